"""GPU paged attention kernels against the oracles in kernels_pallas.reference.

The Mosaic GPU (Hopper) kernels: on a GPU backend every case runs the compiled kernel; elsewhere
it runs the same kernel body in Mosaic GPU's interpret mode. One Pallas Triton case checks that
kernel's reads of the page layout (its own file is ``test_gpu_triton.py``). Pages are the stacked
token-major ``kv_pages [L, N, S, C, P, D]`` (:mod:`kernels_pallas.kv_layout`); unwritten page
slots are NaN so any read past a length shows up, and the other layers differ so a wrong layer
shows up.
"""

from __future__ import annotations

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from test_attention_kernels import as_cache

import kernels_pallas as kp
from kernels_pallas import compat, kv_layout, reference
from kernels_pallas.gpu import attention as ga
from kernels_pallas.gpu import triton_attention as ta
from kernels_pallas.gpu import work

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _tol(dtype) -> dict:
    t = TOL[jnp.dtype(dtype).type]
    return dict(atol=t, rtol=t)


def _pages_and_tables(rng, *, kv_heads, d, s, n, m, kv_lens, dtype, layers=1):
    """Random distinct block tables (not identity), -1 past each sequence; stacked pages
    ``[L, N, S, C, P, D]``, NaN where unwritten (in every layer; int8: values of about
    ``40 * N(0, 1)`` and 127 where unwritten)."""
    b = len(kv_lens)
    tables = np.full((b, m), -1, np.int32)
    written = np.zeros((n, s), bool)
    perm = rng.permutation(n)
    nxt = 0
    for i, length in enumerate(kv_lens):
        nb = -(-int(length) // s)
        assert nb <= m and nxt + nb <= n, "test case does not fit"
        tables[i, :nb] = perm[nxt : nxt + nb]
        for j in range(nb):
            written[perm[nxt + j], : min(s, int(length) - j * s)] = True
        nxt += nb
    shape = (layers, n, s, kv_heads, d)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[:, ~written] = np.nan
    v[:, ~written] = np.nan
    if jnp.dtype(dtype) == jnp.int8:
        k, v = (np.where(np.isnan(x), 127, np.clip(np.round(x * 40), -127, 127)) for x in (k, v))
    kv = kv_layout.merge_kv(jnp.asarray(k, dtype), jnp.asarray(v, dtype))
    return kv, jnp.asarray(tables)


def _decode_want(q, kv, kv_heads, lengths, tables, layer=0, **kw):
    """The decode oracle on layer ``layer`` of stacked pages."""
    return reference.paged_attention_reference(
        q, kv[layer], lengths, tables, num_kv_heads=kv_heads, **kw
    )


def _ragged_want(q, kv, kv_heads, kv_lens, tables, cu, nseq, layer=0, **kw):
    """The ragged oracle on layer ``layer`` of stacked pages."""
    return reference.ragged_paged_attention_reference(
        q, kv[layer], kv_lens, tables, cu, nseq, num_kv_heads=kv_heads, **kw
    )


def _decode_case(seed, *, g, kv_heads=2, d=64, s=16, m=6, lengths, dtype=jnp.float32, layers=1):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    n = max(8, int(sum(-(-int(x) // s) for x in lengths)) + 3)
    kv, tables = _pages_and_tables(
        rng, kv_heads=kv_heads, d=d, s=s, n=n, m=m, kv_lens=lengths, dtype=dtype, layers=layers
    )
    q = jnp.asarray(rng.standard_normal((len(lengths), kv_heads * g, d)), dtype)
    return q, kv, jnp.asarray(lengths), tables


def _ragged_case(seed, *, g, kv_heads=2, d=64, s=16, m=5, rows, pad_rows, num_pad_seqs=1,
                 dtype=jnp.float32):  # fmt: skip
    """``rows``: list of (q_len, kv_len) for real sequences; padded sequences and rows added."""
    rng = np.random.default_rng(seed)
    q_lens = [ql for ql, _ in rows] + [2] * num_pad_seqs
    kv_lens = np.asarray([kl for _, kl in rows] + [3] * num_pad_seqs, np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[len(rows)]) + pad_rows
    cu = np.minimum(cu, t)  # padded sequences may claim rows past T: they do not count anyway
    n = int(sum(-(-int(x) // s) for x in kv_lens)) + 3
    kv, tables = _pages_and_tables(
        rng, kv_heads=kv_heads, d=d, s=s, n=n, m=m, kv_lens=kv_lens, dtype=dtype
    )
    q_dtype = jnp.float32 if jnp.dtype(dtype) == jnp.int8 else dtype
    q = jnp.asarray(rng.standard_normal((t, kv_heads * g, d)), q_dtype)
    return q, kv, jnp.asarray(kv_lens), tables, jnp.asarray(cu), jnp.int32(len(rows))


def _check(out, want, dtype):
    chex.assert_shape(out, want.shape)
    out32 = np.asarray(out, np.float32)
    assert np.isfinite(out32).all(), "NaN/inf leaked into the output"
    chex.assert_trees_all_close(out32, np.asarray(want, np.float32), **_tol(dtype))


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------

DECODE_FAST = [
    # g, kv_heads, d, s, dtype, soft_cap, window, num_splits
    pytest.param(1, 2, 128, 16, jnp.float32, None, None, 1, id="mha-d128-s16-f32-layer1"),
    # D = 256: two-stage pipeline, output stored in four 64-column chunks; 3 kv heads (C = 3)
    pytest.param(4, 3, 256, 8, jnp.bfloat16, None, None, 2, id="gqa4-k3-d256-s8-bf16-split2"),
    pytest.param(8, 2, 64, 32, jnp.float32, 30.0, None, 3, id="gqa8-d64-s32-f32-softcap-split3"),
    # S = 128: a KV step is a 64-token slice of one page
    pytest.param(4, 2, 64, 128, jnp.float32, None, 20, 2, id="gqa4-d64-s128-f32-window-split2"),
]


@pytest.mark.parametrize("g,kv_heads,d,s,dtype,soft_cap,window,splits", DECODE_FAST)
def test_decode_matches_oracle_despite_nan_pages(
    g, kv_heads, d, s, dtype, soft_cap, window, splits
):
    m = max(2, 128 // s)
    cap = m * s
    lengths = [1, 0, s, cap, 2 * s + 3][: 4 if s >= 64 else 5]
    layers, layer = (2, 1) if g == 1 else (1, 0)  # the MHA case reads layer 1 of two
    q, kv, lengths, tables = _decode_case(
        0, g=g, kv_heads=kv_heads, d=d, s=s, m=m, lengths=lengths, dtype=dtype, layers=layers
    )
    if layers > 1:  # the other layer differs: reading it would show
        kv = kv.at[0].multiply(-2.0)
    kw = dict(sm_scale=d**-0.5, soft_cap=soft_cap, sliding_window=window)
    out = ga.paged_attention_gpu(
        q, kv, lengths, tables, num_kv_heads=kv_heads, interpret=INTERPRET, num_splits=splits,
        layer=jnp.int32(layer), **kw,
    )  # fmt: skip
    want = _decode_want(q, kv, kv_heads, lengths, tables, layer, **kw)
    _check(out, want, dtype)
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)  # length 0 -> zeros


@pytest.mark.skipif(ON_GPU, reason="the race detector is part of the CPU interpreter")
def test_pipeline_has_no_smem_races_when_stages_are_reused():
    """5 KV steps through 3 stages: every TMA write is ordered after the reads of the stage."""
    q, kv, lengths, tables = _decode_case(9, g=4, kv_heads=1, s=32, m=10, lengths=[300, 70])
    try:
        out = ga.paged_attention_gpu(
            q, kv, lengths, tables, num_kv_heads=1, sm_scale=0.125, num_splits=1,
            interpret=compat.mosaic_gpu_interpret_params(detect_races=True),
        )  # fmt: skip
        jax.block_until_ready(out)
    finally:
        races = compat.mosaic_gpu_races_found()
        compat.mosaic_gpu_reset_interpreter()
    assert not races
    want = _decode_want(q, kv, 1, lengths, tables, sm_scale=0.125)
    _check(out, want, jnp.float32)


def test_few_live_sequences_get_split_by_need_and_dead_items_are_ignored():
    """Default splits: one live sequence of 5 KV steps takes 5 items of the budget (the other
    items, and the empty sequence, are dead: no Q load, no output write, ignored by the
    combine), and the result is the oracle's."""
    q, kv, lengths, tables = _decode_case(9, g=4, kv_heads=1, s=32, m=10, lengths=[300, 0])
    items, item_tile = work.plan_items(ga.decode_work(lengths, None), 1, None, True)
    np.testing.assert_array_equal(np.asarray(item_tile), [0, 0, 0, 0, 0, 2, 2, 2])
    out = ga.paged_attention_gpu(
        q, kv, lengths, tables, num_kv_heads=1, sm_scale=0.125, interpret=INTERPRET
    )
    want = _decode_want(q, kv, 1, lengths, tables, sm_scale=0.125)
    _check(out, want, jnp.float32)


# ---------------------------------------------------------------------------------------------
# Ragged
# ---------------------------------------------------------------------------------------------

# (q_len, kv_len): decode, whole prefill, chunked prefill, prefix hit, length-1 prefill.
# With G = 4 a tile holds 16 tokens, so the 20-token prefill spans two tiles.
MIXED_ROWS = [(1, 37), (20, 20), (9, 48), (3, 19), (1, 1)]


@pytest.mark.parametrize(
    "g,dtype,soft_cap,window,via_dispatch",
    [
        pytest.param(1, jnp.float32, None, None, True, id="mha-f32-via-public-dispatch"),
        pytest.param(4, jnp.bfloat16, 20.0, 11, False, id="gqa4-bf16-softcap-window-split2"),
    ],
)
def test_ragged_mixed_batch_matches_oracle(g, dtype, soft_cap, window, via_dispatch):
    q, kv, kv_lens, tables, cu, nseq = _ragged_case(
        4, g=g, rows=MIXED_ROWS, pad_rows=3, dtype=dtype
    )
    kw = dict(sm_scale=0.125, soft_cap=soft_cap, sliding_window=window)
    args = (q, kv, kv_lens, tables, cu, nseq)
    if via_dispatch:  # kernels_pallas.ragged_paged_attention(impl="pallas_gpu") -> this kernel
        cache = as_cache(kv, 2)  # the public cache holding these (NaN-filled) pages
        out = kp.ragged_paged_attention(
            q, cache, *args[2:], impl="pallas_gpu", interpret=INTERPRET, **kw
        )
    else:
        out = ga.ragged_paged_attention_gpu(
            *args, num_kv_heads=2, interpret=INTERPRET, num_splits=2, **kw
        )
    want = _ragged_want(q, kv, 2, *args[2:], **kw)
    _check(out, want, dtype)
    np.testing.assert_array_equal(np.asarray(out[int(cu[nseq]) :], np.float32), 0.0)


def test_triton_reads_each_heads_k_and_v_from_8bit_pages_with_a_dummy_head():
    """The Pallas Triton kernel (interpreted) on int8 pages of 3 kv heads: 4 heads a 32-bit
    word, so ``C = 2`` rows hold K0 V0 K1 V1 | K2 V2 and a dummy head; layer 1 of 2; unwritten
    slots and the other layer hold extreme values a wrong read would show."""
    kh, kw = 3, dict(sm_scale=0.25, k_scale=0.03, v_scale=0.02)
    q, kv, kv_lens, tables, cu, nseq = _ragged_case(
        6, g=2, kv_heads=kh, d=16, s=8, m=7, rows=MIXED_ROWS, pad_rows=2, dtype=jnp.int8
    )
    kv = jnp.concatenate([jnp.full_like(kv, -127), kv])  # layer 0: junk
    assert kv.shape[3:5] == (2, 4) and kv_layout.kv_head_pad(kh, kv.dtype) == 1
    args = (q, kv, kv_lens, tables, cu, nseq)
    out = ta.ragged_paged_attention_triton(*args, num_kv_heads=kh, layer=1, interpret=True, **kw)
    _check(out, _ragged_want(q, kv, kh, *args[2:], layer=1, **kw), jnp.float32)
    b = len(MIXED_ROWS)
    out = ta.paged_attention_triton(
        q[:b], kv, kv_lens[:b], tables[:b], num_kv_heads=kh, layer=jnp.int32(1), num_splits=2,
        interpret=True, **kw,
    )  # fmt: skip
    _check(out, _decode_want(q[:b], kv, kh, kv_lens[:b], tables[:b], 1, **kw), jnp.float32)


def test_f32_pages_outside_interpret_take_the_xla_path_reading_the_stacked_layer():
    """The compiled kernel's wgmma takes bf16/f16 only: f32 pages outside interpret mode run
    the exact XLA path (on any backend), which must read layer 1 of stacked pages, not 0."""
    q, kv, lengths, tables = _decode_case(3, g=2, lengths=[5, 19, 0], layers=3)
    kv = kv.at[0].multiply(3.0).at[2].multiply(-1.0)  # a wrong layer shows
    out = ga.paged_attention_gpu(
        q, kv, lengths, tables, num_kv_heads=2, sm_scale=0.125, layer=jnp.int32(1)
    )
    want = _decode_want(q, kv, 2, lengths, tables, 1, sm_scale=0.125)
    _check(out, want, jnp.float32)

    q, kv1, kv_lens, tables, cu, nseq = _ragged_case(5, g=2, rows=MIXED_ROWS, pad_rows=2)
    kv = jnp.concatenate([3.0 * kv1, kv1, -kv1])
    args = (q, kv, kv_lens, tables, cu, nseq)
    out = ga.ragged_paged_attention_gpu(*args, num_kv_heads=2, sm_scale=0.125, layer=1)
    want = _ragged_want(*args[:2], 2, *args[2:], layer=1, sm_scale=0.125)
    _check(out, want, jnp.float32)


# ---------------------------------------------------------------------------------------------
# Host-side logic (pure XLA: work lists, split combine, support checks)
# ---------------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    q_lens=st.lists(st.integers(0, 13), min_size=4, max_size=4),
    extra=st.lists(st.integers(0, 20), min_size=4, max_size=4),
    num_seqs=st.integers(0, 4),
    tpt=st.sampled_from([1, 4, 8]),
    window=st.sampled_from([None, 5]),
)
def test_ragged_work_tiles_cover_every_real_row_exactly_once(q_lens, extra, num_seqs, tpt, window):
    t = 40
    q_lens = np.asarray(q_lens, np.int32)
    cu = np.minimum(np.concatenate([[0], np.cumsum(q_lens)]), t).astype(np.int32)
    kv_lens = (q_lens + np.asarray(extra, np.int32)).astype(np.int32)
    meta, tile_of_row, slot_of_row = _ragged_work_jit(
        jnp.asarray(kv_lens), jnp.asarray(cu), jnp.int32(num_seqs), t, tpt, window
    )
    meta, tile_of_row, slot_of_row = map(np.asarray, (meta, tile_of_row, slot_of_row))
    _, pos, valid = map(
        np.asarray,
        reference.ragged_row_info(jnp.asarray(cu), jnp.asarray(kv_lens), num_seqs, t),
    )
    covered = np.zeros(t, int)
    for _seq, row0, nq, pos0, lo, hi, *_ in meta:
        assert 0 <= nq <= tpt and lo <= hi
        for j in range(nq):
            r = row0 + j
            covered[r] += 1
            assert pos[r] == pos0 + j
            lo_r = 0 if window is None else max(pos[r] - window + 1, 0)
            assert lo <= lo_r and pos[r] + 1 <= hi  # the tile's key range covers every row's
    real = np.arange(t) < cu[num_seqs]
    np.testing.assert_array_equal(covered, real.astype(int))
    for r in np.flatnonzero(valid):
        w = tile_of_row[r]
        assert meta[w, 1] + slot_of_row[r] == r and slot_of_row[r] < meta[w, 2]


_ragged_work_jit = jax.jit(ga.ragged_work, static_argnums=(3, 4, 5))


def test_combine_of_split_partials_equals_one_softmax_and_dead_items_are_ignored():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((3, 12)).astype(np.float32)  # 3 rows, 12 keys
    vals = rng.standard_normal((12, 5)).astype(np.float32)
    bounds = [0, 5, 5, 12]  # the middle split is empty
    os_, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if a == b:
            os_.append(np.zeros((3, 5), np.float32))
            lses.append(np.full((3,), -np.inf, np.float32))
            continue
        lg = logits[:, a:b]
        mx = lg.max(1, keepdims=True)
        p = np.exp(lg - mx)
        os_.append((p / p.sum(1, keepdims=True)) @ vals[a:b])
        lses.append(mx[:, 0] + np.log(p.sum(1)))
    # Items: tile 0 has the three splits; item 3 is dead and holds NaN garbage (never written).
    os_.append(np.full((3, 5), np.nan, np.float32))
    lses.append(np.full((3,), np.nan, np.float32))
    o = jnp.asarray(np.stack(os_))[:, None]  # [I=4, K=1, R=3, D]
    lse = jnp.pad(jnp.asarray(np.stack(lses))[:, None], ((0, 0), (0, 0), (0, 61)))
    item_tile = jnp.asarray([0, 0, 0, 1], jnp.int32)  # W = 1: tile 1 means dead
    got = work.combine(o, lse, item_tile, 1)[0, 0]
    want = jax.nn.softmax(jnp.asarray(logits), axis=-1) @ vals
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
    all_empty = work.combine(jnp.zeros_like(o), jnp.full_like(lse, -jnp.inf), item_tile, 1)
    np.testing.assert_array_equal(np.asarray(all_empty), 0.0)


def _tiles(nq, lo, hi) -> jax.Array:
    """Tile metadata with the given query counts and key ranges (other columns zero)."""
    w = len(nq)
    cols = [np.zeros(w, np.int32)] * 8
    cols[work.M_NQ], cols[work.M_LO], cols[work.M_HI] = (
        np.asarray(x, np.int32) for x in (nq, lo, hi)
    )
    return jnp.asarray(np.stack(cols, axis=1))


def _check_items(tiles, items, item_tile, num_items):
    """Every live tile's KV steps are covered exactly once, in order, by its own items."""
    tiles, items, item_tile = map(np.asarray, (tiles, items, item_tile))
    w = tiles.shape[0]
    assert items.shape == (num_items, 10) and (np.diff(item_tile) >= 0).all()
    for t in range(w):
        nq, lo, hi = tiles[t, work.M_NQ], tiles[t, work.M_LO], tiles[t, work.M_HI]
        mine = items[item_tile == t]
        steps = list(range(lo // 64, -(-hi // 64))) if nq > 0 else []
        got = [st_ for f, n in mine[:, 8:10] for st_ in range(f, f + n)]
        assert got == steps, (t, got, steps)
        assert (mine[:, 9] >= 1).all()  # a live item has work
        np.testing.assert_array_equal(mine[:, :8], np.broadcast_to(tiles[t], (len(mine), 8)))
    dead = items[item_tile == w]
    assert (dead[:, 9] == 0).all()
    return np.bincount(item_tile, minlength=w + 1)[:w]


@settings(max_examples=25, deadline=None)
@given(
    ranges=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 900), st.integers(0, 900)),
                    min_size=1, max_size=12),
    extra_items=st.integers(0, 40),
    target=st.integers(1, 64),
)  # fmt: skip
def test_split_work_covers_every_live_tiles_steps_exactly_once(ranges, extra_items, target):
    nq = [a for a, _, _ in ranges]
    lo = [min(b, c) for _, b, c in ranges]
    hi = [max(b, c) + 1 for _, b, c in ranges]
    tiles = _tiles(nq, lo, hi)
    num_items = len(ranges) + extra_items
    items, item_tile = _split_work_jit(tiles, num_items, None, target)
    per_tile = _check_items(tiles, items, item_tile, num_items)
    live = np.asarray(nq) > 0
    assert per_tile[live].sum() <= max(live.sum(), min(num_items, target))


_split_work_jit = jax.jit(
    lambda t, n, p, tg: ga.split_work(t, n, splits_per_tile=p, target_items=tg),
    static_argnums=(1, 2, 3),
)


def test_split_work_gives_a_few_long_sequences_in_a_wide_batch_flash_decoding():
    """4 live decode rows of 8K keys among 256 padded slots: they share the item budget."""
    nq = [1] * 4 + [0] * 252
    tiles = _tiles(nq, [0] * 256, [8192] * 4 + [0] * 252)
    kv_heads = 8
    budget = ga.default_item_budget(256, kv_heads)
    items, item_tile = _split_work_jit(tiles, budget, None, -(-2 * ga.NUM_SMS // kv_heads))
    per_tile = _check_items(tiles, items, item_tile, budget)
    # 33 items wanted: 1 each + floor(29 / 4) = 8 each, at most 33 in all.
    np.testing.assert_array_equal(per_tile[:4], [8, 8, 8, 8])
    # A full batch gets one item per tile: no split overhead when the grid is already full.
    tiles = _tiles([1] * 256, [0] * 256, [8192] * 256)
    items, item_tile = _split_work_jit(tiles, budget, None, 33)
    assert (_check_items(tiles, items, item_tile, budget) == 1).all()
    # Fixed splits: min(P, steps) each.
    tiles = _tiles([1, 1, 0], [0, 0, 0], [100, 30, 0])
    items, item_tile = _split_work_jit(tiles, 9, 3, None)
    np.testing.assert_array_equal(_check_items(tiles, items, item_tile, 9), [2, 1, 0])


def test_unsupported_reason_names_each_hardware_limit():
    ok = dict(head_dim=128, num_q_per_kv=4, block_size=16, dtype=jnp.bfloat16)
    assert ga.unsupported_reason(**ok) is None
    for head_dim, g, s in [(64, 1, 8), (256, 8, 128), (192, 2, 32), (128, 64, 256)]:
        assert (
            ga.unsupported_reason(
                head_dim=head_dim, num_q_per_kv=g, block_size=s, dtype=jnp.float16
            )
            is None
        ), (head_dim, g, s)
    bad = {
        "dtype": dict(ok, dtype=jnp.float32),
        "head_dim=96": dict(ok, head_dim=96),
        "head_dim=512": dict(ok, head_dim=512),
        "block_size=24": dict(ok, block_size=24),
        "block_size=96": dict(ok, block_size=96),
        "(3)": dict(ok, num_q_per_kv=3),
    }
    for needle, kw in bad.items():
        reason = ga.unsupported_reason(**kw)
        assert reason is not None and needle in reason, (needle, reason)


def test_float32_without_interpret_falls_back_to_the_exact_xla_path():
    """wgmma would read float32 as tf32; compiled float32 calls use the XLA scan instead."""
    q, kv, lengths, tables = _decode_case(1, g=4, s=8, m=12, lengths=[96, 0, 7])
    kw = dict(sm_scale=0.125, sliding_window=30)
    out = ga.paged_attention_gpu(q, kv, lengths, tables, num_kv_heads=2, **kw)
    _check(out, _decode_want(q, kv, 2, lengths, tables, **kw), jnp.float32)


def test_kv_stages_over_the_shared_memory_limit_raise_value_error():
    assert ga.smem_bytes(256, jnp.bfloat16, ga.default_kv_stages(256)) <= ga.SMEM_LIMIT
    assert ga.smem_bytes(128, jnp.bfloat16, ga.default_kv_stages(128)) <= ga.SMEM_LIMIT
    q, kv, lengths, tables = _decode_case(8, g=1, d=256, s=8, m=2, lengths=[3], dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        ga.paged_attention_gpu(q, kv, lengths, tables, num_kv_heads=2, sm_scale=1.0, kv_stages=3)


def test_unsupported_geometry_raises_value_error_before_tracing():
    q, kv, lengths, tables = _decode_case(8, g=1, s=8, m=2, lengths=[3])
    kw = dict(sm_scale=1.0, interpret=True)
    kv12 = jnp.zeros((1, 8, 12, 4, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="block_size=12"):
        ga.paged_attention_gpu(q, kv12, lengths, tables, num_kv_heads=2, **kw)
    q3 = jnp.zeros((1, 6, 64), jnp.float32)  # G = 3 does not divide 64
    with pytest.raises(ValueError, match="divide"):
        ga.paged_attention_gpu(q3, kv, lengths, tables, num_kv_heads=2, **kw)
    with pytest.raises(ValueError, match="num_kv_heads=3 does not fit"):  # 2 heads' K and V
        ga.paged_attention_gpu(q3, kv, lengths, tables, num_kv_heads=3, **kw)
    with pytest.raises(ValueError, match=r"\[L, N, S, C, P, D\]"):  # one layer: not stacked
        ga.paged_attention_gpu(q, kv[0], lengths, tables, num_kv_heads=2, **kw)


# ---------------------------------------------------------------------------------------------
# Wide grid (slow)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "s,dtype",
    [(8, jnp.float32), (16, jnp.bfloat16), (16, jnp.float32), (32, jnp.bfloat16),
     (64, jnp.float32), (128, jnp.bfloat16)],
)  # fmt: skip
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_wide_grid(s, dtype, g, d):
    m = max(2, 128 // s)
    lengths = [1, 0, s, m * s, min(m * s, 2 * s + 5)]
    q, kv, lengths, tables = _decode_case(
        11, g=g, kv_heads=1, d=d, s=s, m=m, lengths=lengths, dtype=dtype
    )
    for soft_cap, window in [(None, None), (25.0, s + 3)]:
        kw = dict(sm_scale=d**-0.5, soft_cap=soft_cap, sliding_window=window)
        out = ga.paged_attention_gpu(
            q, kv, lengths, tables, num_kv_heads=1, interpret=INTERPRET, **kw
        )
        _check(out, _decode_want(q, kv, 1, lengths, tables, **kw), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("s", [8, 32])
@pytest.mark.parametrize("window", [None, 7])
def test_ragged_wide_grid(dtype, g, s, window):
    q, kv, kv_lens, tables, cu, nseq = _ragged_case(
        12, g=g, s=s, m=-(-64 // s), rows=MIXED_ROWS + [(12, 64)], pad_rows=2, dtype=dtype
    )
    kw = dict(sm_scale=0.125, soft_cap=30.0, sliding_window=window)
    args = (q, kv, kv_lens, tables, cu, nseq)
    out = ga.ragged_paged_attention_gpu(*args, num_kv_heads=2, interpret=INTERPRET, **kw)
    _check(out, _ragged_want(q, kv, 2, *args[2:], **kw), dtype)
