"""The paged KV cache: one opaque value in the kernels' layout, its sizes and its 8-bit scales.

Every op of :mod:`kernels_pallas` takes and returns a :class:`PagedKVCache`; nothing outside
this package indexes its arrays. Callers create it with :func:`init_kv_cache`, write it with
``write_kv`` (or the fused ``ragged_paged_attention(..., new_kv=...)``), read it with
``read_kv`` and the attention ops, and move blocks with ``copy_blocks`` / ``swap_blocks``.
Sizes derive from here too: :func:`kv_cache_bytes_per_block` (sizing), :func:`kv_cache_specs`
(the partition specs that split it over kv heads), :func:`kv_cache_vmem_bytes` (what the TPU
attention kernels' KV buffers take in VMEM).

Layout (private to this package; a slot is ``block * S + offset``): one array
``kv [L, N, S, C, P, Dp]``, token-major pages with K and V of every kv head of a token side by
side, packed ``P`` heads to a 32-bit word (:mod:`kernels_pallas.kv_layout` defines it: one
page of a layer is one contiguous DMA, one token's K/V one aligned row group; tpu-inference's
RPA v3 keeps the same per-layer layout). ``Dp`` is the head dim ``D`` except on TPU, where a
``D`` that is not a multiple of 128 is stored padded to one (zero lanes;
:func:`stored_head_dim`), as tpu-inference's RPA v3 stores it: XLA:TPU gives a
``[..., S, 64]`` array a transposed layout
(no lane padding) that the Mosaic kernels cannot take, and then copies the whole cache into
theirs and back around the kernels every step (2x the cache in temporaries, and the whole
cache moved twice a step; gpt-oss-20b on v6e:2x2). Stored lane-dense, the cache costs what
that copy's padding would, once, and nothing per step. The ops take and return ``D``: they
pad queries and new K/V and slice outputs, so callers never see ``Dp``.

Stacking the layers lets a model run them under ``lax.scan`` with the
cache in the carry (layer ``i`` is written and read in place through ``layer=``), lets the
engine donate one buffer instead of ``2L``, and moves a block in every layer with one
gather/scatter or DMA.

8-bit caches (``int8``, ``float8_e4m3fn``) hold ``round(x / scale)`` (int8, clipped to
[-127, 127]) or ``x / scale`` saturated to the e4m3 range (fp8), with per-layer scales
``k_scale, v_scale: f32[L]``; reads dequantize to ``x_q * scale`` in float32. For
``float32`` / ``bfloat16`` / ``float16`` caches the scales are stored as 1.0 and unused.

Shape letters: L layers, N blocks, S block size, K kv heads, D head dim, Dp stored head dim,
C packed rows per token (``ceil(2K / P)``), P heads per 32-bit word (4 bytes / itemsize).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, make_single_device_sharding

from kernels_pallas import kv_layout

__all__ = [
    "KV_CACHE_DTYPES",
    "PagedKVCache",
    "dequantize",
    "init_kv_cache",
    "is_quantized_dtype",
    "kv_cache_bytes_per_block",
    "kv_cache_shape",
    "kv_cache_specs",
    "kv_cache_vmem_bytes",
    "quantize",
    "set_kv_scales",
    "stored_head_dim",
]

#: The cache dtypes every op takes.
KV_CACHE_DTYPES = (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float16),
    jnp.dtype(jnp.int8),
    jnp.dtype(jnp.float8_e4m3fn),
)
_QUANTIZED = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
_INT8_MAX = 127.0
_FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
_HOST_KINDS = ("pinned_host", "unpinned_host")


def is_quantized_dtype(dtype: Any) -> bool:
    """Whether a cache of ``dtype`` stores scaled 8-bit values."""
    return jnp.dtype(dtype) in _QUANTIZED


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Paged K/V of every layer (opaque: use the ops of :mod:`kernels_pallas`).

    Attributes:
      kv: ``[L, N, S, C, P, Dp]`` pages, cache dtype (:mod:`kernels_pallas.kv_layout`).
      k_scale: ``f32[L]`` per-layer key scale (8-bit dtypes; 1.0 otherwise).
      v_scale: ``f32[L]`` per-layer value scale.
      lane_padded_from: static; ``D`` when the pages store it padded to ``Dp`` lanes
        (:func:`stored_head_dim`), None when ``Dp == D``.
      kv_head_pad: static; dummy kv heads filling the last packed row (1 for an 8-bit cache
        with an odd ``K``, else 0; :func:`kernels_pallas.kv_layout.kv_head_pad`).
    """

    kv: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
    lane_padded_from: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    kv_head_pad: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return kv_layout.num_kv_heads_of(self.kv, self.kv_head_pad)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[1]

    @property
    def block_size(self) -> int:
        return self.kv.shape[2]

    @property
    def head_dim(self) -> int:
        """D, the head dim the ops take and return."""
        return self.lane_padded_from or self.kv.shape[5]

    @property
    def stored_head_dim(self) -> int:
        """Dp, the lanes a page row stores (D, or D padded to a multiple of 128 on TPU)."""
        return self.kv.shape[5]

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.kv.dtype)

    @property
    def quantized(self) -> bool:
        """Whether the pages hold scaled 8-bit values."""
        return is_quantized_dtype(self.dtype)

    @property
    def memory_kind(self) -> str | None:
        """The pages' memory kind (``"device"``, ``"pinned_host"``; None when unknown)."""
        return getattr(getattr(self.kv, "sharding", None), "memory_kind", None)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages (K and V, all layers)."""
        return math.prod(self.kv.shape) * self.dtype.itemsize

    def replace(self, **changes: Any) -> PagedKVCache:
        return dataclasses.replace(self, **changes)


def _check_dims(name: str, **dims: Any) -> None:
    for what, val in dims.items():
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name}: {what} must be a positive int, got {val!r}")


def _check_dtype(name: str, dtype: Any) -> jnp.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"{name}: unknown dtype {dtype!r}") from None
    if dt not in KV_CACHE_DTYPES:
        raise ValueError(
            f"{name}: dtype must be one of {[str(d) for d in KV_CACHE_DTYPES]}, got {dt}"
        )
    return dt


def _scale_array(name: str, what: str, value: Any, num_layers: int) -> jax.Array:
    """A scalar or ``f32[L]`` scale as ``f32[L]``; concrete values must be finite and > 0."""
    shape = np.shape(value)
    if shape not in ((), (num_layers,)):
        raise ValueError(
            f"{name}: {what} must be a scalar or f32[{num_layers}] (one per layer), got shape "
            f"{shape}"
        )
    if not isinstance(value, jax.core.Tracer):
        host = np.asarray(value, np.float64)
        if not np.all(np.isfinite(host)) or not np.all(host > 0):
            raise ValueError(f"{name}: {what} must be finite and positive, got {host.tolist()}")
    return jnp.broadcast_to(jnp.asarray(value, jnp.float32), (num_layers,))


def stored_head_dim(head_dim: int, platform: str | None = None) -> int:
    """Dp, the lanes a page row stores for ``head_dim`` on ``platform`` (``"tpu"``,
    ``"cuda"``, ``"cpu"``, ...; default: the platform programs traced now are meant for):
    ``head_dim`` rounded up to a multiple of 128 on TPU (see the module docstring), else
    ``head_dim``."""
    if platform is None:
        from kernels_pallas._dispatch import target_platform

        platform = target_platform()
    if platform == "tpu":
        return -(-head_dim // 128) * 128
    return head_dim


def _platform_of(sharding: Sharding) -> str:
    return next(iter(sharding.device_set)).platform


def kv_cache_shape(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.bfloat16,
    *,
    platform: str | None = None,
) -> PagedKVCache:
    """The cache's abstract value: a :class:`PagedKVCache` of ``jax.ShapeDtypeStruct``s.

    For ahead-of-time compilation and sizing (``jax.eval_shape`` of :func:`init_kv_cache`).
    ``platform``: where it will live (:func:`stored_head_dim`; default: the platform
    programs traced now are meant for, e.g. inside ``aot.tpu_target``).
    """
    name = "kv_cache_shape"
    _check_dims(
        name,
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    dt = _check_dtype(name, dtype)
    dp = stored_head_dim(head_dim, platform)
    shape = kv_layout.page_shape(num_layers, num_blocks, block_size, num_kv_heads, dp, dt)
    scale = jax.ShapeDtypeStruct((num_layers,), jnp.float32)
    return PagedKVCache(
        kv=jax.ShapeDtypeStruct(shape, dt),
        k_scale=scale,
        v_scale=scale,
        lane_padded_from=head_dim if dp != head_dim else None,
        kv_head_pad=kv_layout.kv_head_pad(num_kv_heads, dt),
    )


def kv_cache_specs(
    head_axis: str | None = None, *, like: PagedKVCache | None = None
) -> PagedKVCache:
    """Partition specs of a cache split over kv heads on mesh axis ``head_axis``.

    A :class:`PagedKVCache` of ``PartitionSpec``s (pages split on their packed-row axis
    ``C``, which holds whole kv heads per device when each device's ``2K / devices`` combined
    heads fill whole words: :func:`init_kv_cache` checks; scales replicated), usable as
    ``shard_map`` in/out specs or to build ``NamedSharding``s; pass the cache (or its
    :func:`kv_cache_shape`) as ``like`` where the specs must have its tree structure (its
    static fields).
    """
    pages = PartitionSpec(None, None, None, head_axis) if head_axis else PartitionSpec()
    return PagedKVCache(
        kv=pages,
        k_scale=PartitionSpec(),
        v_scale=PartitionSpec(),
        lane_padded_from=None if like is None else like.lane_padded_from,
        kv_head_pad=0 if like is None else like.kv_head_pad,
    )


def kv_cache_bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
    *,
    platform: str | None = None,
) -> int:
    """Bytes of one block, K and V of every layer: ``L * S * C * P * Dp * itemsize``, i.e.
    ``2 * L * K * S * Dp * itemsize`` plus an 8-bit odd ``K``'s dummy head (``Dp``:
    :func:`stored_head_dim` on ``platform``, default the one programs traced now are meant
    for)."""
    dp = stored_head_dim(head_dim, platform)
    _, _, s, c, p, _ = kv_layout.page_shape(num_layers, 1, block_size, num_kv_heads, dp, dtype)
    return num_layers * s * c * p * dp * jnp.dtype(dtype).itemsize


def kv_cache_vmem_bytes(
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
    *,
    max_blocks_per_seq: int,
    device_kind: str | None = None,
) -> int:
    """VMEM the TPU attention kernels' KV double buffers take for this cache geometry on the
    chip of ``device_kind`` (None: one with no block sizes of its own): the larger kernel's
    (:func:`kernels_pallas.tpu.routing.kv_pages_per_step`; bfloat16 queries on 8-bit pages)."""
    from kernels_pallas.tpu.routing import kv_pages_per_step

    itemsize = jnp.dtype(dtype).itemsize
    head_dim = stored_head_dim(head_dim, "tpu")
    q_itemsize = 2 if is_quantized_dtype(dtype) else itemsize
    pages = kv_pages_per_step(
        block_size, max_blocks_per_seq, kv_heads=num_kv_heads, head_dim=head_dim,
        q_itemsize=q_itemsize, kv_itemsize=itemsize, device_kind=device_kind,
    )  # fmt: skip
    rows = kv_layout.combined_rows(num_kv_heads, dtype) * kv_layout.kv_packing(dtype)
    return 2 * pages * block_size * rows * head_dim * itemsize  # two buffers of P pages


def _scale_sharding(sharding: Sharding) -> Sharding:
    """Replicated placement for the scales, on the pages' devices and memory kind."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    device = next(iter(sharding.device_set))
    return make_single_device_sharding(device, memory_kind=sharding.memory_kind)


def init_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.bfloat16,
    *,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    fill_value: float = 0.0,
    sharding: Sharding | None = None,
    platform: str | None = None,
) -> PagedKVCache:
    """Allocate a cache of ``num_blocks`` blocks for every layer.

    Args:
      num_layers, num_blocks, block_size, num_kv_heads, head_dim: L, N, S, K, D.
      dtype: ``float32``, ``bfloat16``, ``float16``, ``int8`` or ``float8_e4m3fn``.
      k_scale, v_scale: 8-bit dtypes' dequantization scales, a scalar or ``f32[L]`` (finite,
        positive); replace them later with :func:`set_kv_scales`. Must be 1.0 for the other
        dtypes.
      fill_value: initial value of every page slot (in real units: quantized like a write);
        tests use NaN to prove nothing unwritten is read (int8 has no NaN: use e.g. 127).
      sharding: placement of the pages (rank-6 sharding, e.g. a ``NamedSharding`` with
        :func:`kv_cache_specs` pages spec, possibly with a host memory kind for a swap pool;
        a host pool is built from host memory, never staged through the device). Split over
        kv heads, each device must get whole heads in whole 32-bit words (an 8-bit cache
        needs an even number of kv heads per device). Default: the first device.
      platform: whose page layout to use (:func:`stored_head_dim`); default the sharding's
        devices' platform (tests pass ``"tpu"`` to run a TPU layout on the CPU).

    Returns:
      The cache.

    Raises:
      ValueError: a non-positive dimension, an unknown dtype, a bad scale, a NaN fill for an
        int8 cache, more slots than int32 addresses, or a head split the layout cannot take.
    """
    name = "init_kv_cache"
    _check_dims(
        name,
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    dt = _check_dtype(name, dtype)
    if num_blocks * block_size >= 2**31:
        raise ValueError(f"{name}: num_blocks * block_size must fit in int32")
    ks = _scale_array(name, "k_scale", k_scale, num_layers)
    vs = _scale_array(name, "v_scale", v_scale, num_layers)
    if not is_quantized_dtype(dt):
        for what, val in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(val, jax.core.Tracer) and not np.all(np.asarray(val) == 1.0):
                raise ValueError(f"{name}: {what} applies to 8-bit caches only ({dt} has none)")
    if dt == jnp.int8 and not math.isfinite(float(fill_value)):
        raise ValueError(f"{name}: an int8 cache cannot hold fill_value={fill_value}")
    if sharding is None:
        sharding = make_single_device_sharding(jax.devices()[0])
    dp = stored_head_dim(head_dim, platform or _platform_of(sharding))
    shape = kv_layout.page_shape(num_layers, num_blocks, block_size, num_kv_heads, dp, dt)
    pad = kv_layout.kv_head_pad(num_kv_heads, dt)
    _check_head_split(name, sharding, shape, num_kv_heads, pad)
    fill = _fill_pattern(_fill_bits(fill_value, dt, ks, vs), shape, num_kv_heads, dt)
    if sharding.memory_kind in _HOST_KINDS:
        # Built from numpy on the host: a swap pool never has to fit in device memory.
        kv = jax.device_put(np.ascontiguousarray(np.broadcast_to(fill, shape)), sharding)
    else:
        kv = jax.jit(lambda: jnp.broadcast_to(jnp.asarray(fill), shape), out_shardings=sharding)()
    scale_sharding = _scale_sharding(sharding)
    return PagedKVCache(
        kv=kv,
        k_scale=jax.device_put(ks, scale_sharding),
        v_scale=jax.device_put(vs, scale_sharding),
        lane_padded_from=head_dim if dp != head_dim else None,
        kv_head_pad=pad,
    )


def _check_head_split(
    name: str, sharding: Sharding, shape: tuple, num_kv_heads: int, pad: int
) -> None:
    """A sharding that splits the packed-row axis ``C`` must give every device whole heads."""
    if not isinstance(sharding, NamedSharding):
        return
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    for axis, entry in enumerate(spec):
        if entry is None or axis == 3:
            continue
        raise ValueError(
            f"{name}: the pages may be split over kv heads only (axis 3 of [L, N, S, C, P, Dp]), "
            f"got spec {sharding.spec}"
        )
    names = spec[3]
    if names is None:
        return
    names = names if isinstance(names, tuple) else (names,)
    devices = math.prod(sharding.mesh.shape[n] for n in names)
    rows, packing = shape[3], shape[4]
    if pad or rows % devices or (rows // devices * packing) % 2:
        raise ValueError(
            f"{name}: {num_kv_heads} kv heads of a {packing}-per-word cache cannot split over "
            f"{devices} devices: each device needs whole kv heads filling whole 32-bit words "
            "(8-bit caches: an even number of kv heads per device)"
        )


def _fill_bits(fill_value: float, dt: jnp.dtype, ks: jax.Array, vs: jax.Array) -> tuple:
    """The stored fill for K and V: a scalar, or (8-bit) ``fill_value`` quantized with each
    layer's scale, a ``[L]`` numpy array (so every layer reads back ``fill_value``, as if
    written)."""
    if not is_quantized_dtype(dt) or not math.isfinite(float(fill_value)):
        return fill_value, fill_value
    kq = np.asarray(quantize(jnp.full(np.shape(ks), fill_value, jnp.float32), ks, dt))
    vq = np.asarray(quantize(jnp.full(np.shape(vs), fill_value, jnp.float32), vs, dt))
    return kq, vq


def _fill_pattern(fill: tuple, shape: tuple, num_kv_heads: int, dt: jnp.dtype) -> np.ndarray:
    """The stored fill as an array broadcastable to ``shape`` (``[L, 1, 1, C, P, 1]``): K's
    fill on every head's K, V's on its V (per layer for 8-bit), zeros on a dummy head."""
    num_layers, _, _, c, p, _ = shape
    k_fill = np.broadcast_to(np.asarray(fill[0], dt).reshape(-1), (num_layers,))
    v_fill = np.broadcast_to(np.asarray(fill[1], dt).reshape(-1), (num_layers,))
    heads = np.zeros((num_layers, c * p), dt)
    heads[:, 0 : 2 * num_kv_heads : 2] = k_fill[:, None]
    heads[:, 1 : 2 * num_kv_heads : 2] = v_fill[:, None]
    return heads.reshape(num_layers, 1, 1, c, p, 1)


def set_kv_scales(cache: PagedKVCache, *, k_scale: Any = None, v_scale: Any = None) -> PagedKVCache:
    """The same pages with new per-layer scales (scalar or ``f32[L]``; None keeps one).

    The stored 8-bit values are not rescaled: set scales before the data they describe is
    written (e.g. after calibrating on the first prefills, before serving).

    Raises:
      ValueError: a bad scale, or scales for a cache that is not 8-bit.
    """
    name = "set_kv_scales"
    if not cache.quantized and (k_scale is not None or v_scale is not None):
        raise ValueError(f"{name}: a {cache.dtype} cache has no scales (8-bit caches only)")
    out = cache
    sharding = getattr(cache.k_scale, "sharding", None)
    for field, val in (("k_scale", k_scale), ("v_scale", v_scale)):
        if val is None:
            continue
        arr = _scale_array(name, field, val, cache.num_layers)
        if sharding is not None and not isinstance(val, jax.core.Tracer):
            arr = jax.device_put(arr, sharding)
        out = out.replace(**{field: arr})
    return out


def quantize(x: jax.Array, scale: Any, dtype: Any) -> jax.Array:
    """``x`` in real units -> the cache's stored values (``dtype``), with ``scale``.

    For 8-bit dtypes: int8 ``clip(round(x / scale), -127, 127)``, fp8 ``clip(x / scale,
    -448, 448)`` (e4m3 has no infinity: saturate instead of overflowing to NaN). Other
    dtypes: a plain cast (``scale`` unused).
    """
    dt = jnp.dtype(dtype)
    if not is_quantized_dtype(dt):
        return x.astype(dt)
    y = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)
    if dt == jnp.int8:
        return jnp.clip(jnp.round(y), -_INT8_MAX, _INT8_MAX).astype(dt)
    return jnp.clip(y, -_FP8_MAX, _FP8_MAX).astype(dt)


def dequantize(x: jax.Array, scale: Any, dtype: Any = jnp.float32) -> jax.Array:
    """Stored values -> real units in ``dtype``: ``x * scale`` for 8-bit, else a cast."""
    if not is_quantized_dtype(x.dtype):
        return x.astype(dtype)
    return (x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(dtype)


# --------------------------------------------------------------------------------------------
# The ops on a cache (the array-level implementations: kernels_pallas.kv_ops)
# --------------------------------------------------------------------------------------------


def pad_lanes(x: jax.Array, width: int) -> jax.Array:
    """``x [..., D]`` with zeros appended on its last axis to ``width`` lanes (as is when
    ``D == width``): what a lane-padded cache stores, and the queries that attend to it."""
    extra = width - x.shape[-1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def check_cache(name: str, cache: Any) -> PagedKVCache:
    """``cache`` is a :class:`PagedKVCache` (raises ``ValueError`` naming the op otherwise)."""
    if not isinstance(cache, PagedKVCache):
        raise ValueError(
            f"{name}: expected a kernels_pallas.PagedKVCache (from kp.init_kv_cache), got "
            f"{type(cache).__name__}"
        )
    return cache


def resolve_layer(name: str, cache: PagedKVCache, layer: Any) -> Any:
    """``layer`` checked against the cache; a one-layer cache defaults to layer 0."""
    if layer is None:
        if cache.num_layers == 1:
            return 0
        raise ValueError(
            f"{name}: the cache has {cache.num_layers} layers; pass layer= (int or i32 scalar)"
        )
    if isinstance(layer, (bool, np.bool_)):
        raise ValueError(f"{name}: layer must be an integer, got {layer!r}")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= int(layer) < cache.num_layers:
            raise ValueError(
                f"{name}: layer={int(layer)} out of range for {cache.num_layers} layers"
            )
        return int(layer)
    if np.ndim(layer) != 0 or not jnp.issubdtype(jnp.asarray(layer).dtype, jnp.integer):
        raise ValueError(f"{name}: layer must be an integer scalar, got {layer!r}")
    return layer


def check_new_kv(name: str, cache: PagedKVCache, k: Any, v: Any) -> None:
    if np.ndim(k) != 3 or np.shape(k) != np.shape(v):
        raise ValueError(
            f"{name}: k and v must both be [T, K, D] with the same shape, got {np.shape(k)} "
            f"and {np.shape(v)}"
        )
    if tuple(np.shape(k)[1:]) != (cache.num_kv_heads, cache.head_dim):
        raise ValueError(
            f"{name}: k/v are [T, K, D] = {tuple(np.shape(k))} but the cache has "
            f"K={cache.num_kv_heads}, D={cache.head_dim}"
        )
    for what, x in (("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}: {what} must be floating point, got {x.dtype}")


def write_kv(
    cache: PagedKVCache,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: Any,
    *,
    layer: int | jax.Array | None = None,
    impl: str = "auto",
    interpret: bool = False,
) -> PagedKVCache:
    """Write T new tokens' K and V of one layer into their slots (in place under donation).

    Args:
      cache: the cache.
      k, v: ``[T, K, D]`` in any float dtype; cast (8-bit: quantized with the layer's scale)
        to the cache dtype.
      slot_mapping: ``i32[T]``, ``block * S + offset``; negative = padding, skipped. Live
        slots must be distinct.
      layer: the layer to write (int or traced ``i32`` scalar; optional for one layer).
      impl, interpret: see :mod:`kernels_pallas` (``"auto"``: the Mosaic TPU kernel on TPU,
        XLA's in-place scatter elsewhere).

    Returns:
      The updated cache.

    Raises:
      ValueError: a bad cache, shapes, dtypes, layer, impl, or (host values) out-of-range or
        duplicate slots.
    """
    from kernels_pallas import kv_ops

    name = "write_kv"
    check_cache(name, cache)
    layer = resolve_layer(name, cache, layer)
    check_new_kv(name, cache, k, v)
    kv = kv_ops.write_pages(
        cache.kv,
        merged_rows(cache, k, v, layer),
        slot_mapping,
        layer=layer,
        impl=impl,
        interpret=interpret,
    )
    return cache.replace(kv=kv)


def merged_rows(cache: PagedKVCache, k: jax.Array, v: jax.Array, layer: Any) -> jax.Array:
    """New ``k, v [T, K, D]`` as the cache stores them: quantized with the layer's scales,
    lane-padded to ``Dp`` and merged to ``[T, C, P, Dp]`` rows."""
    kq = pad_lanes(quantize(k, cache.k_scale[layer], cache.dtype), cache.stored_head_dim)
    vq = pad_lanes(quantize(v, cache.v_scale[layer], cache.dtype), cache.stored_head_dim)
    return kv_layout.merge_kv(kq, vq)


def read_kv(
    cache: PagedKVCache,
    slot_mapping: Any,
    *,
    layer: int | jax.Array | None = None,
    dtype: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """The K and V stored at ``slot_mapping`` in one layer, in real units.

    Args:
      cache: the cache.
      slot_mapping: ``i32[T]`` slots (``block * S + offset``); a negative slot reads zeros.
      layer: the layer (int or traced scalar; optional for one layer).
      dtype: the result dtype; default float32 for 8-bit caches, else the cache dtype.

    Returns:
      ``(k [T, K, D], v [T, K, D])``, dequantized.

    Raises:
      ValueError: a bad cache, layer or slot array, or (host values) slots out of range.
    """
    name = "read_kv"
    check_cache(name, cache)
    layer = resolve_layer(name, cache, layer)
    if np.ndim(slot_mapping) != 1 or not jnp.issubdtype(
        jnp.asarray(slot_mapping).dtype, jnp.integer
    ):
        raise ValueError(f"{name}: slot_mapping must be a 1-D integer array")
    limit = cache.num_blocks * cache.block_size
    host = isinstance(slot_mapping, (np.ndarray, list, tuple)) and np.size(slot_mapping)
    if host and int(np.max(slot_mapping)) >= limit:
        raise ValueError(
            f"{name}: slot_mapping contains {int(np.max(slot_mapping))}, out of range for "
            f"N * S={limit}"
        )
    out_dtype = (
        jnp.dtype(dtype)
        if dtype is not None
        else (jnp.dtype(jnp.float32) if cache.quantized else cache.dtype)
    )
    slots = jnp.asarray(slot_mapping, jnp.int32)
    live = slots >= 0
    safe = jnp.where(live, slots, 0)
    blk, off = safe // cache.block_size, safe % cache.block_size

    k, v = kv_layout.split_kv(cache.kv[layer, blk, off], cache.num_kv_heads)  # [T, K, Dp]

    def one(x: jax.Array, scale: jax.Array) -> jax.Array:
        x = dequantize(x[..., : cache.head_dim], scale[layer], out_dtype)
        return jnp.where(live[:, None, None], x, jnp.zeros((), out_dtype))

    return one(k, cache.k_scale), one(v, cache.v_scale)


def copy_blocks(
    cache: PagedKVCache,
    src: Any,
    dst: Any,
    *,
    impl: str = "auto",
    interpret: bool = False,
    xla_moves: str = "auto",
) -> PagedKVCache:
    """Copy whole blocks ``src[i] -> dst[i]`` in every layer's K and V (copy-on-write, fork).

    Args:
      cache: the cache.
      src, dst: ``i32[P]`` block ids; a pair with a negative id is skipped. Destinations must
        be distinct and must not be sources; all reads see the cache as before the call.
      impl, interpret: see :func:`write_kv`.
      xla_moves: how the XLA path copies (:data:`kernels_pallas.kv_ops.XLA_MOVES`).

    Returns:
      The updated cache (8-bit values are copied as stored: same scales on both sides).
    """
    from kernels_pallas import kv_ops

    check_cache("copy_blocks", cache)
    kv = kv_ops.copy_pages(cache.kv, src, dst, impl=impl, interpret=interpret, xla_moves=xla_moves)
    return cache.replace(kv=kv)


def _check_swap_pair(name: str, src: Any, dst: Any) -> None:
    check_cache(name, src)
    check_cache(name, dst)
    if src.dtype != dst.dtype:
        raise ValueError(f"{name}: dtype mismatch: src cache {src.dtype} vs dst {dst.dtype}")
    a, b = src.kv.shape, dst.kv.shape
    if a[:1] != b[:1] or a[2:] != b[2:] or src.kv_head_pad != dst.kv_head_pad:
        raise ValueError(
            f"{name}: the caches differ outside the block count: L, K, S, Dp = "
            f"{(a[0], src.num_kv_heads, a[2], a[5])} vs {(b[0], dst.num_kv_heads, b[2], b[5])}"
        )
    if src.quantized:
        # Stored 8-bit values move as they are: with other scales they would silently mean
        # other values. Checked when the scales are concrete (not traced, not abstract).
        for what in ("k_scale", "v_scale"):
            x, y = getattr(src, what), getattr(dst, what)
            if not all(isinstance(z, jax.Array) and not isinstance(z, jax.core.Tracer)
                       for z in (x, y)):  # fmt: skip
                continue
            hx, hy = np.asarray(x), np.asarray(y)
            if not np.array_equal(hx, hy):
                raise ValueError(
                    f"{name}: the caches' {what}s differ ({hx.tolist()} vs {hy.tolist()}); "
                    "8-bit blocks move as stored, so both sides need the same scales "
                    "(set_kv_scales)"
                )


def swap_blocks(
    src_cache: PagedKVCache,
    dst_cache: PagedKVCache,
    src_ids: Any,
    dst_ids: Any,
    *,
    impl: str = "auto",
    interpret: bool = False,
    donate: bool = True,
    xla_moves: str = "auto",
) -> PagedKVCache:
    """Copy blocks ``src_ids[i]`` of ``src_cache`` to ``dst_ids[i]`` of ``dst_cache``.

    The caches may live in different memory kinds (device HBM and ``pinned_host``): one
    program gathers on the source side, makes one transfer and scatters on the destination
    side (:func:`kernels_pallas.kv_ops.swap_pages`). Stored values move as they are (8-bit
    stays 8-bit; the destination keeps its scales, which should equal the source's).

    Args:
      src_cache, dst_cache: caches with equal L, K, S, D and dtype.
      src_ids, dst_ids: ``i32[P]``; a pair with a negative id is skipped. Destinations must
        be distinct.
      impl, interpret, donate, xla_moves: see :func:`kernels_pallas.kv_ops.swap_pages`
        (``donate``: the destination's pages are consumed; use the returned cache).

    Returns:
      ``dst_cache`` with the blocks written.
    """
    from kernels_pallas import kv_ops

    name = "swap_blocks"
    _check_swap_pair(name, src_cache, dst_cache)
    (kv,) = kv_ops.swap_pages(
        swap_operands(src_cache),
        swap_operands(dst_cache),
        src_ids,
        dst_ids,
        impl=impl,
        interpret=interpret,
        donate=donate,
        xla_moves=xla_moves,
    )
    return dst_cache.replace(kv=kv)


def swap_program(
    src_cache: PagedKVCache,
    dst_cache: PagedKVCache,
    num_pairs: int,
    *,
    impl: str = "auto",
    interpret: bool = False,
    donate: bool = True,
    xla_moves: str = "auto",
) -> tuple[Any, int]:
    """The jitted program :func:`swap_blocks` runs for these caches and pair count.

    For warm-up and ahead-of-time compilation (the caches may hold ``ShapeDtypeStruct``s
    whose shardings carry the memory kinds). Returns ``(fn, padded_pairs)``; call
    ``fn(src_pages, dst_pages, src_ids, dst_ids)`` with :func:`swap_operands` of the caches.
    """
    from kernels_pallas import kv_ops

    _check_swap_pair("swap_blocks", src_cache, dst_cache)
    return kv_ops.swap_program(
        swap_operands(src_cache),
        swap_operands(dst_cache),
        num_pairs,
        impl=impl,
        interpret=interpret,
        donate=donate,
        xla_moves=xla_moves,
    )


def swap_operands(cache: PagedKVCache) -> tuple[Any, Any]:
    """The arrays a :func:`swap_program` moves for ``cache`` (its pages, in program order)."""
    return (cache.kv,)
