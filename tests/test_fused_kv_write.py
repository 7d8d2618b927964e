"""The KV write fused into the TPU attention kernels (``new_kv=``), in TPU interpret mode.

The fused kernels read a step's new tokens from its K/V inputs (the pages' copy of those
positions is never read) and write them to their slots with one DMA each while attending.
Equality is the property: the same output and the same pages, bit for bit in the pages, as
the plain path (``write_kv`` then attention) for decode, prefill, chunked prefill, prefix
hits, mixed batches, padding rows, sliding windows and 8-bit caches, with NaN in every slot
nothing wrote (so a read of an unwritten or skipped row would show).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels_pallas as kp
from kernels_pallas.kv_layout import merge_kv, page_shape
from kernels_pallas.tpu.kv_ops import write_kv_tpu
from kernels_pallas.tpu.paged_attention import paged_attention_tpu

_D = 128


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))


def _pages(rng, layers, blocks, s, k, dtype, tables, cached):
    """Pages holding values at each sequence's cached positions (``p < cached[i]``) and NaN
    (8-bit: the largest values) everywhere else: a read of any other row would show."""
    shape = page_shape(layers, blocks, s, k, _D, dtype)
    x = np.full(shape, np.nan, np.float32)
    tables = np.asarray(tables)
    for i, n in enumerate(cached):
        for p in range(n):
            x[:, tables[i, p // s], p % s] = rng.standard_normal(shape[3:])
    if jnp.dtype(dtype).itemsize == 1:
        return jnp.asarray(np.where(np.isnan(x), 127, np.clip(x * 20, -100, 100)), dtype)
    return jnp.asarray(x, dtype)


def _decode_batch(rng, lengths, s, blocks):
    """Tables giving each sequence its own blocks; slots of each row's last position."""
    b = len(lengths)
    m = max(1, -(-max(lengths) // s))
    ids = rng.permutation(blocks)[: b * m].reshape(b, m)
    slots = np.array(
        [ids[i, (n - 1) // s] * s + (n - 1) % s if n > 0 else -1 for i, n in enumerate(lengths)],
        np.int32,
    )
    return jnp.asarray(ids, jnp.int32), jnp.asarray(slots)


# CI runs bfloat16; float32 (~24 s of interpreted kernels) under -m slow: the public op's
# fused form on a float32 cache stays in CI (test_kv_cache_api).
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), window=st.sampled_from([None, 5]))
def test_fused_decode_write_matches_write_then_attend(dtype, seed, window):
    rng = np.random.default_rng(seed)
    layers, blocks, s, k, h = 2, 24, 8, 2, 4
    lengths = [int(x) for x in rng.integers(1, 30, 3)] + [0]  # a padding row last
    tables, slots = _decode_batch(rng, lengths, s, blocks)
    pages = _pages(rng, layers, blocks, s, k, dtype, tables, [max(n - 1, 0) for n in lengths])
    q = jnp.asarray(rng.standard_normal((4, h, _D)), dtype)
    kv_new = merge_kv(
        jnp.asarray(rng.standard_normal((4, k, _D)), dtype),
        jnp.asarray(rng.standard_normal((4, k, _D)), dtype),
    )
    kw = dict(num_kv_heads=k, sm_scale=_D**-0.5, sliding_window=window, layer=1, interpret=True)
    lens = jnp.asarray(lengths, jnp.int32)
    written = write_kv_tpu(pages, kv_new, slots, 1, interpret=True)
    want = paged_attention_tpu(q, written, lens, tables, **kw)
    got, got_pages = paged_attention_tpu(q, pages, lens, tables, new_kv=(kv_new, slots), **kw)
    np.testing.assert_array_equal(_bits(got_pages), _bits(written))
    chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-6)
    assert not np.isnan(np.asarray(got, np.float32)).any()


def _ragged_batch(rng, q_lens, kv_lens, s, blocks, t):
    """Tables with each sequence's own blocks, ``cu_q_lens`` and the slots of every new row
    (padding rows past the last sequence: -1)."""
    b = len(q_lens)
    m = max(1, -(-max(kv_lens) // s))
    ids = rng.permutation(blocks)[: b * m].reshape(b, m)
    slots = np.full(t, -1, np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    for i in range(b):
        for r in range(q_lens[i]):
            p = kv_lens[i] - q_lens[i] + r
            slots[cu[i] + r] = ids[i, p // s] * s + p % s
    return jnp.asarray(ids, jnp.int32), jnp.asarray(cu), jnp.asarray(slots)


# CI runs bfloat16 (the served dtype; ~30 s of interpreted kernels per dtype); float32 under
# -m slow (the decode kernel's fused write keeps both dtypes in CI).
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16])
@settings(max_examples=3, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    window=st.sampled_from([None, 6]),
    first_seq=st.sampled_from([0, 2]),
)
def test_fused_ragged_write_matches_write_then_attend(dtype, seed, window, first_seq):
    """Prefill, chunks after cached prefixes and decodes in one batch, two query blocks;
    ``first_seq``: the leading sequences belong to another kernel (not attended, not
    written here)."""
    from kernels_pallas.tpu.ragged_paged_attention import ragged_paged_attention_tpu

    rng = np.random.default_rng(seed)
    layers, blocks, s, k, h, t = 2, 40, 8, 2, 4, 24
    q_lens = [1, 1, int(rng.integers(5, 12)), 1, int(rng.integers(1, 5))]
    kv_lens = [int(n + rng.integers(0, 20)) for n in q_lens]
    tables, cu, slots = _ragged_batch(rng, q_lens, kv_lens, s, blocks, t)
    cached = [n - q for n, q in zip(kv_lens, q_lens, strict=True)]
    pages = _pages(rng, layers, blocks, s, k, dtype, tables, cached)
    q = jnp.asarray(rng.standard_normal((t, h, _D)), dtype)
    kv_new = merge_kv(
        jnp.asarray(rng.standard_normal((t, k, _D)), dtype),
        jnp.asarray(rng.standard_normal((t, k, _D)), dtype),
    )
    kw = dict(
        num_kv_heads=k, sm_scale=_D**-0.5, sliding_window=window, layer=1, interpret=True,
        queries_per_block=8,
    )  # fmt: skip
    lens = jnp.asarray(kv_lens, jnp.int32)
    n = len(q_lens)
    mine = np.arange(t) >= int(cu[first_seq])  # rows of the sequences this kernel runs
    written = write_kv_tpu(pages, kv_new, jnp.where(mine, slots, -1), 1, interpret=True)
    want = ragged_paged_attention_tpu(q, written, lens, tables, cu, n, first_seq, **kw)
    got, got_pages = ragged_paged_attention_tpu(
        q, pages, lens, tables, cu, n, first_seq, new_kv=(kv_new, slots), **kw
    )
    np.testing.assert_array_equal(_bits(got_pages), _bits(written))
    chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-6)
    assert not np.isnan(np.asarray(got, np.float32)).any()


def _public_case(rng, dtype, q_lens, kv_lens, pad):
    s, k, blocks = 8, 2, 32
    t = sum(q_lens) + pad
    tables, cu, slots = _ragged_batch(rng, q_lens, kv_lens, s, blocks, t)
    kw = dict(k_scale=0.05, v_scale=0.04) if jnp.dtype(dtype).itemsize == 1 else {}
    cache = kp.init_kv_cache(2, blocks, s, k, _D, dtype, **kw)
    fill = np.full(cache.kv.shape, np.nan if jnp.dtype(dtype).itemsize > 1 else 0, np.float32)
    cache = cache.replace(kv=jnp.asarray(fill, dtype))  # no row is ever read unwritten
    hist = np.concatenate(
        [np.asarray(tables)[i, p // s] * s + p % s for i, (q, n) in
         enumerate(zip(q_lens, kv_lens, strict=True)) for p in [np.arange(n - q)]]
    ).astype(np.int32)  # fmt: skip
    kh, vh = (jnp.asarray(rng.standard_normal((len(hist), k, _D)), jnp.float32) for _ in "kv")
    cache = kp.write_kv(cache, kh, vh, hist, layer=1)
    k_new, v_new = (jnp.asarray(rng.standard_normal((t, k, _D)), jnp.bfloat16) for _ in "kv")
    q = jnp.asarray(rng.standard_normal((t, 4, _D)), jnp.bfloat16)
    lens, n = jnp.asarray(kv_lens, jnp.int32), len(q_lens)
    return cache, q, lens, tables, cu, n, (k_new, v_new, slots)


_CASES = {
    "decodes-then-chunks": ([1, 1, 7, 1, 3], 3, None),
    "decode-only-hint": ([1, 1, 1], 2, 1),
    "chunk-first": ([4, 1, 1], 0, None),
}
_DTYPES = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# CI runs each case and each dtype once; the other pairs are `-m slow`.
_FAST = {("bf16", "decodes-then-chunks"), ("int8", "decode-only-hint"), ("fp8", "chunk-first")}


@pytest.mark.parametrize(
    "dtype,q_lens,pad,hint",
    [
        pytest.param(
            _DTYPES[d], *_CASES[c], id=f"{d}-{c}",
            marks=() if (d, c) in _FAST else pytest.mark.slow,
        )
        for d in _DTYPES
        for c in _CASES
    ],
)  # fmt: skip
def test_public_fused_new_kv_matches_write_kv_then_attention(dtype, q_lens, pad, hint):
    """The public op's fused form on the TPU kernels (8-bit caches quantize the new rows
    with the layer's scales) against ``write_kv`` then the same kernels."""
    rng = np.random.default_rng(len(q_lens) + pad)
    kv_lens = [q + int(rng.integers(0, 19)) for q in q_lens]
    cache, q, lens, tables, cu, n, new = _public_case(rng, dtype, q_lens, kv_lens, pad)
    kw = dict(layer=1, impl="pallas_tpu", interpret=True, max_q_len=hint)
    out, fused = kp.ragged_paged_attention(q, cache, lens, tables, cu, n, new_kv=new, **kw)
    written = kp.write_kv(cache, *new, layer=1, impl="pallas_tpu", interpret=True)
    want = kp.ragged_paged_attention(q, written, lens, tables, cu, n, **kw)
    np.testing.assert_array_equal(_bits(fused.kv), _bits(written.kv))
    chex.assert_trees_all_close(out, want, atol=1e-6, rtol=1e-6)
    assert not np.isnan(np.asarray(out, np.float32)).any()


def test_fused_decode_rows_past_the_table_are_still_written():
    """A decode-only hint with more rows than the table has sequences: the rows no decode
    program runs get their tokens written too (as ``write_kv`` would)."""
    from kernels_pallas.tpu import routing

    rng = np.random.default_rng(3)
    cache, q, lens, tables, cu, n, (k, v, slots) = _public_case(rng, jnp.float32, [1, 1], [5, 9], 0)
    extra = jnp.asarray([40, 41], jnp.int32)  # two more rows, slots in blocks nobody owns
    k2, v2 = (jnp.concatenate([x, x[:2] + 1]) for x in (k, v))
    slots2 = jnp.concatenate([slots, extra])
    q2 = jnp.concatenate([q, q[:2]])
    rows = kp.cache.merged_rows(cache, k2, v2, 1)
    kw = dict(num_kv_heads=2, sm_scale=_D**-0.5)
    out, pages = routing.decode_rows(
        q2, cache.kv, lens, tables, jnp.int32(n), 1, True, kw, (rows, slots2)
    )
    written = write_kv_tpu(cache.kv, rows, slots2, 1, interpret=True)
    np.testing.assert_array_equal(_bits(pages), _bits(written))
    assert not np.asarray(out[2:]).any()  # padding rows: zeros


@pytest.mark.parametrize(
    "hint", [None, pytest.param(1, marks=pytest.mark.slow)], ids=["mixed", "decode-only"]
)  # the mixed batch runs both kernels (its leading decodes on the decode kernel)
def test_unique_slots_skips_the_dedupe_sort_and_writes_the_same_pages(hint):
    """``unique_slots=True`` (a served step's promise) gives the same output and pages as the
    default on distinct slots, and its TPU program sorts no slots; the default's sorts them
    once (duplicates resolved once per call, not once per kernel). The interpreter's own
    sorts (random DMA order, ``u32``) are not counted."""
    q_lens, pad = ([1, 1, 7, 1, 3], 3) if hint is None else ([1, 1, 1], 2)
    rng = np.random.default_rng(7)
    kv_lens = [q + int(rng.integers(0, 19)) for q in q_lens]
    cache, q, lens, tables, cu, n, new = _public_case(rng, jnp.bfloat16, q_lens, kv_lens, pad)
    kw = dict(layer=1, impl="pallas_tpu", interpret=True, max_q_len=hint)
    t = q.shape[0]
    slot_sort = f"}}) : (tensor<{t}xi32>, tensor<{t}xi32>) -> "  # an argsort of the T slots

    def run(unique):
        def f(q, cache, new):
            return kp.ragged_paged_attention(
                q, cache, lens, tables, cu, n, new_kv=new, unique_slots=unique, **kw
            )

        sorts = jax.jit(f).lower(q, cache, new).as_text().count(slot_sort)
        return f(q, cache, new), sorts

    (out, fused), sorts = run(True)
    (want, written), sorts_default = run(False)
    np.testing.assert_array_equal(_bits(fused.kv), _bits(written.kv))
    np.testing.assert_array_equal(_bits(out), _bits(want))
    assert (sorts, sorts_default) == (0, 1)
