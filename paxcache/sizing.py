"""How many KV blocks the engine gets.

* Off an accelerator (or with an explicit ``kv_memory_bytes``): a byte budget (1 GiB by default
  on the CPU), capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use.
* On an accelerator: 0.9 of the memory the weights leave free, less what the largest step needs
  besides its arguments (activations, logits, sampling buffers: the compiled program's
  temporaries). The engine measures that reserve by compiling its largest step over a small
  cache (:func:`step_reserve_bytes`), as vLLM profiles a forward pass before sizing its cache.
  Sized from free memory alone, the cache and the step do not fit together: Llama-3-8B in
  bf16 on one v6e chip needed 31.7 GiB of 31.25 (``scripts/compile_check.py``).
* On a CUDA GPU, from the device's real memory: XLA's allocator pool (``bytes_limit``) is
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of it, 0.75 by default, which would leave a quarter of
  the GPU unused. :func:`configure_gpu_allocator` (``scripts/serve.py`` calls it before JAX
  starts; call it yourself before the first JAX call, or set the variable) makes the pool
  :data:`GPU_POOL_FRACTION` of the GPU, and the cache gets ``0.9 x the GPU's memory - the
  memory in use (weights) - the step's reserve``, within what the pool has free less
  :data:`GPU_POOL_HEADROOM` of the GPU (with a warning naming the variable when the pool is
  what limits it: a cache that took all of XLA's default pool but the step's reserve left
  no slack, and a Llama-3-8B step on an H200 ran out of memory). The device's total comes
  from the CUDA driver (``cuDeviceTotalMem``), else from ``bytes_limit`` and the fraction.
  Preallocation (``XLA_PYTHON_CLIENT_PREALLOCATE``, on by default) does not change the pool
  size, only when it is taken; ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` has no pool, and the
  device's total is then the limit.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from paxcache import kv_cache

__all__ = [
    "DEVICE_MEMORY_FRACTION",
    "GPU_POOL_FRACTION",
    "GPU_POOL_HEADROOM",
    "Sized",
    "configure_gpu_allocator",
    "cuda_total_memory",
    "device_memory_stats",
    "device_num_blocks",
    "host_num_blocks",
    "probe_reserve",
    "settle_num_blocks",
    "step_reserve_bytes",
]

logger = logging.getLogger(__name__)

DEVICE_MEMORY_FRACTION = 0.9
"""Share of the free accelerator memory (after the weights) the cache and the step may use."""

HOST_KV_BYTES = 1 << 30
"""The default KV budget off an accelerator."""

GPU_POOL_FRACTION = 0.95
"""XLA's GPU allocator pool, as a fraction of the GPU's memory, that
:func:`configure_gpu_allocator` asks for (room above the 0.9 the engine sizes for)."""

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
_XLA_DEFAULT_MEM_FRACTION = 0.75


GPU_POOL_HEADROOM = GPU_POOL_FRACTION - DEVICE_MEMORY_FRACTION
"""Share of the GPU's memory the cache leaves free inside XLA's pool: with the pool at
:data:`GPU_POOL_FRACTION` the cache gets its :data:`DEVICE_MEMORY_FRACTION` share exactly; a
smaller pool keeps the same headroom."""


def configure_gpu_allocator(fraction: float = GPU_POOL_FRACTION) -> bool:
    """Make XLA's GPU allocator pool ``fraction`` of each GPU's memory (instead of 0.75) by
    setting ``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless it or ``XLA_PYTHON_CLIENT_ALLOCATOR``
    is already set. Takes effect only before JAX initialises its GPU backend; no effect on
    other backends.

    Returns:
      Whether the variable was set here.

    Raises:
      ValueError: ``fraction`` is not in ``(0, 1]``.
    """
    if not 0.0 < float(fraction) <= 1.0:
        raise ValueError(f"GPU pool fraction must be in (0, 1], got {fraction!r}")
    if MEM_FRACTION_ENV in os.environ or "XLA_PYTHON_CLIENT_ALLOCATOR" in os.environ:
        return False
    os.environ[MEM_FRACTION_ENV] = f"{float(fraction):g}"
    return True


def cuda_total_memory(ordinal: int) -> int | None:
    """The memory of CUDA device ``ordinal`` (visible numbering) from the CUDA driver
    (``cuDeviceTotalMem``), or None when the driver cannot be asked."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        device, total = ctypes.c_int(), ctypes.c_size_t()
        if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(device), int(ordinal)) != 0:
            return None
        if lib.cuDeviceTotalMem_v2(ctypes.byref(total), device) != 0:
            return None
        return int(total.value) or None
    except (OSError, AttributeError):
        return None


def device_memory_stats(device: Any) -> dict[str, int] | None:
    """``device.memory_stats()``; on a CUDA GPU also ``"device_total_bytes"``, the device's
    real memory (:func:`cuda_total_memory`, else ``bytes_limit`` over the pool fraction)."""
    stats = device.memory_stats()
    if not stats or getattr(device, "platform", None) != "gpu" or "bytes_limit" not in stats:
        return stats
    stats = dict(stats)
    total = cuda_total_memory(getattr(device, "local_hardware_id", None) or 0)
    if total is None and "XLA_PYTHON_CLIENT_ALLOCATOR" not in os.environ:
        fraction = float(os.environ.get(MEM_FRACTION_ENV, _XLA_DEFAULT_MEM_FRACTION))
        total = int(stats["bytes_limit"] / fraction)
    if total:
        stats["device_total_bytes"] = total
    return stats


def _gpu_budget(stats: Mapping[str, int], reserve_bytes: int) -> int:
    """KV bytes on a GPU: 0.9 of its memory less what is in use and the step's reserve,
    within what XLA's pool has free."""
    in_use = int(stats.get("bytes_in_use", 0))
    total = int(stats["device_total_bytes"])
    want = int(DEVICE_MEMORY_FRACTION * total) - in_use
    # The pool keeps the headroom the device's fraction leaves (fragmentation, the buffers of
    # the other programs): see the module doc.
    pool = int(stats["bytes_limit"]) - int(GPU_POOL_HEADROOM * total) - in_use
    if pool < want:
        logger.warning(
            "KV sizing: XLA's GPU pool (%.1f of the device's %.1f GiB) limits the cache to "
            "%.1f GiB instead of %.1f; set %s=%g before JAX starts "
            "(paxcache.sizing.configure_gpu_allocator)",
            int(stats["bytes_limit"]) / 2**30, int(stats["device_total_bytes"]) / 2**30,
            max(pool, 0) / 2**30, max(want, 0) / 2**30, MEM_FRACTION_ENV, GPU_POOL_FRACTION,
        )  # fmt: skip
    return min(want, pool) - int(reserve_bytes)


def host_num_blocks(
    kv_memory_bytes: int | None, max_num_seqs: int, max_blocks_per_seq: int, bytes_per_block: int
) -> int:
    """Blocks for a byte budget (default :data:`HOST_KV_BYTES`), capped at what
    ``max_num_seqs`` sequences of ``max_blocks_per_seq`` blocks can hold."""
    budget = kv_memory_bytes if kv_memory_bytes is not None else HOST_KV_BYTES
    return min(max_num_seqs * max_blocks_per_seq, budget // bytes_per_block)


def step_reserve_bytes(compiled: Any) -> int:
    """Bytes per device a compiled step needs besides its arguments: temporaries, generated
    code and outputs that do not alias a donated input (0, with a warning, on a backend with
    no memory analysis)."""
    mem = compiled.memory_analysis()
    if mem is None:
        logger.warning("no memory analysis on this backend: the KV sizing reserves nothing")
        return 0
    unaliased_out = max(0, int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes))
    return int(mem.temp_size_in_bytes) + int(mem.generated_code_size_in_bytes) + unaliased_out


def probe_reserve(jitted: Any, args: tuple) -> int:
    """:func:`step_reserve_bytes` of ``jitted`` compiled for ``args`` (nothing runs).

    Raises what the compiler raises: on TPU a program that does not fit the chip's HBM is
    refused with ``RESOURCE_EXHAUSTED``.
    """
    return step_reserve_bytes(jitted.lower(*args).compile())


def device_num_blocks(
    memory_stats: Mapping[str, int] | None,
    reserve_bytes: int,
    *,
    num_layers: int,
    num_kv_heads_per_device: int,
    head_dim: int,
    block_size: int,
    dtype: Any,
    device: Any = None,
    reserve_bytes_per_block: int = 0,
) -> int:
    """Blocks for :data:`DEVICE_MEMORY_FRACTION` of the free memory less ``reserve_bytes``
    (on a GPU, of the device's memory: see the module doc).

    Args:
      memory_stats: ``{"bytes_limit", "bytes_in_use"}`` of one device, taken after the weights
        are placed, plus ``"device_total_bytes"`` on a GPU (:func:`device_memory_stats`;
        None: ``device.memory_stats()``).
      reserve_bytes: what the largest step needs besides its arguments (:func:`step_reserve_bytes`).
      num_layers, num_kv_heads_per_device, head_dim, block_size, dtype: the cache's dimensions.
      device: the device whose stats to read when ``memory_stats`` is None.
      reserve_bytes_per_block: what the step's temporaries grow by per KV block (a compiler
        copy of the cache), counted with each block's own bytes.

    Raises:
      ValueError: no block fits (the message gives the budget and the reserve).
    """
    if memory_stats and "device_total_bytes" in memory_stats and "bytes_limit" in memory_stats:
        budget = _gpu_budget(memory_stats, reserve_bytes)
        per_block = kv_cache.bytes_per_block(
            num_layers, num_kv_heads_per_device, head_dim, block_size, dtype
        ) + int(reserve_bytes_per_block)
        if budget < per_block:
            raise ValueError(
                f"no KV block fits on the GPU: {max(budget, 0)} bytes left after the weights "
                f"and the step's reserve of {reserve_bytes} bytes; one block takes {per_block}"
            )
        return budget // per_block
    num_blocks, _ = kv_cache.num_blocks_for_budget(
        DEVICE_MEMORY_FRACTION,
        num_layers,
        num_kv_heads_per_device,
        head_dim,
        block_size,
        dtype,
        device,
        memory_stats=memory_stats,
        reserve_bytes=reserve_bytes,
        reserve_bytes_per_block=reserve_bytes_per_block,
    )
    return num_blocks


@dataclass(frozen=True)
class Sized:
    """What :func:`settle_num_blocks` settled on."""

    num_blocks: int
    program: str
    """The program that limits the cache (the first, the step, on a tie)."""
    reserve_bytes: int
    """What that program needs besides its arguments over the small probe cache."""
    reserve_bytes_per_block: int
    """How much of that reserve grows with each KV block."""


def settle_num_blocks(
    reserves_over: Callable[..., dict[str, int] | None],
    stats: Mapping[str, int],
    dims: Mapping[str, Any],
    *,
    bytes_per_block: int,
    probe_blocks: int,
    max_checks: int,
) -> Sized:
    """The device cache's size, from the compiled programs' reserves.

    ``reserves_over(num_blocks, may_not_fit=False)`` builds a cache of ``num_blocks`` blocks and
    returns each program's reserve over it (:func:`probe_reserve`), or None when the compiler
    refuses one for memory and ``may_not_fit``. The programs are compiled over a small cache
    (``probe_blocks``) to measure what each needs besides its arguments, which sizes the cache
    (:func:`device_num_blocks` with ``dims``); then once more over that size, to measure how
    much of each reserve grows with the cache. It can: when the compiler keeps the cache in a
    layout the kernels cannot take, it copies the whole cache into theirs around them, a
    temporary a small probe does not show (XLA:TPU did this to a head_dim-64 cache until the
    kernels stored it lane-padded, ``kp.stored_head_dim``: twice the cache's size). That
    growth, per block, is then counted with each block's own bytes (``bytes_per_block``, per
    device). When the programs over the first size do not fit (the compiler refuses one: such
    a copy makes a step about three caches), the second probe halves its cache until they
    compile (gpt-oss-20b on v6e:2x2 then: 51.84G of temporaries over the first size, which is
    why a probe must not need to fit). The
    temporaries need not be linear in the cache either (Qwen3-30B-A3B's loop on v5e:2x4: 6.0
    GiB over 1391 blocks, 17.19G over 2769), so a size past the largest one that compiled is
    checked, and bisected down to one that does (``max_checks`` compiles; at worst the size
    that compiled). The cache gets the fewest blocks any program allows.
    """
    reserve = reserves_over(probe_blocks)
    assert reserve is not None  # may_not_fit is off: a refusal raises
    programs = list(reserve)
    first = min(device_num_blocks(stats, r, **dims) for r in reserve.values())
    growth, size = dict.fromkeys(programs, 0), first
    fits_at = probe_blocks  # the largest cache the programs are known to compile over
    while size > probe_blocks:
        grown = reserves_over(size, may_not_fit=True)
        if grown is not None:
            growth = {k: max(0, grown[k] - reserve[k]) // (size - probe_blocks) for k in programs}
            fits_at = size
            break
        logger.info("KV sizing: the programs over %d blocks do not fit; half", size)
        size //= 2
    else:
        if first > probe_blocks:
            logger.warning(
                "KV sizing: the programs fit over no cache larger than %d blocks; their growth "
                "with the cache is not measured (the engine's own build may not fit)",
                probe_blocks,
            )
    grows = max(programs, key=growth.get)
    if growth[grows] > bytes_per_block // 10:  # more than rounding: a copy of the cache
        logger.warning(
            "KV sizing: %s's temporaries grow by %d bytes per KV block (%.1fx the block's own "
            "%d bytes): the compiler copies the cache around the kernels, so fewer blocks fit "
            "and every step moves the whole cache twice (head_dim=%d; look for a cache-sized "
            "copy in the step's HLO)",
            grows, growth[grows], growth[grows] / max(bytes_per_block, 1), bytes_per_block,
            dims["head_dim"],
        )  # fmt: skip
    sized = {
        k: device_num_blocks(stats, reserve[k], reserve_bytes_per_block=growth[k], **dims)
        for k in programs
    }
    limiting = min(programs, key=sized.get)
    num_blocks = sized[limiting]
    low, high, checks = fits_at, num_blocks, 0
    while high > low and checks < max_checks:
        checks += 1
        if reserves_over(high, may_not_fit=True) is not None:
            low = high
            break
        high = (low + high) // 2
    if low < num_blocks:
        logger.warning(
            "KV sizing: %d blocks, not the %d the probes' figures give: the programs did not "
            "compile over those (the compiler's temporaries jump with the cache size)",
            low, num_blocks,
        )  # fmt: skip
        num_blocks = low
    logger.info(
        "KV sizing: %d blocks (%s needs %.2f GiB + %d bytes per block)",
        num_blocks, limiting, reserve[limiting] / 2**30, growth[limiting],
    )  # fmt: skip
    return Sized(num_blocks, limiting, reserve[limiting], growth[limiting])
