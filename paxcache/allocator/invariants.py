"""Consistency checks of a :class:`~paxcache.allocator.state.BlockState` (tests, debugging).

One source of truth per fact: block ownership is the ref counts, and a block is free iff its
ref count is 0 and the prefix cache does not hold it. :func:`check_invariants` returns a named
bool per rule, so a failing test says which rule broke.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paxcache.allocator.state import I32, BlockState

__all__ = ["check_invariants"]


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
        jnp.zeros((n,), I32).at[jnp.where(dev_entries >= 0, dev_entries, n)].add(1, mode="drop")
    )
    in_stack = jnp.arange(n) < state.num_free
    stack_ids = jnp.where(in_stack, state.free_stack, n)
    stack_count = jnp.zeros((n,), I32).at[stack_ids].add(1, mode="drop")
    is_free = (state.ref_counts == 0) & ~state.cached
    evictable = (state.ref_counts == 0) & state.cached
    checks = {
        "ref_counts_match_tables": jnp.all(state.ref_counts == dev_count),
        "ref_counts_nonnegative": jnp.all(state.ref_counts >= 0),
        "free_pool_no_duplicates": jnp.all(stack_count <= 1),
        "free_not_referenced": jnp.all(jnp.where(stack_count > 0, is_free, True)),
        "free_pool_complete": jnp.all(jnp.where(is_free, stack_count == 1, True)),
        "num_evictable_matches": state.num_evictable == jnp.sum(evictable.astype(I32)),
        "counts_add_up": state.num_free
        + state.num_evictable
        + jnp.sum((state.ref_counts > 0).astype(I32))
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
            jnp.zeros((nh,), I32)
            .at[jnp.where(host_entries >= 0, host_entries, nh)]
            .add(1, mode="drop")
        )
        h_in = jnp.arange(nh) < state.host_num_free
        h_ids = jnp.where(h_in, state.host_free_stack, nh)
        h_stack = jnp.zeros((nh,), I32).at[h_ids].add(1, mode="drop")
        h_free = state.host_ref_counts == 0
        checks.update(
            host_ref_counts_match_tables=jnp.all(state.host_ref_counts == host_count),
            host_free_pool_no_duplicates=jnp.all(h_stack <= 1),
            host_free_not_referenced=jnp.all(jnp.where(h_stack > 0, h_free, True)),
            host_counts_add_up=state.host_num_free
            + jnp.sum((state.host_ref_counts > 0).astype(I32))
            == nh,
        )
    return checks
