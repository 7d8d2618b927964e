"""Paged attention for NVIDIA Hopper (sm_90a) written with Mosaic GPU Pallas (``plgpu``).

One kernel serves both entry points. :func:`ragged_paged_attention_gpu` handles any mix of
decode rows, whole prefills, chunked prefills and prefix-cache hits;
:func:`paged_attention_gpu` (decode: one query token per sequence) is the same kernel fed a
trivial work list. Semantics are exactly those of the oracles in
:mod:`kernels_pallas.reference`.

Shape letters: B sequences, T query tokens, H query heads, K kv heads, G = H // K query heads
per kv head, D head dim, N blocks, S block size, M max blocks per sequence, W work tiles,
P KV splits (flash-decoding), R = 64 rows of one wgmma tile.

Design (what one CUDA block does)
---------------------------------
* **Work tiles.** The host side (plain XLA, jit-traceable, no Python loop over sequences)
  cuts every sequence's query rows into tiles of ``R // G`` tokens, so one tile holds
  ``R // G`` tokens x ``G`` heads = 64 rows: GQA query heads are packed into the wgmma M
  dimension and each KV page is read once per group. A decode row is a tile with one token.
  Tile metadata ``i32[W, 8]`` (sequence, first query row, key range ``[lo, hi)``, ...) lives
  in GMEM and is read as scalars.
* **Grid** ``(W, P, K)``: tile x KV split x kv head, one warpgroup per block.
* **KV pipeline.** A KV step is ``64`` tokens = ``64 // S`` pages. Each page is one TMA copy
  ``k_pages[kh, block_table[seq, j]] -> smem`` (the block id is read from GMEM, clamped to
  ``>= 0``); ``kv_stages`` (3, or 2 at D = 256) stages of K and V buffers in 128B-swizzled SMEM
  with one mbarrier per stage, so the TMA of steps ``i+1 .. i+stages-1`` overlaps the math of
  step ``i``. Pages wholly outside the tile's key range are not fetched (the barrier gets a
  plain arrive instead, so its arrival count stays ``64 // S``).
* **Math.** ``S = Q K^T`` with ``wgmma`` (A = Q tile from SMEM, B = transposed K stage),
  optional soft cap, causal / sliding-window / length mask applied with ``where``, online
  softmax in float32 (``m``, ``l`` in the WGMMA row layout), ``O += P V`` with ``wgmma``
  (A = P from registers in the input dtype, B = V stage). float32 accumulation throughout.
* **Never read what was not written.** K columns outside the key range are masked with
  ``where`` (NaN cannot pass a select). On the first and last step of a range, V rows outside
  it (stale SMEM, unwritten slots, skipped pages) are zeroed in SMEM before the ``P V`` wgmma,
  because ``0 * NaN`` would leak through a matmul.
* **Flash-decoding.** The key range of a tile is split over ``P`` blocks (balanced per tile at
  run time). Each writes its normalized partial output (float32) and log-sum-exp; a small XLA
  combine merges them (``P = 1`` for large batches). ``P`` defaults to enough blocks to fill
  the GPU twice (132 SMs on H100/H200) and can be forced with ``num_splits``.

Hardware minimums of the compiled kernel (reported by :func:`check_compiled_support`)
--------------------------------------------------------------------------------------
* Hopper (sm_90a): ``wgmma`` and TMA. The wgmma M dimension is 64, so query rows are padded to
  64 per tile (a decode tile with ``G = 1`` computes 63 dead rows; decode is memory bound).
* ``bfloat16`` / ``float16`` pages. wgmma reads float32 as tf32 (too coarse for the 1e-5
  float32 contract) and needs K-major float32 operands, which V as the B operand of ``P V`` is
  not, so float32 inputs on a real GPU are routed to the exact XLA path
  (:func:`kernels_pallas.reference.ragged_paged_attention_xla`) with a logged notice.
  Interpret mode runs float32 through the kernel itself.
* Geometry problems below raise ``ValueError`` (at trace time, before any kernel runs).
* ``head_dim`` a multiple of 64 (128-byte swizzle tiles of ``(8, 64)`` bf16): 64, 128, 256.
* ``block_size`` a multiple of 8 that divides 64 (8, 16, 32, 64): a page must be whole
  ``(8, 64)`` tiles and a 64-token KV step must be whole pages.
* SMEM (:func:`smem_bytes`): Q 64xD + ``kv_stages`` x 2 x 64xD (input dtype) + a 64x64
  float32 output stage: 128 KiB at D = 128 (3 stages), 176 KiB at D = 256 (2 stages); Hopper
  allows 227 KiB per block, so more stages than that raise ``ValueError``. ``kv_stages=2`` at
  D <= 128 fits two blocks per SM; which is faster is for ``scripts/gpu_check.py`` to measure.

Interpret mode (CPU tests)
--------------------------
``interpret=True`` runs the same kernel body in Mosaic GPU's interpreter
(``InterpretGPUParams``): grid, TMA copies, mbarriers, scalar GMEM reads, SMEM stages, loops
and masking are all interpreted. Two things differ, because this JAX's interpreter lacks them:
the two matmuls are computed with ``jnp.dot`` on the SMEM contents (its ``wgmma`` rejects a
transposed operand and register A operands), and register layouts (``plgpu.layout_cast``,
``plgpu.load(layout=...)``: no CPU rules) are skipped. Uninitialized SMEM is NaN in the
interpreter, which the NaN tests rely on, and its barrier checks and race detector
(``interpret=InterpretGPUParams(detect_races=True)``) validate the pipeline's synchronization.
The compiled path itself is checked on any host by exporting for CUDA
(``jax.export(..., platforms=["cuda"])``), which runs the full Mosaic GPU lowering (layouts,
TMA descriptors, wgmma shapes) short of ptxas; on a GPU the tests and
``scripts/gpu_check.sh`` compile and run it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import reference

__all__ = [
    "paged_attention_gpu",
    "ragged_paged_attention_gpu",
    "check_compiled_support",
    "default_num_splits",
    "default_kv_stages",
    "smem_bytes",
    "NUM_SMS",
]

logger = logging.getLogger(__name__)

NUM_SMS = 132  # H100 SXM / H200
_ROWS = 64  # wgmma M: rows of one query tile (tokens x heads of a GQA group)
_BLOCK_KV = 64  # tokens per KV pipeline step
_OUT_COLS = 64  # columns per output store (keeps the float32 output stage at 16 KiB)
SMEM_LIMIT = 227 * 1024  # Hopper: max dynamic shared memory per block
_NEG_INF = float("-inf")
_COMPILED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Tile metadata columns (i32[W, _META]).
_M_SEQ, _M_ROW0, _M_NQ, _M_POS0, _M_LO, _M_HI, _M_LAYER = range(7)
_META = 8


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration of one kernel instance."""

    g: int  # query heads per kv head
    d: int
    s: int  # block size
    m: int  # max blocks per sequence
    kv_heads: int
    pages_per_step: int
    slots: int
    num_splits: int
    out_rows: int  # rows of each tile written back (G for decode, 64 for ragged)
    dtype: jnp.dtype
    sm_scale: float
    soft_cap: float | None
    window: int | None
    stacked: bool  # pages are [L, K, N, S, D]
    interpret: bool
    interpret_params: object = None  # an InterpretGPUParams, or None for the defaults

    @property
    def block_kv(self) -> int:
        return self.pages_per_step * self.s


# ---------------------------------------------------------------------------------------------
# Support checks and heuristics
# ---------------------------------------------------------------------------------------------


def check_compiled_support(head_dim: int, block_size: int, dtype) -> str | None:
    """Why the compiled Hopper kernel cannot run this configuration, or ``None`` if it can.

    ``None`` means fully supported. A dtype problem (float32) is handled by the entry points
    by falling back to the XLA path; geometry problems raise ``ValueError`` there.
    """
    if jnp.dtype(dtype) not in _COMPILED_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (wgmma needs bfloat16/float16 operands here)"
    return _check_geometry(head_dim, block_size)


def _check_geometry(head_dim: int, block_size: int) -> str | None:
    if head_dim % 64:
        return f"head_dim={head_dim} is not a multiple of 64 (128B-swizzled TMA tiles)"
    if block_size % 8 or _BLOCK_KV % block_size:
        return f"block_size={block_size} must be a multiple of 8 that divides {_BLOCK_KV}"
    return None


def default_num_splits(num_tiles: int, kv_heads: int, max_kv_steps: int) -> int:
    """KV splits per tile so that about ``2 * NUM_SMS`` blocks run (flash-decoding).

    Args:
      num_tiles: W, work tiles (sequences for decode).
      kv_heads: K.
      max_kv_steps: most 64-token KV steps any tile can need (``ceil(M * S / 64)``).
    """
    want = -(-2 * NUM_SMS // max(1, num_tiles * kv_heads))
    return int(max(1, min(want, max_kv_steps, 32)))


def default_kv_stages(head_dim: int) -> int:
    """Pipeline depth: 3 stages of K+V up to D = 128 (~128 KiB SMEM), 2 at D = 256."""
    return 3 if head_dim <= 128 else 2


def smem_bytes(head_dim: int, dtype, kv_stages: int) -> int:
    """Shared memory of one block: Q tile, K/V stages, output and LSE staging, barriers."""
    item = jnp.dtype(dtype).itemsize
    q = _ROWS * head_dim * item
    kv = 2 * kv_stages * _BLOCK_KV * head_dim * item
    out = _ROWS * min(head_dim, _OUT_COLS) * 4 + _ROWS * 4
    return q + kv + out + 8 * (1 + 2 * kv_stages)


def _interpret_params(given=None):
    """Mosaic GPU interpret-mode parameters (private JAX module: imported only when used)."""
    if given is not None:
        return given
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def _layout_cast(x: jax.Array, layout, cfg: _Cfg) -> jax.Array:
    return x if cfg.interpret else plgpu.layout_cast(x, layout)


def _iota(shape: tuple[int, int], dim: int, cfg: _Cfg) -> jax.Array:
    layout = None if cfg.interpret else plgpu.Layout.WGMMA
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)


def _load_wgmma(ref, cfg: _Cfg) -> jax.Array:
    """Load a swizzled SMEM tile into registers in the WGMMA layout (plain read in interpret)."""
    if cfg.interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)


def _mma_qk(q_smem, k_stage, cfg: _Cfg) -> jax.Array:
    """f32[64, BKV] = Q @ K^T (wgmma; jnp.dot in interpret mode)."""
    if cfg.interpret:
        return jnp.dot(q_smem[...], k_stage[...].T, preferred_element_type=jnp.float32)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_stage, (1, 0)))
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC((_ROWS, cfg.block_kv), jnp.float32))


def _mma_pv(p: jax.Array, v_stage, cfg: _Cfg) -> jax.Array:
    """f32[64, D] = P @ V with P cast to the input dtype (wgmma A operand from registers)."""
    p = p.astype(cfg.dtype)
    if cfg.interpret:
        return jnp.dot(p, v_stage[...], preferred_element_type=jnp.float32)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, p, v_stage)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC((_ROWS, cfg.d), jnp.float32))


def _kernel(meta_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, cfg: _Cfg):
    """One (tile, split, kv head): online softmax over this split's share of the key range."""
    w = lax.axis_index("w")
    sp = lax.axis_index("p")
    kh = lax.axis_index("k")
    seq = meta_ref[w, _M_SEQ]
    row0 = meta_ref[w, _M_ROW0]
    nq = meta_ref[w, _M_NQ]
    pos0 = meta_ref[w, _M_POS0]
    lo = meta_ref[w, _M_LO]
    hi = meta_ref[w, _M_HI]
    layer = meta_ref[w, _M_LAYER]
    bkv, s, pps = cfg.block_kv, cfg.s, cfg.pages_per_step

    # This split's share of the KV steps covering [lo, hi).
    step_lo = lax.div(lo, bkv)  # lo, hi >= 0
    n_steps_all = jnp.maximum(lax.div(hi + bkv - 1, bkv) - step_lo, 0)
    per_split = lax.div(n_steps_all + cfg.num_splits - 1, cfg.num_splits)
    first = step_lo + jnp.minimum(sp * per_split, n_steps_all)
    n_steps = jnp.clip(n_steps_all - sp * per_split, 0, per_split)

    def pages_of(src_ref):
        return src_ref.at[layer, kh] if cfg.stacked else src_ref.at[kh]

    k_src, v_src = pages_of(k_ref), pages_of(v_ref)

    def scoped(q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar):
        def issue_page(step, p, slot):
            """TMA page ``p`` of KV step ``step`` into stage ``slot``, or arrive if not needed."""
            j = step * pps + p
            needed = (j < cfg.m) & (j * s < hi) & ((j + 1) * s > lo)
            blk = jnp.maximum(tables_ref[seq, jnp.minimum(j, cfg.m - 1)], 0)
            dst = pl.ds(p * s, s)

            @pl.when(needed)
            def _copy():
                plgpu.copy_gmem_to_smem(k_src.at[blk], k_smem.at[slot, dst], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_src.at[blk], v_smem.at[slot, dst], v_bar.at[slot])

            @pl.when(~needed)
            def _skip():  # keep the barrier's arrival count at pages_per_step
                plgpu.barrier_arrive(k_bar.at[slot])
                plgpu.barrier_arrive(v_bar.at[slot])

        def issue(step, slot):
            for p in range(pps):
                issue_page(step, p, slot)

        def prefetch(i):
            pl.when(i < n_steps)(lambda: issue(first + i, i))

        plgpu.copy_gmem_to_smem(q_ref.at[kh, pl.ds(row0 * cfg.g, _ROWS)], q_smem, q_bar.at[0])
        for i in range(cfg.slots):  # prologue: fill the pipeline
            prefetch(i)

        # Row r of the tile is token r // G of the tile, head r % G of the group.
        tok = lax.shift_right_logical(_iota((_ROWS, bkv), 0, cfg), cfg.g.bit_length() - 1)
        col = _iota((_ROWS, bkv), 1, cfg)
        qpos = pos0 + tok
        row_ok = tok < nq
        vrow = _iota((bkv, cfg.d), 0, cfg)

        m_i = _layout_cast(jnp.full((_ROWS,), _NEG_INF, jnp.float32), _reduce_layout(), cfg)
        l_i = _layout_cast(jnp.zeros((_ROWS,), jnp.float32), _reduce_layout(), cfg)
        acc = _layout_cast(jnp.zeros((_ROWS, cfg.d), jnp.float32), _wgmma_layout(), cfg)
        plgpu.barrier_wait(q_bar.at[0])

        def step_body(i, carry):
            acc, m_i, l_i = carry
            step = first + i
            slot = lax.rem(i, cfg.slots)
            start = step * bkv
            plgpu.barrier_wait(k_bar.at[slot])
            logits = _mma_qk(q_smem, k_smem.at[slot], cfg) * cfg.sm_scale
            if cfg.soft_cap is not None:
                logits = cfg.soft_cap * jnp.tanh(logits / cfg.soft_cap)
            kpos = start + col
            mask = row_ok & (kpos <= qpos)
            if cfg.window is not None:
                mask &= kpos > qpos - cfg.window
            logits = jnp.where(mask, logits, _NEG_INF)
            m_new = jnp.maximum(m_i, logits.max(axis=1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            alpha = jnp.exp(m_i - m_safe)
            m_b = lax.broadcast_in_dim(m_safe, logits.shape, [0])
            p = jnp.where(mask, jnp.exp(logits - m_b), 0.0)
            l_i = l_i * alpha + p.sum(axis=1)

            plgpu.barrier_wait(v_bar.at[slot])

            @pl.when((start < lo) | (start + bkv > hi))
            def _scrub_v():  # zero V rows outside [lo, hi): stale SMEM or unwritten slots
                stage = v_smem.at[slot]
                vals = _load_wgmma(stage, cfg)
                keep = (start + vrow >= lo) & (start + vrow < hi)
                stage[...] = jnp.where(keep, vals, jnp.zeros_like(vals))
                plgpu.commit_smem()

            pv = _mma_pv(p, v_smem.at[slot], cfg)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv

            @pl.when(i + cfg.slots < n_steps)
            def _next():
                issue(step + cfg.slots, slot)

            return acc, m_new, l_i

        acc, m_i, l_i = lax.fori_loop(0, n_steps, step_body, (acc, m_i, l_i))

        has = l_i > 0.0
        inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
        acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        lse_smem[...] = jnp.where(has, m_i + jnp.log(jnp.where(has, l_i, 1.0)), _NEG_INF)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[w, sp, kh])
        cols = o_smem.shape[1]
        for c in range(cfg.d // cols):
            if c:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[...] = acc if cols == cfg.d else acc[:, c * cols : (c + 1) * cols]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(0, cfg.out_rows)],
                o_ref.at[w, sp, kh, :, pl.ds(c * cols, cols)],
            )
        plgpu.wait_smem_to_gmem(0)

    transforms = _smem_transforms(cfg)
    pl.run_scoped(
        scoped,
        plgpu.SMEM((_ROWS, cfg.d), cfg.dtype, transforms=transforms),
        plgpu.SMEM((cfg.slots, bkv, cfg.d), cfg.dtype, transforms=transforms),
        plgpu.SMEM((cfg.slots, bkv, cfg.d), cfg.dtype, transforms=transforms),
        plgpu.SMEM((_ROWS, min(cfg.d, _OUT_COLS)), jnp.float32),
        plgpu.SMEM((_ROWS,), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=pps, num_barriers=cfg.slots),
        plgpu.Barrier(num_arrivals=pps, num_barriers=cfg.slots),
    )


def _reduce_layout():
    return plgpu.Layout.WGMMA.reduce(1)


def _wgmma_layout():
    return plgpu.Layout.WGMMA


def _smem_transforms(cfg: _Cfg) -> tuple:
    """128-byte swizzle with (8, 128 / itemsize) tiles: what TMA + wgmma want for K-major data."""
    itemsize = jnp.dtype(cfg.dtype).itemsize
    return (plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128))


def _run_kernel(meta, tables, q_rows, k_pages, v_pages, cfg: _Cfg):
    """Launch the kernel. Returns partial ``o f32[W, P, K, R, D]`` and ``lse f32[W, P, K, 64]``."""
    w = meta.shape[0]
    out_type = (
        jax.ShapeDtypeStruct((w, cfg.num_splits, cfg.kv_heads, cfg.out_rows, cfg.d), jnp.float32),
        jax.ShapeDtypeStruct((w, cfg.num_splits, cfg.kv_heads, _ROWS), jnp.float32),
    )
    fn = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg),
        out_type=out_type,
        grid=(w, cfg.num_splits, cfg.kv_heads),
        grid_names=("w", "p", "k"),
        interpret=_interpret_params(cfg.interpret_params) if cfg.interpret else None,
        compiler_params=None if cfg.interpret else plgpu.CompilerParams(approx_math=True),
    )
    return fn(meta, tables, q_rows, k_pages, v_pages)


def _combine(o: jax.Array, lse: jax.Array) -> jax.Array:
    """Merge split partials: ``o f32[W, P, K, R, D]``, ``lse f32[W, P, K, 64]`` -> ``[W, K, R, D]``.

    Empty splits (``lse = -inf``) get weight 0; a row with no keys in any split gives zeros.
    """
    r = o.shape[3]
    lse = lse[..., :r]
    mx = jnp.max(lse, axis=1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    wgt = jnp.where(jnp.isfinite(lse), jnp.exp(lse - mx), 0.0)  # [W, P, K, R]
    den = jnp.sum(wgt, axis=1)
    num = jnp.sum(jnp.where(wgt[..., None] > 0, o, 0.0) * wgt[..., None], axis=1)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


# ---------------------------------------------------------------------------------------------
# Host-side work lists (jit-traceable XLA)
# ---------------------------------------------------------------------------------------------


def _key_range(pos0: jax.Array, nq: jax.Array, window: int | None):
    """Keys any of the tile's queries may see: ``[lo, hi)``; empty when ``nq == 0``."""
    hi = jnp.where(nq > 0, jnp.maximum(pos0 + nq, 0), 0)
    lo = jnp.zeros_like(hi) if window is None else jnp.maximum(pos0 - window + 1, 0)
    lo = jnp.minimum(lo, hi)
    return lo, hi


def decode_work(lengths: jax.Array, window: int | None, layer=0) -> jax.Array:
    """Tile metadata ``i32[B, 8]`` for decode: one tile per sequence, token at ``len - 1``."""
    b = lengths.shape[0]
    lengths = lengths.astype(jnp.int32)
    nq = (lengths > 0).astype(jnp.int32)
    pos0 = lengths - 1
    lo, hi = _key_range(pos0, nq, window)
    seq = jnp.arange(b, dtype=jnp.int32)
    lay = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (b,))
    zero = jnp.zeros((b,), jnp.int32)
    return jnp.stack([seq, seq, nq, pos0, lo, hi, lay, zero], axis=1)


def ragged_work(
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    num_tokens: int,
    tokens_per_tile: int,
    window: int | None,
    layer=0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cut every real sequence's query rows into tiles of ``tokens_per_tile`` tokens.

    Returns:
      ``(meta i32[W, 8], tile_of_row i32[T], slot_of_row i32[T])`` where
      ``W = ceil(T / tokens_per_tile) + B`` (a static bound), ``tile_of_row`` the tile holding
      each query row and ``slot_of_row`` its token index inside that tile.
    """
    b = kv_lens.shape[0]
    tpt = tokens_per_tile
    w = -(-num_tokens // tpt) + b
    cu = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    nseq = jnp.asarray(num_seqs, jnp.int32)
    real = jnp.arange(b, dtype=jnp.int32) < nseq
    q_len = jnp.where(real, cu[1:] - cu[:-1], 0)
    n_tiles = (q_len + tpt - 1) // tpt  # [B]
    tile_end = jnp.cumsum(n_tiles).astype(jnp.int32)
    tile_start = tile_end - n_tiles
    widx = jnp.arange(w, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, widx, side="right"), b - 1).astype(jnp.int32)
    used = widx < tile_end[-1]
    chunk = widx - tile_start[seq]
    row0 = jnp.where(used, cu[seq] + chunk * tpt, 0)
    nq = jnp.where(used, jnp.clip(q_len[seq] - chunk * tpt, 0, tpt), 0)
    pos0 = kv_lens[seq] - q_len[seq] + chunk * tpt
    lo, hi = _key_range(pos0, nq, window)
    lay = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (w,))
    meta = jnp.stack([seq, row0, nq, pos0, lo, hi, lay, jnp.zeros_like(seq)], axis=1)

    rseq, _, _ = reference.ragged_row_info(cu, kv_lens, nseq, num_tokens)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    local = rows - cu[rseq]
    tile_of_row = jnp.clip(tile_start[rseq] + local // tpt, 0, w - 1)
    return meta, tile_of_row, local % tpt


def _q_rows(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[T, H, D] -> [K, R_pad, D]``: each kv head's query rows, token-major.

    Padded so that a 64-row tile starting at any real token stays in bounds and the row count
    is a multiple of 64 (TMA wants whole (8, 64) tiles).
    """
    t, h, d = q.shape
    g = h // kv_heads
    rows = -(-(t * g + _ROWS) // _ROWS) * _ROWS
    qg = q.reshape(t, kv_heads, g, d).transpose(1, 0, 2, 3)
    qg = jnp.pad(qg, ((0, 0), (0, rows // g - t), (0, 0), (0, 0)))
    return qg.reshape(kv_heads, rows, d)


def _make_cfg(q, k_pages, block_tables, *, sm_scale, soft_cap, sliding_window, interpret,
              num_splits, out_rows, num_tiles, kv_stages=None) -> _Cfg:  # fmt: skip
    stacked = k_pages.ndim == 5
    kv_heads, _, s, d = k_pages.shape[-4:]
    g = q.shape[1] // kv_heads
    problem = _check_geometry(d, s)
    if problem is not None:
        raise ValueError(f"Mosaic GPU paged attention: {problem}")
    if _ROWS % g:
        raise ValueError(f"query heads per kv head ({g}) must divide {_ROWS}")
    m = block_tables.shape[1]
    pps = _BLOCK_KV // s
    max_steps = -(-m // pps)
    if num_splits is None:
        num_splits = default_num_splits(num_tiles, kv_heads, max_steps)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    stages = default_kv_stages(d) if kv_stages is None else int(kv_stages)
    need = smem_bytes(d, q.dtype, stages)
    if stages < 1 or (need > SMEM_LIMIT and not interpret):
        raise ValueError(
            f"kv_stages={stages} needs {need} bytes of shared memory (limit {SMEM_LIMIT})"
        )
    return _Cfg(
        g=g, d=d, s=s, m=m, kv_heads=kv_heads, pages_per_step=pps,
        slots=stages, num_splits=int(num_splits), out_rows=out_rows,
        dtype=jnp.dtype(q.dtype), sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if sliding_window is None else int(sliding_window),
        stacked=stacked, interpret=bool(interpret),
        interpret_params=None if isinstance(interpret, bool) else interpret,
    )  # fmt: skip


def _use_fallback(q: jax.Array, k_pages: jax.Array, interpret: bool, name: str) -> bool:
    if interpret or jnp.dtype(k_pages.dtype) in _COMPILED_DTYPES:
        return False
    logger.info("%s: %s pages run on the XLA path on GPU (wgmma is bf16/f16 only here)",
                name, jnp.dtype(k_pages.dtype).name)  # fmt: skip
    return True


def _select_layer(pages: jax.Array, layer) -> jax.Array:
    return pages if pages.ndim == 4 else pages[layer]


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "num_splits",
        "kv_stages",
    ),
)
def paged_attention_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool | object = False,
    num_splits: int | None = None,
    kv_stages: int | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Decode attention over paged KV on Hopper (one query token per sequence).

    Arguments are validated by :func:`kernels_pallas.attention.paged_attention`.

    Args:
      q: ``[B, H, D]`` queries (token at position ``lengths[b] - 1``).
      k_pages, v_pages: ``[K, N, S, D]`` pages, or ``[L, K, N, S, D]`` with ``layer``.
      lengths: ``i32[B]``; 0 marks a padding row (output zeros).
      block_tables: ``i32[B, M]``; negative ids are never dereferenced.
      sm_scale: logit scale.
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)`` if set.
      sliding_window: keys in ``(pos - window, pos]`` only, if set.
      interpret: run in Mosaic GPU interpret mode (CPU); ``True`` or an
        ``InterpretGPUParams`` (e.g. ``detect_races=True``).
      num_splits: KV splits per sequence (flash-decoding); default fills the GPU.
      kv_stages: K/V pipeline depth (SMEM stages); default :func:`default_kv_stages`.
      layer: layer index into stacked ``[L, ...]`` pages (read in the kernel, no copy).

    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    layer = 0 if layer is None else layer
    if _use_fallback(q, k_pages, interpret, "paged_attention_gpu"):
        # Decode is ragged attention with one row per sequence (memory-light XLA scan).
        b = q.shape[0]
        return reference.ragged_paged_attention_xla(
            q, _select_layer(k_pages, layer), _select_layer(v_pages, layer), lengths,
            block_tables, jnp.arange(b + 1, dtype=jnp.int32), b, sm_scale=sm_scale,
            soft_cap=soft_cap, sliding_window=sliding_window,
        )  # fmt: skip
    b, h, d = q.shape
    kv_heads = k_pages.shape[-4]
    g = h // kv_heads
    cfg = _make_cfg(
        q, k_pages, block_tables, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret, num_splits=num_splits,
        kv_stages=kv_stages, out_rows=g, num_tiles=b,
    )  # fmt: skip
    meta = decode_work(lengths, sliding_window, layer)
    q_rows = _q_rows(q, kv_heads)
    o, lse = _run_kernel(meta, block_tables.astype(jnp.int32), q_rows, k_pages, v_pages, cfg)
    out = _combine(o, lse)  # [B, K, G, D]
    return out.reshape(b, h, d).astype(q.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "num_splits",
        "kv_stages",
    ),
)
def ragged_paged_attention_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool | object = False,
    num_splits: int | None = None,
    kv_stages: int | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Ragged causal attention over paged KV on Hopper (decode, prefill, chunks, prefix hits).

    Arguments are validated by :func:`kernels_pallas.attention.ragged_paged_attention`.

    Args:
      q: ``[T, H, D]``; sequence ``s < num_seqs`` owns rows ``cu_q_lens[s]:cu_q_lens[s+1]``,
        the last ``q_len`` of its ``kv_lens[s]`` tokens. Rows past ``cu_q_lens[num_seqs]``
        are padding (output zeros).
      k_pages, v_pages: ``[K, N, S, D]`` pages, or ``[L, K, N, S, D]`` with ``layer``.
      kv_lens: ``i32[B]``.
      block_tables: ``i32[B, M]``.
      cu_q_lens: ``i32[B + 1]``.
      num_seqs: scalar.
      sm_scale, soft_cap, sliding_window, interpret, num_splits, kv_stages, layer: as in
        :func:`paged_attention_gpu`.

    Returns:
      ``[T, H, D]`` in ``q.dtype``.
    """
    layer = 0 if layer is None else layer
    if _use_fallback(q, k_pages, interpret, "ragged_paged_attention_gpu"):
        return reference.ragged_paged_attention_xla(
            q, _select_layer(k_pages, layer), _select_layer(v_pages, layer), kv_lens,
            block_tables, cu_q_lens, num_seqs, sm_scale=sm_scale, soft_cap=soft_cap,
            sliding_window=sliding_window,
        )  # fmt: skip
    t, h, d = q.shape
    kv_heads = k_pages.shape[-4]
    g = h // kv_heads
    tpt = _ROWS // g
    meta, tile_of_row, slot_of_row = ragged_work(
        kv_lens, cu_q_lens, num_seqs, t, tpt, sliding_window, layer
    )
    cfg = _make_cfg(
        q, k_pages, block_tables, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret, num_splits=num_splits,
        kv_stages=kv_stages, out_rows=_ROWS, num_tiles=meta.shape[0],
    )  # fmt: skip
    q_rows = _q_rows(q, kv_heads)
    o, lse = _run_kernel(meta, block_tables.astype(jnp.int32), q_rows, k_pages, v_pages, cfg)
    out = _combine(o, lse)  # [W, K, 64, D]
    out = out.reshape(out.shape[0], kv_heads, tpt, g, d)
    out = out[tile_of_row, :, slot_of_row]  # [T, K, G, D]
    _, _, valid = reference.ragged_row_info(cu_q_lens, kv_lens, num_seqs, t)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(t, h, d).astype(q.dtype)
