"""Mosaic TPU kernels for KV movement: write_kv, copy_blocks, swap_blocks.

All three kernels leave the pages in HBM (``memory_space=ANY``), alias them input -> output
(``input_output_aliases``) and move data with DMAs, so nothing but the touched rows or blocks
is ever read or written: under ``jax.jit`` with donated pages the update is in place.

* :func:`write_kv_tpu`: the slot mapping (and the layer) are scalar-prefetched into SMEM; the
  new K/V rows are tiled into VMEM ``tokens_per_step`` at a time and each token's ``[K, D]``
  row is DMA'd into ``pages[(layer,) :, block, offset, :]``. Slots < 0 issue no DMA.
* :func:`copy_blocks_tpu`: one HBM -> HBM DMA per ``(src, dst)`` pair and per page array,
  covering the whole block in every layer (``pages[..., src, :, :]``).
* :func:`swap_blocks_tpu`: the same block DMAs between two different arrays, one of which may
  live in host memory (``memory_kind="pinned_host"``; Pallas memory space ``HOST``).

Pairs and tokens are processed in steps of ``pairs_per_step`` / ``tokens_per_step``: every
DMA of a step is started before any is waited on, so the DMA engines work concurrently while
the number of DMAs in flight stays bounded.

Interpret mode: pass ``interpret=True``; the kernels then run under
``pltpu.InterpretParams()`` (the TPU interpreter that models DMAs and semaphores). Known limit
of JAX 0.10.2's TPU interpreter: it has no ``HOST`` memory space and cannot take a
``pinned_host`` operand at all, so :func:`swap_blocks_tpu` is interpret-tested only between
two device arrays.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["copy_blocks_tpu", "swap_blocks_tpu", "write_kv_tpu"]


def _interpret_arg(interpret: bool) -> Any:
    return pltpu.InterpretParams() if interpret else False


def _pad_to(x: jax.Array, n: int, value: int | float = 0) -> jax.Array:
    pad = n - x.shape[0]
    if pad == 0:
        return x
    widths = [(0, pad)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, widths, constant_values=value)


def _block_index(rank: int, block: jax.Array) -> tuple:
    """Index of one block (all leading axes) in pages ``[..., N, S, D]`` of the given rank."""
    return (slice(None),) * (rank - 3) + (block,)


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------


def _write_kv_kernel(
    slots_ref,  # SMEM i32[Tp]
    layer_ref,  # SMEM i32[1]
    k_ref,  # VMEM [tb, K, D]
    v_ref,  # VMEM [tb, K, D]
    k_hbm_in,  # ANY pages (aliased to k_hbm)
    v_hbm_in,
    k_hbm,  # ANY pages, output
    v_hbm,
    sem,
    *,
    tb: int,
    block_size: int,
    stacked: bool,
):
    del k_hbm_in, v_hbm_in  # same buffers as the outputs
    base = pl.program_id(0) * tb
    layer = layer_ref[0]

    def dmas(i):
        slot = slots_ref[base + i]
        safe = jnp.maximum(slot, 0)
        blk, off = safe // block_size, safe % block_size
        if stacked:
            k_dst, v_dst = k_hbm.at[layer, :, blk, off], v_hbm.at[layer, :, blk, off]
        else:
            k_dst, v_dst = k_hbm.at[:, blk, off], v_hbm.at[:, blk, off]
        ck = pltpu.make_async_copy(k_ref.at[i], k_dst, sem)
        cv = pltpu.make_async_copy(v_ref.at[i], v_dst, sem)
        return slot >= 0, ck, cv

    @pl.loop(0, tb)
    def _start(i):
        ok, ck, cv = dmas(i)

        @pl.when(ok)
        def _():
            ck.start()
            cv.start()

    @pl.loop(0, tb)
    def _wait(i):
        ok, ck, cv = dmas(i)

        @pl.when(ok)
        def _():
            ck.wait()
            cv.wait()


@functools.partial(jax.jit, static_argnames=("tokens_per_step", "interpret"))
def write_kv_tpu(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array | int = 0,
    *,
    tokens_per_step: int = 16,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Scatter T tokens' K/V rows into their slots with per-token DMAs (in place).

    Args:
      k_pages, v_pages: ``[K, N, S, D]`` or stacked ``[L, K, N, S, D]`` (then ``layer``
        selects the layer written).
      k, v: ``[T, K, D]`` in the pages' dtype.
      slot_mapping: ``i32[T]``; ``block * S + offset``, negative = skip.
      layer: layer index (int or i32 scalar) for stacked pages; ignored for rank 4.
      tokens_per_step: tokens per grid step (DMAs in flight per step is twice this).
      interpret: run in the TPU interpreter.

    Returns:
      ``(k_pages, v_pages)`` updated (aliased to the inputs).
    """
    stacked = k_pages.ndim == 5
    s = k_pages.shape[-2]
    t = k.shape[0]
    tb = max(1, min(tokens_per_step, t))
    tp = pl.cdiv(t, tb) * tb
    slots = _pad_to(slot_mapping.astype(jnp.int32), tp, -1)
    k = _pad_to(k, tp)
    v = _pad_to(v, tp)
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    kh, d = k.shape[1:]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    tok_spec = pl.BlockSpec((tb, kh, d), lambda i, *_: (i, 0, 0))
    kernel = functools.partial(_write_kv_kernel, tb=tb, block_size=s, stacked=stacked)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(tp // tb,),
            in_specs=[tok_spec, tok_spec, any_spec, any_spec],
            out_specs=[any_spec, any_spec],
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ],
        # operand order: slots, layer, k, v, k_pages, v_pages
        input_output_aliases={4: 0, 5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret_arg(interpret),
        name="write_kv",
    )(slots, layer_arr, k, v, k_pages, v_pages)


# --------------------------------------------------------------------------------------------
# copy_blocks / swap_blocks: block -> block DMAs
# --------------------------------------------------------------------------------------------


def _block_copy_kernel(src_ref, dst_ref, *refs, num_arrays: int, pb: int, rank: int, same: bool):
    """``refs``: inputs (src arrays, then dst arrays unless ``same``), outputs, semaphore."""
    sem = refs[-1]
    n_in = num_arrays if same else 2 * num_arrays
    ins, outs = refs[:n_in], refs[n_in : n_in + num_arrays]
    srcs = ins[:num_arrays]
    base = pl.program_id(0) * pb

    def dmas(i):
        s, d = src_ref[base + i], dst_ref[base + i]
        ok = (s >= 0) & (d >= 0)
        s_idx = _block_index(rank, jnp.maximum(s, 0))
        d_idx = _block_index(rank, jnp.maximum(d, 0))
        copies = [
            pltpu.make_async_copy(src.at[s_idx], out.at[d_idx], sem)
            for src, out in zip(srcs, outs, strict=True)
        ]
        return ok, copies

    @pl.loop(0, pb)
    def _start(i):
        ok, copies = dmas(i)

        @pl.when(ok)
        def _():
            for c in copies:
                c.start()

    @pl.loop(0, pb)
    def _wait(i):
        ok, copies = dmas(i)

        @pl.when(ok)
        def _():
            for c in copies:
                c.wait()


def _block_copy_call(
    srcs: tuple[jax.Array, ...],
    dsts: tuple[jax.Array, ...] | None,
    src_ids: jax.Array,
    dst_ids: jax.Array,
    *,
    pairs_per_step: int,
    interpret: bool,
    src_space: Any = pl.ANY,
    dst_space: Any = pl.ANY,
) -> tuple[jax.Array, ...]:
    same = dsts is None
    outs_like = srcs if same else dsts
    n = len(srcs)
    p = src_ids.shape[0]
    pb = max(1, min(pairs_per_step, p))
    pp = pl.cdiv(p, pb) * pb
    src_ids = _pad_to(src_ids.astype(jnp.int32), pp, -1)
    dst_ids = _pad_to(dst_ids.astype(jnp.int32), pp, -1)
    rank = srcs[0].ndim
    kernel = functools.partial(_block_copy_kernel, num_arrays=n, pb=pb, rank=rank, same=same)
    in_specs = [pl.BlockSpec(memory_space=src_space)] * n
    operands = list(srcs)
    if not same:
        in_specs += [pl.BlockSpec(memory_space=dst_space)] * n
        operands += list(dsts)
    # Scalar-prefetch operands come first, so aliased operand i sits at index 2 + offset.
    first_aliased = 2 if same else 2 + n
    aliases = {first_aliased + j: j for j in range(n)}
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(pp // pb,),
            in_specs=in_specs,
            out_specs=[pl.BlockSpec(memory_space=src_space if same else dst_space)] * n,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs_like],
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret_arg(interpret),
        name="copy_blocks" if same else "swap_blocks",
    )(src_ids, dst_ids, *operands)
    return tuple(outs)


@functools.partial(jax.jit, static_argnames=("pairs_per_step", "interpret"))
def copy_blocks_tpu(
    k_pages: jax.Array,
    v_pages: jax.Array,
    src: jax.Array,
    dst: jax.Array,
    *,
    pairs_per_step: int = 16,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Copy whole blocks ``src[i] -> dst[i]`` (every layer / head) with HBM DMAs, in place.

    Args:
      k_pages, v_pages: ``[K, N, S, D]`` or ``[L, K, N, S, D]`` (all layers copied).
      src, dst: ``i32[P]``; a pair with a negative id is skipped. Destinations must be
        distinct and must not also be sources (copy-on-write always targets fresh blocks).
      pairs_per_step: pairs per grid step.
      interpret: run in the TPU interpreter.
    """
    k_out, v_out = _block_copy_call(
        (k_pages, v_pages), None, src, dst, pairs_per_step=pairs_per_step, interpret=interpret
    )
    return k_out, v_out


def swap_blocks_tpu(
    src_pages: tuple[jax.Array, ...],
    dst_pages: tuple[jax.Array, ...],
    src_ids: jax.Array,
    dst_ids: jax.Array,
    *,
    src_host: bool,
    dst_host: bool,
    pairs_per_step: int = 16,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Block DMAs ``src_pages[..., src_ids[i], :, :] -> dst_pages[..., dst_ids[i], :, :]``.

    Meant to be called inside a ``jax.jit`` that donates ``dst_pages`` and whose shardings put
    each side in its memory kind; ``src_host`` / ``dst_host`` select the Pallas ``HOST``
    memory space for that side (HBM <-> host DMA on TPU).

    Args:
      src_pages, dst_pages: tuples of arrays ``[..., N_src|N_dst, S, D]`` with equal leading
        and trailing dims.
      src_ids, dst_ids: ``i32[P]``; pairs with a negative id are skipped.
    """
    src_space = pl.HOST if src_host else pl.ANY
    dst_space = pl.HOST if dst_host else pl.ANY
    return _block_copy_call(
        tuple(src_pages),
        tuple(dst_pages),
        src_ids,
        dst_ids,
        pairs_per_step=pairs_per_step,
        interpret=interpret,
        src_space=src_space,
        dst_space=dst_space,
    )
