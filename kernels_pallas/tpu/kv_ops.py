"""Mosaic TPU kernels for KV movement: write_kv, copy_blocks, swap_blocks.

All three kernels leave the pages in HBM (``memory_space=ANY``), alias them input -> output
(``input_output_aliases``) and move data with DMAs, so nothing but the touched tiles or blocks
is ever read or written: under ``jax.jit`` with donated pages the update is in place.

* :func:`write_kv_tpu`: pages ``[..., S, D]`` are tiled ``(8, 128)`` in HBM (bf16: two rows
  packed per word) and a DMA must start and end on a tile boundary along ``S``, so one bf16
  token row cannot be written alone (Mosaic: "Offsets along tiled dimensions must be aligned
  to tiles"). The tokens are sorted by slot in XLA and grouped into runs that fall in the
  same 8-row tile; each run is one ``[K, 8, D]`` tile DMA. A run covering its whole tile (the
  inside of a prefill) is written without reading; a partial one (a decode token, a chunk's
  ends) is read, merged in VMEM and written back (read-modify-write, 2 x 8 rows moved for a
  1-row decode write). Same kernel for every dtype (f32, bf16, fp8, int8).
* :func:`copy_blocks_tpu`: one HBM -> HBM DMA per ``(src, dst)`` pair and per page array,
  covering the whole block in every layer (``pages[..., src, :, :]``).
* :func:`swap_blocks_tpu`: the same block DMAs between two different *device* arrays. Host
  memory (``pinned_host``) is not supported: with libtpu 0.0.42 a Mosaic kernel whose operand
  or output lives in host memory aborts the process (HostOffloader CHECK) or fails an LLO
  check, so :func:`kernels_pallas.swap_blocks` moves blocks to and from the host with an XLA
  program instead.

DMA semaphores count bytes: waiting for one copy on a semaphore that several copies share
only says that *some* copy of that size landed, so every copy a step issues is waited for
before any of their buffers is read.

Interpret mode: pass ``interpret=True``; the kernels then run under
``pltpu.InterpretParams()`` (the TPU interpreter that models DMAs and semaphores, executing
them as late as possible and out of order, which is what catches a wait-then-read race).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
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

#: Rows of one HBM tile along the block-size axis: ``[..., S, D]`` pages are tiled ``(8, 128)``
#: (``(8, 128)(2, 1)`` for bf16: two rows packed per 32-bit word), and Mosaic DMAs must start
#: and end on tile boundaries along that axis ("Offsets along tiled dimensions must be aligned
#: to tiles"), so a single bf16 token row cannot be DMA'd on its own.
TILE_ROWS = 8


def write_kv_unsupported_reason(block_size: int, dtype: Any) -> str | None:
    """Why the compiled write_kv kernel cannot take this geometry (None when it can)."""
    if block_size % TILE_ROWS:
        return f"block_size={block_size} is not a multiple of the {TILE_ROWS}-row HBM tile"
    if jnp.dtype(dtype).itemsize not in (1, 2, 4):
        return f"dtype {jnp.dtype(dtype).name} is not a 1, 2 or 4-byte type"
    return None


def _write_runs(slots: jax.Array, tile_rows: int) -> tuple[jax.Array, ...]:
    """Group the tokens by destination tile (XLA, on ``T`` int32s).

    Returns ``(order i32[T], sorted_slots i32[T], run_first i32[T], run_count i32[T],
    num_runs i32[1])``: tokens sorted by slot (padding last); run ``r < num_runs`` is the
    ``run_count[r]`` consecutive sorted tokens from ``run_first[r]``, all in one tile.
    """
    t = slots.shape[0]
    big = jnp.iinfo(jnp.int32).max
    key = jnp.where(slots >= 0, slots, big)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    ss = key[order]
    valid = ss != big
    tile = ss // tile_rows
    new_run = valid & jnp.concatenate([jnp.ones((1,), bool), tile[1:] != tile[:-1]])
    num_runs = jnp.sum(new_run, dtype=jnp.int32)
    run_id = jnp.cumsum(new_run, dtype=jnp.int32) - 1
    idx = jnp.arange(t, dtype=jnp.int32)
    run_first = jnp.zeros((t,), jnp.int32).at[jnp.where(new_run, run_id, t)].set(idx, mode="drop")
    nxt = jnp.concatenate([run_first[1:], jnp.zeros((1,), jnp.int32)])
    run_end = jnp.where(idx + 1 < num_runs, nxt, jnp.sum(valid, dtype=jnp.int32))
    run_count = jnp.where(idx < num_runs, run_end - run_first, 0)
    return order, jnp.where(valid, ss, -1), run_first, run_count, num_runs.reshape(1)


def _write_kv_kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1]
    slots_ref,  # i32[T]: slots sorted ascending, padding (-1) last
    first_ref,  # i32[T]: first sorted token of run r
    count_ref,  # i32[T]: tokens of run r (all in one tile)
    num_runs_ref,  # i32[1]
    # inputs
    k_new_hbm,  # [T + R * TR, K, D] new keys in sorted order (ANY)
    v_new_hbm,  # [T + R * TR, K, D]
    k_hbm_in,  # [L, K, N, S, D] pages (ANY), aliased to k_hbm
    v_hbm_in,
    # outputs
    k_hbm,  # [L, K, N, S, D]
    v_hbm,
    # scratch
    k_rows,  # VMEM [R * TR, K, D]: the step's new rows
    v_rows,
    k_tiles,  # VMEM [R, K, TR, D]: one tile per run
    v_tiles,
    sems,  # DMA[3]: new rows, tile reads, tile writes
    *,
    runs_per_step: int,
    tile_rows: int,
    block_size: int,
):
    del k_hbm_in, v_hbm_in  # the same buffers as k_hbm / v_hbm
    r0 = pl.program_id(0) * runs_per_step
    num_runs = num_runs_ref[0]
    layer = layer_ref[0]
    tiles_per_block = block_size // tile_rows

    @pl.when(r0 < num_runs)
    def _step():
        t0 = first_ref[r0]
        window = k_rows.shape[0]
        rows_k = pltpu.make_async_copy(k_new_hbm.at[pl.ds(t0, window)], k_rows, sems.at[0])
        rows_v = pltpu.make_async_copy(v_new_hbm.at[pl.ds(t0, window)], v_rows, sems.at[0])
        rows_k.start()
        rows_v.start()

        def run(j):
            """Run ``r0 + j``: ``(live, full, first token, K tile, V tile)`` in the pages."""
            r = jnp.minimum(r0 + j, num_runs - 1)  # clamped: SMEM reads stay in bounds
            first = first_ref[r]
            tile = jnp.maximum(slots_ref[first], 0) // tile_rows
            blk = tile // tiles_per_block
            row0 = pl.multiple_of((tile % tiles_per_block) * tile_rows, tile_rows)
            k_dst = k_hbm.at[layer, :, blk, pl.ds(row0, tile_rows)]  # [K, TR, D]
            v_dst = v_hbm.at[layer, :, blk, pl.ds(row0, tile_rows)]
            full = count_ref[r] == tile_rows  # distinct slots: every row of the tile is new
            return r0 + j < num_runs, full, first, k_dst, v_dst

        def reads(j, k_dst, v_dst):
            return (
                pltpu.make_async_copy(k_dst, k_tiles.at[j], sems.at[1]),
                pltpu.make_async_copy(v_dst, v_tiles.at[j], sems.at[1]),
            )

        def writes(j, k_dst, v_dst):
            return (
                pltpu.make_async_copy(k_tiles.at[j], k_dst, sems.at[2]),
                pltpu.make_async_copy(v_tiles.at[j], v_dst, sems.at[2]),
            )

        # Read-modify-write: partial tiles are read first (their other rows must survive).
        @pl.loop(0, runs_per_step)
        def _read_tiles(j):
            live, full, _, k_dst, v_dst = run(j)

            @pl.when(live & ~full)
            def _read():
                for c in reads(j, k_dst, v_dst):
                    c.start()

        rows_k.wait()
        rows_v.wait()

        # Every read shares one semaphore, so a wait only says that *some* read of that size
        # landed: all of them are waited for before any tile is merged.
        @pl.loop(0, runs_per_step)
        def _wait_tiles(j):
            live, full, _, k_dst, v_dst = run(j)

            @pl.when(live & ~full)
            def _wait():
                for c in reads(j, k_dst, v_dst):
                    c.wait()

        row_iota = lax.broadcasted_iota(jnp.int32, k_tiles.shape[1:], 1)  # [K, TR, D]

        @pl.loop(0, runs_per_step)
        def _merge_and_write(j):
            live, _, first, k_dst, v_dst = run(j)

            @pl.when(live)
            def _merge():
                def merge_token(i, tiles):
                    tok = first + i
                    at = row_iota == slots_ref[tok] % tile_rows
                    kt, vt = tiles
                    kt = jnp.where(at, k_rows[tok - t0].astype(jnp.float32)[:, None, :], kt)
                    vt = jnp.where(at, v_rows[tok - t0].astype(jnp.float32)[:, None, :], vt)
                    return kt, vt

                init = (k_tiles[j].astype(jnp.float32), v_tiles[j].astype(jnp.float32))
                count = count_ref[jnp.minimum(r0 + j, num_runs - 1)]
                kt, vt = lax.fori_loop(0, count, merge_token, init)
                k_tiles[j] = kt.astype(k_tiles.dtype)
                v_tiles[j] = vt.astype(v_tiles.dtype)
                for c in writes(j, k_dst, v_dst):
                    c.start()

        @pl.loop(0, runs_per_step)
        def _wait_writes(j):
            live, _, _, k_dst, v_dst = run(j)

            @pl.when(live)
            def _wait():
                for c in writes(j, k_dst, v_dst):
                    c.wait()


@functools.partial(jax.jit, static_argnames=("runs_per_step", "interpret"))
def write_kv_tpu(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array | int = 0,
    *,
    runs_per_step: int = 16,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Scatter T tokens' K/V rows into their slots, tile by tile (in place).

    Tokens are grouped (in XLA) into runs that fall in the same ``TR = 8``-row tile of a
    block; each run is one tile DMA into the pages. A run that covers its whole tile (the
    inside of a prefill) is written without reading; a partial tile (a decode token, the
    ends of a chunk) is read, merged in VMEM and written back. Nothing else of the pages is
    touched.

    Args:
      k_pages, v_pages: ``[K, N, S, D]`` or stacked ``[L, K, N, S, D]`` (then ``layer``
        selects the layer written). ``S`` must be a multiple of 8 when compiled.
      k, v: ``[T, K, D]`` in the pages' dtype.
      slot_mapping: ``i32[T]``; ``block * S + offset``, negative = skip. Live slots distinct.
      layer: layer index (int or i32 scalar) for stacked pages; ignored for rank 4.
      runs_per_step: tile runs per grid step (DMAs in flight: up to ``4 * runs_per_step``).
      interpret: run in the TPU interpreter.

    Returns:
      ``(k_pages, v_pages)`` updated (aliased to the inputs).
    """
    rank4 = k_pages.ndim == 4
    if rank4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    s = k_pages.shape[-2]
    t, kh, d = k.shape
    tr = TILE_ROWS if s % TILE_ROWS == 0 else math.gcd(s, TILE_ROWS)  # gcd: interpret only
    rps = max(1, min(runs_per_step, t))
    order, ss, first, count, num_runs = _write_runs(slot_mapping.astype(jnp.int32), tr)
    pad = ((0, rps * tr), (0, 0), (0, 0))  # the last step's row window stays in bounds
    k_new = jnp.pad(k[order], pad)
    v_new = jnp.pad(v[order], pad)
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_write_kv_kernel, runs_per_step=rps, tile_rows=tr, block_size=s)
    k_out, v_out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(pl.cdiv(t, rps),),
            in_specs=[any_spec] * 4,
            out_specs=[any_spec, any_spec],
            scratch_shapes=[
                pltpu.VMEM((rps * tr, kh, d), k.dtype),
                pltpu.VMEM((rps * tr, kh, d), v.dtype),
                pltpu.VMEM((rps, kh, tr, d), k_pages.dtype),
                pltpu.VMEM((rps, kh, tr, d), v_pages.dtype),
                pltpu.SemaphoreType.DMA((3,)),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ],
        # operands: layer, slots, first, count, num_runs, k_new, v_new, k_pages, v_pages
        input_output_aliases={7: 0, 8: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret_arg(interpret),
        name="paxcache_write_kv",
    )(layer_arr, ss, first, count, num_runs, k_new, v_new, k_pages, v_pages)
    if rank4:
        return k_out[0], v_out[0]
    return k_out, v_out


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
    pairs_per_step: int = 16,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Block DMAs ``src_pages[..., src_ids[i], :, :] -> dst_pages[..., dst_ids[i], :, :]``.

    Between two device (HBM) arrays only: a host-memory side is not supported (see the
    module docstring). Meant to be called inside a ``jax.jit`` that donates ``dst_pages``.

    Args:
      src_pages, dst_pages: tuples of arrays ``[..., N_src|N_dst, S, D]`` with equal leading
        and trailing dims.
      src_ids, dst_ids: ``i32[P]``; pairs with a negative id are skipped.
      pairs_per_step: pairs per grid step.
      interpret: run in the TPU interpreter.
    """
    return _block_copy_call(
        tuple(src_pages),
        tuple(dst_pages),
        src_ids,
        dst_ids,
        pairs_per_step=pairs_per_step,
        interpret=interpret,
    )
