"""Mosaic GPU (Pallas) kernels for KV movement: write_kv and copy_blocks.

Both kernels keep the pages in global memory (``GMEM``), alias them input -> output
(``input_output_aliases``) and move only the touched rows / blocks through shared memory with
TMA copies (``copy_gmem_to_smem`` -> ``copy_smem_to_gmem``), so under ``jax.jit`` with
donated pages the update is in place.

* :func:`write_kv_gpu`: each program handles ``tokens_per_program`` tokens; a token's
  ``[K, D]`` K and V rows are staged in SMEM and stored to ``pages[(layer,) :, blk, off, :]``.
  Slots < 0 are skipped.
* :func:`copy_blocks_gpu`: each program handles ``pairs_per_program`` pairs; a block is moved
  as ``[G, S, D]`` (G = all leading rows: layers x heads) in SMEM-sized chunks.

Status (JAX 0.10.2): these kernels were run only in Mosaic GPU *interpret* mode on CPU. That
interpreter runs only the first program of a ``pallas_call`` grid (program ids > 0 never
execute), so with ``interpret=True`` the whole batch runs as a single program; on a GPU the
grid is ``cdiv(T, tokens_per_program)`` programs. ``plgpu.kernel`` (which interprets a grid
correctly) rejects in-place ``jax.Ref`` operands under ``jit`` in this JAX version. They have
not been compiled on a GPU yet, so ``impl="auto"`` on GPU uses the XLA scatter path (in place
under donation too); ``impl="pallas_gpu"`` forces these kernels.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["copy_blocks_gpu", "write_kv_gpu"]

_SMEM_CHUNK_BYTES = 32 * 1024


def _interpret_arg(interpret: bool) -> Any:
    if not interpret:
        return False
    # GPU interpret parameters are not re-exported publicly in JAX 0.10.2.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _pad_to(x: jax.Array, n: int, value: int | float = 0) -> jax.Array:
    pad = n - x.shape[0]
    if pad == 0:
        return x
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def _write_kv_kernel(
    slots_ref, layer_ref, k_ref, v_ref, k_in, v_in, k_out, v_out, *, tb, block_size, stacked
):
    del k_in, v_in  # aliased to the outputs
    kh, d = k_ref.shape[1:]

    @functools.partial(
        pl.run_scoped,
        kbuf=plgpu.SMEM((kh, d), k_ref.dtype),
        vbuf=plgpu.SMEM((kh, d), v_ref.dtype),
        bar=plgpu.Barrier(num_arrivals=2),
    )
    def _(kbuf, vbuf, bar):
        base = pl.program_id(0) * tb
        layer = layer_ref[0]

        @pl.loop(0, tb)
        def _(i):
            t = base + i
            slot = slots_ref[t]

            @pl.when(slot >= 0)
            def _():
                blk, off = slot // block_size, slot % block_size
                plgpu.copy_gmem_to_smem(k_ref.at[t], kbuf, bar)
                plgpu.copy_gmem_to_smem(v_ref.at[t], vbuf, bar)
                plgpu.barrier_wait(bar)
                if stacked:
                    k_dst, v_dst = k_out.at[layer, :, blk, off], v_out.at[layer, :, blk, off]
                else:
                    k_dst, v_dst = k_out.at[:, blk, off], v_out.at[:, blk, off]
                plgpu.copy_smem_to_gmem(kbuf, k_dst)
                plgpu.copy_smem_to_gmem(vbuf, v_dst)
                plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("tokens_per_program", "interpret"))
def write_kv_gpu(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array | int = 0,
    *,
    tokens_per_program: int = 8,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Scatter T tokens' K/V rows into their slots (in place). Shapes as ``write_kv_tpu``."""
    stacked = k_pages.ndim == 5
    t = k.shape[0]
    tb = t if interpret else max(1, min(tokens_per_program, t))
    tp = pl.cdiv(t, tb) * tb
    slots = _pad_to(slot_mapping.astype(jnp.int32), tp, -1)
    k, v = _pad_to(k, tp), _pad_to(v, tp)
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    g = pl.BlockSpec(memory_space=plgpu.GMEM)
    kernel = functools.partial(
        _write_kv_kernel, tb=tb, block_size=k_pages.shape[-2], stacked=stacked
    )
    return pl.pallas_call(
        kernel,
        grid=(tp // tb,),
        in_specs=[g] * 6,
        out_specs=[g, g],
        out_shape=[
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ],
        input_output_aliases={4: 0, 5: 1},
        compiler_params=plgpu.CompilerParams(),
        interpret=_interpret_arg(interpret),
        name="write_kv_gpu",
    )(slots, layer_arr, k, v, k_pages, v_pages)


def _copy_kernel(src_ref, dst_ref, k_in, v_in, k_out, v_out, *, pb, gc):
    del k_in, v_in  # aliased to the outputs
    g_rows, _, s, d = k_out.shape

    @functools.partial(
        pl.run_scoped,
        kbuf=plgpu.SMEM((gc, s, d), k_out.dtype),
        vbuf=plgpu.SMEM((gc, s, d), v_out.dtype),
        bar=plgpu.Barrier(num_arrivals=2),
    )
    def _(kbuf, vbuf, bar):
        base = pl.program_id(0) * pb

        @pl.loop(0, pb)
        def _(i):
            sb, db = src_ref[base + i], dst_ref[base + i]

            @pl.when((sb >= 0) & (db >= 0))
            def _():
                @pl.loop(0, g_rows // gc)
                def _(c):
                    rows = pl.ds(c * gc, gc)
                    plgpu.copy_gmem_to_smem(k_out.at[rows, sb], kbuf, bar)
                    plgpu.copy_gmem_to_smem(v_out.at[rows, sb], vbuf, bar)
                    plgpu.barrier_wait(bar)
                    plgpu.copy_smem_to_gmem(kbuf, k_out.at[rows, db])
                    plgpu.copy_smem_to_gmem(vbuf, v_out.at[rows, db])
                    plgpu.wait_smem_to_gmem(0)


def _row_chunk(g_rows: int, row_bytes: int) -> int:
    """Largest divisor of ``g_rows`` whose rows fit in the SMEM staging budget."""
    best = 1
    for c in range(1, g_rows + 1):
        if g_rows % c == 0 and c * row_bytes <= _SMEM_CHUNK_BYTES:
            best = c
    return best


@functools.partial(jax.jit, static_argnames=("pairs_per_program", "interpret"))
def copy_blocks_gpu(
    k_pages: jax.Array,
    v_pages: jax.Array,
    src: jax.Array,
    dst: jax.Array,
    *,
    pairs_per_program: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Copy whole blocks ``src[i] -> dst[i]`` in every leading row (in place).

    Args:
      k_pages, v_pages: ``[K, N, S, D]`` or ``[L, K, N, S, D]``.
      src, dst: ``i32[P]``; negative ids skip the pair; destinations distinct, not sources.
    """
    shape = k_pages.shape
    n, s, d = shape[-3:]
    g_rows = math.prod(shape[:-3])
    kp = k_pages.reshape(g_rows, n, s, d)
    vp = v_pages.reshape(g_rows, n, s, d)
    p = src.shape[0]
    pb = p if interpret else max(1, min(pairs_per_program, p))
    pp = pl.cdiv(p, pb) * pb
    src = _pad_to(src.astype(jnp.int32), pp, -1)
    dst = _pad_to(dst.astype(jnp.int32), pp, -1)
    gc = _row_chunk(g_rows, s * d * k_pages.dtype.itemsize)
    g = pl.BlockSpec(memory_space=plgpu.GMEM)
    k_out, v_out = pl.pallas_call(
        functools.partial(_copy_kernel, pb=pb, gc=gc),
        grid=(pp // pb,),
        in_specs=[g] * 4,
        out_specs=[g, g],
        out_shape=[jax.ShapeDtypeStruct(kp.shape, kp.dtype)] * 2,
        input_output_aliases={2: 0, 3: 1},
        compiler_params=plgpu.CompilerParams(),
        interpret=_interpret_arg(interpret),
        name="copy_blocks_gpu",
    )(src, dst, kp, vp)
    return k_out.reshape(shape), v_out.reshape(shape)
