"""Mosaic TPU Pallas kernel: paged decode attention (one query token per sequence).

Decode reads every KV byte once and does little math per byte, so the kernel is built to keep
the bundles per KiB of KV below the HBM time (the static schedule of libtpu's final bundles):

* Grid ``(C, B / C)`` with ``C = 2`` (``"parallel"``: the two TensorCores of a megacore chip
  each take half the sequences; one-core chips run the halves in turn), the sequences of a
  half in order (``"arbitrary"``). Program ``(c, i)`` handles sequence ``b = c * B / C + i``
  and walks its kv range in steps of ``P`` pages (:func:`decode_pages_per_step`: ~2048 keys
  within the chip's VMEM budget, sizes padded to the VMEM tiles), all ``K`` kv heads at
  once; the ``G = H // K`` query heads of a kv head are processed together (GQA/MQA).
* Scalar prefetch (SMEM): ``layer i32[1]``, ``lengths i32[B]``. Block tables stay in HBM;
  each program DMAs the *next* sequence's table row into SMEM while it computes
  (:class:`~kernels_pallas.tpu._attention_common.TableRows`), so tables of any size work.
* KV pages stay in HBM (``memory_space=ANY``) in the token-major layout ``kv_pages [L, N, S,
  C, W, Dp]`` (:mod:`kernels_pallas.kv_layout`: K and V of every kv head of a token side by
  side, packed ``W`` to a 32-bit word). A step issues ONE DMA per page
  (``kv_pages.at[layer, block]``, ``[S, C, W, Dp]``, contiguous: K and V of every kv head)
  into a two-slot VMEM scratch ``[2, P * S, R, W, Dp]``
  (:func:`~kernels_pallas.tpu._attention_common.kv_buffer_shape`); step ``j + 1`` is started
  before step ``j`` is computed, and a step waits ONCE (a descriptor as large as all of its
  copies: DMA semaphores count bytes). In VMEM each kv head's K and V ``[P * S, Dp]`` are
  taken out of the slot seen as 32-bit words: a strided sublane load of the head's word row
  of every token, then (bf16, 8-bit) shifts and a truncation
  (:func:`~kernels_pallas.tpu._attention_common.load_kv_head`). Static schedule
  (``scripts/kernel_cycles.py``, Llama-3-8B, 64 sequences at ctx 4096): cycles per KiB of KV
  v5e 0.5297 -> 0.5032, v6e 0.4722 -> 0.4523 against the K / V layout's two DMAs per page
  (RPA v3: 0.6133, 0.5694); the step loop 8342 -> 7926 bundles on v5e. Bounds checks are off
  when compiled (every address is in range: the wrapper clips the table to ``[0, N)``, one
  elementwise op per call, so a page's DMA takes its block id as read, no clamp per page).
* The heads are unrolled, each head's P.V issued after the next head's Q.K^T and softmax
  (``attend_step(stagger=True)``; v5e cycles per KiB, 32 kv heads 0.5089 -> 0.4305,
  Llama-3-8B 0.5470 -> 0.5049). A step whose keys are all visible (the steady state) runs
  with no mask at all; only the step holding the length (or the window's first key) masks
  logits and zeroes the value rows no query may see, so NaN garbage in unwritten slots cannot
  leak (keys need no such care: their logits are replaced by ``where``). A length-0 row copies
  nothing and returns zeros; negative block ids are clipped to 0 for addressing, and table
  entries past a length are never read.
* Matmuls take the pages' dtype (bf16 on the MXU) with float32 accumulation and a float32
  online softmax.

Trip counts (for the static schedule, ``scripts/kernel_cycles.py``): per sequence, the grid
body once, ``ceil(length / (P * S))`` steps (each: the loop head and the unmasked body, or
the masked body for the edge step) and one next-step DMA issue per step but the last.

Also the TPU path of ``ragged_paged_attention(..., max_q_len=1)`` (a decode-only batch).
Compiled for v5e, v6e and TPU7x in the tests (``tests/test_tpu_compile.py``) for bf16 and
f32, ``D`` in {64, 128, 256}, ``G`` 1..8, ``S`` 8..128, sliding window, soft cap and tables of
256 sequences x 32K tokens, int8 (v5e) and fp8 (v6e) pages at S = 16 (converted in VMEM,
``kv_scales``); correctness is checked in TPU interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.tpu._attention_common import (
    TABLE_ROW_ALIGN,
    FusedRows,
    attend_step,
    combined_rows_of,
    dma_tables,
    finish,
    kernel_refs,
    kv_buffer_bytes,
    kv_buffer_shape,
    kv_page_bytes,
    page_copy,
    reset_state,
    table_row_len,
    token_writes,
    wait_pages,
)
from kernels_pallas.tpu.kv_ops import live_slots

__all__ = [
    "DECODE_KV_VMEM_BUDGET",
    "DECODE_KV_VMEM_BUDGETS",
    "decode_kv_vmem_budget",
    "decode_pages_per_step",
    "paged_attention_tpu",
]

_CORES = 2  # TensorCores of a megacore chip (v4, v5p)

#: VMEM for the decode kernel's KV double buffer (two slots of pages) on a chip not in
#: :data:`DECODE_KV_VMEM_BUDGETS`. Decode reads each KV byte once and does little math per
#: byte, so it wants big steps: fixed per-step costs (the wait, the state update, the loop)
#: are paid once per ``P * S`` keys.
DECODE_KV_VMEM_BUDGET = 16 * 1024 * 1024
#: The budget by ``device_kind``, for the chips with 64 MiB of VMEM or more (the scoped limit
#: is the buffer plus 8 MiB): pages of many or wide heads get twice the keys per step. Static
#: schedule (``scripts/kernel_cycles.py --fused``, 64 sequences at ctx 2048, page 16, v5e
#: cycles per KiB, 32 kv heads: 16 KiB per token): 0.5461 at 512 keys, 0.5089 at 1024 (0.4305
#: with :func:`~kernels_pallas.tpu._attention_common.attend_step`'s staggered P.V; RPA v3,
#: its 1024-key blocks: 0.4563). Llama-3-8B's and Qwen2-7B's 2048 keys fit 16 MiB: unchanged.
DECODE_KV_VMEM_BUDGETS = {
    "TPU v5 lite": 32 * 1024 * 1024,
    "TPU v6 lite": 32 * 1024 * 1024,
    "TPU7x": 32 * 1024 * 1024,
}
#: Keys per step the decode kernel aims for (capped by the budget and the table width).
_DECODE_TARGET_KEYS = 2048


def decode_kv_vmem_budget(device_kind: str | None) -> int:
    """The decode kernel's KV buffer budget on a chip (:data:`DECODE_KV_VMEM_BUDGETS`, else
    :data:`DECODE_KV_VMEM_BUDGET`)."""
    return DECODE_KV_VMEM_BUDGETS.get(device_kind or "", DECODE_KV_VMEM_BUDGET)


def decode_pages_per_step(
    block_size: int,
    max_blocks: int,
    *,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    device_kind: str | None = None,
) -> int:
    """``P``: pages per decode step, ~``_DECODE_TARGET_KEYS`` keys within the chip's VMEM
    budget (:func:`decode_kv_vmem_budget`; ``head_dim`` the stored ``Dp``)."""
    c = combined_rows_of(kv_heads, itemsize)
    per_page = 2 * kv_page_bytes(block_size, c, head_dim)  # two slots
    p = min(max_blocks, max(1, _DECODE_TARGET_KEYS // block_size))
    return int(max(1, min(p, decode_kv_vmem_budget(device_kind) // per_page)))


def _decode_kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1]
    lengths_ref,  # i32[B_pad]
    *refs,  # fused: the scalar slots_ref i32[B_pad] (row b's slot, -1: not written); then the
    #         inputs q_ref [K, G, D] (block of q [B_pad, K, G, D]), tables_hbm i32[B, M] and
    #         kv_hbm [L, N, S, C, W, Dp] (HBM); fused: kv_new_hbm [B_pad, C, W, Dp] (HBM);
    #         with has_sinks, sinks_ref: VMEM f32[K, G, 1] (head k * G + g's sink logit);
    #         with has_scales, scales_ref: SMEM f32[2] (the layer's K and V scales of 8-bit
    #         pages); then the outputs and the scratch, as unpacked below
    fused: bool,
    has_sinks: bool,
    has_scales: bool,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    num_seqs: int,
    per_core: int,
    interpret: bool,
):
    (slots_ref, q_ref, tables_hbm, kv_hbm, kv_new_hbm, sinks_ref, k_scale, v_scale, o_ref,
     kv_out, write_sem, refs) = kernel_refs(refs, fused, has_sinks, has_scales)  # fmt: skip
    (
        table,  # SMEM i32[2 * (M + P)]: table rows of this and the next sequence, flat, each
        #        padded with P entries so a step's last page index needs no clamp
        kv_buf,  # VMEM [2, P * S, R, W, Dp]: two slots of P pages, token-major (pages' dtype)
        m_ref,  # VMEM f32[K, G, 1]
        l_ref,  # VMEM f32[K, G, 1]
        acc_ref,  # VMEM f32[K, G, D]
        table_sem,  # DMA[2]
        kv_sem,  # DMA[2]: one per slot, for the page copies of that slot
    ) = refs
    seq_in_core = pl.program_id(1)
    seq = pl.program_id(0) * per_core + seq_in_core
    _, g, _ = q_ref.shape
    block_size = kv_hbm.shape[2]
    combined_rows = kv_hbm.shape[3]
    keys = kv_buf.shape[1]
    n_pages = keys // block_size
    max_blocks = tables_hbm.shape[1]
    row_len = table.shape[0] // 2  # M + P, rounded up to the 128-entry SMEM tile
    layer = layer_ref[0]

    class rows:  # noqa: N801 - the table-row DMAs of this kernel's flat SMEM rows
        @staticmethod
        def _copy(seq, slot):
            dst = table.at[pl.ds(pl.multiple_of(slot * row_len, TABLE_ROW_ALIGN), max_blocks)]
            return pltpu.make_async_copy(tables_hbm.at[seq], dst, table_sem.at[slot])

        @staticmethod
        def start(seq, slot):
            rows._copy(seq, slot).start()

        @staticmethod
        def wait(seq, slot):
            rows._copy(seq, slot).wait()

    tslot = seq_in_core % 2

    # The first sequence of this core's half fetches its own row; every program prefetches
    # the next one's, which the next program (same core, "arbitrary" order) waits for.
    @pl.when((seq_in_core == 0) & (seq < num_seqs))
    def _first_row():
        rows.start(seq, tslot)

    @pl.when(seq < num_seqs)
    def _wait_row():
        rows.wait(seq, tslot)

    @pl.when((seq_in_core + 1 < per_core) & (seq + 1 < num_seqs))
    def _prefetch_next_row():
        rows.start(seq + 1, 1 - tslot)

    length = lengths_ref[seq]
    end_page = (length + block_size - 1) // block_size  # pages [first_page, end_page)
    if sliding_window is not None:
        first_key = jnp.maximum(length - sliding_window, 0)
    else:
        first_key = jnp.int32(0)
    first_page = first_key // block_size
    n_steps = (jnp.maximum(end_page - first_page, 0) + n_pages - 1) // n_pages

    def fused_rows(page0):
        """Fused write: the step's cached tokens and its new one (position ``length - 1``,
        row ``seq`` of ``kv_new``)."""
        n_valid = jnp.clip(end_page - page0, 0, n_pages)
        return FusedRows.of(page0, n_valid, block_size, length - 1, length - 1)

    if fused:
        # This row's token goes to HBM while the row attends (the pages' copy of its
        # position is never read here: the new row comes from kv_new).
        token_writes(kv_new_hbm, kv_out, layer, slots_ref, seq, 1, write_sem, lambda c: c.start())

    def start_step(page0, slot):
        """Start the copy of each page ``page0 + j`` (``j < P``) below ``end_page`` (fused:
        the cached part of them, and the new row)."""
        row = tslot * row_len + page0
        n_valid = end_page - page0  # copies j < n_valid run: one compare with a constant each
        if fused:
            rows_of = fused_rows(page0)
            n_valid = rows_of.full_pages
            rows_of.start(
                kv_hbm, kv_buf, kv_new_hbm, kv_sem, layer, table, row, page0, slot,
                offset=length - 1 - seq,
            )  # fmt: skip
        for j in range(n_pages):
            # page0 + j < end_page <= M for a copy that runs; the padding keeps the read of
            # a skipped one (its value unused) inside the row. Entries are in [0, N) (the
            # wrapper clips the table), so the block id is used as read.
            block = table[row + j]
            copy = page_copy(kv_hbm, kv_buf, layer, block, slot, j, kv_sem)

            @pl.when(n_valid > j)
            def _start(copy=copy):
                copy.start()

    def wait_step(page0, slot):
        # One wait: a descriptor as large as every copy of the slot together (a DMA semaphore
        # counts bytes), instead of one wait per page.
        if fused:
            tokens = fused_rows(page0).total_rows
        else:
            tokens = jnp.clip(end_page - page0, 0, n_pages) * block_size
        wait_pages(kv_buf, combined_rows, slot, tokens, kv_sem)

    state = (m_ref, l_ref, acc_ref)
    reset_state(state, None if sinks_ref is None else sinks_ref[...])
    key_in_row = lax.broadcasted_iota(jnp.int32, (g, keys), 1)
    key_in_col = lax.broadcasted_iota(jnp.int32, (keys, 1), 0)

    @pl.when(n_steps > 0)
    def _first_step_pages():
        start_step(first_page, 0)

    def step(j, carry):
        slot = j % 2
        page0 = first_page + j * n_pages

        @pl.when(j + 1 < n_steps)
        def _next_step_pages():
            start_step(page0 + n_pages, 1 - slot)

        wait_step(page0, slot)
        base = page0 * block_size
        whole = (base + keys <= length) & (base >= first_key)
        attend = functools.partial(
            attend_step, q_ref, kv_buf, slot, state, sm_scale=sm_scale, soft_cap=soft_cap,
            k_scale=k_scale, interpret=interpret, stagger=True,
        )  # fmt: skip

        @pl.when(whole)
        def _every_key_visible():  # the steady state: no masks at all
            attend(None, None)

        @pl.when(~whole)
        def _edge_step():  # the step holding the length (or the window's start)
            kpos_row = base + key_in_row
            kpos_col = base + key_in_col
            attend(
                (kpos_row < length) & (kpos_row >= first_key),  # mask: which (row, key) pairs
                (kpos_col < length) & (kpos_col >= first_key),  # key_ok: value rows to keep
            )

        return carry

    lax.fori_loop(0, n_steps, step, 0)
    o_ref[...] = finish(l_ref[...], acc_ref[...], v_scale).astype(o_ref.dtype)
    if fused:
        token_writes(kv_new_hbm, kv_out, layer, slots_ref, seq, 1, write_sem, lambda c: c.wait())


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _vmem_limit(pages: int, block_size: int, combined_rows: int, head_dim: int) -> int:
    """Scoped VMEM for the decode kernel: its KV buffer plus 8 MiB for everything else."""
    kv = kv_buffer_bytes(pages, block_size, combined_rows, head_dim)
    return int(kv + 8 * 1024 * 1024)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "pages_per_compute_block",
        "num_kv_heads",
        "unique_slots",
        "device_kind",
    ),
)
def paged_attention_tpu(
    q: jax.Array,
    kv_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    num_kv_heads: int,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: int | jax.Array | None = None,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
    sinks: jax.Array | None = None,
    kv_scales: jax.Array | None = None,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    unique_slots: bool = False,
    device_kind: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Paged decode attention on TPU (arguments already validated by the public wrapper).

    Args:
      q: ``[B, H, Dp]`` (head dim padded as the pages store it).
      kv_pages: ``[L, N, S, C, W, Dp]`` (:mod:`kernels_pallas.kv_layout`).
      lengths: ``i32[B]``; 0 = padding row (zeros out).
      block_tables: ``i32[B, M]``; negative = no block.
      num_kv_heads: ``K`` (the pages hold ``C * W / 2`` heads, a dummy one included for an
        odd ``K`` in an 8-bit cache).
      sm_scale: logit scale (a float; the wrapper resolves the default).
      soft_cap: optional logit soft cap.
      sliding_window: optional window (the query sees keys ``> length - 1 - window``).
      layer: the layer of ``kv_pages`` (int or traced i32 scalar; None: 0).
      interpret: run in TPU interpret mode (``pltpu.InterpretParams()``), e.g. on CPU.
      pages_per_compute_block: pages per DMA/compute step ``P`` (default
        :func:`decode_pages_per_step`: ~2048 keys within the chip's VMEM budget).
      sinks: optional ``f32[H]`` attention sinks: one logit per query head in the softmax's
        denominator, with no value (gpt-oss).
      kv_scales: 8-bit (int8 / float8_e4m3fn) pages: ``f32[2]``, the layer's K and V scales
        (a page holds ``x / scale``); the kernel converts each step's pages to ``q.dtype``
        in VMEM and applies the scales to the logits and the output.
      new_kv: the fused KV write, ``(kv_new [B, C, W, Dp], slots i32[B])``: row ``b``'s
        token, already in the pages' dtype and merged (:func:`kernels_pallas.kv_layout.
        merge_kv`), is the key at position ``lengths[b] - 1`` and goes to ``slots[b]`` of
        ``layer`` (``< 0`` or out of range: not written; duplicates: the last row wins). The
        row attends to it from ``kv_new`` (its page copy skips that position) while one DMA
        writes it to HBM, so ``slots[b]`` must be the slot of that position for a row that
        counts. ``kv_pages`` is aliased to the returned pages (donate it under jit).
      unique_slots: a promise that no two live ``new_kv`` slots are equal (a served step's
        are not): skips the sort that makes the last duplicate win.
      device_kind: the target chip's ``device_kind`` (picks the default ``P``'s budget,
        :func:`decode_kv_vmem_budget`); None: :data:`DECODE_KV_VMEM_BUDGET`.

    Returns:
      ``[B, H, Dp]`` in ``q.dtype``; with ``new_kv``, ``(out, kv_pages)`` with the new
      tokens written.
    """
    layer = 0 if layer is None else layer
    b, h, d = q.shape
    _, n_blocks, s, c, w, dp = kv_pages.shape
    if dp != d:
        raise ValueError(f"q's head dim {d} is not the pages' stored head dim {dp}")
    kh = num_kv_heads
    g = h // kh
    p = pages_per_compute_block or decode_pages_per_step(
        s, block_tables.shape[1], kv_heads=kh, head_dim=d, itemsize=kv_pages.dtype.itemsize,
        device_kind=device_kind,
    )  # fmt: skip
    block_tables = dma_tables(block_tables, n_blocks)  # ids used as read by the DMAs
    m = block_tables.shape[1]
    cores = _CORES if b >= _CORES else 1
    per_core = -(-b // cores)
    b_pad = cores * per_core
    qg = q.reshape(b, kh, g, d)
    lengths = lengths.astype(jnp.int32)
    if b_pad != b:
        qg = jnp.pad(qg, ((0, b_pad - b), (0, 0), (0, 0), (0, 0)))
        lengths = jnp.pad(lengths, (0, b_pad - b))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    q_spec = pl.BlockSpec((None, kh, g, d), lambda c, i, *_: (c * per_core + i, 0, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    fused = new_kv is not None
    scalars = [layer_arr, lengths]
    inputs = [qg, block_tables, kv_pages]
    in_specs = [q_spec, any_spec, any_spec]
    out_shape = [jax.ShapeDtypeStruct(qg.shape, q.dtype)]
    out_specs = [q_spec]
    if fused:
        kv_new, slots = new_kv
        slots = live_slots(slots.astype(jnp.int32)[:b], n_blocks * s, not unique_slots)
        scalars.append(jnp.pad(slots, (0, b_pad - b), constant_values=-1))
        inputs.append(jnp.pad(kv_new[:b], ((0, b_pad - b), (0, 0), (0, 0), (0, 0))))
        in_specs.append(any_spec)
        out_shape.append(jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype))
        out_specs.append(any_spec)
    if sinks is not None:  # [K, G, 1]: the same block for every program (fetched once)
        inputs.append(sinks.astype(jnp.float32).reshape(kh, g, 1))
        in_specs.append(pl.BlockSpec((kh, g, 1), lambda c, i, *_: (0, 0, 0)))
    if kv_scales is not None:  # f32[2] in SMEM: two scalars every program reads
        inputs.append(kv_scales.astype(jnp.float32).reshape(2))
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    kernel = functools.partial(
        _decode_kernel,
        fused=fused,
        has_sinks=sinks is not None,
        has_scales=kv_scales is not None,
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        num_seqs=b,
        per_core=per_core,
        interpret=interpret,
    )
    results = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(cores, per_core),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.SMEM((2 * table_row_len(m, p),), jnp.int32),
                pltpu.VMEM(kv_buffer_shape(p, s, c, w, d), kv_pages.dtype),
                pltpu.VMEM((kh, g, 1), jnp.float32),
                pltpu.VMEM((kh, g, 1), jnp.float32),
                pltpu.VMEM((kh, g, d), jnp.float32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((2,)),
                *([pltpu.SemaphoreType.DMA(())] if fused else []),
            ],
        ),
        out_shape=out_shape,
        # fused: kv_pages (after the scalars and q, tables) is the second output
        input_output_aliases={len(scalars) + 2: 1} if fused else {},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=_vmem_limit(p, s, c, d),
            # Checks stay on in interpret mode (the CPU tests); compiled, a page's DMA is
            # a few bundles instead of tens (every address is clamped in range above).
            disable_bounds_checks=not interpret,
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paxcache_paged_decode_attention",
    )(*scalars, *inputs)
    out = results[0][:b].reshape(b, h, d)
    return (out, results[1]) if fused else out
