"""Mosaic TPU Pallas kernel: ragged paged attention (decode, prefill, chunked prefill, prefix hits).

Sequence ``s < num_seqs`` owns query rows ``cu_q_lens[s]:cu_q_lens[s + 1]``, the last
``q_len`` of its ``kv_lens[s]`` tokens; row ``i`` sits at ``kv_lens[s] - q_len + i`` and
attends causally (and within ``sliding_window``). Rows past ``cu_q_lens[num_seqs]`` return 0.

Design:

* Grid ``(T / TQ,)``: one program per block of ``TQ`` query tokens, for all kv heads. Queries
  are laid out ``[K, T * G, D]``; the ``G`` query heads of a kv head are processed together
  (``TQ * G`` rows), so every KV page a block needs is read once for the whole group.
  ``TQ * G`` is a multiple of 8 (the TPU sublane tile) for every ``G``: ``TQ`` is about
  ``rows / G`` (:data:`RAGGED_BLOCKS` per chip: 1024 on v5e, v6e and TPU7x, else 128) rounded to a
  multiple of ``8 / gcd(G, 8)`` (e.g. ``G = 4``: 256 tokens; ``G = 6``: 172 tokens, 1032
  rows), or the whole token count when that is smaller. Big blocks amortise each KV step (its
  DMAs, the K/V tiles pushed through the MXU, the softmax bookkeeping) over many query rows,
  and a prefill chunk re-reads its context up to each block's last row, ``T / TQ`` blocks:
  the static schedule (``scripts/kernel_cycles.py``, v5e, Llama-3-8B, a 2048-token chunk)
  went from 2.66e-05 to 1.18e-05 bundles per useful flop from 128 rows x 512 keys to 1024 x
  512, and the context read from 260 MiB to 36 MiB (RPA v3's, with its 256-token blocks).
  A served step's decode rows do not come here (the public op gives a batch's leading
  one-row sequences to the decode kernel), so the block size serves prefill.
* Scalar prefetch (SMEM): ``layer i32[1]``, ``kv_lens i32[B]``, ``cu_q_lens i32[B + 1]``,
  ``num_seqs i32[1]``, ``first_seq i32[1]`` (sequences below it are someone else's: their
  rows return 0 here; the public op gives a mixed batch's leading decode rows to the decode
  kernel this way). Block tables stay in HBM: the row of the sequence being computed and
  of the next one sit in a two-slot SMEM scratch
  (:class:`~kernels_pallas.tpu._attention_common.TableRows`), the next row DMA'd while the
  current sequence is computed, so tables of any size work.
* A program finds the first sequence (at or after ``first_seq``) overlapping its rows by
  binary search on ``cu_q_lens``,
  then walks work items ``(sequence, compute step)`` in one ``while_loop``, all kv heads per
  item. A compute step covers ``P`` pages of the token-major layout ``kv_pages [L, N, S, C,
  W, Dp]`` (:mod:`kernels_pallas.kv_layout`), ONE DMA descriptor per page for K and V of
  every kv head (``kv_pages.at[layer, block]``, contiguous) into a ``[2, P * S, R, W, Dp]``
  VMEM double buffer, each kv head's K and V then taken out of the slot by strided 32-bit
  loads and shifts (:func:`~kernels_pallas.tpu._attention_common.load_kv_head`; static
  schedule, Llama-3-8B, a 2048-token chunk at ctx 2048, bundles per useful flop against the
  K / V layout's two DMAs per page: v5e 1.247e-05 -> 1.206e-05, v6e 9.057e-06 -> 8.99e-06;
  RPA v3 1.356e-05, 9.901e-06); the DMA
  of the next item (possibly the next sequence's first pages) is started before the current
  one is computed (double buffering across sequences), so one copy per program is exposed.
  Only pages the block's rows of that sequence can see are copied: from the first key inside
  the sliding window of its first row to its last row's position.
* A step where every row sees every key runs unmasked; any other (the diagonal, a
  sequence's edges) runs masked at the narrowest of a few compiled widths (a quarter, a half,
  three quarters, the whole step: :func:`masked_step_widths`) that holds the pages its rows
  may see, so a short block's diagonal step does not compute keys past its last row.
* Logits stay unscaled: ``sm_scale`` rides in the exponent
  (:func:`~kernels_pallas.tpu._attention_common.attend_step`).
* The float32 softmax state ``(m, l, acc)`` of every kv head lives in VMEM scratch, the
  statistics lane-dense (``f32[K, R, 128]``, a row's value in every lane: whole-vreg loads
  and stores, and the row max / sum reach ``[R, C]`` and ``[R, D]`` operands by tiling
  vregs instead of lane broadcasts; static schedule, v5e, a 2048-token chunk: 67.6 -> 59.3
  cycles per KiB, v6e 53.7 -> 41.3, from ``[K, R, 1]`` one row per sublane); when a
  sequence's last step is done its rows of the output block are written (the whole block
  when the sequence owns it, else a ``where`` on the row range) and, when another sequence
  follows in the block, the state is reset.
* 8-bit pages (int8, float8_e4m3fn) are copied as stored and converted to the queries' dtype
  in VMEM; the layer's K scale joins ``sm_scale`` and its V scale multiplies the output
  (``kv_scales``, two SMEM scalars).
* Matmuls take the pages' dtype (bf16 operands on the MXU) with float32 accumulation.
* Masks use ``where`` on logits and values; unwritten slots (NaN in tests) never leak;
  negative block ids are clipped to 0 for addressing (the table is clipped to ``[0, N)``
  before the call).

Compiled for v5e and v6e in the tests (``tests/test_tpu_compile.py``): bf16 and f32, ``D`` in
{64, 128, 256}, ``G`` 1..8 (3, 5, 6, 7 included), ``S`` 8..128, window, soft cap, stacked
layers and tables of 256 sequences x 32K tokens, int8 (v5e) and fp8 (v6e) pages at S = 16;
correctness is checked in TPU interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.tpu._attention_common import (
    KV_VMEM_BUDGET,
    VMEM_LIMIT_CAP,
    KVStream,
    TableRows,
    attend_step,
    default_pages_per_compute_block,
    dma_tables,
    finish,
    kernel_refs,
    pipeline_scratch,
    reset_state,
    scratch_bytes,
    token_writes,
    vmem_limit_bytes,
    vmem_tile_bytes,
)
from kernels_pallas.tpu.kv_ops import live_slots

__all__ = ["default_queries_per_block", "ragged_paged_attention_tpu"]

_SUBLANES = 8  # rows of a TPU (8, 128) tile: a query block's TQ * G must be a multiple
_MIB = 1024 * 1024


#: VMEM a query block's rows may take (q and out blocks double-buffered, f32 accumulator,
#: lane-dense softmax statistics, per kv head) on a chip whose :class:`RaggedBlocks` says no
#: other: Llama-3-8B's 1024 rows take 20 MiB. A model with more kv heads or a wider head dim
#: gets fewer rows (:func:`block_rows`: head_dim 256 with 8 kv heads, 640).
ROW_VMEM_BUDGET = 20 * _MIB


@dataclasses.dataclass(frozen=True)
class RaggedBlocks:
    """Block sizes of the ragged kernel on one TPU generation.

    Attributes:
      rows: target query rows (tokens x heads of a group) per program.
      keys: target keys per compute step (capped by ``kv_budget``).
      headroom: scoped VMEM beyond the scratch buffers, for the step's temporaries (logits,
        probabilities of ``rows x keys`` per unrolled head).
      row_budget: VMEM a query block's rows may take (:func:`block_rows`).
      vmem_cap: the most scoped VMEM the kernel asks for.
      kv_budget: VMEM the step's two KV buffers may take
        (:func:`default_pages_per_compute_block`).
      logits_budget: bytes the step's float32 logits of every kv head (``rows x keys x K``)
        may take: fewer keys for a model with many kv heads (:func:`step_keys`); None: no
        cap.
    """

    rows: int
    keys: int
    headroom: int
    row_budget: int = ROW_VMEM_BUDGET
    vmem_cap: int = VMEM_LIMIT_CAP
    kv_budget: int = KV_VMEM_BUDGET
    logits_budget: int | None = None


#: Tuned per ``device_kind`` from the static schedule (``scripts/kernel_cycles.py --fused
#: --ragged-blocks``, a 2048-token chunk at ctx 2048, Llama-3-8B attention; bundles per useful
#: flop and KV bytes read, 2026-12-05): 512 x 1024 gave v5e 1.165e-05 / v6e 8.58e-06 reading
#: the context 68 MiB (128-token query blocks each re-read it up to their last row); 1024 x 512
#: gives 1.178e-05 / 9.135e-06 and 36 MiB, RPA v3's bytes (its 256-token blocks), still under
#: its 1.356e-05 / 9.901e-06. Both targets hold only at 1024 rows. TPU7x (64 MiB of VMEM; RPA
#: v3's default prefill blocks do not fit it): 1.359e-05 at 128 x 512 (the default rule),
#: 9.408e-06 at 1024 x 512. Any other chip (v4, v5p, unknown) gets
#: :data:`DEFAULT_RAGGED_BLOCKS`, the sizes every chip compiles.
#:
#: v5e and v6e (128 MiB of VMEM; RPA v3 asks for all of it) take 1024 rows x 1024 keys: a
#: block's rows get 40 MiB (head_dim 256 with 8 kv heads keeps 1024 rows, 640 in 20 MiB), the
#: KV double buffer 16 MiB (1024 keys of head_dim 256 with 8 kv heads, RPA v3's 1024-key KV
#: blocks; 8 MiB held 512) and the kernel up to 120 MiB. Head_dim 256 with 8 kv heads, a
#: 2048-token chunk at ctx 2048 (2026-12-05): v5e 1.073e-05 -> 1.056e-05, v6e 5.506e-06 ->
#: 5.226e-06 (RPA v3 1.063e-05 / 5.358e-06; the same 40 MiB read), in ~107 MiB of scoped VMEM
#: (60 MiB of headroom: with 64 libtpu's v5e schedule came out at 1.067e-05); Llama-3-8B
#: 1.178e-05 -> 1.142e-05 / 9.135e-06 -> 8.559e-06; its mixed batch (64 decodes at ctx 4096 +
#: a 512-token chunk) 2.220e-05 -> 2.183e-05 / 1.925e-05 -> 1.850e-05. A 1024-key step
#: computed in two 512-key halves (RPA v3's compute chunks) took as much scoped VMEM (106
#: MiB) and 11% more bundles (v6e Llama 9.523e-06): not kept. 16 kv heads of head_dim 128 at
#: 1024 x 1024 need 106 MiB (scratch 41 + temporaries): a step's f32 logits of every kv head
#: are held to 32 MiB (:func:`step_keys`; 8 kv heads x 1024 rows x 1024 keys), so 16 or 32 kv
#: heads take 512 keys.
#:
#: TPU7x takes 2048 rows (within its 20 MiB row budget: Qwen2-7B's G = 7 gets 256-token
#: blocks, Llama-3-8B stays at 1024 rows), the blocks RPA v3's TPU7x rule takes: Qwen2-7B
#: (2026-12-06, with power-of-two blocks) reads what RPA v3 does (a 2048-token chunk at ctx
#: 2048: 34 -> 18 MiB; the mixed batch 542.5 -> 527.5 MiB) for 1-6% more bundles per useful
#: flop (8.992e-06 -> 9.542e-06, 1.621e-05 -> 1.637e-05; RPA v3 1.019e-05, 1.889e-05); at
#: ctx 8192 226 -> 114 MiB, 7.066e-06 -> 7.155e-06 (RPA v3 7.956e-06). One kv head with
#: G = 8 (a 70B model at tensor parallel 8): 8.5 -> 4.5 MiB, 1.066e-05 -> 1.068e-05.
_V5E_V6E_BLOCKS = RaggedBlocks(
    rows=1024, keys=1024, headroom=60 * _MIB, row_budget=40 * _MIB, vmem_cap=120 * _MIB,
    kv_budget=16 * _MIB, logits_budget=32 * _MIB,
)  # fmt: skip
RAGGED_BLOCKS = {
    "TPU v5 lite": _V5E_V6E_BLOCKS,
    "TPU v6 lite": _V5E_V6E_BLOCKS,
    "TPU7x": RaggedBlocks(rows=2048, keys=512, headroom=40 * _MIB),
}
DEFAULT_RAGGED_BLOCKS = RaggedBlocks(rows=128, keys=512, headroom=16 * _MIB)


def ragged_blocks(device_kind: str | None) -> RaggedBlocks:
    """The block sizes for a chip's ``device_kind`` (the table, else the default rule)."""
    return RAGGED_BLOCKS.get(device_kind or "", DEFAULT_RAGGED_BLOCKS)


def block_rows(blocks: RaggedBlocks, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Query rows per block: ``blocks.rows``, fewer when their VMEM would pass
    ``blocks.row_budget`` (``itemsize``: the queries' bytes per element)."""
    per_row = kv_heads * (4 * head_dim * itemsize + 4 * head_dim + 2 * 4 * 128)
    return max(_SUBLANES, min(blocks.rows, blocks.row_budget // per_row // _SUBLANES * _SUBLANES))


def step_keys(blocks: RaggedBlocks, kv_heads: int, rows: int) -> int:
    """Target keys per compute step: ``blocks.keys``, fewer (a multiple of 128, at least 128)
    when the step's float32 logits of ``kv_heads`` heads over ``rows`` query rows would pass
    ``blocks.logits_budget`` (the kernel's temporaries grow with them: 16 kv heads of
    head_dim 128 at 1024 rows x 1024 keys need 106 MiB of scoped VMEM on v5e, 8 kv heads of
    head_dim 256 ~107 MiB)."""
    if blocks.logits_budget is None:
        return blocks.keys
    fit = blocks.logits_budget // (4 * rows * kv_heads) // 128 * 128  # whole lane tiles
    return max(128, min(blocks.keys, fit))


def step_pages(
    blocks: RaggedBlocks, block_size: int, max_blocks: int, *, kv_heads: int, head_dim: int,
    q_itemsize: int, kv_itemsize: int,
) -> int:  # fmt: skip
    """``P``: pages per compute step of the ragged kernel, the op's rule in one place: the
    block's query rows (:func:`block_rows`) cap the step's keys (:func:`step_keys`), which
    give pages within ``blocks.kv_budget`` (``head_dim`` the stored ``Dp``; itemsizes of the
    queries and of the pages)."""
    rows = block_rows(blocks, kv_heads, head_dim, q_itemsize)
    return default_pages_per_compute_block(
        block_size, max_blocks, step_keys(blocks, kv_heads, rows), kv_heads=kv_heads,
        head_dim=head_dim, itemsize=kv_itemsize, kv_budget=blocks.kv_budget,
    )  # fmt: skip


def masked_step_widths(pages: int, block_size: int, lane_aligned: bool = True) -> list[int]:
    """The widths (in pages) a masked compute step of ``pages`` pages is compiled at: a
    quarter, a half, three quarters (compiled: when a multiple of 128 keys, the lane tile)
    and the whole step; it runs the narrowest that holds its visible pages
    (:func:`_ragged_kernel`).

    A diagonal step of a prefill block needs keys only up to the block's last row: with 128
    query tokens and 1024-key steps, 128 to 1024 of them. Static schedule, v5e, a 2048-token
    chunk (``scripts/kernel_cycles.py``): 79.3 -> 69.0 cycles per KiB with quarter and half
    widths; eighths gained 0.8% more, for a fourth copy of the masked code. Three quarters
    (2026-12-05, a fourth copy too): v5e bundles per useful flop, that chunk at ctx 2048
    1.299e-05 -> 1.247e-05, the mixed batch (64 decodes + a 512-token chunk, ctx 4096)
    2.413e-05 -> 2.389e-05."""
    widths = {pages}
    for num, den in ((1, 4), (1, 2), (3, 4)):
        w = pages * num // den
        if w and pages % den == 0 and (not lane_aligned or (w * block_size) % 128 == 0):
            widths.add(w)
    return sorted(widths)


def default_queries_per_block(num_tokens: int, g: int, rows: int | None = None) -> int:
    """``TQ``: the largest power of two of at most ``rows / G`` tokens (default: the default
    rule's rows; at least enough for ``TQ * G`` to be a multiple of 8), or all ``T`` tokens.

    Chunks are mostly powers of two long (512, 2048 tokens): a block of a power of two of
    tokens divides them, where a block of, say, 144 tokens leaves a last block of padding rows
    that still walks the whole context. It is also RPA v3's rule (1024 rows, 2048 on TPU7x,
    over G rounded up to a power of two), so a chunk reads the KV bytes RPA v3 does. Qwen2-7B
    (G = 7) took 144-token blocks before (the nearest multiple of 8): static schedule, v5e, a
    64-decode + 512-token mixed batch 2.036e-05 -> 1.903e-05 bundles per useful flop and
    542.7 -> 542.5 MiB of KV read (RPA v3: 542.5), a 2048-token chunk at ctx 2048 1.413e-05
    -> 1.225e-05 (``scripts/kernel_cycles.py --fused``, 2026-12-06).
    """
    rows = rows or DEFAULT_RAGGED_BLOCKS.rows
    align = _SUBLANES // math.gcd(g, _SUBLANES)  # a power of two: so is every TQ below
    tq = max(align, 1 << (max(1, rows // g).bit_length() - 1))
    return num_tokens if num_tokens <= tq else tq


def _ragged_kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1]
    kv_lens_ref,  # i32[B]
    cu_ref,  # i32[B + 1]
    num_seqs_ref,  # i32[1]
    first_seq_ref,  # i32[1]: sequences below it are skipped (their rows return 0)
    *refs,  # fused: the scalar slots_ref i32[T_pad] (token t's slot, -1: not written); then
    #         the inputs q_ref [K, TQ * G, D] (block of q [K, T_pad * G, D], row = token * G
    #         + head in group), tables_hbm i32[B, M_pad] (HBM, clipped to [0, N), padded to
    #         TABLE_ROW_ALIGN), kv_hbm [L, N, S, C, W, Dp] (HBM); fused: kv_new_hbm [T_pad,
    #         C, W, Dp] (HBM); with has_sinks, sinks_ref: VMEM f32[K, TQ * G, 1] (row r's
    #         query head k * G + r % G's sink logit); with has_scales, scales_ref: SMEM
    #         f32[2] (the layer's K and V scales of 8-bit pages); then the outputs and the
    #         scratch, as unpacked below
    fused: bool,
    has_sinks: bool,
    has_scales: bool,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    g: int,
    num_blocks: int,
    interpret: bool,
):
    (slots_ref, q_ref, tables_hbm, kv_hbm, kv_new_hbm, sinks_ref, k_scale, v_scale, o_ref,
     kv_out, write_sem, refs) = kernel_refs(refs, fused, has_sinks, has_scales)  # fmt: skip
    (
        table,  # SMEM i32[2 * W]: table rows of the current and the next sequence (flat,
        #        W = table_row_len(M_pad, P) entries each: TableRows)
        kv_buf,  # VMEM [2, P * S, R, W, Dp]: two slots of P pages, token-major
        m_ref,  # VMEM f32[K, TQ * G, 128]: lane-dense (a row's value in every lane)
        l_ref,  # VMEM f32[K, TQ * G, 128]
        acc_ref,  # VMEM f32[K, TQ * G, D]
        table_sem,  # DMA[2]
        kv_sem,  # DMA[2]: one per KV slot
    ) = refs
    qb = pl.program_id(0)
    _, rows, _ = q_ref.shape
    tq = rows // g
    s = kv_hbm.shape[2]
    keys = kv_buf.shape[1]  # P * S
    n_pages = keys // s
    max_blocks = num_blocks  # M, the table's width before padding
    r0 = qb * tq
    r1 = r0 + tq
    nseq = num_seqs_ref[0]
    last_seq = cu_ref.shape[0] - 2

    # First sequence whose rows end after r0: smallest s in [first, nseq) with cu[s + 1] > r0.
    def search_cond(c):
        return c[0] < c[1]

    def search_step(c):
        lo, hi = c
        mid = (lo + hi) // 2
        right = cu_ref[mid + 1] > r0
        return jnp.where(right, lo, mid + 1), jnp.where(right, mid, hi)

    lo0 = jnp.minimum(first_seq_ref[0], nseq)
    start_seq, _ = lax.while_loop(search_cond, search_step, (lo0, nseq))

    def seq_info(sq):
        """Rows of sequence ``sq`` inside this block and the pages they need."""
        sq = jnp.minimum(sq, last_seq)
        qs = cu_ref[sq]
        qe = cu_ref[sq + 1]
        kv = kv_lens_ref[sq]
        row_lo = jnp.maximum(qs, r0)
        row_hi = jnp.minimum(qe, r1)
        off = kv - (qe - qs) - qs  # position of row t is t + off
        pos_lo = row_lo + off
        pos_hi = row_hi - 1 + off
        end_page = jnp.minimum((pos_hi + s) // s, max_blocks)  # pages [first, end)
        if sliding_window is not None:
            key_lo = jnp.maximum(pos_lo - sliding_window + 1, 0)
        else:
            key_lo = jnp.int32(0)
        first_page = key_lo // s
        n = jnp.maximum(end_page - first_page, 0)
        n_steps = jnp.where((row_hi > row_lo) & (pos_hi >= 0), (n + n_pages - 1) // n_pages, 0)
        return row_lo, row_hi, off, key_lo, pos_hi, first_page, end_page, n_steps

    def active(sq):
        return (sq < nseq) & (cu_ref[jnp.minimum(sq, cu_ref.shape[0] - 1)] < r1)

    def skip_empty(sq):
        def empty(x):
            return active(x) & (seq_info(x)[-1] == 0)

        def next_seq(x):
            return x + 1

        return lax.while_loop(empty, next_seq, sq)

    rows_dma = TableRows(tables_hbm, table, table_sem)
    stream = KVStream(kv_hbm, kv_buf, kv_sem, rows_dma, layer_ref[0], kv_new_hbm)
    state = (m_ref, l_ref, acc_ref)

    def fused_of(sq):
        """Fused write: ``(cache_end, last_pos, offset)`` of sequence ``sq`` in this block
        (its new tokens, positions ``kv - q_len ..``, come from ``kv_new`` row ``position -
        offset``; :class:`~kernels_pallas.tpu._attention_common.FusedRows`)."""
        if not fused:
            return None
        _, _, off, _, pos_hi, *_ = seq_info(sq)
        return off + cu_ref[jnp.minimum(sq, last_seq)], pos_hi, off

    def start_pages(sq, i, tslot, slot):
        *_, first_page, end_page, _ = seq_info(sq)
        stream.start(tslot, first_page + i * n_pages, end_page, slot, fused_of(sq))

    if fused:
        # The block's tokens go to HBM while it attends (no step reads them from the pages:
        # they come from kv_new); the wrapper set -1 for rows that are not this kernel's.
        token_writes(kv_new_hbm, kv_out, layer_ref[0], slots_ref, r0, tq, write_sem,
                     lambda c: c.start())  # fmt: skip

    # Row r of the block is token r0 + r // G. Masks compare r with multiples of G instead of
    # dividing a vector (floor(r / G) >= a  <=>  r >= a * G for integers a).
    masked_widths = masked_step_widths(n_pages, s, lane_aligned=not interpret)
    out_row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)

    s0 = skip_empty(start_seq)
    s1 = skip_empty(s0 + 1)
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)  # rows no sequence covers stay zero
    reset_state(state, None if sinks_ref is None else sinks_ref[...])

    @pl.when(active(s0))
    def _first_sequence():
        rows_dma.start(s0, 0)
        rows_dma.wait(s0, 0)
        start_pages(s0, 0, 0, 0)

    @pl.when(active(s0) & active(s1))
    def _second_row():
        rows_dma.start(s1, 1)

    def cond(carry):
        return active(carry[0])

    def body(carry):
        sq, i, slot, tslot = carry
        row_lo, row_hi, off, key_lo, pos_hi, first_page, end_page, n_steps = seq_info(sq)
        last = i + 1 >= n_steps
        nsq = skip_empty(sq + 1)
        next_seq = last & active(nsq)

        @pl.when(next_seq)
        def _next_sequence_pages():
            rows_dma.wait(nsq, 1 - tslot)  # its row was prefetched when sq started
            start_pages(nsq, 0, 1 - tslot, 1 - slot)

        @pl.when(~last)
        def _next_step_pages():
            start_pages(sq, i + 1, tslot, 1 - slot)

        step_page = first_page + i * n_pages
        stream.wait(tslot, step_page, end_page, slot, fused_of(sq))
        base = step_page * s
        attend = functools.partial(
            attend_step, q_ref, kv_buf, slot, state, sm_scale=sm_scale, soft_cap=soft_cap,
            k_scale=k_scale, interpret=interpret,
        )  # fmt: skip
        # Every row of the block is this sequence's and sees every key of the step (below the
        # causal diagonal, inside the window): the steady state of a prefill, no masks.
        whole = (row_lo == r0) & (row_hi == r1) & (base + keys - 1 <= row_lo + off)
        if sliding_window is not None:
            whole &= base > pos_hi - sliding_window

        @pl.when(whole)
        def _every_pair_visible():
            attend(None, None)

        @pl.when(~whole)
        def _masked_step():  # the diagonal, the sequence's edges, shared (decode) blocks
            # Computed over the narrowest of `masked_widths` that holds every page of the step
            # a row may see (a diagonal step of a short block needs a fraction of its keys).
            need = end_page - step_page
            narrower = 0
            for width in masked_widths:
                fits = need > narrower
                if width < n_pages:
                    fits &= need <= width

                @pl.when(fits)
                def _masked(width=width):
                    cols = width * s
                    row = lax.broadcasted_iota(jnp.int32, (rows, cols), 0)  # row r of the block
                    key_col = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
                    # key position relative to the position of the block's token 0 here
                    rel = base - r0 - off + key_col
                    kpos = base + lax.broadcasted_iota(jnp.int32, (cols, 1), 0)
                    in_seq = (row >= (row_lo - r0) * g) & (row < (row_hi - r0) * g)
                    mask = in_seq & (rel * g <= row)  # causal: kpos <= pos
                    key_ok = (kpos <= pos_hi) & (kpos >= key_lo)
                    if sliding_window is not None:
                        mask &= row < (rel + sliding_window) * g  # window: kpos > pos - window
                    attend(mask, key_ok, keys=cols)

                narrower = width

        @pl.when(last)
        def _finish_sequence():
            block_is_mine = (row_lo == r0) & (row_hi == r1)

            def out(h: int) -> jax.Array:
                """Head ``h``'s rows ``[R, D]`` (bf16 ones take the approximate reciprocal)."""
                o = finish(
                    l_ref[h], acc_ref[h], v_scale, reciprocal=True,
                    approx=o_ref.dtype == jnp.bfloat16,
                )  # fmt: skip
                return o.astype(o_ref.dtype)

            # Computed where stored, head by head: a [K, R, D] result computed before the
            # branches would be spilled and reloaded.
            @pl.when(block_is_mine)  # a prefill block: no other sequence's rows to keep
            def _store_block():
                for h in range(o_ref.shape[0]):
                    o_ref[h] = out(h)

            @pl.when(~block_is_mine)
            def _store_rows():
                mine = (out_row >= (row_lo - r0) * g) & (out_row < (row_hi - r0) * g)  # [R, 1]
                for h in range(o_ref.shape[0]):
                    o_ref[h] = jnp.where(mine, out(h), o_ref[h])

            @pl.when(next_seq)  # the state is read again only by a next sequence here
            def _reset_for_next_sequence():
                reset_state(state, None if sinks_ref is None else sinks_ref[...])

        nnsq = skip_empty(nsq + 1)

        @pl.when(next_seq & active(nnsq))
        def _prefetch_row_after_next():
            rows_dma.start(nnsq, tslot)  # the current row's slot: no longer read

        nxt = jnp.where(last, nsq, sq)
        ni = jnp.where(last, 0, i + 1)
        ntslot = jnp.where(last, 1 - tslot, tslot)
        return nxt, ni, 1 - slot, ntslot

    lax.while_loop(cond, body, (s0, jnp.int32(0), jnp.int32(0), jnp.int32(0)))
    if fused:
        token_writes(kv_new_hbm, kv_out, layer_ref[0], slots_ref, r0, tq, write_sem,
                     lambda c: c.wait())  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "pages_per_compute_block",
        "queries_per_block",
        "device_kind",
        "num_kv_heads",
        "unique_slots",
    ),
)
def ragged_paged_attention_tpu(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    first_seq: jax.Array | int = 0,
    *,
    num_kv_heads: int,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: int | jax.Array | None = None,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
    queries_per_block: int | None = None,
    device_kind: str | None = None,
    sinks: jax.Array | None = None,
    kv_scales: jax.Array | None = None,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    unique_slots: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Ragged paged attention on TPU (arguments already validated by the public wrapper).

    Args:
      q: ``[T, H, Dp]`` token-packed queries (head dim padded as the pages store it).
      kv_pages: ``[L, N, S, C, W, Dp]`` (:mod:`kernels_pallas.kv_layout`).
      kv_lens: ``i32[B]``.
      block_tables: ``i32[B, M]``; negative = no block.
      cu_q_lens: ``i32[B + 1]``.
      num_seqs: scalar or ``i32[1]``.
      first_seq: scalar or ``i32[1]``: sequences ``s < first_seq`` are skipped (their rows
        return 0, as padding does), for a batch whose leading rows another kernel computes.
      num_kv_heads: ``K`` (the pages hold ``C * W / 2`` heads, a dummy one included for an
        odd ``K`` in an 8-bit cache).
      sm_scale: logit scale (a float).
      soft_cap: optional logit soft cap.
      sliding_window: optional window (a query at ``p`` sees keys in ``(p - window, p]``).
      layer: the layer of ``kv_pages`` (int or traced i32 scalar; None: 0).
      interpret: run in TPU interpret mode (``pltpu.InterpretParams()``).
      pages_per_compute_block: pages per DMA/compute step ``P`` (default: the chip's
        :class:`RaggedBlocks` ``keys``, capped so the KV buffers fit its ``kv_budget``).
      queries_per_block: query tokens per program ``TQ`` (default
        :func:`default_queries_per_block`). Compiled, ``TQ * G`` must be a multiple of 8
        unless ``TQ`` covers all tokens (interpret mode takes any ``TQ``).
      device_kind: the target chip's ``device_kind``: picks the default block sizes and the
        VMEM headroom (:func:`ragged_blocks`).
      sinks: optional ``f32[H]`` attention sinks: one logit per query head in the softmax's
        denominator, with no value (gpt-oss).
      kv_scales: 8-bit (int8 / float8_e4m3fn) pages: ``f32[2]``, the layer's K and V scales
        (a page holds ``x / scale``); pages are converted to ``q.dtype`` in VMEM.
      new_kv: the fused KV write, ``(kv_new [T, C, W, Dp], slots i32[T])``: token ``t``'s
        K/V (the pages' dtype, merged: :func:`kernels_pallas.kv_layout.merge_kv`) goes to
        ``slots[t]`` of ``layer`` (``< 0`` or out of range: not written; duplicates: the
        last token wins; the skipped sequences' rows are not written here). A sequence's
        rows attend to its new tokens (positions ``kv_lens[s] - q_len`` on) straight from
        ``kv_new``, never through the pages, while each block's tokens are DMA'd to HBM; so
        ``slots[t]`` must be the slot of row ``t``'s position for a row that counts.
        ``kv_pages`` is aliased to the returned pages (donate it under jit).
      unique_slots: a promise that no two live ``new_kv`` slots are equal (a served step's
        are not): skips the sort that makes the last duplicate win.

    Returns:
      ``[T, H, Dp]`` in ``q.dtype``; with ``new_kv``, ``(out, kv_pages)``.

    Raises:
      ValueError: ``queries_per_block`` whose rows are not a multiple of 8; a ``q`` head dim
        other than the pages'.
    """
    layer = 0 if layer is None else layer
    t, h, d = q.shape
    _, n_blocks, s, c, w, dp = kv_pages.shape
    if dp != d:
        raise ValueError(f"q's head dim {d} is not the pages' stored head dim {dp}")
    kh = num_kv_heads
    g = h // kh
    m = block_tables.shape[1]
    blocks = ragged_blocks(device_kind)
    rows = block_rows(blocks, kh, d, q.dtype.itemsize)
    p = pages_per_compute_block or step_pages(
        blocks, s, m, kv_heads=kh, head_dim=d, q_itemsize=q.dtype.itemsize,
        kv_itemsize=kv_pages.dtype.itemsize,
    )  # fmt: skip
    tq = queries_per_block or default_queries_per_block(t, g, rows)
    if tq < t and (tq * g) % _SUBLANES and not interpret:
        raise ValueError(
            f"queries_per_block={tq} gives {tq * g} query rows per block (G={g}); it must be "
            f"a multiple of {_SUBLANES} or cover all {t} tokens"
        )
    t_pad = -(-t // tq) * tq
    # Rows of the skipped sequences (s < first_seq: a mixed batch's leading decodes) are
    # dropped and the rest moved up to row 0 (folded into the layout copy below), so the
    # query blocks start where this kernel's first sequence does: a 512-token chunk behind
    # 64 decode rows takes 4 blocks of 128 tokens, not 5 (two of them half empty, each
    # walking the whole context). The output is moved back after the call.
    shifted = not (isinstance(first_seq, int) and first_seq == 0)
    if shifted:
        first = jnp.minimum(jnp.asarray(first_seq, jnp.int32).reshape(()), cu_q_lens.shape[0] - 1)
        first = jnp.minimum(first, jnp.asarray(num_seqs, jnp.int32).reshape(()))
        shift = cu_q_lens.astype(jnp.int32)[first]
        q = jnp.roll(q, -shift, axis=0)  # rows past T - shift: no sequence's (zeros out)
        cu_q_lens = cu_q_lens.astype(jnp.int32) - shift
    fused = new_kv is not None
    if fused:
        kv_new, slots = new_kv
        slots = live_slots(slots.astype(jnp.int32), n_blocks * s, not unique_slots)
        if shifted:  # moved with q; the skipped sequences' rows (now the tail): not written
            kv_new = jnp.roll(kv_new, -shift, axis=0)
            slots = jnp.where(jnp.arange(t) < t - shift, jnp.roll(slots, -shift), -1)
        slots = jnp.pad(slots, (0, t_pad - t), constant_values=-1)
        kv_new = jnp.pad(kv_new, ((0, t_pad - t), (0, 0), (0, 0), (0, 0)))
    # [T, H, D] -> [K, T_pad * G, D]: each kv head's query rows are one 2-D slab, so a block
    # is a plain [TQ * G, D] tile (no in-kernel reshape of the G axis).
    qg = q.reshape(t, kh, g, d)
    if t_pad != t:
        qg = jnp.pad(qg, ((0, t_pad - t), (0, 0), (0, 0), (0, 0)))
    qg = jnp.transpose(qg, (1, 0, 2, 3)).reshape(kh, t_pad * g, d)
    q_spec = pl.BlockSpec((kh, tq * g, d), lambda qi, *_: (0, qi, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    tables = dma_tables(block_tables, n_blocks)  # a page's DMA takes its id as read
    inputs = [qg, tables, kv_pages]
    in_specs = [q_spec, any_spec, any_spec]
    if sinks is not None:  # [K, TQ * G, 1], row r: head k * G + r % G; the same every block
        rows_sinks = jnp.tile(sinks.astype(jnp.float32).reshape(kh, 1, g), (1, tq, 1))
        inputs.append(rows_sinks.reshape(kh, tq * g, 1))
        in_specs.append(pl.BlockSpec((kh, tq * g, 1), lambda qi, *_: (0, 0, 0)))
    if kv_scales is not None:  # f32[2] in SMEM: two scalars every program reads
        inputs.append(kv_scales.astype(jnp.float32).reshape(2))
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    kernel = functools.partial(
        _ragged_kernel,
        fused=fused,
        has_sinks=sinks is not None,
        has_scales=kv_scales is not None,
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        g=g,
        num_blocks=m,
        interpret=interpret,
    )
    scalars = (
        jnp.asarray(layer, jnp.int32).reshape(1),
        kv_lens.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(1),
        jnp.asarray(first_seq, jnp.int32).reshape(1),
        *((slots,) if fused else ()),
    )
    out_shape = [jax.ShapeDtypeStruct(qg.shape, q.dtype)]
    out_specs = [q_spec]
    if fused:
        inputs.insert(3, kv_new)
        in_specs.insert(3, any_spec)
        out_shape.append(jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype))
        out_specs.append(any_spec)
    results = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(t_pad // tq,),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=pipeline_scratch(
                kv_heads=kh,
                rows=tq * g,
                pages=p,
                block_size=s,
                head_dim=d,
                max_blocks=tables.shape[1],
                combined_rows=c,
                packing=w,
                kv_dtype=kv_pages.dtype,
            )
            + ([pltpu.SemaphoreType.DMA(())] if fused else []),
        ),
        out_shape=out_shape,
        # fused: kv_pages (after the scalars and q, tables) is the second output
        input_output_aliases={len(scalars) + 2: 1} if fused else {},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=vmem_limit_bytes(
                blocks.headroom,
                scratch_bytes(
                    kv_heads=kh,
                    rows=tq * g,
                    pages=p,
                    block_size=s,
                    head_dim=d,
                    combined_rows=c,
                )
                + (0 if sinks is None else 2 * kh * vmem_tile_bytes(tq * g, 1, 4)),
                blocks.vmem_cap,
            ),
            disable_bounds_checks=not interpret,  # every DMA address is in range (clipped)
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paxcache_ragged_paged_attention",
    )(*scalars, *inputs)
    out = jnp.transpose(results[0].reshape(kh, t_pad, g, d), (1, 0, 2, 3))
    out = out[:t].reshape(t, h, d)
    if shifted:  # back in place; the skipped sequences' rows get the zero rows of the tail
        out = jnp.roll(out, shift, axis=0)
    return (out, results[1]) if fused else out
