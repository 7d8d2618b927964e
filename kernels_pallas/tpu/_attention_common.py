"""Pieces shared by the Mosaic TPU paged-attention kernels (decode and ragged).

* :class:`TableRows`: block-table rows fetched on demand. Tables stay in HBM
  (``memory_space=ANY``) and one sequence's row ``i32[M]`` at a time is DMA'd into a two-slot,
  flat SMEM scratch, so a batch's tables (256 sequences x 32K tokens = 2 MiB at ``S = 16``) never
  have to fit in SMEM (1 MiB on v5e/v6e, shared with the other scalars).
* :class:`KVStream`: the DMAs that bring ``P`` KV pages of one layer, all ``K`` kv heads at
  once (one descriptor per page for K and one for V: ``pages.at[layer, :, block]`` is
  ``[K, S, D]``), into one slot of a double-buffered, page-major VMEM scratch
  ``[2, P, K, S, D]``; a slot is waited for ONCE per buffer, with a descriptor as large as
  all of its copies. Pages outside ``[first, end)`` are neither copied nor waited on (their
  VMEM rows keep stale data, which the caller masks with ``where``). Block ids are used as
  read: the kernels' wrappers clip the tables to ``[0, N)`` (negative = no block: 0), one
  elementwise op per call instead of a clamp per page.
* :func:`attend_step`: one flash-attention update of the ``(m, l, acc)`` VMEM state of every
  kv head (statistics lane-dense in the ragged kernel: :func:`state_scratch`), with bf16/f16
  operands fed to the MXU as they are (float32 accumulation), a ``where``-mask so NaN garbage
  in masked keys/values cannot reach the result.

A DMA semaphore counts bytes, not copies: waiting for one copy on a semaphore shared by
several only says that *some* copy of that size landed. Both helpers therefore wait for every
copy of a slot before anything in that slot is read.

``MASK_VALUE`` is finite, so fully masked rows keep ``m = MASK_VALUE`` and ``l = 0`` (their
output becomes zeros, never NaN).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2_E = 1.4426950408889634
#: Lanes of a softmax statistic (m, l) in the state scratch: lane-dense, the row's value in
#: every lane of its vreg row.
STAT_LANES = 128

#: VMEM the KV double buffers may take (K and V, two slots). The kernels raise their scoped
#: VMEM limit to fit them (:func:`vmem_limit_bytes`).
KV_VMEM_BUDGET = 8 * 1024 * 1024


def vmem_tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """VMEM of a ``[rows, cols]`` slab: rows padded to the sublane tile (8 32-bit rows, 16
    packed 16-bit rows, 32 8-bit rows), columns to 128 lanes."""
    sub = 8 * max(1, 4 // itemsize)
    return -(-rows // sub) * sub * -(-cols // 128) * 128 * itemsize


def default_pages_per_compute_block(
    block_size: int, max_blocks: int, target_tokens: int, *, kv_heads: int, head_dim: int,
    itemsize: int,
) -> int:  # fmt: skip
    """Pages per compute step: about ``target_tokens`` keys, at most ``max_blocks`` pages,
    and small enough that the four ``[P, K, S, D]`` KV buffers fit :data:`KV_VMEM_BUDGET`."""
    per_page = 4 * kv_heads * vmem_tile_bytes(block_size, head_dim, itemsize)
    p = min(max_blocks, max(1, target_tokens // block_size), KV_VMEM_BUDGET // per_page)
    return int(max(1, p))


def vmem_limit_bytes(headroom: int, scratch_bytes: int) -> int:
    """The scoped VMEM limit for a kernel with ``scratch_bytes`` of scratch: that plus
    ``headroom`` for pipelined blocks and temporaries, at least the 32 MiB default of v6e, at
    most 60 MiB (TPU7x has 64 MiB)."""
    mib = 1024 * 1024
    return int(min(max(scratch_bytes + headroom, 32 * mib), 60 * mib))


#: Table columns a row is padded to: an HBM -> SMEM row copy moves a multiple of 512 B.
TABLE_ROW_ALIGN = 128


def table_row_len(max_blocks: int, pages: int) -> int:
    """Entries per SMEM table row (:class:`TableRows`): ``M + P`` (a step's last page index
    needs no clamp) rounded up to :data:`TABLE_ROW_ALIGN`."""
    return -(-(max_blocks + pages) // TABLE_ROW_ALIGN) * TABLE_ROW_ALIGN


def dma_tables(block_tables: jax.Array, num_blocks: int) -> jax.Array:
    """``i32[B, M_pad]``: block tables as the kernels' DMAs read them, once per call (one
    elementwise op on the table instead of a clamp per page): ids clipped to ``[0, N)``
    (negative = no block: 0, never copied past a length), columns padded with 0 to a multiple
    of :data:`TABLE_ROW_ALIGN` (an HBM -> SMEM row copy moves whole 512 B units)."""
    tables = jnp.clip(block_tables.astype(jnp.int32), 0, num_blocks - 1)
    pad = -tables.shape[1] % TABLE_ROW_ALIGN
    return jnp.pad(tables, ((0, 0), (0, pad))) if pad else tables


@dataclasses.dataclass(frozen=True)
class TableRows:
    """One sequence's block-table row at a time, HBM -> SMEM (two slots, flat).

    Attributes:
      tables_hbm: ``i32[B, M]`` block tables left in HBM, ``M`` a multiple of
        :data:`TABLE_ROW_ALIGN` (the wrapper pads them).
      rows: ``i32[2 * W]`` SMEM scratch, slot ``t``'s row at ``t * W``
        (``W = table_row_len(M, P)``): a flat row is indexed with one add (a 2-D SMEM array
        is tiled, and its index takes a shift, a mask and three adds).
      sems: DMA semaphores ``[2]``, one per slot.
    """

    tables_hbm: Any
    rows: Any
    sems: Any

    @property
    def row_len(self) -> int:
        return self.rows.shape[0] // 2

    def _copy(self, seq: jax.Array, tslot: jax.Array):
        m = self.tables_hbm.shape[1]
        dst = self.rows.at[pl.ds(pl.multiple_of(tslot * self.row_len, TABLE_ROW_ALIGN), m)]
        return pltpu.make_async_copy(self.tables_hbm.at[seq], dst, self.sems.at[tslot])

    def start(self, seq: jax.Array, tslot: jax.Array) -> None:
        self._copy(seq, tslot).start()

    def wait(self, seq: jax.Array, tslot: jax.Array) -> None:
        self._copy(seq, tslot).wait()


@dataclasses.dataclass(frozen=True)
class KVStream:
    """DMAs of up to ``P`` pages (all kv heads) of one layer from HBM into a VMEM slot.

    Attributes:
      k_hbm, v_hbm: ``[L, K, N, S, D]`` refs left in HBM (``memory_space=ANY``).
      k_buf, v_buf: ``[2, P, K, S, D]`` VMEM scratch (two slots for double buffering).
      sem: DMA semaphores ``[2]``, one per slot (the K and V copies of a slot share it).
      table: :class:`TableRows` (flat SMEM rows of ``W >= M + P`` entries).
      layer: scalar selecting ``k_hbm.at[layer]``.
    """

    k_hbm: Any
    v_hbm: Any
    k_buf: Any
    v_buf: Any
    sem: Any
    table: TableRows
    layer: jax.Array

    def start(self, tslot, first_page, end_page, slot) -> None:
        """Start copying pages ``first_page + j`` (``j < P``) that are ``< end_page``
        (``end_page <= M``)."""
        n_pages = self.k_buf.shape[1]
        row = tslot * self.table.row_len + first_page
        n_valid = end_page - first_page  # copies j < n_valid run: one compare with a constant
        for j in range(n_pages):
            # Table entries are in [0, N) (the kernels' wrappers clip the tables), so a block
            # id is used as read; a skipped copy's read stays in the row (W >= M + P).
            block = self.table.rows[row + j]
            kc = pltpu.make_async_copy(
                self.k_hbm.at[self.layer, :, block], self.k_buf.at[slot, j], self.sem.at[slot]
            )
            vc = pltpu.make_async_copy(
                self.v_hbm.at[self.layer, :, block], self.v_buf.at[slot, j], self.sem.at[slot]
            )

            @pl.when(n_valid > j)
            def _start(kc=kc, vc=vc):
                kc.start()
                vc.start()

    def wait(self, tslot, first_page, end_page, slot) -> None:
        """Wait for every copy :meth:`start` issued with the same arguments: one wait per
        buffer, for the bytes of all of them (a DMA semaphore counts bytes)."""
        del tslot
        n = jnp.clip(end_page - first_page, 0, self.k_buf.shape[1])
        for buf in (self.k_buf, self.v_buf):
            whole = buf.at[slot, pl.ds(0, n)]
            pltpu.make_async_copy(whole, whole, self.sem.at[slot]).wait()


def attend_step(
    q_ref: Any,
    k_buf: Any,
    v_buf: Any,
    slot: jax.Array,
    state: tuple[Any, Any, Any],
    mask: jax.Array | None,
    key_ok: jax.Array | None,
    *,
    sm_scale: float,
    soft_cap: float | None,
    n_pages: int | None = None,
    k_scale: jax.Array | None = None,
) -> None:
    """One flash-attention step of R query rows against ``C = P * S`` keys, every kv head.

    Args:
      q_ref: ``[K, R, D]`` queries (VMEM, input dtype: bf16 stays bf16 on the MXU).
      k_buf, v_buf: ``[2, P, K, S, D]`` VMEM; slot ``slot`` holds this step's pages. Keys not
        in ``mask`` may hold anything (NaN included).
      slot: which buffer slot.
      state: ``(m f32[K, R, L], l f32[K, R, L], acc f32[K, R, D])`` VMEM refs, updated; the
        statistics one lane (``L = 1``, the decode kernel) or lane-dense (``L = 128``, each
        row's value in every lane, :func:`state_scratch`).
      mask: ``bool[R, C]``, which (row, key) pairs count; None: every pair (no masking).
      key_ok: ``bool[C, 1]``, keys that count for at least one row: other value rows are
        zeroed so NaN garbage cannot pass through ``p @ v`` (keys need no such care: their
        logits are replaced by ``where``); None with ``mask=None``.
      sm_scale: logit scale (applied to the float32 logits).
      soft_cap: optional logit soft cap.
      n_pages: attend to the slot's first ``n_pages`` pages only (static; default all ``P``):
        ``C = n_pages * S``, and ``mask`` / ``key_ok`` cover those keys.
      k_scale: 8-bit pages: the layer's K scale (a traced f32 scalar). Pages of another
        dtype than the queries' (8-bit ones) are converted to it after their DMA, and the K
        scale joins ``sm_scale`` (the V scale is applied by :func:`finish`).

    The heads are unrolled (a Python loop), so one head's P.V can overlap the next head's
    Q.K^T in the schedule.
    """
    m_ref, l_ref, acc_ref = state
    _, slot_pages, kh, s, d = k_buf.shape  # [2, P, K, S, D]
    n_pages = n_pages or slot_pages
    keys = n_pages * s
    for h in range(kh):
        k = k_buf[slot, :n_pages, h]  # [P, S, D]
        v = v_buf[slot, :n_pages, h]
        if k.dtype != q_ref.dtype:  # 8-bit pages: to the queries' dtype (scales applied later)
            k, v = k.astype(q_ref.dtype), v.astype(q_ref.dtype)
        k, v = k.reshape(keys, d), v.reshape(keys, d)  # [C, D]
        if key_ok is not None:
            v = jnp.where(key_ok, v, jnp.zeros_like(v))
        logits = lax.dot_general(
            q_ref[h], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [R, C]
        m_prev = m_ref[h]  # [R, 1] or lane-dense [R, 128], scaled units
        scale = sm_scale if k_scale is None else sm_scale * k_scale
        if soft_cap is None and sm_scale > 0:
            # The scale rides in the exponent: exp(scale * x - m) = 2^(x * scale * log2(e) -
            # m * log2(e)). The max of unscaled logits is scaled on [R, 1], so no [R, C] pass
            # multiplies (and stores) scaled logits.
            if mask is not None:  # a fill that stays finite once scaled
                fill = (
                    MASK_VALUE / max(1.0, sm_scale)
                    if k_scale is None
                    else MASK_VALUE / jnp.maximum(1.0, scale)
                )
                logits = jnp.where(mask, logits, fill)
            row_max = jnp.max(logits, axis=1, keepdims=True) * scale
            m_new = jnp.maximum(m_prev, row_max)
            p = jnp.exp2(logits * (scale * _LOG2_E) - spread_lanes(m_new * _LOG2_E, keys))
        else:
            logits = logits * scale
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            if mask is not None:
                logits = jnp.where(mask, logits, MASK_VALUE)
            m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            p = jnp.exp(logits - spread_lanes(m_new, keys))
        alpha = jnp.exp(m_prev - m_new)
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, D]
        acc_ref[h] = spread_lanes(alpha, d) * acc_ref[h] + pv
        m_ref[h] = m_new


def spread_lanes(x: jax.Array, n: int) -> jax.Array:
    """A per-row statistic ``[..., L]`` (``L = 1``, or lane-dense: the row's value in each
    of ``L = 128`` lanes) as an operand of a ``[..., n]`` array: lane-dense values are tiled
    (whole vregs, no cross-lane broadcast) or sliced to ``n`` lanes; ``[..., 1]`` ones are
    returned as they are (broadcast by the operation)."""
    lanes = x.shape[-1]
    if lanes == 1 or lanes == n:
        return x
    if n < lanes:
        return x[..., :n]
    if n % lanes:
        return x[..., :1]
    return jnp.concatenate([x] * (n // lanes), axis=-1)


def reset_state(state: tuple[Any, Any, Any], sinks: jax.Array | None = None) -> None:
    """``m = MASK_VALUE``, ``l = 0``, ``acc = 0`` for every head.

    With attention sinks (``f32[K, R, 1]``, each row's query head's sink logit, broadcast to
    the statistics' lanes) the softmax starts from the sink instead, a logit with no value:
    ``m = max(sink, MASK_VALUE)``, ``l = exp(sink - m)`` (1, or 0 for a sink of -inf),
    ``acc = 0``; the online softmax then carries it in its denominator, and a row that sees
    no key returns zeros.
    """
    m_ref, l_ref, acc_ref = state
    if sinks is None:
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    else:
        sinks = jnp.broadcast_to(sinks, m_ref.shape)  # lane-dense statistics: every lane
        m0 = jnp.maximum(sinks, MASK_VALUE)
        m_ref[...] = m0
        l_ref[...] = jnp.exp(sinks - m0)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def finish(
    l_i: jax.Array, acc: jax.Array, v_scale: jax.Array | None = None, *,
    reciprocal: bool = False, approx: bool = False,
) -> jax.Array:  # fmt: skip
    """``acc / l`` (times an 8-bit cache's V scale) with rows that saw no key returning
    zeros; ``l_i`` ``[..., R, 1]`` or lane-dense ``[..., R, 128]``, ``acc`` ``[..., R, D]``.

    ``reciprocal``: multiply by ``1 / l`` (``pl.reciprocal`` without IEEE edge cases: ``l`` is
    0 or at least 1, the row max's own term) instead of dividing; ``approx``: the TPU's
    reciprocal estimate without its refinement (for bf16 outputs: the exact path refines
    the estimate with one Newton step, which doubles its bits to float32's 24, so it holds
    about 12, bf16 keeps 8; RPA v3 takes it for outputs narrower than float32)."""
    l_i = jnp.where(l_i > 0.0, l_i, 1.0)
    if not (reciprocal or approx):
        out = acc / spread_lanes(l_i, acc.shape[-1])
    else:
        inv = pl.reciprocal(l_i, approx=approx, full_range=False)
        out = acc * spread_lanes(inv, acc.shape[-1])
    return out if v_scale is None else out * v_scale


def state_scratch(kv_heads: int, rows: int, head_dim: int) -> list:
    """VMEM scratch shapes of ``(m, l, acc)``: lane-dense statistics ``f32[K, R, 128]``
    (a row's value in every lane: whole-vreg loads and stores, no lane broadcasts)."""
    return [
        pltpu.VMEM((kv_heads, rows, STAT_LANES), jnp.float32),
        pltpu.VMEM((kv_heads, rows, STAT_LANES), jnp.float32),
        pltpu.VMEM((kv_heads, rows, head_dim), jnp.float32),
    ]


def pipeline_scratch(
    *, kv_heads: int, rows: int, pages: int, block_size: int, head_dim: int, max_blocks: int,
    k_dtype: Any, v_dtype: Any,
) -> list:  # fmt: skip
    """Every scratch buffer of an attention kernel, in the order its body receives them.

    ``i32[2 * W]`` SMEM table rows (:class:`TableRows`, ``W = table_row_len(M, P)``), the
    ``[2, P, K, S, D]`` K and V VMEM double buffers (:class:`KVStream`), the ``(m, l, acc)``
    softmax state of ``rows`` query rows per kv head (:func:`state_scratch`), then the DMA
    semaphores ``[2]`` of the table rows and of the KV slots.
    """
    kv_shape = (2, pages, kv_heads, block_size, head_dim)
    return [
        pltpu.SMEM((2 * table_row_len(max_blocks, pages),), jnp.int32),
        pltpu.VMEM(kv_shape, k_dtype),
        pltpu.VMEM(kv_shape, v_dtype),
        *state_scratch(kv_heads, rows, head_dim),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
    ]


def scratch_bytes(
    *, kv_heads: int, rows: int, pages: int, block_size: int, head_dim: int, itemsize: int
) -> int:
    """VMEM of :func:`pipeline_scratch`'s buffers (padded to tiles)."""
    kv = 4 * pages * kv_heads * vmem_tile_bytes(block_size, head_dim, itemsize)
    stats = 2 * kv_heads * vmem_tile_bytes(rows, STAT_LANES, 4)
    acc = kv_heads * vmem_tile_bytes(rows, head_dim, 4)
    return kv + stats + acc
