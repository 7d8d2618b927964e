"""The block pools: reference counts and free stacks of the device and host tiers.

A device block is *free* iff its ref count is 0 and the prefix cache does not hold it; free
blocks live on a stack (``free_stack[:num_free]``). Blocks with ref count 0 that the prefix
cache still holds are *evictable*: they count as free but are only taken, least-recently-used
first, when the stack runs short (:func:`ensure_free`, under a ``lax.cond`` so the common path
does no O(N log N) work). The host tier has its own ref counts and free stack, and no cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from paxcache.allocator.state import I32, INT_MAX, KEY, BlockState, cumsum, take

__all__ = ["decref", "ensure_free", "pop_at", "push", "release", "release_host"]


def decref(ref: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
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
    idx = jnp.arange(k, dtype=I32)
    first = jnp.full((size,), k, I32).at[safe].min(idx, mode="drop")
    clipped = jnp.clip(ids, 0, size - 1)
    zeroed = valid & (take(first, clipped) == idx) & (take(ref, clipped) == 0)
    return ref, zeroed


def push(stack: jax.Array, num: jax.Array, ids: jax.Array, mask: jax.Array):
    """Pushes ``ids[mask]`` (distinct) onto ``stack``; returns (stack, num)."""
    m = mask.astype(I32)
    pos = num + cumsum(m) - m
    stack = stack.at[jnp.where(mask, pos, stack.shape[0])].set(ids, mode="drop")
    return stack, num + jnp.sum(m)


def release(state: BlockState, ids: jax.Array) -> BlockState:
    """Drops one device reference per entry of ``ids`` (i32[K], -1 = skip).

    Blocks whose count reaches 0 go back on the free stack, or become evictable if the
    prefix cache holds them (stamped with the current clock for LRU).
    """

    def run(state: BlockState) -> BlockState:
        ref, zeroed = decref(state.ref_counts, ids)
        cached = take(state.cached, ids)
        to_free = zeroed & ~cached
        to_evict = zeroed & cached
        stack, num_free = push(state.free_stack, state.num_free, ids, to_free)
        n = state.cfg.num_blocks
        last_access = state.last_access.at[jnp.where(to_evict, ids, n)].set(
            state.clock, mode="drop"
        )
        return state.replace(
            ref_counts=ref,
            free_stack=stack,
            num_free=num_free,
            num_evictable=state.num_evictable + jnp.sum(to_evict.astype(I32)),
            last_access=last_access,
        )

    return lax.cond(jnp.any(ids >= 0), run, lambda s: s, state)


def release_host(state: BlockState, ids: jax.Array) -> BlockState:
    """Drops one host reference per entry of ``ids`` (i32[K], -1 = skip)."""
    ref, zeroed = decref(state.host_ref_counts, ids)
    stack, num = push(state.host_free_stack, state.host_num_free, ids, zeroed)
    return state.replace(host_ref_counts=ref, host_free_stack=stack, host_num_free=num)


def ensure_free(state: BlockState, total: jax.Array) -> BlockState:
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
        primary = jnp.where(evictable, state.last_access, INT_MAX)
        order = jnp.lexsort((jnp.arange(n, dtype=I32), -state.block_pos, primary))
        chosen = jnp.arange(n, dtype=I32) < k
        stack, num_free = push(state.free_stack, state.num_free, order.astype(I32), chosen)
        sel = jnp.where(chosen, order, n)
        return state.replace(
            free_stack=stack,
            num_free=num_free,
            num_evictable=state.num_evictable - k,
            cached=state.cached.at[sel].set(False, mode="drop"),
            cache_keys=state.cache_keys.at[sel, KEY["gen"]].add(1, mode="drop"),
        )

    return lax.cond(total > state.num_free, evict, lambda s: s, state)


def pop_at(state: BlockState, rank: jax.Array) -> jax.Array:
    """Block id ``rank`` places below the top of the free stack (rank 0 = top)."""
    idx = jnp.clip(state.num_free - 1 - rank, 0, state.cfg.num_blocks - 1)
    return take(state.free_stack, idx)
