"""KV movement on page arrays (``kernels_pallas.kv_ops``: write_pages, copy_pages, swap_pages,
the implementations behind the cache ops write_kv, copy_blocks, swap_blocks) against numpy.

Every op runs through the XLA/reference path, ``impl="auto"`` and the Pallas TPU kernels in
interpret mode, in f32 and bf16, for several head
dims and block sizes, on single-layer ``[K, N, S, D]`` and stacked ``[L, K, N, S, D]`` pages.
The in-place checks also run on the public ``PagedKVCache`` ops (the cache in a scan carry,
donated); the public contract itself is tests/test_kv_cache_api.py.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import SingleDeviceSharding

import kernels_pallas as kp
from kernels_pallas import _dispatch, kv_ops, reference

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


def _host(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32))


def _pinned(x):
    return jax.device_put(x, SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------


def _np_write(pages: np.ndarray, new: np.ndarray, slots: np.ndarray, layer=None) -> np.ndarray:
    out = pages.copy()
    view = out if layer is None else out[layer]
    s = pages.shape[-2]
    for t, slot in enumerate(slots):
        if slot >= 0:
            view[:, slot // s, slot % s, :] = new[t]
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
    k_pages = _pages(rng, (layers, kh, n, s, d), dtype)
    v_pages = _pages(rng, (layers, kh, n, s, d), dtype)
    k = _pages(rng, (t, kh, d), dtype)
    v = _pages(rng, (t, kh, d), dtype)
    slots = rng.choice(n * s, t, replace=False).astype(np.int32)
    slots[[1, 6]] = -1  # padding tokens

    # Stacked pages, traced layer (as under lax.scan in the engine).
    fn = jax.jit(
        lambda kp_, vp_, k_, v_, s_, layer: kv_ops.write_pages(
            kp_, vp_, k_, v_, s_, layer=layer, impl=impl, interpret=interpret
        )
    )
    out_k, out_v = fn(k_pages, v_pages, k, v, jnp.asarray(slots), jnp.int32(2))
    chex.assert_shape([out_k, out_v], k_pages.shape)
    np.testing.assert_array_equal(_host(out_k), _np_write(_host(k_pages), _host(k), slots, 2))
    np.testing.assert_array_equal(_host(out_v), _np_write(_host(v_pages), _host(v), slots, 2))

    # Single layer [K, N, S, D], host (numpy) slot mapping.
    out_k, out_v = kv_ops.write_pages(
        k_pages[0], v_pages[0], k, v, slots, impl=impl, interpret=interpret
    )
    np.testing.assert_array_equal(_host(out_k), _np_write(_host(k_pages[0]), _host(k), slots))
    np.testing.assert_array_equal(_host(out_v), _np_write(_host(v_pages[0]), _host(v), slots))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tpu_write_kv_tile_runs_prefill_decode_and_scattered_slots(dtype):
    """The TPU write kernel's read-modify-write of 8-row tiles (interpret mode): a 21-token
    prefill starting mid-tile (partial, full, partial tiles), decode tokens in partial tiles,
    two tokens of one tile far apart in the batch (sorted together), padding; several grid
    steps (2 runs per step). Rows of touched tiles that are not written must survive."""
    from kernels_pallas.tpu.kv_ops import write_kv_tpu

    kh, n, s, d, layers = 2, 6, 16, 128, 2
    rng = np.random.default_rng(3)
    prefill = list(range(16 + 5, 16 + 26))  # block 1 rows 5..15, block 2 rows 0..9
    slots = np.array([70, *prefill, -1, 3, 88, 6, -1], np.int32)  # 3 and 6 share a tile
    t = len(slots)
    k_pages = _pages(rng, (layers, kh, n, s, d), dtype)
    v_pages = _pages(rng, (layers, kh, n, s, d), dtype)
    k, v = _pages(rng, (t, kh, d), dtype), _pages(rng, (t, kh, d), dtype)
    out_k, out_v = write_kv_tpu(
        k_pages, v_pages, k, v, jnp.asarray(slots), jnp.int32(1), runs_per_step=2, interpret=True
    )
    np.testing.assert_array_equal(_host(out_k), _np_write(_host(k_pages), _host(k), slots, 1))
    np.testing.assert_array_equal(_host(out_v), _np_write(_host(v_pages), _host(v), slots, 1))


@settings(max_examples=15, deadline=None)
@given(
    perm_seed=st.integers(0, 2**31 - 1),
    num_skipped=st.integers(0, 8),
)
def test_write_kv_xla_any_distinct_slot_mapping_matches_numpy(perm_seed, num_skipped):
    kh, n, s, d, t = 2, 5, 4, 8, 8
    rng = np.random.default_rng(perm_seed)
    pages = np.zeros((kh, n, s, d), np.float32)
    k = rng.standard_normal((t, kh, d)).astype(np.float32)
    slots = rng.choice(n * s, t, replace=False).astype(np.int32)
    slots[rng.choice(t, num_skipped, replace=False)] = -1
    out_k, _ = _jit_write(jnp.asarray(pages), jnp.asarray(pages), k, k, jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(out_k), _np_write(pages, k, slots))


_jit_write = jax.jit(lambda a, b, k, v, s: kv_ops.write_pages(a, b, k, v, s, impl="reference"))


def test_write_kv_all_slots_skipped_leaves_pages_untouched():
    pages = jnp.arange(2 * 3 * 4 * 8, dtype=jnp.float32).reshape(2, 3, 4, 8)
    k = jnp.ones((4, 2, 8))
    out_k, out_v = kv_ops.write_pages(pages, pages, k, k, np.full(4, -1, np.int32))
    chex.assert_trees_all_equal((out_k, out_v), (pages, pages))


# --------------------------------------------------------------------------------------------
# copy_blocks
# --------------------------------------------------------------------------------------------


def _np_copy(pages: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    out = pages.copy()
    for a, b in zip(src, dst, strict=True):
        if a >= 0 and b >= 0:
            out[..., b, :, :] = pages[..., a, :, :]
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
    k_pages = _pages(rng, (layers, kh, n, s, d), dtype)
    v_pages = _pages(rng, (layers, kh, n, s, d), dtype)
    src, dst = _cow_pairs(rng, n)
    out_k, out_v = kv_ops.copy_pages(k_pages, v_pages, src, dst, impl=impl, interpret=interpret)
    np.testing.assert_array_equal(_host(out_k), _np_copy(_host(k_pages), src, dst))
    np.testing.assert_array_equal(_host(out_v), _np_copy(_host(v_pages), src, dst))


@pytest.mark.parametrize("moves", ["loop", "scatter"], ids=["update-slice-loop", "scatter"])
def test_copy_blocks_xla_loop_and_scatter_forms_match_numpy(moves):
    rng = np.random.default_rng(5)
    pages = _pages(rng, (2, 2, 200, 4, 8), jnp.float32)
    src, dst = _cow_pairs(rng, 200)
    fn = jax.jit(
        lambda a, b, x, y: kv_ops.copy_pages(a, b, x, y, impl="reference", xla_moves=moves)
    )
    out_k, _ = fn(pages, pages, jnp.asarray(src), jnp.asarray(dst))
    np.testing.assert_array_equal(np.asarray(out_k), _np_copy(np.asarray(pages), src, dst))


@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("impl,interpret", IMPLS)
def test_copy_blocks_single_layer_pages_match_numpy(impl, interpret, geom):
    kh, s, d = geom
    rng = np.random.default_rng(2)
    pages = _pages(rng, (kh, 12, s, d), jnp.float32)
    src = np.array([0, 4, -1, 7, 2], np.int32)
    dst = np.array([9, 10, 1, -1, 11], np.int32)
    fn = jax.jit(lambda a, b, x, y: kv_ops.copy_pages(a, b, x, y, impl=impl, interpret=interpret))
    out_k, out_v = fn(pages, pages * 2, jnp.asarray(src), jnp.asarray(dst))
    np.testing.assert_array_equal(np.asarray(out_k), _np_copy(np.asarray(pages), src, dst))
    np.testing.assert_array_equal(np.asarray(out_v), _np_copy(np.asarray(pages * 2), src, dst))


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
    layers, kh, n, nh, s, d = 2, 2, 16, 8, 4, 16
    rng = np.random.default_rng(3)
    dev_k = _pages(rng, (layers, kh, n, s, d), dtype)
    dev_v = _pages(rng, (layers, kh, n, s, d), dtype)
    host_k = _pinned(jnp.zeros((layers, kh, nh, s, d), dtype))
    host_v = _pinned(jnp.zeros((layers, kh, nh, s, d), dtype))
    src = np.array([3, 9, 14, -1, 0], np.int32)
    dst = np.array([7, 0, 2, 5, 4], np.int32)
    moves = swap_program_kind
    host_k, host_v = kv_ops.swap_pages((dev_k, dev_v), (host_k, host_v), src, dst, xla_moves=moves)
    assert host_k.sharding.memory_kind == "pinned_host"
    assert host_v.sharding.memory_kind == "pinned_host"
    zeros = np.zeros(host_k.shape, np.float32)
    np.testing.assert_array_equal(_host(host_k), _np_copy_between(_host(dev_k), zeros, src, dst))
    np.testing.assert_array_equal(_host(host_v), _np_copy_between(_host(dev_v), zeros, src, dst))
    # Back into different device blocks of a fresh NaN-filled device array.
    back = jnp.full(dev_k.shape, jnp.nan, dtype)
    back = kv_ops.swap_pages(
        host_k, back, np.array([7, 0, 2, 4]), np.array([1, 2, 3, 4]), xla_moves=moves
    )
    assert back.sharding.memory_kind == "device"
    for new, old in zip([1, 2, 3, 4], [3, 9, 14, 0], strict=True):
        np.testing.assert_array_equal(
            np.asarray(back[:, :, new]).view(np.uint8), np.asarray(dev_k[:, :, old]).view(np.uint8)
        )


def _np_copy_between(src_pages, dst_pages, src, dst):
    out = dst_pages.copy()
    for a, b in zip(src, dst, strict=True):
        if a >= 0 and b >= 0:
            out[..., b, :, :] = src_pages[..., a, :, :]
    return out


def test_swap_pads_pair_counts_to_power_of_two_buckets():
    assert [kv_ops.bucket_size(p) for p in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]
    dev = jnp.arange(1 * 2 * 32 * 2 * 8, dtype=jnp.float32).reshape(1, 2, 32, 2, 8)
    host = _pinned(jnp.zeros((1, 2, 16, 2, 8), jnp.float32))
    kv_ops._swap_program.cache_clear()
    for p in (3, 4):  # both in the bucket of 4: one program, one compilation
        host = kv_ops.swap_pages(dev, host, np.arange(p), np.arange(p) + 8)
    assert kv_ops._swap_program.cache_info().currsize == 1
    program = kv_ops._swap_program(False, True, (host.sharding,), False, True, True, True)
    assert program._cache_size() == 1
    np.testing.assert_array_equal(np.asarray(host[:, :, 8:12]), np.asarray(dev[:, :, 0:4]))


@pytest.mark.parametrize("direct", [True, False], ids=["cpu-direct", "gather-transfer-scatter"])
@pytest.mark.parametrize("to_host", [True, False], ids=["device->host", "host->device"])
def test_swap_program_scatters_in_place_and_moves_only_gathered_blocks(to_host, direct):
    dev = jnp.zeros((2, 2, 256, 4, 8), jnp.float32)
    host = _pinned(jnp.zeros((2, 2, 128, 4, 8), jnp.float32))
    src, dst = ((dev, dev), (host, host)) if to_host else ((host, host), (dev, dev))
    program = kv_ops._swap_program(
        not to_host, to_host, (dst[0].sharding,) * 2, False, True, direct, True
    )
    ids = jnp.arange(4, dtype=jnp.int32)
    compiled = program.lower(src, dst, ids, ids).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == 2 * dst[0].nbytes  # both destinations updated in place
    # Only the gathered K/V blocks (4 of 128) are temporaries, never a pool-sized copy.
    assert mem.temp_size_in_bytes < dst[0].nbytes // 8
    full = "f32[" + ",".join(map(str, dst[0].shape)) + "]"
    assert not [ln for ln in compiled.as_text().splitlines() if " copy(" in ln and full in ln]


def test_swap_tpu_kernel_interpret_between_device_arrays_matches_reference():
    rng = np.random.default_rng(4)
    src_pages = _pages(rng, (2, 2, 10, 4, 16), jnp.float32)
    dst_pages = _pages(rng, (2, 2, 6, 4, 16), jnp.float32)
    src = np.array([9, 0, -1, 4], np.int32)
    dst = np.array([5, 1, 2, 0], np.int32)
    expect = _np_copy_between(np.asarray(src_pages), np.asarray(dst_pages), src, dst)
    out = kv_ops.swap_pages(src_pages, dst_pages, src, dst, impl="pallas_tpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(out), expect)


@pytest.mark.parametrize("interpret", [True, False])
def test_swap_tpu_kernel_refuses_host_memory_operands(interpret):
    """The Mosaic swap kernel with a pinned_host side aborts the TPU compiler (HostOffloader
    CHECK) or fails its LLO checks, so that program must never be built: refused up front."""
    host = _pinned(jnp.zeros((1, 1, 4, 2, 8), jnp.float32))
    dev = jnp.zeros((1, 1, 4, 2, 8), jnp.float32)
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
    pages = jnp.zeros((layers, kh, n, s, d), jnp.float32)
    k = jnp.ones((t, kh, d), jnp.float32)

    def step(k_pages, v_pages, k, slots):
        def body(carry, layer):
            a, b = kv_ops.write_pages(*carry, k, k, slots, layer=layer)
            return (a, b), None

        return jax.lax.scan(body, (k_pages, v_pages), jnp.arange(layers))[0]

    compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(pages, pages, k, jnp.arange(t, dtype=jnp.int32))
        .compile()
    )
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == 2 * pages.nbytes  # both page arrays aliased in -> out
    assert mem.temp_size_in_bytes < pages.nbytes // 100  # no scratch copy of the cache
    full = f"f32[{layers},{kh},{n},{s},{d}]"
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
    # every buffer of the cache (both page arrays and the scales) aliased in -> out
    assert mem.alias_size_in_bytes == sum(x.nbytes for x in jax.tree.leaves(cache))
    assert mem.temp_size_in_bytes < cache.k.nbytes // 100  # no scratch copy of the cache
    full = f"f32[{layers},{kh},{n},{s},{d}]"
    copies = [ln for ln in compiled.as_text().splitlines() if " copy(" in ln and full in ln]
    assert not copies, copies


def test_donated_cache_copy_blocks_compiles_in_place():
    cache = kp.init_kv_cache(4, 256, 16, 2, 64, jnp.float32)
    ids = jnp.arange(8, dtype=jnp.int32)
    fn = jax.jit(lambda c, s, d: kp.copy_blocks(c, s, d), donate_argnums=(0,))
    mem = fn.lower(cache, ids, ids + 8).compile().memory_analysis()
    assert mem.alias_size_in_bytes == sum(x.nbytes for x in jax.tree.leaves(cache))
    assert mem.temp_size_in_bytes < cache.k.nbytes // 10  # only the gathered blocks


def test_donated_copy_blocks_compiles_in_place():
    pages = jnp.zeros((4, 2, 256, 16, 64), jnp.float32)
    ids = jnp.arange(8, dtype=jnp.int32)
    fn = jax.jit(lambda a, b, s, d: kv_ops.copy_pages(a, b, s, d), donate_argnums=(0, 1))
    mem = fn.lower(pages, pages, ids, ids + 8).compile().memory_analysis()
    assert mem.alias_size_in_bytes == 2 * pages.nbytes
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
        "tpu-write_kv": ("tpu", lambda a, b, k, v, s, layer: write_kv_tpu(a, b, k, v, s, layer)),
        "tpu-copy_blocks": ("tpu", lambda a, b, s, d: copy_blocks_tpu(a, b, s, d)),
        "tpu-swap_blocks": ("tpu", lambda a, b, s, d: swap_blocks_tpu((a,), (b,), s, d)),
        # No Mosaic GPU KV kernels (kernels_pallas.kv_ops doc): on GPU the XLA path, which
        # must still be in place when lowered for CUDA.
        "gpu-write_kv": (
            "cuda",
            lambda a, b, k, v, s, layer: kv_ops.write_pages(
                a, b, k, v, s, layer=layer, impl="auto"
            ),
        ),
        "gpu-copy_blocks": ("cuda", lambda a, b, s, d: kv_ops.copy_pages(a, b, s, d, impl="auto")),
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
    Mosaic custom call, the GPU (XLA) path lowers for CUDA, and both alias the page arrays
    input -> output (in place)."""
    platform, fn = _kernel_cases()[case]
    pages = jax.ShapeDtypeStruct((2, 8, 64, 16, 128), dtype)
    ids = jax.ShapeDtypeStruct((16,), jnp.int32)
    if "write_kv" in case:
        new = jax.ShapeDtypeStruct((16, 8, 128), dtype)
        args = (pages, pages, new, new, ids, jax.ShapeDtypeStruct((), jnp.int32))
    else:
        args = (pages, pages, ids, ids)
    donate = (1,) if "swap" in case else (0, 1)  # a swap updates only the destination
    exported = jax.export.export(jax.jit(fn, donate_argnums=donate), platforms=[platform])(*args)
    text = exported.mlir_module()
    if platform == "tpu":
        assert "tpu_custom_call" in text
    n_aliased = 1 if "swap" in case else 2
    assert text.count("tf.aliasing_output") == n_aliased


# --------------------------------------------------------------------------------------------
# Bad arguments
# --------------------------------------------------------------------------------------------


def _args():
    pages = jnp.zeros((2, 4, 4, 8), jnp.float32)
    k = jnp.zeros((3, 2, 8), jnp.float32)
    return pages, k


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda p, k: (p, p[..., :4], k, k, np.zeros(3, np.int32), {}), "shapes differ"),
        (lambda p, k: (p, p.astype(jnp.bfloat16), k, k, np.zeros(3, np.int32), {}), "dtypes"),
        (lambda p, k: (p[0], p[0], k, k, np.zeros(3, np.int32), {}), "rank 4"),
        (lambda p, k: (p, p, k[:, :1], k[:, :1], np.zeros(3, np.int32), {}), "K=2"),
        (lambda p, k: (p, p, k.astype(jnp.bfloat16), k, np.zeros(3, np.int32), {}), "cast"),
        (lambda p, k: (p, p, k, k, np.zeros(4, np.int32), {}), "length"),
        (lambda p, k: (p, p, k, k, np.zeros(3, np.float32), {}), "integer"),
        (lambda p, k: (p, p, k, k, np.array([0, 16, 1], np.int32), {}), "out of range"),
        (lambda p, k: (p, p, k, k, np.array([2, 2, -1], np.int32), {}), "duplicate"),
        (lambda p, k: (p, p, k, k, np.zeros(3, np.int32), {"layer": 0}), "layer"),
        (lambda p, k: (p[None], p[None], k, k, np.zeros(3, np.int32), {}), "layer="),
        (lambda p, k: (p[None], p[None], k, k, np.arange(3), {"layer": 1}), "out of range"),
        (lambda p, k: (p, p, k, k, np.arange(3), {"impl": "cuda"}), "impl"),
        (lambda p, k: (p, p, k, k, np.arange(3), {"impl": "pallas_tpu"}), "interpret=True"),
    ],
)
def test_write_kv_bad_arguments_raise_value_error(mutate, match):
    kp_, vp_, k, v, slots, kw = mutate(*_args())
    with pytest.raises(ValueError, match=match):
        kv_ops.write_pages(kp_, vp_, k, v, slots, **kw)


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
    pages = jnp.zeros((2, 4, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match=match):
        kv_ops.copy_pages(pages, pages, src, dst)


def test_swap_blocks_bad_arguments_raise_value_error():
    a = jnp.zeros((2, 2, 4, 4, 8), jnp.float32)
    b = jnp.zeros((2, 2, 6, 4, 8), jnp.float32)
    ids = np.array([0, 1])
    with pytest.raises(ValueError, match="outside the block axis"):
        kv_ops.swap_pages(a, jnp.zeros((2, 3, 6, 4, 8)), ids, ids)
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
    pages = _pages(rng, (2, kh, n, s, d), dtype)
    k = _pages(rng, (t, kh, d), dtype)
    slots = rng.choice(n * s, t, replace=False).astype(np.int32)
    slots[::5] = -1
    out_k, _ = kv_ops.write_pages(
        pages, pages, k, k, slots, layer=1, impl=impl, interpret=interpret
    )
    np.testing.assert_array_equal(_host(out_k), _np_write(_host(pages), _host(k), slots, 1))
    perm = rng.permutation(n)
    src = np.concatenate([perm[:10], [-1, 2]]).astype(np.int32)
    dst = np.concatenate([perm[10:20], [7, -1]]).astype(np.int32)
    out_k, _ = kv_ops.copy_pages(pages, pages, src, dst, impl=impl, interpret=interpret)
    np.testing.assert_array_equal(_host(out_k), _np_copy(_host(pages), src, dst))


def test_xla_moves_is_checked_before_anything_runs():
    pages = jnp.zeros((1, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="copy_blocks: xla_moves must be one of"):
        kv_ops.copy_pages(pages, pages, [0], [1], xla_moves="direct")  # one array: no "direct"
    with pytest.raises(ValueError, match="swap_blocks: xla_moves must be one of"):
        kv_ops.swap_pages(pages, pages, [0], [1], xla_moves="fast")


def test_forced_swap_impls_follow_the_shared_dispatch_rule(monkeypatch):
    """One rule for every op (kernels_pallas._dispatch.forced_family): on a GPU target
    "pallas" means the GPU kernel, and swaps have none, so they run XLA; "pallas_tpu" off a
    TPU target needs interpret=True, as for attention and write_kv."""
    monkeypatch.setattr(_dispatch, "target_platform", lambda: "cuda")
    rng = np.random.default_rng(6)
    src_pages = _pages(rng, (1, 2, 6, 4, 8), jnp.float32)
    dst_pages = jnp.zeros((1, 2, 6, 4, 8), jnp.float32)
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
    k_pages = _pages(rng, (kh, n, s, d), jnp.float32)
    v_pages = _pages(rng, (kh, n, s, d), jnp.float32)
    k_new = _pages(rng, (5, kh, d), jnp.float32)
    v_new = _pages(rng, (5, kh, d), jnp.float32)
    slots = jnp.array([3, -1, 17, 40, 0], jnp.int32)
    got = kv_ops.write_pages(k_pages, v_pages, k_new, v_new, slots, impl=impl, interpret=interpret)
    want = reference.write_kv_reference(k_pages, v_pages, k_new, v_new, slots)
    chex.assert_trees_all_equal(got, want)
    src, dst = jnp.array([0, 4, -1, 7], jnp.int32), jnp.array([9, 10, 1, 11], jnp.int32)
    got = kv_ops.copy_pages(k_pages, v_pages, src, dst, impl=impl, interpret=interpret)
    chex.assert_trees_all_equal(got, reference.copy_blocks_reference(k_pages, v_pages, src, dst))
