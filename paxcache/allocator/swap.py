"""Swapping: move whole sequences between the device and host tiers, as block-copy plans.

:func:`swap_out` / :func:`swap_in` update the tables and both pools and return a fixed-length
:class:`~paxcache.allocator.state.SwapPlan` (``NH`` pairs padded with ``-1``, plus ``num``);
the caller moves the KV (``paxcache.kv_cache.swap_out`` / ``swap_in``). A swapped slot's table
holds *host* ids while ``swapped[slot]`` is set. A block shared by several slots swapped in
the same call moves once. A swapped-in sequence's blocks are not prefix-cacheable any more
(tokens are not kept on the host).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paxcache.allocator.pool import ensure_free, pop_at, release, release_host
from paxcache.allocator.state import (
    I32,
    BlockState,
    SwapPlan,
    cumsum,
    i32,
    num_free_blocks,
    take,
    tick,
)

__all__ = ["swap_in", "swap_out"]


def _first_occurrence(entries: jax.Array, size: int) -> jax.Array:
    """bool[B, M]: entry is the first (row-major) occurrence of its id (negative = none)."""
    flat = entries.reshape(-1)
    k = flat.shape[0]
    idx = jnp.arange(k, dtype=I32)
    safe = jnp.where(flat >= 0, flat, size)
    first = jnp.full((size,), k, I32).at[safe].min(idx, mode="drop")
    return ((flat >= 0) & (take(first, flat) == idx)).reshape(entries.shape)


def _empty_plan(state: BlockState, mask: jax.Array) -> tuple[BlockState, SwapPlan]:
    nh = state.cfg.num_host_blocks
    return state, SwapPlan(
        ok=jnp.zeros_like(mask),
        src=jnp.full((nh,), -1, I32),
        dst=jnp.full((nh,), -1, I32),
        num=i32(0),
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
    need = jnp.sum(first.astype(I32), axis=1)
    ok = mask & (cumsum(need) <= state.host_num_free)
    move = (first & ok[:, None]).reshape(-1)
    flat = entries.reshape(-1)
    mv = move.astype(I32)
    rank = cumsum(mv) - mv
    total = jnp.sum(mv)
    host_ids = state.host_free_stack[jnp.clip(state.host_num_free - 1 - rank, 0, nh - 1)]
    dev2host = jnp.full((n,), -1, I32).at[jnp.where(move, flat, n)].set(host_ids, mode="drop")
    moving = ok[:, None] & (entries >= 0)
    new_rows = jnp.where(moving, dev2host[jnp.clip(entries, 0, n - 1)], state.block_tables)
    host_ref = state.host_ref_counts.at[jnp.where(moving, new_rows, nh).reshape(-1)].add(
        1, mode="drop"
    )
    plan_pos = jnp.where(move, rank, nh)
    src = jnp.full((nh,), -1, I32).at[plan_pos].set(flat, mode="drop")
    dst = jnp.full((nh,), -1, I32).at[plan_pos].set(host_ids, mode="drop")
    new = state.replace(
        host_ref_counts=host_ref,
        host_num_free=state.host_num_free - total,
        block_tables=new_rows,
        swapped=state.swapped | ok,
    )
    new = release(new, jnp.where(moving, entries, -1).reshape(-1))
    return tick(new), SwapPlan(ok=ok, src=src, dst=dst, num=total)


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
    need = jnp.sum(first.astype(I32), axis=1)
    avail = num_free_blocks(state) - cfg.watermark_blocks
    ok = mask & (cumsum(need) <= avail)
    move = (first & ok[:, None]).reshape(-1)
    flat = entries.reshape(-1)
    mv = move.astype(I32)
    rank = cumsum(mv) - mv
    total = jnp.sum(mv)
    new = ensure_free(state, total)
    dev_ids = pop_at(new, rank)
    host2dev = jnp.full((nh,), -1, I32).at[jnp.where(move, flat, nh)].set(dev_ids, mode="drop")
    moving = ok[:, None] & (entries >= 0)
    new_rows = jnp.where(moving, host2dev[jnp.clip(entries, 0, nh - 1)], new.block_tables)
    ref = new.ref_counts.at[jnp.where(move, dev_ids, n)].set(0, mode="drop")
    ref = ref.at[jnp.where(moving, new_rows, n).reshape(-1)].add(1, mode="drop")
    plan_pos = jnp.where(move, rank, nh)
    src = jnp.full((nh,), -1, I32).at[plan_pos].set(flat, mode="drop")
    dst = jnp.full((nh,), -1, I32).at[plan_pos].set(dev_ids, mode="drop")
    z = jnp.zeros_like(state.seq_lens)
    new = new.replace(
        ref_counts=ref,
        num_free=new.num_free - total,
        block_tables=new_rows,
        swapped=new.swapped & ~ok,
        num_registered=jnp.where(ok, z, new.num_registered),
        num_known_tokens=jnp.where(ok, z, new.num_known_tokens),
    )
    new = release_host(new, jnp.where(moving, entries, -1).reshape(-1))
    return tick(new), SwapPlan(ok=ok, src=src, dst=dst, num=total)
