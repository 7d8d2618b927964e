"""Static configuration: frozen, hashable dataclasses validated on construction.

``CacheConfig`` is a static argument of every jitted allocator function (it lives in the
``BlockState`` pytree as non-array metadata), so it must be hashable and immutable; changing
any field means a new compilation.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["CacheConfig"]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"CacheConfig.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"CacheConfig.{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shape and policy of the paged KV cache.

    Attributes:
        num_blocks: N, device blocks. Every id ``0..N-1`` is usable; ``-1`` means "no block".
        block_size: S, tokens per block.
        max_seqs: B, sequence slots (rows of the block tables).
        max_blocks_per_seq: M, columns of the block tables; a sequence holds at most
            ``M * S`` tokens (``max_model_len``).
        num_host_blocks: NH, host-memory blocks for swapping (0 disables swapping).
        watermark: fraction of ``num_blocks`` kept free when admitting a prompt or swapping
            in (``watermark_blocks = int(watermark * num_blocks)``), as in vLLM.
        enable_prefix_caching: share full prompt blocks between sequences with an identical
            prefix (exact token match, keyed by parent block and cache salt).
        sliding_window: if set, attention sees only the last ``sliding_window`` keys and
            blocks wholly outside the window are released during decode.
    """

    num_blocks: int
    block_size: int = 16
    max_seqs: int = 256
    max_blocks_per_seq: int = 128
    num_host_blocks: int = 0
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _check_int("num_blocks", self.num_blocks, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("max_seqs", self.max_seqs, 1)
        _check_int("max_blocks_per_seq", self.max_blocks_per_seq, 1)
        _check_int("num_host_blocks", self.num_host_blocks, 0)
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)):
            raise ValueError(f"CacheConfig.watermark must be a float, got {self.watermark!r}")
        if not (0.0 <= float(self.watermark) < 1.0) or math.isnan(self.watermark):
            raise ValueError(f"CacheConfig.watermark must be in [0, 1), got {self.watermark}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                "CacheConfig.enable_prefix_caching must be a bool, "
                f"got {self.enable_prefix_caching!r}"
            )
        if self.sliding_window is not None:
            _check_int("sliding_window", self.sliding_window, 1)
        # Block ids, token positions and slot indices (block_id * S + offset) are int32.
        if self.num_blocks * self.block_size >= 2**31:
            raise ValueError(
                "CacheConfig.num_blocks * block_size must fit in int32, "
                f"got {self.num_blocks} * {self.block_size}"
            )

    @property
    def watermark_blocks(self) -> int:
        """Blocks that admission (allocate / swap_in) must leave free."""
        return int(self.watermark * self.num_blocks)

    @property
    def max_model_len(self) -> int:
        """Most tokens one sequence can hold: ``max_blocks_per_seq * block_size``."""
        return self.max_blocks_per_seq * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        return -(-int(num_tokens) // self.block_size)
