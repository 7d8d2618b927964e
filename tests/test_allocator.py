"""Scenario tests of the pure allocator functions, each named after what it proves."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxcache import allocator
from paxcache.config import CacheConfig

S = 4


def make_cfg(**kw) -> CacheConfig:
    base = dict(
        num_blocks=16,
        block_size=S,
        max_seqs=4,
        max_blocks_per_seq=8,
        num_host_blocks=8,
        watermark=0.0,
        enable_prefix_caching=True,
    )
    base.update(kw)
    return CacheConfig(**base)


# Few distinct configurations: each one compiles every function once.
C1 = make_cfg()
SMALL = make_cfg(num_blocks=8, num_host_blocks=3)
WATERMARK = make_cfg(num_blocks=10, watermark=0.2)  # 2 watermark blocks
WINDOW = make_cfg(sliding_window=6, max_blocks_per_seq=16, num_blocks=32)

alloc = jax.jit(allocator.allocate, static_argnames=("commit",))
append = jax.jit(allocator.append, static_argnames=("commit",))
commit = jax.jit(allocator.commit)
fork = jax.jit(allocator.fork)
free = jax.jit(allocator.free)
swap_out = jax.jit(allocator.swap_out)
swap_in = jax.jit(allocator.swap_in)
check = jax.jit(allocator.check_invariants)


def toks(*values: int, length: int = 32) -> np.ndarray:
    out = np.zeros(length, np.int32)
    out[: len(values)] = values
    return out


def seq(n: int, start: int = 100) -> np.ndarray:
    return toks(*range(start, start + n))


def mask(cfg: CacheConfig, *slots: int) -> np.ndarray:
    m = np.zeros(cfg.max_seqs, bool)
    m[list(slots)] = True
    return m


def counts(cfg: CacheConfig, **per_slot: int) -> np.ndarray:
    c = np.zeros(cfg.max_seqs, np.int32)
    for k, v in per_slot.items():
        c[int(k[1:])] = v
    return c


def assert_ok(state: allocator.BlockState) -> None:
    checks = jax.device_get(check(state))
    bad = sorted(k for k, v in checks.items() if not v)
    assert not bad, bad


def row(state, slot: int) -> list[int]:
    n = -(-int(state.seq_lens[slot]) // state.cfg.block_size)
    return [int(x) for x in np.asarray(state.block_tables[slot, :n])]


def nfree(state) -> int:
    return int(allocator.num_free_blocks(state))


def assert_same_state(a, b) -> None:
    chex.assert_trees_all_equal(a, b)


# ---------------------------------------------------------------------------------------------
# basic allocation


def test_init_has_every_block_free_and_every_invariant():
    cfg = C1
    state = allocator.init(cfg)
    assert_ok(state)
    assert nfree(state) == cfg.num_blocks
    chex.assert_shape(state.block_tables, (cfg.max_seqs, cfg.max_blocks_per_seq))
    chex.assert_shape(state.block_tokens, (cfg.num_blocks, cfg.block_size))


def test_allocate_until_out_of_blocks_then_free_returns_every_block():
    cfg = SMALL
    state = allocator.init(cfg)
    for slot in range(2):  # 3 blocks each (10 tokens, S=4)
        state, res = alloc(state, slot, seq(10, 10 * slot), 10)
        assert bool(res.ok)
    assert nfree(state) == 2
    before = state
    state, res = alloc(state, 2, seq(10), 10)
    assert not bool(res.ok)
    assert_same_state(state, before)  # refused => bitwise unchanged
    state, res = alloc(state, 2, seq(8), 8)  # exactly the 2 remaining blocks
    assert bool(res.ok) and nfree(state) == 0
    assert_ok(state)
    state = free(state, np.ones(cfg.max_seqs, bool))
    assert nfree(state) == cfg.num_blocks
    assert_ok(state)


def test_watermark_refuses_admission_that_would_dip_below_it():
    cfg = WATERMARK
    state = allocator.init(cfg)
    state, res = alloc(state, 0, seq(32), 32)  # 8 blocks -> 2 left == watermark: ok
    assert bool(res.ok)
    state = free(state, mask(cfg, 0))
    state, res = alloc(state, 0, seq(32), 29)  # still 8 blocks
    assert bool(res.ok)
    state2, res = alloc(state, 1, seq(1), 1)  # would leave 1 < 2
    assert not bool(res.ok)
    assert_same_state(state2, state)


def test_allocate_refuses_bad_slot_taken_slot_and_bad_lengths():
    cfg = C1
    state = allocator.init(cfg)
    state, res = alloc(state, 0, seq(5), 5)
    assert bool(res.ok)
    for slot, n in [(0, 3), (-1, 3), (cfg.max_seqs, 3), (1, 0), (1, 33)]:
        new, res = alloc(state, slot, seq(32), n)
        assert not bool(res.ok), (slot, n)
        assert_same_state(new, state)


def test_append_crosses_a_block_boundary_exactly_when_expected():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(3), 3)  # 1 block, 3 of 4 slots used
    assert len(row(state, 0)) == 1
    state, res = append(state, counts(cfg, s0=1))  # 4 tokens: still 1 block
    assert bool(res.ok[0]) and len(row(state, 0)) == 1
    state, res = append(state, counts(cfg, s0=1))  # 5th token: new block
    assert bool(res.ok[0]) and len(row(state, 0)) == 2
    assert int(res.num_copies) == 0
    state, res = append(state, counts(cfg, s0=9))  # 14 tokens: 4 blocks
    assert len(row(state, 0)) == 4 and int(state.seq_lens[0]) == 14
    assert_ok(state)


def test_append_zero_is_a_no_op_and_empty_slots_refuse_growth():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(3), 3)
    new, res = append(state, counts(cfg, s1=2))
    assert list(np.asarray(res.ok)) == [True, False, True, True]
    chex.assert_trees_all_equal(new.block_tables, state.block_tables)
    assert_ok(new)


def test_append_past_capacity_is_refused_and_leaves_the_slot_unchanged():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(30), 30)
    new, res = append(state, counts(cfg, s0=3))
    assert not bool(res.ok[0])
    assert int(new.seq_lens[0]) == 30 and row(new, 0) == row(state, 0)


def test_append_serves_slots_in_ascending_order_with_the_prefix_rule():
    cfg = SMALL
    state = allocator.init(cfg)
    for slot in range(3):
        state, _ = alloc(state, slot, seq(4), 4)  # 1 full block each; 5 left
    # slot 0 needs 3, slot 1 needs 3 (cumsum 6 > 5: refused), slot 2 needs 1 (cumsum 7:
    # refused too, although it would fit: once a slot is refused, later ones are too).
    state, res = append(state, counts(cfg, s0=12, s1=12, s2=4))
    assert list(np.asarray(res.ok)) == [True, False, False, True]
    assert nfree(state) == 2
    assert_ok(state)


# ---------------------------------------------------------------------------------------------
# fork and copy-on-write


def test_fork_then_append_gives_exactly_one_copy_on_write_and_keeps_the_parent_table():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(6), 6)  # blocks [a, b], b half full
    state, res = fork(state, 0, 1)
    assert bool(res.ok)
    assert row(state, 1) == row(state, 0)
    assert [int(state.ref_counts[b]) for b in row(state, 0)] == [2, 2]
    parent_before = row(state, 0)
    state, res = append(state, counts(cfg, s1=1))
    assert int(res.num_copies) == 1
    src, dst = int(res.copy_src[0]), int(res.copy_dst[0])
    assert src == parent_before[1] and dst != src and dst >= 0
    assert row(state, 0) == parent_before
    assert row(state, 1) == [parent_before[0], dst]
    assert int(res.slot_copy_dst[1]) == dst
    # The parent now holds the last block alone: it writes in place.
    state, res = append(state, counts(cfg, s0=1))
    assert int(res.num_copies) == 0 and row(state, 0) == parent_before
    assert_ok(state)


def test_siblings_appending_together_copy_all_but_the_last_holder():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(6), 6)
    state, _ = fork(state, 0, 1)
    state, _ = fork(state, 0, 3)
    shared = row(state, 0)[1]
    state, res = append(state, counts(cfg, s0=1, s1=1, s3=1))
    assert int(res.num_copies) == 2  # as if served one by one in slot order
    assert [int(x) for x in np.asarray(res.copy_src[:2])] == [shared, shared]
    assert row(state, 3)[1] == shared and int(state.ref_counts[shared]) == 1
    assert len({row(state, s)[1] for s in (0, 1, 3)}) == 3
    assert_ok(state)


def test_fork_at_a_block_boundary_needs_no_copy():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(8), 8)
    state, _ = fork(state, 0, 1)
    state, res = append(state, counts(cfg, s0=1, s1=1))
    assert int(res.num_copies) == 0
    assert row(state, 0)[:2] == row(state, 1)[:2] and row(state, 0)[2] != row(state, 1)[2]
    assert_ok(state)


def test_fork_refuses_bad_arguments_and_leaves_the_state_unchanged():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(5), 5)
    state, _ = alloc(state, 1, seq(5, 7), 5)
    for p, c in [(0, 0), (0, 1), (2, 3), (-1, 2), (0, cfg.max_seqs)]:
        new, res = fork(state, p, c)
        assert not bool(res.ok), (p, c)
        assert_same_state(new, state)


def test_free_drops_one_reference_per_holder():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(6), 6)
    state, _ = fork(state, 0, 1)
    state = free(state, mask(cfg, 0))
    assert nfree(state) == cfg.num_blocks - 2
    state = free(state, mask(cfg, 1))
    assert nfree(state) == cfg.num_blocks
    assert_ok(state)


# ---------------------------------------------------------------------------------------------
# swapping


def test_swap_out_then_in_restores_counts_and_mapping():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(10), 10)  # 3 blocks
    state, _ = fork(state, 0, 1)  # shares all 3
    state, _ = append(state, counts(cfg, s1=3))  # slot 1: CoW of the last + 1 new block
    free0, host0 = nfree(state), int(state.host_num_free)
    tables0 = [row(state, 0), row(state, 1)]
    state, plan = swap_out(state, mask(cfg, 0, 1))
    assert list(np.asarray(plan.ok))[:2] == [True, True]
    distinct = set(tables0[0]) | set(tables0[1])
    assert len(distinct) == 5 and int(plan.num) == 5  # shared blocks move once
    src = [int(x) for x in np.asarray(plan.src[:5])]
    assert sorted(src) == sorted(set(tables0[0]) | set(tables0[1]))
    assert nfree(state) == free0 + 5 and int(state.host_num_free) == host0 - 5
    assert bool(state.swapped[0]) and bool(state.swapped[1])
    dev2host = dict(zip(src, [int(x) for x in np.asarray(plan.dst[:5])], strict=True))
    assert row(state, 0) == [dev2host[b] for b in tables0[0]]
    assert_ok(state)
    state, plan = swap_in(state, mask(cfg, 0, 1))
    assert int(plan.num) == 5 and bool(plan.ok[0]) and bool(plan.ok[1])
    assert nfree(state) == free0 and int(state.host_num_free) == host0
    host2dev = dict(
        zip(
            [int(x) for x in np.asarray(plan.src[:5])],
            [int(x) for x in np.asarray(plan.dst[:5])],
            strict=True,
        )
    )
    for slot in range(2):  # same sharing structure, through the copies
        assert row(state, slot) == [host2dev[dev2host[b]] for b in tables0[slot]]
    assert int(state.ref_counts[row(state, 0)[0]]) == 2
    assert_ok(state)


def test_swap_out_is_all_or_nothing_and_refused_when_the_host_is_full():
    cfg = SMALL
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(8), 8)  # 2 blocks
    state, _ = alloc(state, 1, seq(8, 300), 8)  # 2 blocks
    new, plan = swap_out(state, mask(cfg, 0, 1))
    assert list(np.asarray(plan.ok))[:2] == [True, False]
    assert int(plan.num) == 2 and not bool(new.swapped[1])
    assert row(new, 1) == row(state, 1)
    assert_ok(new)


def test_swap_in_respects_the_watermark():
    cfg = WATERMARK
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(8), 8)
    state, _ = swap_out(state, mask(cfg, 0))
    state, _ = alloc(state, 1, seq(24), 24)  # 6 blocks; 4 free, watermark 2
    state, _ = alloc(state, 2, seq(1), 1)  # 3 free
    new, plan = swap_in(state, mask(cfg, 0))  # needs 2: 3 - 2 < 2
    assert not bool(plan.ok[0]) and int(plan.num) == 0
    assert_same_state(new.block_tables, state.block_tables)
    state = free(state, mask(cfg, 2))
    state, plan = swap_in(state, mask(cfg, 0))
    assert bool(plan.ok[0])
    assert_ok(state)


def test_swapped_slots_cannot_grow_or_fork_and_free_returns_host_blocks():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(5), 5)
    state, _ = swap_out(state, mask(cfg, 0))
    _, res = append(state, counts(cfg, s0=1))
    assert not bool(res.ok[0])
    _, res = fork(state, 0, 1)
    assert not bool(res.ok)
    state = free(state, mask(cfg, 0))  # freeing a swapped sequence frees host blocks
    assert int(state.host_num_free) == cfg.num_host_blocks
    assert_ok(state)


# ---------------------------------------------------------------------------------------------
# prefix caching


def test_two_identical_prompts_share_their_full_blocks():
    cfg = C1
    state = allocator.init(cfg)
    state, res = alloc(state, 0, seq(10), 10)
    assert int(res.num_cached_tokens) == 0
    state, res = alloc(state, 1, seq(10), 10)
    assert int(res.num_cached_tokens) == 8
    assert row(state, 1)[:2] == row(state, 0)[:2] and row(state, 1)[2] != row(state, 0)[2]
    assert int(state.prefix_hits) == 8 and int(state.prefix_queries) == 20
    assert_ok(state)


def test_a_hit_never_covers_the_whole_prompt():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(8), 8)
    state, res = alloc(state, 1, seq(8), 8)
    assert int(res.num_cached_tokens) == 4  # the last full block is recomputed
    assert row(state, 1)[0] == row(state, 0)[0] and row(state, 1)[1] != row(state, 0)[1]


def test_different_salts_never_share():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(12), 12, 1)
    state, res = alloc(state, 1, seq(12), 12, 2)
    assert int(res.num_cached_tokens) == 0
    assert not set(row(state, 0)) & set(row(state, 1))
    state, res = alloc(state, 2, seq(12), 12, 1)
    assert int(res.num_cached_tokens) == 8


def test_prefix_hits_need_the_same_parent_chain_not_just_the_same_block_tokens():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, toks(1, 1, 1, 1, 2, 2, 2, 2, 9), 9)
    # Same second block, different first block: no hit on either.
    state, res = alloc(state, 1, toks(3, 3, 3, 3, 2, 2, 2, 2, 9), 9)
    assert int(res.num_cached_tokens) == 0
    # Same first block only.
    state, res = alloc(state, 2, toks(1, 1, 1, 1, 5, 5, 5, 5, 9), 9)
    assert int(res.num_cached_tokens) == 4


def test_a_hash_collision_is_never_a_hit():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, toks(1, 2, 3, 4, 5), 5)
    # Forge a collision: make the cached block's stored tokens differ from its key hash.
    blk = row(state, 0)[0]
    forged = state.replace(block_tokens=state.block_tokens.at[blk].set(jnp.array([1, 2, 3, 9])))
    _, res = alloc(forged, 1, toks(1, 2, 3, 4, 5), 5)
    assert int(res.num_cached_tokens) == 0  # hash matches, tokens do not: verified miss


def test_freed_cached_blocks_stay_evictable_count_as_free_and_a_hit_revives_them():
    cfg = SMALL
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(9), 9)  # 3 blocks, 2 full (cached)
    state = free(state, mask(cfg, 0))
    assert nfree(state) == 8 and int(state.num_evictable) == 2
    assert_ok(state)
    state, res = alloc(state, 1, seq(9), 9)
    assert int(res.num_cached_tokens) == 8 and int(state.num_evictable) == 0
    assert nfree(state) == 5
    assert_ok(state)


def test_lru_eviction_takes_never_cached_blocks_first_then_least_recently_used():
    cfg = SMALL
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(5, 100), 5)  # A: A0 cached + a partial block
    state, _ = alloc(state, 1, seq(5, 200), 5)  # B: B0 cached + a partial block
    state = free(state, mask(cfg, 0))  # A0 released first (oldest)
    state = free(state, mask(cfg, 1))
    assert int(state.num_evictable) == 2 and int(state.num_free) == 6
    # 6 fresh blocks come from the never-cached ones: both cached blocks survive.
    state, _ = alloc(state, 2, seq(24, 300), 24)
    assert int(state.num_evictable) == 2 and int(state.num_free) == 0
    state = free(state, mask(cfg, 2))  # C0..C5 cached, newest
    state, res = alloc(state, 3, seq(5, 100), 5)  # hit revives A0, 1 block evicted
    assert int(res.num_cached_tokens) == 4
    # The least recently used evictable block was B0: it is gone.
    state, res = alloc(state, 0, seq(5, 200), 5)
    assert bool(res.ok) and int(res.num_cached_tokens) == 0
    assert_ok(state)


def test_lru_evicts_the_oldest_block_and_deepest_first_on_ties():
    cfg = SMALL
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(9, 100), 9)  # X0 X1 cached, 1 partial
    x = row(state, 0)
    state = free(state, mask(cfg, 0))  # X0 and X1 released together: tie, X1 deeper
    state, _ = alloc(state, 1, seq(5, 500), 5)  # Y0 cached
    y = row(state, 1)
    state = free(state, mask(cfg, 1))  # Y0 newer than X*
    assert int(state.num_evictable) == 3 and int(state.num_free) == 5
    # 6 blocks needed, 5 truly free -> evict exactly one: X1 (oldest, deeper).
    state, res = alloc(state, 2, seq(24, 900), 24)
    assert bool(res.ok) and int(state.num_evictable) == 2
    assert x[1] in row(state, 2)  # X1's id was reused
    for blk in (x[0], y[0]):  # still cached and evictable
        assert bool(state.cached[blk]) and int(state.ref_counts[blk]) == 0
    assert_ok(state)


def test_evicting_a_parent_invalidates_its_cached_children():
    cfg = SMALL
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, toks(1, 1, 1, 1, 2, 2, 2, 2, 3), 9)  # P, C cached
    state = free(state, mask(cfg, 0))
    # Make C the most recently used so that P is evicted first and its id reused.
    state = state.replace(last_access=state.last_access.at[row_of(state, 1)].set(10**6))
    state, _ = alloc(state, 1, toks(7, 7, 7, 7, *([8] * 24)), 28)  # evicts P, reuses its id
    state = free(state, mask(cfg, 1))
    assert_ok(state)
    # The block now at P's old id holds 7777; C (parent P, old generation) must not match.
    state, res = alloc(state, 2, toks(7, 7, 7, 7, 2, 2, 2, 2, 3), 9)
    assert int(res.num_cached_tokens) == 4
    assert_ok(state)


def row_of(state, pos: int) -> int:
    """Id of the cached block at chain position ``pos`` (for white-box LRU tweaks)."""
    ids = np.flatnonzero(np.asarray(state.cached) & (np.asarray(state.block_pos) == pos))
    return int(ids[0])


def test_commit_false_hides_uncomputed_blocks_until_commit():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(13), 13, commit=False)
    _, res = alloc(state, 1, seq(13), 13)
    assert int(res.num_cached_tokens) == 0
    state = commit(state, counts(cfg, s0=5))  # block 0 computed
    _, res = alloc(state, 1, seq(13), 13)
    assert int(res.num_cached_tokens) == 4
    state = commit(state, counts(cfg, s0=13))
    _, res = alloc(state, 1, seq(13), 13)
    assert int(res.num_cached_tokens) == 12
    assert_ok(state)


def test_append_with_token_ids_makes_decode_blocks_cacheable():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(3), 3)
    new_tokens = np.zeros((cfg.max_seqs, 2), np.int32)
    for t in range(3, 9):  # decode tokens 103..108 one by one
        new_tokens[0, 0] = 100 + t
        state, _ = append(state, counts(cfg, s0=1), new_tokens[:, :1])
    assert int(state.seq_lens[0]) == 9
    _, res = alloc(state, 1, seq(10), 10)
    assert int(res.num_cached_tokens) == 8
    # Without token ids the decode blocks are not cached.
    state2 = allocator.init(cfg)
    state2, _ = alloc(state2, 0, seq(3), 3)
    state2, _ = append(state2, counts(cfg, s0=6))
    _, res = alloc(state2, 1, seq(10), 10)
    assert int(res.num_cached_tokens) == 0


# ---------------------------------------------------------------------------------------------
# sliding window


def test_sliding_window_bounds_the_blocks_a_decoding_sequence_holds():
    cfg = WINDOW
    window = cfg.sliding_window
    bound = -(-window // S) + 1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, toks(*range(20), length=64), 20)
    for _ in range(30):
        state, res = append(state, counts(cfg, s0=1))
        assert bool(res.ok[0])
        held = int(np.sum(np.asarray(state.block_tables[0]) >= 0))
        assert held <= bound
        # every key the next query (position L-1) may see is still mapped
        length = int(state.seq_lens[0])
        for p in range(max(0, length - window), length):
            assert int(state.block_tables[0, p // S]) >= 0
        assert_ok(state)
    state = free(state, mask(cfg, 0))
    assert nfree(state) == cfg.num_blocks


# ---------------------------------------------------------------------------------------------
# composition, variants and invariants


def test_append_works_traced_inside_a_larger_jitted_step():
    cfg = C1

    @jax.jit
    def model_step(state, kv, n):
        state, res = allocator.append(state, n)
        length = state.seq_lens
        slots = allocator.slot_mapping(state, length - 1, jnp.arange(cfg.max_seqs))
        kv = kv.at[jnp.where(slots >= 0, slots, kv.shape[0])].set(1.0, mode="drop")
        return state, kv, res.ok

    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(4), 4)
    state, _ = alloc(state, 2, seq(7), 7)
    kv = jnp.zeros(cfg.num_blocks * S)
    state, kv, ok = model_step(state, kv, counts(cfg, s0=1, s2=1))
    assert bool(ok[0]) and bool(ok[2])
    assert float(kv[row(state, 0)[1] * S + 0]) == 1.0  # token 4 -> block 1 offset 0
    assert float(kv[row(state, 2)[1] * S + 3]) == 1.0  # token 7 -> block 1 offset 3
    assert float(jnp.sum(kv)) == 2.0
    assert_ok(state)


def test_check_invariants_catches_a_corrupted_state():
    cfg = C1
    state = allocator.init(cfg)
    state, _ = alloc(state, 0, seq(9), 9)
    bad = state.replace(ref_counts=state.ref_counts.at[row(state, 0)[0]].add(1))
    checks = jax.device_get(allocator.check_invariants(bad))
    assert not checks["ref_counts_match_tables"]
    dup = state.replace(
        free_stack=state.free_stack.at[int(state.num_free) - 1].set(state.free_stack[0])
    )
    checks = jax.device_get(allocator.check_invariants(dup))
    assert not checks["free_pool_no_duplicates"]


def test_packed_fields_are_properties_and_replace_writes_their_columns():
    """BlockState's packed fields are explicit properties reading their column (with the
    documented dtype), and replace() writes a packed field into its column, touching nothing
    else; the state is a pytree of its 12 arrays with the config static."""
    from paxcache.allocator import state as state_mod

    state = allocator.init(C1)
    for name in state_mod.COUNTERS + state_mod.SLOT_INFO + state_mod.CACHE_KEYS:
        assert isinstance(vars(allocator.BlockState)[name], property), name
    new = state.replace(num_free=3, clock=7, ref_counts=state.ref_counts + 1)
    assert int(new.num_free) == 3 and int(new.clock) == 7 and int(new.ref_counts[0]) == 1
    np.testing.assert_array_equal(new.counters[1:3], state.counters[1:3])
    active = jnp.array([True, False, True, False])
    new = state.replace(active=active, slot_salt=jnp.arange(4) + 5)
    chex.assert_type(new.active, bool)
    np.testing.assert_array_equal(new.active, active)
    np.testing.assert_array_equal(new.slot_salt, [5, 6, 7, 8])
    np.testing.assert_array_equal(new.swapped, state.swapped)
    high = jnp.full((C1.num_blocks,), 0xFFFFFFF0, jnp.uint32)  # bit-cast through the i32 array
    new = state.replace(key_hash=high)
    chex.assert_type(new.key_hash, jnp.uint32)
    np.testing.assert_array_equal(new.key_hash, high)
    np.testing.assert_array_equal(new.parent_block, state.parent_block)
    with pytest.raises(TypeError):
        state.replace(no_such_field=1)
    with pytest.raises(AttributeError):
        _ = state.no_such_field
    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == 12 and jax.tree.unflatten(treedef, leaves).cfg is C1
    bumped = jax.jit(lambda st: st.replace(clock=st.clock + 1))(state)
    assert int(bumped.clock) == int(state.clock) + 1


class AllocatorVariantsTest(chex.TestCase):
    """The pure functions give the same results with and without jit."""

    def setUp(self):
        super().setUp()
        self.cfg = C1

    @chex.variants(with_jit=True, without_jit=True)
    def test_allocate_append_fork_free_agree_with_and_without_jit(self):
        cfg = self.cfg
        allocate_v = self.variant(functools.partial(allocator.allocate, commit=True))
        append_v = self.variant(allocator.append)
        fork_v = self.variant(allocator.fork)
        free_v = self.variant(allocator.free)
        state = allocator.init(cfg)
        state, res = allocate_v(state, 0, seq(6), 6)
        self.assertTrue(bool(res.ok))
        state, res = allocate_v(state, 1, seq(6), 6)
        self.assertEqual(int(res.num_cached_tokens), 4)
        state, res = fork_v(state, 0, 2)
        self.assertTrue(bool(res.ok))
        state, res = append_v(state, jnp.asarray(counts(cfg, s2=3)))
        chex.assert_shape(res.copy_src, (cfg.max_seqs,))
        self.assertEqual(int(res.num_copies), 1)
        state = free_v(state, jnp.asarray(mask(cfg, 0, 1, 2)))
        self.assertEqual(int(allocator.num_free_blocks(state)), cfg.num_blocks)
        assert_ok(state)

    @chex.variants(with_jit=True, without_jit=True)
    def test_swap_round_trip_agrees_with_and_without_jit(self):
        cfg = self.cfg
        out_v = self.variant(allocator.swap_out)
        in_v = self.variant(allocator.swap_in)
        state = allocator.init(cfg)
        state, _ = alloc(state, 0, seq(9), 9)
        state, plan = out_v(state, jnp.asarray(mask(cfg, 0)))
        chex.assert_shape(plan.src, (cfg.num_host_blocks,))
        self.assertEqual(int(plan.num), 3)
        state, plan = in_v(state, jnp.asarray(mask(cfg, 0)))
        self.assertEqual(int(plan.num), 3)
        assert_ok(state)

    @chex.variants(with_jit=True, without_jit=True)
    def test_check_invariants_holds_with_and_without_jit(self):
        checks = self.variant(allocator.check_invariants)(allocator.init(self.cfg))
        self.assertTrue(all(bool(v) for v in checks.values()))


def test_init_rejects_a_non_config():
    with pytest.raises(ValueError, match="CacheConfig"):
        allocator.init({"num_blocks": 4})


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(0, 40),
    num_new=st.integers(0, 20),
    block_size=st.sampled_from([1, 4, 16]),
    holders=st.integers(2, 5),
    writers=st.integers(0, 5),
)
def test_append_need_is_one_rule_for_python_ints_and_device_arrays(
    length, num_new, block_size, holders, writers
):
    """The scheduler (Python ints per row) and the allocator (i32 arrays) share the rule: the
    blocks an append crosses, and min(writers, holders - 1) copies of a shared last block."""
    writers = min(writers, holders)
    shared = length % block_size != 0 and num_new > 0
    host = [
        allocator.append_need(length, num_new, block_size, shared, holders, r)
        for r in range(writers)
    ] or [allocator.append_need(length, num_new, block_size, False, 0, 0)]
    dev = allocator.append_need(
        jnp.full(max(writers, 1), length, jnp.int32),
        jnp.full(max(writers, 1), num_new, jnp.int32),
        block_size,
        jnp.full(max(writers, 1), shared and writers > 0),
        jnp.full(max(writers, 1), holders, jnp.int32),
        jnp.arange(max(writers, 1), dtype=jnp.int32),
    )
    before, after, _ = host[0]
    assert before == -(-length // block_size) and after == -(-(length + num_new) // block_size)
    copies = sum(int(cow) for _, _, cow in host)
    assert copies == (min(writers, holders - 1) if shared else 0)
    assert [bool(c) for c in dev[2]] == [bool(c) for _, _, c in host]
    assert int(dev[0][0]) == before and int(dev[1][0]) == after
