"""Mosaic TPU Pallas kernel: ragged paged attention (decode, prefill, chunked prefill, prefix hits).

Sequence ``s < num_seqs`` owns query rows ``cu_q_lens[s]:cu_q_lens[s + 1]``, the last
``q_len`` of its ``kv_lens[s]`` tokens; row ``i`` sits at ``kv_lens[s] - q_len + i`` and
attends causally (and within ``sliding_window``). Rows past ``cu_q_lens[num_seqs]`` return 0.

Design:

* Grid ``(T / TQ,)``: one program per block of ``TQ`` query tokens, for all kv heads. Queries
  are laid out ``[K, T * G, D]``; the ``G`` query heads of a kv head are processed together
  (``TQ * G`` rows), so every KV page a block needs is read once for the whole group.
* Scalar prefetch (SMEM): ``layer i32[1]``, ``kv_lens i32[B]``, ``block_tables i32[B * M]``,
  ``cu_q_lens i32[B + 1]``, ``num_seqs i32[1]``.
* A program finds the first sequence overlapping its rows by binary search on ``cu_q_lens``,
  then walks a flat list of work items ``(kv head, sequence, compute step)`` in one
  ``while_loop``. A compute step covers ``P`` pages; the DMA of the next item (possibly the
  next sequence's or the next head's first pages) is started before the current one is
  computed (double buffering across sequences and heads), so one copy per program is exposed.
  Only pages the block's rows can see are copied: from the first key inside the sliding
  window of the block's first row to the last row's position.
* Rows not in the current sequence see an all-masked step, which leaves their online-softmax
  state unchanged, so one ``(m, l, acc)`` carry serves every sequence of the block.
* Masks use ``where`` on logits and values; unwritten slots (NaN in tests) never leak; negative
  block ids are clamped to 0 for addressing.

Hardware notes for the compiled kernel: as for the decode kernel (``S`` a multiple of 8 / 16
for f32 / bf16, ``D`` a multiple of 128 ideally, ``P * S`` a multiple of 128); in addition
``TQ * G`` should be a multiple of 8 (the default ``TQ = 64 // G`` gives 64 rows), or ``TQ``
the whole (padded) token count. Checked in TPU interpret mode on CPU; not yet compiled on a
TPU in this project.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.tpu._attention_common import (
    PageCopier,
    default_pages_per_compute_block,
    finish,
    init_carry,
    online_softmax_step,
)

__all__ = ["ragged_paged_attention_tpu"]


def _ragged_kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1]
    kv_lens_ref,  # i32[B]
    tables_ref,  # i32[B * M]
    cu_ref,  # i32[B + 1]
    num_seqs_ref,  # i32[1]
    # inputs
    q_ref,  # [K, TQ * G, D] block of q [K, T_pad * G, D] (row = token * G + head in group)
    k_hbm,  # [L, K, N, S, D] in HBM
    v_hbm,
    # output
    o_ref,  # [K, TQ * G, D]
    # scratch
    k_buf,  # [2, P, S, D] VMEM
    v_buf,
    k_sem,  # DMA[2]
    v_sem,
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    max_blocks: int,
    g: int,
):
    qb = pl.program_id(0)
    kh, rows, d = q_ref.shape
    tq = rows // g
    _, n_pages, s, _ = k_buf.shape
    keys_per_step = n_pages * s
    r0 = qb * tq
    r1 = r0 + tq
    nseq = num_seqs_ref[0]

    # First sequence whose rows end after r0: smallest s in [0, nseq) with cu[s + 1] > r0.
    def bs_cond(c):
        return c[0] < c[1]

    def bs_body(c):
        lo, hi = c
        mid = (lo + hi) // 2
        right = cu_ref[mid + 1] > r0
        return jnp.where(right, lo, mid + 1), jnp.where(right, mid, hi)

    first_seq, _ = lax.while_loop(bs_cond, bs_body, (jnp.int32(0), nseq))

    def seq_info(sq):
        """Rows of sequence ``sq`` inside this block and the pages they need."""
        sq = jnp.minimum(sq, cu_ref.shape[0] - 2)
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
        return lax.while_loop(lambda x: active(x) & (seq_info(x)[-1] == 0), lambda x: x + 1, sq)

    copier = PageCopier(
        k_hbm, v_hbm, k_buf, v_buf, k_sem, v_sem, tables_ref, max_blocks, layer_ref[0], 0
    )

    def start(head, sq, i, slot):
        *_, first_page, end_page, _ = seq_info(sq)
        dataclasses.replace(copier, head=head).start(sq, first_page + i * n_pages, end_page, slot)

    # Row r of the block is token r0 + r // G. Masks compare r with multiples of G instead of
    # dividing a vector (floor(r / G) >= a  <=>  r >= a * G for integers a).
    row = lax.broadcasted_iota(jnp.int32, (rows, keys_per_step), 0)

    s0 = skip_empty(first_seq)
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)  # rows no sequence covers stay zero

    @pl.when(active(s0))
    def _():
        start(0, s0, 0, 0)

    # One flat walk over (kv head, sequence, step): every head sees the same sequences; the
    # next item's pages (next step, next sequence or next head) are prefetched while the
    # current one is computed.
    def cond(state):
        return (state[0] < kh) & active(state[1])

    def body(state):
        head, sq, i, slot, carry = state
        row_lo, row_hi, off, key_lo, pos_hi, first_page, end_page, n_steps = seq_info(sq)
        last = i + 1 >= n_steps
        nsq = jnp.where(last, skip_empty(sq + 1), sq)
        head_done = last & ~active(nsq)
        nhead = jnp.where(head_done, head + 1, head)
        nsq = jnp.where(head_done, s0, nsq)
        ni = jnp.where(last, 0, i + 1)

        @pl.when(nhead < kh)
        def _():
            start(nhead, nsq, ni, 1 - slot)

        step_page = first_page + i * n_pages
        dataclasses.replace(copier, head=head).wait(sq, step_page, end_page, slot)
        k = k_buf[slot].astype(jnp.float32).reshape(keys_per_step, d)
        v = v_buf[slot].astype(jnp.float32).reshape(keys_per_step, d)
        base = step_page * s
        # key position relative to the position of the block's token 0 in this sequence
        rel = base - r0 - off + lax.broadcasted_iota(jnp.int32, (rows, keys_per_step), 1)
        kpos_col = base + lax.broadcasted_iota(jnp.int32, (keys_per_step, 1), 0)
        in_seq = (row >= (row_lo - r0) * g) & (row < (row_hi - r0) * g)
        mask = in_seq & (rel * g <= row)  # causal: kpos <= pos
        key_ok = (kpos_col <= pos_hi) & (kpos_col >= key_lo)
        if sliding_window is not None:
            mask &= row < (rel + sliding_window) * g  # window: kpos > pos - window
        q = q_ref[head].astype(jnp.float32) * sm_scale
        carry = online_softmax_step(q, k, v, mask, key_ok, carry, soft_cap=soft_cap)

        @pl.when(head_done)
        def _():
            o_ref[head] = finish(carry).astype(o_ref.dtype)

        carry = tuple(
            jnp.where(head_done, c0, c) for c0, c in zip(init_carry(rows, d), carry, strict=True)
        )
        return nhead, nsq, ni, 1 - slot, carry

    state = (jnp.int32(0), s0, jnp.int32(0), jnp.int32(0), init_carry(rows, d))
    lax.while_loop(cond, body, state)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "pages_per_compute_block",
        "queries_per_block",
    ),
)
def ragged_paged_attention_tpu(
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
    layer: int | jax.Array | None = None,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
    queries_per_block: int | None = None,
) -> jax.Array:
    """Ragged paged attention on TPU (arguments already validated by the public wrapper).

    Args:
      q: ``[T, H, D]`` token-packed queries.
      k_pages, v_pages: ``[K, N, S, D]``, or ``[L, K, N, S, D]`` with ``layer``.
      kv_lens: ``i32[B]``.
      block_tables: ``i32[B, M]``; negative = no block.
      cu_q_lens: ``i32[B + 1]``.
      num_seqs: scalar or ``i32[1]``.
      sm_scale: logit scale (a float).
      soft_cap: optional logit soft cap.
      sliding_window: optional window (a query at ``p`` sees keys in ``(p - window, p]``).
      layer: layer of stacked pages (int or traced i32 scalar); ignored for rank-4 pages.
      interpret: run in TPU interpret mode (``pltpu.InterpretParams()``).
      pages_per_compute_block: pages per DMA/compute step ``P`` (default: about 128 keys).
      queries_per_block: query tokens per program ``TQ`` (default: about 64 rows of
        ``TQ * G``, at most T).

    Returns:
      ``[T, H, D]`` in ``q.dtype``.
    """
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    t, h, d = q.shape
    _, kh, _, s, _ = k_pages.shape
    g = h // kh
    m = block_tables.shape[1]
    p = pages_per_compute_block or default_pages_per_compute_block(s, m, 128)
    tq = queries_per_block or max(1, min(t, 64 // g))
    t_pad = -(-t // tq) * tq
    # [T, H, D] -> [K, T_pad * G, D]: each kv head's query rows are one 2-D slab, so a block
    # is a plain [TQ * G, D] tile (no in-kernel reshape of the G axis).
    qg = q.reshape(t, kh, g, d)
    if t_pad != t:
        qg = jnp.pad(qg, ((0, t_pad - t), (0, 0), (0, 0), (0, 0)))
    qg = jnp.transpose(qg, (1, 0, 2, 3)).reshape(kh, t_pad * g, d)
    q_spec = pl.BlockSpec((kh, tq * g, d), lambda qi, *_: (0, qi, 0))
    kernel = functools.partial(
        _ragged_kernel,
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        max_blocks=m,
        g=g,
    )
    scalars = (
        jnp.asarray(layer, jnp.int32).reshape(1),
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        cu_q_lens.astype(jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(1),
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(t_pad // tq,),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, p, s, d), k_pages.dtype),
                pltpu.VMEM((2, p, s, d), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paxcache_ragged_paged_attention",
    )(*scalars, qg, k_pages, v_pages)
    out = jnp.transpose(out.reshape(kh, t_pad, g, d), (1, 0, 2, 3))
    return out[:t].reshape(t, h, d)
