"""Paged attention (decode and ragged) against the oracles in ``kernels_pallas.reference``.

Every case runs through the public API (a ``PagedKVCache`` from ``init_kv_cache`` filled with
NaN, the tokens written with ``write_kv``) with ``impl="reference"``, ``impl="auto"``, the TPU
Pallas kernel in interpret mode and, when ``kernels_pallas.gpu.attention`` is installed, the
GPU Pallas kernel in interpret mode. Pages are filled with NaN everywhere no token was written,
block tables are random permutations (never the identity) and table entries past a sequence's
last block point at other sequences' blocks or are -1, so any read of unwritten data shows up
as NaN or as a mismatch. Cases hold one layer's ``[N, S, C, P, D]`` pages (``merge_kv``:
``kernels_pallas.kv_layout``); the array-level ops take them stacked, ``[L, N, S, C, P, D]``.

The fast subset keeps shapes tiny (TPU interpret mode simulates every DMA); the wide grid of
the issue is marked ``slow``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import kernels_pallas as kp
from kernels_pallas import kv_layout, reference
from kernels_pallas.attention import (
    leading_decode_seqs,
    paged_attention_pages,
    ragged_paged_attention_pages,
)

HAS_GPU_KERNELS = importlib.util.find_spec("kernels_pallas.gpu.attention") is not None

# (impl, interpret) pairs run for every case; the oracle is compared against each.
IMPLS = [
    pytest.param("reference", False, id="reference"),
    pytest.param("auto", False, id="auto"),
    pytest.param("pallas_tpu", True, id="pallas_tpu_interpret"),
    pytest.param(
        "pallas_gpu",
        True,
        id="pallas_gpu_interpret",
        marks=pytest.mark.skipif(not HAS_GPU_KERNELS, reason="GPU kernels not installed"),
    ),
]


def _with_impls(cases: list, gpu_fast: int = 1) -> list:
    """Cross cases with IMPLS; GPU interpret runs past the first ``gpu_fast`` cases are slow
    (tests/test_gpu_kernels.py covers that kernel in depth)."""
    out = []
    for n, case in enumerate(cases):
        for impl in IMPLS:
            marks = list(case.marks) + list(impl.marks)
            if impl.id == "pallas_gpu_interpret" and n >= gpu_fast:
                marks.append(pytest.mark.slow)
            out.append(
                pytest.param(*case.values, *impl.values, id=f"{case.id}-{impl.id}", marks=marks)
            )
    return out


def _tols(dtype) -> dict:
    if dtype == jnp.bfloat16:
        return dict(atol=2e-2, rtol=2e-2)
    return dict(atol=2e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Case builders
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    q: np.ndarray
    kv_pages: np.ndarray  # one layer's [N, S, C, P, D] (kernels_pallas.kv_layout)
    kv_lens: np.ndarray
    block_tables: np.ndarray
    k_heads: int
    cu_q_lens: np.ndarray | None = None
    num_seqs: int | None = None


def _fill_pages(rng, kv_lens, tables, k_heads, n_blocks, s, d, dtype):
    """One layer's ``[N, S, C, P, D]`` pages that hold random K/V at written slots and NaN
    everywhere else (K and V merged token-major with ``merge_kv``)."""
    kpg, vpg = np.full((2, n_blocks, s, k_heads, d), np.nan, np.float32)
    for b, length in enumerate(kv_lens):
        for p in range(length):
            blk = tables[b, p // s]
            kpg[blk, p % s] = rng.normal(size=(k_heads, d))
            vpg[blk, p % s] = rng.normal(size=(k_heads, d))
    return np.asarray(kv_layout.merge_kv(jnp.asarray(kpg, dtype), jnp.asarray(vpg, dtype)))


def _tables(rng, lens, s, m, n_blocks, n_real=None):
    """Random (non-identity) block tables; entries past a row's last block are -1 or junk."""
    b = len(lens)
    tables = rng.permutation(n_blocks)[: b * m].reshape(b, m).astype(np.int32)
    n_real = b if n_real is None else n_real
    for i, length in enumerate(lens):
        used = -(-length // s) if i < n_real else 0
        if i % 2 == 0:
            tables[i, used:] = -1  # "no block"
        # odd rows keep other blocks (possibly another sequence's) past their last block
    return tables


def decode_case(rng, lens, h, k_heads, d, s, m, dtype) -> Case:
    lens = np.asarray(lens, np.int32)
    n_blocks = len(lens) * m + 3
    tables = _tables(rng, lens, s, m, n_blocks)
    kv = _fill_pages(rng, lens, tables, k_heads, n_blocks, s, d, dtype)
    q = rng.normal(size=(len(lens), h, d)).astype(dtype)
    return Case(q, kv, lens, tables, k_heads)


def ragged_case(rng, q_lens, kv_lens, num_seqs, t, h, k_heads, d, s, m, dtype) -> Case:
    """Sequences past ``num_seqs`` are padding (junk kv_lens, empty query ranges)."""
    q_lens = np.asarray(q_lens, np.int32)
    kv_lens = np.asarray(kv_lens, np.int32)
    b = len(q_lens)
    cu = np.zeros(b + 1, np.int32)
    cu[1 : num_seqs + 1] = np.cumsum(q_lens[:num_seqs])
    cu[num_seqs + 1 :] = cu[num_seqs]
    assert cu[num_seqs] <= t
    n_blocks = b * m + 3
    tables = _tables(rng, kv_lens, s, m, n_blocks, n_real=num_seqs)
    written = np.where(np.arange(b) < num_seqs, kv_lens, 0)
    kv = _fill_pages(rng, written, tables, k_heads, n_blocks, s, d, dtype)
    q = rng.normal(size=(t, h, d)).astype(dtype)  # padding rows: finite junk
    junk = kv_lens.copy()
    junk[num_seqs:] = rng.integers(1, m * s, size=b - num_seqs)
    return Case(q, kv, junk, tables, k_heads, cu, num_seqs)


def as_cache(kv_pages, k_heads: int) -> kp.PagedKVCache:
    """The public cache holding these pages (one layer's ``[N, S, C, P, D]``, or
    ``[L, N, S, C, P, D]`` for L layers): NaN-filled by ``init_kv_cache``, every written
    (non-NaN) slot of every layer written with ``write_kv``; unwritten slots stay NaN."""
    kv_pages = np.asarray(kv_pages)
    if kv_pages.ndim == 5:
        kv_pages = kv_pages[None]
    layers, n, s, _, _, d = kv_pages.shape
    cache = kp.init_kv_cache(layers, n, s, k_heads, d, kv_pages.dtype, fill_value=float("nan"))
    for layer in range(layers):
        written = ~np.isnan(np.asarray(kv_pages[layer, :, :, 0, 0, 0], np.float32))  # [N, S]
        blk, off = np.nonzero(written)
        slots = (blk * s + off).astype(np.int32)
        k, v = kv_layout.split_kv(jnp.asarray(kv_pages[layer, blk, off]), k_heads)  # [T, K, D]
        cache = kp.write_kv(cache, k, v, slots, layer=layer)
    np.testing.assert_array_equal(  # the cache holds exactly these pages (NaN where unwritten)
        np.asarray(cache.kv, np.float32), np.asarray(kv_pages, np.float32)
    )
    return cache


def _run_decode(case: Case, impl: str, interpret: bool, **kw) -> jax.Array:
    return kp.paged_attention(
        jnp.asarray(case.q),
        as_cache(case.kv_pages, case.k_heads),
        jnp.asarray(case.kv_lens),
        jnp.asarray(case.block_tables),
        impl=impl,
        interpret=interpret,
        **kw,
    )


def _run_ragged(case: Case, impl: str, interpret: bool, **kw) -> jax.Array:
    return kp.ragged_paged_attention(
        jnp.asarray(case.q),
        as_cache(case.kv_pages, case.k_heads),
        jnp.asarray(case.kv_lens),
        jnp.asarray(case.block_tables),
        jnp.asarray(case.cu_q_lens),
        case.num_seqs,
        impl=impl,
        interpret=interpret,
        **kw,
    )


_ORACLE_STATIC = ("num_kv_heads", "sm_scale", "soft_cap", "sliding_window")
_paged_oracle = jax.jit(reference.paged_attention_reference, static_argnames=_ORACLE_STATIC)
_ragged_naive = jax.jit(reference.ragged_paged_attention_reference, static_argnames=_ORACLE_STATIC)


def _decode_oracle(case: Case, **kw) -> jax.Array:
    return _paged_oracle(
        case.q, case.kv_pages, case.kv_lens, case.block_tables, num_kv_heads=case.k_heads, **kw
    )


def _ragged_oracle(case: Case, **kw) -> jax.Array:
    return _ragged_naive(
        case.q,
        case.kv_pages,
        case.kv_lens,
        case.block_tables,
        case.cu_q_lens,
        case.num_seqs,
        num_kv_heads=case.k_heads,
        **kw,
    )


def _check(out, want, dtype):
    chex.assert_shape(out, want.shape)
    assert out.dtype == want.dtype
    assert np.isfinite(np.asarray(out, np.float32)).all(), "output has NaN/inf"
    assert np.isfinite(np.asarray(want, np.float32)).all(), "oracle has NaN/inf"
    chex.assert_trees_all_close(
        np.asarray(out, np.float32), np.asarray(want, np.float32), **_tols(dtype)
    )


# --------------------------------------------------------------------------------------------
# Fast subset
# --------------------------------------------------------------------------------------------

# (h, k_heads, d, s, dtype, options). Lengths always include 1, 0 and multiples of S.
DECODE_FAST = [
    pytest.param(4, 4, 64, 8, jnp.float32, {}, id="mha-d64-s8-f32"),
    pytest.param(8, 2, 128, 16, jnp.bfloat16, dict(soft_cap=5.0), id="gqa4-d128-s16-bf16-cap"),
    pytest.param(8, 1, 64, 8, jnp.float32, dict(sliding_window=11, sm_scale=0.3), id="mqa-window"),
]


@pytest.mark.parametrize("h,k_heads,d,s,dtype,opts,impl,interpret", _with_impls(DECODE_FAST))
def test_decode_matches_oracle_on_nan_filled_pages(h, k_heads, d, s, dtype, opts, impl, interpret):
    rng = np.random.default_rng(0)
    m = 4
    lens = [1, s, 2 * s + 3, 0, m * s]  # 1, exact multiples, partial, padding row, capacity
    case = decode_case(rng, lens, h, k_heads, d, s, m, dtype)
    out = _run_decode(case, impl, interpret, **opts)
    _check(out, _decode_oracle(case, **opts), dtype)
    np.testing.assert_array_equal(np.asarray(out[3], np.float32), 0.0)  # length-0 row


# q_lens / kv_lens: decode, whole prefill, chunked prefill, prefix hit, empty query, then
# padded sequences; T leaves padded rows at the end.
RAGGED_Q = [1, 5, 4, 3, 0, 1, 2]
RAGGED_KV = [9, 5, 16, 11, 7, 1, 3]
RAGGED_NUM_SEQS = 6

RAGGED_FAST = [
    pytest.param(4, 4, 64, 8, jnp.float32, {}, id="mha-d64-s8-f32"),
    pytest.param(8, 2, 128, 8, jnp.bfloat16, dict(soft_cap=4.0), id="gqa4-d128-bf16-cap"),
    pytest.param(8, 1, 64, 16, jnp.float32, dict(sliding_window=6), id="mqa-s16-window"),
]


@pytest.mark.parametrize("h,k_heads,d,s,dtype,opts,impl,interpret", _with_impls(RAGGED_FAST))
def test_ragged_mixed_batch_matches_oracle(h, k_heads, d, s, dtype, opts, impl, interpret):
    rng = np.random.default_rng(1)
    t = sum(RAGGED_Q[:RAGGED_NUM_SEQS]) + 3
    case = ragged_case(rng, RAGGED_Q, RAGGED_KV, RAGGED_NUM_SEQS, t, h, k_heads, d, s, 3, dtype)
    out = _run_ragged(case, impl, interpret, **opts)
    _check(out, _ragged_oracle(case, **opts), dtype)
    total = case.cu_q_lens[RAGGED_NUM_SEQS]
    np.testing.assert_array_equal(np.asarray(out[total:], np.float32), 0.0)  # padded rows


def test_ragged_xla_matches_naive_oracle_on_mixed_batch():
    rng = np.random.default_rng(2)
    case = ragged_case(rng, RAGGED_Q, RAGGED_KV, RAGGED_NUM_SEQS, 20, 8, 2, 64, 8, 3, np.float32)
    for opts in (dict(sliding_window=5, soft_cap=3.0),):
        out = reference.ragged_paged_attention_xla(
            case.q, case.kv_pages[None], case.kv_lens, case.block_tables, case.cu_q_lens,
            case.num_seqs, num_kv_heads=case.k_heads, **opts,
        )  # fmt: skip
        _check(out, _ragged_oracle(case, **opts), np.float32)


def test_ragged_with_one_token_per_sequence_equals_decode():
    rng = np.random.default_rng(3)
    case = decode_case(rng, [1, 8, 13, 0], 8, 2, 64, 8, 2, np.float32)
    cu = np.arange(5, dtype=np.int32)
    cache = as_cache(case.kv_pages, case.k_heads)
    # impl="pallas" on CPU is the TPU kernel in interpret mode
    for impl, interpret in (("reference", False), ("pallas", True)):
        out = kp.ragged_paged_attention(
            jnp.asarray(case.q), cache, case.kv_lens, case.block_tables, cu, 4,
            impl=impl, interpret=interpret,
        )  # fmt: skip
        _check(out, _decode_oracle(case), np.float32)


@pytest.mark.parametrize("window", [None, 9])
def test_tpu_ragged_masked_steps_at_every_width_match_oracle(window):
    """A masked compute step runs at the narrowest compiled width (a quarter, a half, all of
    its pages) that holds the pages its rows may see: prefill blocks whose diagonal steps
    need 1 to 4 of 4 pages, a prefix hit, decodes, a window; NaN in unwritten slots (a
    width too narrow drops keys, one too wide reads NaN past the length)."""
    from kernels_pallas.tpu.ragged_paged_attention import ragged_paged_attention_tpu

    rng = np.random.default_rng(5)
    q_lens, kv_lens = [1, 29, 6, 1, 0], [23, 29, 40, 2, 3]
    case = ragged_case(rng, q_lens, kv_lens, 4, 40, 4, 2, 64, 4, 11, np.float32)
    opts = dict(sm_scale=0.3, sliding_window=window)
    want = _ragged_oracle(case, **opts)
    for tq in (2, 5):
        out = ragged_paged_attention_tpu(
            case.q, case.kv_pages[None], case.kv_lens, case.block_tables, case.cu_q_lens,
            case.num_seqs, num_kv_heads=case.k_heads, interpret=True,
            pages_per_compute_block=4, queries_per_block=tq, **opts,
        )  # fmt: skip
        _check(out, want, np.float32)


@pytest.mark.parametrize("sm_scale", [4.0, pytest.param(1e-3, marks=pytest.mark.slow)])
def test_tpu_kernels_with_the_scale_in_the_exponent_match_oracle(sm_scale):
    """The TPU kernels fold ``sm_scale`` into the softmax's exponent (``exp2``) and mask
    unscaled logits: a scale above 1 (the mask value divided by it, no overflow to -inf) and
    a tiny one, with windows that leave rows seeing nothing and NaN in unwritten slots."""
    rng = np.random.default_rng(31)
    opts = dict(sm_scale=sm_scale, sliding_window=3)
    case = ragged_case(rng, RAGGED_Q, RAGGED_KV, RAGGED_NUM_SEQS, 20, 8, 2, 64, 8, 3, np.float32)
    out = _run_ragged(case, "pallas_tpu", True, **opts)
    _check(out, _ragged_oracle(case, **opts), np.float32)
    dec = decode_case(rng, [1, 8, 19, 0], 8, 2, 64, 8, 3, np.float32)
    out = _run_decode(dec, "pallas_tpu", True, **opts)
    _check(out, _decode_oracle(dec, **opts), np.float32)
    np.testing.assert_array_equal(np.asarray(out[3]), 0.0)


def test_tpu_mixed_batch_splits_leading_decodes_exactly():
    """The TPU path hands a batch's leading one-row sequences to the decode kernel and the
    rest to the ragged kernel (``first_seq``): the result is the oracle's, with NaN in every
    unwritten slot, a one-row sequence after a prefill (it stays in the ragged kernel) and
    junk past ``num_seqs``; the ragged kernel alone leaves the leading decodes' rows to the
    decode kernel."""
    from kernels_pallas.tpu.ragged_paged_attention import ragged_paged_attention_tpu

    rng = np.random.default_rng(11)
    q_lens, kv_lens, num_seqs = [1, 1, 1, 6, 1, 0, 2], [9, 17, 1, 12, 4, 7, 3], 6
    t = sum(q_lens[:num_seqs]) + 2
    case = ragged_case(rng, q_lens, kv_lens, num_seqs, t, 8, 2, 64, 8, 3, np.float32)
    want = _ragged_oracle(case, sliding_window=10)
    out = _run_ragged(case, "pallas_tpu", True, sliding_window=10)
    _check(out, want, np.float32)
    np.testing.assert_array_equal(np.asarray(out[case.cu_q_lens[num_seqs] :]), 0.0)

    n_dec = int(leading_decode_seqs(jnp.asarray(case.cu_q_lens), jnp.int32(num_seqs)))
    assert n_dec == 3
    kv = case.kv_pages[None]
    rag = ragged_paged_attention_tpu(
        case.q, kv, case.kv_lens, case.block_tables, case.cu_q_lens, case.num_seqs, n_dec,
        num_kv_heads=case.k_heads, sm_scale=64**-0.5, sliding_window=10, interpret=True,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(rag[:n_dec]), 0.0)
    _check(rag[n_dec:], want[n_dec:], np.float32)
    # query blocks smaller than the batch: the skipped rows are moved out of the blocks (they
    # start at the first ragged sequence) and the output moved back
    for tq in (2, 5):
        rag = ragged_paged_attention_tpu(
            case.q, kv, case.kv_lens, case.block_tables, case.cu_q_lens, case.num_seqs,
            n_dec, num_kv_heads=case.k_heads, sm_scale=64**-0.5, sliding_window=10,
            interpret=True, queries_per_block=tq,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(rag[:n_dec]), 0.0)
        np.testing.assert_array_equal(np.asarray(rag[case.cu_q_lens[num_seqs] :]), 0.0)
        _check(rag[n_dec:], want[n_dec:], np.float32)


@pytest.mark.slow
@pytest.mark.parametrize(
    "q_lens,kv_lens,num_seqs",
    [
        pytest.param([1, 1, 1, 1, 1], [9, 1, 24, 8, 5], 4, id="all-decode-no-hint"),
        pytest.param([3, 1, 1, 5], [3, 9, 2, 20], 4, id="prefill-leads"),
    ],
)
def test_tpu_ragged_batch_without_leading_prefill_or_decode(q_lens, kv_lens, num_seqs):
    """Either kernel's ``lax.cond`` branch skipped: decodes only (no hint) and a prefill
    first (no leading decodes: everything in the ragged kernel)."""
    rng = np.random.default_rng(12)
    t = sum(q_lens[:num_seqs]) + 2
    case = ragged_case(rng, q_lens, kv_lens, num_seqs, t, 8, 2, 64, 8, 3, np.float32)
    out = _run_ragged(case, "pallas_tpu", True, sliding_window=10)
    _check(out, _ragged_oracle(case, sliding_window=10), np.float32)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(q_lens=st.lists(st.integers(0, 3), min_size=1, max_size=8), data=st.data())
def test_leading_decode_seqs_counts_the_one_row_prefix(q_lens, data):
    num_seqs = data.draw(st.integers(0, len(q_lens)))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    want = 0
    while want < num_seqs and q_lens[want] == 1:
        want += 1
    got = leading_decode_seqs(jnp.asarray(cu), jnp.int32(num_seqs))
    assert int(got) == want


def test_tpu_kernels_never_copy_pages_past_length_or_before_window():
    """Table entries the kernel must not touch hold out-of-range ids: interpret mode raises on
    any out-of-bounds DMA, so passing proves those pages were never copied."""
    rng = np.random.default_rng(4)
    s, m = 8, 6
    case = decode_case(rng, [3, 17, 40, 0], 2, 1, 64, s, m, np.float32)
    bad = case.kv_pages.shape[0] + 1000
    tables = case.block_tables.copy()
    window = 9
    for b, length in enumerate(case.kv_lens):
        used = -(-int(length) // s)
        tables[b, used:] = bad
        first = max(int(length) - window, 0) // s
        tables[b, :first] = bad
    case = dataclasses.replace(case, block_tables=tables)
    out = _run_decode(case, "pallas_tpu", True, sliding_window=window)
    _check(out, _decode_oracle(case, sliding_window=window), np.float32)

    cu = np.arange(5, dtype=np.int32)
    out = kp.ragged_paged_attention(
        jnp.asarray(case.q), as_cache(case.kv_pages, case.k_heads), case.kv_lens, tables, cu, 4,
        sliding_window=window, impl="pallas_tpu", interpret=True,
    )  # fmt: skip
    _check(out, _decode_oracle(case, sliding_window=window), np.float32)


@pytest.mark.parametrize("dtype,k_heads", [(jnp.float8_e4m3fn, 3)], ids=["fp8-K3-dummy"])
def test_xla_path_never_reads_a_dummy_head_or_a_table_entry_past_a_length(dtype, k_heads):
    """The XLA path (``impl="reference"``, ``auto`` on CPU, the GPU fallback) on pages NaN
    wherever it must not read: unwritten slots, block 0 (where it sends block columns a row
    does not see), the block that table entries past a sequence's last block point at, and
    in an 8-bit cache of odd K every slot's dummy head (combined heads ``2K .. C * P - 1``).
    Its output is finite and bit-equal to its output with the NaNs zeroed (which meets the
    oracle)."""
    rng = np.random.default_rng(41)
    h, d, s, m = 2 * k_heads, 16, 4, 4
    q_lens, kv_lens, num_seqs = [1, 5, 2, 1, 0], [6, 9, 13, 1, 3], 4
    b, t, n = len(q_lens), sum(q_lens) + 2, len(q_lens) * m + 2
    tables = (1 + rng.permutation(n - 2)[: b * m]).reshape(b, m).astype(np.int32)
    for i, length in enumerate(kv_lens):  # past the last block: the NaN block n - 1, or -1
        tables[i, (-(-length // s) if i < num_seqs else 0) :] = n - 1 if i % 2 == 0 else -1
    pos = [np.arange(kv_lens[i]) for i in range(num_seqs)]
    slots = np.concatenate([tables[i, p // s] * s + p % s for i, p in enumerate(pos)])
    cache = kp.init_kv_cache(1, n, s, k_heads, d, dtype, fill_value=float("nan"))
    cast = jnp.float32 if cache.quantized else dtype  # an 8-bit cache quantizes f32 K/V
    k, v = jnp.asarray(rng.normal(size=(2, len(slots), k_heads, d)), cast)
    cache = kp.write_kv(cache, k, v, slots.astype(np.int32))
    c, p = cache.kv.shape[3:5]
    pad = c * p > 2 * k_heads  # a dummy head fills the last word
    assert cache.kv_head_pad == int(pad)
    dummy = jnp.arange(c * p)[:, None] >= 2 * k_heads  # [C * P, 1]: a dummy combined head
    rows = jnp.where(dummy, jnp.asarray(np.nan, dtype), cache.kv.reshape(1, n, s, c * p, d))
    poisoned = cache.replace(kv=rows.reshape(cache.kv.shape))
    nan = np.isnan(np.asarray(poisoned.kv, np.float32))
    assert nan[0, 0].all() and nan[0, n - 1].all() and nan[..., -1, -1, :].all() == pad
    clean = poisoned.replace(kv=jnp.where(nan, jnp.zeros((), dtype), poisoned.kv))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(t, h, d)), cast)
    lens = np.where(np.arange(b) < num_seqs, kv_lens, 0).astype(np.int32)
    args = (jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), num_seqs)
    kw = dict(num_kv_heads=k_heads, **(dict(k_scale=1.0, v_scale=1.0) if cache.quantized else {}))
    xla = reference.ragged_paged_attention_xla
    cuda_form = dict(chunk_bytes=reference.XLA_GPU_CHUNK_BYTES, native_operands=True)

    def xla_runs(cache: kp.PagedKVCache) -> list:
        return [
            kp.ragged_paged_attention(q, cache, *args, impl="reference"),
            # one block column a loop step: every column a row does not see gathers block 0
            xla(q, cache.kv, *args, chunk_bytes=1, **kw),
            xla(q, cache.kv, *args, **cuda_form, **kw),  # big chunks, 16-bit operands
            kp.paged_attention(q[:b], cache, lens, tables, impl="reference"),
        ]

    want = xla_runs(clean)
    for got, ok in zip(xla_runs(poisoned), want, strict=True):
        assert np.isfinite(np.asarray(got, np.float32)).all(), "a poisoned value was read"
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ok, np.float32))
    oracle = reference.ragged_paged_attention_reference(q, clean.kv[0], *args, **kw)
    _check(want[0], oracle, jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32)


@pytest.mark.parametrize("impl,interpret", IMPLS[:3])
def test_stacked_layer_pages_select_layer_under_scan(impl, interpret):
    """A multi-layer cache + a traced ``layer``: each scan step sees its own layer."""
    rng = np.random.default_rng(5)
    layers = 2
    base = decode_case(rng, [5, 12], 4, 2, 64, 8, 2, np.float32)
    tables = base.block_tables
    cases = [base]
    for _ in range(layers - 1):  # same tables and lengths, different page contents per layer
        kv = _fill_pages(rng, base.kv_lens, tables, 2, base.kv_pages.shape[0], 8, 64, np.float32)
        cases.append(dataclasses.replace(base, kv_pages=kv))
    cache = as_cache(np.stack([c.kv_pages for c in cases]), 2)
    q = jnp.asarray(cases[0].q)
    lens = jnp.asarray(cases[0].kv_lens)
    cu = jnp.arange(3, dtype=jnp.int32)

    def step(_, layer):
        dec = kp.paged_attention(
            q, cache, lens, tables, impl=impl, interpret=interpret, layer=layer
        )
        rag = kp.ragged_paged_attention(
            q, cache, lens, tables, cu, 2, impl=impl, interpret=interpret, layer=layer
        )
        return None, (dec, rag)

    _, (dec, rag) = jax.lax.scan(step, None, jnp.arange(layers, dtype=jnp.int32))
    for i, c in enumerate(cases):
        want = _decode_oracle(c)
        _check(dec[i], want, np.float32)
        _check(rag[i], want, np.float32)


# --------------------------------------------------------------------------------------------
# Bad arguments
# --------------------------------------------------------------------------------------------


def _good_args():
    """Array-level ``(q, kv_pages, lengths, tables)``: one layer of K = 2 f32 heads."""
    q = jnp.zeros((2, 4, 8), jnp.float32)
    pages = jnp.zeros(kv_layout.page_shape(1, 6, 4, 2, 8, jnp.float32), jnp.float32)
    return q, pages, jnp.array([1, 2], jnp.int32), jnp.zeros((2, 3), jnp.int32)


def _good_cache_args():
    q, _, lens, tables = _good_args()
    return q, kp.init_kv_cache(1, 6, 4, 2, 8, jnp.float32), lens, tables


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: (a[0][0],) + a[1:], "q must have rank 3"),
        (lambda a: (jnp.zeros((2, 3, 8)),) + a[1:], "not divisible"),
        (lambda a: (jnp.zeros((2, 4, 16)),) + a[1:], "head_dim mismatch"),
        (lambda a: (a[0].astype(jnp.bfloat16),) + a[1:], "dtype mismatch"),
        (lambda a: a[:2] + (jnp.array([1, 2, 3], jnp.int32), a[3]), "lengths"),
        (lambda a: a[:3] + (jnp.zeros((3, 3), jnp.int32),), "batch"),
        (lambda a: a[:3] + (jnp.zeros((2,), jnp.int32),), "rank 2"),
        (lambda a: a[:3] + (jnp.zeros((2, 3), jnp.float32),), "integer"),
        (lambda a: (a[0], a[1].kv) + a[2:], "expected a kernels_pallas.PagedKVCache"),
    ],
)
def test_decode_bad_arguments_raise_value_error(mutate, match):
    with pytest.raises(ValueError, match=match):
        kp.paged_attention(*mutate(_good_cache_args()))


@pytest.mark.parametrize(
    "mutate,kw,match",
    [
        (lambda a: (a[0], a[1][0]) + a[2:], {}, "rank 6"),
        # the packing axis must be the dtype's: f32 packs 1 head a word, bf16 2
        (lambda a: (a[0], a[1].reshape(1, 6, 4, 2, 2, 8)) + a[2:], {}, "must pack P=1"),
        (lambda a: (a[0], a[1].astype(jnp.bfloat16)) + a[2:], {}, "must pack P=2"),
        (lambda a: a, dict(num_kv_heads=3), "num_kv_heads=3 does not fit"),
        (lambda a: a, dict(num_kv_heads=0), "num_kv_heads=0 does not fit"),
        (lambda a: a, dict(num_kv_heads=2.0), "does not fit"),
        (lambda a: a, dict(num_kv_heads=True), "does not fit"),
        (lambda a: (a[0].astype(jnp.bfloat16),) + a[1:], {}, "dtype mismatch"),
        (lambda a: (jnp.zeros((2, 3, 8)),) + a[1:], {}, "not divisible"),
        (lambda a: (jnp.zeros((2, 4, 16)),) + a[1:], {}, "head_dim mismatch"),
    ],
)
def test_decode_on_page_arrays_bad_arguments_raise_value_error(mutate, kw, match):
    """The array-level form (``paged_attention_pages``) checks its pages itself: rank 6, the
    dtype's packing on axis 4, a ``num_kv_heads`` that fits ``C * P / 2``."""
    with pytest.raises(ValueError, match=match):
        paged_attention_pages(*mutate(_good_args()), **{"num_kv_heads": 2, **kw})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(impl="triton"), "impl must be one of"),
        (dict(impl="pallas"), "interpret=True"),
        (dict(impl="pallas_tpu"), "interpret=True"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(soft_cap=-1.0), "soft_cap"),
        (dict(layer=1), "out of range"),
    ],
)
def test_decode_bad_options_raise_value_error(kwargs, match):
    if jax.default_backend() == "tpu" and "interpret" in match:
        pytest.skip("the TPU kernel needs no interpret mode on a TPU")
    with pytest.raises(ValueError, match=match):
        kp.paged_attention(*_good_cache_args(), **kwargs)


def test_page_arrays_of_one_layer_take_layer_0_or_none():
    """Pages are always stacked: with L = 1 ``layer`` may be left out (it is layer 0); any
    other layer, or a non-integer one, is refused."""
    q, pages, lens, tables = _good_args()
    pages = pages.at[0, 0].set(1.0)  # the block every table row points at
    out = paged_attention_pages(q, pages, lens, tables, num_kv_heads=2)
    np.testing.assert_array_equal(np.asarray(out), 1.0)  # V = 1 everywhere it reads
    same = paged_attention_pages(q, pages, lens, tables, num_kv_heads=2, layer=0)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(out))
    with pytest.raises(ValueError, match="out of range"):
        paged_attention_pages(q, pages, lens, tables, num_kv_heads=2, layer=1)
    with pytest.raises(ValueError, match="layer must be an integer"):
        paged_attention_pages(q, pages, lens, tables, num_kv_heads=2, layer=True)
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        paged_attention_pages(q, pages, lens, tables, num_kv_heads=2, layer=jnp.zeros(1))


def test_multi_layer_cache_needs_a_valid_layer():
    q, _, lens, tables = _good_cache_args()
    cache = kp.init_kv_cache(2, 6, 4, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match="2 layers; pass layer="):
        kp.paged_attention(q, cache, lens, tables)
    with pytest.raises(ValueError, match="out of range"):
        kp.paged_attention(q, cache, lens, tables, layer=2)
    q, pages, lens, tables = _good_args()
    stacked = jnp.concatenate([pages, pages])  # L = 2
    with pytest.raises(ValueError, match="need layer="):
        paged_attention_pages(q, stacked, lens, tables, num_kv_heads=2)
    with pytest.raises(ValueError, match="out of range"):
        paged_attention_pages(q, stacked, lens, tables, num_kv_heads=2, layer=2)


def test_ragged_bad_arguments_raise_value_error():
    q, cache, lens, tables = _good_cache_args()
    cu = jnp.array([0, 1, 2], jnp.int32)
    with pytest.raises(ValueError, match="cu_q_lens"):
        kp.ragged_paged_attention(q, cache, lens, tables, cu[:2], 2)
    with pytest.raises(ValueError, match="kv_lens"):
        kp.ragged_paged_attention(q, cache, lens[:1], tables, cu, 2)
    with pytest.raises(ValueError, match="num_seqs"):
        kp.ragged_paged_attention(q, cache, lens, tables, cu, 3)
    with pytest.raises(ValueError, match="num_seqs"):
        kp.ragged_paged_attention(q, cache, lens, tables, cu, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="not divisible"):
        kp.ragged_paged_attention(jnp.zeros((2, 3, 8)), cache, lens, tables, cu, 2)
    with pytest.raises(ValueError, match="new_kv must be a tuple"):
        kp.ragged_paged_attention(q, cache, lens, tables, cu, 2, new_kv=(q, q))
    _, pages, _, _ = _good_args()
    q3 = jnp.zeros((2, 3, 8))
    with pytest.raises(ValueError, match="not divisible"):
        ragged_paged_attention_pages(q3, pages, lens, tables, cu, 2, num_kv_heads=2)
    with pytest.raises(ValueError, match="does not fit"):
        ragged_paged_attention_pages(q, pages, lens, tables, cu, 2, num_kv_heads=4)


def test_pallas_gpu_without_gpu_module_raises_not_implemented():
    if HAS_GPU_KERNELS:
        pytest.skip("GPU kernels are installed")
    with pytest.raises(NotImplementedError):
        kp.paged_attention(*_good_cache_args(), impl="pallas_gpu", interpret=True)


@pytest.mark.parametrize(
    "h,k_heads",
    [
        pytest.param(12, 2, id="g6"),
        pytest.param(6, 2, id="g3", marks=pytest.mark.slow),
        pytest.param(10, 2, id="g5", marks=pytest.mark.slow),
        pytest.param(7, 1, id="g7", marks=pytest.mark.slow),
    ],
)
def test_tpu_ragged_kernel_for_group_sizes_off_the_8_row_tile(h, k_heads):
    """G = 3, 5, 6, 7 (Qwen2 shapes): query blocks of TQ tokens with TQ * G a multiple of 8
    (the default rule's 128 rows: G = 6 takes 16 tokens, 96 rows); 30 tokens span two
    blocks and split sequences."""
    from kernels_pallas.tpu.ragged_paged_attention import default_queries_per_block

    g = h // k_heads
    assert (default_queries_per_block(64, g) * g) % 8 == 0
    rng = np.random.default_rng(20 + g)
    q_lens, kv_lens = [1, 13, 9, 2, 0], [17, 13, 30, 5, 4]
    case = ragged_case(rng, q_lens, kv_lens, 4, 30, h, k_heads, 64, 8, 4, jnp.bfloat16)
    out = _run_ragged(case, "pallas_tpu", True, sliding_window=11, soft_cap=5.0)
    _check(out, _ragged_oracle(case, sliding_window=11, soft_cap=5.0), jnp.bfloat16)


# --------------------------------------------------------------------------------------------
# Wide grid (slow)
# --------------------------------------------------------------------------------------------

HEADS = [(8, 8), (8, 2), (8, 1)]  # H / K in {1, 4, 8}
HEAD_DIMS = [64, 128, 256]
BLOCK_SIZES = [8, 16, 32, 64]
DTYPES = [jnp.float32, jnp.bfloat16]
OPTIONS = [{}, dict(soft_cap=3.0), dict(sliding_window=13), dict(sm_scale=0.05, soft_cap=8.0)]


def _wide_cases(n: int = 12) -> list:
    """``n`` cases in which every value of every axis appears (not every combination)."""
    cases = []
    for i in range(n):
        h, kh = HEADS[i % 3]
        d = HEAD_DIMS[(i // 3) % 3]
        s = BLOCK_SIZES[i % 4]
        dt = DTYPES[(i // 2) % 2]
        opts = OPTIONS[(i + i // 4) % 4]
        name = f"h{h}k{kh}-d{d}-s{s}-{jnp.dtype(dt).name}-{'+'.join(sorted(opts)) or 'plain'}"
        cases.append(pytest.param(h, kh, d, s, dt, opts, id=name))
    return cases


WIDE = _wide_cases()


@pytest.mark.slow
@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("h,k_heads,d,s,dtype,opts", WIDE)
def test_decode_wide_grid(h, k_heads, d, s, dtype, opts, impl, interpret):
    rng = np.random.default_rng(10)
    m = 3
    lens = [1, s, int(rng.integers(2, m * s)), 0, m * s, s + 1]
    case = decode_case(rng, lens, h, k_heads, d, s, m, dtype)
    _check(_run_decode(case, impl, interpret, **opts), _decode_oracle(case, **opts), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("h,k_heads,d,s,dtype,opts", WIDE)
def test_ragged_wide_grid(h, k_heads, d, s, dtype, opts, impl, interpret):
    rng = np.random.default_rng(11)
    m = 3
    cap = m * s
    # decode, prefill of a whole block, chunked prefill, prefix hit at capacity, padded seqs
    q_lens = [1, s, 3, 2, 0, 1]
    kv_lens = [int(rng.integers(1, cap)), s, 2 * s + 1, cap, 5, 2]
    t = sum(q_lens[:4]) + 2
    case = ragged_case(rng, q_lens, kv_lens, 4, t, h, k_heads, d, s, m, dtype)
    _check(_run_ragged(case, impl, interpret, **opts), _ragged_oracle(case, **opts), dtype)


@pytest.mark.slow
def test_tpu_kernels_with_several_pages_per_step_and_query_blocks():
    from kernels_pallas.tpu.paged_attention import paged_attention_tpu
    from kernels_pallas.tpu.ragged_paged_attention import ragged_paged_attention_tpu

    rng = np.random.default_rng(12)
    case = ragged_case(rng, RAGGED_Q, RAGGED_KV, RAGGED_NUM_SEQS, 20, 8, 2, 64, 4, 5, np.float32)
    want = _ragged_oracle(case, sm_scale=0.2, sliding_window=7)
    for p, tq in itertools.product([1, 2, 3], [1, 3, 8]):
        out = ragged_paged_attention_tpu(
            case.q, case.kv_pages[None], case.kv_lens, case.block_tables, case.cu_q_lens,
            case.num_seqs, num_kv_heads=2, sm_scale=0.2, sliding_window=7, interpret=True,
            pages_per_compute_block=p, queries_per_block=tq,
        )  # fmt: skip
        _check(out, want, np.float32)
    dec = decode_case(rng, [1, 4, 19, 0, 20], 8, 2, 64, 4, 5, np.float32)
    want = _decode_oracle(dec, soft_cap=2.0)
    for p in (1, 2, 3, 5):
        out = paged_attention_tpu(
            dec.q, dec.kv_pages[None], dec.kv_lens, dec.block_tables, num_kv_heads=2,
            sm_scale=64**-0.5, soft_cap=2.0, interpret=True, pages_per_compute_block=p,
        )  # fmt: skip
        _check(out, want, np.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tpu_kernels_lower_to_mosaic(monkeypatch, dtype):
    """Lower both TPU kernels for a TPU target (Pallas -> Mosaic MLIR) without a TPU: catches
    primitives the Mosaic lowering lacks. The TPU generation is faked (v5e) through JAX
    internals; skipped if those moved. Mosaic's own compile passes run only on a TPU."""
    if jax.default_backend() == "tpu":
        pytest.skip("compiled for real in the kernel tests")
    try:
        from jax._src.pallas.mosaic import tpu_info

        fake = tpu_info._get_tpu_info_impl(tpu_info.ChipVersion.TPU_V5E, 1)
    except (ImportError, AttributeError, TypeError) as e:
        pytest.skip(f"JAX internals changed: {e}")
    monkeypatch.setattr(tpu_info, "get_tpu_info", lambda: fake)
    from kernels_pallas.tpu.paged_attention import paged_attention_tpu
    from kernels_pallas.tpu.ragged_paged_attention import ragged_paged_attention_tpu

    b, h, kh, d, s, m, n, t = 8, 32, 8, 128, 16, 16, 128, 64
    spec = jax.ShapeDtypeStruct
    pages = spec(kv_layout.page_shape(2, n, s, kh, d, dtype), dtype)
    i32 = jnp.int32
    opts = dict(num_kv_heads=kh, sm_scale=0.1, soft_cap=30.0, sliding_window=64)

    def decode(q, kv, lens, bt, layer):
        return paged_attention_tpu(q, kv, lens, bt, layer=layer, **opts)

    def ragged(q, kv, lens, bt, cu, ns, layer):
        return ragged_paged_attention_tpu(q, kv, lens, bt, cu, ns, layer=layer, **opts)

    lowered = [
        jax.jit(decode)
        .trace(spec((b, h, d), dtype), pages, spec((b,), i32), spec((b, m), i32),
               spec((), i32))
        .lower(lowering_platforms=("tpu",)),
        jax.jit(ragged)
        .trace(spec((t, h, d), dtype), pages, spec((b,), i32), spec((b, m), i32),
               spec((b + 1,), i32), spec((), i32), spec((), i32))
        .lower(lowering_platforms=("tpu",)),
    ]  # fmt: skip
    for low in lowered:
        assert "tpu_custom_call" in low.as_text()
