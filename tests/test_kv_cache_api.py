"""The public KV-cache contract (shared/DESIGN.md): one opaque ``PagedKVCache`` value.

For every cache dtype (float32, bfloat16, int8, float8_e4m3fn): ``init_kv_cache`` ->
``write_kv`` / ``read_kv`` round trips (exact for f32, within the quantization step for 8-bit),
``paged_attention`` and ``ragged_paged_attention`` against the oracles of
``kernels_pallas.reference`` run on ``read_kv``'s dequantized pages (so the kernels'
dequantization is what is checked), NaN / finite poison in unwritten slots and garbage block
table entries never reaching the output, the fused ``new_kv=`` form, ``copy_blocks`` and
``swap_blocks`` (device <-> pinned_host) moving 8-bit values exactly, per-layer scales,
``set_kv_scales``, and the ``ValueError``s of bad calls (which leave the cache unchanged).

Shapes are tiny (L=2, N=16 blocks of S=4, K=2 kv heads, H=4 query heads: GQA, D=8); the
Pallas TPU kernels run in interpret mode on float caches for one decode and one ragged case.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import make_single_device_sharding

import kernels_pallas as kp
from kernels_pallas import reference
from kernels_pallas.kv_layout import merge_kv

L, N, S, K, H, D = 2, 16, 4, 2, 4, 8
NAN = float("nan")
DTYPES = [
    pytest.param(jnp.float32, id="f32"),
    pytest.param(jnp.bfloat16, id="bf16"),
    pytest.param(jnp.int8, id="int8"),
    pytest.param(jnp.float8_e4m3fn, id="fp8"),
]
FLOAT_DTYPES = DTYPES[:2]
QUANT_DTYPES = DTYPES[2:]
# Per-layer 8-bit scales: inputs are in [-1, 1], so 127 * scale > 1 (int8 never clips).
K_SCALE = np.array([1 / 100, 1 / 64], np.float32)
V_SCALE = np.array([1 / 120, 1 / 80], np.float32)


def _quantized(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def _poison(dtype) -> float:
    """What unwritten slots hold: NaN, except int8 (no NaN) which gets the finite 127."""
    return 127.0 if jnp.dtype(dtype) == jnp.int8 else NAN


def _new_cache(dtype, fill_value=0.0, **kw) -> kp.PagedKVCache:
    if _quantized(dtype):
        kw = dict(k_scale=K_SCALE, v_scale=V_SCALE) | kw
    return kp.init_kv_cache(L, N, S, K, D, dtype, fill_value=fill_value, **kw)


def _tokens(rng, t: int) -> tuple[jax.Array, jax.Array]:
    k = rng.uniform(-1, 1, (t, K, D)).astype(np.float32)
    v = rng.uniform(-1, 1, (t, K, D)).astype(np.float32)
    return jnp.asarray(k), jnp.asarray(v)


def _in_dtype(x: jax.Array, dtype) -> jax.Array:
    """New K/V as a caller passes them: the cache dtype for float caches, f32 for 8-bit."""
    return x if _quantized(dtype) else x.astype(dtype)


def _q_dtype(dtype):
    return jnp.float32 if _quantized(dtype) else dtype


def _tols(dtype) -> dict:
    if jnp.dtype(dtype) == jnp.bfloat16:
        return dict(atol=2e-2, rtol=2e-2)
    return dict(atol=2e-5, rtol=2e-5)


ALL_SLOTS = np.arange(N * S, dtype=np.int32)
# Every slot of one layer, compiled once per cache type (the layer is traced).
_read_all = jax.jit(lambda cache, layer: kp.read_kv(cache, jnp.asarray(ALL_SLOTS), layer=layer))
_paged_oracle = jax.jit(reference.paged_attention_reference)
# Setup writes (the tests of write_kv itself call it eagerly too): one compilation each.
_write = jax.jit(kp.write_kv, static_argnames=("layer",))
_ragged_naive = jax.jit(reference.ragged_paged_attention_reference)


def _pages(cache: kp.PagedKVCache, layer: int) -> jax.Array:
    """One layer's dequantized pages ``[N, S, C, P, D]`` through ``read_kv`` (the oracle's
    view, in the page layout of the read dtype)."""
    k, v = _read_all(cache, layer)
    return merge_kv(k.reshape(N, S, K, D), v.reshape(N, S, K, D))


def _snapshot(cache: kp.PagedKVCache) -> list:
    return [_read_all(cache, i) for i in range(cache.num_layers)] + [
        cache.k_scale,
        cache.v_scale,
    ]


# --------------------------------------------------------------------------------------------
# A mixed batch: sequences written into random blocks of a poisoned cache
# --------------------------------------------------------------------------------------------


def _fill_sequences(rng, cache, kv_lens, *, layer, m):
    """Write ``kv_lens[b]`` tokens of each sequence into random distinct blocks of ``layer``.

    Returns ``(cache, tables i32[B, M])``: tables hold -1 past each sequence's blocks.
    """
    b = len(kv_lens)
    perm = rng.permutation(N)
    tables = np.full((b, m), -1, np.int32)
    nxt, slots = 0, []
    for i, length in enumerate(kv_lens):
        nb = -(-int(length) // S)
        tables[i, :nb] = perm[nxt : nxt + nb]
        nxt += nb
        slots += [tables[i, p // S] * S + p % S for p in range(int(length))]
    assert nxt <= N
    # Padded with skipped slots to one size (one compilation of write_kv per cache type).
    slots = np.asarray(slots + [-1] * (N * S - len(slots)), np.int32)
    k, v = _tokens(rng, len(slots))
    cache = _write(cache, _in_dtype(k, cache.dtype), _in_dtype(v, cache.dtype), slots, layer=layer)
    return cache, tables


def _garbage_tables(rng, tables, kv_lens):
    """The same tables with every entry past a sequence's last block replaced by a valid but
    unrelated block id (possibly another sequence's block)."""
    out = tables.copy()
    for i, length in enumerate(kv_lens):
        used = -(-int(length) // S)
        out[i, used:] = rng.integers(0, N, out.shape[1] - used)
    return out


DECODE_LENS = [1, S, 2 * S + 3, 0, 3 * S]  # 1, a full block, partial, padding row, capacity


def _decode(cache, q, lens, tables, *, layer, **kw):
    return kp.paged_attention(q, cache, jnp.asarray(lens), jnp.asarray(tables), layer=layer, **kw)


def _decode_oracle(cache, q, lens, tables, *, layer):
    kv = _pages(cache, layer)
    dt = jnp.float32 if cache.quantized else cache.dtype
    return _paged_oracle(q.astype(dt), kv, jnp.asarray(lens), jnp.asarray(tables)).astype(q.dtype)


def _check(out, want, dtype):
    chex.assert_shape(out, want.shape)
    assert out.dtype == want.dtype
    out32, want32 = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(out32).all(), "poison reached the output"
    assert np.isfinite(want32).all(), "poison reached the oracle"
    chex.assert_trees_all_close(out32, want32, **_tols(dtype))


IMPLS = [
    pytest.param("reference", False, id="reference"),
    pytest.param("auto", False, id="auto"),
]
INTERPRET = pytest.param("pallas_tpu", True, id="pallas_tpu-interpret")


def _decode_params():
    """Every dtype on the XLA path; auto (the same path on CPU, through the dispatch) on one
    float and one 8-bit cache; the TPU kernel interpreted on f32 and both 8-bit caches (it
    dequantizes in VMEM)."""
    out = [pytest.param(*d.values, *IMPLS[0].values, id=f"{d.id}-reference") for d in DTYPES]
    out += [pytest.param(*d.values, *IMPLS[1].values, id=f"{d.id}-auto") for d in DTYPES[::2]]
    kernel = [DTYPES[0], *QUANT_DTYPES]
    return out + [
        pytest.param(*d.values, *INTERPRET.values, id=f"{d.id}-pallas_tpu-interpret")
        for d in kernel
    ]


@pytest.mark.parametrize("dtype,impl,interpret", _decode_params())
def test_paged_attention_matches_oracle_on_dequantized_poisoned_pages(dtype, impl, interpret):
    rng = np.random.default_rng(0)
    cache = _new_cache(dtype, fill_value=_poison(dtype))
    cache, tables = _fill_sequences(rng, cache, DECODE_LENS, layer=1, m=3)
    q = jnp.asarray(rng.standard_normal((len(DECODE_LENS), H, D)), _q_dtype(dtype))
    out = _decode(cache, q, DECODE_LENS, tables, layer=1, impl=impl, interpret=interpret)
    _check(out, _decode_oracle(cache, q, DECODE_LENS, tables, layer=1), dtype)
    np.testing.assert_array_equal(np.asarray(out[3], np.float32), 0.0)  # length-0 row
    # Garbage (valid, unrelated) block ids past each length never change the result.
    garbage = _garbage_tables(rng, tables, DECODE_LENS)
    again = _decode(cache, q, DECODE_LENS, garbage, layer=1, impl=impl, interpret=interpret)
    chex.assert_trees_all_equal(again, out)


# (q_len, kv_len): decode, whole prefill, chunked prefill, prefix hit, length-1 prefill.
RAGGED_ROWS = [(1, 9), (5, 5), (3, 11), (2, 6), (1, 1)]


def _ragged_batch(rows):
    q_lens = np.asarray([q for q, _ in rows], np.int32)
    kv_lens = np.asarray([k for _, k in rows], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return kv_lens, cu


def _ragged(cache, q, kv_lens, tables, cu, *, layer, **kw):
    n = len(kv_lens)
    return kp.ragged_paged_attention(
        q, cache, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), n, layer=layer, **kw
    )


def _ragged_oracle(cache, q, kv_lens, tables, cu, *, layer):
    kv = _pages(cache, layer)
    dt = jnp.float32 if cache.quantized else cache.dtype
    return _ragged_naive(
        q.astype(dt), kv, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu),
        len(kv_lens),
    ).astype(q.dtype)  # fmt: skip


def _ragged_case(rng, dtype, rows, pad=2, fill=None):
    kv_lens, cu = _ragged_batch(rows)
    cache = _new_cache(dtype, fill_value=_poison(dtype) if fill is None else fill)
    cache, tables = _fill_sequences(rng, cache, kv_lens, layer=0, m=3)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + pad, H, D)), _q_dtype(dtype))
    return cache, q, kv_lens, tables, cu


@settings(max_examples=2, deadline=None)
@given(order=st.permutations(range(len(RAGGED_ROWS))), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_mixed_rows_in_any_order_match_oracle(dtype, order, seed):
    rng = np.random.default_rng(seed)
    rows = [RAGGED_ROWS[i] for i in order]
    cache, q, kv_lens, tables, cu = _ragged_case(rng, dtype, rows)
    out = _ragged(cache, q, kv_lens, tables, cu, layer=0, impl="reference")
    _check(out, _ragged_oracle(cache, q, kv_lens, tables, cu, layer=0), dtype)
    np.testing.assert_array_equal(np.asarray(out[int(cu[-1]) :], np.float32), 0.0)  # padding
    auto = _ragged(cache, q, kv_lens, _garbage_tables(rng, tables, kv_lens), cu, layer=0)
    _check(auto, out, dtype)


def test_ragged_pallas_tpu_interpret_on_a_float_cache_matches_oracle():
    rng = np.random.default_rng(1)
    cache, q, kv_lens, tables, cu = _ragged_case(rng, jnp.float32, RAGGED_ROWS)
    out = _ragged(cache, q, kv_lens, tables, cu, layer=0, impl="pallas_tpu", interpret=True)
    _check(out, _ragged_oracle(cache, q, kv_lens, tables, cu, layer=0), jnp.float32)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_8bit_caches_run_the_tpu_kernels_and_xla_elsewhere(dtype):
    """On TPU the dispatch picks the Pallas kernels for an 8-bit cache (they dequantize in
    VMEM); off TPU (here) the XLA path runs; the output is the oracle's either way."""
    rng = np.random.default_rng(2)
    cache, q, kv_lens, tables, cu = _ragged_case(rng, dtype, RAGGED_ROWS)
    with kp.recording():
        out = _ragged(cache, q, kv_lens, tables, cu, layer=0)
    assert kp.kernel_info("tpu")["ragged_paged_attention"] == "pallas_tpu"
    _check(out, _ragged_oracle(cache, q, kv_lens, tables, cu, layer=0), dtype)


@pytest.mark.parametrize(
    "q_dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)]
)  # f32 queries: also the decode kernel rows of _decode_params
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_tpu_kernels_dequantize_8bit_poisoned_pages_like_the_oracle(dtype, q_dtype):
    """The TPU kernels (interpreted) on 8-bit pages with poison (NaN for fp8, int8's 127) in
    unwritten slots: a mixed ragged batch in any order and decode rows, bf16 queries (the
    served case) or f32 ones, each layer with its own scales, match the dequantizing oracle;
    forcing ``"pallas"`` (the TPU kernel off GPUs) runs them too."""
    rng = np.random.default_rng(5)
    rows = [RAGGED_ROWS[i] for i in rng.permutation(len(RAGGED_ROWS))]
    cache, q, kv_lens, tables, cu = _ragged_case(rng, dtype, rows)
    q = q.astype(q_dtype)
    tol = jnp.bfloat16 if q_dtype == jnp.bfloat16 else dtype
    want = _ragged_oracle(cache, q, kv_lens, tables, cu, layer=0)
    for impl in ("pallas_tpu", "pallas"):
        out = _ragged(cache, q, kv_lens, tables, cu, layer=0, impl=impl, interpret=True)
        _check(out, want, tol)
    dec_cache, dec_tables = _fill_sequences(rng, cache, DECODE_LENS, layer=1, m=3)
    qd = jnp.asarray(rng.standard_normal((len(DECODE_LENS), H, D)), q_dtype)
    out = _decode(dec_cache, qd, DECODE_LENS, dec_tables, layer=1, impl="pallas_tpu",
                  interpret=True)  # fmt: skip
    _check(out, _decode_oracle(dec_cache, qd, DECODE_LENS, dec_tables, layer=1), tol)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_forced_gpu_kernels_refuse_8bit_caches_even_interpreted(dtype):
    """The Mosaic GPU kernels read float pages only: forcing one on an 8-bit cache is an
    error, never raw 8-bit values read without their scales (interpret mode included)."""
    rng = np.random.default_rng(2)
    cache, q, kv_lens, tables, cu = _ragged_case(rng, dtype, RAGGED_ROWS)
    with pytest.raises(ValueError, match="8-bit KV pages"):
        _ragged(cache, q, kv_lens, tables, cu, layer=0, impl="pallas_gpu", interpret=True)
    lens = np.array([3], np.int32)
    with pytest.raises(ValueError, match="8-bit KV pages"):
        _decode(cache, q[:1], lens, tables[:1], layer=0, impl="pallas_gpu", interpret=True)


def test_int8_finite_poison_in_unwritten_slots_never_changes_the_output():
    """int8 has no NaN: a cache filled with 127 (stored 127 after clipping: the largest
    finite poison) gives exactly the output of the same writes into a cache filled with 0."""
    outs = []
    for fill in (127.0, 0.0):
        rng = np.random.default_rng(3)  # the same writes and queries for both fills
        cache, q, kv_lens, tables, cu = _ragged_case(rng, jnp.int8, RAGGED_ROWS, fill=fill)
        lens = [1, S, 2 * S + 3, 0, 3 * S]
        dec_cache, dec_tables = _fill_sequences(rng, cache, lens, layer=1, m=3)
        qd = jnp.asarray(rng.standard_normal((len(lens), H, D)), jnp.float32)
        k0, _ = _read_all(dec_cache, 0)
        poison = float(kp.dequantize(kp.quantize(jnp.float32(fill), K_SCALE[0], jnp.int8), 1.0))
        assert poison == (127.0 if fill else 0.0)
        assert (np.asarray(k0) == poison * K_SCALE[0]).any()  # unwritten slots hold it
        ragged = _ragged(cache, q, kv_lens, tables, cu, layer=0)
        decode = _decode(dec_cache, qd, lens, dec_tables, layer=1)
        assert np.isfinite(np.asarray(ragged)).all() and np.isfinite(np.asarray(decode)).all()
        outs.append((ragged, decode))
    chex.assert_trees_all_equal(outs[0], outs[1])


# --------------------------------------------------------------------------------------------
# write_kv / read_kv
# --------------------------------------------------------------------------------------------


def _assert_round_trip(got, x, dtype, scale, rows=None):
    """``got`` is ``x`` after a write and a read (only ``rows`` of them, when given)."""
    if _quantized(dtype):  # exactly what quantize/dequantize define
        want = np.asarray(kp.dequantize(kp.quantize(jnp.asarray(x), scale, dtype), scale))
    got, x = np.asarray(got, np.float32), np.asarray(x, np.float32)
    if rows is not None:
        got, x = got[rows], x[rows]
        want = want[rows] if _quantized(dtype) else None
    dt = jnp.dtype(dtype)
    if dt == jnp.float32:
        np.testing.assert_array_equal(got, x)
    elif dt == jnp.bfloat16:
        np.testing.assert_array_equal(got, np.asarray(jnp.asarray(x).astype(dt), np.float32))
    elif dt == jnp.int8:
        assert np.abs(got - x).max() <= scale / 2 * (1 + 1e-6)
    else:  # e4m3: 3 mantissa bits (half-ulp 2^-4 relative), subnormal spacing 2^-9 * scale
        np.testing.assert_array_less(np.abs(got - x), np.abs(x) * 2**-4 + scale * 2**-9 + 1e-9)
    if _quantized(dtype):
        np.testing.assert_array_equal(got, want)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), num_skipped=st.integers(0, 5))
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_then_read_round_trips_and_skips_negative_slots(dtype, seed, num_skipped):
    rng = np.random.default_rng(seed)
    t = 10
    slots = rng.choice(N * S, t, replace=False).astype(np.int32)
    skipped = rng.choice(t, num_skipped, replace=False)
    slots[skipped] = -1
    k, v = _tokens(rng, t)
    cache = _new_cache(dtype)
    out = kp.write_kv(cache, _in_dtype(k, dtype), _in_dtype(v, dtype), slots, layer=1)
    chex.assert_shape(out.kv, cache.kv.shape)
    got_k, got_v = kp.read_kv(out, slots, layer=1)
    chex.assert_shape([got_k, got_v], (t, K, D))
    live = slots >= 0
    ks, vs = (K_SCALE[1], V_SCALE[1]) if _quantized(dtype) else (1.0, 1.0)
    _assert_round_trip(got_k, k, dtype, ks, rows=live)
    _assert_round_trip(got_v, v, dtype, vs, rows=live)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32)[~live], 0.0)  # slot < 0 reads 0
    # Nothing else changed: unwritten slots of layer 1 and all of layer 0 still read 0.
    rest = np.setdiff1d(ALL_SLOTS, slots[live])
    for layer, idx in ((1, rest), (0, ALL_SLOTS)):
        for x in _read_all(out, layer):
            np.testing.assert_array_equal(np.asarray(x, np.float32)[idx], 0.0)
    chex.assert_trees_all_equal((out.k_scale, out.v_scale), (cache.k_scale, cache.v_scale))


def test_write_kv_with_every_slot_negative_leaves_the_cache_unchanged():
    cache = _new_cache(jnp.int8, fill_value=0.5)
    k, v = _tokens(np.random.default_rng(4), 3)
    out = kp.write_kv(cache, k, v, np.full(3, -1, np.int32), layer=0)
    chex.assert_trees_all_equal(_snapshot(out), _snapshot(cache))


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_per_layer_scales_are_used_per_layer(dtype):
    """The same K written to both layers: each layer quantizes and dequantizes with its own
    scale (a layer read with the other layer's scale would be off by 100/64)."""
    rng = np.random.default_rng(5)
    k, v = _tokens(rng, 4)
    slots = np.array([0, 5, 9, 30], np.int32)
    cache = _new_cache(dtype)
    for layer in (0, 1):
        cache = kp.write_kv(cache, k, v, slots, layer=layer)
    for layer in (0, 1):
        got_k, got_v = kp.read_kv(cache, slots, layer=layer)
        _assert_round_trip(got_k, k, dtype, K_SCALE[layer])
        _assert_round_trip(got_v, v, dtype, V_SCALE[layer])
    # Attention over each layer matches the oracle on that layer's dequantized pages.
    tables = np.array([[0, 1, 2, 3, 4, 5, 6, 7]], np.int32)
    q = jnp.asarray(rng.standard_normal((1, H, D)), jnp.float32)
    only = kp.write_kv(_new_cache(dtype), k, v, slots, layer=0)
    for layer in (0, 1):
        full = kp.write_kv(only, k, v, np.arange(4, dtype=np.int32) + 31, layer=layer)
        out = _decode(full, q, [35], tables, layer=layer)
        _check(out, _decode_oracle(full, q, [35], tables, layer=layer), dtype)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("host", [False, True], ids=["device", "pinned_host"])
def test_fill_value_reads_back_in_every_layer_with_per_layer_scales(dtype, host):
    """The fill is in real units, quantized like a write: with each layer's own scale."""
    sharding = _pinned() if host else None
    cache = _new_cache(dtype, fill_value=0.5, sharding=sharding)
    if host:  # read it on the device
        cache = kp.swap_blocks(cache, _new_cache(dtype), ALL_SLOTS[:N], ALL_SLOTS[:N])
    for layer in range(L):
        k, v = _read_all(cache, layer)
        _assert_round_trip(k, np.full(k.shape, 0.5, np.float32), dtype, K_SCALE[layer])
        _assert_round_trip(v, np.full(v.shape, 0.5, np.float32), dtype, V_SCALE[layer])


def test_set_kv_scales_replaces_the_scales_and_refuses_float_caches():
    cache = kp.init_kv_cache(L, N, S, K, D, jnp.int8)
    np.testing.assert_array_equal(np.asarray(cache.k_scale), [1.0, 1.0])  # default 1.0
    scaled = kp.set_kv_scales(cache, k_scale=jnp.asarray([0.5, 0.25]), v_scale=0.125)
    np.testing.assert_array_equal(np.asarray(scaled.k_scale), [0.5, 0.25])
    np.testing.assert_array_equal(np.asarray(scaled.v_scale), [0.125, 0.125])
    kept = kp.set_kv_scales(scaled, v_scale=0.5)
    np.testing.assert_array_equal(np.asarray(kept.k_scale), [0.5, 0.25])  # None keeps one
    x = jnp.full((1, K, D), 10.0)
    written = kp.write_kv(scaled, x, x, np.array([3], np.int32), layer=1)
    got_k, got_v = kp.read_kv(written, np.array([3], np.int32), layer=1)
    np.testing.assert_array_equal(np.asarray(got_k), 10.0)  # 40 * 0.25
    np.testing.assert_array_equal(np.asarray(got_v), 10.0)  # 80 * 0.125
    np.testing.assert_array_equal(np.asarray(cache.k_scale), [1.0, 1.0])  # input unchanged
    for dtype in (jnp.float32, jnp.bfloat16):
        with pytest.raises(ValueError, match="has no scales"):
            kp.set_kv_scales(kp.init_kv_cache(1, 2, 2, 1, 2, dtype), k_scale=0.5)
    for bad, match in (([1.0, 2.0, 3.0], r"f32\[2\]"), (0.0, "positive"), (-1.0, "positive")):
        with pytest.raises(ValueError, match=match):
            kp.set_kv_scales(scaled, k_scale=bad)
        with pytest.raises(ValueError, match=match):
            kp.set_kv_scales(scaled, v_scale=bad)
    np.testing.assert_array_equal(np.asarray(scaled.k_scale), [0.5, 0.25])


# --------------------------------------------------------------------------------------------
# The fused write: ragged_paged_attention(new_kv=...)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_new_kv_equals_write_kv_then_attend(dtype):
    rng = np.random.default_rng(6)
    rows = [(1, 9), (5, 5), (3, 11)]
    kv_lens, cu = _ragged_batch(rows)
    cache = _new_cache(dtype, fill_value=_poison(dtype))
    # The history (kv_len - q_len tokens of each sequence) is in the cache already.
    cache, tables = _fill_sequences(rng, cache, kv_lens, layer=1, m=3)
    hist = [kv - q for q, kv in rows]
    slots = np.concatenate(
        [[tables[i, p // S] * S + p % S for p in range(h, kv)] for i, (h, kv) in
         enumerate(zip(hist, kv_lens, strict=True))] + [[-1, -1]]
    ).astype(np.int32)  # fmt: skip
    t = len(slots)
    k, v = _tokens(rng, t)
    k, v = _in_dtype(k, dtype), _in_dtype(v, dtype)
    q = jnp.asarray(rng.standard_normal((t, H, D)), _q_dtype(dtype))
    out, fused = _ragged(cache, q, kv_lens, tables, cu, layer=1, new_kv=(k, v, slots))
    written = kp.write_kv(cache, k, v, slots, layer=1)
    want = _ragged(written, q, kv_lens, tables, cu, layer=1)
    chex.assert_trees_all_equal(out, want)
    chex.assert_trees_all_equal(fused, written)
    _check(out, _ragged_oracle(written, q, kv_lens, tables, cu, layer=1), dtype)


def test_fused_new_kv_under_jit_with_a_traced_layer():
    rng = np.random.default_rng(7)
    kv_lens, cu = _ragged_batch([(2, 2)])
    cache = _new_cache(jnp.float32, fill_value=NAN)
    tables = np.array([[3, -1, -1]], np.int32)
    k, v = _tokens(rng, 2)
    q = jnp.asarray(rng.standard_normal((2, H, D)), jnp.float32)
    slots = np.array([12, 13], np.int32)

    @jax.jit
    def step(cache, layer):
        return _ragged(cache, q, kv_lens, tables, cu, layer=layer, new_kv=(k, v, slots))

    out, new = step(cache, jnp.int32(1))
    written = kp.write_kv(cache, k, v, slots, layer=1)
    chex.assert_trees_all_equal(new, written)
    _check(out, _ragged_oracle(written, q, kv_lens, tables, cu, layer=1), jnp.float32)


# --------------------------------------------------------------------------------------------
# copy_blocks / swap_blocks
# --------------------------------------------------------------------------------------------


def _filled(dtype, seed=8) -> kp.PagedKVCache:
    rng = np.random.default_rng(seed)
    cache = _new_cache(dtype)
    for layer in range(L):
        k, v = _tokens(rng, N * S)
        cache = _write(cache, _in_dtype(k, dtype), _in_dtype(v, dtype), ALL_SLOTS, layer=layer)
    return cache


def _block_slots(blocks) -> np.ndarray:
    return (np.asarray(blocks)[:, None] * S + np.arange(S)).reshape(-1).astype(np.int32)


def _assert_blocks_equal(a, a_blocks, b, b_blocks):
    """Blocks ``a_blocks`` of ``a`` read (dequantized, every layer) exactly as ``b_blocks``
    of ``b``."""
    for layer in range(L):
        got = [np.asarray(x)[_block_slots(b_blocks)] for x in _read_all(b, layer)]
        want = [np.asarray(x)[_block_slots(a_blocks)] for x in _read_all(a, layer)]
        chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_moves_stored_values_exactly_in_every_layer_and_keeps_scales(dtype):
    cache = _filled(dtype)
    src = np.array([0, 3, -1, 7], np.int32)
    dst = np.array([9, 10, 11, -1], np.int32)
    out = kp.copy_blocks(cache, src, dst)
    _assert_blocks_equal(cache, [0, 3], out, [9, 10])
    untouched = [b for b in range(N) if b not in (9, 10)]
    _assert_blocks_equal(cache, untouched, out, untouched)
    chex.assert_trees_all_equal((out.k_scale, out.v_scale), (cache.k_scale, cache.v_scale))


def test_8bit_write_kv_and_copy_blocks_through_the_tpu_kernels_equal_the_xla_path():
    """The TPU KV kernels (interpreted) move the quantized bytes the XLA path stores (int8;
    the kernels only move bytes, so fp8 takes the same 1-byte path; interpret mode is slow)."""
    dtype = jnp.int8
    rng = np.random.default_rng(9)
    k, v = _tokens(rng, 5)
    slots = np.array([3, -1, 17, 40, 9], np.int32)
    src, dst = np.array([0, 10, -1]), np.array([2, 3, 4])
    got = []
    for impl, interpret in (("reference", False), ("pallas_tpu", True)):
        out = kp.write_kv(_new_cache(dtype), k, v, slots, layer=1, impl=impl, interpret=interpret)
        got.append((out, kp.copy_blocks(out, src, dst, impl=impl, interpret=interpret)))
    chex.assert_trees_all_equal(got[0], got[1])


def _pinned() -> jax.sharding.Sharding:
    return make_single_device_sharding(jax.devices()[0], memory_kind="pinned_host")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_to_pinned_host_and_back_is_exact_and_keeps_scales(dtype):
    dev = _filled(dtype)
    host = _new_cache(dtype, sharding=_pinned())
    assert host.memory_kind == "pinned_host"
    host = kp.swap_blocks(dev, host, np.array([2, 5, -1, 12]), np.array([0, 1, 2, 3]))
    assert host.memory_kind == "pinned_host"
    chex.assert_trees_all_equal((host.k_scale, host.v_scale), (dev.k_scale, dev.v_scale))
    back = _new_cache(dtype, fill_value=_poison(dtype))
    back = kp.swap_blocks(host, back, np.array([0, 1, 3]), np.array([7, 8, 9]))
    assert back.memory_kind == "device"
    _assert_blocks_equal(dev, [2, 5, 12], back, [7, 8, 9])
    chex.assert_trees_all_equal((back.k_scale, back.v_scale), (dev.k_scale, dev.v_scale))


def test_swap_blocks_refuses_caches_that_do_not_match_including_8bit_scales():
    a = _new_cache(jnp.int8)
    with pytest.raises(ValueError, match="dtype mismatch"):
        kp.swap_blocks(a, _new_cache(jnp.float8_e4m3fn), [0], [0])
    with pytest.raises(ValueError, match="outside the block count"):
        kp.swap_blocks(a, kp.init_kv_cache(L, N, S, K, 2 * D, jnp.int8), [0], [0])
    other = kp.set_kv_scales(_new_cache(jnp.int8), v_scale=V_SCALE * 2)
    with pytest.raises(ValueError, match="v_scales differ"):
        kp.swap_blocks(a, other, [0], [0])
    with pytest.raises(ValueError, match="k_scales differ"):
        kp.swap_blocks(kp.set_kv_scales(a, k_scale=1.0), _new_cache(jnp.int8), [0], [0])
    b = kp.init_kv_cache(L, 2 * N, S, K, D, jnp.int8, k_scale=K_SCALE, v_scale=V_SCALE)
    out = kp.swap_blocks(a, b, [1], [N + 1])  # a different block count is fine
    chex.assert_shape(out.kv, b.kv.shape)


# --------------------------------------------------------------------------------------------
# Bad calls: ValueErrors naming the problem, the cache unchanged
# --------------------------------------------------------------------------------------------


def _bad_calls(cache):
    x = jnp.zeros((2, K, D), jnp.float32)
    slots = np.array([0, 1], np.int32)
    q = jnp.zeros((1, H, D), jnp.float32)
    lens, tables = jnp.array([1], jnp.int32), jnp.zeros((1, 2), jnp.int32)
    cu = jnp.array([0, 1], jnp.int32)
    pair = (cache.kv, cache.kv)
    return [
        ("PagedKVCache", lambda: kp.write_kv(pair, x, x, slots, layer=0)),
        ("PagedKVCache", lambda: kp.read_kv(pair, slots, layer=0)),
        ("PagedKVCache", lambda: kp.copy_blocks(pair, [0], [1])),
        ("PagedKVCache", lambda: kp.swap_blocks(pair, cache, [0], [1])),
        ("PagedKVCache", lambda: kp.paged_attention(q, pair, lens, tables, layer=0)),
        ("PagedKVCache", lambda: kp.ragged_paged_attention(q, pair, lens, tables, cu, 1)),
        ("out of range", lambda: kp.write_kv(cache, x, x, slots, layer=2)),
        ("out of range", lambda: kp.read_kv(cache, slots, layer=-1)),
        ("out of range", lambda: kp.paged_attention(q, cache, lens, tables, layer=5)),
        ("2 layers; pass layer=", lambda: kp.write_kv(cache, x, x, slots)),
        ("2 layers; pass layer=", lambda: kp.read_kv(cache, slots)),
        ("2 layers; pass layer=", lambda: kp.paged_attention(q, cache, lens, tables)),
        ("2 layers; pass layer=", lambda: kp.ragged_paged_attention(q, cache, lens, tables, cu, 1)),
        ("same shape", lambda: kp.write_kv(cache, x, x[:1], slots, layer=0)),
        ("K=2, D=8", lambda: kp.write_kv(cache, x[:, :1], x[:, :1], slots, layer=0)),
        ("floating point", lambda: kp.write_kv(cache, x.astype(jnp.int32), x, slots, layer=0)),
        ("duplicate", lambda: kp.write_kv(cache, x, x, np.array([3, 3], np.int32), layer=0)),
        ("out of range", lambda: kp.write_kv(cache, x, x, np.array([0, N * S]), layer=0)),
        ("out of range", lambda: kp.read_kv(cache, np.array([N * S]), layer=0)),
        ("1-D integer", lambda: kp.read_kv(cache, np.zeros((1, 1), np.int32), layer=0)),
        ("also a source", lambda: kp.copy_blocks(cache, [0, 1], [1, 2])),
        ("new_kv must be a tuple", lambda: kp.ragged_paged_attention(
            q, cache, lens, tables, cu, 1, layer=0, new_kv=(x, x))),
        ("same shape", lambda: kp.ragged_paged_attention(
            q, cache, lens, tables, cu, 1, layer=0, new_kv=(x, x[:1], slots))),
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8], ids=["f32", "int8"])
def test_bad_calls_raise_value_errors_naming_the_problem_and_leave_the_cache_unchanged(dtype):
    cache = _filled(dtype)
    before = _snapshot(cache)
    for match, call in _bad_calls(cache):
        with pytest.raises(ValueError, match=match):
            call()
    chex.assert_trees_all_equal(_snapshot(cache), before)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dtype=jnp.int32), "dtype must be one of"),
        (dict(dtype="float64"), "dtype must be one of"),
        (dict(dtype="not-a-dtype"), "unknown dtype"),
        (dict(dtype=jnp.int8, k_scale=np.ones(3)), r"scalar or f32\[2\]"),
        (dict(dtype=jnp.int8, v_scale=np.ones((2, 1))), r"scalar or f32\[2\]"),
        (dict(dtype=jnp.int8, k_scale=0.0), "finite and positive"),
        (dict(dtype=jnp.float8_e4m3fn, v_scale=[1.0, -2.0]), "finite and positive"),
        (dict(dtype=jnp.int8, k_scale=NAN), "finite and positive"),
        (dict(dtype=jnp.int8, fill_value=NAN), "int8 cache cannot hold fill_value=nan"),
        (dict(dtype=jnp.float32, k_scale=0.5), "8-bit caches only"),
        (dict(dtype=jnp.bfloat16, v_scale=[1.0, 2.0]), "8-bit caches only"),
        (dict(dtype=jnp.float32, num_blocks=0), "num_blocks must be a positive int"),
    ],
)
def test_init_kv_cache_bad_arguments_raise_value_error(kwargs, match):
    args = dict(num_layers=L, num_blocks=N, block_size=S, num_kv_heads=K, head_dim=D) | kwargs
    with pytest.raises(ValueError, match=match):
        kp.init_kv_cache(**args)


def test_kv_cache_shape_is_the_abstract_value_of_init_kv_cache():
    for dtype in (jnp.float32, jnp.int8):
        want = kp.init_kv_cache(L, N, S, K, D, dtype)
        got = kp.kv_cache_shape(L, N, S, K, D, dtype)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), got) == jax.tree.map(
            lambda x: (x.shape, x.dtype), want
        )
    cache = kp.init_kv_cache(L, N, S, K, D, jnp.int8)
    assert (cache.num_layers, cache.num_blocks, cache.block_size) == (L, N, S)
    assert (cache.num_kv_heads, cache.head_dim, cache.quantized) == (K, D, True)
    assert cache.nbytes == 2 * L * N * S * K * D
    assert kp.kv_cache_bytes_per_block(L, S, K, D, jnp.int8) * N == cache.nbytes
