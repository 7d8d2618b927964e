"""How many KV blocks the engine gets.

* Off an accelerator (or with an explicit ``kv_memory_bytes``): a byte budget (1 GiB by default
  on the CPU), capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use.
* On an accelerator: 0.9 of the memory the weights leave free, less what the largest step needs
  besides its arguments (activations, logits, sampling buffers: the compiled program's
  temporaries). The engine measures that reserve by compiling its largest step over a small
  cache (:func:`step_reserve_bytes`), as vLLM profiles a forward pass before sizing its cache.
  Sized from free memory alone, the cache and the step do not fit together: Llama-3-8B in
  bf16 on one v6e chip needed 31.7 GiB of 31.25 (``scripts/compile_check.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from paxcache import kv_cache

__all__ = ["DEVICE_MEMORY_FRACTION", "device_num_blocks", "host_num_blocks", "step_reserve_bytes"]

logger = logging.getLogger(__name__)

DEVICE_MEMORY_FRACTION = 0.9
"""Share of the free accelerator memory (after the weights) the cache and the step may use."""

HOST_KV_BYTES = 1 << 30
"""The default KV budget off an accelerator."""


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
) -> int:
    """Blocks for :data:`DEVICE_MEMORY_FRACTION` of the free memory less ``reserve_bytes``.

    Args:
      memory_stats: ``{"bytes_limit", "bytes_in_use"}`` of one device, taken after the weights
        are placed (None: ``device.memory_stats()``).
      reserve_bytes: what the largest step needs besides its arguments (:func:`step_reserve_bytes`).
      num_layers, num_kv_heads_per_device, head_dim, block_size, dtype: the cache's dimensions.
      device: the device whose stats to read when ``memory_stats`` is None.

    Raises:
      ValueError: no block fits (the message gives the budget and the reserve).
    """
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
    )
    return num_blocks
