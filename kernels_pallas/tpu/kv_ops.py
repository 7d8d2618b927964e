"""Mosaic TPU kernels for KV movement on token-major pages: write_kv, copy_blocks, swap_blocks.

The pages are one array ``kv_pages [L, N, S, C, P, Dp]`` (:mod:`kernels_pallas.kv_layout`):
a token's K and V of one layer, ``kv_pages[l, n, s]`` = ``[C, P, Dp]``, is one contiguous,
tile-aligned piece of HBM (XLA:TPU and Mosaic tile the trailing ``[P, Dp]`` dims as one
``(P, 128)`` tile, packed ``P`` rows to a 32-bit word), so every kernel here moves whole
tokens or whole blocks with plain DMAs and never reads what it overwrites.

All three kernels leave the pages in HBM (``memory_space=ANY``), alias them input -> output
(``input_output_aliases``) and only issue DMAs: under ``jax.jit`` with donated pages the
update is in place and touches nothing but the written tokens / blocks.

* :func:`write_kv_tpu`: one HBM -> HBM DMA per live token, ``kv_new[t]`` (``[C, P, Dp]``)
  -> ``kv_pages[layer, slot // S, slot % S]``. A grid step starts the DMAs of a window of
  ``tokens_per_step`` tokens and then waits for the previous window's (two semaphores,
  alternating), so up to two windows are in flight and no DMA waits on another. The slot
  axis ``S`` is untiled, so any block size works, and every dtype (f32, bf16, fp16, fp8,
  int8) takes the same kernel. Duplicate live slots: the last token (highest index) wins,
  deterministically (the others are dropped by an XLA argsort before the kernel; two DMAs
  to one row in flight at once would tear it).

  Bytes per written token and layer, read from the compiled kernel (libtpu 0.0.42, v5e and
  v6e, Mosaic dump after ``finalize-llo``): the DMA is ``memref<C x P x Dp>`` tiled
  ``(P, 128)`` with unit tile strides (XLA lays the pages and ``kv_new`` out as
  ``T(1,128)`` f32, ``T(2,128)(2,1)`` bf16, ``T(4,128)(4,1)`` int8/fp8), one
  ``llo.enqueue_dma`` of ``C * Dp / 128`` tiles of 512 bytes = exactly ``C * P * Dp *
  itemsize`` written into the pages (bf16 K = 8, Dp = 128: 4096 bytes, the token's K and V;
  int8 K = 3: 1024 bytes for 768 of K/V, the dummy head's 256) and the same read from
  ``kv_new``; nothing of the pages is read (the head-major layout read-modify-wrote 8-row
  tiles: 2 x 8 rows for one decode token). ``Dp = 64`` compiles but is lane-padded to a
  128-lane tile in HBM (and an XLA-chosen entry layout adds relayout copies): serve TPU
  caches at ``Dp = 128``.
* :func:`copy_blocks_tpu`: one HBM -> HBM DMA per ``(src, dst)`` pair covering the block in
  every layer (``kv_pages[:, src]``: ``L`` contiguous pieces of ``S * C * P * Dp``).
* :func:`swap_blocks_tpu`: the same block DMAs between two different *device* arrays (or
  tuples of them). Host memory (``pinned_host``) is not supported: with libtpu 0.0.42 a
  Mosaic kernel whose operand or output lives in host memory aborts the process
  (HostOffloader CHECK) or fails an LLO check, so :func:`kernels_pallas.swap_blocks` moves
  blocks to and from the host with an XLA program instead.

DMA semaphores count bytes: waiting for one copy on a semaphore that several copies share
only says that *some* copy of that size landed, so every copy a step issues is waited for
(with the same descriptor, so the same byte count) before the step is done.

Interpret mode: pass ``interpret=True``; the kernels then run under
``pltpu.InterpretParams()`` (the TPU interpreter that models DMAs and semaphores, executing
them as late as possible and out of order, which is what catches a wait-then-read race).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = [
    "copy_blocks_tpu",
    "live_slots",
    "swap_blocks_tpu",
    "write_kv_tpu",
    "write_kv_unsupported_reason",
]

#: Rank of the page array ``[L, N, S, C, P, Dp]`` and the axis of its blocks.
PAGE_RANK = 6
BLOCK_AXIS = 1


def _interpret_arg(interpret: bool) -> Any:
    return pltpu.InterpretParams() if interpret else False


def _pad_to(x: jax.Array, n: int, value: int | float = 0) -> jax.Array:
    pad = n - x.shape[0]
    if pad == 0:
        return x
    widths = [(0, pad)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, widths, constant_values=value)


def _check_pages(name: str, *pages: jax.Array) -> None:
    for x in pages:
        if x.ndim != PAGE_RANK:
            raise ValueError(f"{name}: pages must be [L, N, S, C, P, Dp], got shape {x.shape}")


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------


def write_kv_unsupported_reason(block_size: int, dtype: Any) -> str | None:
    """Why the compiled write_kv kernel cannot take this geometry (None when it can).

    A token's row ``[C, P, Dp]`` is indexed on untiled leading axes only, so every block
    size is fine; the dtype must pack into 32-bit words (1, 2 or 4 bytes).
    """
    if block_size < 1:
        return f"block_size={block_size} is not positive"
    if jnp.dtype(dtype).itemsize not in (1, 2, 4):
        return f"dtype {jnp.dtype(dtype).name} is not a 1, 2 or 4-byte type"
    return None


def live_slots(slots: jax.Array, num_slots: int, dedupe: bool) -> jax.Array:
    """``slots`` with every token that is not written set to -1 (XLA, on ``T`` int32s):
    out of ``[0, num_slots)`` (as the XLA scatter drops them), and with ``dedupe`` every
    token whose live slot a later token also writes (the last one wins)."""
    slots = jnp.where((slots >= 0) & (slots < num_slots), slots, -1)
    if not dedupe or slots.shape[0] < 2:
        return slots
    order = jnp.argsort(slots, stable=True)  # equal slots stay in token order
    ss = slots[order]
    shadowed = jnp.concatenate([ss[:-1] == ss[1:], jnp.zeros((1,), bool)]) & (ss >= 0)
    dead = jnp.zeros(slots.shape, bool).at[order].set(shadowed)
    return jnp.where(dead, -1, slots)


def _write_kv_kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1]
    slots_ref,  # i32[steps * W]: slot of token t, -1 = not written
    # inputs
    new_hbm,  # [T, C, P, Dp] (ANY)
    pages_in,  # [L, N, S, C, P, Dp] (ANY), aliased to pages
    # outputs
    pages,  # [L, N, S, C, P, Dp]
    # scratch
    sems,  # DMA[2]: window w uses sems[w % 2]
    *,
    window: int,
    block_size: int,
):
    del pages_in  # the same buffer as pages
    step = pl.program_id(0)
    layer = layer_ref[0]

    def dma(w, j):
        t = w * window + j
        slot = slots_ref[t]
        at = jnp.maximum(slot, 0)  # non-negative: truncating div / rem (fewer scalar ops)
        copy = pltpu.make_async_copy(
            new_hbm.at[t],
            pages.at[layer, lax.div(at, block_size), lax.rem(at, block_size)],
            sems.at[w % 2],
        )
        return slot >= 0, copy

    def each_live(w, action):
        @pl.loop(0, window)
        def _token(j):
            live, copy = dma(w, j)

            @pl.when(live)
            def _():
                action(copy)

    each_live(step, lambda c: c.start())

    @pl.when(step > 0)
    def _wait_previous():
        each_live(step - 1, lambda c: c.wait())

    @pl.when(step == pl.num_programs(0) - 1)
    def _wait_last():
        each_live(step, lambda c: c.wait())


@functools.partial(jax.jit, static_argnames=("tokens_per_step", "dedupe", "interpret"))
def write_kv_tpu(
    kv_pages: jax.Array,
    kv_new: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array | int = 0,
    *,
    tokens_per_step: int = 64,
    dedupe: bool = True,
    interpret: bool = False,
) -> jax.Array:
    """Scatter T tokens' merged K/V rows into their slots of one layer, one DMA per token.

    Args:
      kv_pages: ``[L, N, S, C, P, Dp]`` (:mod:`kernels_pallas.kv_layout`); aliased to the
        output (donate it under jit for an in-place write).
      kv_new: ``[T, C, P, Dp]`` in the pages' dtype (:func:`~kernels_pallas.kv_layout.
        merge_kv` of the new K and V, already quantized).
      slot_mapping: ``i32[T]``: ``block * S + offset``; a slot outside ``[0, N * S)``
        (negative = padding) is skipped.
      layer: the layer written (int or i32 scalar), ``0 <= layer < L`` (not checked here).
      tokens_per_step: tokens whose DMAs a grid step starts (up to twice this in flight).
      dedupe: drop every token whose slot a later token also writes, so duplicates resolve
        deterministically to the last one (an argsort of ``T`` int32s in XLA). ``False``
        skips that for callers whose live slots are distinct; duplicates then race.
      interpret: run in the TPU interpreter.

    Returns:
      ``kv_pages`` with ``kv_pages[layer, slot // S, slot % S] = kv_new[t]`` for every
      written token; every other byte untouched.
    """
    _check_pages("write_kv_tpu", kv_pages)
    _, n, s, *row = kv_pages.shape
    if kv_new.ndim != 4 or tuple(kv_new.shape[1:]) != tuple(row):
        raise ValueError(f"write_kv_tpu: kv_new must be [T, {row}], got {kv_new.shape}")
    if kv_new.dtype != kv_pages.dtype:
        raise ValueError(f"write_kv_tpu: kv_new is {kv_new.dtype}, pages {kv_pages.dtype}")
    t = kv_new.shape[0]
    if t == 0:
        return kv_pages
    w = max(1, min(tokens_per_step, t))
    steps = pl.cdiv(t, w)
    slots = live_slots(slot_mapping.astype(jnp.int32), n * s, dedupe)
    slots = _pad_to(slots, steps * w, -1)
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_write_kv_kernel, window=w, block_size=s),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(steps,),
            in_specs=[any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        # operands: layer, slots, kv_new, kv_pages
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret_arg(interpret),
        name="paxcache_write_kv",
    )(layer_arr, slots, kv_new, kv_pages)


# --------------------------------------------------------------------------------------------
# copy_blocks / swap_blocks: block -> block DMAs
# --------------------------------------------------------------------------------------------


def _block_copy_kernel(src_ref, dst_ref, *refs, num_arrays: int, pb: int, same: bool):
    """``refs``: inputs (src arrays, then dst arrays unless ``same``), outputs, semaphore."""
    sem = refs[-1]
    n_in = num_arrays if same else 2 * num_arrays
    ins, outs = refs[:n_in], refs[n_in : n_in + num_arrays]
    srcs = ins[:num_arrays]
    base = pl.program_id(0) * pb

    def dmas(i):
        s, d = src_ref[base + i], dst_ref[base + i]
        ok = (s >= 0) & (d >= 0)
        s, d = jnp.maximum(s, 0), jnp.maximum(d, 0)
        copies = [
            pltpu.make_async_copy(src.at[:, s], out.at[:, d], sem)
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
) -> tuple[jax.Array, ...]:
    same = dsts is None
    outs_like = srcs if same else dsts
    n = len(srcs)
    p = src_ids.shape[0]
    if p == 0:
        return tuple(outs_like)
    pb = max(1, min(pairs_per_step, p))
    pp = pl.cdiv(p, pb) * pb
    src_ids = _pad_to(src_ids.astype(jnp.int32), pp, -1)
    dst_ids = _pad_to(dst_ids.astype(jnp.int32), pp, -1)
    kernel = functools.partial(_block_copy_kernel, num_arrays=n, pb=pb, same=same)
    in_specs = [pl.BlockSpec(memory_space=pl.ANY)] * n
    operands = list(srcs)
    if not same:
        in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * n
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
            out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * n,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs_like],
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret_arg(interpret),
        name="paxcache_copy_blocks" if same else "paxcache_swap_blocks",
    )(src_ids, dst_ids, *operands)
    return tuple(outs)


@functools.partial(jax.jit, static_argnames=("pairs_per_step", "interpret"))
def copy_blocks_tpu(
    kv_pages: jax.Array,
    src: jax.Array,
    dst: jax.Array,
    *,
    pairs_per_step: int = 16,
    interpret: bool = False,
) -> jax.Array:
    """Copy whole blocks ``src[i] -> dst[i]`` in every layer with HBM DMAs, in place.

    Args:
      kv_pages: ``[L, N, S, C, P, Dp]`` (all layers copied: ``kv_pages[:, dst[i]] =
        kv_pages[:, src[i]]``, one DMA per pair).
      src, dst: ``i32[P]``; a pair with a negative id is skipped. Destinations must be
        distinct and must not also be sources (copy-on-write always targets fresh blocks).
      pairs_per_step: pairs per grid step (all of a step's DMAs are in flight together).
      interpret: run in the TPU interpreter.
    """
    _check_pages("copy_blocks_tpu", kv_pages)
    (out,) = _block_copy_call(
        (kv_pages,), None, src, dst, pairs_per_step=pairs_per_step, interpret=interpret
    )
    return out


def swap_blocks_tpu(
    src_pages: jax.Array | tuple[jax.Array, ...],
    dst_pages: jax.Array | tuple[jax.Array, ...],
    src_ids: jax.Array,
    dst_ids: jax.Array,
    *,
    pairs_per_step: int = 16,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:
    """Block DMAs ``src_pages[:, src_ids[i]] -> dst_pages[:, dst_ids[i]]`` (every layer).

    Between two device (HBM) arrays only: a host-memory side is not supported (see the
    module docstring). Meant to be called inside a ``jax.jit`` that donates ``dst_pages``.

    Args:
      src_pages, dst_pages: ``kv_pages`` arrays ``[L, N_src|N_dst, S, C, P, Dp]`` (equal but
        for ``N``), or tuples of them (moved by one kernel).
      src_ids, dst_ids: ``i32[P]``; pairs with a negative id are skipped. Destinations must
        be distinct.
      pairs_per_step: pairs per grid step.
      interpret: run in the TPU interpreter.

    Returns:
      The updated destination pages: an array, or a tuple when tuples were given.
    """
    single = not isinstance(src_pages, (tuple, list))
    srcs = (src_pages,) if single else tuple(src_pages)
    dsts = (dst_pages,) if not isinstance(dst_pages, (tuple, list)) else tuple(dst_pages)
    if len(srcs) != len(dsts):
        raise ValueError(f"swap_blocks_tpu: {len(srcs)} source arrays, {len(dsts)} destinations")
    _check_pages("swap_blocks_tpu", *srcs, *dsts)
    outs = _block_copy_call(
        srcs,
        dsts,
        src_ids,
        dst_ids,
        pairs_per_step=pairs_per_step,
        interpret=interpret,
    )
    return outs[0] if single else outs
