"""KV movement on page arrays: write new tokens' K/V, copy blocks, swap blocks.

The array-level implementations behind the cache ops of :mod:`kernels_pallas.cache`
(``write_kv``, ``copy_blocks``, ``swap_blocks`` take a ``PagedKVCache`` and call these on its
pages), with semantics defined by the oracles in :mod:`kernels_pallas.reference`:

* :func:`write_pages`: scatter T tokens' K/V into their slots (``block * S + offset``); slots
  < 0 are padding and skipped.
* :func:`copy_pages`: copy whole blocks ``src[i] -> dst[i]``; pairs with a negative id are
  skipped, and with traced ids the copy sits under a ``lax.cond`` on "any pair", so a program
  (the engine's step) whose call has no pair does no work over the pages.
* :func:`swap_pages`: move blocks between two page arrays that may live in different memory
  kinds (device HBM and ``pinned_host``), in either direction.

Pages are one array ``kv_pages [L, N, S, C, P, Dp]`` in the layout of
:mod:`kernels_pallas.kv_layout` (token-major, K and V of each head side by side, layers
stacked; the block axis is axis 1). :func:`write_pages` takes ``layer=`` (Python int or traced
``i32`` scalar) and tokens already merged to ``[T, C, P, Dp]`` rows
(:func:`kernels_pallas.kv_layout.merge_kv`), and writes each token's row in place;
:func:`copy_pages` copies a block in every layer at once (what copy-on-write needs).

In place: every op is a pure function returning the new pages. Under ``jax.jit`` with the
pages donated (``donate_argnums``) the XLA path is an in-place scatter and the Pallas kernels
alias their pages input -> output (``input_output_aliases``), so writing a few tokens touches
only those rows; tests check the compiled program has no full-size copy. On CPU, block
copies run as in-place update-slice loops over the live pairs only; and XLA:CPU, which has no
native bf16, upcasts bf16 updates over the whole array, so keep CPU caches in float32.

``impl`` (decided in :mod:`kernels_pallas._dispatch`, shared with attention): ``"auto"``
follows the platform the program is lowered for (Mosaic TPU kernel on TPU, live or an AOT
topology target; XLA's in-place scatter on GPU and CPU), ``"reference"`` (the XLA path),
``"pallas"`` (the target's kernel; on CPU the TPU kernel, which needs ``interpret=True``),
``"pallas_tpu"`` (force the TPU kernels), ``"pallas_gpu"`` / ``"pallas_triton"`` (there are
no GPU KV kernels: the XLA path, recorded as such, as for swap_blocks).

Why no GPU kernels for write_kv / copy_blocks: on a GPU, XLA's scatter of donated pages is
already one in-place kernel with a thread per element, so a Mosaic GPU kernel moving the same
rows through SMEM with one TMA per token (or per block) cannot read or write fewer bytes and
issues far fewer memory operations in flight. ``write_kv`` moves ``T x 2K x D`` elements a
step (kilobytes to a few MB), next to an attention that reads the whole live KV; block copies
happen only on copy-on-write. ``scripts/gpu_check.py`` times both XLA ops on the device
against its copy bandwidth, which is what would justify a kernel if they ever fall short.

swap_blocks, on every platform (TPU included): one jitted program gathers the blocks on the
source side into one array, moves it with ONE transfer (a ``device_put`` to the destination
memory kind inside the jit), and scatters it on the destination side (host-side gather and
scatter run under ``compute_on("device_host")``); the destination is donated so the scatter
is in place. On TPU this is the only formulation the compiler takes (libtpu 0.0.42): a Mosaic
kernel DMA-ing between HBM and ``pinned_host`` aborts the process in XLA's HostOffloader
(swap out) or fails an LLO check (swap in), so that program is refused, never compiled. On
the CPU backend, where "device" and ``pinned_host`` are the same RAM and XLA elides
memory-kind moves, the program instead copies block to block in place (one pass over the
moved bytes instead of three); ``xla_moves=`` picks one of these forms explicitly
(:data:`XLA_MOVES`). The number of pairs is padded with -1 up to a power of two,
so swapping 3, 4, 5 ... blocks compiles once per bucket, not once per count;
:func:`swap_program` gives the program of a bucket (warm-up, AOT compilation).

Errors: argument problems raise ``ValueError`` naming the problem before anything is traced;
ids are range-checked (and destinations checked for duplicates) when they are host values
(numpy arrays, lists); device arrays are not pulled to the host for checking.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import _dispatch, compat, reference
from kernels_pallas._checks import IMPLS, check_layer, check_pages, is_int_dtype
from kernels_pallas.buckets import next_power_of_two

__all__ = [
    "IMPLS",
    "XLA_MOVES",
    "bucket_size",
    "copy_pages",
    "swap_pages",
    "swap_program",
    "write_pages",
]

logger = logging.getLogger(__name__)

_HOST_KINDS = ("pinned_host", "unpinned_host")

XLA_MOVES = ("auto", "direct", "loop", "scatter")
"""How the XLA path moves blocks (``xla_moves=`` of :func:`copy_blocks` and
:func:`swap_blocks`; the Pallas kernels ignore it):

* ``"loop"``: in-place update-slice loops over the live pairs only. XLA:CPU runs a block
  scatter about 10x slower than the equivalent dynamic-update-slices, and a loop whose trip
  count is the number of live pairs costs nothing for padding.
* ``"scatter"``: one gather and one scatter (on GPU/TPU one scatter beats P small kernels).
  Except a TPU device-side gather, always a loop: XLA:TPU relayouts the whole pool for it.
* ``"direct"`` (swaps only): block-to-block copies from the source pages into the
  destination, for the CPU backend where device and ``pinned_host`` memory are the same RAM
  (XLA elides the memory-kind move, so this is one pass over the moved bytes instead of
  three). Swaps otherwise gather on the source side, make one transfer and write the
  destination with ``"loop"`` or ``"scatter"``.
* ``"auto"``: by the platform the program is lowered for: CPU ``"loop"`` (swaps
  ``"direct"``), TPU copies ``"loop"``, elsewhere ``"scatter"``.

(XLA:CPU has no native bf16 either: it upcasts bf16 updates to f32 over the whole array, so
on CPU only f32 caches are updated in place; use float32 pages there.)
"""


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _dtype_of(x: Any) -> np.dtype:
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _host_value(x: Any) -> np.ndarray | None:
    """``x`` as numpy when it is a host value (numpy / list / tuple / int), else None."""
    if isinstance(x, (np.ndarray, list, tuple, int, np.integer)):
        return np.asarray(x)
    return None


def _check_ids(name: str, what: str, ids: Any, length: int | None) -> int:
    shape = np.shape(ids)
    if len(shape) != 1:
        raise ValueError(f"{name}: {what} must be a 1-D integer array, got shape {shape}")
    if not is_int_dtype(ids):
        raise ValueError(f"{name}: {what} must be integer, got dtype {_dtype_of(ids)}")
    if length is not None and shape[0] != length:
        raise ValueError(f"{name}: {what} has length {shape[0]}, expected {length}")
    return shape[0]


def _check_range(name: str, what: str, ids: Any, limit: int, limit_desc: str) -> None:
    host = _host_value(ids)
    if host is None or host.size == 0:
        return
    if int(host.max()) >= limit:
        raise ValueError(
            f"{name}: {what} contains {int(host.max())}, out of range for {limit_desc}={limit} "
            "(use a negative id to skip an entry)"
        )


def _check_distinct_dst(name: str, src: Any, dst: Any, *, dst_not_src: bool) -> None:
    hs, hd = _host_value(src), _host_value(dst)
    if hs is None or hd is None:
        return
    live = (hs >= 0) & (hd >= 0)
    d = hd[live]
    if np.unique(d).size != d.size:
        raise ValueError(f"{name}: destination ids must be distinct, got {d.tolist()}")
    if dst_not_src and np.intersect1d(d, hs[live]).size:
        raise ValueError(
            f"{name}: a destination is also a source ({np.intersect1d(d, hs[live]).tolist()}); "
            "in-place block copies need destinations disjoint from sources"
        )


# --------------------------------------------------------------------------------------------
# Dispatch (kernels_pallas._dispatch decides)
# --------------------------------------------------------------------------------------------


def _check_impl(name: str, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"{name}: impl must be one of {IMPLS}, got {impl!r}")


def _swap_family(impl: str) -> str:
    """``"xla"`` or ``"pallas_tpu"``: ``auto`` and ``reference`` always run the memory-kinds
    program (module doc); a forced ``impl`` follows :func:`kernels_pallas._dispatch.
    forced_family` (no GPU swap kernel: ``"pallas_gpu"``, and ``"pallas"`` on a GPU target,
    run XLA)."""
    return "xla" if impl in ("auto", "reference") else _dispatch.forced_family(impl, False)


def _kernels(family: str):
    return importlib.import_module(f"kernels_pallas.{family}.kv_ops")


# --------------------------------------------------------------------------------------------
# XLA building blocks
# --------------------------------------------------------------------------------------------


def _resolve_moves(name: str, xla_moves: str, *, swap: bool) -> str:
    """``xla_moves`` checked, with ``"auto"`` decided for the target platform (:data:`XLA_MOVES`).

    Raises:
      ValueError: an unknown value, or ``"direct"`` for a copy within one page array.
    """
    allowed = XLA_MOVES if swap else tuple(m for m in XLA_MOVES if m != "direct")
    if xla_moves not in allowed:
        raise ValueError(f"{name}: xla_moves must be one of {allowed}, got {xla_moves!r}")
    if xla_moves != "auto":
        return xla_moves
    platform = _dispatch.target_platform()
    if platform == "cpu":
        return "direct" if swap else "loop"
    # A TPU copy within the pool loops: XLA:TPU relayouts the whole pool for a block gather.
    return "loop" if platform == "tpu" and not swap else "scatter"


def _compact_pairs(
    src: jax.Array, dst: jax.Array, n_src: int, n_dst: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Live pairs first: ``(s u32[P], d u32[P], count i32[])``.

    A pair is live when both ids are in range. Dead entries get ``s = 0`` and ``d = n_dst``
    (out of range: dropped by a scatter, never reached by a loop over ``count``). Unsigned ids
    need no index-normalizing compares later, whose constants would live in device memory and
    break host-side (``compute_on``) gathers and scatters; so all the arithmetic is done here,
    on the device side.
    """
    src, dst = src.astype(jnp.int32), dst.astype(jnp.int32)
    ok = (src >= 0) & (dst >= 0) & (src < n_src) & (dst < n_dst)
    perm = jnp.argsort(~ok, stable=True)
    ok_p = ok[perm]
    s = jnp.where(ok_p, src[perm], 0).astype(jnp.uint32)
    d = jnp.where(ok_p, dst[perm], n_dst).astype(jnp.uint32)
    return s, d, jnp.sum(ok, dtype=jnp.int32)


BLOCK_AXIS = 1
"""The block axis of ``kv_pages [L, N, S, C, P, Dp]``."""


def _take_blocks(pages: jax.Array, s: jax.Array) -> jax.Array:
    """``pages[:, s]`` for in-range ``u32`` ids: ``[L, P, S, C, P, Dp]``."""
    return pages.at[:, s].get(mode="promise_in_bounds")


def _set_blocks(
    pages: jax.Array, blocks: jax.Array, d: jax.Array, count: jax.Array, loops: bool
) -> jax.Array:
    """``pages[:, d[i]] = blocks[:, i]`` for the ``count`` live pairs."""
    if not loops:
        return pages.at[:, d].set(blocks.astype(pages.dtype), mode="drop")
    axis = BLOCK_AXIS

    def body(i, x):
        new = jax.lax.dynamic_slice_in_dim(blocks, i, 1, axis=axis).astype(x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(x, new, d[i], axis=axis)

    return jax.lax.fori_loop(0, count, body, pages)


def _copy_loop(
    dst: jax.Array, src: jax.Array | None, s: jax.Array, d: jax.Array, count: jax.Array
) -> jax.Array:
    """Block-by-block update-slices ``src -> dst`` for ``count`` live pairs (no temporary).

    ``src=None`` copies within ``dst``, reading the loop carry itself: reading the original
    array instead would keep it alive next to the carry and force a full copy.
    """
    axis = BLOCK_AXIS

    def body(i, x):
        frm = x if src is None else src
        new = jax.lax.dynamic_slice_in_dim(frm, s[i], 1, axis=axis).astype(x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(x, new, d[i], axis=axis)

    return jax.lax.fori_loop(0, count, body, dst)


def _copy_xla(pages: jax.Array, src: jax.Array, dst: jax.Array, loops: bool) -> jax.Array:
    n = pages.shape[BLOCK_AXIS]
    s, d, count = _compact_pairs(src, dst, n, n)
    if not loops:
        return _set_blocks(pages, _take_blocks(pages, s), d, count, loops=False)
    # Reading the live pages is exact: destinations are never sources (documented contract).
    return _copy_loop(pages, None, s, d, count)


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------


def write_xla(pages: jax.Array, new: jax.Array, slots: jax.Array, layer: Any) -> jax.Array:
    """In-place-able scatter of ``new [T, C, P, Dp]`` rows into ``pages`` at flat slots."""
    _, n, s = pages.shape[:3]
    slots = jnp.where(slots < 0, n * s, slots)  # out of range -> block n: dropped
    layer = jnp.asarray(layer, jnp.int32)
    # (block, offset) indices, no reshape of the pages: XLA:CPU would relayout (copy) the
    # whole stacked cache around a reshape that merges N and S next to a size-1 P.
    return pages.at[layer, slots // s, slots % s].set(new.astype(pages.dtype), mode="drop")


def check_new_rows(name: str, kv_pages: jax.Array, kv_new: Any, slot_mapping: Any) -> int:
    """Checks of a write of ``kv_new [T, C, P, Dp]`` rows to ``slot_mapping`` (shape, dtype,
    and for host slot values their range and distinctness); returns ``T``.

    Raises:
      ValueError: naming the problem.
    """
    _, n, s, *row = kv_pages.shape
    if kv_new.ndim != 4 or tuple(kv_new.shape[1:]) != tuple(row):
        raise ValueError(
            f"{name}: kv_new must be [T, C, P, Dp] = [T, {', '.join(map(str, row))}], got "
            f"{kv_new.shape}"
        )
    if kv_new.dtype != kv_pages.dtype:
        raise ValueError(
            f"{name}: dtype mismatch: kv_new is {kv_new.dtype}, pages are {kv_pages.dtype}; "
            "cast the new K/V to the cache dtype first"
        )
    t = _check_ids(name, "slot_mapping", slot_mapping, kv_new.shape[0])
    _check_range(name, "slot_mapping", slot_mapping, n * s, "N * S")
    host = _host_value(slot_mapping)
    if host is not None:
        live = host[host >= 0]
        if np.unique(live).size != live.size:
            raise ValueError(f"{name}: slot_mapping has duplicate live slots")
    return t


def write_pages(
    kv_pages: jax.Array,
    kv_new: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    impl: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Scatter T new tokens' K/V rows into their slots of one layer.

    Args:
      kv_pages: ``[L, N, S, C, P, Dp]`` (:mod:`kernels_pallas.kv_layout`).
      kv_new: ``[T, C, P, Dp]`` the tokens' merged K/V rows
        (:func:`~kernels_pallas.kv_layout.merge_kv`), in the pages' dtype.
      slot_mapping: ``i32[T]``: ``block * S + offset``; negative = padding, skipped. Live
        slots must be distinct.
      layer: layer to write (Python int or traced ``i32`` scalar; optional when L = 1).
      impl: ``"auto" | "reference" | "pallas" | "pallas_tpu" | "pallas_gpu"``.
      interpret: run the Pallas kernel in interpret mode (CPU tests).

    Returns:
      The updated ``kv_pages`` (in place when donated under jit).

    Raises:
      ValueError: bad ranks, shapes, dtypes, layer, impl, or (host values) out-of-range or
        duplicate slots.
    """
    name = "write_kv"
    check_pages(name, kv_pages)
    check_layer(name, kv_pages, layer)
    t = check_new_rows(name, kv_pages, kv_new, slot_mapping)
    _check_impl(name, impl)
    if t == 0:
        return kv_pages
    from kernels_pallas.tpu.kv_ops import write_kv_unsupported_reason

    s = kv_pages.shape[2]
    layer_arr = jnp.asarray(0 if layer is None else layer, jnp.int32)  # one-layer pages
    args = (kv_pages, kv_new, jnp.asarray(slot_mapping, jnp.int32), layer_arr)

    def xla(pages, new, slots, lyr):
        return write_xla(pages, new, slots, lyr)

    def tpu(pages, new, slots, lyr):
        return _kernels("tpu").write_kv_tpu(pages, new, slots, lyr, interpret=interpret)

    return _dispatch.run(
        name,
        impl,
        interpret,
        args,
        xla=xla,
        tpu=tpu,
        gpu=None,  # no Mosaic GPU KV kernels (module doc)
        tpu_reason=write_kv_unsupported_reason(s, kv_pages.dtype),
        donate=(0,),
    )


# --------------------------------------------------------------------------------------------
# copy_blocks
# --------------------------------------------------------------------------------------------


def copy_pages(
    kv_pages: jax.Array,
    src: jax.Array,
    dst: jax.Array,
    *,
    impl: str = "auto",
    interpret: bool = False,
    xla_moves: str = "auto",
) -> jax.Array:
    """Copy whole blocks ``src[i] -> dst[i]`` in every layer.

    Args:
      kv_pages: ``[L, N, S, C, P, Dp]``.
      src, dst: ``i32[P]`` block ids; a pair with a negative id is skipped. Destinations must
        be distinct and must not also be sources (copy-on-write targets fresh blocks); all
        reads see the pages as they were before the call.
      impl, interpret: as in :func:`write_pages`.
      xla_moves: ``"auto" | "loop" | "scatter"``: how the XLA path copies (:data:`XLA_MOVES`).

    Returns:
      The updated ``kv_pages``.

    Raises:
      ValueError: bad ranks/shapes/dtypes, mismatched id lengths, (host values) ids out of
        range, duplicate destinations, a destination that is also a source, or a bad
        ``impl`` / ``xla_moves``.
    """
    name = "copy_blocks"
    check_pages(name, kv_pages)
    p = _check_ids(name, "src", src, None)
    _check_ids(name, "dst", dst, p)
    n = kv_pages.shape[BLOCK_AXIS]
    _check_range(name, "src", src, n, "num_blocks N")
    _check_range(name, "dst", dst, n, "num_blocks N")
    _check_distinct_dst(name, src, dst, dst_not_src=True)
    _check_impl(name, impl)
    loops = _resolve_moves(name, xla_moves, swap=False) == "loop"
    host_src, host_dst = _host_value(src), _host_value(dst)
    known = host_src is not None and host_dst is not None
    if p == 0 or (known and not np.any((host_src >= 0) & (host_dst >= 0))):
        return kv_pages
    args = (kv_pages, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))

    def xla(pages, s_, d_):
        return _copy_xla(pages, s_, d_, loops)

    def tpu(pages, s_, d_):
        return _kernels("tpu").copy_blocks_tpu(pages, s_, d_, interpret=interpret)

    def copy(*operands):
        return _dispatch.run(
            name,
            impl,
            interpret,
            operands,
            xla=xla,
            tpu=tpu,
            gpu=None,  # no Mosaic GPU KV kernels (module doc)
            donate=(0,),
        )

    if known:
        return copy(*args)
    # Traced ids (the step's copy-on-write pairs): the copy runs under a data-dependent cond,
    # so a step without a pair does no work over the pages (the kept branch aliases them).
    any_pair = jnp.any((args[1] >= 0) & (args[2] >= 0))
    return jax.lax.cond(any_pair, copy, lambda pages, *_: pages, *args)


# --------------------------------------------------------------------------------------------
# swap_blocks
# --------------------------------------------------------------------------------------------


def bucket_size(p: int) -> int:
    """Padded pair count for ``p`` pairs: the next power of two (at least 1)."""
    return next_power_of_two(p)


def _memory_kind(x: Any) -> str | None:
    """Memory kind of a concrete array or a ``ShapeDtypeStruct`` (None for tracers / numpy)."""
    if isinstance(x, jax.core.Tracer):
        return None
    if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return None
    return getattr(getattr(x, "sharding", None), "memory_kind", None)


def _pad_ids(ids: Any, size: int) -> jax.Array:
    host = _host_value(ids)
    if host is not None:
        out = np.full((size,), -1, np.int32)
        out[: host.shape[0]] = host
        return jnp.asarray(out)
    ids = jnp.asarray(ids, jnp.int32)
    return jnp.pad(ids, (0, size - ids.shape[0]), constant_values=-1)


def _gather(srcs: tuple[jax.Array, ...], s: jax.Array, loops: bool) -> jax.Array:
    """All sources' blocks stacked into one array ``[A, L, P, S, C, P, Dp]`` (one transfer).

    ``loops``: one dynamic slice per pair into the stacked buffer. An XLA gather over the
    block axis makes XLA:TPU relayout the whole source pool first (a pool-sized temporary).
    """
    if not loops:
        return jnp.stack([_take_blocks(x, s) for x in srcs])
    num = s.shape[0]
    blocks = jnp.zeros((len(srcs), srcs[0].shape[0], num, *srcs[0].shape[2:]), srcs[0].dtype)

    def body(i, out):
        for a, x in enumerate(srcs):
            block = jax.lax.dynamic_slice_in_dim(x, s[i], 1, axis=BLOCK_AXIS)
            out = jax.lax.dynamic_update_slice(out, block[None], (a, 0, i, 0, 0, 0, 0))
        return out

    return jax.lax.fori_loop(0, num, body, blocks)


def _scatter(dsts: tuple, blocks: jax.Array, d: jax.Array, count: jax.Array, loops: bool):
    return tuple(_set_blocks(x, blocks[i], d, count, loops) for i, x in enumerate(dsts))


def _copy_between(dsts: tuple, srcs: tuple, s: jax.Array, d: jax.Array, count: jax.Array):
    return tuple(_copy_loop(x, y, s, d, count) for x, y in zip(dsts, srcs, strict=True))


@functools.lru_cache(maxsize=64)
def _swap_program(
    src_host: bool,
    dst_host: bool,
    dst_shardings: tuple,
    use_tpu: bool,
    donate: bool,
    direct: bool = False,
    loops: bool = False,
    gather_loops: bool = False,
):
    """One jitted program moving blocks between memory kinds (see :func:`swap_blocks`).

    ``use_tpu``: the Pallas DMA kernel (device arrays on both sides only). ``direct``:
    block-to-block copies after a whole-pool memory-kind move, only for the CPU backend,
    where device and host memory are the same RAM and XLA elides that move. Otherwise:
    gather on the source side (``gather_loops``: a slice loop), one transfer of the gathered
    blocks, scatter (``loops``: update-slice loop) on the destination side.
    """
    host = jax.memory.Space.Host

    def on_dst(fn, *args):
        if not dst_host:
            return fn(*args)
        return compat.compute_on_host(fn)(*args)

    def program(srcs, dsts, src_ids, dst_ids):
        if use_tpu:
            from kernels_pallas.tpu.kv_ops import swap_blocks_tpu

            return swap_blocks_tpu(srcs, dsts, src_ids, dst_ids)
        n_src, n_dst = srcs[0].shape[BLOCK_AXIS], dsts[0].shape[BLOCK_AXIS]
        s, d, count = _compact_pairs(src_ids, dst_ids, n_src, n_dst)
        if direct:
            if src_host != dst_host:
                srcs = jax.device_put(srcs, host if dst_host else jax.memory.Space.Device)
            if dst_host:
                s, d, count = jax.device_put((s, d, count), host)
            return on_dst(_copy_between, dsts, srcs, s, d, count)
        if src_host:
            # Typing the pool as host memory inside the program is what lets XLA:TPU run the
            # gather on the host ("memory_space of all inputs passed to gather must be the
            # same" otherwise); it moves nothing.
            srcs = jax.device_put(srcs, host)
            blocks = compat.compute_on_host(functools.partial(_gather, loops=gather_loops))(
                srcs, jax.device_put(s, host)
            )
        else:
            blocks = _gather(srcs, s, gather_loops)
        # The move goes flat ([A, L, P, S*C*W*D]): XLA:TPU (libtpu 0.0.42) miscompiles the
        # host side of a move of the tiled 7-D blocks ("Bitcast cannot have different shape
        # sizes" in swap_out).
        shape = blocks.shape
        blocks = blocks.reshape(*shape[:5], -1)
        blocks = jax.device_put(blocks, host if dst_host else jax.memory.Space.Device)  # 1 move
        if dst_host:
            d, count = jax.device_put((d, count), host)

        def scatter(dsts, flat, d, count):
            return _scatter(dsts, flat.reshape(shape), d, count, loops)

        return on_dst(scatter, dsts, blocks, d, count)

    return jax.jit(program, donate_argnums=(1,) if donate else (), out_shardings=dst_shardings)


@functools.lru_cache(maxsize=2)
def _tpu_interpret_swap(donate: bool):
    from kernels_pallas.tpu.kv_ops import swap_blocks_tpu

    return jax.jit(
        functools.partial(swap_blocks_tpu, interpret=True),
        donate_argnums=(1,) if donate else (),
    )


def swap_program(
    src_pages: Any | Sequence[Any],
    dst_pages: Any | Sequence[Any],
    num_pairs: int,
    *,
    impl: str = "auto",
    interpret: bool = False,
    donate: bool = True,
    xla_moves: str = "auto",
) -> tuple[Any, int]:
    """The jitted program :func:`swap_blocks` runs for these pages and pair count.

    For warm-up (run it once with ids all ``-1``: it moves nothing) and ahead-of-time
    compilation (``fn.trace(...).lower().compile()`` on ``ShapeDtypeStruct`` pages whose
    shardings carry the memory kinds).

    Args:
      src_pages, dst_pages: arrays or ``ShapeDtypeStruct``s (or tuples of them), as for
        :func:`swap_blocks`.
      num_pairs: pairs to move (padded to :func:`bucket_size`).
      impl, interpret, donate, xla_moves: as in :func:`swap_blocks`.

    Returns:
      ``(fn, padded_pairs)``; call ``fn(srcs, dsts, src_ids, dst_ids)`` with tuples of pages
      and ``i32[padded_pairs]`` ids.

    Raises:
      ValueError: a Pallas TPU swap between a device and host memory (the compiler aborts
        the process on that program, see below) or on a non-TPU target without interpret.
    """
    name = "swap_blocks"
    _check_impl(name, impl)
    moves = _resolve_moves(name, xla_moves, swap=True)
    srcs = tuple(src_pages) if isinstance(src_pages, (tuple, list)) else (src_pages,)
    dsts = tuple(dst_pages) if isinstance(dst_pages, (tuple, list)) else (dst_pages,)
    size = bucket_size(num_pairs)
    src_host = _memory_kind(srcs[0]) in _HOST_KINDS
    dst_host = _memory_kind(dsts[0]) in _HOST_KINDS
    shardings = tuple(x.sharding for x in dsts)
    if _swap_family(impl) == "pallas_tpu":
        if src_host or dst_host:
            # libtpu 0.0.42: HBM <-> host DMAs in a Mosaic kernel either abort the process in
            # XLA's HostOffloader (swap out) or fail an LLO check (swap in).
            raise ValueError(
                f"{name}: the Mosaic TPU swap kernel cannot address host memory (the TPU "
                "compiler aborts the process on that program); use impl='auto'"
            )
        _dispatch.run_forced_check(name, "pallas_tpu", interpret)
        _dispatch.record(name, "pallas_tpu")
        if interpret:
            return _tpu_interpret_swap(donate), size
        return _swap_program(False, False, shardings, True, donate), size
    _dispatch.record(name, "xla")
    direct, loops = moves == "direct", moves != "scatter"  # direct copies are loops too
    # XLA:TPU relayouts the whole device pool for a gather over the block axis (a pool-sized
    # temporary: a Llama-3-8B swap-out ran out of HBM); a loop of slices reads only the blocks.
    # (Host-side gathers stay gathers: a loop's buffer would be device memory there.)
    gather_loops = not src_host and (loops or _dispatch.target_platform() == "tpu")
    program = _swap_program(
        src_host, dst_host, shardings, False, donate, direct, loops, gather_loops
    )
    return program, size


def swap_pages(
    src_pages: jax.Array | Sequence[jax.Array],
    dst_pages: jax.Array | Sequence[jax.Array],
    src_ids: Any,
    dst_ids: Any,
    *,
    impl: str = "auto",
    interpret: bool = False,
    donate: bool = True,
    xla_moves: str = "auto",
) -> jax.Array | tuple[jax.Array, ...]:
    """Copy blocks ``src_pages[:, src_ids[i]] -> dst_pages[:, dst_ids[i]]``.

    The two sides may live in different memory kinds (device and ``pinned_host``); the result
    keeps ``dst_pages``' sharding and memory kind. A tuple of page arrays moves all of them in
    one program and one transfer.

    Called on concrete arrays (outside jit) it runs one cached jitted program per
    (shapes, memory kinds, pair bucket) with ``dst_pages`` donated (so the destination is
    updated in place and the passed ``dst_pages`` are consumed; pass ``donate=False`` to keep
    them). Under a trace it is the pure reference math (memory placement is then the caller's
    jit's business). :func:`swap_program` returns that program (warm-up, AOT compilation).

    Args:
      src_pages: ``[L, N_src, S, C, P, Dp]`` or a tuple of such arrays.
      dst_pages: ``[L, N_dst, S, C, P, Dp]`` (same dims but N, same dtype) or a tuple.
      src_ids, dst_ids: ``i32[P]``; a pair with a negative id is skipped. Destinations must
        be distinct.
      impl: ``"auto"`` and ``"reference"``: the memory-kinds program (gather, one transfer,
        scatter) on every platform, TPU included: a Mosaic kernel cannot DMA between HBM and
        host memory with this libtpu (the compiler aborts the process on it).
        ``"pallas_tpu"`` (and ``"pallas"`` off a GPU target): the TPU DMA kernel, between
        two *device* arrays only, on a TPU target or with ``interpret=True``.
        ``"pallas_gpu"`` (and ``"pallas"`` on a GPU target): no GPU swap kernel: as
        ``"auto"``.
      interpret: run the TPU kernel in interpret mode.
      donate: donate ``dst_pages`` (in-place update).
      xla_moves: ``"auto" | "direct" | "loop" | "scatter"``: the memory-kinds program's form
        (:data:`XLA_MOVES`).

    Returns:
      The updated destination pages (an array, or a tuple when tuples were given).

    Raises:
      ValueError: mismatched shapes/dtypes/structure, ids of different lengths, (host
        values) ids out of range or duplicate destinations, a Pallas swap touching host
        memory.
    """
    name = "swap_blocks"
    single = not isinstance(src_pages, (tuple, list))
    srcs = (src_pages,) if single else tuple(src_pages)
    dsts = (dst_pages,) if not isinstance(dst_pages, (tuple, list)) else tuple(dst_pages)
    if len(srcs) != len(dsts) or not srcs:
        raise ValueError(
            f"{name}: src_pages and dst_pages must be arrays or tuples of the same length, got "
            f"{len(srcs)} and {len(dsts)}"
        )
    for a, b in zip(srcs, dsts, strict=True):
        if a.ndim != 6 or a.ndim != b.ndim:
            raise ValueError(
                f"{name}: pages must be [L, N, S, C, P, Dp], got {a.shape} and {b.shape}"
            )
        if a.shape[:1] != b.shape[:1] or a.shape[2:] != b.shape[2:]:
            raise ValueError(
                f"{name}: src and dst pages differ outside the block axis: {a.shape} vs {b.shape}"
            )
        if a.dtype != b.dtype:
            raise ValueError(f"{name}: dtype mismatch: src {a.dtype} vs dst {b.dtype}")
        if a.shape != srcs[0].shape or b.shape != dsts[0].shape:
            raise ValueError(f"{name}: all page arrays on one side must have the same shape")
    p = _check_ids(name, "src_ids", src_ids, None)
    _check_ids(name, "dst_ids", dst_ids, p)
    _check_range(name, "src_ids", src_ids, srcs[0].shape[BLOCK_AXIS], "source blocks")
    _check_range(name, "dst_ids", dst_ids, dsts[0].shape[BLOCK_AXIS], "destination blocks")
    _check_distinct_dst(name, src_ids, dst_ids, dst_not_src=False)
    _check_impl(name, impl)
    _resolve_moves(name, xla_moves, swap=True)

    def ret(out: tuple) -> Any:
        return out[0] if single else tuple(out)

    if p == 0:
        return ret(dsts)
    traced = any(isinstance(x, jax.core.Tracer) for x in (*srcs, *dsts))
    if traced:
        s_ids = jnp.asarray(src_ids, jnp.int32)
        d_ids = jnp.asarray(dst_ids, jnp.int32)
        if _swap_family(impl) == "pallas_tpu":
            from kernels_pallas.tpu.kv_ops import swap_blocks_tpu

            _dispatch.run_forced_check(name, "pallas_tpu", interpret)
            return ret(swap_blocks_tpu(srcs, dsts, s_ids, d_ids, interpret=interpret))
        return ret(
            tuple(
                reference.swap_blocks_reference(a, b, s_ids, d_ids)
                for a, b in zip(srcs, dsts, strict=True)
            )
        )
    fn, size = swap_program(
        srcs, dsts, p, impl=impl, interpret=interpret, donate=donate, xla_moves=xla_moves
    )
    s_ids, d_ids = _pad_ids(src_ids, size), _pad_ids(dst_ids, size)
    return ret(fn(srcs, dsts, s_ids, d_ids))
