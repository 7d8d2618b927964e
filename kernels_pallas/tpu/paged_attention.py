"""Mosaic TPU Pallas kernel: paged decode attention (one query token per sequence).

Design:

* Grid ``(B,)``: one program per sequence, walking its kv heads one after the other. All
  ``G = H // K`` query heads of a kv head are processed together (GQA/MQA), so each KV page is
  read from HBM once per group.
* Scalar prefetch (SMEM): ``layer i32[1]``, ``lengths i32[B]``, ``block_tables i32[B * M]``.
* Pages stay in HBM (``memory_space=ANY``); the program walks (kv head, ``P`` pages) steps
  (``pages_per_compute_block``), DMA-ing them into a two-slot VMEM scratch: the copy of step
  ``j + 1`` (possibly the next head's first pages) is started before step ``j`` is computed
  (double buffering), so only the first copy of each sequence is exposed.
* Only pages holding keys the query may see are copied: ``[first_page, cdiv(length, S))``,
  where ``first_page`` skips pages wholly outside the sliding window. Slots past the length
  are masked with ``where`` (never by multiplication), so NaN garbage cannot leak; a length-0
  row copies nothing and returns zeros. Negative block ids are clamped to 0 for addressing.
* Online softmax in float32 across compute steps (``_attention_common.online_softmax_step``).
* Stacked caches: pages are addressed as ``[L, K, N, S, D]`` and the layer is a prefetched
  scalar, so a ``lax.scan`` over layers reads ``pages.at[layer]`` without copying a layer.

Hardware notes for the compiled kernel (interpret mode has no such limits): ``S`` should be a
multiple of 8 (float32) or 16 (bfloat16) so a ``[P, S, D]`` VMEM buffer reshapes to
``[P*S, D]`` without relayout; ``D`` a multiple of 128 avoids lane padding (64 works, padded);
``P * S`` a multiple of 128 keeps the logits lane-dense (the default aims at 128 keys per step).
This kernel has been checked in TPU interpret mode on CPU; it has not yet been compiled on a
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

__all__ = ["paged_attention_tpu"]


def _decode_kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1]
    lengths_ref,  # i32[B]
    tables_ref,  # i32[B * M]
    # inputs
    q_ref,  # [K, G, D] block of q [B, K, G, D]
    k_hbm,  # [L, K, N, S, D] in HBM
    v_hbm,
    # output
    o_ref,  # [K, G, D]
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
):
    b = pl.program_id(0)
    kh, g, d = q_ref.shape
    _, n_pages, s, _ = k_buf.shape
    keys_per_step = n_pages * s
    length = lengths_ref[b]
    end_page = (length + s - 1) // s
    if sliding_window is not None:
        first_page = jnp.maximum(length - sliding_window, 0) // s
    else:
        first_page = jnp.int32(0)
    n_steps = (jnp.maximum(end_page - first_page, 0) + n_pages - 1) // n_pages
    # One flat walk over (kv head, step): the first pages of head h + 1 are prefetched while
    # the last step of head h is computed, so only the sequence's very first copy is exposed.
    total = kh * n_steps

    copier = PageCopier(
        k_hbm, v_hbm, k_buf, v_buf, k_sem, v_sem, tables_ref, max_blocks, layer_ref[0], 0
    )

    def item(j):
        head = j // jnp.maximum(n_steps, 1)
        return head, first_page + (j - head * n_steps) * n_pages

    def start(j, slot):
        head, page = item(j)
        dataclasses.replace(copier, head=head).start(b, page, end_page, slot)

    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)  # rows with nothing to see stay zero

    @pl.when(total > 0)
    def _():
        start(0, 0)

    def body(j, carry):
        slot = j % 2

        @pl.when(j + 1 < total)
        def _():
            start(j + 1, 1 - slot)

        head, page = item(j)
        dataclasses.replace(copier, head=head).wait(b, page, end_page, slot)
        k = k_buf[slot].astype(jnp.float32).reshape(keys_per_step, d)
        v = v_buf[slot].astype(jnp.float32).reshape(keys_per_step, d)
        base = page * s
        kpos_row = base + lax.broadcasted_iota(jnp.int32, (g, keys_per_step), 1)
        kpos_col = base + lax.broadcasted_iota(jnp.int32, (keys_per_step, 1), 0)
        mask = kpos_row < length
        key_ok = kpos_col < length
        if sliding_window is not None:
            lo = length - sliding_window  # first visible key position
            mask &= kpos_row >= lo
            key_ok &= kpos_col >= lo
        q = q_ref[head].astype(jnp.float32) * sm_scale  # [G, D]
        carry = online_softmax_step(q, k, v, mask, key_ok, carry, soft_cap=soft_cap)
        o_ref[head] = finish(carry).astype(o_ref.dtype)
        # The head's last step: start the next head from a fresh state.
        last = page + n_pages >= end_page
        return tuple(jnp.where(last, c0, c) for c0, c in zip(init_carry(g, d), carry, strict=True))

    lax.fori_loop(0, total, body, init_carry(g, d))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "pages_per_compute_block",
    ),
)
def paged_attention_tpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: int | jax.Array | None = None,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
) -> jax.Array:
    """Paged decode attention on TPU (arguments already validated by the public wrapper).

    Args:
      q: ``[B, H, D]``.
      k_pages, v_pages: ``[K, N, S, D]``, or ``[L, K, N, S, D]`` with ``layer``.
      lengths: ``i32[B]``; 0 = padding row (zeros out).
      block_tables: ``i32[B, M]``; negative = no block.
      sm_scale: logit scale (a float; the wrapper resolves the default).
      soft_cap: optional logit soft cap.
      sliding_window: optional window (the query sees keys ``> length - 1 - window``).
      layer: layer of stacked pages (int or traced i32 scalar); ignored for rank-4 pages.
      interpret: run in TPU interpret mode (``pltpu.InterpretParams()``), e.g. on CPU.
      pages_per_compute_block: pages per DMA/compute step ``P`` (default: about 128 keys).

    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    b, h, d = q.shape
    _, kh, _, s, _ = k_pages.shape
    g = h // kh
    m = block_tables.shape[1]
    p = pages_per_compute_block or default_pages_per_compute_block(s, m, 128)
    qg = q.reshape(b, kh, g, d)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    q_spec = pl.BlockSpec((None, kh, g, d), lambda bi, *_: (bi, 0, 0, 0))
    kernel = functools.partial(
        _decode_kernel,
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        max_blocks=m,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b,),
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
        name="paxcache_paged_decode_attention",
    )(layer_arr, lengths.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), qg,
      k_pages, v_pages)  # fmt: skip
    return out.reshape(b, h, d)
