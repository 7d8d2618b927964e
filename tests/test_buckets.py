"""The one power-of-two bucket rule (kernels_pallas.buckets) and the sizes built on it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernels_pallas import kv_ops
from kernels_pallas.buckets import next_power_of_two, power_of_two_buckets
from paxcache import kv_cache


def test_next_power_of_two_rounds_up_to_at_least_the_minimum():
    assert [next_power_of_two(n) for n in (-3, 0, 1, 2, 3, 4, 5, 17)] == [1, 1, 1, 2, 4, 4, 8, 32]
    assert [next_power_of_two(n, minimum=16) for n in (1, 15, 16, 17)] == [16, 16, 16, 32]
    assert next_power_of_two(3, minimum=5) == 8  # the minimum is a bucket only when a power
    with pytest.raises(ValueError, match="minimum must be >= 1"):
        next_power_of_two(3, minimum=0)


def test_buckets_double_from_the_smallest_and_end_at_the_largest():
    assert power_of_two_buckets(100, 16) == (16, 32, 64, 100)
    assert power_of_two_buckets(64, 16) == (16, 32, 64)
    assert power_of_two_buckets(10, 16) == (10,)
    assert power_of_two_buckets(8) == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="must be >= 1"):
        power_of_two_buckets(0)


@given(largest=st.integers(1, 5000), smallest=st.sampled_from([1, 2, 16, 64]))
def test_every_size_pads_to_less_than_twice_itself(largest, smallest):
    buckets = power_of_two_buckets(largest, smallest)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == largest
    for n in range(1, largest + 1, max(1, largest // 97)):
        padded = next(b for b in buckets if b >= n)
        assert padded < 2 * max(n, smallest)


def test_swap_pair_buckets_use_the_shared_rule():
    assert kv_ops.bucket_size(5) == next_power_of_two(5) == 8
    assert kv_cache.swap_buckets(5) == (1, 2, 4, 8)
    assert kv_cache.swap_buckets(0) == (1,)
