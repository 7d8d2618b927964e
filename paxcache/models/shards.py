"""Checkpoint tensors read slice by slice straight into device shards.

The loader (:mod:`paxcache.models.loading`) describes every parameter of the model by a
:class:`TensorSource` (which HF tensor, transposed or not, which rows of a fused one) and its
target ``jax.sharding.Sharding`` (:func:`paxcache.sharding.param_specs` on the abstract model;
one device when there is no mesh). :func:`place_param` then builds the ``jax.Array``:

* For every device this process can address (``sharding.addressable_devices_indices_map``:
  on a multi-host slice, only this host's devices), it reads exactly that device's block of
  the parameter from the memory-mapped safetensors file (``safe_open(...).get_slice(name)
  [rows, cols]``), applies the per-family transform to the block (the ``[out, in]`` ->
  ``[in, out]`` transpose, the row offset of a fused Phi-3 ``qkv_proj`` / ``gate_up_proj``,
  the dtype cast) and copies it to the device. Devices that hold the same block (a replicated
  parameter) share one read.
* A layer-stacked parameter ``[L, ...]`` (the decoder's ``lax.scan`` wants one array per
  weight) is built one layer at a time: the stacked array is allocated once on its devices and
  each layer's shards are written into it by a jitted, donated ``dynamic_update_index_in_dim``,
  so the host never holds more than one layer's block and a device never more than its shard
  of the stack plus one layer's shard of it.

Peak host memory is therefore about two copies of the largest block one device receives (the
slice as read, and its transposed / cast copy), whatever the model's size; peak device memory
is the device's shard of the model plus one layer's shard of one weight. The same code loads
onto one device (a single-device sharding), so there is one loading path.

Quantize-at-load: :func:`place_param`'s ``make_block`` replaces :func:`read_block` as the
producer of each host block; :mod:`paxcache.models.quantize` quantizes every block there
(values, and per-output-channel scales from the whole input axis) before it is copied to its
device, so a bf16 weight is never on a device.

Shape letters as in :mod:`paxcache.sharding`: L layers, the rest per parameter.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import compat

__all__ = [
    "EXPERT",
    "LAYER",
    "Block",
    "TensorSource",
    "layer_sharding",
    "place_param",
    "read_block",
]

LAYER = "{layer}"
"""The placeholder of the layer index in a :class:`TensorSource` name."""

EXPERT = "{expert}"
"""The placeholder of the expert index: the (per-layer) parameter's first axis enumerates
tensors stored one per expert (``...experts.{expert}.w1.weight``)."""

Block = tuple[tuple[int, int], ...]
"""A block of an array: ``(start, stop)`` per axis."""


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one parameter of ours lives in an HF checkpoint.

    Attributes:
      name: the HF tensor name; with ``{layer}`` (:data:`LAYER`) for a layer-stacked
        parameter ``[L, ...]``, whose layer ``i`` is the tensor named with ``i``; with
        ``{expert}`` (:data:`EXPERT`) as well when the next axis enumerates per-expert tensors.
      transpose: the HF tensor holds linear weights ``[..., out, in]``; ours are
        ``[..., in, out]`` (the last two axes swapped; 2-D, or 3-D fused experts).
      rows: ``(start, stop)`` of HF's ``out`` axis (axis -2 of a transposed source, else axis
        0) that this parameter is, for a fused tensor (Phi-3's ``qkv_proj``,
        ``gate_up_proj``); None for the whole tensor.
      layers: the checkpoint layer of each entry of a stack over some layers only (a
        mixture of experts' sparse / dense MLP layers); None: entry ``i`` is layer ``i``.
      interleave: ``(step, offset)``: entry ``j`` of our last axis is entry
        ``offset + step * j`` of HF's output axis (axis -2 of a transposed source, else the
        last): gpt-oss's fused ``gate_up_proj`` holds gate and up in alternate columns.
    """

    name: str
    transpose: bool = False
    rows: tuple[int, int] | None = None
    layers: tuple[int, ...] | None = None
    interleave: tuple[int, int] | None = None

    @property
    def stacked(self) -> bool:
        """Whether the parameter has a leading layer axis filled from one tensor per layer."""
        return LAYER in self.name

    @property
    def per_expert(self) -> bool:
        """Whether the (per-layer) parameter's first axis enumerates per-expert tensors."""
        return EXPERT in self.name

    def tensor(self, layer: int | None, expert: int | None = None) -> str:
        """The HF tensor name for stack entry ``layer`` (and ``expert``); None where it has
        none."""
        if self.stacked and self.layers is not None and layer is not None:
            layer = self.layers[layer]
        name = self.name.replace(LAYER, str(layer)) if self.stacked else self.name
        return name.replace(EXPERT, str(expert)) if self.per_expert else name

    def hf_block(self, block: Block) -> Block:
        """The block of the HF tensor that holds ``block`` of (one layer, one expert of) our
        parameter."""
        out = list(block)
        if self.transpose:
            if len(out) < 2:
                raise ValueError(f"{self.name}: a transposed source needs 2 axes, got {block}")
            out[-2], out[-1] = out[-1], out[-2]
        if self.rows is not None:
            axis = len(out) - 2 if self.transpose else 0
            start, stop = out[axis]
            out[axis] = (self.rows[0] + start, self.rows[0] + stop)
        if self.interleave is not None:  # the covering range; read_block takes every step-th
            step, offset = self.interleave
            axis = len(out) - 2 if self.transpose else len(out) - 1
            start, stop = out[axis]
            out[axis] = (offset + step * start, offset + step * (stop - 1) + 1)
        return tuple(out)

    def pick(self, arr: np.ndarray) -> np.ndarray:
        """The interleaved entries of a block read as :meth:`hf_block` says (else ``arr``)."""
        if self.interleave is None:
            return arr
        axis = arr.ndim - 2 if self.transpose else arr.ndim - 1
        index = [slice(None)] * arr.ndim
        index[axis] = slice(None, None, self.interleave[0])
        return arr[tuple(index)]


ReadSlice = Callable[[str, Block], np.ndarray]
"""``read(tensor_name, hf_block) -> the block as stored`` (the loader's reader)."""


def read_block(
    read: ReadSlice, source: TensorSource, layer: int | None, block: Block, dtype: Any
) -> np.ndarray:
    """One block of (one layer of) our parameter, as a C-contiguous ``dtype`` host array.

    Args:
      read: reads a block of an HF tensor from the checkpoint.
      source: where the parameter lives.
      layer: the layer of a stacked parameter (None otherwise).
      block: ``(start, stop)`` per axis of our (per-layer) parameter.
      dtype: the parameter's numpy dtype.

    Returns:
      The block, shape ``[stop - start per axis]``: read, transposed, cast. (Quantize-at-load
      calls this and quantizes the result: :func:`place_param`'s ``make_block``.)
    """
    if source.per_expert:  # one tensor per expert along our first axis
        (first, last), rest = block[0], block[1:]
        out = np.empty([b - a for a, b in block], dtype)
        for k, expert in enumerate(range(first, last)):
            arr = source.pick(read(source.tensor(layer, expert), source.hf_block(rest)))
            out[k] = np.swapaxes(arr, -1, -2) if source.transpose else arr
        return out
    arr = source.pick(read(source.tensor(layer), source.hf_block(block)))
    # Always one copy (transposed and cast as needed) that owns its memory: a device array
    # made from the read-only slice itself may keep it alive (JAX's CPU client aliases it).
    arr = np.swapaxes(arr, -1, -2) if source.transpose else arr
    return np.array(arr, dtype=dtype, order="C", copy=True)


def _block_of(index: tuple[slice, ...], shape: Sequence[int]) -> Block:
    out = []
    for sl, dim in zip(index, shape, strict=True):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise ValueError(f"strided shard index {index} for shape {tuple(shape)}")
        out.append((start, stop))
    return tuple(out)


def _from_blocks(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, make: Callable[[Block], np.ndarray]
) -> jax.Array:
    """The array of ``shape`` on ``sharding`` from host blocks, one read per distinct block
    among this process's devices, each block dropped once its devices have it."""
    by_block: dict[Block, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        by_block.setdefault(_block_of(index, shape), []).append(device)
    shards = {}
    for block, devices in by_block.items():
        host = make(block)
        want = tuple(stop - start for start, stop in block)
        if host.shape != want:
            raise ValueError(f"block {block} read as shape {host.shape}, expected {want}")
        placed = [jax.device_put(host, d, may_alias=False) for d in devices]
        jax.block_until_ready(placed)  # the host block is freed before the next is read
        shards.update(zip(devices, placed, strict=True))
        del host
    arrays = [shards[d] for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def layer_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The sharding of one layer ``[...]`` of a stacked ``[L, ...]`` array on ``sharding``.

    Raises:
      ValueError: the layer axis itself is split (layers are scanned, never sharded).
    """
    if compat.is_single_device_sharding(sharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if spec and spec[0] is not None:
            raise ValueError(f"the layer axis of a stacked parameter cannot be split: {spec}")
        return NamedSharding(sharding.mesh, P(*spec[1:]), memory_kind=sharding.memory_kind)
    raise ValueError(f"unsupported sharding for a stacked parameter: {sharding!r}")


@functools.lru_cache(maxsize=64)
def _zeros_fn(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding) -> Any:
    return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=64)
def _set_layer_fn(sharding: jax.sharding.Sharding) -> Any:
    def set_layer(stacked: jax.Array, layer: jax.Array, i: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_index_in_dim(stacked, layer, i, 0)

    return jax.jit(set_layer, donate_argnums=0, out_shardings=sharding)


def place_param(
    source: TensorSource,
    shape: tuple[int, ...],
    dtype: Any,
    sharding: jax.sharding.Sharding,
    read: ReadSlice,
    make_block: Callable[[int | None, Block], np.ndarray] | None = None,
) -> jax.Array:
    """Builds one parameter on ``sharding`` from the checkpoint, reading only the blocks of
    this process's devices.

    Args:
      source: where it lives in the checkpoint.
      shape: its full shape (``[L, ...]`` when ``source.stacked``).
      dtype: its dtype.
      sharding: its target sharding (a ``NamedSharding`` on the mesh, or one device).
      read: the checkpoint reader (``read(tensor_name, hf_block)``).
      make_block: ``make_block(layer, block) -> host block of dtype`` in place of
        :func:`read_block` (the quantize-at-load hook: :mod:`paxcache.models.quantize`
        quantizes each block as it is read); None: ``read_block``.

    Returns:
      The parameter, committed to ``sharding``; each device holds only its shard.
    """
    dtype = np.dtype(dtype)
    if make_block is None:

        def make_block(layer: int | None, block: Block) -> np.ndarray:
            return read_block(read, source, layer, block, dtype)

    if not source.stacked:
        return _from_blocks(shape, sharding, lambda b: make_block(None, b))
    num_layers, per_layer = shape[0], tuple(shape[1:])
    one_layer = layer_sharding(sharding)
    stacked = _zeros_fn(tuple(shape), dtype, sharding)()
    set_layer = _set_layer_fn(sharding)
    for i in range(num_layers):
        layer = _from_blocks(per_layer, one_layer, lambda b, i=i: make_block(i, b))
        stacked = set_layer(stacked, layer, np.int32(i))
        del layer
    return stacked
