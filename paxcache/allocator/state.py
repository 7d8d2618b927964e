"""The allocator state (:class:`BlockState`), the results of its operations, and :func:`init`.

Small per-block, per-slot and scalar fields are *packed* into three arrays (``counters``,
``slot_info``, ``cache_keys``): the state is dispatched on every step, and each pytree leaf
costs about a microsecond of host overhead per call. Each packed field has its own property
(``state.num_free``, ``state.active``, ``state.key_hash``, ...), and
:meth:`BlockState.replace` accepts the packed names too, so code reads and writes them like
stored fields.

Also here: the array helpers every operation uses (clamped gathers, a fast prefix sum).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from paxcache.config import CacheConfig

__all__ = [
    "AllocateResult",
    "AppendResult",
    "BlockState",
    "ForkResult",
    "SwapPlan",
    "init",
    "num_free_blocks",
    "num_free_host_blocks",
]

I32 = jnp.int32
U32 = jnp.uint32
INT_MAX = jnp.iinfo(jnp.int32).max

# Column layout of the packed arrays.
COUNTERS = ("num_free", "num_evictable", "host_num_free", "clock", "prefix_queries", "prefix_hits")
SLOT_INFO = ("active", "swapped", "slot_salt", "num_registered", "num_known_tokens")
CACHE_KEYS = ("key_hash", "parent_block", "parent_gen", "gen", "block_salt", "block_pos")
KEY = {k: i for i, k in enumerate(CACHE_KEYS)}
"""Column of each cache-key field in ``cache_keys``."""

_COUNTER = {k: i for i, k in enumerate(COUNTERS)}
_SLOT = {k: i for i, k in enumerate(SLOT_INFO)}
_PACKED = {
    **{k: ("counters", i) for k, i in _COUNTER.items()},
    **{k: ("slot_info", i) for k, i in _SLOT.items()},
    **{k: ("cache_keys", i) for k, i in KEY.items()},
}


@dataclasses.dataclass(frozen=True)
class BlockState:
    """The whole allocator state (a pytree of arrays; ``cfg`` is static metadata).

    Stored arrays:
        cfg: the static :class:`CacheConfig`.
        ref_counts: i32[N] number of (device) block-table references to each block.
        free_stack: i32[N] free block ids in ``free_stack[:num_free]`` (top = last); the rest
            is stale.
        cached: bool[N] block is registered in the prefix cache (visible to lookups).
        last_access: i32[N] ``clock`` at the last hit / registration / release to 0 refs.
        block_tokens: i32[N, S] token ids stored in each block (valid for cached blocks).
        cache_keys: i32[N, 6] packed per-block cache keys (the properties below).
        block_tables: i32[B, M] position-indexed device (or, if swapped, host) block ids; -1
            for none.
        seq_lens: i32[B] tokens held by each slot.
        slot_info: i32[B, 5] packed per-slot fields (the properties below).
        host_ref_counts: i32[NH] references from swapped slots to each host block.
        host_free_stack: i32[NH] free host ids in ``host_free_stack[:host_num_free]``.
        counters: i32[6] packed scalars (the properties below).

    Packed fields, read as properties (and accepted by :meth:`replace`): see each property.

    A pytree (``jax.tree_util.register_dataclass``; ``cfg`` is static metadata), immutable:
    every operation returns a new state.
    """

    cfg: CacheConfig
    ref_counts: jax.Array
    free_stack: jax.Array
    cached: jax.Array
    last_access: jax.Array
    block_tokens: jax.Array
    cache_keys: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    slot_info: jax.Array
    host_ref_counts: jax.Array
    host_free_stack: jax.Array
    counters: jax.Array

    def replace(self, **updates: Any) -> BlockState:
        """A copy with ``updates`` applied; stored and packed field names are both accepted
        (a packed field is written into its column of the packed array)."""
        for name in [k for k in updates if k in _PACKED]:
            arr_name, col = _PACKED[name]
            arr = updates.get(arr_name, getattr(self, arr_name))
            val = jnp.asarray(updates.pop(name))
            if name == "key_hash":
                val = lax.bitcast_convert_type(val.astype(U32), I32)
            val = val.astype(I32)
            updates[arr_name] = arr.at[col].set(val) if arr.ndim == 1 else arr.at[:, col].set(val)
        return dataclasses.replace(self, **updates)

    # -- counters: i32[6] --------------------------------------------------------------------

    @property
    def num_free(self) -> jax.Array:
        """i32[] blocks on the free stack (ref 0 and not cached)."""
        return self.counters[_COUNTER["num_free"]]

    @property
    def num_evictable(self) -> jax.Array:
        """i32[] blocks with ref 0 still held by the prefix cache."""
        return self.counters[_COUNTER["num_evictable"]]

    @property
    def host_num_free(self) -> jax.Array:
        """i32[] free host blocks."""
        return self.counters[_COUNTER["host_num_free"]]

    @property
    def clock(self) -> jax.Array:
        """i32[] logical time, +1 per mutating call."""
        return self.counters[_COUNTER["clock"]]

    @property
    def prefix_queries(self) -> jax.Array:
        """i32[] prompt tokens looked up in the prefix cache."""
        return self.counters[_COUNTER["prefix_queries"]]

    @property
    def prefix_hits(self) -> jax.Array:
        """i32[] prompt tokens found in the prefix cache."""
        return self.counters[_COUNTER["prefix_hits"]]

    # -- slot_info: i32[B, 5] ----------------------------------------------------------------

    @property
    def active(self) -> jax.Array:
        """bool[B] slot holds a sequence."""
        return self.slot_info[:, _SLOT["active"]] != 0

    @property
    def swapped(self) -> jax.Array:
        """bool[B] slot's blocks are on the host tier."""
        return self.slot_info[:, _SLOT["swapped"]] != 0

    @property
    def slot_salt(self) -> jax.Array:
        """i32[B] cache salt of each slot's sequence."""
        return self.slot_info[:, _SLOT["slot_salt"]]

    @property
    def num_registered(self) -> jax.Array:
        """i32[B] leading blocks of the slot registered in (or hit from) the prefix cache;
        registration continues from here."""
        return self.slot_info[:, _SLOT["num_registered"]]

    @property
    def num_known_tokens(self) -> jax.Array:
        """i32[B] leading tokens whose ids are recorded in ``block_tokens``."""
        return self.slot_info[:, _SLOT["num_known_tokens"]]

    # -- cache_keys: i32[N, 6] ---------------------------------------------------------------

    @property
    def key_hash(self) -> jax.Array:
        """u32[N] hash of the cache key of a cached block."""
        return lax.bitcast_convert_type(self.cache_keys[:, KEY["key_hash"]], U32)

    @property
    def parent_block(self) -> jax.Array:
        """i32[N] cached block's parent block id (-1 for a first block)."""
        return self.cache_keys[:, KEY["parent_block"]]

    @property
    def parent_gen(self) -> jax.Array:
        """i32[N] ``gen`` of the parent when this block was registered."""
        return self.cache_keys[:, KEY["parent_gen"]]

    @property
    def gen(self) -> jax.Array:
        """i32[N] generation of each block, bumped on eviction."""
        return self.cache_keys[:, KEY["gen"]]

    @property
    def block_salt(self) -> jax.Array:
        """i32[N] cache salt (tenant id) a cached block was registered with."""
        return self.cache_keys[:, KEY["block_salt"]]

    @property
    def block_pos(self) -> jax.Array:
        """i32[N] block index within its sequence (LRU tie-break: deeper first)."""
        return self.cache_keys[:, KEY["block_pos"]]


jax.tree_util.register_dataclass(
    BlockState,
    data_fields=[f.name for f in dataclasses.fields(BlockState) if f.name != "cfg"],
    meta_fields=["cfg"],
)


@struct.dataclass
class AllocateResult:
    """Result of :func:`paxcache.allocator.allocate`.

    Attributes:
        ok: bool[] the prompt was admitted.
        num_cached_tokens: i32[] prompt tokens found in the prefix cache (0 if refused).
    """

    ok: jax.Array
    num_cached_tokens: jax.Array


@struct.dataclass
class AppendResult:
    """Result of :func:`paxcache.allocator.append`.

    Attributes:
        ok: bool[B] the slot grew by its count (always True for a count of 0).
        copy_src: i32[B] copy-on-write sources, compacted: first ``num_copies`` valid, rest -1.
        copy_dst: i32[B] copy-on-write destinations, same layout.
        num_copies: i32[] number of copy-on-write pairs.
        slot_copy_dst: i32[B] per slot: the fresh block it copied into, or -1.
    """

    ok: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array
    num_copies: jax.Array
    slot_copy_dst: jax.Array


@struct.dataclass
class ForkResult:
    """Result of :func:`paxcache.allocator.fork`.

    Attributes:
        ok: bool[] the child now shares every block of the parent.
    """

    ok: jax.Array


@struct.dataclass
class SwapPlan:
    """Result of :func:`paxcache.allocator.swap_out` / :func:`paxcache.allocator.swap_in`: the
    block copies to perform.

    Attributes:
        ok: bool[B] the slot was swapped (all of its blocks); False for unmasked slots.
        src: i32[NH] source block ids (device ids for swap_out, host ids for swap_in), the
            first ``num`` valid, rest -1.
        dst: i32[NH] destination block ids, same layout.
        num: i32[] number of blocks to copy.
    """

    ok: jax.Array
    src: jax.Array
    dst: jax.Array
    num: jax.Array


def init(cfg: CacheConfig) -> BlockState:
    """Returns the empty state for ``cfg``: every block free, every slot empty."""
    if not isinstance(cfg, CacheConfig):
        raise ValueError(f"init expects a CacheConfig, got {type(cfg).__name__}")
    n, s, b, m, nh = (
        cfg.num_blocks,
        cfg.block_size,
        cfg.max_seqs,
        cfg.max_blocks_per_seq,
        cfg.num_host_blocks,
    )

    counters = {"num_free": n, "host_num_free": nh, "clock": 1}
    cache_keys = jnp.zeros((n, len(CACHE_KEYS)), I32)
    # Every leaf is a distinct buffer, so the state can be donated.
    return BlockState(
        cfg=cfg,
        ref_counts=jnp.zeros((n,), I32),
        # Reversed so that the first pops hand out 0, 1, 2, ...
        free_stack=jnp.arange(n - 1, -1, -1, dtype=I32),
        cached=jnp.zeros((n,), bool),
        last_access=jnp.zeros((n,), I32),
        block_tokens=jnp.zeros((n, s), I32),
        cache_keys=cache_keys.at[:, KEY["parent_block"]].set(-1),
        block_tables=jnp.full((b, m), -1, I32),
        seq_lens=jnp.zeros((b,), I32),
        slot_info=jnp.zeros((b, len(SLOT_INFO)), I32),
        host_ref_counts=jnp.zeros((nh,), I32),
        host_free_stack=jnp.arange(nh - 1, -1, -1, dtype=I32),
        counters=jnp.array([counters.get(k, 0) for k in COUNTERS], I32),
    )


def num_free_blocks(state: BlockState) -> jax.Array:
    """i32[] blocks available for allocation: the free stack plus evictable cached blocks."""
    return state.num_free + state.num_evictable


def num_free_host_blocks(state: BlockState) -> jax.Array:
    """i32[] free host-tier blocks."""
    return state.host_num_free


def tick(state: BlockState) -> BlockState:
    """Advances the logical clock by one (every successful mutating call)."""
    return state.replace(clock=state.clock + 1)


# ---------------------------------------------------------------------------------------------
# Array helpers


def i32(x: Any) -> jax.Array:
    return jnp.asarray(x, dtype=I32)


def cumsum(x: jax.Array) -> jax.Array:
    """Inclusive prefix sum of a 1-D array.

    ``jnp.cumsum`` lowers to a reduce-window that costs O(n^2) on XLA:CPU (about 55 us for
    4,096 elements); the associative scan is O(n log n) and several times faster.
    """
    return lax.associative_scan(jnp.add, x)


def take(arr: jax.Array, idx: jax.Array) -> jax.Array:
    """``arr[idx]`` along axis 0 with clamped indices.

    Callers pass in-range (or deliberately clamped) indices. On XLA:CPU this form is several
    times faster than default ``arr[idx]`` indexing (about 8 us vs 60 us for 4,096 indices).
    """
    return jnp.take(arr, idx, axis=0, mode="clip")


def take2(arr: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
    """``arr[rows, cols]`` for a 2-D ``arr`` with clamped indices (see :func:`take`)."""
    return take(arr.reshape(-1), rows * arr.shape[1] + jnp.clip(cols, 0, arr.shape[1] - 1))
