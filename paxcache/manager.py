"""BlockManager: the stateful host-side wrapper around :mod:`paxcache.allocator`.

It maps user sequence ids (any hashable) to slots, calls the jitted pure functions and turns
their ``ok`` flags into typed :mod:`paxcache.errors`. On any error the manager's state (block
state, id map, slot pool) is exactly what it was before the call: the pure functions leave a
refused slot unchanged and the manager only commits a new state on success.

Compilation: the jitted callables are module-level, so they are shared by every manager and
cached per :class:`CacheConfig` (the config is static metadata of the state pytree). Prompts are
padded to ``max_blocks_per_seq * block_size`` tokens and appended token ids to a power-of-two
bucket, so steady-state calls never recompile.

Slots: when every slot is taken, :meth:`BlockManager.allocate` and :meth:`BlockManager.fork`
raise :class:`~paxcache.errors.NoFreeSlotError`, a subclass of
:class:`~paxcache.errors.OutOfBlocksError` ("cannot admit now"); a prompt longer than
``max_model_len`` raises :class:`~paxcache.errors.SequenceTooLongError`.

Cache salts: ``cache_salt`` may be any hashable; the manager maps each distinct salt to a
distinct int32 tenant id with a dict (exact: no two salts ever share an id; ``None`` is 0).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence

import jax
import numpy as np

from paxcache import allocator
from paxcache.config import CacheConfig
from paxcache.errors import (
    DuplicateSequenceError,
    NoFreeSlotError,
    OutOfBlocksError,
    PaxcacheError,
    SequenceSwappedError,
    SequenceTooLongError,
    UnknownSequenceError,
)

__all__ = ["BlockManager"]

_allocate = jax.jit(allocator.allocate, static_argnames=("commit",))
_append = jax.jit(allocator.append, static_argnames=("commit",))
_commit = jax.jit(allocator.commit)
_fork = jax.jit(allocator.fork)
_free = jax.jit(allocator.free)
_swap_out = jax.jit(allocator.swap_out)
_swap_in = jax.jit(allocator.swap_in)
_check = jax.jit(allocator.check_invariants)

TokenIds = Sequence[int] | np.ndarray | jax.Array


def _as_ids(token_ids: TokenIds) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise PaxcacheError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise PaxcacheError(f"token_ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int32)


def _bucket(n: int, cap: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return min(max(size, 1), max(cap, 1))


class BlockManager:
    """Host-side block manager with Python errors (see the module docstring).

    Args:
        cfg: the cache configuration.

    Example:
        >>> bm = BlockManager(CacheConfig(num_blocks=64, block_size=16, max_seqs=8,
        ...                               max_blocks_per_seq=16))
        >>> bm.allocate("a", list(range(40)))   # tokens found in the prefix cache
        0
        >>> bm.append("a", [7])                 # copy-on-write pairs to apply
        []
        >>> len(bm.block_table("a"))
        3
    """

    def __init__(self, cfg: CacheConfig) -> None:
        if not isinstance(cfg, CacheConfig):
            raise PaxcacheError(f"BlockManager expects a CacheConfig, got {type(cfg).__name__}")
        self._cfg = cfg
        self._state = allocator.init(cfg)
        self._slots: dict[Hashable, int] = {}
        self._free_slots: list[int] = list(range(cfg.max_seqs))
        self._salts: dict[Hashable, int] = {}

    # -- read-only views ------------------------------------------------------------------

    @property
    def cfg(self) -> CacheConfig:
        """The cache configuration."""
        return self._cfg

    @property
    def state(self) -> allocator.BlockState:
        """The current :class:`~paxcache.allocator.BlockState` (immutable arrays)."""
        return self._state

    @property
    def num_free_blocks(self) -> int:
        """Device blocks available to new allocations (free plus evictable cached)."""
        return int(allocator.num_free_blocks(self._state))

    @property
    def num_free_host_blocks(self) -> int:
        """Free host-tier blocks."""
        return int(self._state.host_num_free)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens looked up (0 if none)."""
        q = int(self._state.prefix_queries)
        return int(self._state.prefix_hits) / q if q else 0.0

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, seq_id: Hashable) -> int:
        """The slot (row of the block tables) holding ``seq_id``."""
        try:
            return self._slots[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(f"unknown sequence id {seq_id!r}") from None

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens held by ``seq_id``."""
        return int(self._state.seq_lens[self.slot(seq_id)])

    def is_swapped(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id``'s blocks are on the host tier."""
        return bool(self._state.swapped[self.slot(seq_id)])

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Block ids of ``seq_id``, one per ``block_size`` tokens (host ids while swapped).

        With a sliding window, released leading blocks appear as -1.
        """
        slot = self.slot(seq_id)
        nblk = self._cfg.blocks_for(int(self._state.seq_lens[slot]))
        return [int(x) for x in np.asarray(self._state.block_tables[slot, :nblk])]

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` tokens would be admitted now, ignoring hits."""
        if not self._free_slots or not 1 <= num_tokens <= self._cfg.max_model_len:
            return False
        free = self.num_free_blocks - self._cfg.blocks_for(num_tokens)
        return free >= self._cfg.watermark_blocks and free >= 0

    def check_invariants(self) -> dict[str, bool]:
        """:func:`allocator.check_invariants` plus the manager's own bookkeeping checks."""
        checks = {k: bool(v) for k, v in _check(self._state).items()}
        active = np.asarray(self._state.active)
        checks["manager_slots_match_state"] = (
            sorted(self._slots.values()) == sorted(int(i) for i in np.flatnonzero(active))
            and len(self._slots) + len(self._free_slots) == self._cfg.max_seqs
        )
        return checks

    # -- operations -----------------------------------------------------------------------

    def _salt_id(self, cache_salt: Hashable | None) -> int:
        if cache_salt is None:
            return 0
        try:
            return self._salts[cache_salt]
        except KeyError:
            return len(self._salts) + 1
        except TypeError:
            raise PaxcacheError(f"cache_salt must be hashable, got {cache_salt!r}") from None

    def _new_slot(self, seq_id: Hashable) -> int:
        try:
            hash(seq_id)
        except TypeError:
            raise PaxcacheError(f"sequence id must be hashable, got {seq_id!r}") from None
        if seq_id in self._slots:
            raise DuplicateSequenceError(f"sequence id {seq_id!r} is already allocated")
        if not self._free_slots:
            raise NoFreeSlotError(f"all {self._cfg.max_seqs} sequence slots are in use")
        return self._free_slots[0]

    def _take_slot(self, seq_id: Hashable, slot: int) -> None:
        assert heapq.heappop(self._free_slots) == slot
        self._slots[seq_id] = slot

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: TokenIds,
        cache_salt: Hashable | None = None,
        *,
        commit: bool = True,
    ) -> int:
        """Admits a prompt; returns how many of its tokens were found in the prefix cache.

        Args:
            seq_id: new sequence id (any hashable).
            token_ids: the prompt token ids (1 to ``max_model_len`` of them).
            cache_salt: tenant key; prompts with different salts never share blocks.
            commit: make the prompt's full blocks visible to lookups now (see
                :func:`allocator.allocate`); with False call :meth:`commit` once computed.

        Raises:
            DuplicateSequenceError, NoFreeSlotError, SequenceTooLongError, OutOfBlocksError
            (watermark included), PaxcacheError for an empty prompt.
        """
        ids = _as_ids(token_ids)
        cfg = self._cfg
        if ids.size == 0:
            raise PaxcacheError("cannot allocate an empty prompt")
        if ids.size > cfg.max_model_len:
            raise SequenceTooLongError(
                f"prompt of {ids.size} tokens exceeds max_model_len={cfg.max_model_len} "
                f"(max_blocks_per_seq={cfg.max_blocks_per_seq} * block_size={cfg.block_size})"
            )
        slot = self._new_slot(seq_id)
        salt = self._salt_id(cache_salt)
        padded = np.zeros(cfg.max_model_len, np.int32)
        padded[: ids.size] = ids
        state, res = _allocate(
            self._state, np.int32(slot), padded, np.int32(ids.size), np.int32(salt), commit=commit
        )
        if not bool(res.ok):
            raise OutOfBlocksError(
                f"cannot allocate {cfg.blocks_for(ids.size)} blocks for {seq_id!r}: "
                f"{self.num_free_blocks} free, watermark {cfg.watermark_blocks}"
            )
        self._state = state
        self._take_slot(seq_id, slot)
        if cache_salt is not None:
            self._salts.setdefault(cache_salt, salt)
        return int(res.num_cached_tokens)

    def append(
        self, seq_id: Hashable, token_ids: TokenIds | int, *, commit: bool = True
    ) -> list[tuple[int, int]]:
        """Grows ``seq_id`` by the given new tokens (ids, or just a count).

        Returns:
            The copy-on-write ``(src, dst)`` block pairs the caller must copy (0 or 1).

        Raises:
            UnknownSequenceError, SequenceSwappedError, SequenceTooLongError,
            OutOfBlocksError.
        """
        failed, cows = self._append_many({seq_id: token_ids}, commit=commit)
        if failed:
            raise failed[seq_id]
        return cows[seq_id]

    def append_batch(
        self, requests: Mapping[Hashable, TokenIds | int], *, commit: bool = True
    ) -> tuple[dict[Hashable, list[tuple[int, int]]], dict[Hashable, PaxcacheError]]:
        """Appends to several sequences in one jitted call (the scheduler's decode step).

        Slots are served in ascending slot order under the allocator's prefix rule. Sequences
        that fail are left unchanged; the others proceed.

        Returns:
            ``(cow, failed)``: per succeeded id its copy-on-write pairs, per failed id the
            error that :meth:`append` would have raised.
        """
        failed, cows = self._append_many(requests, commit=commit)
        return cows, failed

    def _append_many(
        self, requests: Mapping[Hashable, TokenIds | int], *, commit: bool
    ) -> tuple[dict[Hashable, PaxcacheError], dict[Hashable, list[tuple[int, int]]]]:
        cfg = self._cfg
        b = cfg.max_seqs
        counts = np.zeros(b, np.int32)
        rows: dict[int, np.ndarray] = {}
        failed: dict[Hashable, PaxcacheError] = {}
        slots: dict[Hashable, int] = {}
        lens = np.asarray(self._state.seq_lens)
        swapped = np.asarray(self._state.swapped)
        for seq_id, toks in requests.items():
            slot = self.slot(seq_id)
            if isinstance(toks, (int, np.integer)) and not isinstance(toks, bool):
                if toks < 0:
                    raise PaxcacheError(f"cannot append a negative count ({toks})")
                n, ids = int(toks), None
            else:
                ids = _as_ids(toks)
                n = int(ids.size)
            if swapped[slot]:
                failed[seq_id] = SequenceSwappedError(f"sequence {seq_id!r} is swapped out")
                continue
            if lens[slot] + n > cfg.max_model_len:
                failed[seq_id] = SequenceTooLongError(
                    f"sequence {seq_id!r} would hold {lens[slot] + n} tokens "
                    f"> max_model_len={cfg.max_model_len}"
                )
                continue
            counts[slot] = n
            slots[seq_id] = slot
            if ids is not None and n:
                rows[slot] = ids
        if not counts.any():
            return failed, {k: [] for k in slots}
        token_arr = None
        if rows and cfg.enable_prefix_caching:
            width = _bucket(max(r.size for r in rows.values()), cfg.max_model_len)
            token_arr = np.zeros((b, width), np.int32)
            for slot, ids in rows.items():
                token_arr[slot, : ids.size] = ids
        state, res = _append(self._state, counts, token_arr, commit=commit)
        ok = np.asarray(res.ok)
        dst = np.asarray(res.slot_copy_dst)
        last_col = np.minimum(lens // cfg.block_size, cfg.max_blocks_per_seq - 1)
        src = np.asarray(self._state.block_tables)[np.arange(b), last_col]
        cows: dict[Hashable, list[tuple[int, int]]] = {}
        for seq_id, slot in slots.items():
            if not ok[slot]:
                failed[seq_id] = OutOfBlocksError(
                    f"no free block to append {counts[slot]} tokens to {seq_id!r}"
                )
            else:
                cows[seq_id] = [(int(src[slot]), int(dst[slot]))] if dst[slot] >= 0 else []
        if cows:
            self._state = state  # refused slots are bitwise unchanged in `state`
        return failed, cows

    def commit(self, num_computed: Mapping[Hashable, int]) -> None:
        """Makes the computed full blocks of each given sequence visible to prefix lookups.

        Args:
            num_computed: per sequence id, how many of its tokens have their KV written.
        """
        nc = np.zeros(self._cfg.max_seqs, np.int32)
        for seq_id, n in num_computed.items():
            nc[self.slot(seq_id)] = int(n)
        self._state = _commit(self._state, nc)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Makes ``child_id`` share every block of ``parent_id`` (no copy until an append).

        Raises:
            UnknownSequenceError, DuplicateSequenceError, NoFreeSlotError,
            SequenceSwappedError.
        """
        parent = self.slot(parent_id)
        if bool(self._state.swapped[parent]):
            raise SequenceSwappedError(f"cannot fork swapped-out sequence {parent_id!r}")
        child = self._new_slot(child_id)
        state, res = _fork(self._state, np.int32(parent), np.int32(child))
        if not bool(res.ok):  # pragma: no cover - guarded above
            raise PaxcacheError(f"fork of {parent_id!r} into {child_id!r} refused")
        self._state = state
        self._take_slot(child_id, child)

    def free(self, seq_id: Hashable) -> None:
        """Releases every block of ``seq_id``; raises UnknownSequenceError on double free."""
        slot = self.slot(seq_id)
        mask = np.zeros(self._cfg.max_seqs, bool)
        mask[slot] = True
        self._state = _free(self._state, mask)
        del self._slots[seq_id]
        heapq.heappush(self._free_slots, slot)

    def _swap(self, seq_id: Hashable, out: bool) -> list[tuple[int, int]]:
        slot = self.slot(seq_id)
        swapped = bool(self._state.swapped[slot])
        if out and swapped:
            raise SequenceSwappedError(f"sequence {seq_id!r} is already swapped out")
        if not out and not swapped:
            raise SequenceSwappedError(f"sequence {seq_id!r} is not swapped out")
        mask = np.zeros(self._cfg.max_seqs, bool)
        mask[slot] = True
        state, plan = (_swap_out if out else _swap_in)(self._state, mask)
        if not bool(plan.ok[slot]):
            where = "host" if out else "device"
            free = self.num_free_host_blocks if out else self.num_free_blocks
            raise OutOfBlocksError(
                f"not enough free {where} blocks to swap {'out' if out else 'in'} "
                f"{seq_id!r} ({free} free)"
            )
        self._state = state
        num = int(plan.num)
        src, dst = np.asarray(plan.src[:num]), np.asarray(plan.dst[:num])
        return [(int(a), int(b)) for a, b in zip(src, dst, strict=True)]

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Moves ``seq_id`` to the host tier; returns ``(device_block, host_block)`` copies."""
        return self._swap(seq_id, out=True)

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Moves ``seq_id`` back to the device; returns ``(host_block, device_block)`` copies."""
        return self._swap(seq_id, out=False)
