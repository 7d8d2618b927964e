"""The scheduler's consistency checks: its queues and accounting against the block manager.

:func:`check_scheduler` is what :meth:`paxcache.scheduler.Scheduler.check_invariants` returns
(the engine's ``check_invariants`` reports them; tests assert them after every step). It only
reads: the scheduler, its sequences and its block manager are left as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from paxcache.sequence import SeqState

if TYPE_CHECKING:
    from paxcache.scheduler import Scheduler

__all__ = ["check_scheduler"]


def check_scheduler(sched: Scheduler, ahead: Mapping[int, int]) -> dict[str, bool]:
    """Named checks of ``sched``'s queues and accounting against its block manager, all True
    when consistent (reads the block state back from the device). ``ahead``: ``id(seq)`` ->
    tokens of it in a step in flight, which the block state already holds and the accounting
    not yet (:mod:`paxcache.overlap`).

    Every live sequence in exactly one queue with the matching state; queues in age order
    and every running sequence older than every queued one; at most ``max_num_seqs``
    running; followers with a running leader; slots (held by exactly the running and
    swapped sequences, the free list and the allocator's active / swapped flags agree);
    each sequence's allocation matches its slot's length, and ``num_computed <=
    num_allocated <= len(token_ids)``; every planned row got its blocks.
    """
    bm = sched.block_manager
    cfg = bm.cfg
    st = (
        np.asarray(bm.state.seq_lens),
        np.asarray(bm.state.active),
        np.asarray(bm.state.swapped),
    )
    seq_lens, active, swapped_flags = st
    waiting = [s for unit in sched.waiting for s in unit]
    swapped = sched.swapped
    queued = [s for unit in sched.queued for s in unit]
    live = sched.running + queued
    ids = [id(s) for s in live]
    checks: dict[str, bool] = {}
    checks["queues_disjoint"] = len(set(ids)) == len(ids)
    checks["queue_states"] = (
        all(s.state == SeqState.RUNNING for s in sched.running)
        and all(len(u) == 1 for u in sched.queued if u[0].state == SeqState.SWAPPED)
        and all(s.state == SeqState.WAITING for s in waiting)
    )
    ages = [u[0].age for u in sched.queued]
    checks["queues_in_age_order"] = ages == sorted(ages)
    checks["running_older_than_queued"] = not (sched.running and queued) or max(
        s.age for s in sched.running
    ) < min(s.age for s in queued)
    checks["running_within_max_num_seqs"] = len(sched.running) <= sched.max_num_seqs
    checks["followers_with_running_leader"] = all(
        s.leader.state == SeqState.RUNNING for s in sched.running if s.leader is not None
    )
    holders = sched.running + swapped
    held = all(s in bm for s in holders) and not any(s in bm for s in waiting)
    slots = [bm.slot(s) for s in holders] if held else []
    free_slots = bm.free_slots
    checks["slots_accounted"] = (
        held and len(bm) == len(holders) and sorted(slots + free_slots) == list(range(cfg.max_seqs))
    )
    swapped_ids = {id(s) for s in swapped}
    checks["slot_flags_match"] = checks["slots_accounted"] and (
        all(bool(active[bm.slot(s)]) for s in holders)
        and not any(bool(active[x]) for x in free_slots)
        and all(bool(swapped_flags[bm.slot(s)]) == (id(s) in swapped_ids) for s in holders)
    )
    checks["lengths_match"] = checks["slots_accounted"] and (
        all(int(seq_lens[bm.slot(s)]) == s.num_allocated + ahead.get(id(s), 0) for s in holders)
        and all(s.num_computed <= s.num_allocated <= len(s.token_ids) for s in holders)
        and all(s.num_computed == s.num_allocated == 0 for s in waiting)
    )
    checks["planned_rows_ran"] = sched.num_refused_rows == 0
    return checks
