"""Typed errors raised by the host-side wrappers (never inside jit).

Every error is a :class:`PaxcacheError`, itself a :class:`ValueError`, so callers that only
know about ``ValueError`` still catch them. The pure functions in :mod:`paxcache.allocator`
never raise; they return ``ok`` flags that :class:`paxcache.manager.BlockManager` turns into
these exceptions. Whenever one of them is raised, the manager's state is exactly what it was
before the call.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "DuplicateSequenceError",
    "NoFreeSlotError",
    "OutOfBlocksError",
    "PaxcacheError",
    "SequenceSwappedError",
    "SequenceTooLongError",
    "UnknownSequenceError",
]


class PaxcacheError(ValueError):
    """Base class of every paxcache error."""


class OutOfBlocksError(PaxcacheError):
    """Not enough free blocks (device or host tier, watermark included) for the operation."""


class NoFreeSlotError(OutOfBlocksError):
    """Every sequence slot (``CacheConfig.max_seqs``) is taken.

    A subclass of :class:`OutOfBlocksError`: for a scheduler both mean "cannot admit now,
    retry after something finishes".
    """


class UnknownSequenceError(PaxcacheError, KeyError):
    """The sequence id is not allocated (never was, or was already freed: double free)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateSequenceError(PaxcacheError):
    """The sequence id is already allocated."""


class SequenceTooLongError(PaxcacheError):
    """The sequence would exceed ``max_blocks_per_seq * block_size`` tokens."""


class SequenceSwappedError(PaxcacheError):
    """The operation needs the sequence on the device (or on the host) and it is not there."""


class CheckpointError(PaxcacheError):
    """A checkpoint is unusable or unsafe: missing or malformed file, a shard path outside the
    checkpoint directory, a config value out of range, a missing or mis-shaped tensor.

    The message names the file and the field or tensor. ``paxcache.models.loading`` raises
    only this class and its subclasses for a bad checkpoint (never a raw ``TypeError`` or
    ``safetensors`` error).
    """
