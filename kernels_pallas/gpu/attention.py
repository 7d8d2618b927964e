"""Paged attention for NVIDIA Hopper (sm_90a) written with Mosaic GPU Pallas (``plgpu``).

One kernel serves both entry points. :func:`ragged_paged_attention_gpu` handles any mix of
decode rows, whole prefills, chunked prefills and prefix-cache hits;
:func:`paged_attention_gpu` (decode: one query token per sequence) is the same kernel fed a
trivial tile list. Semantics are exactly those of the oracles in :mod:`kernels_pallas.reference`.

Shape letters: B sequences, T query tokens, H query heads, K kv heads, G = H // K query heads
per kv head, D head dim, L layers, N blocks, S block size, M max blocks per sequence, W query
tiles, I work items (tile x KV split), R = 64 rows of one wgmma tile, C packed rows and P heads
per 32-bit word of the page layout.

Pages are the stacked token-major ``kv_pages [L, N, S, C, P, D]`` of
:mod:`kernels_pallas.kv_layout` (``layer`` picks one; ``num_kv_heads`` says K): kv head ``h``'s
K is combined head ``2h`` at ``[..., (2h) // P, (2h) % P, :]``, its V combined head ``2h + 1``;
for the 16-bit pages the compiled kernel takes (P = 2) that is ``[..., h, 0, :]`` and
``[..., h, 1, :]``. In one page of one layer, a head's K is a strided ``[S, D]`` matrix: S rows
of D contiguous elements, ``C * P * D`` elements apart.

Design (what one CUDA block does)
---------------------------------
* **Query tiles.** The host side (plain XLA, jit-traceable, no Python loop over sequences)
  cuts every sequence's query rows into tiles of ``R // G`` tokens, so one tile holds
  ``R // G`` tokens x ``G`` heads = 64 rows: GQA query heads are packed into the wgmma M
  dimension and each KV page is read once per group. A decode row is a tile with one token.
* **Work items (flash-decoding).** Each live tile's key range is split into KV splits, and a
  work item is one (tile, split). Splits are assigned at run time from the tiles that are
  actually live, in proportion to their key ranges, within a static item budget
  (:func:`split_work`): a small decode batch in a wide padded batch still gets enough items to
  fill the GPU. Item metadata ``i32[I, 10]`` (sequence, first query row, key range ``[lo, hi)``,
  the split's first KV step and step count, layer) lives in GMEM and is read as scalars.
* **Grid** ``(I, K)``: work item x kv head, one warpgroup per block. A dead item (no steps:
  padding tiles, unused budget) returns at once: no Q load, no output write; the combine
  ignores it.
* **KV pipeline.** A KV step is ``64`` tokens: ``64 // S`` whole pages for ``S <= 64``, a
  64-token slice of one page for ``S >= 64``. Each piece is one TMA copy for K and one for V
  of a strided window ``kv_pages[layer, blk, off:off+64, c, j, :] -> smem`` (``blk`` read from
  the block table in GMEM, clamped to ``>= 0``), straight from the token-major pages with no
  relayout copy: the TMA descriptor carries the page row stride (``C * P * D * 2`` bytes, a
  multiple of 16) and Mosaic GPU folds the indexed dims (layer, block, ``c``, ``j``) into one
  coordinate next to the 128B-swizzle tiling's four (TMA's limit is 5 dims). That coordinate
  counts ``D``-element rows of the whole cache and TMA coordinates are 32-bit signed, so the
  cache must stay under ``2**31 * D * 2`` bytes (256 GiB at D = 64). Other heads' rows are
  not read: a K piece is ``64`` runs of ``D * 2 >= 128`` contiguous bytes. ``kv_stages``
  (3, or 2 at D = 256) stages of K and V in 128B-swizzled SMEM, each with an mbarrier the TMA
  arrives on, so the TMA of steps ``i+1 .. i+stages-1`` overlaps the math of step ``i``. A
  stage is refilled by the same warpgroup that read it, after both wgmmas on it have
  completed (their accumulators were read, which waits for them) and after the V scrub's
  generic-proxy writes were fenced (``commit_smem``), so program order is the whole
  synchronization; no "consumed" barrier is needed as it is where a separate producer
  warpgroup issues the copies (JAX's ``attention_mgpu``). Pieces wholly outside the tile's
  key range are not fetched (a plain arrive keeps the count).
* **Math.** ``S = Q K^T`` with ``wgmma`` (A = Q tile from SMEM, B = transposed K stage),
  optional soft cap, causal / sliding-window / length mask applied with ``where``, online
  softmax in float32 (``m``, ``l`` in the WGMMA row layout), ``O = alpha O + P V`` with
  ``wgmma`` accumulating in place into the one live f32 accumulator (A = P from registers in
  the input dtype, B = V stage). At D = 256 the accumulator alone is 128 registers a thread,
  so a second one (a fresh ``P V`` result added afterwards) would spill.
* **Never read what was not written.** K columns outside the key range are masked with
  ``where`` (NaN cannot pass a select). On the first and last step of a range, V rows outside
  it (stale SMEM, unwritten slots, skipped pages) are zeroed in SMEM before the ``P V`` wgmma,
  because ``0 * NaN`` would leak through a matmul.
* **Combine.** Each item writes its normalized partial output (float32) and log-sum-exp; a
  small XLA segment reduction over the items of each tile merges them.

Hardware minimums of the compiled kernel (:func:`unsupported_reason`)
---------------------------------------------------------------------
* Hopper (sm_90a): ``wgmma`` and TMA. The wgmma M dimension is 64, so query rows are padded to
  64 per tile (a decode tile with ``G = 1`` computes 63 dead rows; decode is memory bound).
* ``bfloat16`` / ``float16`` pages. wgmma reads float32 as tf32 (too coarse for the 1e-5
  float32 contract) and needs K-major float32 operands, which V as the B operand of ``P V`` is
  not, so float32 inputs on a real GPU are routed to the exact XLA path
  (:func:`kernels_pallas.reference.ragged_paged_attention_xla`) with a logged notice.
  Interpret mode runs float32 through the kernel itself.
* ``head_dim`` a multiple of 64 (128-byte swizzle tiles of ``(8, 64)`` bf16) up to 256 (the
  f32 accumulator's registers): 64, 128, 192, 256.
* ``G`` (query heads per kv head) divides 64: 1, 2, 4, ..., 64.
* ``block_size`` a multiple of 8 that divides 64 or is a multiple of 64 (8 ... 64, 128, 256):
  a 64-token KV step must be whole pages or a whole slice of one page.
* SMEM (:func:`smem_bytes`): Q 64xD + ``kv_stages`` x 2 x 64xD (input dtype) + a 64x64
  float32 output stage: 128 KiB at D = 128 (3 stages), 176 KiB at D = 256 (2 stages); Hopper
  allows 227 KiB per block.
Entry points raise ``ValueError`` for geometry outside these limits (at trace time); the
public dispatch asks :func:`unsupported_reason` first and runs the XLA path instead.

Interpret mode (CPU tests)
--------------------------
``interpret=True`` runs the same kernel body in Mosaic GPU's interpreter: grid, TMA copies,
mbarriers, scalar GMEM reads, SMEM stages, loops and masking are all interpreted. Two things
differ, because the interpreter lacks them: the two matmuls are computed with ``jnp.dot`` on
the SMEM contents (its ``wgmma`` rejects a transposed operand and register A operands), and
register layouts (``plgpu.layout_cast``, loads with a layout: no CPU rules) are skipped.
Uninitialized SMEM is NaN in the interpreter, which the NaN tests rely on, and its barrier
checks and race detector (``interpret=compat.mosaic_gpu_interpret_params(detect_races=True)``)
validate the pipeline's synchronization. The compiled path itself is checked on any host by
exporting for CUDA (``jax.export(..., platforms=["cuda"])``), which runs the full Mosaic GPU
lowering (layouts, TMA descriptors, wgmma shapes) short of ptxas; on a GPU the tests and
``scripts/gpu_check.sh`` compile and run it. JAX API differences between releases go through
:mod:`kernels_pallas.compat` (lane lowering semantics pinned, ``load``, ``transpose``).
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

from kernels_pallas import compat, reference
from kernels_pallas.gpu.work import (
    BLOCK_KV,
    M_FIRST,
    M_HI,
    M_LAYER,
    M_LO,
    M_NQ,
    M_POS0,
    M_ROW0,
    M_SEQ,
    M_STEPS,
    NUM_SMS,
    combine,
    decode_work,
    default_item_budget,
    plan_items,
    ragged_work,
    split_work,
)
from kernels_pallas.kv_layout import kv_row

__all__ = [
    "paged_attention_gpu",
    "ragged_paged_attention_gpu",
    "unsupported_reason",
    "check_compiled_support",
    "default_item_budget",
    "default_kv_stages",
    "split_work",
    "smem_bytes",
    "NUM_SMS",
]

logger = logging.getLogger(__name__)

_ROWS = 64  # wgmma M: rows of one query tile (tokens x heads of a GQA group)
_OUT_COLS = 64  # columns per output store (keeps the float32 output stage at 16 KiB)
_MAX_HEAD_DIM = 256  # the f32 accumulator is D / 2 registers a thread
SMEM_LIMIT = 227 * 1024  # Hopper: max dynamic shared memory per block
_NEG_INF = float("-inf")
_COMPILED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration of one kernel instance."""

    g: int  # query heads per kv head
    d: int
    s: int  # block size
    m: int  # max blocks per sequence
    kv_heads: int
    packing: int  # P: combined heads per 32-bit word of the page layout
    slots: int  # pipeline stages
    out_rows: int  # rows of each item written back (G rounded up to 8 for decode, 64 ragged)
    dtype: jnp.dtype
    sm_scale: float
    soft_cap: float | None
    window: int | None
    interpret: bool
    interpret_params: object = None  # an InterpretGPUParams, or None for the defaults

    @property
    def piece(self) -> int:
        """Tokens per TMA copy: a whole page, or a 64-token slice of a larger page."""
        return min(self.s, BLOCK_KV)

    @property
    def pieces_per_step(self) -> int:
        return BLOCK_KV // self.piece


# ---------------------------------------------------------------------------------------------
# Support checks and heuristics
# ---------------------------------------------------------------------------------------------


def unsupported_reason(*, head_dim: int, num_q_per_kv: int, block_size: int, dtype) -> str | None:
    """Why the compiled Hopper kernel cannot take this geometry, or ``None`` if it can.

    The public dispatch runs the XLA path (with a warning naming the reason) when this is not
    ``None``. Hardware (compute capability 9.x) is the dispatch's business, not checked here.

    Args:
      head_dim: D.
      num_q_per_kv: G = H // K.
      block_size: S.
      dtype: the pages' dtype.
    """
    if jnp.dtype(dtype) not in _COMPILED_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (wgmma here takes bfloat16/float16)"
    problem = _check_geometry(head_dim, block_size, num_q_per_kv)
    if problem is not None:
        return problem
    need = smem_bytes(head_dim, dtype, default_kv_stages(head_dim))
    if need > SMEM_LIMIT:
        return f"head_dim={head_dim} needs {need} bytes of shared memory (limit {SMEM_LIMIT})"
    return None


def check_compiled_support(head_dim: int, block_size: int, dtype) -> str | None:
    """:func:`unsupported_reason` for ``G = 1`` (kept for callers that have no G)."""
    return unsupported_reason(head_dim=head_dim, num_q_per_kv=1, block_size=block_size, dtype=dtype)


def _check_geometry(head_dim: int, block_size: int, g: int = 1) -> str | None:
    if head_dim % 64 or not 0 < head_dim <= _MAX_HEAD_DIM:
        return (
            f"head_dim={head_dim} is not a multiple of 64 up to {_MAX_HEAD_DIM} "
            "(128B-swizzled TMA tiles, one f32 accumulator in registers)"
        )
    if block_size <= 0 or block_size % 8 or (BLOCK_KV % block_size and block_size % BLOCK_KV):
        return (
            f"block_size={block_size} must be a multiple of 8 that divides {BLOCK_KV} or a "
            f"multiple of {BLOCK_KV}"
        )
    if g <= 0 or _ROWS % g:
        return f"query heads per kv head ({g}) must divide {_ROWS}"
    return None


def default_kv_stages(head_dim: int) -> int:
    """Pipeline depth: 3 stages of K+V up to D = 192 (<= 184 KiB SMEM), 2 at D = 256."""
    return 3 if head_dim <= 192 else 2


def smem_bytes(head_dim: int, dtype, kv_stages: int) -> int:
    """Shared memory of one block: Q tile, K/V stages, output and LSE staging, barriers."""
    item = jnp.dtype(dtype).itemsize
    q = _ROWS * head_dim * item
    kv = 2 * kv_stages * BLOCK_KV * head_dim * item
    out = _ROWS * min(head_dim, _OUT_COLS) * 4 + _ROWS * 4
    return q + kv + out + 8 * (1 + 2 * kv_stages)


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
    return compat.mosaic_gpu_load(ref, plgpu.Layout.WGMMA)


def _emulated_wgmma_done() -> None:
    """Interpret mode: the SMEM reads that stood in for a wgmma are visible to async copies.

    A real wgmma reads SMEM through the async proxy and has completed (``wgmma.wait``) when
    its accumulator is read, so the TMA that refills the stage afterwards is ordered after
    it. The interpreter's stand-in reads through the generic proxy, which its race detector
    orders before a later TMA write only across a proxy fence: ``commit_smem``.
    """
    plgpu.commit_smem()


def _mma_qk(q_smem, k_stage, cfg: _Cfg) -> jax.Array:
    """f32[64, 64] = Q @ K^T (wgmma; jnp.dot in interpret mode)."""
    if cfg.interpret:
        out = jnp.dot(q_smem[...], k_stage[...].T, preferred_element_type=jnp.float32)
        _emulated_wgmma_done()
        return out

    def body(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, compat.mosaic_gpu_transpose(k_stage, (1, 0)))
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC((_ROWS, BLOCK_KV), jnp.float32))


def _mma_pv_into(acc: jax.Array, p: jax.Array, v_stage, cfg: _Cfg) -> jax.Array:
    """``acc + P @ V`` accumulated in place (one live f32 accumulator); P in the input dtype."""
    p = p.astype(cfg.dtype)
    if cfg.interpret:
        out = acc + jnp.dot(p, v_stage[...], preferred_element_type=jnp.float32)
        _emulated_wgmma_done()
        return out

    def body(acc_ref):
        plgpu.wgmma(acc_ref, p, v_stage)

    return pl.run_state(body)(plgpu.ACC.init(acc))


def _kernel(items_ref, tables_ref, q_ref, kv_ref, o_ref, lse_ref, cfg: _Cfg):
    """One (work item, kv head): online softmax over the item's KV steps of one query tile."""
    item = lax.axis_index("i")
    kh = lax.axis_index("k")
    seq = items_ref[item, M_SEQ]
    row0 = items_ref[item, M_ROW0]
    nq = items_ref[item, M_NQ]
    pos0 = items_ref[item, M_POS0]
    lo = items_ref[item, M_LO]
    hi = items_ref[item, M_HI]
    layer = items_ref[item, M_LAYER]
    first = items_ref[item, M_FIRST]
    n_steps = items_ref[item, M_STEPS]
    bkv, s, piece = BLOCK_KV, cfg.s, cfg.piece

    k_c, k_j = _head_at(kh, False, cfg.packing)  # K of kv head kh: kv[..., k_c, k_j, :]
    v_c, v_j = _head_at(kh, True, cfg.packing)

    def scoped(q_smem, k_smem, v_smem, o_smem, lse_smem, q_full, k_full, v_full):
        def issue_piece(step, c, slot):
            """TMA piece ``c`` of KV step ``step`` into stage ``slot``, or arrive if unneeded."""
            t0 = step * bkv + c * piece  # first token of the piece
            j = t0 // s if s > bkv else step * cfg.pieces_per_step + c  # page index
            needed = (j < cfg.m) & (t0 < hi) & (t0 + piece > lo)
            blk = jnp.maximum(tables_ref[seq, jnp.minimum(j, cfg.m - 1)], 0)
            rows = pl.ds(lax.rem(t0, s), piece) if s > bkv else pl.ds(0, s)
            dst = pl.ds(c * piece, piece)

            @pl.when(needed)
            def _copy():  # strided [piece, D] windows: row stride C * P * D elements
                k_src = kv_ref.at[layer, blk, rows, k_c, k_j]
                v_src = kv_ref.at[layer, blk, rows, v_c, v_j]
                plgpu.copy_gmem_to_smem(k_src, k_smem.at[slot, dst], k_full.at[slot])
                plgpu.copy_gmem_to_smem(v_src, v_smem.at[slot, dst], v_full.at[slot])

            @pl.when(~needed)
            def _skip():  # keep the barrier's arrival count at pieces_per_step
                plgpu.barrier_arrive(k_full.at[slot])
                plgpu.barrier_arrive(v_full.at[slot])

        def issue(step, slot):
            for c in range(cfg.pieces_per_step):
                issue_piece(step, c, slot)

        def prefetch(i):
            pl.when(i < n_steps)(lambda: issue(first + i, i))

        plgpu.copy_gmem_to_smem(q_ref.at[kh, pl.ds(row0 * cfg.g, _ROWS)], q_smem, q_full.at[0])
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
        plgpu.barrier_wait(q_full.at[0])

        def step_body(i, carry):
            acc, m_i, l_i = carry
            step = first + i
            slot = lax.rem(i, cfg.slots)
            start = step * bkv
            plgpu.barrier_wait(k_full.at[slot])
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
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            plgpu.barrier_wait(v_full.at[slot])

            @pl.when((start < lo) | (start + bkv > hi))
            def _scrub_v():  # zero V rows outside [lo, hi): stale SMEM or unwritten slots
                stage = v_smem.at[slot]
                vals = _load_wgmma(stage, cfg)
                keep = (start + vrow >= lo) & (start + vrow < hi)
                stage[...] = jnp.where(keep, vals, jnp.zeros_like(vals))
                plgpu.commit_smem()

            acc = _mma_pv_into(acc, p, v_smem.at[slot], cfg)

            @pl.when(i + cfg.slots < n_steps)
            def _refill():  # every read of this stage (both wgmmas, the V scrub) is done
                issue(step + cfg.slots, slot)

            return acc, m_new, l_i

        acc, m_i, l_i = lax.fori_loop(0, n_steps, step_body, (acc, m_i, l_i))

        has = l_i > 0.0
        inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
        acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        lse_smem[...] = jnp.where(has, m_i + jnp.log(jnp.where(has, l_i, 1.0)), _NEG_INF)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[item, kh])
        cols = o_smem.shape[1]
        for c in range(cfg.d // cols):
            if c:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[...] = acc if cols == cfg.d else acc[:, c * cols : (c + 1) * cols]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(0, cfg.out_rows)],
                o_ref.at[item, kh, :, pl.ds(c * cols, cols)],
            )
        plgpu.wait_smem_to_gmem(0)

    def live_item(*refs):
        pl.when(n_steps > 0)(lambda: scoped(*refs))  # dead items: no Q load, no writes

    transforms = _smem_transforms(cfg.dtype)
    pl.run_scoped(
        live_item,
        plgpu.SMEM((_ROWS, cfg.d), cfg.dtype, transforms=transforms),
        plgpu.SMEM((cfg.slots, bkv, cfg.d), cfg.dtype, transforms=transforms),
        plgpu.SMEM((cfg.slots, bkv, cfg.d), cfg.dtype, transforms=transforms),
        plgpu.SMEM(
            (_ROWS, min(cfg.d, _OUT_COLS)), jnp.float32, transforms=_smem_transforms(jnp.float32)
        ),  # fmt: skip
        plgpu.SMEM((_ROWS,), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=cfg.pieces_per_step, num_barriers=cfg.slots),
        plgpu.Barrier(num_arrivals=cfg.pieces_per_step, num_barriers=cfg.slots),
    )


def _head_at(kh, value: bool, packing: int):
    """``(c, j)``: kv head ``kh``'s K / V is ``kv_pages[..., c, j, :]`` (combined head
    ``2 * kh + value``); static arithmetic where the packing allows (P = 1, 2)."""
    if packing == 1:
        return 2 * kh + int(value), 0
    if packing == 2:
        return kh, int(value)
    return kv_row(kh, value, packing)


def _reduce_layout():
    return plgpu.Layout.WGMMA.reduce(1)


def _wgmma_layout():
    return plgpu.Layout.WGMMA


def _smem_transforms(dtype) -> tuple:
    """128-byte swizzle with (8, 128 / itemsize) tiles: what TMA + wgmma want for K-major data.

    The float32 output stage is swizzled too, so storing the WGMMA-layout accumulator into it
    has a bank-conflict-free plan (JAX 0.12 refuses to lower a conflicting one).
    """
    itemsize = jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128))


def _run_kernel(items, tables, q_rows, kv_pages, cfg: _Cfg):
    """Launch the kernel. Returns partial ``o f32[I, K, R, D]`` and ``lse f32[I, K, 64]``."""
    num_items = items.shape[0]
    out_type = (
        jax.ShapeDtypeStruct((num_items, cfg.kv_heads, cfg.out_rows, cfg.d), jnp.float32),
        jax.ShapeDtypeStruct((num_items, cfg.kv_heads, _ROWS), jnp.float32),
    )
    fn = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg),
        out_type=out_type,
        grid=(num_items, cfg.kv_heads),
        grid_names=("i", "k"),
        interpret=_interpret_params(cfg.interpret_params) if cfg.interpret else None,
        compiler_params=None
        if cfg.interpret
        else compat.mosaic_gpu_compiler_params(approx_math=True),
    )
    return fn(items, tables, q_rows, kv_pages)


def _interpret_params(given=None):
    """Mosaic GPU interpret-mode parameters: ``given``, or the interpreter's defaults."""
    return compat.mosaic_gpu_interpret_params() if given is None else given


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


def _make_cfg(q, kv_pages, num_kv_heads, block_tables, *, sm_scale, soft_cap, sliding_window,
              interpret, out_rows, kv_stages=None) -> _Cfg:  # fmt: skip
    kv_heads = _check_pages(q, kv_pages, num_kv_heads)
    _, _, s, _, p, d = kv_pages.shape
    g = q.shape[1] // kv_heads
    problem = _check_geometry(d, s, g)
    if problem is not None:
        raise ValueError(f"Mosaic GPU paged attention: {problem}")
    stages = default_kv_stages(d) if kv_stages is None else int(kv_stages)
    need = smem_bytes(d, q.dtype, stages)
    if stages < 1 or (need > SMEM_LIMIT and not interpret):
        raise ValueError(
            f"kv_stages={stages} needs {need} bytes of shared memory (limit {SMEM_LIMIT})"
        )
    return _Cfg(
        g=g, d=d, s=s, m=block_tables.shape[1], kv_heads=kv_heads, packing=p, slots=stages,
        out_rows=out_rows, dtype=jnp.dtype(q.dtype), sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret),
        interpret_params=None if isinstance(interpret, bool) else interpret,
    )  # fmt: skip


def _check_pages(q: jax.Array, kv_pages: jax.Array, num_kv_heads: int) -> int:
    """K, after checking that ``kv_pages [L, N, S, C, P, D]`` holds ``num_kv_heads`` heads."""
    if kv_pages.ndim != 6:
        raise ValueError(
            f"Mosaic GPU paged attention: kv_pages must be [L, N, S, C, P, D], got {kv_pages.shape}"
        )
    kv_heads = int(num_kv_heads)
    c, p = kv_pages.shape[3:5]
    if not 0 < 2 * kv_heads <= c * p or q.shape[1] % kv_heads:
        raise ValueError(
            f"Mosaic GPU paged attention: num_kv_heads={kv_heads} does not fit pages "
            f"{kv_pages.shape} and {q.shape[1]} query heads"
        )
    return kv_heads


def _use_fallback(kv_pages: jax.Array, interpret: bool, name: str) -> bool:
    if interpret or jnp.dtype(kv_pages.dtype) in _COMPILED_DTYPES:
        return False
    logger.warning(
        "%s: %s pages run on the exact XLA path (the Hopper kernel's wgmma takes bf16/f16)",
        name, jnp.dtype(kv_pages.dtype).name,
    )  # fmt: skip
    return True


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

_STATIC = (
    "num_kv_heads", "sm_scale", "soft_cap", "sliding_window", "interpret", "num_splits",
    "kv_stages",
)  # fmt: skip


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention_gpu(
    q: jax.Array,
    kv_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    num_kv_heads: int,
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
      kv_pages: ``[L, N, S, C, P, D]`` stacked token-major pages
        (:mod:`kernels_pallas.kv_layout`); ``layer`` picks one.
      lengths: ``i32[B]``; 0 marks a padding row (output zeros).
      block_tables: ``i32[B, M]``; negative ids are never dereferenced.
      num_kv_heads: K (static; ``C * P / 2`` for the 16-bit pages the kernel takes).
      sm_scale: logit scale.
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)`` if set.
      sliding_window: keys in ``(pos - window, pos]`` only, if set.
      interpret: run in Mosaic GPU interpret mode (CPU); ``True`` or an
        ``InterpretGPUParams`` (e.g. ``compat.mosaic_gpu_interpret_params(detect_races=True)``).
      num_splits: exactly this many KV splits per live sequence (at most its 64-token steps);
        default: splits by need (:func:`split_work`), enough to fill the GPU.
      kv_stages: K/V pipeline depth (SMEM stages); default :func:`default_kv_stages`.
      layer: layer index into the stacked pages (read in the kernel, no copy; default 0).

    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    layer = 0 if layer is None else layer
    kv_heads = _check_pages(q, kv_pages, num_kv_heads)
    if _use_fallback(kv_pages, interpret, "paged_attention_gpu"):
        # Decode is ragged attention with one row per sequence (memory-light XLA scan).
        b = q.shape[0]
        return reference.ragged_paged_attention_xla(
            q, kv_pages, lengths, block_tables, jnp.arange(b + 1, dtype=jnp.int32), b,
            num_kv_heads=kv_heads, sm_scale=sm_scale, soft_cap=soft_cap,
            sliding_window=sliding_window, layer=layer,
        )  # fmt: skip
    b, h, d = q.shape
    g = h // kv_heads
    out_rows = -(-g // 8) * 8  # whole (8, 32) tiles of the swizzled f32 output stage
    cfg = _make_cfg(
        q, kv_pages, kv_heads, block_tables, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret, kv_stages=kv_stages,
        out_rows=out_rows,
    )  # fmt: skip
    tiles = decode_work(lengths, sliding_window, layer)
    items, item_tile = plan_items(tiles, kv_heads, num_splits, cfg.interpret)
    q_rows = _q_rows(q, kv_heads)
    o, lse = _run_kernel(items, block_tables.astype(jnp.int32), q_rows, kv_pages, cfg)
    out = combine(o, lse, item_tile, b)[:, :, :g]  # [B, K, G, D]
    return out.reshape(b, h, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_paged_attention_gpu(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    num_kv_heads: int,
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
      kv_pages, num_kv_heads: as in :func:`paged_attention_gpu`.
      kv_lens: ``i32[B]``.
      block_tables: ``i32[B, M]``.
      cu_q_lens: ``i32[B + 1]``.
      num_seqs: scalar.
      sm_scale, soft_cap, sliding_window, interpret, num_splits, kv_stages, layer: as in
        :func:`paged_attention_gpu` (``num_splits`` counts splits per live query tile).

    Returns:
      ``[T, H, D]`` in ``q.dtype``.
    """
    layer = 0 if layer is None else layer
    kv_heads = _check_pages(q, kv_pages, num_kv_heads)
    if _use_fallback(kv_pages, interpret, "ragged_paged_attention_gpu"):
        return reference.ragged_paged_attention_xla(
            q, kv_pages, kv_lens, block_tables, cu_q_lens, num_seqs, num_kv_heads=kv_heads,
            sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, layer=layer,
        )  # fmt: skip
    t, h, d = q.shape
    g = h // kv_heads
    cfg = _make_cfg(
        q, kv_pages, kv_heads, block_tables, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret, kv_stages=kv_stages,
        out_rows=_ROWS,
    )  # fmt: skip
    tpt = _ROWS // g
    tiles, tile_of_row, slot_of_row = ragged_work(
        kv_lens, cu_q_lens, num_seqs, t, tpt, sliding_window, layer
    )
    items, item_tile = plan_items(tiles, kv_heads, num_splits, cfg.interpret)
    q_rows = _q_rows(q, kv_heads)
    o, lse = _run_kernel(items, block_tables.astype(jnp.int32), q_rows, kv_pages, cfg)
    out = combine(o, lse, item_tile, tiles.shape[0])  # [W, K, 64, D]
    out = out.reshape(out.shape[0], kv_heads, tpt, g, d)
    out = out[tile_of_row, :, slot_of_row]  # [T, K, G, D]
    _, _, valid = reference.ragged_row_info(cu_q_lens, kv_lens, num_seqs, t)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(t, h, d).astype(q.dtype)
