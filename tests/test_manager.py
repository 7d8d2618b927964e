"""BlockManager: host-side wrapper, typed errors, state untouched on every error."""

from __future__ import annotations

import chex
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxcache import BlockManager, CacheConfig, errors

CFG = CacheConfig(
    num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=8, num_host_blocks=8, watermark=0.0
)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def assert_ok(bm: BlockManager) -> None:
    bad = sorted(k for k, v in bm.check_invariants().items() if not v)
    assert not bad, bad


def snapshot(bm: BlockManager):
    return bm.state, dict(bm._slots), bm.free_slots


def assert_unchanged(bm: BlockManager, snap) -> None:
    state, slots, free_slots = snap
    chex.assert_trees_all_equal(bm.state, state)
    assert bm._slots == slots and bm.free_slots == free_slots


@pytest.fixture
def bm() -> BlockManager:
    return BlockManager(CFG)


def test_errors_are_value_errors():
    for cls in (
        errors.OutOfBlocksError,
        errors.NoFreeSlotError,
        errors.UnknownSequenceError,
        errors.DuplicateSequenceError,
        errors.SequenceTooLongError,
        errors.SequenceSwappedError,
    ):
        assert issubclass(cls, errors.PaxcacheError) and issubclass(cls, ValueError)
    assert issubclass(errors.NoFreeSlotError, errors.OutOfBlocksError)


def test_config_validation_names_the_bad_field():
    with pytest.raises(ValueError, match="num_blocks"):
        CacheConfig(num_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="watermark"):
        CacheConfig(num_blocks=4, watermark=1.5)
    with pytest.raises(ValueError, match="sliding_window"):
        CacheConfig(num_blocks=4, sliding_window=0)
    with pytest.raises(ValueError, match="max_seqs"):
        CacheConfig(num_blocks=4, max_seqs=True)
    assert hash(CFG) == hash(CacheConfig(**{f: getattr(CFG, f) for f in CFG.__dataclass_fields__}))


def test_allocate_append_and_block_table_with_any_hashable_ids(bm):
    assert bm.allocate(("req", 1), prompt(6)) == 0
    assert len(bm.block_table(("req", 1))) == 2 and bm.seq_len(("req", 1)) == 6
    assert bm.append(("req", 1), [7, 8, 9]) == []
    assert len(bm.block_table(("req", 1))) == 3
    assert bm.append(("req", 1), 0) == []
    assert bm.num_free_blocks == CFG.num_blocks - 3
    assert ("req", 1) in bm and len(bm) == 1
    assert_ok(bm)


def test_double_free_and_unknown_ids_raise_and_change_nothing(bm):
    bm.allocate("a", prompt(5))
    bm.free("a")
    snap = snapshot(bm)
    for call in (
        lambda: bm.free("a"),
        lambda: bm.append("nope", [1]),
        lambda: bm.block_table("nope"),
        lambda: bm.fork("nope", "b"),
        lambda: bm.swap_out("nope"),
        lambda: bm.swap_in("nope"),
        lambda: bm.free(["unhashable"]),
    ):
        with pytest.raises(errors.UnknownSequenceError):
            call()
        assert_unchanged(bm, snap)


def test_duplicate_ids_raise(bm):
    bm.allocate("a", prompt(5))
    bm.allocate("b", prompt(5, 300))
    snap = snapshot(bm)
    with pytest.raises(errors.DuplicateSequenceError):
        bm.allocate("a", prompt(3))
    with pytest.raises(errors.DuplicateSequenceError):
        bm.fork("a", "b")
    assert_unchanged(bm, snap)


def test_out_of_blocks_and_too_long_and_no_free_slot_raise_without_side_effects(bm):
    bm.allocate("big", prompt(32))  # 8 of 16 blocks
    bm.allocate("big2", prompt(24, 500))  # 6 more, 2 left
    snap = snapshot(bm)
    with pytest.raises(errors.OutOfBlocksError):
        bm.allocate("c", prompt(12, 900))
    assert_unchanged(bm, snap)
    with pytest.raises(errors.SequenceTooLongError):
        bm.allocate("c", prompt(CFG.max_model_len + 1))
    with pytest.raises(errors.SequenceTooLongError):
        bm.append("big", [1])
    with pytest.raises(errors.PaxcacheError):
        bm.allocate("c", [])
    assert_unchanged(bm, snap)
    bm.allocate("s", [1])
    bm.append("big2", [1, 2, 3, 4])  # takes the last block
    snap = snapshot(bm)
    with pytest.raises(errors.OutOfBlocksError):
        bm.append("s", [2, 3, 4, 5])
    assert_unchanged(bm, snap)
    bm.free("s")
    bm.free("big")
    bm.free("big2")
    for i in range(CFG.max_seqs):
        bm.allocate(i, [i])
    snap = snapshot(bm)
    with pytest.raises(errors.NoFreeSlotError):
        bm.allocate("late", [1])
    with pytest.raises(errors.OutOfBlocksError):  # NoFreeSlotError is an OutOfBlocksError
        bm.fork(0, "child")
    assert_unchanged(bm, snap)
    assert not bm.can_allocate(1)
    assert_ok(bm)


def test_can_allocate_follows_free_blocks_and_watermark():
    bm = BlockManager(
        CacheConfig(num_blocks=10, block_size=4, max_seqs=4, max_blocks_per_seq=8, watermark=0.2)
    )
    assert bm.can_allocate(32) and not bm.can_allocate(33) and not bm.can_allocate(0)
    bm.allocate("a", prompt(20))  # 5 blocks, 5 left, watermark 2
    assert bm.can_allocate(12) and not bm.can_allocate(13)
    with pytest.raises(errors.OutOfBlocksError):
        bm.allocate("b", prompt(13, 500))


def test_fork_then_append_returns_one_copy_on_write_pair(bm):
    bm.allocate("p", prompt(6))
    bm.fork("p", "c")
    parent = bm.block_table("p")
    assert bm.block_table("c") == parent
    cow = bm.append("c", [1])
    assert len(cow) == 1 and cow[0][0] == parent[1] and cow[0][1] != parent[1]
    assert bm.block_table("p") == parent
    assert bm.block_table("c") == [parent[0], cow[0][1]]
    assert bm.append("p", [2]) == []
    assert_ok(bm)


def test_swap_out_then_in_restores_counts_and_table_shape(bm):
    bm.allocate("a", prompt(10))
    free0, host0 = bm.num_free_blocks, bm.num_free_host_blocks
    table = bm.block_table("a")
    pairs = bm.swap_out("a")
    assert [d for d, _ in pairs] == table and bm.is_swapped("a")
    assert bm.num_free_host_blocks == host0 - 3 and bm.num_free_blocks == free0 + 3
    assert bm.block_table("a") == [h for _, h in pairs]
    snap = snapshot(bm)
    with pytest.raises(errors.SequenceSwappedError):
        bm.append("a", [1])
    with pytest.raises(errors.SequenceSwappedError):
        bm.swap_out("a")
    with pytest.raises(errors.SequenceSwappedError):
        bm.fork("a", "b")
    assert_unchanged(bm, snap)
    back = bm.swap_in("a")
    assert [h for h, _ in back] == [h for _, h in pairs]
    assert bm.block_table("a") == [d for _, d in back]
    assert bm.num_free_blocks == free0 and bm.num_free_host_blocks == host0
    with pytest.raises(errors.SequenceSwappedError):
        bm.swap_in("a")
    assert_ok(bm)


def test_swap_out_without_room_on_the_host_raises_and_changes_nothing():
    bm = BlockManager(
        CacheConfig(
            num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=8, num_host_blocks=2
        )
    )
    bm.allocate("a", prompt(10))
    snap = snapshot(bm)
    with pytest.raises(errors.OutOfBlocksError):
        bm.swap_out("a")
    assert_unchanged(bm, snap)


def test_identical_prompts_share_blocks_and_salts_isolate_tenants(bm):
    assert bm.allocate("a", prompt(10), cache_salt="tenant-1") == 0
    assert bm.allocate("b", prompt(10), cache_salt="tenant-1") == 8
    assert bm.allocate("c", prompt(10), cache_salt=("tenant", 2)) == 0
    assert bm.allocate("d", prompt(10)) == 0  # no salt is its own tenant
    assert bm.block_table("a")[:2] == bm.block_table("b")[:2]
    assert not set(bm.block_table("a")) & set(bm.block_table("c"))
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 40)
    for seq_id in "abcd":
        bm.free(seq_id)
    assert bm.num_free_blocks == CFG.num_blocks
    assert_ok(bm)


def test_commit_false_then_commit_makes_blocks_visible(bm):
    bm.allocate("a", prompt(9), commit=False)
    assert bm.allocate("b", prompt(9), commit=False) == 0
    bm.free("b")
    bm.commit({"a": 9})
    assert bm.allocate("c", prompt(9)) == 8


def test_append_batch_serves_several_sequences_in_one_call(bm):
    bm.allocate("a", prompt(4))
    bm.allocate("b", prompt(3, 300))
    bm.fork("b", "c")
    cows, failed = bm.append_batch({"a": [1], "b": [2], "c": 1})
    assert not failed
    # b and c share a partial block: b copies, c (the last holder) writes in place.
    assert cows["a"] == [] and len(cows["b"]) == 1 and cows["c"] == []
    assert bm.seq_len("a") == 5 and bm.seq_len("b") == 4 and bm.seq_len("c") == 4
    assert_ok(bm)


def test_free_many_equals_freeing_one_by_one_and_refuses_bad_ids_whole(bm):
    one = BlockManager(CFG)
    for m in (bm, one):
        m.allocate("a", prompt(5))
        m.allocate("b", prompt(7, start=300))
        m.fork("a", "c")  # "c" shares "a"'s blocks: both freed at once drop two references
        m.allocate("d", prompt(3, start=500))
    snap = snapshot(bm)
    with pytest.raises(errors.UnknownSequenceError):
        bm.free_many(["a", "nope"])
    assert_unchanged(bm, snap)
    with pytest.raises(ValueError, match="repeated"):
        bm.free_many(["a", "b", "a"])
    assert_unchanged(bm, snap)
    bm.free_many(["a", "b", "c"])
    for seq_id in ("a", "b", "c"):
        one.free(seq_id)
    assert bm.num_free_blocks == one.num_free_blocks
    assert bm.free_slots == one.free_slots and list(bm._slots) == ["d"]
    assert bm.block_table("d") == one.block_table("d")
    assert_ok(bm)
    bm.free_many([])  # nothing to free: nothing changes
    assert bm.num_free_blocks == one.num_free_blocks


# -- admitting several prompts in one call -------------------------------------------------

MANY = CacheConfig(num_blocks=16, block_size=4, max_seqs=10, max_blocks_per_seq=6, watermark=0.1)
TEXTS = (prompt(24, 1), prompt(8, 1) + prompt(16, 50), prompt(24, 200))  # two share a block


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    rounds=st.lists(
        st.tuples(
            st.lists(  # items: prompt length, text, salt
                st.tuples(
                    st.integers(1, 20),
                    st.integers(0, 2),
                    st.sampled_from([None, None, "a", "b", ("t", 1)]),
                ),
                min_size=1,
                max_size=10,
            ),
            st.integers(0, 4),  # reserve
            st.booleans(),  # commit
            st.integers(0, 2**10 - 1),  # which held sequences to free afterwards
        ),
        min_size=1,
        max_size=3,
    )
)
def test_allocate_many_equals_allocate_one_by_one_until_the_first_refusal(rounds):
    """Batches of up to 10 prompts (two calls past 8) with repeated prompts (prefix hits,
    within a call too when ``commit``), tenants, a watermark and reserves, on 16 blocks:
    ``allocate_many`` returns the cached counts ``allocate`` returns item by item up to its
    first OutOfBlocksError, and leaves the same block state, slots and salt ids."""
    batch, one = BlockManager(MANY), BlockManager(MANY)
    n = 0
    for specs, reserve, commit, to_free in rounds:
        items = [
            (f"s{n + i}", TEXTS[text][:length], salt)
            for i, (length, text, salt) in enumerate(specs[: batch.num_free_slots])
        ]
        n += len(items)
        got = batch.allocate_many(items, commit=commit, reserve=reserve)
        want = []
        for seq_id, ids, salt in items:
            try:
                want.append(one.allocate(seq_id, ids, salt, commit=commit, reserve=reserve))
            except errors.OutOfBlocksError:
                break
        assert got == want
        chex.assert_trees_all_equal(batch.state, one.state)
        assert batch._slots == one._slots and batch._salts == one._salts
        assert batch.num_free_blocks == one.num_free_blocks
        assert_ok(batch)
        for bm in (batch, one):  # the prompts computed: later lookups hit them
            bm.commit({seq_id: len(ids) for seq_id, ids, _ in items[: len(got)]})
            bm.free_many([s for j, s in enumerate(sorted(bm._slots)) if to_free >> j & 1])


def test_allocate_many_with_an_invalid_item_raises_what_allocate_raises_and_changes_nothing():
    bm = BlockManager(MANY)
    bm.allocate("held", prompt(6), cache_salt="old")
    snap, salts = snapshot(bm), (dict(bm._salts), bm._next_salt)
    good = [("a", prompt(5), "new"), ("b", prompt(9, 300), None)]
    too_many = [(f"x{i}", [i + 1], None) for i in range(MANY.max_seqs)]  # one slot is held
    cases = [
        ([*good, ("a", prompt(3), None)], errors.DuplicateSequenceError),  # twice in the call
        ([*good, ("held", prompt(3), None)], errors.DuplicateSequenceError),
        ([*good, ("c", [], None)], errors.PaxcacheError),
        ([*good, ("c", [[1, 2]], None)], errors.PaxcacheError),
        ([*good, ("c", prompt(MANY.max_model_len + 1), None)], errors.SequenceTooLongError),
        ([*good, (["unhashable"], prompt(3), None)], errors.PaxcacheError),
        ([*good, ("c", prompt(3), ["unhashable"])], errors.PaxcacheError),
        (too_many, errors.NoFreeSlotError),
    ]
    for items, error in cases:
        with pytest.raises(errors.PaxcacheError) as raised:
            bm.allocate_many(items)
        assert type(raised.value) is error, items
        if items is not too_many and items[-1][0] != "a":  # allocate raises it for the item
            with pytest.raises(error):
                bm.allocate(*items[-1])
        assert_unchanged(bm, snap)
        assert (dict(bm._salts), bm._next_salt) == salts
    with pytest.raises(errors.PaxcacheError, match="reserve"):
        bm.allocate_many(good, reserve=-1)
    assert bm.allocate_many([]) == []
    assert_unchanged(bm, snap)


def test_a_new_salt_repeated_in_one_call_is_one_tenant_and_two_new_salts_are_two():
    bm = BlockManager(MANY)
    items = [("a", prompt(10), "x"), ("b", prompt(10), "y"), ("c", prompt(10), "x")]
    assert bm.allocate_many([*items, ("d", prompt(10), None)], commit=True) == [0, 0, 8, 0]
    assert bm._salts == {"x": 1, "y": 2}
    assert_ok(bm)


def test_a_reserve_refuses_an_admission_that_would_leave_fewer_blocks_free():
    bm = BlockManager(MANY)  # 16 blocks, watermark 1
    bm.allocate("a", prompt(20))  # 5 blocks: 11 free
    snap = snapshot(bm)
    with pytest.raises(errors.OutOfBlocksError, match="6 reserved"):
        bm.allocate("b", prompt(20, 300), reserve=6)  # would leave 6 < 6 + 1
    assert_unchanged(bm, snap)
    # "b" leaves 6 free (5 reserved + the watermark); "c" would leave 5: refused, and "d" after
    # it is not tried although a hit would make it take no block.
    items = [("b", prompt(20, 300), None), ("c", [1], None), ("d", prompt(5), None)]
    assert bm.allocate_many(items, reserve=5) == [0]
    assert bm.num_free_blocks == 6 and "c" not in bm and "d" not in bm
