"""KVCache: the whole model's paged K/V on the device, plus a host pool for swapping.

The pages are a :class:`kernels_pallas.PagedKVCache`, an opaque value in the kernels' own
layout (``kernels_pallas.cache``): this module never indexes them, it calls the kernels' ops
(``write_kv``, ``copy_blocks``, ``swap_blocks``) and sizes blocks with
``kv_cache_bytes_per_block``. All layers live in one value, so the model runs its layers under
``lax.scan`` with the cache in the carry, the engine donates it across steps, and
copy-on-write, fork and swap move a block in every layer with one gather/scatter or DMA.

The host pool ``host`` is a second ``PagedKVCache`` of ``num_host_blocks`` blocks with
``memory_kind="pinned_host"`` (``None`` when ``num_host_blocks == 0``), with the device's
8-bit scales. Swapping uses :func:`kernels_pallas.swap_blocks`: gather on the source side,
one transfer, scatter on the destination side.

Every function returns a new ``KVCache``; the arrays they update are donated where the call
runs its own program (``swap_out`` donates the host pool, ``swap_in`` the device pages), so
always continue with the returned cache. ``write_layer`` and ``apply_copies`` are pure
functions meant to run inside the engine's jitted step with the cache donated.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, make_single_device_sharding

import kernels_pallas as kp
from kernels_pallas.buckets import next_power_of_two, power_of_two_buckets

__all__ = [
    "KVCache",
    "apply_copies",
    "bytes_per_block",
    "host_memory_kind",
    "num_blocks_for_budget",
    "swap_buckets",
    "swap_in",
    "swap_out",
    "swap_programs",
    "warmup_swaps",
    "write_layer",
]

logger = logging.getLogger(__name__)


def host_memory_kind(device: jax.Device | None = None) -> str:
    """The host memory kind used for the swap pool: ``pinned_host`` when the device has it."""
    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" in kinds:
        return "pinned_host"
    if "unpinned_host" in kinds:
        logger.warning("device %s has no pinned_host memory; using unpinned_host", device)
        return "unpinned_host"
    raise ValueError(f"device {device} has no host memory kind (has {sorted(kinds)})")


@flax.struct.dataclass
class KVCache:
    """Paged K/V for every layer, on the device, plus an optional host pool.

    Attributes:
      device: the device pages, a :class:`kernels_pallas.PagedKVCache` (L layers, N blocks).
      host: the host pool (``NH`` blocks in ``pinned_host`` memory, same layout and scales),
        or None (NH = 0).
    """

    device: kp.PagedKVCache
    host: kp.PagedKVCache | None = None

    # ---- shape accessors -----------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.device.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.device.num_kv_heads

    @property
    def num_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def block_size(self) -> int:
        return self.device.block_size

    @property
    def head_dim(self) -> int:
        return self.device.head_dim

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host is None else self.host.num_blocks

    @property
    def dtype(self) -> jnp.dtype:
        return self.device.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in K and V over all layers, as stored (lane padding in)."""
        return self.device.nbytes // self.device.num_blocks

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: Any = jnp.bfloat16,
        num_host_blocks: int = 0,
        sharding: Sharding | None = None,
        *,
        fill_value: float = 0.0,
        k_scale: Any = 1.0,
        v_scale: Any = 1.0,
        platform: str | None = None,
    ) -> KVCache:
        """Allocate the cache.

        Args:
          num_layers, num_kv_heads, head_dim, num_blocks, block_size: L, K, D, N, S.
          dtype: cache dtype (e.g. ``jnp.bfloat16``; ``int8`` / ``float8_e4m3fn`` for 8-bit).
          num_host_blocks: NH blocks in the host pool (0 = no pool, no swapping).
          sharding: sharding of the device pages (e.g. a ``NamedSharding`` splitting kv heads
            over a ``tp`` axis, ``paxcache.sharding.kv_sharding``). The host pool uses the
            same sharding with the host memory kind. Default: the first device.
          fill_value: initial value of every page; tests use ``float("nan")`` to prove nothing
            unwritten is ever read.
          k_scale, v_scale: 8-bit caches' per-layer scales (scalar or ``f32[L]``).
          platform: whose page layout to use (``kp.init_kv_cache``; default the devices').

        Raises:
          ValueError: a non-positive dimension, negative ``num_host_blocks``, a bad dtype or
            scale.
        """
        if (
            isinstance(num_host_blocks, bool)
            or not isinstance(num_host_blocks, (int, np.integer))
            or num_host_blocks < 0
        ):
            raise ValueError(
                f"KVCache.create: num_host_blocks must be an int >= 0, got {num_host_blocks!r}"
            )
        if sharding is None:
            sharding = make_single_device_sharding(jax.devices()[0])
        dims = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        kw = dict(
            dtype=dtype, k_scale=k_scale, v_scale=v_scale, fill_value=fill_value, platform=platform
        )
        try:
            device = kp.init_kv_cache(*dims, sharding=sharding, **kw)
            host = None
            if num_host_blocks:
                dev = next(iter(sharding.device_set))
                host_sharding = sharding.with_memory_kind(host_memory_kind(dev))
                host_dims = (num_layers, num_host_blocks, block_size, num_kv_heads, head_dim)
                host = kp.init_kv_cache(*host_dims, sharding=host_sharding, **kw)
        except ValueError as e:
            raise ValueError(f"KVCache.create: {e}") from None
        return cls(device=device, host=host)

    def with_scales(self, *, k_scale: Any = None, v_scale: Any = None) -> KVCache:
        """The same cache with new 8-bit scales on the device pages and the host pool."""
        device = kp.set_kv_scales(self.device, k_scale=k_scale, v_scale=v_scale)
        host = self.host
        if host is not None:
            host = kp.set_kv_scales(host, k_scale=k_scale, v_scale=v_scale)
        return self.replace(device=device, host=host)


# --------------------------------------------------------------------------------------------
# Operations
# --------------------------------------------------------------------------------------------


def write_layer(
    cache: KVCache,
    layer: int | jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    impl: str = "auto",
    interpret: bool = False,
) -> KVCache:
    """Write T new tokens' K/V of one layer into their slots (in place under donation).

    Args:
      cache: the cache.
      layer: layer index (Python int or traced ``i32`` scalar, e.g. inside ``lax.scan``).
      k, v: ``[T, K, D]`` (any float dtype; cast or quantized to the cache's).
      slot_mapping: ``i32[T]``, ``block * S + offset``; negative = padding, skipped.
      impl, interpret: see :func:`kernels_pallas.write_kv`.
    """
    device = kp.write_kv(
        cache.device, k, v, slot_mapping, layer=layer, impl=impl, interpret=interpret
    )
    return cache.replace(device=device)


def apply_copies(
    cache: KVCache,
    src: jax.Array,
    dst: jax.Array,
    *,
    impl: str = "auto",
    interpret: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    xla_moves: str = "auto",
) -> KVCache:
    """Apply copy-on-write / fork pairs ``src[i] -> dst[i]`` to every layer's K and V.

    Args:
      cache: the cache.
      src, dst: ``i32[P]`` device block ids padded with -1 (e.g. the allocator's
        ``copy_src`` / ``copy_dst``).
      impl, interpret: see :func:`kernels_pallas.copy_blocks`.
      mesh: a mesh with a ``"tp"`` axis over which the pages are split by kv heads
        (``paxcache.sharding.kv_sharding``): each device copies its own heads under
        ``jax.shard_map`` (a Mosaic kernel cannot be partitioned automatically).
      xla_moves: see :data:`kernels_pallas.kv_ops.XLA_MOVES`.
    """

    def copy(pages: kp.PagedKVCache, s: jax.Array, d: jax.Array) -> kp.PagedKVCache:
        return kp.copy_blocks(pages, s, d, impl=impl, interpret=interpret, xla_moves=xla_moves)

    if mesh is None:
        device = copy(cache.device, src, dst)
    else:
        from jax.sharding import PartitionSpec as P

        from paxcache.sharding import TP_AXIS

        specs = kp.kv_cache_specs(TP_AXIS, like=cache.device)
        copy = jax.shard_map(
            copy, mesh=mesh, in_specs=(specs, P(), P()), out_specs=specs, check_vma=False
        )
        device = copy(cache.device, jnp.asarray(src), jnp.asarray(dst))
    return cache.replace(device=device)


def _plan_ids(src: Any, dst: Any, num: Any) -> tuple[Any, Any]:
    """Trim a padded plan to its first ``num`` pairs (host values; None keeps the padding)."""
    if num is None:
        return src, dst
    n = int(num)
    src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    if not 0 <= n <= src.shape[0]:
        raise ValueError(f"swap plan num={n} out of range for a plan of length {src.shape[0]}")
    return src[:n], dst[:n]


def _need_host(cache: KVCache, name: str) -> None:
    if cache.host is None:
        raise ValueError(f"{name}: the cache has no host pool (num_host_blocks=0)")


def swap_out(
    cache: KVCache,
    plan_src: Any,
    plan_dst: Any,
    num: Any = None,
    *,
    impl: str = "auto",
    xla_moves: str = "auto",
) -> KVCache:
    """Copy device blocks ``plan_src[i]`` to host blocks ``plan_dst[i]`` (K and V, all layers).

    One program: gather on the device, one device -> host transfer, scatter into the host
    pool (donated: the passed cache's host arrays are consumed; use the returned cache).

    Args:
      cache: the cache (with a host pool).
      plan_src: ``i32[P]`` device block ids, -1 padded (allocator ``SwapPlan.src``).
      plan_dst: ``i32[P]`` host block ids, -1 padded (``SwapPlan.dst``).
      num: optional number of valid leading pairs (``SwapPlan.num``); when given, only those
        are moved (pulls the plan to the host), otherwise the whole padded plan runs.
      impl, xla_moves: see :func:`kernels_pallas.swap_blocks`.
    """
    _need_host(cache, "swap_out")
    src, dst = _plan_ids(plan_src, plan_dst, num)
    host = kp.swap_blocks(cache.device, cache.host, src, dst, impl=impl, xla_moves=xla_moves)
    return cache.replace(host=host)


def swap_in(
    cache: KVCache,
    plan_src: Any,
    plan_dst: Any,
    num: Any = None,
    *,
    impl: str = "auto",
    xla_moves: str = "auto",
) -> KVCache:
    """Copy host blocks ``plan_src[i]`` to device blocks ``plan_dst[i]`` (K and V, all layers).

    One program: gather in the host pool, one host -> device transfer, scatter into the
    device pages (donated: use the returned cache).

    Args:
      cache: the cache (with a host pool).
      plan_src: ``i32[P]`` host block ids, -1 padded (allocator ``SwapPlan.src``).
      plan_dst: ``i32[P]`` device block ids, -1 padded (``SwapPlan.dst``).
      num: optional number of valid leading pairs, as in :func:`swap_out`.
      impl, xla_moves: see :func:`kernels_pallas.swap_blocks`.
    """
    _need_host(cache, "swap_in")
    src, dst = _plan_ids(plan_src, plan_dst, num)
    device = kp.swap_blocks(cache.host, cache.device, src, dst, impl=impl, xla_moves=xla_moves)
    return cache.replace(device=device)


def swap_buckets(max_pairs: int) -> tuple[int, ...]:
    """The padded pair counts a swap of up to ``max_pairs`` blocks can use (powers of two)."""
    return power_of_two_buckets(next_power_of_two(max(1, int(max_pairs))))


def warmup_swaps(cache: KVCache, max_pairs: int, *, impl: str = "auto") -> KVCache:
    """Compile every swap program (out and in, each pair bucket up to ``max_pairs``).

    Each program runs once with every pair skipped (ids ``-1``), which moves nothing, so the
    first real preemption does not compile. Returns the cache to continue with (the host
    pool and device pages are donated through the programs).
    """
    _need_host(cache, "warmup_swaps")
    for p in swap_buckets(max_pairs):
        ids = np.full(p, -1, np.int32)
        cache = swap_out(cache, ids, ids, impl=impl)
        cache = swap_in(cache, ids, ids, impl=impl)
    return cache


def swap_programs(cache: KVCache, max_pairs: int, *, impl: str = "auto") -> list[tuple]:
    """``[(name, jitted_fn, args)]`` of every swap program, for ahead-of-time compilation.

    ``cache`` may hold ``jax.ShapeDtypeStruct``s (with shardings carrying the memory kinds);
    ``jitted_fn.trace(*args).lower().compile()`` compiles one program. Names are
    ``swap_out[P]`` / ``swap_in[P]`` for the padded pair count ``P``.
    """
    _need_host(cache, "swap_programs")
    dev, host = cache.device, cache.host
    out = []
    for p in swap_buckets(max_pairs):
        for name, src, dst in (("swap_out", dev, host), ("swap_in", host, dev)):
            fn, size = kp.swap_program(src, dst, p, impl=impl)
            ids = jax.ShapeDtypeStruct((size,), jnp.int32)
            args = (kp.swap_operands(src), kp.swap_operands(dst), ids, ids)
            out.append((f"{name}[{size}]", fn, args))
    return out


# --------------------------------------------------------------------------------------------
# Sizing
# --------------------------------------------------------------------------------------------


def bytes_per_block(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: Any,
    platform: str | None = None,
) -> int:
    """Bytes of one block, K and V of every layer (``kp.kv_cache_bytes_per_block``; on TPU a
    head_dim that is not a multiple of 128 is stored lane-padded: ``kp.stored_head_dim``)."""
    return kp.kv_cache_bytes_per_block(
        num_layers, block_size, num_kv_heads, head_dim, dtype, platform=platform
    )


def num_blocks_for_budget(
    bytes_or_fraction: int | float,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: Any,
    device: jax.Device | None = None,
    *,
    memory_stats: Mapping[str, int] | None = None,
    reserve_bytes: int = 0,
    reserve_bytes_per_block: int = 0,
) -> tuple[int, int]:
    """How many blocks fit in a memory budget.

    Args:
      bytes_or_fraction: an ``int`` is a budget in bytes. A ``float`` in ``(0, 1]`` is a
        fraction of the device's *free* memory, ``bytes_limit - bytes_in_use`` from
        ``device.memory_stats()`` (like vLLM's ``gpu_memory_utilization``, but measured
        against what is free now, so call it after the weights are loaded). Backends without
        memory stats (the CPU) need an explicit byte budget.
      num_layers, num_kv_heads, head_dim, block_size, dtype: the model's KV dimensions
        (``num_kv_heads`` per device when heads are sharded).
      device: the device to size for (default: the first device).
      memory_stats: use these ``{"bytes_limit", "bytes_in_use"}`` instead of the device's
        (sizing for a chip that is not attached, e.g. ``scripts/compile_check.py``).
      reserve_bytes: with a fraction, bytes taken off the budget for what the model step needs
        besides its arguments (activations, logits, sampling buffers: its temporaries), so the
        cache and the step fit together (the engine measures it by compiling its largest step).
      reserve_bytes_per_block: step temporaries that grow with the cache, per block (a
        compiler copy of the cache), counted with each block's own bytes.

    Returns:
      ``(num_blocks, bytes_per_block)``.

    Raises:
      ValueError: a bad budget, a fraction on a device without memory stats, or a budget too
        small for one block.
    """
    per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
    if isinstance(bytes_or_fraction, bool):
        raise ValueError(
            f"budget must be bytes (int) or a fraction (float), got {bytes_or_fraction!r}"
        )
    if isinstance(bytes_or_fraction, (int, np.integer)):
        budget = int(bytes_or_fraction)
        if budget <= 0:
            raise ValueError(f"byte budget must be positive, got {budget}")
    elif isinstance(bytes_or_fraction, (float, np.floating)):
        frac = float(bytes_or_fraction)
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"memory fraction must be in (0, 1], got {frac}")
        device = device or jax.devices()[0]
        stats = memory_stats if memory_stats is not None else device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            raise ValueError(
                f"device {device} reports no memory stats; pass the KV budget in bytes (int) "
                "instead of a fraction"
            )
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        budget = int(frac * max(free, 0)) - int(reserve_bytes)
    else:
        raise ValueError(
            f"budget must be bytes (int) or a fraction (float), got {bytes_or_fraction!r}"
        )
    n = budget // (per_block + int(reserve_bytes_per_block))
    if n < 1:
        after = f" (after {int(reserve_bytes)} bytes for the model step)" if reserve_bytes else ""
        dims = f"L={num_layers}, K={num_kv_heads}, D={head_dim}, S={block_size}, {jnp.dtype(dtype)}"
        raise ValueError(
            f"KV budget of {budget} bytes{after} holds no block of {per_block} bytes ({dims})"
        )
    return int(n), per_block
