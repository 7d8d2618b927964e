"""Pieces shared by the Mosaic TPU paged-attention kernels (decode and ragged).

* :class:`TableRows`: block-table rows fetched on demand. Tables stay in HBM
  (``memory_space=ANY``) and one sequence's row ``i32[M]`` at a time is DMA'd into a two-slot,
  flat SMEM scratch, so a batch's tables (256 sequences x 32K tokens = 2 MiB at ``S = 16``) never
  have to fit in SMEM (1 MiB on v5e/v6e, shared with the other scalars).
* :class:`KVStream`: the DMAs that bring ``P`` KV pages of one layer into one slot of a
  double-buffered VMEM scratch ``[2, P * S, R, W, Dp]`` (:func:`kv_buffer_shape`), one
  descriptor per page for K and V of every kv head together (``kv_pages.at[layer, block]``,
  ``[S, C, W, Dp]``, is contiguous: :mod:`kernels_pallas.kv_layout`); a slot is waited for
  ONCE per step, with a descriptor as large as all of its copies. Pages outside ``[first,
  end)`` are neither copied nor waited on (their VMEM rows keep stale data, which the caller
  masks with ``where``). Block ids are used as read: the kernels' wrappers clip the tables to
  ``[0, N)`` (negative = no block: 0), one elementwise op per call instead of a clamp per page.
* :func:`load_kv_head`: one kv head's K and V ``[keys, Dp]`` out of a slot: the slot seen as
  32-bit words ``[P * S * R, Dp]``, the head's word row loaded every ``R`` rows (a strided
  sublane load), and for packed dtypes its K and V taken out of the word by shifts and a
  truncation (bf16: K the low half, V the high half). ``R`` is ``C``, or ``C + 1`` where a
  stride of ``C`` words would put the rows of one strided load in the same VMEM banks
  (:func:`kv_row_stride`; the extra row is never written nor read).
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
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import compat, kv_layout

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


def kv_row_stride(combined_rows: int) -> int:
    """``R``, 32-bit word rows per token in a KV VMEM buffer: ``C``, or ``C + 1`` when a
    strided load of every ``C``-th row would hit one of 32 VMEM banks twice within 24 rows
    (the padding tpu-inference's RPA v3 applies to the same loads)."""
    banks = {(i * combined_rows) % 32 for i in range(24)}
    return combined_rows + 1 if len(banks) < 24 else combined_rows


def kv_buffer_shape(
    pages: int, block_size: int, combined_rows: int, packing: int, head_dim: int
) -> tuple[int, ...]:
    """The KV double buffer ``[2, P * S, R, W, Dp]`` (``R = kv_row_stride(C)``, ``W`` the
    packing): two slots of ``P`` pages, token-major, a token's ``C`` rows of words (and the
    unused padding row, if any) together."""
    return (2, pages * block_size, kv_row_stride(combined_rows), packing, head_dim)


def kv_buffer_bytes(pages: int, block_size: int, combined_rows: int, head_dim: int) -> int:
    """VMEM of :func:`kv_buffer_shape`'s buffer: every row is a 32-bit word per lane (the
    packed dtypes' ``[W, Dp]`` tile is one word row), ``Dp`` padded to 128 lanes."""
    lanes = -(-head_dim // 128) * 128
    return 2 * pages * block_size * kv_row_stride(combined_rows) * 4 * lanes


def kv_page_bytes(block_size: int, combined_rows: int, head_dim: int) -> int:
    """Bytes of one page of one layer, K and V of every head (``S * C`` word rows): what a
    step's buffers are budgeted by (the padding row, if any, is left out of the budget so
    the step sizes stay those of the K / V layout at the same bytes)."""
    return block_size * combined_rows * 4 * (-(-head_dim // 128) * 128)


def combined_rows_of(kv_heads: int, itemsize: int) -> int:
    """``C`` of ``kv_heads`` heads of ``itemsize``-byte elements: the layout's own
    :func:`kernels_pallas.kv_layout.combined_rows` (which reads only the dtype's width)."""
    return kv_layout.combined_rows(kv_heads, jnp.dtype(f"uint{8 * itemsize}"))


def default_pages_per_compute_block(
    block_size: int, max_blocks: int, target_tokens: int, *, kv_heads: int, head_dim: int,
    itemsize: int, kv_budget: int = KV_VMEM_BUDGET,
) -> int:  # fmt: skip
    """Pages per compute step: about ``target_tokens`` keys, at most ``max_blocks`` pages,
    and small enough that two slots of pages fit ``kv_budget`` bytes (default
    :data:`KV_VMEM_BUDGET`; ``head_dim`` the stored ``Dp``)."""
    per_page = 2 * kv_page_bytes(block_size, combined_rows_of(kv_heads, itemsize), head_dim)
    p = min(max_blocks, max(1, target_tokens // block_size), kv_budget // per_page)
    return int(max(1, p))


#: The most scoped VMEM a kernel asks for on a chip not known to have more: 60 MiB (TPU7x
#: has 64 MiB).
VMEM_LIMIT_CAP = 60 * 1024 * 1024


def vmem_limit_bytes(headroom: int, scratch_bytes: int, cap: int = VMEM_LIMIT_CAP) -> int:
    """The scoped VMEM limit for a kernel with ``scratch_bytes`` of scratch: that plus
    ``headroom`` for pipelined blocks and temporaries, at least the 32 MiB default of v6e, at
    most ``cap``."""
    mib = 1024 * 1024
    return int(min(max(scratch_bytes + headroom, 32 * mib), cap))


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
    """DMAs of up to ``P`` pages (K and V of every kv head) of one layer into a VMEM slot.

    Attributes:
      kv_hbm: ``[L, N, S, C, W, Dp]`` ref left in HBM (``memory_space=ANY``).
      kv_buf: ``[2, P * S, R, W, Dp]`` VMEM scratch (:func:`kv_buffer_shape`; two slots).
      sem: DMA semaphores ``[2]``, one per slot.
      table: :class:`TableRows` (flat SMEM rows of ``W >= M + P`` entries).
      layer: scalar selecting ``kv_hbm.at[layer]``.
      kv_new: the fused KV write's new rows ``[T, C, W, Dp]`` in HBM (None: not fused).
    """

    kv_hbm: Any
    kv_buf: Any
    sem: Any
    table: TableRows
    layer: jax.Array
    kv_new: Any = None

    def _fused_rows(self, first_page, end_page, fused) -> FusedRows:
        s = self.kv_hbm.shape[2]
        n_valid = jnp.clip(end_page - first_page, 0, self.kv_buf.shape[1] // s)
        cache_end, last_pos, _ = fused
        return FusedRows.of(first_page, n_valid, s, cache_end, last_pos)

    def start(self, tslot, first_page, end_page, slot, fused=None) -> None:
        """Start copying pages ``first_page + j`` (``j < P``) that are ``< end_page``
        (``end_page <= M``). ``fused``: ``(cache_end, last_pos, offset)``: only positions
        below ``cache_end`` come from the pages; those from it up to ``last_pos`` come from
        ``kv_new`` row ``position - offset`` (:class:`FusedRows`)."""
        s = self.kv_hbm.shape[2]
        n_pages = self.kv_buf.shape[1] // s
        row = tslot * self.table.row_len + first_page
        n_valid = end_page - first_page  # copies j < n_valid run: one compare with a constant
        if fused is not None:
            rows = self._fused_rows(first_page, end_page, fused)
            n_valid = rows.full_pages
            rows.start(
                self.kv_hbm, self.kv_buf, self.kv_new, self.sem, self.layer, self.table.rows,
                row, first_page, slot, fused[2],
            )  # fmt: skip
        for j in range(n_pages):
            # Table entries are in [0, N) (the kernels' wrappers clip the tables), so a block
            # id is used as read; a skipped copy's read stays in the row (W >= M + P).
            block = self.table.rows[row + j]
            copy = page_copy(self.kv_hbm, self.kv_buf, self.layer, block, slot, j, self.sem)

            @pl.when(n_valid > j)
            def _start(copy=copy):
                copy.start()

    def wait(self, tslot, first_page, end_page, slot, fused=None) -> None:
        """Wait for every copy :meth:`start` issued with the same arguments: one wait for the
        bytes of all of them (a DMA semaphore counts bytes)."""
        del tslot
        s = self.kv_hbm.shape[2]
        if fused is not None:
            tokens = self._fused_rows(first_page, end_page, fused).total_rows
        else:
            tokens = jnp.clip(end_page - first_page, 0, self.kv_buf.shape[1] // s) * s
        wait_pages(self.kv_buf, self.kv_hbm.shape[3], slot, tokens, self.sem)


def _slot_rows(kv_buf: Any, combined_rows: int) -> Any:
    """The rows a slot's copies write: all of ``kv_buf``'s, or its first ``C`` of ``R``."""
    if kv_buf.shape[2] == combined_rows:
        return kv_buf
    return kv_buf.at[:, :, pl.ds(0, combined_rows)]


def page_copy(kv_hbm, kv_buf, layer, block, slot, j: int, sem):
    """The DMA of page ``block`` of ``layer`` (``[S, C, W, Dp]``, contiguous) into page
    ``j`` of a slot of ``kv_buf`` ``[2, P * S, R, W, Dp]``: one descriptor, K and V of every
    kv head."""
    s, c = kv_hbm.shape[2], kv_hbm.shape[3]
    dst = _slot_rows(kv_buf, c).at[slot, pl.ds(j * s, s)]
    return pltpu.make_async_copy(kv_hbm.at[layer, block], dst, sem.at[slot])


def partial_page_copy(kv_hbm, kv_buf, layer, block, slot, page_in_step, rows: Any, sem):
    """The DMA of the first ``rows`` tokens (traced, ``< S``) of page ``block`` into page
    ``page_in_step`` (traced) of a slot: a page holding cached tokens and, past them, new
    ones that come from the step's K/V instead (:func:`new_rows_copy`)."""
    s, c = kv_hbm.shape[2], kv_hbm.shape[3]
    dst = _slot_rows(kv_buf, c).at[slot, pl.ds(page_in_step * s, rows)]
    return pltpu.make_async_copy(kv_hbm.at[layer, block, pl.ds(0, rows)], dst, sem.at[slot])


def new_rows_copy(kv_new_hbm, kv_buf, slot, first_row: Any, buf_row: Any, rows: Any, sem):
    """The DMA of the step's new K/V rows ``kv_new[first_row : first_row + rows]``
    (``[T, C, W, Dp]`` in HBM) into a slot's token rows from ``buf_row`` on: the fused KV
    write hands attention the new tokens straight from its inputs, never through the pages
    it writes them to."""
    c = kv_new_hbm.shape[1]
    dst = _slot_rows(kv_buf, c).at[slot, pl.ds(buf_row, rows)]
    return pltpu.make_async_copy(kv_new_hbm.at[pl.ds(first_row, rows)], dst, sem.at[slot])


@dataclasses.dataclass(frozen=True)
class FusedRows:
    """Where a compute step's tokens come from when the step's KV write is fused.

    Positions below ``cache_end`` are read from the pages; positions from ``cache_end`` on
    are new this step and come from ``kv_new`` (row ``position - offset``), never from the
    pages, which the same kernel writes them to asynchronously. For a step of ``n_valid``
    pages from ``step_page`` (``S`` tokens each) covering positions up to ``last_pos``:

    Attributes:
      full_pages: pages ``j < full_pages`` are wholly cached (one whole-page DMA each).
      part_rows: cached tokens of page ``full_pages`` (0 when none or when it is whole).
      new_first: the first new position in the step (valid when ``new_rows > 0``).
      new_rows: new positions in the step.
      total_rows: token rows all of the step's copies write (what its one wait counts).
    """

    full_pages: Any
    part_rows: Any
    new_first: Any
    new_rows: Any
    total_rows: Any

    @staticmethod
    def of(step_page, n_valid, block_size: int, cache_end, last_pos) -> FusedRows:
        step_start = step_page * block_size
        valid_end = step_start + n_valid * block_size  # positions the pages span
        cached = jnp.clip(cache_end - step_start, 0, n_valid * block_size)
        full_pages = cached // block_size
        part_rows = cached - full_pages * block_size
        new_first = jnp.maximum(step_start, cache_end)
        new_rows = jnp.maximum(jnp.minimum(valid_end, last_pos + 1) - new_first, 0)
        return FusedRows(full_pages, part_rows, new_first, new_rows, cached + new_rows)

    def start(self, kv_hbm, kv_buf, kv_new_hbm, sem, layer, table, row, step_page, slot,
              offset) -> None:  # fmt: skip
        """Start the partial page's copy and the new rows' copy (the whole pages are the
        caller's, ``j < full_pages``). ``table[row + j]`` is page ``j``'s block id."""
        s = kv_hbm.shape[2]

        @pl.when(self.part_rows > 0)
        def _partial_page():
            block = table[row + self.full_pages]
            partial_page_copy(
                kv_hbm, kv_buf, layer, block, slot, self.full_pages, self.part_rows, sem
            ).start()

        @pl.when(self.new_rows > 0)
        def _new_rows():
            new_rows_copy(
                kv_new_hbm, kv_buf, slot, self.new_first - offset,
                self.new_first - step_page * s, self.new_rows, sem,
            ).start()  # fmt: skip


def kernel_refs(refs: Sequence[Any], fused: bool, has_sinks: bool, has_scales: bool) -> tuple:
    """The attention kernels' refs after the layer and length scalars, unpacked:
    ``(slots_ref, q_ref, tables_hbm, kv_hbm, kv_new_hbm, sinks_ref, k_scale, v_scale, o_ref,
    kv_out, write_sem, scratch)``; the fused write's (``slots_ref``, ``kv_new_hbm``, the
    aliased pages ``kv_out`` and its DMA semaphore ``write_sem``, the last scratch) and the
    optional inputs are None when absent; ``scratch`` the kernel's own scratch refs."""
    if fused:
        slots_ref, q_ref, tables_hbm, kv_hbm, kv_new_hbm, *refs = refs
    else:
        q_ref, tables_hbm, kv_hbm, *refs = refs
        slots_ref = kv_new_hbm = None
    sinks_ref = refs[0] if has_sinks else None
    scales_ref = refs[int(has_sinks)] if has_scales else None
    k_scale = None if scales_ref is None else scales_ref[0]
    v_scale = None if scales_ref is None else scales_ref[1]
    rest = refs[int(has_sinks) + int(has_scales) :]
    if fused:
        o_ref, kv_out, *rest, write_sem = rest  # kv_out: kv_hbm's buffer (aliased)
    else:
        (o_ref, *rest), kv_out, write_sem = rest, None, None
    return (slots_ref, q_ref, tables_hbm, kv_hbm, kv_new_hbm, sinks_ref, k_scale, v_scale,
            o_ref, kv_out, write_sem, rest)  # fmt: skip


def token_writes(kv_new_hbm, kv_out, layer, slots_ref, first: Any, count: int, sem, action):
    """``action(copy)`` for the HBM write of each token ``first + i`` (``i < count``) whose
    slot ``slots_ref[first + i]`` is live (``>= 0``): ``kv_new[t]`` -> ``kv_out[layer,
    slot // S, slot % S]``, one DMA per token (a token's K/V of every head is one contiguous
    ``[C, W, Dp]`` row of the token-major pages). Start them all, then wait for them all with
    the same descriptors (one semaphore: every copy counts the same bytes)."""
    s = kv_out.shape[2]

    @pl.loop(0, count)
    def _token(i):
        t = first + i
        slot = slots_ref[t]
        at = jnp.maximum(slot, 0)

        @pl.when(slot >= 0)
        def _():
            dst = kv_out.at[layer, lax.div(at, s), lax.rem(at, s)]
            action(pltpu.make_async_copy(kv_new_hbm.at[t], dst, sem))


def wait_pages(kv_buf, combined_rows: int, slot, tokens, sem) -> None:
    """One wait for every page copy of a slot: a descriptor as large as ``tokens`` tokens'
    rows (the copies' bytes together; a DMA semaphore counts bytes)."""
    whole = _slot_rows(kv_buf, combined_rows).at[slot, pl.ds(0, tokens)]
    pltpu.make_async_copy(whole, whole, sem.at[slot]).wait()


def _strided_rows(words: Any, start: int, n: int, stride: int) -> jax.Array:
    """Rows ``start, start + stride, ...`` (``n`` of them) of a ``u32[rows, Dp]`` ref: one
    strided sublane load per 128 lanes (a ``Dp = 256`` ref is seen as ``[2 * rows, 128]``)."""
    rows, lanes = words.shape
    folds = lanes // 128 if lanes % 128 == 0 else 1
    if folds == 1:
        return words[pl.ds(start, n, stride=stride)] if stride > 1 else words[pl.ds(start, n)]
    flat = words.reshape(rows * folds, 128)
    parts = [flat[pl.ds(start * folds + f, n, stride=stride * folds)] for f in range(folds)]
    return jnp.concatenate(parts, axis=1)


def _word_rows(kv_buf: Any, slot: jax.Array, row: int, keys: int, interpret: bool) -> jax.Array:
    """Word row ``row`` of the first ``keys`` tokens of a slot, ``u32[keys, Dp]`` (``f32``
    for 4-byte pages): compiled, one strided load per 128 lanes of the slot seen as 32-bit
    words ``[P * S * R, Dp]``; in interpret mode (which does not take reshaped refs) the same
    words from the loaded ``[keys, R, W, Dp]`` slot, element ``j`` of a word in its ``j``-th
    lowest bits (the TPU's packing of ``[W, 128]`` tiles)."""
    _, tokens, stride, pack, dp = kv_buf.shape
    if interpret:
        x = kv_buf[slot, pl.ds(0, keys), row]  # [keys, W, Dp]
        if pack == 1:
            return x[:, 0]
        return lax.bitcast_convert_type(jnp.swapaxes(x, 1, 2), jnp.uint32)
    words = kv_buf if pack == 1 else kv_buf.bitcast(jnp.uint32)
    words = words.at[slot].reshape(tokens * stride, dp)
    return _strided_rows(words, row, keys, stride)


def load_kv_head(
    kv_buf: Any, slot: jax.Array, head: int, keys: int, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Kv head ``head``'s K and V ``[keys, Dp]`` (the pages' dtype) from the first ``keys``
    tokens of slot ``slot`` of ``kv_buf`` ``[2, P * S, R, W, Dp]``.

    Combined head ``2 * head`` (K) and ``2 * head + 1`` (V) sit in word row ``(2 * head) //
    W`` of each token (:func:`kernels_pallas.kv_layout.kv_row`): for ``W = 1`` (4-byte dtypes)
    two rows, each loaded every ``R`` rows; for ``W = 2, 4`` one row, K at bit ``b * ((2 *
    head) % W)`` and V the next ``b`` bits (``b = 32 / W``), moved down and truncated.
    """
    pack = kv_buf.shape[3]
    if pack == 1:
        k = _word_rows(kv_buf, slot, 2 * head, keys, interpret)
        v = _word_rows(kv_buf, slot, 2 * head + 1, keys, interpret)
        return k, v
    row = _word_rows(kv_buf, slot, (2 * head) // pack, keys, interpret)
    bits = 32 // pack
    narrow = jnp.dtype(f"uint{bits}")
    shift = bits * ((2 * head) % pack)
    k = (row >> shift) if shift else row
    v = k >> bits
    k = lax.bitcast_convert_type(k.astype(narrow), kv_buf.dtype)
    v = lax.bitcast_convert_type(v.astype(narrow), kv_buf.dtype)
    return k, v


def attend_step(
    q_ref: Any,
    kv_buf: Any,
    slot: jax.Array,
    state: tuple[Any, Any, Any],
    mask: jax.Array | None,
    key_ok: jax.Array | None,
    *,
    sm_scale: float,
    soft_cap: float | None,
    keys: int | None = None,
    k_scale: jax.Array | None = None,
    interpret: bool = False,
    stagger: bool = False,
) -> None:
    """One flash-attention step of R query rows against ``T`` keys, every kv head.

    Args:
      q_ref: ``[K, R, D]`` queries (VMEM, input dtype: bf16 stays bf16 on the MXU).
      kv_buf: ``[2, P * S, R, W, Dp]`` VMEM (:func:`kv_buffer_shape`); slot ``slot`` holds
        this step's pages, token-major. Keys not in ``mask`` may hold anything (NaN
        included).
      slot: which buffer slot.
      state: ``(m f32[K, R, L], l f32[K, R, L], acc f32[K, R, D])`` VMEM refs, updated; the
        statistics one lane (``L = 1``, the decode kernel) or lane-dense (``L = 128``, each
        row's value in every lane, :func:`state_scratch`).
      mask: ``bool[R, T]``, which (row, key) pairs count; None: every pair (no masking).
      key_ok: ``bool[T, 1]``, keys that count for at least one row: other value rows are
        zeroed so NaN garbage cannot pass through ``p @ v`` (keys need no such care: their
        logits are replaced by ``where``); None with ``mask=None``.
      sm_scale: logit scale (applied to the float32 logits).
      soft_cap: optional logit soft cap.
      keys: attend to the slot's first ``keys`` tokens only (static; default all ``P * S``):
        ``T = keys``, and ``mask`` / ``key_ok`` cover those keys.
      k_scale: 8-bit pages: the layer's K scale (a traced f32 scalar). Pages of another
        dtype than the queries' (8-bit ones) are converted to it after their DMA, and the K
        scale joins ``sm_scale`` (the V scale is applied by :func:`finish`).
      interpret: TPU interpret mode (:func:`load_kv_head` reads the slot without reshaped
        refs).
      stagger: issue each head's P.V after the next head's Q.K^T and softmax (the last
        head's at the end), as RPA v3 orders its heads. The decode kernel's choice: with a
        few query rows per head the step is MXU pushes of K and V, and libtpu packs this
        order into fewer bundles (unstaggered, 32 kv heads stored 3280 vregs per 1024 keys
        where RPA v3's step stores 496, at the same pushes). Static schedule,
        ``scripts/kernel_cycles.py --fused``, 64 sequences at ctx 2048, page 16, v5e cycles
        per KiB: 32 kv heads 0.5089 -> 0.4305, Llama-3-8B 0.5470 -> 0.5049. The ragged
        kernel's query blocks (up to 1024 rows) keep the plain order: staggered, its
        2048-token prefill takes 6% more bundles on v5e.

    Each head's K and V are taken out of the slot by :func:`load_kv_head`. The heads are
    unrolled (a Python loop), so one head's P.V can overlap the next head's Q.K^T in the
    schedule.
    """
    m_ref, l_ref, acc_ref = state
    kh = q_ref.shape[0]
    keys = keys or kv_buf.shape[1]
    pending = None  # staggered: the previous head's (head, p, v, alpha), its P.V not issued yet
    for h in range(kh):
        k, v = load_kv_head(kv_buf, slot, h, keys, interpret)  # [T, Dp] each
        if k.dtype != q_ref.dtype:  # 8-bit pages: to the queries' dtype (scales applied later)
            k, v = k.astype(q_ref.dtype), v.astype(q_ref.dtype)
        if key_ok is not None:
            v = jnp.where(key_ok, v, jnp.zeros_like(v))
        logits = lax.dot_general(
            q_ref[h], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [R, T]
        m_prev = m_ref[h]  # [R, 1] or lane-dense [R, 128], scaled units
        scale = sm_scale if k_scale is None else sm_scale * k_scale
        if soft_cap is None and sm_scale > 0:
            # The scale rides in the exponent: exp(scale * x - m) = 2^(x * scale * log2(e) -
            # m * log2(e)). The max of unscaled logits is scaled on [R, 1], so no [R, T] pass
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
        m_ref[h] = m_new
        if not stagger:
            _accumulate_pv(acc_ref, h, p, v, alpha)
            continue
        if pending is not None:
            _accumulate_pv(acc_ref, *pending)
        pending = (h, p, v, alpha)
    if pending is not None:
        _accumulate_pv(acc_ref, *pending)


def _accumulate_pv(acc_ref: Any, head: int, p: jax.Array, v: jax.Array, alpha: jax.Array) -> None:
    """``acc[head] = alpha * acc[head] + p @ v`` (``p f32[R, T]``, ``v [T, Dp]``, ``alpha
    f32[R, L]``)."""
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, Dp]
    acc_ref[head] = spread_lanes(alpha, acc_ref.shape[-1]) * acc_ref[head] + pv


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

    ``reciprocal``: multiply by ``1 / l`` (``compat.tpu_reciprocal`` without IEEE edge
    cases: ``l`` is 0 or at least 1, the row max's own term) instead of dividing; ``approx``:
    the TPU's reciprocal estimate without its refinement (for bf16 outputs: the exact path
    refines the estimate with one Newton step, which doubles its bits to float32's 24, so it
    holds about 12, bf16 keeps 8; RPA v3 takes it for outputs narrower than float32)."""
    l_i = jnp.where(l_i > 0.0, l_i, 1.0)
    if not (reciprocal or approx):
        out = acc / spread_lanes(l_i, acc.shape[-1])
    else:
        inv = compat.tpu_reciprocal(l_i, approx=approx, full_range=False)
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
    combined_rows: int, packing: int, kv_dtype: Any,
) -> list:  # fmt: skip
    """Every scratch buffer of an attention kernel, in the order its body receives them.

    ``i32[2 * W]`` SMEM table rows (:class:`TableRows`, ``W = table_row_len(M, P)``), the
    ``[2, P * S, R, W, Dp]`` KV VMEM double buffer (:class:`KVStream`), the ``(m, l, acc)``
    softmax state of ``rows`` query rows per kv head (:func:`state_scratch`), then the DMA
    semaphores ``[2]`` of the table rows and of the KV slots.
    """
    shape = kv_buffer_shape(pages, block_size, combined_rows, packing, head_dim)
    return [
        pltpu.SMEM((2 * table_row_len(max_blocks, pages),), jnp.int32),
        pltpu.VMEM(shape, kv_dtype),
        *state_scratch(kv_heads, rows, head_dim),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
    ]


def scratch_bytes(
    *, kv_heads: int, rows: int, pages: int, block_size: int, head_dim: int, combined_rows: int
) -> int:
    """VMEM of :func:`pipeline_scratch`'s buffers (padded to tiles)."""
    kv = kv_buffer_bytes(pages, block_size, combined_rows, head_dim)
    stats = 2 * kv_heads * vmem_tile_bytes(rows, STAT_LANES, 4)
    acc = kv_heads * vmem_tile_bytes(rows, head_dim, 4)
    return kv + stats + acc
