"""The TPU KV kernels (kernels_pallas.tpu.kv_ops) on token-major pages, in interpret mode.

``write_kv_tpu`` (one DMA per token row ``[C, P, Dp]``), ``copy_blocks_tpu`` and
``swap_blocks_tpu`` against pure-numpy oracles on NaN-poisoned caches, compared bit for bit:
untouched slots and blocks keep their bits. Small shapes; the TPU interpreter models the
DMAs and semaphores (late, out-of-order completion), so a missing wait shows up as a stale
value.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas.kv_layout import merge_kv, page_shape, split_kv
from kernels_pallas.tpu.kv_ops import (
    copy_blocks_tpu,
    swap_blocks_tpu,
    write_kv_tpu,
    write_kv_unsupported_reason,
)

DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn]
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(_UINT[x.dtype.itemsize])


def _assert_bits_equal(got, want) -> None:
    chex.assert_shape(got, want.shape)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _values(rng, shape, dtype, nan_fraction=0.0) -> jnp.ndarray:
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-128, 128, shape).astype(np.int8))
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < nan_fraction] = np.nan
    return jnp.asarray(x).astype(dtype)


def _poisoned(rng, shape, dtype) -> jnp.ndarray:
    return _values(rng, shape, dtype, nan_fraction=0.3)


def _np_write(pages, new, slots, layer) -> np.ndarray:
    """Sequential numpy scatter: later tokens overwrite earlier ones; out of range skipped."""
    out = np.array(pages)
    num_layers, n, s, *row = out.shape
    flat = out.reshape(num_layers, n * s, *row)
    for t, slot in enumerate(np.asarray(slots)):
        if 0 <= slot < n * s:
            flat[layer, slot] = np.asarray(new[t])
    return flat.reshape(out.shape)


def _np_copy(dst, src, s_ids, d_ids) -> np.ndarray:
    out, src = np.array(dst), np.asarray(src)
    for s, d in zip(s_ids, d_ids, strict=True):
        if s >= 0 and d >= 0:
            out[:, d] = src[:, s]
    return out


@settings(max_examples=4, deadline=None)  # ~4.5 s each (an interpreted compile per shape)
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(DTYPES),
    num_kv_heads=st.sampled_from([1, 3, 8]),
    block_size=st.sampled_from([8, 16]),
    num_tokens=st.integers(1, 12),
    skip_fraction=st.floats(0.0, 0.5),
    layer=st.integers(0, 1),
)
def test_write_kv_any_distinct_slots_matches_the_scatter(
    seed, dtype, num_kv_heads, block_size, num_tokens, skip_fraction, layer
):
    """Distinct slots anywhere, skipped (-1) and out-of-range (>= N * S) tokens; the written
    rows read back through split_kv as the K and V merged in; every other bit survives."""
    rng = np.random.default_rng(seed)
    n = 3
    shape = page_shape(2, n, block_size, num_kv_heads, 128, dtype)
    pages = _poisoned(rng, shape, dtype)
    k = _values(rng, (num_tokens, num_kv_heads, 128), dtype)
    v = _values(rng, (num_tokens, num_kv_heads, 128), dtype)
    new = merge_kv(k, v)
    slots = rng.choice(n * block_size, num_tokens, replace=False).astype(np.int32)
    slots[rng.random(num_tokens) < skip_fraction] = -1
    if num_tokens > 2:
        slots[1] = n * block_size + 5
    out = write_kv_tpu(
        pages, new, jnp.asarray(slots), jnp.int32(layer), tokens_per_step=4, interpret=True
    )
    _assert_bits_equal(out, _np_write(pages, new, slots, layer))
    live = np.flatnonzero((slots >= 0) & (slots < n * block_size))
    if live.size:
        t = live[0]
        row = out[layer, slots[t] // block_size, slots[t] % block_size]
        got_k, got_v = split_kv(row, num_kv_heads)
        _assert_bits_equal(got_k, np.asarray(k[t]))
        _assert_bits_equal(got_v, np.asarray(v[t]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize(("block_size", "head_dim"), [(32, 64), (128, 128)])
def test_write_kv_large_blocks_and_half_lane_head_dim(dtype, block_size, head_dim):
    """S = 32 / 128 and Dp = 64 (the CPU/GPU layout): a prefill over a whole block and a
    scattered tail, several windows."""
    rng = np.random.default_rng(7)
    shape = page_shape(1, 2, block_size, 2, head_dim, dtype)
    pages = _poisoned(rng, shape, dtype)
    slots = np.concatenate([np.arange(block_size), [-1, 2 * block_size - 1, block_size + 3]])
    slots = slots.astype(np.int32)
    new = _values(rng, (slots.size, *shape[3:]), dtype)
    out = write_kv_tpu(pages, new, jnp.asarray(slots), 0, tokens_per_step=16, interpret=True)
    _assert_bits_equal(out, _np_write(pages, new, slots, 0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
@pytest.mark.parametrize("tokens_per_step", [1, 3, 64])
def test_write_kv_duplicate_slots_last_token_wins(dtype, tokens_per_step):
    """Duplicates in one call resolve to the last token with that slot, whatever the window
    (the interpreter completes DMAs out of order, so without the dedupe this races)."""
    rng = np.random.default_rng(11)
    shape = page_shape(2, 4, 8, 3, 128, dtype)
    pages = _poisoned(rng, shape, dtype)
    slots = np.array([5, 9, 5, 5, -1, 9, 30, 31, 0, 5, 12, 30, 2, 0, 31, 9], np.int32)
    new = _values(rng, (slots.size, *shape[3:]), dtype)
    out = write_kv_tpu(
        pages, new, jnp.asarray(slots), 1, tokens_per_step=tokens_per_step, interpret=True
    )
    _assert_bits_equal(out, _np_write(pages, new, slots, 1))


def test_write_kv_nothing_live_and_no_tokens_leave_the_pages_alone():
    rng = np.random.default_rng(2)
    shape = page_shape(1, 2, 8, 2, 128, jnp.bfloat16)
    pages = _poisoned(rng, shape, jnp.bfloat16)
    new = _values(rng, (5, *shape[3:]), jnp.bfloat16)
    out = write_kv_tpu(pages, new, jnp.full((5,), -1, jnp.int32), 0, interpret=True)
    _assert_bits_equal(out, np.asarray(pages))
    out = write_kv_tpu(pages, new[:0], jnp.zeros((0,), jnp.int32), 0, interpret=True)
    _assert_bits_equal(out, np.asarray(pages))


def test_write_kv_rejects_mismatched_rows():
    pages = jnp.zeros(page_shape(1, 2, 8, 2, 128, jnp.bfloat16), jnp.bfloat16)
    with pytest.raises(ValueError, match="kv_new"):
        write_kv_tpu(pages, jnp.zeros((3, 1, 2, 128), jnp.bfloat16), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="float32"):
        write_kv_tpu(pages, jnp.zeros((3, 2, 2, 128), jnp.float32), jnp.zeros((3,), jnp.int32))


def test_write_kv_unsupported_reason_takes_any_block_size():
    for s in (1, 3, 8, 16, 24, 128):
        for dtype in DTYPES:
            assert write_kv_unsupported_reason(s, dtype) is None
    assert "1, 2 or 4-byte" in write_kv_unsupported_reason(16, jnp.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_every_layer_skips_negative_pairs(dtype):
    rng = np.random.default_rng(5)
    shape = page_shape(3, 10, 8, 3, 128, dtype)
    pages = _poisoned(rng, shape, dtype)
    src = np.array([0, 3, -1, 7, 2, 9, 4], np.int32)
    dst = np.array([5, 1, 2, 6, -1, 8, 0], np.int32)
    out = copy_blocks_tpu(
        pages, jnp.asarray(src), jnp.asarray(dst), pairs_per_step=3, interpret=True
    )
    _assert_bits_equal(out, _np_copy(pages, pages, src, dst))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_swap_blocks_between_two_pools_array_and_tuple(dtype):
    rng = np.random.default_rng(6)
    shape = page_shape(2, 6, 16, 1, 128, dtype)
    device = _poisoned(rng, shape, dtype)
    other = _poisoned(rng, (2, 4, *shape[2:]), dtype)
    s_ids = np.array([5, 0, -1, 3], np.int32)
    d_ids = np.array([3, 0, 1, 2], np.int32)
    out = swap_blocks_tpu(
        device, other, jnp.asarray(s_ids), jnp.asarray(d_ids), pairs_per_step=3, interpret=True
    )
    assert not isinstance(out, tuple)
    _assert_bits_equal(out, _np_copy(other, device, s_ids, d_ids))
    back = swap_blocks_tpu(
        (other,), (device,), jnp.asarray(d_ids), jnp.asarray(s_ids), interpret=True
    )
    assert isinstance(back, tuple) and len(back) == 1
    _assert_bits_equal(back[0], _np_copy(device, other, d_ids, s_ids))
