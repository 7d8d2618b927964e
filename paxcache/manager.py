"""BlockManager: the stateful host-side wrapper around :mod:`paxcache.allocator`.

It maps user sequence ids (any hashable) to slots, calls the jitted pure functions and turns
their ``ok`` flags into typed :mod:`paxcache.errors`. On any error the manager's state (block
state and id map) is exactly what it was before the call: the pure functions leave a
refused slot unchanged and the manager only commits a new state on success.

Compilation: the jitted callables are module-level, so they are shared by every manager and
cached per :class:`CacheConfig` (the config is static metadata of the state pytree). Prompts are
padded to ``max_blocks_per_seq * block_size`` tokens, admissions to a bucket of 1 or 8
prompts (``ADMIT_BUCKETS``) and appended token ids to a power-of-two bucket, so steady-state
calls never recompile.

Slots: when every slot is taken, :meth:`BlockManager.allocate` and :meth:`BlockManager.fork`
raise :class:`~paxcache.errors.NoFreeSlotError`, a subclass of
:class:`~paxcache.errors.OutOfBlocksError` ("cannot admit now"); a prompt longer than
``max_model_len`` raises :class:`~paxcache.errors.SequenceTooLongError`.

Cache salts: ``cache_salt`` may be any hashable; the manager maps each distinct salt to a
distinct int32 tenant id with a dict (exact: no two salts ever share an id, and an id is never
reused; ``None`` is 0). Entries whose id no block or held sequence carries any more are dropped
now and then, so the map stays bounded however many tenants come and go.

Serving: the engine's scheduler (:mod:`paxcache.scheduler`) owns one manager and is its only
caller. Admission allocates with ``commit=False`` (blocks become visible to prefix lookups once
computed) and a ``reserve`` (blocks that must stay free for rows already planned), a step's
queued prompts in one call (:meth:`BlockManager.allocate_many`);
:meth:`BlockManager.swap_in` takes the same reserve. The fused device step runs the
allocator's ``append`` and ``commit`` on :attr:`BlockManager.state` itself and hands the
resulting state back through :meth:`BlockManager.adopt`. The manager may hold a state placed
on several devices (replicated over a tensor-parallel mesh) or abstract values (ahead-of-time
compilation): it never moves the state between devices.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Hashable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from paxcache import allocator
from paxcache.allocator.state import SLOT_INFO
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


ADMIT_BUCKETS = (1, 8)
"""Item counts one :meth:`BlockManager.allocate_many` call is padded to (a longer list is
split): one compiled admission program per bucket and ``commit`` flag. A lone admission
sends one prompt, as before batching; any other call eight, of which only the real ones run:
padding costs its transfer only, and each bucket costs a compile as long as the allocator's
(about 1.5 s on a CPU), so there are just two."""


@functools.partial(jax.jit, static_argnames=("commit",))
def _allocate_many(state, slots, token_ids, num_tokens, salts, count, reserve, *, commit):
    """Admits the first ``count`` items in order with ``allocator.allocate`` (``reserve``
    folded into its refusal), stopping at the first it refuses.

    Args: ``slots``, ``num_tokens``, ``salts``: i32[K]; ``token_ids``: i32[K, T]; ``count``,
    ``reserve``: i32[]. Items from ``count`` on are padding and never run (the loop's trip
    count is ``count`` at most, so padding costs only its transfer).

    Returns:
      ``(state, admitted i32[], cached i32[K], free i32[])``: the state after the admitted
      prefix of the items, its length, each item's cached-token count (valid below
      ``admitted``) and the free block count after (the scheduler asks for it next).
    """
    k = slots.shape[0]

    def more(carry):
        i, _, refused, _ = carry
        return (i < count) & ~refused

    def admit(carry):
        i, st, _, cached = carry
        st, res = allocator.allocate(
            st, slots[i], token_ids[i], num_tokens[i], salts[i], commit=commit, reserve=reserve
        )  # a refusal leaves ``st`` bitwise unchanged
        return i + 1, st, ~res.ok, cached.at[i].set(res.num_cached_tokens)

    zero = jnp.zeros((), jnp.int32)
    init = (zero, state, jnp.zeros((), bool), jnp.zeros((k,), jnp.int32))
    i, state, refused, cached = lax.while_loop(more, admit, init)
    return state, i - refused.astype(jnp.int32), cached, allocator.num_free_blocks(state)


_append = jax.jit(allocator.append, static_argnames=("commit",))
_commit = jax.jit(allocator.commit)
_fork = jax.jit(allocator.fork)
_free = jax.jit(allocator.free)
_swap_out = jax.jit(allocator.swap_out)
_swap_in = jax.jit(allocator.swap_in)
_check = jax.jit(allocator.check_invariants)
_num_free = jax.jit(allocator.num_free_blocks)
_num_free_host = jax.jit(allocator.num_free_host_blocks)
_prefix_counts = jax.jit(lambda st: (st.prefix_queries, st.prefix_hits))
_salts_in_use = jax.jit(lambda st: (st.block_salt, jax.numpy.where(st.active, st.slot_salt, 0)))

_SALT_GC_THRESHOLD = 4096
"""Salt-map size that triggers dropping the salts no block or held sequence carries."""


def _swapped_flags(slot_info: np.ndarray) -> np.ndarray:
    """bool[B] swap flags from a host copy of ``state.slot_info`` (i32[B, 5]); read on the
    host, as ``state.swapped`` would run (and first compile) device ops after warm-up."""
    return slot_info[:, SLOT_INFO.index("swapped")] != 0


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
        state: the initial :class:`~paxcache.allocator.BlockState` (default
            ``allocator.init(cfg)``); pass one already placed on the devices that will use it.

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

    def __init__(self, cfg: CacheConfig, *, state: allocator.BlockState | None = None) -> None:
        if not isinstance(cfg, CacheConfig):
            raise PaxcacheError(f"BlockManager expects a CacheConfig, got {type(cfg).__name__}")
        if state is not None and state.cfg != cfg:
            raise PaxcacheError("BlockManager: the given state was made for another CacheConfig")
        self._cfg = cfg
        # The one host record: which sequence id holds which slot (the device state knows
        # slots, not ids). Free slots and swap flags are the state's (``active``,
        # ``swapped``); nothing on the host mirrors them.
        self._slots: dict[Hashable, int] = {}
        self._salts: dict[Hashable, int] = {}  # cache_salt -> tenant id (None is 0, not stored)
        self._next_salt = 1
        self._salt_gc_at = _SALT_GC_THRESHOLD
        self._set_state(allocator.init(cfg) if state is None else state)

    def _set_state(self, state: allocator.BlockState, num_free: int | None = None) -> None:
        self._state = state
        self._num_free_cache = num_free  # device free count, read lazily
        self._num_free_host_cache: int | None = None

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
        if self._num_free_cache is None:
            self._num_free_cache = int(_num_free(self._state))
        return self._num_free_cache

    @property
    def num_free_host_blocks(self) -> int:
        """Free host-tier blocks."""
        if self._num_free_host_cache is None:
            self._num_free_host_cache = int(_num_free_host(self._state))
        return self._num_free_host_cache

    @property
    def num_free_slots(self) -> int:
        """Slots no sequence holds."""
        return self._cfg.max_seqs - len(self._slots)

    @property
    def free_slots(self) -> list[int]:
        """The slots no sequence holds, ascending."""
        held = set(self._slots.values())
        return [i for i in range(self._cfg.max_seqs) if i not in held]

    @property
    def prefix_cache_counts(self) -> tuple[int, int]:
        """``(queried, hit)`` prompt tokens over every allocation so far."""
        queries, hits = _prefix_counts(self._state)
        return int(queries), int(hits)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens looked up (0 if none)."""
        q, h = self.prefix_cache_counts
        return h / q if q else 0.0

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
        return int(np.asarray(self._state.seq_lens)[self.slot(seq_id)])

    def is_swapped(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id``'s blocks are on the host tier (reads the block state)."""
        return self._slot_swapped(self.slot(seq_id))

    def _slot_swapped(self, slot: int) -> bool:
        return bool(_swapped_flags(np.asarray(self._state.slot_info))[slot])

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Block ids of ``seq_id``, one per ``block_size`` tokens (host ids while swapped).

        With a sliding window, released leading blocks appear as -1.
        """
        slot = self.slot(seq_id)
        nblk = self._cfg.blocks_for(self.seq_len(seq_id))
        return [int(x) for x in np.asarray(self._state.block_tables)[slot, :nblk]]

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` tokens would be admitted now, ignoring hits."""
        if not self.num_free_slots or not 1 <= num_tokens <= self._cfg.max_model_len:
            return False
        free = self.num_free_blocks - self._cfg.blocks_for(num_tokens)
        return free >= self._cfg.watermark_blocks and free >= 0

    def check_invariants(self) -> dict[str, bool]:
        """:func:`allocator.check_invariants` plus the manager's own bookkeeping checks
        (named ``manager_*``): the id map holds exactly the state's active slots, cached counts
        are current."""
        checks = {k: bool(v) for k, v in _check(self._state).items()}
        info = jax.device_get(
            {
                "active": self._state.active,
                "free": _num_free(self._state),
                "host_free": _num_free_host(self._state),
            }
        )
        held = sorted(self._slots.values())
        checks["manager_slots_match_state"] = held == [
            int(i) for i in np.flatnonzero(info["active"])
        ]
        checks["manager_free_counts_current"] = self._num_free_cache in (
            None,
            int(info["free"]),
        ) and self._num_free_host_cache in (None, int(info["host_free"]))
        return checks

    # -- serving ---------------------------------------------------------------------------

    def adopt(self, state: allocator.BlockState, num_free_blocks: int | None = None) -> None:
        """Takes the state a fused device step returned.

        That step ran the allocator's ``append`` and ``commit`` on :attr:`state` (it never
        allocates, forks, frees or swaps a slot, so the slot map stays valid).

        Args:
            state: the step's new state (same config).
            num_free_blocks: its free-block count when the step returned it (saves a read).
        """
        self._set_state(state, num_free_blocks)

    def reset(self, state: allocator.BlockState | None = None) -> None:
        """Forgets every sequence and starts from an empty ``state`` (default
        ``allocator.init``), e.g. after a failed device step consumed the donated one. Salt
        ids stay reserved (never reused)."""
        self._slots.clear()
        self._set_state(allocator.init(self._cfg) if state is None else state)

    def warmup(self) -> None:
        """Compiles every program the serving calls use, by refused or empty calls (the state
        does not change)."""
        cfg, st = self._cfg, self._state
        none = np.zeros(cfg.max_seqs, bool)
        for k in ADMIT_BUCKETS:  # no item: the loop runs no iteration
            ids = np.zeros(k, np.int32)
            tokens = np.zeros((k, cfg.max_model_len), np.int32)
            _allocate_many(st, ids, tokens, ids, ids, np.int32(0), np.int32(0), commit=False)
        _fork(st, np.int32(-1), np.int32(-1))
        _free(st, none)
        if cfg.num_host_blocks > 0:
            _swap_out(st, none)
            _swap_in(st, none)
        _num_free(st)
        _num_free_host(st)
        _prefix_counts(st)

    # -- operations -----------------------------------------------------------------------

    def _peek_salt(self, cache_salt: Hashable | None, pending: dict[Hashable, int]) -> int:
        """The id ``cache_salt`` has or would get, registering nothing in the manager.
        ``pending``: the new salts of the items before it in one call, with the ids they get
        (a new one is added)."""
        if cache_salt is None:
            return 0
        try:
            sid = self._salts.get(cache_salt)
        except TypeError:
            raise PaxcacheError(
                f"cache_salt must be hashable, got {type(cache_salt).__name__}"
            ) from None
        if sid is not None:
            return sid
        if cache_salt in pending:
            return pending[cache_salt]
        sid = self._next_salt + len(pending)  # new salts take the next ids in order
        if sid > np.iinfo(np.int32).max:
            raise PaxcacheError("cache salt ids are exhausted (2**31 distinct salts); restart")
        pending[cache_salt] = sid
        return sid

    def _register_salt(self, cache_salt: Hashable | None, sid: int) -> None:
        """Records ``cache_salt``'s id ``sid`` (from :meth:`_peek_salt`; exact, never reused)."""
        if cache_salt is None or cache_salt in self._salts:
            return
        if len(self._salts) >= self._salt_gc_at:
            self._collect_salts()
        self._salts[cache_salt] = sid
        self._next_salt = max(self._next_salt, sid + 1)

    def _collect_salts(self) -> None:
        """Drops the salts whose id no block (cached or held) and no held slot carries: a
        later request with that salt gets a new id and loses nothing (no block had it)."""
        blocks, slots = jax.device_get(_salts_in_use(self._state))
        in_use = set(np.asarray(blocks).tolist()) | set(np.asarray(slots).tolist())
        self._salts = {k: v for k, v in self._salts.items() if v in in_use}
        self._salt_gc_at = max(_SALT_GC_THRESHOLD, 2 * len(self._salts))

    def _check_new_id(self, seq_id: Hashable, also: Collection[Hashable] = ()) -> None:
        """Raises unless ``seq_id`` is hashable and neither held nor among ``also``."""
        try:
            hash(seq_id)
        except TypeError:
            raise PaxcacheError(f"sequence id must be hashable, got {seq_id!r}") from None
        if seq_id in self._slots or seq_id in also:
            raise DuplicateSequenceError(f"sequence id {seq_id!r} is already allocated")

    def _no_free_slot(self) -> NoFreeSlotError:
        return NoFreeSlotError(f"all {self._cfg.max_seqs} sequence slots are in use")

    def _new_slot(self, seq_id: Hashable) -> int:
        self._check_new_id(seq_id)
        free = self.free_slots
        if not free:
            raise self._no_free_slot()
        return free[0]  # the lowest

    def _take_slot(self, seq_id: Hashable, slot: int) -> None:
        self._slots[seq_id] = slot

    def _prompt(self, token_ids: TokenIds) -> np.ndarray:
        """``token_ids`` as i32[n], checked to be an admissible prompt (1 to max_model_len)."""
        ids = _as_ids(token_ids)
        cfg = self._cfg
        if ids.size == 0:
            raise PaxcacheError("cannot allocate an empty prompt")
        if ids.size > cfg.max_model_len:
            raise SequenceTooLongError(
                f"prompt of {ids.size} tokens exceeds max_model_len={cfg.max_model_len} "
                f"(max_blocks_per_seq={cfg.max_blocks_per_seq} * block_size={cfg.block_size})"
            )
        return ids

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: TokenIds,
        cache_salt: Hashable | None = None,
        *,
        commit: bool = True,
        reserve: int = 0,
    ) -> int:
        """Admits a prompt; returns how many of its tokens were found in the prefix cache.

        One item of :meth:`allocate_many`, raising when it is not admitted.

        Args:
            seq_id: new sequence id (any hashable).
            token_ids: the prompt token ids (1 to ``max_model_len`` of them).
            cache_salt: tenant key; prompts with different salts never share blocks.
            commit: make the prompt's full blocks visible to lookups now (see
                :func:`allocator.allocate`); with False call :meth:`commit` once computed.
            reserve: blocks that must still be free afterwards, on top of the watermark
                (blocks already promised to other sequences this step).

        Raises:
            DuplicateSequenceError, NoFreeSlotError, SequenceTooLongError, OutOfBlocksError
            (watermark and reserve included), PaxcacheError for an empty prompt, an
            unhashable salt or a negative reserve.
        """
        got = self.allocate_many([(seq_id, token_ids, cache_salt)], commit=commit, reserve=reserve)
        if not got:
            cfg = self._cfg
            raise OutOfBlocksError(
                f"cannot allocate {seq_id!r} ({cfg.blocks_for(np.size(token_ids))} blocks, "
                f"fewer with prefix hits): {self.num_free_blocks} free, {reserve} reserved, "
                f"watermark {cfg.watermark_blocks}"
            )
        return got[0]

    def allocate_many(
        self,
        items: Sequence[tuple[Hashable, TokenIds, Hashable | None]],
        *,
        commit: bool = False,
        reserve: int = 0,
    ) -> list[int]:
        """Admits prompts in order, in one allocator call (one dispatch, one device read) per
        ``ADMIT_BUCKETS[-1]`` items, and stops at the first that cannot be admitted.

        Item ``i`` is admitted exactly as :meth:`allocate` would admit it right after the
        items before it: the lowest free slot, its prefix-cache hits (with ``commit`` the
        earlier items' full blocks among them), and refused when it does not get its blocks
        with ``reserve`` plus the watermark still free after it. The first refused item and
        every item after it are not attempted and change nothing.

        Args:
            items: ``(seq_id, token_ids, cache_salt)`` each: a new sequence id (any hashable),
                its prompt (1 to ``max_model_len`` token ids, i32[n_i]) and tenant key (see
                :meth:`allocate`; a new salt gets the same id in every item that has it).
            commit: as in :meth:`allocate`; default False (the scheduler's admissions).
            reserve: as in :meth:`allocate`, for every item.

        Returns:
            The prefix-cache hit (tokens) of each admitted item; the admitted items are the
            first ``len(result)`` of ``items``.

        Raises:
            Before anything changes, for the first invalid item, what :meth:`allocate` raises
            for it (PaxcacheError for an empty or non-integer prompt or an unhashable id or
            salt, SequenceTooLongError, DuplicateSequenceError: also for an id repeated in
            ``items``), NoFreeSlotError when ``items`` are more than the free slots, and
            PaxcacheError for a negative ``reserve``.

        Shapes: one call sends slots, lengths and salts as i32[K] and the prompts as
        i32[K, max_model_len], ``K`` = 1 for one item and 8 for 2 to 8 (``ADMIT_BUCKETS``;
        a longer list is split into calls of 8): two compiled programs per ``commit`` flag.
        """
        items = list(items)
        if reserve < 0:
            raise PaxcacheError(f"reserve must be >= 0, got {reserve}")
        free = self.free_slots
        prompts: list[np.ndarray] = []
        new_ids: set[Hashable] = set()
        pending: dict[Hashable, int] = {}
        salts: list[int] = []
        for i, (seq_id, token_ids, cache_salt) in enumerate(items):
            prompts.append(self._prompt(token_ids))
            self._check_new_id(seq_id, new_ids)
            if i >= len(free):
                raise self._no_free_slot()
            new_ids.add(seq_id)
            salts.append(self._peek_salt(cache_salt, pending))
        cached: list[int] = []
        cap = ADMIT_BUCKETS[-1]
        for start in range(0, len(items), cap):
            end = min(start + cap, len(items))
            got = self._allocate_chunk(
                prompts[start:end], free[start:end], salts[start:end], commit, reserve
            )
            for i in range(start, start + len(got)):
                self._register_salt(items[i][2], salts[i])
                self._take_slot(items[i][0], free[i])
            cached += got
            if len(got) < end - start:
                break
        return cached

    def _allocate_chunk(
        self,
        prompts: list[np.ndarray],
        slots: list[int],
        salts: list[int],
        commit: bool,
        reserve: int,
    ) -> list[int]:
        """One :func:`_allocate_many` call for up to ``ADMIT_BUCKETS[-1]`` checked items;
        adopts the state; returns the admitted prefix's cached-token counts."""
        n = len(prompts)
        k = next(b for b in ADMIT_BUCKETS if b >= n)
        tokens = np.zeros((k, self._cfg.max_model_len), np.int32)
        lens = np.zeros(k, np.int32)
        for j, ids in enumerate(prompts):
            tokens[j, : ids.size] = ids
            lens[j] = ids.size
        slot_arr = np.full(k, -1, np.int32)
        slot_arr[:n] = slots
        salt_arr = np.zeros(k, np.int32)
        salt_arr[:n] = salts
        state, admitted, cached, num_free = _allocate_many(
            self._state,
            slot_arr,
            tokens,
            lens,
            salt_arr,
            np.int32(n),
            np.int32(reserve),
            commit=commit,
        )
        admitted, cached, num_free = jax.device_get((admitted, cached, num_free))  # one read
        admitted = int(admitted)
        if admitted:
            self._set_state(state, int(num_free))
        else:  # refused: ``state`` is the old one, bitwise; keep it (and the count read)
            self._num_free_cache = int(num_free)
        return [int(c) for c in cached[:admitted]]

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
        lens, slot_info = jax.device_get((self._state.seq_lens, self._state.slot_info))
        swapped = _swapped_flags(slot_info)
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
            self._set_state(state)  # refused slots are bitwise unchanged in `state`
        return failed, cows

    def commit(self, num_computed: Mapping[Hashable, int]) -> None:
        """Makes the computed full blocks of each given sequence visible to prefix lookups.

        Args:
            num_computed: per sequence id, how many of its tokens have their KV written.
        """
        nc = np.zeros(self._cfg.max_seqs, np.int32)
        for seq_id, n in num_computed.items():
            nc[self.slot(seq_id)] = int(n)
        self._set_state(_commit(self._state, nc), self._num_free_cache)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Makes ``child_id`` share every block of ``parent_id`` (no copy until an append).

        Raises:
            UnknownSequenceError, DuplicateSequenceError, NoFreeSlotError,
            SequenceSwappedError.
        """
        parent = self.slot(parent_id)
        child = self._new_slot(child_id)
        state, res = _fork(self._state, np.int32(parent), np.int32(child))
        if not bool(np.asarray(res.ok)):  # the allocator refuses a swapped-out parent
            if self._slot_swapped(parent):
                raise SequenceSwappedError(f"cannot fork swapped-out sequence {parent_id!r}")
            raise PaxcacheError(f"fork of {parent_id!r} into {child_id!r} refused")
        self._set_state(state, self._num_free_cache)  # a fork takes no block
        self._take_slot(child_id, child)

    def free(self, seq_id: Hashable) -> None:
        """Releases every block of ``seq_id``; raises UnknownSequenceError on double free."""
        self.free_many([seq_id])

    def free_many(self, seq_ids: Collection[Hashable]) -> None:
        """Releases every block of each of ``seq_ids`` in one allocator call (one device
        program however many sequences finish in a step; ``free`` one by one would run one
        each). Nothing is freed if any id is unknown (UnknownSequenceError) or repeated
        (ValueError)."""
        slots = [self.slot(seq_id) for seq_id in seq_ids]
        if not slots:
            return
        if len(set(slots)) != len(slots):
            raise ValueError(f"free_many: a sequence id is repeated in {list(seq_ids)!r}")
        mask = np.zeros(self._cfg.max_seqs, bool)
        mask[slots] = True
        self._set_state(_free(self._state, mask))
        for seq_id in seq_ids:
            del self._slots[seq_id]

    def _swap(self, seq_id: Hashable, out: bool, reserve: int = 0) -> list[tuple[int, int]]:
        slot = self.slot(seq_id)
        mask = np.zeros(self._cfg.max_seqs, bool)
        mask[slot] = True
        state, plan = (_swap_out if out else _swap_in)(self._state, mask)
        ok, num, src, dst, slot_info = jax.device_get(
            (plan.ok, plan.num, plan.src, plan.dst, self._state.slot_info)
        )
        was_swapped = bool(_swapped_flags(slot_info)[slot])
        if not ok[slot]:  # the allocator refuses a slot on the wrong tier, or too few blocks
            if out and was_swapped:
                raise SequenceSwappedError(f"sequence {seq_id!r} is already swapped out")
            if not out and not was_swapped:
                raise SequenceSwappedError(f"sequence {seq_id!r} is not swapped out")
            where = "host" if out else "device"
            free = self.num_free_host_blocks if out else self.num_free_blocks
            raise OutOfBlocksError(
                f"not enough free {where} blocks to swap {'out' if out else 'in'} "
                f"{seq_id!r} ({free} free)"
            )
        num = int(num)
        num_free = None
        if not out:
            # Swap-in takes exactly ``num`` free blocks (the allocator keeps the watermark).
            num_free = self.num_free_blocks - num
            if num_free < reserve + self._cfg.watermark_blocks:
                raise OutOfBlocksError(
                    f"swapping {seq_id!r} in would leave {num_free} free blocks, fewer than "
                    f"the {reserve} reserved plus the watermark {self._cfg.watermark_blocks}"
                )
        self._set_state(state, num_free)
        return [(int(a), int(b)) for a, b in zip(src[:num], dst[:num], strict=True)]

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Moves ``seq_id`` to the host tier; returns ``(device_block, host_block)`` copies.

        Raises:
            UnknownSequenceError, SequenceSwappedError (already out), OutOfBlocksError (the
            host pool has no room; nothing changes).
        """
        return self._swap(seq_id, out=True)

    def swap_in(self, seq_id: Hashable, *, reserve: int = 0) -> list[tuple[int, int]]:
        """Moves ``seq_id`` back to the device; returns ``(host_block, device_block)`` copies.

        Args:
            seq_id: a swapped-out sequence.
            reserve: blocks that must still be free afterwards, on top of the watermark.

        Raises:
            UnknownSequenceError, SequenceSwappedError (not swapped out), OutOfBlocksError
            (too few free device blocks, reserve included; nothing changes).
        """
        return self._swap(seq_id, out=False, reserve=reserve)
