"""KV movement on page arrays (``kernels_pallas.kv_ops``: write_pages, copy_pages, swap_pages,
the implementations behind the cache ops write_kv, copy_blocks, swap_blocks) against numpy,
and the token-major page layout itself (``kernels_pallas.kv_layout``: merge_kv / split_kv).

Every op runs through the XLA/reference path, ``impl="auto"`` and the Pallas TPU kernels in
interpret mode, in f32 and bf16, for several head dims and block sizes, on stacked
``[L, N, S, C, P, D]`` pages (one layer: ``L = 1``); new tokens are ``[T, C, P, D]`` rows
merged from ``[T, K, D]`` K and V with ``merge_kv``. The in-place checks also run on the
public ``PagedKVCache`` ops (the cache in a scan carry, donated); the public contract itself
is tests/test_kv_cache_api.py.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import make_single_device_sharding

import kernels_pallas as kp
from kernels_pallas import _dispatch, kv_ops, reference
from kernels_pallas.kv_layout import (
    combined_rows,
    kv_head_pad,
    kv_packing,
    kv_row,
    merge_kv,
    num_kv_heads_of,
    page_shape,
    split_kv,
)

# (impl, interpret): the XLA path, auto, and the Pallas TPU kernels in interpret mode
# ("pallas_gpu" is the XLA path: there are no Mosaic GPU KV kernels, see kernels_pallas.kv_ops).
IMPLS = [
    pytest.param("reference", False, id="reference"),
    pytest.param("auto", False, id="auto"),
    pytest.param("pallas_tpu", True, id="pallas_tpu-interpret"),
]
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]
# (K, S, D): kv heads, block size, head dim.
GEOMS = [pytest.param((2, 4, 16), id="K2-S4-D16"), pytest.param((1, 16, 128), id="K1-S16-D128")]


def _pages(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


def _kv_pages(rng, layers, n, kh, s, d, dtype):
    """Random ``[L, N, S, C, P, D]`` pages of K kv heads."""
    return _pages(rng, page_shape(layers, n, s, kh, d, dtype), dtype)


def _new_rows(rng, t, kh, d, dtype):
    """T new tokens' random K and V ``[T, K, D]`` and their merged ``[T, C, P, D]`` rows."""
    k, v = _pages(rng, (t, kh, d), dtype), _pages(rng, (t, kh, d), dtype)
    return k, v, merge_kv(k, v)


def _host(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32))


def _pinned(x):
    return jax.device_put(
        x, make_single_device_sharding(jax.devices()[0], memory_kind="pinned_host")
    )


# --------------------------------------------------------------------------------------------
# The layout: merge_kv / split_kv
# --------------------------------------------------------------------------------------------

LAYOUT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn]


@jax.jit
def _round_trip(k, v):
    kv = merge_kv(k, v)
    return (kv, *split_kv(kv, k.shape[-2]))  # one program per shape: eager ops compile each


@settings(max_examples=12, deadline=None)  # + the 3 examples below; ~0.8 s each
@given(
    dtype=st.sampled_from(LAYOUT_DTYPES),
    kh=st.integers(1, 8),
    lead=st.sampled_from([(), (3,), (2, 2)]),
    d=st.sampled_from([8, 128]),
    seed=st.integers(0, 2**31 - 1),
)
@example(dtype=jnp.int8, kh=3, lead=(3,), d=8, seed=0)  # odd K, 8-bit: a dummy head
@example(dtype=jnp.float8_e4m3fn, kh=1, lead=(), d=128, seed=1)
@example(dtype=jnp.bfloat16, kh=5, lead=(2, 2), d=8, seed=2)  # odd K, 16-bit: no dummy
def test_merge_split_round_trip_puts_each_head_where_the_layout_says(dtype, kh, lead, d, seed):
    """``split_kv(merge_kv(k, v), K)`` gives back ``k`` and ``v`` bit for bit, for every cache
    dtype and K = 1..8: the merged rows are ``[..., C, P, D]`` with ``P`` heads per 32-bit word
    and ``C = ceil(2K / P)``; kv head ``h``'s K is combined head ``2h`` and its V ``2h + 1``
    (at ``kv_row``); an odd K in an 8-bit cache pads one zero dummy head (``kv_head_pad``)."""
    rng = np.random.default_rng(seed)
    shape = (*lead, kh, d)
    if jnp.issubdtype(dtype, jnp.integer):
        k, v = (jnp.asarray(rng.integers(-128, 128, shape), dtype) for _ in range(2))
    else:
        k, v = (jnp.asarray(rng.standard_normal(shape) * 4, dtype) for _ in range(2))
    kv, k2, v2 = _round_trip(k, v)
    p = kv_packing(dtype)
    c = combined_rows(kh, dtype)
    assert p == 4 // jnp.dtype(dtype).itemsize and c == -(-2 * kh // p)
    chex.assert_shape(kv, (*lead, c, p, d))
    assert kv.dtype == dtype
    pad = kv_head_pad(kh, dtype)
    assert pad == (1 if p == 4 and kh % 2 else 0) and c * p == 2 * (kh + pad)
    assert num_kv_heads_of(kv, pad) == kh
    bits = np.asarray(kv).view(np.uint8).reshape(*lead, c * p, -1)  # [..., combined head, bytes]
    kb = np.asarray(k).view(np.uint8).reshape(*lead, kh, -1)
    vb = np.asarray(v).view(np.uint8).reshape(*lead, kh, -1)
    for h in range(kh):
        for value, want in ((False, kb), (True, vb)):
            row, j = kv_row(h, value, p)
            assert row * p + j == 2 * h + int(value)
            np.testing.assert_array_equal(bits[..., row * p + j, :], want[..., h, :])
    np.testing.assert_array_equal(bits[..., 2 * kh :, :], 0)  # the dummy head: zeros
    assert k2.dtype == v2.dtype == dtype
    for got, want in ((k2, k), (v2, v)):
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
        )


def test_merge_kv_refuses_k_and_v_that_differ():
    k = jnp.zeros((3, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="k and v must match"):
        merge_kv(k, k[:, :1])
    with pytest.raises(ValueError, match="k and v must match"):
        merge_kv(k, k.astype(jnp.bfloat16))


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------


def _np_write(pages: np.ndarray, new: np.ndarray, slots: np.ndarray, layer: int) -> np.ndarray:
    """``pages [L, N, S, C, P, D]`` with ``new [T, C, P, D]`` written to ``layer``."""
    out = pages.copy()
    s = pages.shape[2]
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[layer, slot // s, slot % s] = new[t]
    return out


def _impl_geom_grid():
    """Every impl on the small geometry; the interpreters' big geometry runs in the slow set."""
    out = []
    for impl in IMPLS:
        for geom in GEOMS:
            slow = impl.values[1] and geom.id != "K2-S4-D16"
            marks = [pytest.mark.slow] if slow else []
            out.append(
                pytest.param(*impl.values, geom.values[0], id=f"{impl.id}-{geom.id}", marks=marks)
            )
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl,interpret,geom", _impl_geom_grid())
def test_write_kv_random_distinct_slots_and_skips_match_numpy(impl, interpret, dtype, geom):
    kh, s, d = geom
    n, t, layers = 6, 10, 3
    rng = np.random.default_rng(0)
    pages = _kv_pages(rng, layers, n, kh, s, d, dtype)
    k, v, new = _new_rows(rng, t, kh, d, dtype)
    slots = rng.choice(n * s, t, replace=False).astype(np.int32)
    slots[[1, 6]] = -1  # padding tokens

    # Traced layer (as under lax.scan in the engine).
    fn = jax.jit(
        lambda p_, new_, s_, layer: kv_ops.write_pages(
            p_, new_, s_, layer=layer, impl=impl, interpret=interpret
        )
    )
    out = fn(pages, new, jnp.asarray(slots), jnp.int32(2))
    chex.assert_shape(out, pages.shape)
    np.testing.assert_array_equal(_host(out), _np_write(_host(pages), _host(new), slots, 2))
    # Each token's K and V sit at its slot, heads side by side (split back from the pages).
    live = slots >= 0
    got_k, got_v = split_kv(out[2, slots[live] // s, slots[live] % s], kh)
    np.testing.assert_array_equal(_host(got_k), _host(k[live]))
    np.testing.assert_array_equal(_host(got_v), _host(v[live]))

    # Python-int layer, host (numpy) slot mapping.
    out = kv_ops.write_pages(pages, new, slots, layer=0, impl=impl, interpret=interpret)
    np.testing.assert_array_equal(_host(out), _np_write(_host(pages), _host(new), slots, 0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tpu_write_kv_token_dmas_on_prefill_decode_and_scattered_slots(dtype):
    """The TPU write kernel (interpret mode; one DMA per live token's row): a 21-token prefill
    starting mid-block, decode tokens, two tokens of one block far apart in the batch,
    padding; several windows of DMAs (8 tokens a window). Neighbouring rows not written
    survive."""
    from kernels_pallas.tpu.kv_ops import write_kv_tpu

    kh, n, s, d, layers = 2, 6, 16, 128, 2
    rng = np.random.default_rng(3)
    prefill = list(range(16 + 5, 16 + 26))  # block 1 rows 5..15, block 2 rows 0..9
    slots = np.array([70, *prefill, -1, 3, 88, 6, -1], np.int32)  # 3 and 6 share a tile
    t = len(slots)
    pages = _kv_pages(rng, layers, n, kh, s, d, dtype)
    _, _, new = _new_rows(rng, t, kh, d, dtype)
    out = write_kv_tpu(
        pages, new, jnp.asarray(slots), jnp.int32(1), tokens_per_step=8, interpret=True
    )
    np.testing.assert_array_equal(_host(out), _np_write(_host(pages), _host(new), slots, 1))


@settings(max_examples=15, deadline=None)
@given(
    perm_seed=st.integers(0, 2**31 - 1),
    num_skipped=st.integers(0, 8),
    dtype=st.sampled_from([jnp.float32, jnp.int8]),
)
def test_write_kv_xla_any_distinct_slot_mapping_matches_numpy(perm_seed, num_skipped, dtype):
    """Any distinct slots, any skips; int8 rows of K = 3 carry a dummy head (moved as is)."""
    kh, n, s, d, t = 3, 5, 4, 8, 8
    rng = np.random.default_rng(perm_seed)
    pages = np.zeros(page_shape(1, n, s, kh, d, dtype), dtype)
    new = rng.integers(-100, 100, (t, *pages.shape[3:])).astype(dtype)
    slots = rng.choice(n * s, t, replace=False).astype(np.int32)
    slots[rng.choice(t, num_skipped, replace=False)] = -1
    out = _jit_write(jnp.asarray(pages), jnp.asarray(new), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(out), _np_write(pages, new, slots, 0))


_jit_write = jax.jit(lambda p, new, s: kv_ops.write_pages(p, new, s, layer=0, impl="reference"))


def test_write_kv_all_slots_skipped_leaves_pages_untouched():
    shape = page_shape(1, 3, 4, 2, 8, jnp.float32)
    pages = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    new = jnp.ones((4, *shape[3:]))
    out = kv_ops.write_pages(pages, new, np.full(4, -1, np.int32), layer=0)
    chex.assert_trees_all_equal(out, pages)


# --------------------------------------------------------------------------------------------
# copy_blocks
# --------------------------------------------------------------------------------------------


def _np_copy(pages: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    out = pages.copy()
    for a, b in zip(src, dst, strict=True):
        if a >= 0 and b >= 0:
            out[:, b] = pages[:, a]
    return out


def _cow_pairs(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """64 sources each copied to 2 distinct fresh destinations, plus skipped entries."""
    perm = rng.permutation(n)
    sources = perm[:64]
    dests = perm[64:192]
    src = np.concatenate([np.repeat(sources, 2), [-1, 3, -1]]).astype(np.int32)
    dst = np.concatenate([dests, [5, -1, -1]]).astype(np.int32)
    order = rng.permutation(src.size)
    return src[order], dst[order]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_copy_blocks_64_sources_to_two_destinations_each_all_layers(impl, interpret, dtype):
    layers, kh, n, s, d = 2, 2, 200, 4, 16
    rng = np.random.default_rng(1)
    pages = _kv_pages(rng, layers, n, kh, s, d, dtype)
    src, dst = _cow_pairs(rng, n)
    out = kv_ops.copy_pages(pages, src, dst, impl=impl, interpret=interpret)
    np.testing.assert_array_equal(_host(out), _np_copy(_host(pages), src, dst))


@pytest.mark.parametrize("moves", ["loop", "scatter"], ids=["update-slice-loop", "scatter"])
def test_copy_blocks_xla_loop_and_scatter_forms_match_numpy(moves):
    rng = np.random.default_rng(5)
    pages = _kv_pages(rng, 2, 200, 2, 4, 8, jnp.float32)
    src, dst = _cow_pairs(rng, 200)
    fn = jax.jit(lambda a, x, y: kv_ops.copy_pages(a, x, y, impl="reference", xla_moves=moves))
    out = fn(pages, jnp.asarray(src), jnp.asarray(dst))
    np.testing.assert_array_equal(np.asarray(out), _np_copy(np.asarray(pages), src, dst))


@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_copy_blocks_single_layer_pages_match_numpy(impl, interpret, geom):
    """One layer (``L = 1``), traced ids."""
    kh, s, d = geom
    rng = np.random.default_rng(2)
    pages = _kv_pages(rng, 1, 12, kh, s, d, jnp.float32)
    src = np.array([0, 4, -1, 7, 2], np.int32)
    dst = np.array([9, 10, 1, -1, 11], np.int32)
    fn = jax.jit(lambda a, x, y: kv_ops.copy_pages(a, x, y, impl=impl, interpret=interpret))
    out = fn(pages, jnp.asarray(src), jnp.asarray(dst))
    np.testing.assert_array_equal(np.asarray(out), _np_copy(np.asarray(pages), src, dst))


# --------------------------------------------------------------------------------------------
# swap_blocks
# --------------------------------------------------------------------------------------------


@pytest.fixture(
    params=["direct", "loop", "scatter"],
    ids=["cpu-direct", "gather-transfer-loop", "gather-transfer-scatter"],
)
def swap_program_kind(request):
    """Run swaps through every program: the CPU block-to-block one, and the generic gather /
    one transfer / scatter one with the CPU update-slice loop or the accelerator scatter."""
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_to_pinned_host_and_back_is_bit_exact(dtype, swap_program_kind):
    """Two page arrays (two caches) in one program to the host, then one back."""
    layers, kh, n, nh, s, d = 2, 2, 16, 8, 4, 16
    rng = np.random.default_rng(3)
    dev_a = _kv_pages(rng, layers, n, kh, s, d, dtype)
    dev_b = _kv_pages(rng, layers, n, kh, s, d, dtype)
    host_a = _pinned(jnp.zeros((layers, nh, *dev_a.shape[2:]), dtype))
    host_b = _pinned(jnp.zeros((layers, nh, *dev_b.shape[2:]), dtype))
    src = np.array([3, 9, 14, -1, 0], np.int32)
    dst = np.array([7, 0, 2, 5, 4], np.int32)
    moves = swap_program_kind
    host_a, host_b = kv_ops.swap_pages((dev_a, dev_b), (host_a, host_b), src, dst, xla_moves=moves)
    assert host_a.sharding.memory_kind == "pinned_host"
    assert host_b.sharding.memory_kind == "pinned_host"
    zeros = np.zeros(host_a.shape, np.float32)
    np.testing.assert_array_equal(_host(host_a), _np_copy_between(_host(dev_a), zeros, src, dst))
    np.testing.assert_array_equal(_host(host_b), _np_copy_between(_host(dev_b), zeros, src, dst))
    # Back into different device blocks of a fresh NaN-filled device array.
    back = jnp.full(dev_a.shape, jnp.nan, dtype)
    back = kv_ops.swap_pages(
        host_a, back, np.array([7, 0, 2, 4]), np.array([1, 2, 3, 4]), xla_moves=moves
    )
    assert back.sharding.memory_kind == "device"
    for new, old in zip([1, 2, 3, 4], [3, 9, 14, 0], strict=True):
        np.testing.assert_array_equal(
            np.asarray(back[:, new]).view(np.uint8), np.asarray(dev_a[:, old]).view(np.uint8)
        )


def _np_copy_between(src_pages, dst_pages, src, dst):
    out = dst_pages.copy()
    for a, b in zip(src, dst, strict=True):
        if a >= 0 and b >= 0:
            out[:, b] = src_pages[:, a]
    return out


def test_swap_pads_pair_counts_to_power_of_two_buckets():
    assert [kv_ops.bucket_size(p) for p in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]
    dev = jnp.arange(1 * 32 * 2 * 2 * 8, dtype=jnp.float32).reshape(1, 32, 2, 2, 1, 8)
    host = _pinned(jnp.zeros((1, 16, 2, 2, 1, 8), jnp.float32))
    kv_ops._swap_program.cache_clear()
    for p in (3, 4):  # both in the bucket of 4: one program, one compilation
        host = kv_ops.swap_pages(dev, host, np.arange(p), np.arange(p) + 8)
    assert kv_ops._swap_program.cache_info().currsize == 1
    program, _ = kv_ops.swap_program(dev, host, 4)  # the cached program swap_pages ran
    assert program._cache_size() == 1
    np.testing.assert_array_equal(np.asarray(host[:, 8:12]), np.asarray(dev[:, 0:4]))


@pytest.mark.parametrize("direct", [True, False], ids=["cpu-direct", "gather-transfer-scatter"])
@pytest.mark.parametrize("to_host", [True, False], ids=["device->host", "host->device"])
def test_swap_program_scatters_in_place_and_moves_only_gathered_blocks(to_host, direct):
    """The cache's swap operands (one ``kv`` array: ``kp.swap_operands``)."""
    shape = page_shape(2, 256, 4, 2, 8, jnp.float32)
    dev = jnp.zeros(shape, jnp.float32)
    host = _pinned(jnp.zeros((2, 128, *shape[2:]), jnp.float32))
    src, dst = ((dev,), (host,)) if to_host else ((host,), (dev,))
    program = kv_ops._swap_program(
        not to_host, to_host, (dst[0].sharding,), False, True, direct, True
    )
    ids = jnp.arange(4, dtype=jnp.int32)
    compiled = program.lower(src, dst, ids, ids).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == dst[0].nbytes  # the destination updated in place
    # Only the gathered blocks (4 of 128) are temporaries, never a pool-sized copy.
    assert mem.temp_size_in_bytes < dst[0].nbytes // 8
    full = "f32[" + ",".join(map(str, dst[0].shape)) + "]"
    assert not [ln for ln in compiled.as_text().splitlines() if " copy(" in ln and full in ln]


def test_swap_tpu_kernel_interpret_between_device_arrays_matches_reference():
    rng = np.random.default_rng(4)
    src_pages = _kv_pages(rng, 2, 10, 2, 4, 16, jnp.float32)
    dst_pages = _kv_pages(rng, 2, 6, 2, 4, 16, jnp.float32)
    src = np.array([9, 0, -1, 4], np.int32)
    dst = np.array([5, 1, 2, 0], np.int32)
    expect = _np_copy_between(np.asarray(src_pages), np.asarray(dst_pages), src, dst)
    want = reference.swap_blocks_reference(src_pages, dst_pages, jnp.asarray(src), jnp.asarray(dst))
    np.testing.assert_array_equal(np.asarray(want), expect)  # the oracle is the numpy move
    out = kv_ops.swap_pages(src_pages, dst_pages, src, dst, impl="pallas_tpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(out), expect)  # (dst_pages donated)


@pytest.mark.parametrize("interpret", [True, False])
def test_swap_tpu_kernel_refuses_host_memory_operands(interpret):
    """The Mosaic swap kernel with a pinned_host side aborts the TPU compiler (HostOffloader
    CHECK) or fails its LLO checks, so that program must never be built: refused up front."""
    host = _pinned(jnp.zeros((1, 4, 2, 2, 1, 8), jnp.float32))
    dev = jnp.zeros((1, 4, 2, 2, 1, 8), jnp.float32)
    for src, dst in ((dev, host), (host, dev)):
        with pytest.raises(ValueError, match="cannot address host memory"):
            kv_ops.swap_pages(
                src, dst, np.array([0]), np.array([1]), impl="pallas_tpu", interpret=interpret
            )


# --------------------------------------------------------------------------------------------
# In place
# --------------------------------------------------------------------------------------------


def test_donated_write_kv_compiles_in_place_without_full_size_copy():
    layers, kh, n, s, d, t = 4, 2, 256, 16, 64, 8
    pages = jnp.zeros(page_shape(layers, n, s, kh, d, jnp.float32), jnp.float32)
    new = jnp.ones((t, *pages.shape[3:]), jnp.float32)

    def step(kv_pages, new, slots):
        def body(carry, layer):
            return kv_ops.write_pages(carry, new, slots, layer=layer), None

        return jax.lax.scan(body, kv_pages, jnp.arange(layers))[0]

    compiled = (
        jax.jit(step, donate_argnums=(0,))
        .lower(pages, new, jnp.arange(t, dtype=jnp.int32))
        .compile()
    )
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == pages.nbytes  # the pages aliased in -> out
    assert mem.temp_size_in_bytes < pages.nbytes // 100  # no scratch copy of the cache
    full = "f32[" + ",".join(map(str, pages.shape)) + "]"
    copies = [ln for ln in compiled.as_text().splitlines() if " copy(" in ln and full in ln]
    assert not copies, copies


def test_donated_cache_write_kv_under_layer_scan_compiles_in_place():
    """The public op: the PagedKVCache in a lax.scan carry, written per layer, donated."""
    layers, kh, n, s, d, t = 4, 2, 256, 16, 64, 8
    cache = kp.init_kv_cache(layers, n, s, kh, d, jnp.float32)
    k = jnp.ones((t, kh, d), jnp.float32)

    def step(cache, k, slots):
        def body(c, layer):
            return kp.write_kv(c, k, k, slots, layer=layer), None

        return jax.lax.scan(body, cache, jnp.arange(layers))[0]

    compiled = (
        jax.jit(step, donate_argnums=(0,)).lower(cache, k, jnp.arange(t, dtype=jnp.int32)).compile()
    )
    mem = compiled.memory_analysis()
    # every buffer of the cache (the pages and the scales) aliased in -> out
    assert mem.alias_size_in_bytes == sum(x.nbytes for x in jax.tree.leaves(cache))
    assert mem.temp_size_in_bytes < cache.kv.nbytes // 100  # no scratch copy of the cache
    full = "f32[" + ",".join(map(str, cache.kv.shape)) + "]"
    copies = [ln for ln in compiled.as_text().splitlines() if " copy(" in ln and full in ln]
    assert not copies, copies


def test_donated_cache_copy_blocks_compiles_in_place():
    cache = kp.init_kv_cache(4, 256, 16, 2, 64, jnp.float32)
    ids = jnp.arange(8, dtype=jnp.int32)
    fn = jax.jit(lambda c, s, d: kp.copy_blocks(c, s, d), donate_argnums=(0,))
    mem = fn.lower(cache, ids, ids + 8).compile().memory_analysis()
    assert mem.alias_size_in_bytes == sum(x.nbytes for x in jax.tree.leaves(cache))
    assert mem.temp_size_in_bytes < cache.kv.nbytes // 10  # only the gathered blocks


def test_donated_copy_blocks_compiles_in_place():
    pages = jnp.zeros(page_shape(4, 256, 16, 2, 64, jnp.float32), jnp.float32)
    ids = jnp.arange(8, dtype=jnp.int32)
    fn = jax.jit(lambda a, s, d: kv_ops.copy_pages(a, s, d), donate_argnums=(0,))
    mem = fn.lower(pages, ids, ids + 8).compile().memory_analysis()
    assert mem.alias_size_in_bytes == pages.nbytes
    assert mem.temp_size_in_bytes < pages.nbytes // 10  # only the gathered blocks


@pytest.fixture
def fake_tpu_info(monkeypatch):
    """Let the Mosaic TPU lowering run on a CPU host: answer TPU-info queries as a v5e."""
    from jax._src.pallas.mosaic import tpu_info

    monkeypatch.setitem(
        tpu_info.registry,
        "cpu",
        lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1),
    )


def _kernel_cases():
    from kernels_pallas.tpu.kv_ops import copy_blocks_tpu, swap_blocks_tpu, write_kv_tpu

    return {
        "tpu-write_kv": ("tpu", lambda a, new, s, layer: write_kv_tpu(a, new, s, layer)),
        "tpu-copy_blocks": ("tpu", lambda a, s, d: copy_blocks_tpu(a, s, d)),
        "tpu-swap_blocks": ("tpu", lambda a, b, s, d: swap_blocks_tpu((a,), (b,), s, d)),
        # No Mosaic GPU KV kernels (kernels_pallas.kv_ops doc): on GPU the XLA path, which
        # must still be in place when lowered for CUDA.
        "gpu-write_kv": (
            "cuda",
            lambda a, new, s, layer: kv_ops.write_pages(a, new, s, layer=layer, impl="auto"),
        ),
        "gpu-copy_blocks": ("cuda", lambda a, s, d: kv_ops.copy_pages(a, s, d, impl="auto")),
    }


@pytest.mark.parametrize(
    "case",
    [
        "tpu-write_kv",
        "tpu-copy_blocks",
        "tpu-swap_blocks",
        "gpu-write_kv",
        "gpu-copy_blocks",
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_kernels_lower_to_mosaic_with_aliased_pages(case, dtype, fake_tpu_info):
    """Lowering for the real backends (no TPU/GPU here): the TPU kernels trace and lower to a
    Mosaic custom call, the GPU (XLA) path lowers for CUDA, and both alias the page array
    input -> output (in place)."""
    platform, fn = _kernel_cases()[case]
    shape = page_shape(2, 64, 16, 8, 128, dtype)
    pages = jax.ShapeDtypeStruct(shape, dtype)
    ids = jax.ShapeDtypeStruct((16,), jnp.int32)
    if "write_kv" in case:
        new = jax.ShapeDtypeStruct((16, *shape[3:]), dtype)
        args = (pages, new, ids, jax.ShapeDtypeStruct((), jnp.int32))
    elif "swap" in case:
        args = (pages, pages, ids, ids)
    else:
        args = (pages, ids, ids)
    donate = (1,) if "swap" in case else (0,)  # a swap updates only the destination
    exported = jax.export.export(jax.jit(fn, donate_argnums=donate), platforms=[platform])(*args)
    text = exported.mlir_module()
    if platform == "tpu":
        assert "tpu_custom_call" in text
    assert text.count("tf.aliasing_output") == 1


# --------------------------------------------------------------------------------------------
# Bad arguments
# --------------------------------------------------------------------------------------------


def _args():
    """Pages ``[L, N, S, C, P, D]`` = ``[2, 4, 4, 4, 1, 8]`` (K = 2, f32) and 3 new rows."""
    pages = jnp.zeros(page_shape(2, 4, 4, 2, 8, jnp.float32), jnp.float32)
    new = jnp.zeros((3, *pages.shape[3:]), jnp.float32)
    return pages, new


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda p, n: (p[0], n, np.zeros(3, np.int32), {"layer": 0}), "rank 6"),
        (lambda p, n: (p[None], n, np.zeros(3, np.int32), {"layer": 0}), "rank 6"),
        # the packing axis (4) is the dtype's: f32 packs one head a word, bf16 two
        (lambda p, n: (p.reshape(2, 4, 4, 2, 2, 8), n, np.zeros(3, np.int32), {}), "must pack P=1"),
        (lambda p, n: (p.astype(jnp.bfloat16), n, np.zeros(3, np.int32), {}), "must pack P=2"),
        (lambda p, n: (p, n[:, :2], np.zeros(3, np.int32), {}), r"\[T, 4, 1, 8\]"),
        (lambda p, n: (p, n[0], np.zeros(3, np.int32), {}), "kv_new must be"),
        (lambda p, n: (p, n.astype(jnp.bfloat16), np.zeros(3, np.int32), {}), "cast"),
        (lambda p, n: (p, n, np.zeros(4, np.int32), {}), "length"),
        (lambda p, n: (p, n, np.zeros(3, np.float32), {}), "integer"),
        (lambda p, n: (p, n, np.array([0, 16, 1], np.int32), {}), "out of range"),
        (lambda p, n: (p, n, np.array([2, 2, -1], np.int32), {}), "duplicate"),
        (lambda p, n: (p, n, np.zeros(3, np.int32), {"layer": True}), "layer must be an integer"),
        (lambda p, n: (p, n, np.zeros(3, np.int32), {"layer": 0.0}), "integer scalar"),
        (lambda p, n: (p, n, np.zeros(3, np.int32), {"layer": None}), "need layer="),
        (lambda p, n: (p, n, np.arange(3), {"layer": 2}), "out of range"),
        (lambda p, n: (p, n, np.arange(3), {"layer": -1}), "out of range"),
        (lambda p, n: (p, n, np.arange(3), {"impl": "cuda"}), "impl"),
        (lambda p, n: (p, n, np.arange(3), {"impl": "pallas_tpu"}), "interpret=True"),
    ],
)
def test_write_kv_bad_arguments_raise_value_error(mutate, match):
    pages, new, slots, kw = mutate(*_args())
    with pytest.raises(ValueError, match=match):
        kv_ops.write_pages(pages, new, slots, **{"layer": 1, **kw})


@pytest.mark.parametrize(
    "src,dst,match",
    [
        (np.array([0, 1]), np.array([2]), "length"),
        (np.array([0, 4]), np.array([2, 3]), "out of range"),
        (np.array([0, 1]), np.array([2, 2]), "distinct"),
        (np.array([0, 1]), np.array([1, 2]), "also a source"),
        (np.array([[0]]), np.array([[1]]), "1-D"),
    ],
)
def test_copy_blocks_bad_arguments_raise_value_error(src, dst, match):
    pages, _ = _args()
    with pytest.raises(ValueError, match=match):
        kv_ops.copy_pages(pages, src, dst)


def test_copy_blocks_refuses_pages_off_the_layout():
    pages, _ = _args()
    with pytest.raises(ValueError, match="rank 6"):
        kv_ops.copy_pages(pages[0], np.array([0]), np.array([1]))
    with pytest.raises(ValueError, match="must pack P=2"):
        kv_ops.copy_pages(pages.astype(jnp.bfloat16), np.array([0]), np.array([1]))


def test_swap_blocks_bad_arguments_raise_value_error():
    a = jnp.zeros((2, 4, 4, 4, 1, 8), jnp.float32)
    b = jnp.zeros((2, 6, 4, 4, 1, 8), jnp.float32)
    ids = np.array([0, 1])
    with pytest.raises(ValueError, match="outside the block axis"):
        kv_ops.swap_pages(a, jnp.zeros((2, 6, 4, 2, 1, 8)), ids, ids)
    with pytest.raises(ValueError, match="outside the block axis"):
        kv_ops.swap_pages(a, jnp.zeros((3, 6, 4, 4, 1, 8)), ids, ids)
    with pytest.raises(ValueError, match=r"must be \[L, N, S, C, P, Dp\]"):
        kv_ops.swap_pages(a[0], b[0], ids, ids)
    with pytest.raises(ValueError, match="dtype"):
        kv_ops.swap_pages(a, b.astype(jnp.bfloat16), ids, ids)
    with pytest.raises(ValueError, match="out of range"):
        kv_ops.swap_pages(a, b, np.array([0, 4]), ids)
    with pytest.raises(ValueError, match="out of range"):
        kv_ops.swap_pages(b, a, ids, np.array([0, 4]))
    with pytest.raises(ValueError, match="same length"):
        kv_ops.swap_pages((a, a), b, ids, ids)


# --------------------------------------------------------------------------------------------
# Wide grid (slow): more head counts, block sizes and head dims through every implementation
# --------------------------------------------------------------------------------------------

WIDE_GEOMS = [(4, 8, 64), (8, 32, 128), (1, 1, 256), (2, 16, 80)]


@pytest.mark.slow
@pytest.mark.parametrize("geom", WIDE_GEOMS, ids=lambda g: "K{}-S{}-D{}".format(*g))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_wide_grid_write_and_copy_match_numpy(impl, interpret, dtype, geom):
    kh, s, d = geom
    n, t = 40, 24
    rng = np.random.default_rng(6)
    pages = _kv_pages(rng, 2, n, kh, s, d, dtype)
    _, _, new = _new_rows(rng, t, kh, d, dtype)
    slots = rng.choice(n * s, t, replace=False).astype(np.int32)
    slots[::5] = -1
    out = kv_ops.write_pages(pages, new, slots, layer=1, impl=impl, interpret=interpret)
    np.testing.assert_array_equal(_host(out), _np_write(_host(pages), _host(new), slots, 1))
    perm = rng.permutation(n)
    src = np.concatenate([perm[:10], [-1, 2]]).astype(np.int32)
    dst = np.concatenate([perm[10:20], [7, -1]]).astype(np.int32)
    out = kv_ops.copy_pages(pages, src, dst, impl=impl, interpret=interpret)
    np.testing.assert_array_equal(_host(out), _np_copy(_host(pages), src, dst))


def test_xla_moves_is_checked_before_anything_runs():
    pages = jnp.zeros((1, 4, 2, 2, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="copy_blocks: xla_moves must be one of"):
        kv_ops.copy_pages(pages, [0], [1], xla_moves="direct")  # one array: no "direct"
    with pytest.raises(ValueError, match="swap_blocks: xla_moves must be one of"):
        kv_ops.swap_pages(pages, pages, [0], [1], xla_moves="fast")


def test_forced_swap_impls_follow_the_shared_dispatch_rule(monkeypatch):
    """One rule for every op (kernels_pallas._dispatch.forced_family): on a GPU target
    "pallas" means the GPU kernel, and swaps have none, so they run XLA; "pallas_tpu" off a
    TPU target needs interpret=True, as for attention and write_kv."""
    monkeypatch.setattr(_dispatch, "target_platform", lambda: "cuda")
    rng = np.random.default_rng(6)
    src_pages = _kv_pages(rng, 1, 6, 1, 4, 8, jnp.float32)
    dst_pages = jnp.zeros(src_pages.shape, jnp.float32)
    src, dst = np.array([4, 1], np.int32), np.array([0, 5], np.int32)
    expect = _np_copy_between(np.asarray(src_pages), np.zeros(dst_pages.shape), src, dst)
    out = kv_ops.swap_pages(src_pages, dst_pages, src, dst, impl="pallas", donate=False)
    np.testing.assert_array_equal(np.asarray(out), expect)
    assert kp.kernel_info("cuda")["swap_blocks"] == "xla"
    with pytest.raises(ValueError, match="needs a TPU target"):
        kv_ops.swap_pages(src_pages, dst_pages, src, dst, impl="pallas_tpu", donate=False)


@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_write_kv_and_copy_blocks_meet_their_oracles(impl, interpret):
    """Every implementation against kernels_pallas.reference (bit-exact: they only move)."""
    rng = np.random.default_rng(7)
    kh, n, s, d = 2, 12, 4, 16
    pages = _kv_pages(rng, 2, n, kh, s, d, jnp.float32)
    _, _, new = _new_rows(rng, 5, kh, d, jnp.float32)
    slots = jnp.array([3, -1, 17, 40, 0], jnp.int32)
    for layer in (0, 1):
        got = kv_ops.write_pages(pages, new, slots, layer=layer, impl=impl, interpret=interpret)
        chex.assert_trees_all_equal(got, reference.write_kv_reference(pages, new, slots, layer))
    src, dst = jnp.array([0, 4, -1, 7], jnp.int32), jnp.array([9, 10, 1, 11], jnp.int32)
    got = kv_ops.copy_pages(pages, src, dst, impl=impl, interpret=interpret)
    chex.assert_trees_all_equal(got, reference.copy_blocks_reference(pages, src, dst))
