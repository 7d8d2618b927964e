"""A step's inputs packed into one transfer (``paxcache.packing``): unpacking gives back every
leaf bit for bit, and the host and the device pack alike. (Every engine test runs its steps on
packed inputs: ``Engine._place_inputs``.)"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxcache import packing
from paxcache import step as step_lib
from paxcache.step import StepShapes


def _random_leaves(inputs, seed: int):
    """``inputs`` with every leaf refilled with random bits of its dtype (NaN payloads and
    negative zeros included: a float must come back as the same 32 bits)."""
    rng = np.random.default_rng(seed)

    def fill(x):
        x = np.asarray(x)
        if x.dtype == np.bool_:
            return rng.integers(0, 2, x.shape).astype(bool)
        bits = rng.integers(-(2**31), 2**31, x.shape, dtype=np.int64).astype(np.int32)
        return bits.view(x.dtype)

    return jax.tree.map(fill, inputs)


def _bits(tree):
    def as_bits(x):
        x = np.asarray(x)
        return x.astype(np.int32) if x.dtype == np.bool_ else x.view(np.int32)

    return jax.tree.map(as_bits, tree)


VARIANTS = [
    dict(),
    dict(decode=True),
    dict(masked=True),
    dict(prompt_logprobs=True),
    dict(loop=True),
    dict(loop=True, decode=True),
]


@settings(max_examples=12, deadline=None)
@given(
    variant=st.sampled_from(VARIANTS),
    rows=st.integers(1, 9),
    bucket=st.sampled_from([8, 16, 32]),
    steps=st.integers(2, 5),
    rope=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_unpacking_gives_back_every_leaf_bit_for_bit(variant, rows, bucket, steps, rope, seed):
    shapes = StepShapes(
        buckets=(bucket,), max_rows=rows, vocab_size=70, decode_steps=steps, rope_lens=rope
    )
    inputs = step_lib.empty_inputs(shapes, bucket, **variant)
    if rope:
        inputs = inputs.replace(rope_lens=inputs.kv_lens)
    inputs = _random_leaves(inputs, seed)
    packed = packing.pack(inputs)
    assert isinstance(packed.words, np.ndarray) and packed.words.dtype == np.int32
    assert packed.words.shape == (packed.layout.num_words,)
    back = jax.jit(packing.PackedInputs.unpack)(packed)  # one program, not an op per leaf
    assert jax.tree.structure(back) == jax.tree.structure(inputs)
    chex.assert_trees_all_equal(_bits(back), _bits(inputs))
    chex.assert_trees_all_equal_shapes_and_dtypes(packed.structure(), inputs)


def test_host_and_device_pack_to_the_same_layout_and_words():
    shapes = StepShapes(buckets=(16,), max_rows=5, vocab_size=70, decode_steps=3)
    inputs = _random_leaves(step_lib.empty_inputs(shapes, 16, loop=True), 7)
    host = packing.pack(inputs)
    device = jax.jit(packing.pack)(inputs)  # traced leaves: packed with jax ops
    assert device.layout == host.layout
    np.testing.assert_array_equal(np.asarray(device.words), host.words)
    # The layout is static: a program compiled for one form runs the other.
    assert jax.tree.structure(device) == jax.tree.structure(host)


def test_token_ids_and_the_bitmask_are_not_copied_into_the_words():
    shapes = StepShapes(buckets=(16,), max_rows=3, vocab_size=200)
    inputs = step_lib.empty_inputs(shapes, 16, masked=True)
    tokens_on_device = jnp.arange(16, dtype=jnp.int32)  # a continuation's gathered tokens
    packed = packing.pack(inputs.replace(token_ids=tokens_on_device))
    assert packed.token_ids is tokens_on_device
    assert packed.allowed is inputs.allowed
    assert isinstance(packed.words, np.ndarray)  # the rest still packs on the host


def test_a_leaf_that_is_not_32_bits_is_refused_naming_it():
    shapes = StepShapes(buckets=(16,), max_rows=3, vocab_size=70)
    inputs = step_lib.empty_inputs(shapes, 16)
    bad = inputs.replace(kv_lens=np.zeros(3, np.int64))
    with pytest.raises(TypeError, match="kv_lens.*int64"):
        packing.pack(bad)
