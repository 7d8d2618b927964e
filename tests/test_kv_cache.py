"""KVCache: creation, per-layer writes under lax.scan, copy-on-write, swapping, sizing, and
the allocator's swap plans carried out on real pages."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.kv_layout import merge_kv, split_kv
from kernels_pallas.reference import paged_attention_reference
from paxcache import kv_cache
from paxcache.kv_cache import KVCache

L, K, D, N, S, NH = 2, 2, 16, 16, 4, 8


def _cache(dtype=jnp.float32, num_host_blocks=NH, fill_value=float("nan")) -> KVCache:
    return KVCache.create(L, K, D, N, S, dtype, num_host_blocks, fill_value=fill_value)


def _k(pages) -> jax.Array:
    """A ``PagedKVCache``'s keys, head-major ``[L, K, N, S, D]`` (for indexing in tests)."""
    return jnp.moveaxis(split_kv(pages.kv, pages.num_kv_heads)[0], 3, 1)


def _v(pages) -> jax.Array:
    """Its values, ``[L, K, N, S, D]``."""
    return jnp.moveaxis(split_kv(pages.kv, pages.num_kv_heads)[1], 3, 1)


def _with_pages(cache: KVCache, k, v) -> KVCache:
    """The cache with its device pages replaced by head-major ``k, v [L, K, N, S, D]`` (tests
    that plant known data)."""
    kv = merge_kv(jnp.moveaxis(k, 1, 3), jnp.moveaxis(v, 1, 3))
    return cache.replace(device=cache.device.replace(kv=kv))


def _bits(x) -> np.ndarray:
    """Raw bytes of an array, so NaN == NaN and -0.0 != 0.0 (bit-exact comparisons)."""
    return np.asarray(x).view(np.uint8)


def test_create_allocates_stacked_device_pages_and_pinned_host_pool():
    cache = _cache(jnp.bfloat16)
    chex.assert_shape([_k(cache.device), _v(cache.device)], (L, K, N, S, D))
    chex.assert_shape([_k(cache.host), _v(cache.host)], (L, K, NH, S, D))
    assert cache.device.kv.dtype == cache.host.kv.dtype == jnp.bfloat16
    assert cache.device.kv.sharding.memory_kind == "device"
    assert cache.host.kv.sharding.memory_kind == "pinned_host"
    assert cache.host.kv.sharding.memory_kind == "pinned_host"
    assert bool(jnp.isnan(_k(cache.device).astype(jnp.float32)).all())
    assert (cache.num_layers, cache.num_kv_heads, cache.num_blocks) == (L, K, N)
    assert (cache.block_size, cache.head_dim, cache.num_host_blocks) == (S, D, NH)
    assert cache.bytes_per_block == 2 * L * K * S * D * 2


def test_create_without_host_blocks_has_no_pool_and_refuses_swaps():
    cache = _cache(num_host_blocks=0, fill_value=0.0)
    assert cache.host is None and cache.num_host_blocks == 0
    assert not bool(_k(cache.device).any())
    with pytest.raises(ValueError, match="no host pool"):
        kv_cache.swap_out(cache, np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="no host pool"):
        kv_cache.swap_in(cache, np.array([0]), np.array([0]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(block_size=-1), "block_size"),
        (dict(num_host_blocks=-2), "num_host_blocks"),
        (dict(head_dim=2.0), "head_dim"),
    ],
)
def test_create_bad_dimensions_raise_value_error(kwargs, match):
    args = dict(num_layers=L, num_kv_heads=K, head_dim=D, num_blocks=N, block_size=S)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVCache.create(**args)


def test_cache_is_a_pytree_that_jit_donates_and_returns():
    cache = _cache(fill_value=0.0)
    leaves = jax.tree_util.tree_leaves(cache)
    # device pages and host pool: the pages and their per-layer K and V scales each
    assert len(leaves) == len(jax.tree_util.tree_leaves(cache.device)) * 2 == 6
    out = jax.jit(lambda c: c, donate_argnums=0)(cache)
    assert isinstance(out, KVCache)


def test_write_layer_under_scan_writes_each_layer_in_place():
    cache = _cache()
    rng = np.random.default_rng(0)
    t = 6
    new_k = jnp.asarray(rng.standard_normal((L, t, K, D)), jnp.float32)
    new_v = new_k + 100.0
    slots = np.array([0, 5, -1, 17, 30, 63], np.int32)

    @jax.jit
    def step(cache, new_k, new_v, slots):
        def body(c, xs):
            layer, k, v = xs
            return kv_cache.write_layer(c, layer, k, v, slots), None

        return jax.lax.scan(body, cache, (jnp.arange(L), new_k, new_v))[0]

    out = jax.jit(step, donate_argnums=0)(cache, new_k, new_v, jnp.asarray(slots))
    for layer in range(L):
        for i, slot in enumerate(slots):
            if slot < 0:
                continue
            np.testing.assert_array_equal(
                _k(out.device)[layer, :, slot // S, slot % S], new_k[layer, i]
            )
            np.testing.assert_array_equal(
                _v(out.device)[layer, :, slot // S, slot % S], new_v[layer, i]
            )
    written = int((~jnp.isnan(_k(out.device))).sum())
    assert written == L * 5 * K * D  # nothing else touched (the rest is still NaN)


def test_apply_copies_copies_every_layer_and_skips_padding():
    cache = _cache(fill_value=0.0)
    ramp = jnp.arange(np.prod(_k(cache.device).shape), dtype=jnp.float32).reshape(
        _k(cache.device).shape
    )
    cache = _with_pages(cache, ramp, -ramp)
    src = jnp.array([2, 7, -1, -1], jnp.int32)
    dst = jnp.array([9, 3, -1, -1], jnp.int32)
    out = jax.jit(kv_cache.apply_copies)(cache, src, dst)
    np.testing.assert_array_equal(_k(out.device)[:, :, 9], ramp[:, :, 2])
    np.testing.assert_array_equal(_v(out.device)[:, :, 3], -ramp[:, :, 7])
    untouched = [i for i in range(N) if i not in (9, 3)]
    np.testing.assert_array_equal(_k(out.device)[:, :, untouched], ramp[:, :, untouched])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_swap_out_then_in_to_other_blocks_is_bit_exact(dtype):
    cache = _cache(dtype)
    rng = np.random.default_rng(1)
    data = jnp.asarray(rng.standard_normal(_k(cache.device).shape), dtype)
    cache = _with_pages(cache, data, -data)
    plan_src = np.array([4, 11, 0, -1, -1, -1], np.int32)  # padded like an allocator plan
    plan_dst = np.array([6, 1, 3, -1, -1, -1], np.int32)
    cache = kv_cache.swap_out(cache, plan_src, plan_dst, num=3)
    assert cache.host.kv.sharding.memory_kind == "pinned_host"
    assert cache.host.kv.sharding.memory_kind == "pinned_host"
    for s_, d_ in [(4, 6), (11, 1), (0, 3)]:
        assert (_bits(_k(cache.host)[:, :, d_]) == _bits(data[:, :, s_])).all()
        assert (_bits(_v(cache.host)[:, :, d_]) == _bits(-data[:, :, s_])).all()
    assert bool(jnp.isnan(_k(cache.host)[:, :, 0].astype(jnp.float32)).all())  # not in the plan

    cache = _with_pages(
        cache, jnp.full_like(_k(cache.device), jnp.nan), jnp.full_like(_v(cache.device), jnp.nan)
    )
    cache = kv_cache.swap_in(cache, jnp.array([6, 1, 3, -1]), jnp.array([13, 14, 15, -1]))
    assert cache.device.kv.sharding.memory_kind == "device"
    for s_, d_ in [(4, 13), (11, 14), (0, 15)]:
        assert (_bits(_k(cache.device)[:, :, d_]) == _bits(data[:, :, s_])).all()
        assert (_bits(_v(cache.device)[:, :, d_]) == _bits(-data[:, :, s_])).all()


def test_swap_plan_num_out_of_range_raises():
    with pytest.raises(ValueError, match="num=7"):
        kv_cache.swap_out(_cache(), np.array([0, 1]), np.array([0, 1]), num=7)


# --------------------------------------------------------------------------------------------
# Sizing
# --------------------------------------------------------------------------------------------


class _FakeDevice:
    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_num_blocks_for_budget_in_bytes():
    n, per_block = kv_cache.num_blocks_for_budget(1 << 30, 32, 8, 128, 16, jnp.bfloat16)
    assert per_block == 2 * 32 * 8 * 16 * 128 * 2  # 2 MiB per block for a Llama-3-8B shape
    assert n == (1 << 30) // per_block == 512


def test_num_blocks_for_budget_fraction_of_free_device_memory():
    dev = _FakeDevice({"bytes_limit": 10 << 30, "bytes_in_use": 2 << 30})
    n, per_block = kv_cache.num_blocks_for_budget(0.5, 32, 8, 128, 16, jnp.bfloat16, dev)
    assert n == (4 << 30) // per_block


def test_num_blocks_for_budget_bad_budgets_raise():
    with pytest.raises(ValueError, match="memory stats"):
        kv_cache.num_blocks_for_budget(0.9, L, K, D, S, jnp.float32, _FakeDevice(None))
    with pytest.raises(ValueError, match="fraction"):
        kv_cache.num_blocks_for_budget(1.5, L, K, D, S, jnp.float32)
    with pytest.raises(ValueError, match="positive"):
        kv_cache.num_blocks_for_budget(0, L, K, D, S, jnp.float32)
    with pytest.raises(ValueError, match="holds no block"):
        kv_cache.num_blocks_for_budget(100, L, K, D, S, jnp.float32)
    with pytest.raises(ValueError, match="bytes"):
        kv_cache.num_blocks_for_budget("1GB", L, K, D, S, jnp.float32)


def test_host_memory_kind_is_pinned_host_on_cpu():
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert "pinned_host" in kinds
    assert kv_cache.host_memory_kind() == "pinned_host"


# --------------------------------------------------------------------------------------------
# With the allocator
# --------------------------------------------------------------------------------------------


def _slot_mapping(table: np.ndarray, start: int, stop: int) -> np.ndarray:
    pos = np.arange(start, stop)
    return (table[pos // S] * S + pos % S).astype(np.int32)


_T_PAD = 16  # every fill is padded to 16 tokens (slot -1) so write_layer compiles once
_write_layer = jax.jit(kv_cache.write_layer)


def _fill_sequence(cache: KVCache, table: np.ndarray, length: int, rng) -> KVCache:
    slots = np.full(_T_PAD, -1, np.int32)
    slots[:length] = _slot_mapping(table, 0, length)
    for layer in range(L):
        k = jnp.asarray(rng.standard_normal((_T_PAD, K, D)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((_T_PAD, K, D)), jnp.float32)
        cache = _write_layer(cache, layer, k, v, jnp.asarray(slots))
    return cache


@jax.jit
def _decode_attention(cache: KVCache, q, lengths, tables) -> list[jax.Array]:
    return [
        paged_attention_reference(q, cache.device.kv[layer], lengths, tables) for layer in range(L)
    ]


def test_allocator_swap_plans_move_the_sequence_and_attention_is_unchanged():
    allocator = pytest.importorskip("paxcache.allocator")
    from paxcache.config import CacheConfig

    cfg = CacheConfig(
        num_blocks=N,
        block_size=S,
        max_seqs=4,
        max_blocks_per_seq=4,
        num_host_blocks=NH,
        watermark=0.0,
        enable_prefix_caching=False,
    )
    rng = np.random.default_rng(2)
    allocate = jax.jit(allocator.allocate)
    state = allocator.init(cfg)
    lens = {0: 10, 1: 6}
    for slot, n_tok in lens.items():
        tokens = jnp.asarray(rng.integers(0, 100, cfg.max_blocks_per_seq * S), jnp.int32)
        state, res = allocate(state, slot, tokens, n_tok)
        assert bool(res.ok)
    tables = np.asarray(state.block_tables)
    cache = _cache()  # NaN everywhere: attention must read only written slots
    for slot, n_tok in lens.items():
        cache = _fill_sequence(cache, tables[slot], n_tok, rng)

    q = jnp.asarray(rng.standard_normal((2, 4, D)), jnp.float32)  # GQA: 4 query heads, K=2
    lengths = jnp.array([lens[0], lens[1]], jnp.int32)
    before = _decode_attention(cache, q, lengths, jnp.asarray(tables[:2]))
    assert all(bool(jnp.isfinite(o).all()) for o in before)

    # Swap slot 0 out: the plan moves exactly its 3 blocks.
    seq_blocks = tables[0][tables[0] >= 0]
    state, plan = jax.jit(allocator.swap_out)(state, jnp.array([True, False, False, False]))
    num = int(plan.num)
    assert num == len(seq_blocks) == 3
    assert sorted(np.asarray(plan.src)[:num].tolist()) == sorted(seq_blocks.tolist())
    assert (np.asarray(plan.src)[num:] == -1).all()
    cache = kv_cache.swap_out(cache, plan.src, plan.dst, plan.num)
    for d_blk, h_blk in zip(np.asarray(plan.src)[:num], np.asarray(plan.dst)[:num], strict=True):
        assert (_bits(_k(cache.host)[:, :, h_blk]) == _bits(_k(cache.device)[:, :, d_blk])).all()
        assert (_bits(_v(cache.host)[:, :, h_blk]) == _bits(_v(cache.device)[:, :, d_blk])).all()

    # Another sequence takes the freed device blocks and overwrites them.
    tokens = jnp.asarray(rng.integers(0, 100, cfg.max_blocks_per_seq * S), jnp.int32)
    state, res = allocate(state, 2, tokens, 12)
    assert bool(res.ok)
    cache = _fill_sequence(cache, np.asarray(state.block_tables)[2], 12, rng)

    # Swap slot 0 back in: it lands in different device blocks.
    state, plan = jax.jit(allocator.swap_in)(state, jnp.array([True, False, False, False]))
    assert int(plan.num) == 3
    cache = kv_cache.swap_in(cache, plan.src, plan.dst, plan.num)
    new_tables = np.asarray(state.block_tables)
    assert not set(new_tables[0][:3].tolist()) & set(seq_blocks.tolist())
    checks = jax.jit(allocator.check_invariants)(state)
    assert all(bool(v) for v in checks.values()), checks

    after = _decode_attention(cache, q, lengths, jnp.asarray(new_tables[:2]))
    for a, b in zip(after, before, strict=True):
        assert (_bits(a) == _bits(b)).all()


_TP_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from paxcache import kv_cache
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
sh = NamedSharding(mesh, P(None, None, None, "tp"))
variants = [("direct", "loop"), ("loop", "loop"), ("scatter", "scatter")][: int(sys.argv[1])]
for swap_moves, copy_moves in variants:
    c = kv_cache.KVCache.create(2, 4, 16, 8, 4, jnp.float32, num_host_blocks=6, sharding=sh)
    assert c.host.kv.sharding.spec == P(None, None, None, "tp"), c.host.kv.sharding
    k = jnp.arange(3 * 4 * 16, dtype=jnp.float32).reshape(3, 4, 16)
    c = jax.jit(kv_cache.write_layer, donate_argnums=0)(c, 1, k, k, jnp.array([0, 5, 9]))
    c = kv_cache.apply_copies(c, np.array([1]), np.array([6]), xla_moves=copy_moves)
    c = kv_cache.swap_out(c, np.array([0, 2, 6]), np.array([5, 4, 0]), xla_moves=swap_moves)
    assert c.host.kv.sharding.memory_kind == "pinned_host"
    assert c.host.kv.sharding.spec == P(None, None, None, "tp")
    assert np.asarray(c.host.kv)[1, 5, 0, 4, 0, 3] == k[0, 2, 3]  # head 2 K: row 4
    c = c.replace(device=c.device.replace(kv=jnp.zeros_like(c.device.kv)))
    c = kv_cache.swap_in(c, np.array([5, 0]), np.array([7, 3]), xla_moves=swap_moves)
    assert c.device.kv.sharding.spec == P(None, None, None, "tp")
    assert np.asarray(c.device.kv)[1, 3, 1, 6, 0, 3] == k[1, 3, 3]  # head 3 K: row 6
print("OK")
"""


@pytest.mark.parametrize(
    "num_variants",
    [1, pytest.param(3, marks=pytest.mark.slow)],
    ids=["cpu-default-program", "all-swap-programs"],
)
def test_kv_head_sharded_cache_writes_copies_and_swaps_on_two_devices(num_variants):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _TP_SCRIPT, str(num_variants)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
