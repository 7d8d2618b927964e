"""The TPU page layout for a head_dim that is not a multiple of 128, run on the CPU.

On TPU the cache stores such a head_dim padded to 128 lanes (``kp.stored_head_dim``), because
XLA:TPU otherwise keeps a ``[..., S, 64]`` cache in a transposed layout and copies all of it
around the Mosaic kernels every step (the deviceless compile check is in
``tests/test_tpu_compile.py``). ``init_kv_cache(..., platform="tpu")`` builds that layout
here, so every op can be checked against the same writes into an unpadded cache: the ops
take and return D, never the stored lanes; NaN-poisoned unwritten slots stay unread; the
engine's greedy tokens do not change.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp

L, N, S, K, H, D = 2, 16, 4, 2, 4, 8
NAN = float("nan")


def _caches(dtype=jnp.float32, **kw) -> tuple[kp.PagedKVCache, kp.PagedKVCache]:
    """The same empty cache in the CPU layout and in the TPU layout, NaN-poisoned."""
    plain = kp.init_kv_cache(L, N, S, K, D, dtype, fill_value=NAN, platform="cpu", **kw)
    padded = kp.init_kv_cache(L, N, S, K, D, dtype, fill_value=NAN, platform="tpu", **kw)
    return plain, padded


def _kv(rng, t: int) -> tuple[jax.Array, jax.Array]:
    return (
        jnp.asarray(rng.uniform(-1, 1, (t, K, D)), jnp.float32),
        jnp.asarray(rng.uniform(-1, 1, (t, K, D)), jnp.float32),
    )


@pytest.mark.parametrize(
    ("head_dim", "platform", "stored"),
    [(64, "tpu", 128), (128, "tpu", 128), (192, "tpu", 256), (8, "tpu", 128), (64, "cpu", 64),
     (64, "cuda", 64), (80, "cuda", 80)],
)  # fmt: skip
def test_stored_head_dim_pads_to_128_lanes_on_tpu_only(head_dim, platform, stored):
    assert kp.stored_head_dim(head_dim, platform) == stored
    per_block = kp.kv_cache_bytes_per_block(3, 16, 2, head_dim, jnp.bfloat16, platform=platform)
    assert per_block == 2 * 3 * 2 * 16 * stored * 2
    shape = kp.kv_cache_shape(3, 10, 16, 2, head_dim, jnp.bfloat16, platform=platform)
    assert shape.kv.shape == (3, 10, 16, 2, 2, stored) and shape.head_dim == head_dim
    specs = kp.kv_cache_specs("tp", like=shape)
    assert jax.tree.structure(specs) == jax.tree.structure(shape)


def test_a_lane_padded_cache_takes_and_returns_its_own_head_dim():
    rng = np.random.default_rng(0)
    plain, padded = _caches()
    assert padded.kv.shape[-1] == 128 and padded.head_dim == D and padded.stored_head_dim == 128
    k, v = _kv(rng, 10)
    slots = jnp.asarray(rng.permutation(N * S)[:10], jnp.int32)
    padded = kp.write_kv(padded, k, v, slots, layer=1)
    rk, rv = kp.read_kv(padded, slots, layer=1)
    chex.assert_trees_all_equal((rk, rv), (k, v))
    # The written rows' extra lanes are zeros (a query's zero lanes then add nothing).
    blk, off = np.asarray(slots) // S, np.asarray(slots) % S
    np.testing.assert_array_equal(np.asarray(padded.kv[1][blk, off][..., D:]), 0.0)
    with pytest.raises(ValueError, match="D=8"):
        kp.paged_attention(jnp.zeros((1, H, 128)), padded, jnp.ones(1, jnp.int32),
                           jnp.zeros((1, 2), jnp.int32), layer=0)  # fmt: skip


@pytest.mark.parametrize(
    ("impl", "interpret"),
    [("reference", False), ("auto", False), ("pallas_tpu", True)],
)
def test_attention_on_lane_padded_pages_equals_the_unpadded_cache(impl, interpret):
    """Decode and ragged (fused write, a prefix-hit chunk, a decode, a copied block) on
    NaN-poisoned caches: the padded layout gives the unpadded one's outputs."""
    rng = np.random.default_rng(1)
    kv_lens = np.asarray([11, 6, 1], np.int32)
    q_lens = np.asarray([3, 1, 1], np.int32)
    tables = np.asarray([[3, 7, 9, -1], [2, 12, -1, -1], [5, -1, -1, -1]], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    slots_old, slots_new = [], []
    for b, (n, q) in enumerate(zip(kv_lens, q_lens, strict=True)):
        pos = [tables[b, p // S] * S + p % S for p in range(n)]
        slots_old += pos[: n - q]
        slots_new += pos[n - q :]
    t = int(cu[-1])
    k_old, v_old = _kv(rng, len(slots_old))
    k_new, v_new = _kv(rng, t)
    q = jnp.asarray(rng.standard_normal((t + 2, H, D)), jnp.float32)
    dq = jnp.asarray(rng.standard_normal((3, H, D)), jnp.float32)
    outs = []
    for cache in _caches():
        cache = kp.write_kv(cache, k_old, v_old, jnp.asarray(slots_old, jnp.int32), layer=0)
        rows = ((0, 2), (0, 0), (0, 0))  # two padding rows, slot -1: skipped
        slots = jnp.concatenate([jnp.asarray(slots_new, jnp.int32), jnp.full((2,), -1, jnp.int32)])
        new_kv = (jnp.pad(k_new, rows), jnp.pad(v_new, rows), slots)
        out, cache = kp.ragged_paged_attention(
            q, cache, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), 3, layer=0,
            new_kv=new_kv, impl=impl, interpret=interpret,
        )  # fmt: skip
        cache = kp.copy_blocks(cache, jnp.asarray([7]), jnp.asarray([14]))
        dec_tables = tables.copy()
        dec_tables[0, 1] = 14
        dec = kp.paged_attention(
            dq, cache, jnp.asarray(kv_lens), jnp.asarray(dec_tables), layer=0, impl=impl,
            interpret=interpret, sliding_window=5,
        )  # fmt: skip
        outs.append((out, dec))
    (out, dec), (pout, pdec) = outs
    assert pout.shape == out.shape == (t + 2, H, D) and pdec.shape == (3, H, D)
    assert np.isfinite(np.asarray(out[:t])).all() and np.isfinite(np.asarray(dec)).all()
    chex.assert_trees_all_close((pout, pdec), (out, dec), atol=1e-5, rtol=1e-5)


def test_lane_padded_8bit_pages_swap_to_the_host_and_back_exactly():
    rng = np.random.default_rng(2)
    scales = dict(k_scale=np.float32(1 / 100), v_scale=np.float32(1 / 90))
    device = kp.init_kv_cache(L, N, S, K, D, jnp.int8, platform="tpu", **scales)
    host_sharding = jax.sharding.make_single_device_sharding(
        jax.devices()[0], memory_kind="pinned_host"
    )
    host = kp.init_kv_cache(L, 4, S, K, D, jnp.int8, platform="tpu", sharding=host_sharding,
                            **scales)  # fmt: skip
    k, v = _kv(rng, S)
    device = kp.write_kv(device, k, v, jnp.arange(S, dtype=jnp.int32) + 6 * S, layer=1)
    host = kp.swap_blocks(device, host, jnp.asarray([6]), jnp.asarray([2]))
    back = kp.swap_blocks(host, kp.init_kv_cache(L, N, S, K, D, jnp.int8, platform="tpu", **scales),
                          jnp.asarray([2]), jnp.asarray([0]))  # fmt: skip
    got = kp.read_kv(back, jnp.arange(S, dtype=jnp.int32), layer=1)
    want = kp.read_kv(device, jnp.arange(S, dtype=jnp.int32) + 6 * S, layer=1)
    chex.assert_trees_all_equal(got, want)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(k), atol=1 / 100)


def test_engine_greedy_tokens_do_not_change_with_the_tpu_page_layout():
    """The tiny test Llama (head_dim 16) with its cache in the TPU layout (128 lanes) gives
    the CPU layout's greedy tokens through chunked prefill, decode and a prefix hit."""
    from tiny_models import byte_llama

    from paxcache import Engine, SamplingParams, kv_cache
    from paxcache.models.tokenizer import ByteTokenizer
    from paxcache.placement import Placement

    class TpuPages(Placement):
        def create_kv(self, mesh, **dims):
            assert mesh is None
            return kv_cache.KVCache.create(**dims, platform="tpu")

    model = byte_llama(jnp.float32)
    prompts = ["the paged cache", "the paged cache holds", "abc"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    limits = dict(max_num_seqs=3, max_num_batched_tokens=8, num_blocks=32, block_size=4,
                  warmup=False, async_scheduling=False, decode_steps=1)  # fmt: skip
    want = [o.outputs[0].token_ids for o in Engine(model, ByteTokenizer(), **limits).generate(
        prompts, params)]  # fmt: skip
    engine = Engine(model, ByteTokenizer(), placement=TpuPages(), **limits)
    assert engine._kv.device.stored_head_dim == 128 != engine._kv.device.head_dim
    outs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[1].num_cached_tokens > 0
