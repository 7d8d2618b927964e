"""Functional paged-KV block allocator: ``BlockState`` plus pure, jit-compiled step functions.

Every function takes a :class:`BlockState` and returns a new one (plus a small result
dataclass). They are pure, static-shaped, batched over sequence slots (no Python loop over
sequences) and never raise inside jit: each reports ``ok`` flags instead, and a refused
operation leaves the state of the refused slot bitwise unchanged (for single-slot operations:
the whole state). They can be ``jax.jit``-ed on their own (the config is static pytree
metadata, so the state is the only array argument) or traced inside a larger jitted function
(the engine fuses :func:`append` into its model step).

Conventions
-----------
* **Block ids.** Every id ``0..N-1`` is a usable block; there is no reserved null block.
  ``-1`` means "no block" in block tables and plans. Consumers (kernels) must never
  dereference a negative id.
* **Tables are position-indexed.** Column ``c`` of ``block_tables[slot]`` holds the block of
  tokens ``[c*S, (c+1)*S)``. With a sliding window, released columns hold ``-1``.
* **Free pool.** A block is *free* iff its ref count is 0 and the prefix cache does not hold
  it. Free blocks live on a stack (``free_stack[:num_free]``). Blocks with ref count 0 that the
  prefix cache still holds are *evictable*: they count as free (``num_free_blocks``) but are
  only taken, least-recently-used first, when the stack runs short (a ``lax.cond`` path, so
  the common path does no O(N log N) work).
* **Serving order.** When blocks run short in a batched call, slots are served in ascending
  slot index with a *prefix rule*: ``ok = need == 0 | cumsum(need) <= available``
  (``cumsum`` in slot order, over the slots that asked for something). Once a slot is refused,
  every later slot that needs a block is refused too, even if it would have fitted.
  :func:`swap_out` / :func:`swap_in` use the strict form ``ok = cumsum(need) <= available``.
  ``available`` is free + evictable blocks for :func:`append` (no watermark, as vLLM's
  append), free + evictable - watermark for :func:`swap_in`, free host blocks for
  :func:`swap_out`; :func:`allocate` needs ``free + evictable - cost >= watermark``.
* **Copy-on-write.** In :func:`append`, a slot that writes into its last, partially filled
  block while that block's ref count is > 1 gets a fresh block, its table points to it, the
  shared block's ref count drops by one and ``(src, dst)`` is reported. When several slots
  sharing one partial block append in the same call, they are taken in slot order: slot ``i``
  copies iff ``ref - (writers of that block before i) > 1``, so when every holder writes, the
  last one keeps the block in place (exactly as serving them one by one, vLLM-style). The
  decision is made on the state at the start of the call and does not depend on which slots
  are refused (a refused writer's view below its length is never touched).
* **Sliding window** (``cfg.sliding_window = W``): a query at position ``p`` sees keys in
  ``(p - W, p]``. When :func:`append` grows a sequence from ``L`` tokens, every block wholly
  below position ``L - W + 1`` is released (its table entry set to ``-1``), so a decoding
  sequence never holds more than ``ceil(W / S) + 1`` blocks. :func:`allocate` keeps every
  prompt block (the prompt may be computed in chunks). Blocks released by a call return to
  the pool at the end of that call (they do not fund the same call's allocations).
* **Prefix caching** (``cfg.enable_prefix_caching``). A full block is cached under the key
  ``(parent block id, parent generation, salt, its S token ids)``. ``gen[b]`` is bumped each
  time block ``b`` is evicted, so children of an evicted parent can never be matched again.
  A 32-bit hash of the key (``key_hash``) finds the candidate; the hit is then verified on the
  exact stored tokens, parent, parent generation and salt (never a hash alone). A hit never
  covers the whole prompt: at least one token is left to compute. Identical keys registered
  concurrently may yield duplicate cached blocks; lookups take the lowest id (harmless).
  Counters ``prefix_queries`` / ``prefix_hits`` count *tokens* (prompt tokens looked up /
  prompt tokens found) over successful :func:`allocate` calls. Freed cached blocks stay
  evictable until their space is needed; never-cached free blocks are always used first, then
  evictable ones are evicted oldest ``last_access`` first, deepest block (largest position in
  its sequence) first on ties, then lowest id. A hit on an evictable block revives it.
* **Visibility of not-yet-computed blocks.** ``allocate(..., commit=True)`` (the default)
  makes the prompt's full blocks visible to later lookups at once (vLLM v0: the prompt is
  computed in the same step). With ``commit=False`` they become visible only when
  :func:`commit` is called with ``num_computed`` covering them, so another request never hits
  a block whose KV is not written yet (chunked prefill). :func:`append` with ``token_ids``
  records the new tokens so that blocks filled during decode become cacheable; with
  ``commit=True`` it registers them at once, otherwise :func:`commit` does. Without token ids
  those blocks (and everything after them in that sequence) are simply not cached.
* **Swapping.** The host tier has its own ref counts and free stack. A swapped slot's table
  holds *host* ids while ``swapped[slot]`` is set. A block shared by several slots swapped in
  the same call moves once. Plans are fixed length ``NH`` (padded with ``-1``) plus ``num``.
  A swapped-in sequence's blocks are not prefix-cacheable any more (tokens are not kept on
  the host).
* ``clock`` advances by one on every successful mutating call and stamps ``last_access``.
* **Performance.** The decode path of :func:`append` does O(B) work (no sort, no O(N) pass,
  no serial scan over slots); calls that release blocks (sliding window, copy-on-write) or
  evict add one O(N) pass under a ``lax.cond``. Small fields are packed into a few arrays
  because every pytree leaf costs host dispatch time. See ``scripts/bench_allocator.py``.

Shape letters: B slots (``max_seqs``), N device blocks, NH host blocks, S block size,
M max blocks per sequence, T tokens.
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
    "allocate",
    "append",
    "check_invariants",
    "commit",
    "fork",
    "free",
    "init",
    "num_free_blocks",
    "num_free_host_blocks",
    "slot_mapping",
    "swap_in",
    "swap_out",
]

_I32 = jnp.int32
_U32 = jnp.uint32
_INT_MAX = jnp.iinfo(jnp.int32).max


# Column layout of the packed arrays. The state is dispatched on every step, and each pytree
# leaf costs about a microsecond of host overhead per call, so small per-block, per-slot and
# scalar fields are packed into a few arrays and exposed under their own names (properties;
# ``replace`` accepts them too).
_COUNTERS = ("num_free", "num_evictable", "host_num_free", "clock", "prefix_queries", "prefix_hits")
_SLOT_INFO = ("active", "swapped", "slot_salt", "num_registered", "num_known_tokens")
_CACHE_KEYS = ("key_hash", "parent_block", "parent_gen", "gen", "block_salt", "block_pos")
_BOOL_FIELDS = ("active", "swapped")
_PACKED = {
    **{k: ("counters", i) for i, k in enumerate(_COUNTERS)},
    **{k: ("slot_info", i) for i, k in enumerate(_SLOT_INFO)},
    **{k: ("cache_keys", i) for i, k in enumerate(_CACHE_KEYS)},
}
_KEY = {k: i for i, k in enumerate(_CACHE_KEYS)}


@struct.dataclass
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

    Packed fields, read as properties (and accepted by ``replace``):
        num_free: i32[] blocks on the free stack (ref 0 and not cached).
        num_evictable: i32[] blocks with ref 0 still held by the prefix cache.
        host_num_free: i32[] free host blocks.
        clock: i32[] logical time, +1 per mutating call.
        prefix_queries: i32[] prompt tokens looked up in the prefix cache.
        prefix_hits: i32[] prompt tokens found in the prefix cache.
        active: bool[B] slot holds a sequence.
        swapped: bool[B] slot's blocks are on the host tier.
        slot_salt: i32[B] cache salt of each slot's sequence.
        num_registered: i32[B] leading blocks of the slot registered in (or hit from) the
            prefix cache; registration continues from here.
        num_known_tokens: i32[B] leading tokens whose ids are recorded in ``block_tokens``.
        key_hash: u32[N] hash of the cache key of a cached block.
        parent_block: i32[N] cached block's parent block id (-1 for a first block).
        parent_gen: i32[N] ``gen`` of the parent when this block was registered.
        gen: i32[N] generation of each block, bumped on eviction.
        block_salt: i32[N] cache salt (tenant id) a cached block was registered with.
        block_pos: i32[N] block index within its sequence (LRU tie-break: deeper first).
    """

    cfg: CacheConfig = struct.field(pytree_node=False)
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

    def __getattr__(self, name: str) -> Any:
        try:
            arr_name, col = _PACKED[name]
        except KeyError:
            raise AttributeError(f"BlockState has no field {name!r}") from None
        arr = object.__getattribute__(self, arr_name)
        val = arr[col] if arr_name == "counters" else arr[:, col]
        if name in _BOOL_FIELDS:
            return val != 0
        if name == "key_hash":
            return lax.bitcast_convert_type(jnp.asarray(val), _U32)
        return val


def _state_replace(self: BlockState, **updates: Any) -> BlockState:
    """``dataclasses.replace`` that also accepts the packed field names."""
    packed = {k: updates.pop(k) for k in list(updates) if k in _PACKED}
    for name, val in packed.items():
        arr_name, col = _PACKED[name]
        arr = updates.get(arr_name, getattr(self, arr_name))
        val = jnp.asarray(val)
        if name == "key_hash":
            val = lax.bitcast_convert_type(val.astype(_U32), _I32)
        val = val.astype(_I32)
        arr = arr.at[col].set(val) if arr_name == "counters" else arr.at[:, col].set(val)
        updates[arr_name] = arr
    return dataclasses.replace(self, **updates)


BlockState.replace = _state_replace  # type: ignore[method-assign]


@struct.dataclass
class AllocateResult:
    """Result of :func:`allocate`.

    Attributes:
        ok: bool[] the prompt was admitted.
        num_cached_tokens: i32[] prompt tokens found in the prefix cache (0 if refused).
    """

    ok: jax.Array
    num_cached_tokens: jax.Array


@struct.dataclass
class AppendResult:
    """Result of :func:`append`.

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
    """Result of :func:`fork`.

    Attributes:
        ok: bool[] the child now shares every block of the parent.
    """

    ok: jax.Array


@struct.dataclass
class SwapPlan:
    """Result of :func:`swap_out` / :func:`swap_in`: the block copies to perform.

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


# ---------------------------------------------------------------------------------------------
# helpers


def _i32(x: Any) -> jax.Array:
    return jnp.asarray(x, dtype=_I32)


def _cumsum(x: jax.Array) -> jax.Array:
    """Inclusive prefix sum of a 1-D array.

    ``jnp.cumsum`` lowers to a reduce-window that costs O(n^2) on XLA:CPU (about 55 us for
    4,096 elements); the associative scan is O(n log n) and several times faster.
    """
    return lax.associative_scan(jnp.add, x)


def _take(arr: jax.Array, idx: jax.Array) -> jax.Array:
    """``arr[idx]`` along axis 0 with clamped indices.

    Callers pass in-range (or deliberately clamped) indices. On XLA:CPU this form is several
    times faster than default ``arr[idx]`` indexing (about 8 us vs 60 us for 4,096 indices).
    """
    return jnp.take(arr, idx, axis=0, mode="clip")


def _take2(arr: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
    """``arr[rows, cols]`` for a 2-D ``arr`` with clamped indices (see :func:`_take`)."""
    return _take(arr.reshape(-1), rows * arr.shape[1] + jnp.clip(cols, 0, arr.shape[1] - 1))


def _rank_among_equal(keys: jax.Array) -> jax.Array:
    """i32[B]: how many earlier entries (lower index) of ``keys`` i32[B] hold the same value."""
    k = keys.shape[0]
    order = jnp.argsort(keys, stable=True)
    sorted_keys = _take(keys, order)
    pos = jnp.arange(k, dtype=_I32)
    start = jnp.concatenate([jnp.ones((1,), bool), sorted_keys[1:] != sorted_keys[:-1]])
    group_start = lax.associative_scan(jnp.maximum, jnp.where(start, pos, 0))
    return jnp.zeros((k,), _I32).at[order].set(pos - group_start)


def _hash_key(tokens: jax.Array, salt: jax.Array, parent: jax.Array, pgen: jax.Array) -> jax.Array:
    """u32[...] hash of a cache key; ``tokens`` i32[..., S], the others broadcast to [...]."""
    h = jnp.full(tokens.shape[:-1], 2166136261, _U32)
    mult = jnp.uint32(0x01000193)
    for v in (salt, parent, pgen):
        h = (h ^ jnp.asarray(v).astype(_U32)) * mult
        h = h ^ (h >> 13)
    for i in range(tokens.shape[-1]):
        h = (h ^ tokens[..., i].astype(_U32)) * mult
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    return h ^ (h >> 13)


def _decref(ref: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Decrements ``ref`` once per entry of ``ids`` (i32[K], negative = skip).

    Returns:
        The new ref counts and bool[K]: this entry is the one (of possibly several equal
        entries) elected to report that its block's count reached 0.
    """
    size = ref.shape[0]
    k = ids.shape[0]
    valid = ids >= 0
    safe = jnp.where(valid, ids, size)
    ref = ref.at[safe].add(-1, mode="drop")
    idx = jnp.arange(k, dtype=_I32)
    first = jnp.full((size,), k, _I32).at[safe].min(idx, mode="drop")
    clipped = jnp.clip(ids, 0, size - 1)
    zeroed = valid & (_take(first, clipped) == idx) & (_take(ref, clipped) == 0)
    return ref, zeroed


def _push(stack: jax.Array, num: jax.Array, ids: jax.Array, mask: jax.Array):
    """Pushes ``ids[mask]`` (distinct) onto ``stack``; returns (stack, num)."""
    m = mask.astype(_I32)
    pos = num + _cumsum(m) - m
    stack = stack.at[jnp.where(mask, pos, stack.shape[0])].set(ids, mode="drop")
    return stack, num + jnp.sum(m)


def _release(state: BlockState, ids: jax.Array) -> BlockState:
    """Drops one device reference per entry of ``ids`` (i32[K], -1 = skip).

    Blocks whose count reaches 0 go back on the free stack, or become evictable if the
    prefix cache holds them (stamped with the current clock for LRU).
    """

    def run(state: BlockState) -> BlockState:
        ref, zeroed = _decref(state.ref_counts, ids)
        cached = _take(state.cached, ids)
        to_free = zeroed & ~cached
        to_evict = zeroed & cached
        stack, num_free = _push(state.free_stack, state.num_free, ids, to_free)
        n = state.cfg.num_blocks
        last_access = state.last_access.at[jnp.where(to_evict, ids, n)].set(
            state.clock, mode="drop"
        )
        return state.replace(
            ref_counts=ref,
            free_stack=stack,
            num_free=num_free,
            num_evictable=state.num_evictable + jnp.sum(to_evict.astype(_I32)),
            last_access=last_access,
        )

    return lax.cond(jnp.any(ids >= 0), run, lambda s: s, state)


def _release_host(state: BlockState, ids: jax.Array) -> BlockState:
    """Drops one host reference per entry of ``ids`` (i32[K], -1 = skip)."""
    ref, zeroed = _decref(state.host_ref_counts, ids)
    stack, num = _push(state.host_free_stack, state.host_num_free, ids, zeroed)
    return state.replace(host_ref_counts=ref, host_free_stack=stack, host_num_free=num)


def _ensure_free(state: BlockState, total: jax.Array) -> BlockState:
    """Makes ``free_stack`` hold at least ``total`` blocks by evicting LRU cached blocks.

    The caller guarantees ``total <= num_free + num_evictable``. Eviction order: smallest
    ``last_access`` first, then the deepest block (largest ``block_pos``), then lowest id.
    Evicted blocks leave the cache (their ``gen`` is bumped) and are pushed on the stack.
    """
    if not state.cfg.enable_prefix_caching:
        return state

    def evict(state: BlockState) -> BlockState:
        n = state.cfg.num_blocks
        k = total - state.num_free
        evictable = (state.ref_counts == 0) & state.cached
        primary = jnp.where(evictable, state.last_access, _INT_MAX)
        order = jnp.lexsort((jnp.arange(n, dtype=_I32), -state.block_pos, primary))
        take = jnp.arange(n, dtype=_I32) < k
        stack, num_free = _push(state.free_stack, state.num_free, order.astype(_I32), take)
        sel = jnp.where(take, order, n)
        return state.replace(
            free_stack=stack,
            num_free=num_free,
            num_evictable=state.num_evictable - k,
            cached=state.cached.at[sel].set(False, mode="drop"),
            cache_keys=state.cache_keys.at[sel, _KEY["gen"]].add(1, mode="drop"),
        )

    return lax.cond(total > state.num_free, evict, lambda s: s, state)


def _pop_at(state: BlockState, rank: jax.Array) -> jax.Array:
    """Block id ``rank`` places below the top of the free stack (rank 0 = top)."""
    idx = jnp.clip(state.num_free - 1 - rank, 0, state.cfg.num_blocks - 1)
    return _take(state.free_stack, idx)


def _register(
    state: BlockState, slots: jax.Array, mask: jax.Array, hi: jax.Array, width: int
) -> BlockState:
    """Registers blocks ``[num_registered, hi)`` of each masked slot in the prefix cache.

    Args:
        state: the state.
        slots: i32[R] slot indices.
        mask: bool[R] which rows to process.
        hi: i32[R] registration end (exclusive, in blocks); tokens must be recorded.
        width: static; at most ``width`` blocks per slot are registered in this call
            (callers pass ``M`` or, on a fast path, 1 after checking ``hi - lo <= 1``).

    Registration continues a slot's chain only if its previous block is cached; blocks that
    are already cached (hits, or shared with a fork sibling) are skipped but extend the chain.
    """
    cfg = state.cfg
    n, m = cfg.num_blocks, cfg.max_blocks_per_seq
    lo = state.num_registered[slots]
    rows = state.block_tables[slots]  # [R, M]
    r = slots.shape[0]
    ridx = jnp.arange(r, dtype=_I32)
    par_blk = jnp.where(lo > 0, rows[ridx, jnp.clip(lo - 1, 0, m - 1)], -1)
    par_ok = (lo == 0) | ((par_blk >= 0) & _take(state.cached, par_blk))
    hi = jnp.minimum(hi, lo + width)
    go = mask & par_ok & (hi > lo)
    cols = lo[:, None] + jnp.arange(width, dtype=_I32)[None, :]  # [R, W]
    in_range = go[:, None] & (cols < hi[:, None])
    blk = jnp.where(in_range, rows[ridx[:, None], jnp.clip(cols, 0, m - 1)], -1)
    # A released (-1) column breaks the chain: stop before the first one.
    bad = in_range & (blk < 0)
    first_bad = jnp.min(jnp.where(bad, cols, m), axis=1)
    hi = jnp.minimum(hi, first_bad)
    in_range = in_range & (cols < hi[:, None])
    prev = jnp.concatenate([par_blk[:, None], blk[:, :-1]], axis=1)
    safe_blk = jnp.clip(blk, 0, n - 1)
    safe_prev = jnp.clip(prev, 0, n - 1)
    already = _take(state.cached, safe_blk)
    write = in_range & ~already
    pgen = jnp.where(prev >= 0, _take(state.gen, safe_prev), 0)
    salt = jnp.broadcast_to(state.slot_salt[slots][:, None], blk.shape)
    h = _hash_key(_take(state.block_tokens, safe_blk), salt, prev, pgen)
    tgt = jnp.where(write, blk, n).reshape(-1)

    def put(arr: jax.Array, val: Any) -> jax.Array:
        val = jnp.broadcast_to(jnp.asarray(val, arr.dtype), blk.shape).reshape(-1)
        return arr.at[tgt].set(val, mode="drop")

    key_cols = ("key_hash", "parent_block", "parent_gen", "block_salt", "block_pos")
    key_vals = jnp.stack(
        [lax.bitcast_convert_type(h, _I32), prev, pgen, salt, jnp.broadcast_to(cols, blk.shape)],
        axis=-1,
    ).reshape(-1, len(key_cols))
    key_idx = jnp.array([_KEY[k] for k in key_cols], _I32)
    return state.replace(
        cached=put(state.cached, True),
        cache_keys=state.cache_keys.at[tgt[:, None], key_idx[None, :]].set(key_vals, mode="drop"),
        last_access=put(state.last_access, state.clock),
        num_registered=state.num_registered.at[jnp.where(go, slots, cfg.max_seqs)].set(
            jnp.maximum(lo, hi), mode="drop"
        ),
    )


def _register_batch(state: BlockState, mask: jax.Array, hi: jax.Array) -> BlockState:
    """:func:`_register` over all slots, with a one-block fast path (decode)."""
    cfg = state.cfg
    slots = jnp.arange(cfg.max_seqs, dtype=_I32)
    span = jnp.where(mask, hi - state.num_registered, 0)
    if cfg.max_blocks_per_seq == 1:
        return _register(state, slots, mask, hi, 1)
    return lax.cond(
        jnp.max(span) <= 1,
        lambda s: _register(s, slots, mask, hi, 1),
        lambda s: _register(s, slots, mask, hi, cfg.max_blocks_per_seq),
        state,
    )


def _tick(state: BlockState) -> BlockState:
    return state.replace(clock=state.clock + 1)


# ---------------------------------------------------------------------------------------------
# public API


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
    cache_keys = jnp.zeros((n, len(_CACHE_KEYS)), _I32)
    # Every leaf is a distinct buffer, so the state can be donated.
    return BlockState(
        cfg=cfg,
        ref_counts=jnp.zeros((n,), _I32),
        # Reversed so that the first pops hand out 0, 1, 2, ...
        free_stack=jnp.arange(n - 1, -1, -1, dtype=_I32),
        cached=jnp.zeros((n,), bool),
        last_access=jnp.zeros((n,), _I32),
        block_tokens=jnp.zeros((n, s), _I32),
        cache_keys=cache_keys.at[:, _KEY["parent_block"]].set(-1),
        block_tables=jnp.full((b, m), -1, _I32),
        seq_lens=jnp.zeros((b,), _I32),
        slot_info=jnp.zeros((b, len(_SLOT_INFO)), _I32),
        host_ref_counts=jnp.zeros((nh,), _I32),
        host_free_stack=jnp.arange(nh - 1, -1, -1, dtype=_I32),
        counters=jnp.array([counters.get(k, 0) for k in _COUNTERS], _I32),
    )


def num_free_blocks(state: BlockState) -> jax.Array:
    """i32[] blocks available for allocation: the free stack plus evictable cached blocks."""
    return state.num_free + state.num_evictable


def num_free_host_blocks(state: BlockState) -> jax.Array:
    """i32[] free host-tier blocks."""
    return state.host_num_free


def _lookup(state: BlockState, blocks: jax.Array, max_hit: jax.Array, salt: jax.Array):
    """Longest verified cached chain for the prompt blocks ``blocks`` i32[M, S].

    Returns (number of hit blocks, i32[M] hit ids with -1 beyond).
    """
    cfg = state.cfg
    n, m = cfg.num_blocks, cfg.max_blocks_per_seq

    def cond(c):
        j, _, good, _ = c
        return good & (j < max_hit)

    def body(c):
        j, prev, _, ids = c
        toks = lax.dynamic_index_in_dim(blocks, j, keepdims=False)
        pgen = jnp.where(prev >= 0, state.gen[jnp.clip(prev, 0, n - 1)], 0)
        h = _hash_key(toks[None], salt, prev, pgen)[0]
        cand_mask = state.cached & (state.key_hash == h)
        cand = jnp.argmax(cand_mask).astype(_I32)
        good = (
            cand_mask[cand]
            & (state.parent_block[cand] == prev)
            & (state.parent_gen[cand] == pgen)
            & (state.block_salt[cand] == salt)
            & jnp.all(state.block_tokens[cand] == toks)
        )
        ids = ids.at[j].set(jnp.where(good, cand, -1))
        return j + good.astype(_I32), jnp.where(good, cand, prev), good, ids

    init_c = (_i32(0), _i32(-1), jnp.bool_(True), jnp.full((m,), -1, _I32))
    h, _, _, ids = lax.while_loop(cond, body, init_c)
    return h, ids


def allocate(
    state: BlockState,
    slot: jax.Array | int,
    token_ids: jax.Array,
    num_tokens: jax.Array | int,
    salt: jax.Array | int = 0,
    *,
    commit: bool = True,
) -> tuple[BlockState, AllocateResult]:
    """Admits a prompt of ``num_tokens`` tokens into the empty ``slot``.

    Args:
        state: the state.
        slot: i32[] target slot (may be traced); must be empty.
        token_ids: i32[T] prompt token ids padded to any fixed length T (T is static; pad to
            ``M * S`` to compile once). Only the first ``num_tokens`` are read.
        num_tokens: i32[] prompt length, ``1 <= num_tokens <= min(T, M * S)`` (may be traced).
        salt: i32[] cache salt (tenant id): prompts with different salts never share blocks.
        commit: static. True: the prompt's full blocks are visible to later lookups at once.
            False: only once :func:`commit` says they are computed.

    Returns:
        ``(state, AllocateResult)``. Refused (``ok=False``, state bitwise unchanged) when the
        slot is out of range or taken, ``num_tokens`` is out of range, or the free blocks
        minus the blocks needed (fresh blocks plus revived evictable hits) would fall below
        ``cfg.watermark_blocks``.
    """
    cfg = state.cfg
    n, s, b, m = cfg.num_blocks, cfg.block_size, cfg.max_seqs, cfg.max_blocks_per_seq
    slot = _i32(slot)
    num_tokens = _i32(num_tokens)
    salt = _i32(salt)
    token_ids = jnp.asarray(token_ids, _I32).reshape(-1)
    t = token_ids.shape[0]
    token_ids = jnp.pad(token_ids, (0, m * s - t)) if t < m * s else token_ids[: m * s]
    blocks = token_ids.reshape(m, s)
    safe_slot = jnp.clip(slot, 0, b - 1)

    valid = (
        (slot >= 0)
        & (slot < b)
        & ~state.active[safe_slot]
        & (num_tokens >= 1)
        & (num_tokens <= min(t, m * s))
    )
    nblk = (num_tokens + s - 1) // s
    cols = jnp.arange(m, dtype=_I32)
    if cfg.enable_prefix_caching:
        max_hit = jnp.where(valid, (num_tokens - 1) // s, 0)
        num_hit, hit_ids = _lookup(state, blocks, max_hit, salt)
    else:
        num_hit, hit_ids = _i32(0), jnp.full((m,), -1, _I32)
    hit_valid = hit_ids >= 0
    safe_hit = jnp.clip(hit_ids, 0, n - 1)
    revived = hit_valid & (state.ref_counts[safe_hit] == 0)
    num_revived = jnp.sum(revived.astype(_I32))
    needed = nblk - num_hit
    avail_after = num_free_blocks(state) - num_revived - needed
    ok = valid & (avail_after >= cfg.watermark_blocks) & (avail_after >= 0)

    # Every update below is masked by `ok` (scatters go out of bounds and are dropped), so a
    # refused call returns the old state bitwise without an O(state) select.
    oki = ok.astype(_I32)
    new = state
    # Revive / reference the hit blocks first so that eviction cannot pick them.
    hit_tgt = jnp.where(hit_valid & ok, hit_ids, n)
    new = new.replace(
        ref_counts=new.ref_counts.at[hit_tgt].add(1, mode="drop"),
        last_access=new.last_access.at[hit_tgt].set(new.clock, mode="drop"),
        num_evictable=new.num_evictable - num_revived * oki,
    )
    new = _ensure_free(new, needed * oki)
    fresh_mask = ok & (cols >= num_hit) & (cols < nblk)
    fresh_ids = jnp.where(fresh_mask, _pop_at(new, cols - num_hit), -1)
    row = jnp.where(hit_valid, hit_ids, fresh_ids)
    fresh_tgt = jnp.where(fresh_mask, fresh_ids, n)
    tslot = jnp.where(ok, safe_slot, b)

    def put(arr: jax.Array, val: Any) -> jax.Array:
        return arr.at[tslot].set(val, mode="drop")

    new = new.replace(
        ref_counts=new.ref_counts.at[fresh_tgt].set(1, mode="drop"),
        num_free=new.num_free - needed * oki,
        block_tables=put(new.block_tables, row),
        seq_lens=put(new.seq_lens, num_tokens),
        active=put(new.active, True),
        swapped=put(new.swapped, False),
        slot_salt=put(new.slot_salt, salt),
        num_registered=put(new.num_registered, num_hit),
        num_known_tokens=put(new.num_known_tokens, num_tokens),
    )
    if cfg.enable_prefix_caching:
        new = new.replace(
            block_tokens=new.block_tokens.at[fresh_tgt].set(blocks, mode="drop"),
            prefix_queries=new.prefix_queries + num_tokens * oki,
            prefix_hits=new.prefix_hits + num_hit * s * oki,
        )
        if commit:
            new = _register(new, safe_slot[None], ok[None], (num_tokens // s)[None], m)
    out = new.replace(clock=new.clock + oki)
    return out, AllocateResult(ok=ok, num_cached_tokens=jnp.where(ok, num_hit * s, 0))


def append(
    state: BlockState,
    num_new_tokens: jax.Array,
    token_ids: jax.Array | None = None,
    *,
    commit: bool = True,
) -> tuple[BlockState, AppendResult]:
    """Grows every slot by its own token count in one call (decode or a prompt chunk).

    Args:
        state: the state.
        num_new_tokens: i32[B] tokens to add per slot (>= 0; 0 = untouched, always ok).
        token_ids: optional i32[B, T] ids of the new tokens (first ``num_new_tokens[b]`` of row
            b are read; T static). With prefix caching, recorded so that blocks filled here
            become cacheable. Without them those blocks are not cached.
        commit: static; with ``token_ids``, register newly full blocks at once (True) or
            leave it to :func:`commit` (False).

    Returns:
        ``(state, AppendResult)``. A slot is refused (``ok=False``, left unchanged) if it is
        empty or swapped, would exceed ``M * S`` tokens, or does not get all the blocks it
        needs under the prefix rule (module docstring). New blocks are taken at block
        boundaries; a shared partial last block is copied on write (see ``copy_*``).
    """
    cfg = state.cfg
    n, s, b, m = cfg.num_blocks, cfg.block_size, cfg.max_seqs, cfg.max_blocks_per_seq
    nt = jnp.asarray(num_new_tokens, _I32).reshape(b)
    rows = jnp.arange(b, dtype=_I32)
    length = state.seq_lens
    new_len = length + nt
    live = state.active & ~state.swapped
    want = live & (nt > 0) & (new_len <= m * s)
    nb_old = (length + s - 1) // s
    nb_new = (new_len + s - 1) // s
    new_blocks = jnp.where(want, nb_new - nb_old, 0)
    last_col = jnp.clip(length // s, 0, m - 1)
    last_blk = _take2(state.block_tables, rows, last_col)
    last_ref = _take(state.ref_counts, last_blk)
    writes_shared = want & (length % s != 0) & (last_blk >= 0) & (last_ref > 1)
    rank = lax.cond(
        jnp.any(writes_shared),
        lambda: _rank_among_equal(jnp.where(writes_shared, last_blk, n)),
        lambda: jnp.zeros((b,), _I32),
    )
    # Like serving the writers of one shared block in slot order: each copies while someone
    # else still holds the block, and the last one (when every holder writes) keeps it.
    cow = writes_shared & (last_ref - rank > 1)
    need = new_blocks + cow.astype(_I32)
    csum = _cumsum(need)
    granted = want & ((need == 0) | (csum <= num_free_blocks(state)))
    ok = (nt == 0) | granted
    need_g = jnp.where(granted, need, 0)
    total = jnp.sum(need_g)
    rank0 = _cumsum(need_g) - need_g

    new = _ensure_free(state, total)
    cow_g = cow & granted
    first_rank = rank0 + cow_g.astype(_I32)

    # First new block of every slot: a [B] scatter outside any cond (the decode hot path;
    # XLA copies operands that a cond branch updates in place).
    ids = jnp.where(granted & (new_blocks >= 1), _pop_at(new, first_rank), -1)
    col = jnp.where(ids >= 0, jnp.clip(nb_old, 0, m - 1), m)
    ref = new.ref_counts.at[jnp.where(ids >= 0, ids, n)].set(1, mode="drop")
    tables = new.block_tables.at[rows, col].set(ids, mode="drop")

    def more_blocks(args):  # appends that cross several block boundaries (prompt chunks)
        tables, ref = args
        cols = jnp.arange(m, dtype=_I32)[None, :]
        sel = granted[:, None] & (cols > nb_old[:, None]) & (cols < nb_new[:, None])
        ids = _pop_at(new, first_rank[:, None] + cols - nb_old[:, None])
        ref = ref.at[jnp.where(sel, ids, n).reshape(-1)].set(1, mode="drop")
        return jnp.where(sel, ids, tables), ref

    if m > 1:
        tables, ref = lax.cond(jnp.max(new_blocks) > 1, more_blocks, lambda a: a, (tables, ref))
    new = new.replace(
        ref_counts=ref,
        block_tables=tables,
        seq_lens=jnp.where(granted, new_len, length),
    )

    def copy_on_write(new: BlockState):
        cow_dst = jnp.where(cow_g, _pop_at(new, rank0), -1)
        cow_src = jnp.where(cow_g, last_blk, -1)
        dst_tgt = jnp.where(cow_g, cow_dst, n)
        new = new.replace(
            block_tables=new.block_tables.at[rows, jnp.where(cow_g, last_col, m)].set(
                cow_dst, mode="drop"
            ),
            ref_counts=new.ref_counts.at[dst_tgt].set(1, mode="drop"),
        )
        if cfg.enable_prefix_caching:
            src_tokens = _take(new.block_tokens, last_blk)
            tokens = new.block_tokens.at[dst_tgt].set(src_tokens, mode="drop")
            new = new.replace(block_tokens=tokens)
        # The source loses one reference per copier; num_free must already be final here.
        new = _release(new.replace(num_free=new.num_free - total), cow_src)
        cm = cow_g.astype(_I32)
        cpos = jnp.where(cow_g, _cumsum(cm) - cm, b)
        copy_src = jnp.full((b,), -1, _I32).at[cpos].set(cow_src, mode="drop")
        copy_dst = jnp.full((b,), -1, _I32).at[cpos].set(cow_dst, mode="drop")
        return new, copy_src, copy_dst, cow_dst

    def no_copy(new: BlockState):
        none = jnp.full((b,), -1, _I32)
        return new.replace(num_free=new.num_free - total), none, none, none

    new, copy_src, copy_dst, cow_dst = lax.cond(jnp.any(cow_g), copy_on_write, no_copy, new)

    if cfg.sliding_window is not None:
        start = jnp.maximum(length - cfg.sliding_window + 1, 0) // s  # first kept column
        cols = jnp.arange(m, dtype=_I32)[None, :]
        drop = granted[:, None] & (cols < start[:, None]) & (new.block_tables >= 0)
        released = jnp.where(drop, new.block_tables, -1)
        new = new.replace(block_tables=jnp.where(drop, -1, new.block_tables))
        new = _release(new, released.reshape(-1))

    if cfg.enable_prefix_caching:
        known = new.num_known_tokens
        if token_ids is not None:
            tok = jnp.asarray(token_ids, _I32).reshape(b, -1)
            tw = tok.shape[1]
            steps = jnp.arange(tw, dtype=_I32)[None, :]
            pos = length[:, None] + steps
            blk = _take2(new.block_tables, rows[:, None], pos // s)
            wr = granted[:, None] & (steps < nt[:, None]) & (blk >= 0)
            new = new.replace(
                block_tokens=new.block_tokens.at[jnp.where(wr, blk, n), pos % s].set(
                    tok, mode="drop"
                )
            )
            extend = granted & (known == length) & (nt <= tw)
            known = jnp.where(extend, new_len, known)
            new = new.replace(num_known_tokens=known)
            if commit:
                new = _register_batch(new, granted, known // s)
    new = _tick(new)
    return new, AppendResult(
        ok=ok,
        copy_src=copy_src,
        copy_dst=copy_dst,
        num_copies=jnp.sum(cow_g.astype(_I32)),
        slot_copy_dst=cow_dst,
    )


def commit(state: BlockState, num_computed: jax.Array) -> BlockState:
    """Makes computed full blocks visible to prefix-cache lookups.

    Args:
        state: the state.
        num_computed: i32[B] tokens of each slot whose KV is written. Every full block lying
            wholly below it (and whose token ids are known) is registered, continuing the
            slot's chain. Empty and swapped slots are ignored.

    Returns:
        The new state (unchanged when prefix caching is disabled).
    """
    cfg = state.cfg
    if not cfg.enable_prefix_caching:
        return state
    nc = jnp.asarray(num_computed, _I32).reshape(cfg.max_seqs)
    mask = state.active & ~state.swapped
    hi = jnp.minimum(jnp.minimum(nc, state.num_known_tokens), state.seq_lens) // cfg.block_size
    return _tick(_register_batch(state, mask, hi))


def fork(
    state: BlockState, parent_slot: jax.Array | int, child_slot: jax.Array | int
) -> tuple[BlockState, ForkResult]:
    """Makes ``child_slot`` share every block of ``parent_slot`` (ref counts +1, no copy).

    Refused (state unchanged) unless the parent is active and on the device and the child
    slot is a different, empty slot.
    """
    cfg = state.cfg
    b, n = cfg.max_seqs, cfg.num_blocks
    p = _i32(parent_slot)
    c = _i32(child_slot)
    sp = jnp.clip(p, 0, b - 1)
    sc = jnp.clip(c, 0, b - 1)
    ok = (
        (p >= 0)
        & (p < b)
        & (c >= 0)
        & (c < b)
        & (p != c)
        & state.active[sp]
        & ~state.swapped[sp]
        & ~state.active[sc]
    )
    row = state.block_tables[sp]
    tc = jnp.where(ok, sc, b)

    def put(arr: jax.Array, val: Any) -> jax.Array:
        return arr.at[tc].set(val, mode="drop")

    new = state.replace(
        ref_counts=state.ref_counts.at[jnp.where(ok & (row >= 0), row, n)].add(1, mode="drop"),
        block_tables=put(state.block_tables, row),
        seq_lens=put(state.seq_lens, state.seq_lens[sp]),
        active=put(state.active, True),
        swapped=put(state.swapped, False),
        slot_salt=put(state.slot_salt, state.slot_salt[sp]),
        num_registered=put(state.num_registered, state.num_registered[sp]),
        num_known_tokens=put(state.num_known_tokens, state.num_known_tokens[sp]),
        clock=state.clock + ok.astype(_I32),
    )
    return new, ForkResult(ok=ok)


def free(state: BlockState, slot_mask: jax.Array) -> BlockState:
    """Frees every active slot in ``slot_mask`` (bool[B]); other slots are untouched.

    Device blocks whose ref count reaches 0 return to the pool, or stay in the prefix cache
    as evictable; host blocks of swapped slots return to the host pool.
    """
    cfg = state.cfg
    mask = jnp.asarray(slot_mask, bool).reshape(cfg.max_seqs) & state.active
    dev = mask & ~state.swapped
    host = mask & state.swapped
    tables = state.block_tables
    new = _release(state, jnp.where(dev[:, None], tables, -1).reshape(-1))
    if cfg.num_host_blocks > 0:
        new = _release_host(new, jnp.where(host[:, None], tables, -1).reshape(-1))
    z = jnp.zeros_like(state.seq_lens)
    new = new.replace(
        block_tables=jnp.where(mask[:, None], -1, tables),
        seq_lens=jnp.where(mask, z, state.seq_lens),
        active=state.active & ~mask,
        swapped=state.swapped & ~mask,
        slot_salt=jnp.where(mask, z, state.slot_salt),
        num_registered=jnp.where(mask, z, state.num_registered),
        num_known_tokens=jnp.where(mask, z, state.num_known_tokens),
    )
    return _tick(new)


def _first_occurrence(entries: jax.Array, size: int) -> jax.Array:
    """bool[B, M]: entry is the first (row-major) occurrence of its id (negative = none)."""
    flat = entries.reshape(-1)
    k = flat.shape[0]
    idx = jnp.arange(k, dtype=_I32)
    safe = jnp.where(flat >= 0, flat, size)
    first = jnp.full((size,), k, _I32).at[safe].min(idx, mode="drop")
    return ((flat >= 0) & (_take(first, flat) == idx)).reshape(entries.shape)


def _empty_plan(state: BlockState, mask: jax.Array) -> tuple[BlockState, SwapPlan]:
    nh = state.cfg.num_host_blocks
    return state, SwapPlan(
        ok=jnp.zeros_like(mask),
        src=jnp.full((nh,), -1, _I32),
        dst=jnp.full((nh,), -1, _I32),
        num=_i32(0),
    )


def swap_out(state: BlockState, slot_mask: jax.Array) -> tuple[BlockState, SwapPlan]:
    """Moves every block of the masked device-resident slots to the host tier.

    All or nothing per slot; slots are served in ascending order and a slot is refused when
    ``cumsum(need) > host free blocks`` (``need`` counts the slot's blocks not already moved
    for an earlier masked slot), so every slot after a refused one is refused too.

    Returns:
        ``(state, plan)``: copy device block ``plan.src[i]`` to host block ``plan.dst[i]``
        for ``i < plan.num``.
    """
    cfg = state.cfg
    n, nh, b = cfg.num_blocks, cfg.num_host_blocks, cfg.max_seqs
    mask = jnp.asarray(slot_mask, bool).reshape(b) & state.active & ~state.swapped
    if nh == 0:
        return _empty_plan(state, mask)
    entries = jnp.where(mask[:, None], state.block_tables, -1)
    first = _first_occurrence(entries, n)
    need = jnp.sum(first.astype(_I32), axis=1)
    ok = mask & (_cumsum(need) <= state.host_num_free)
    move = (first & ok[:, None]).reshape(-1)
    flat = entries.reshape(-1)
    mv = move.astype(_I32)
    rank = _cumsum(mv) - mv
    total = jnp.sum(mv)
    host_ids = state.host_free_stack[jnp.clip(state.host_num_free - 1 - rank, 0, nh - 1)]
    dev2host = jnp.full((n,), -1, _I32).at[jnp.where(move, flat, n)].set(host_ids, mode="drop")
    moving = ok[:, None] & (entries >= 0)
    new_rows = jnp.where(moving, dev2host[jnp.clip(entries, 0, n - 1)], state.block_tables)
    host_ref = state.host_ref_counts.at[jnp.where(moving, new_rows, nh).reshape(-1)].add(
        1, mode="drop"
    )
    plan_pos = jnp.where(move, rank, nh)
    src = jnp.full((nh,), -1, _I32).at[plan_pos].set(flat, mode="drop")
    dst = jnp.full((nh,), -1, _I32).at[plan_pos].set(host_ids, mode="drop")
    new = state.replace(
        host_ref_counts=host_ref,
        host_num_free=state.host_num_free - total,
        block_tables=new_rows,
        swapped=state.swapped | ok,
    )
    new = _release(new, jnp.where(moving, entries, -1).reshape(-1))
    return _tick(new), SwapPlan(ok=ok, src=src, dst=dst, num=total)


def swap_in(state: BlockState, slot_mask: jax.Array) -> tuple[BlockState, SwapPlan]:
    """Moves every block of the masked swapped slots back to the device.

    All or nothing per slot, ascending order, ``ok = cumsum(need) <= free - watermark``
    (free includes evictable blocks). A host block shared by several swapped-in slots moves
    once. Swapped-in blocks are not prefix-cacheable.

    Returns:
        ``(state, plan)``: copy host block ``plan.src[i]`` to device block ``plan.dst[i]``
        for ``i < plan.num``.
    """
    cfg = state.cfg
    n, nh, b = cfg.num_blocks, cfg.num_host_blocks, cfg.max_seqs
    mask = jnp.asarray(slot_mask, bool).reshape(b) & state.active & state.swapped
    if nh == 0:
        return _empty_plan(state, mask)
    entries = jnp.where(mask[:, None], state.block_tables, -1)
    first = _first_occurrence(entries, nh)
    need = jnp.sum(first.astype(_I32), axis=1)
    avail = num_free_blocks(state) - cfg.watermark_blocks
    ok = mask & (_cumsum(need) <= avail)
    move = (first & ok[:, None]).reshape(-1)
    flat = entries.reshape(-1)
    mv = move.astype(_I32)
    rank = _cumsum(mv) - mv
    total = jnp.sum(mv)
    new = _ensure_free(state, total)
    dev_ids = _pop_at(new, rank)
    host2dev = jnp.full((nh,), -1, _I32).at[jnp.where(move, flat, nh)].set(dev_ids, mode="drop")
    moving = ok[:, None] & (entries >= 0)
    new_rows = jnp.where(moving, host2dev[jnp.clip(entries, 0, nh - 1)], new.block_tables)
    ref = new.ref_counts.at[jnp.where(move, dev_ids, n)].set(0, mode="drop")
    ref = ref.at[jnp.where(moving, new_rows, n).reshape(-1)].add(1, mode="drop")
    plan_pos = jnp.where(move, rank, nh)
    src = jnp.full((nh,), -1, _I32).at[plan_pos].set(flat, mode="drop")
    dst = jnp.full((nh,), -1, _I32).at[plan_pos].set(dev_ids, mode="drop")
    z = jnp.zeros_like(state.seq_lens)
    new = new.replace(
        ref_counts=ref,
        num_free=new.num_free - total,
        block_tables=new_rows,
        swapped=new.swapped & ~ok,
        num_registered=jnp.where(ok, z, new.num_registered),
        num_known_tokens=jnp.where(ok, z, new.num_known_tokens),
    )
    new = _release_host(new, jnp.where(moving, entries, -1).reshape(-1))
    return _tick(new), SwapPlan(ok=ok, src=src, dst=dst, num=total)


def slot_mapping(state: BlockState, positions: jax.Array, slots: jax.Array) -> jax.Array:
    """i32[T] KV slot index ``block_id * S + offset`` of token ``positions[t]`` of ``slots[t]``.

    Tokens whose slot is negative, whose position is negative or whose block is missing map
    to -1 (skipped by ``write_kv``).
    """
    cfg = state.cfg
    s, m = cfg.block_size, cfg.max_blocks_per_seq
    positions = jnp.asarray(positions, _I32)
    slots = jnp.asarray(slots, _I32)
    safe_slot = jnp.clip(slots, 0, cfg.max_seqs - 1)
    col = jnp.clip(positions // s, 0, m - 1)
    blk = state.block_tables[safe_slot, col]
    good = (slots >= 0) & (positions >= 0) & (positions < m * s) & (blk >= 0)
    return jnp.where(good, blk * s + positions % s, -1)


def check_invariants(state: BlockState) -> dict[str, jax.Array]:
    """Named bool[] checks of the state's consistency (for tests and debugging).

    Returns:
        A dict of scalar bool arrays, all True for a consistent state.
    """
    cfg = state.cfg
    n, nh, s, m = cfg.num_blocks, cfg.num_host_blocks, cfg.block_size, cfg.max_blocks_per_seq
    tables = state.block_tables
    dev_rows = state.active & ~state.swapped
    host_rows = state.active & state.swapped
    dev_entries = jnp.where(dev_rows[:, None], tables, -1).reshape(-1)
    host_entries = jnp.where(host_rows[:, None], tables, -1).reshape(-1)
    dev_count = (
        jnp.zeros((n,), _I32).at[jnp.where(dev_entries >= 0, dev_entries, n)].add(1, mode="drop")
    )
    in_stack = jnp.arange(n) < state.num_free
    stack_ids = jnp.where(in_stack, state.free_stack, n)
    stack_count = jnp.zeros((n,), _I32).at[stack_ids].add(1, mode="drop")
    is_free = (state.ref_counts == 0) & ~state.cached
    evictable = (state.ref_counts == 0) & state.cached
    checks = {
        "ref_counts_match_tables": jnp.all(state.ref_counts == dev_count),
        "ref_counts_nonnegative": jnp.all(state.ref_counts >= 0),
        "free_pool_no_duplicates": jnp.all(stack_count <= 1),
        "free_not_referenced": jnp.all(jnp.where(stack_count > 0, is_free, True)),
        "free_pool_complete": jnp.all(jnp.where(is_free, stack_count == 1, True)),
        "num_evictable_matches": state.num_evictable == jnp.sum(evictable.astype(_I32)),
        "counts_add_up": state.num_free
        + state.num_evictable
        + jnp.sum((state.ref_counts > 0).astype(_I32))
        == n,
        "table_ids_in_range": jnp.all(
            jnp.where(dev_rows[:, None], tables < n, True)
            & jnp.where(host_rows[:, None], tables < max(nh, 1), True)
            & (tables >= -1)
        ),
        "empty_slots_clear": jnp.all(jnp.where(state.active[:, None], True, tables == -1))
        & ~jnp.any(state.swapped & ~state.active),
    }
    nblk = (state.seq_lens + s - 1) // s
    cols = jnp.arange(m)[None, :]
    beyond_empty = jnp.where(cols >= nblk[:, None], tables == -1, True)
    if cfg.sliding_window is None:
        within = jnp.where(state.active[:, None] & (cols < nblk[:, None]), tables >= 0, True)
    else:
        within = jnp.ones_like(beyond_empty)
    checks["tables_match_lengths"] = jnp.all(beyond_empty & within)
    if nh > 0:
        host_count = (
            jnp.zeros((nh,), _I32)
            .at[jnp.where(host_entries >= 0, host_entries, nh)]
            .add(1, mode="drop")
        )
        h_in = jnp.arange(nh) < state.host_num_free
        h_ids = jnp.where(h_in, state.host_free_stack, nh)
        h_stack = jnp.zeros((nh,), _I32).at[h_ids].add(1, mode="drop")
        h_free = state.host_ref_counts == 0
        checks.update(
            host_ref_counts_match_tables=jnp.all(state.host_ref_counts == host_count),
            host_free_pool_no_duplicates=jnp.all(h_stack <= 1),
            host_free_not_referenced=jnp.all(jnp.where(h_stack > 0, h_free, True)),
            host_counts_add_up=state.host_num_free
            + jnp.sum((state.host_ref_counts > 0).astype(_I32))
            == nh,
        )
    return checks
