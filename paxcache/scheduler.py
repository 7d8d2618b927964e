"""Continuous-batching scheduler: host-side, plain Python; decides *what* runs each step.

The scheduler owns the queues, the per-sequence accounting (:mod:`paxcache.sequence`) and the
one host-side :class:`~paxcache.manager.BlockManager`. A step reads in one direction, and
nothing here calls back into the engine:

1. :meth:`Scheduler.schedule` returns a :class:`StepPlan`: the rows (which sequences feed how
   many tokens), the samples, and what it did to the block manager to make room for them:
   admissions, swaps out and in with their ``(src, dst)`` block pairs, preemptions, failures.
   It moves no KV and runs no model: the plan's block copies are the engine's to make.
2. The engine carries the plan out (swaps, then one fused device step: :mod:`paxcache.step`).
3. :meth:`Scheduler.postprocess` takes the step's :class:`StepResult`: the block manager adopts
   the block state, rows advance, sampled tokens (and logprobs) are appended, a token's own
   stop conditions are applied and what finished is freed; :meth:`Scheduler.stop_at` then
   ends what the output processor found a stop string in (the text is not the scheduler's).

Token accounting is unified (prefill, chunked prefill, decode and recompute are one thing; see
:mod:`paxcache.sequence`): a step feeds ``token_ids[num_computed : num_computed + q]`` and
samples when that reaches the end; a decode is simply ``q == 1``. After a recompute
preemption ``num_computed`` is reset to 0 and the whole history is prefilled again
(prefix-cache hits make that cheap).

Policies (the order in which running sequences share the step's token budget):
  ``"fifo"``: running decodes first (they never stall behind a long prompt), then prefill
  chunks, each group in arrival order.
  ``"prefill_first"``: pending prefill chunks first (time to first token), then decodes.

Rules
-----
Sequences are ordered by arrival (the ``n`` completions of a request by index); *older* means
earlier. A *unit* is what is preempted and resumed together: one sequence, or a leader with the
followers that still wait for its prompt (``n > 1`` before the first token). Each step:

R1 *Oldest runs.* Running sequences are planned in policy order, but one token of the budget is
   held back for the oldest running sequence until it is planned: it feeds at least one token.
R2 *Preempt the newest.* While the planned rows need more new blocks than are free, the newest
   running unit is preempted (swapped to host memory when ``preemption_mode="swap"``, it is
   decoding, has no waiting followers and the host pool has room; otherwise recomputed: its
   blocks are freed and it is queued again with its whole history). The oldest running unit is
   never preempted: if it cannot fit with every other unit preempted, it finishes with an error.
R3 *No resume in a preempting step.* A step that preempted resumes and admits nothing (as vLLM).
R4 *One queue, arrival order.* Swapped sequences and waiting units (recompute-preempted or new)
   are resumed strictly oldest first; nothing overtakes the head of the queue.
R5 *A preempted unit waits for a departure.* It is resumed only after a running sequence has
   left the running set (finished, aborted or failed) since it was preempted. (When nothing
   runs one has: the oldest running unit is never preempted, so it must have left.)
R6 *Reserve what is planned.* A resumption or admission must leave free the blocks that the
   rows already planned for this step (and its own first row) will take, plus the watermark; a
   resumed or admitted unit runs in the same step.
R7 *Outgrowing longrope recomputes in place.* With ``rope_switch_len`` (longrope), a running
   sequence that grows past it on K/V computed with the short factors is freed and allocated
   again whole before the step plans (it keeps running); room is made as by R2, and if it is
   the newest it is queued instead (then the queue's head). A step where this preempted is
   a preempting step for R3.

Guarantees (proved from the rules; ``tests/test_stress.py`` checks them on random workloads):
  * Invariant: every running sequence is older than every queued one. (R2 preempts the newest
    running; R4 resumes the oldest queued; new requests are the newest of all.)
  * Progress: every step, the oldest live sequence feeds at least one token, or finishes with an
    error because it cannot fit in the whole cache. If it is running, R1 plans it, R2 never
    preempts it while anything else runs, and its append cannot be refused: R2 stops only when
    the planned rows' block need (counted exactly, copy-on-write included) fits in the free
    blocks, and R6 keeps resumptions off those blocks. If it is queued, nothing runs
    (invariant), so it is resumed now or can never fit. Hence the oldest sequence finishes
    within ``P + M`` steps of becoming the oldest (``P`` prompt tokens, ``M = max_tokens``: at
    most ``P + M - 1`` tokens to feed, no more recompute once it is the oldest; twice that
    with R7's one longrope recompute), and a request finishes within ``sum(P_s + M_s)`` steps
    (twice that with R7) of its arrival, summed over its own sequences and the older
    sequences alive when it arrived.
  * No thrashing: a sequence is preempted at most ``1 + D`` times, where ``D`` is the number of
    older sequences that finish, are aborted or fail while it is alive. Between two
    preemptions it must be resumed, which needs a departure after the first (R5); while it is
    queued only older sequences run (invariant), so each departure is an older sequence's and
    counts once.
  * A preempted sequence is never resumed in the step that preempted it (R3, R5).
  * A request that can never fit finishes with an error instead of hanging: a running sequence
    by R2, a queued one when nothing runs and it still cannot be resumed (the cache is empty).
"""

from __future__ import annotations

import bisect
import collections
import logging
import operator
from collections.abc import Collection, Mapping

import numpy as np

from paxcache.allocator import append_need
from paxcache.errors import OutOfBlocksError
from paxcache.manager import BlockManager
from paxcache.outputs import INTERNAL_ERROR
from paxcache.plan import StepPlan, StepResult, record_prompt_logprobs
from paxcache.scheduler_checks import check_scheduler
from paxcache.sequence import SeqState, Sequence, check_stop, stop_ids

__all__ = ["Scheduler", "SeqState", "Sequence", "StepPlan", "StepResult"]

logger = logging.getLogger(__name__)

_AGE = operator.attrgetter("arrival", "index")  # Sequence.age, without a call per sequence

_LONG_ROPE_SALT = "paxcache:longrope-long"
"""Tags the prefix-cache salt of sequences past ``rope_switch_len`` (with their own salt)."""


class Scheduler:
    """Queues, per-step decisions and per-sequence accounting (rules in the module docstring).

    Args:
      block_manager: the one block manager; the scheduler is its only caller.
      max_num_seqs: most sequences in one step (and running at once).
      max_num_batched_tokens: token budget of one step, shared by decodes and prefill chunks.
      preemption_mode: ``"swap"`` or ``"recompute"``.
      policy: ``"fifo"`` or ``"prefill_first"``.
      max_model_len: longest sequence; one that reaches it finishes with ``"length"``.
      eos_token_ids: tokens that end a sequence (unless its ``ignore_eos``).
      rope_switch_len: the model's ``LlamaConfig.rope_switch_len`` (longrope's original
        length), or None: a sequence whose K/V were computed while it was no longer than it
        and that grows past it is recomputed whole (:meth:`_recompute_outgrown`), and the
        prefix cache keeps the blocks of sequences on either side of it apart.

    Counters (each fact counted once): ``num_swaps`` (units preempted by swapping their lead
    out: one swap-out, one sequence out, per swap preemption) and
    ``num_preemptions_recompute``, summed by the ``num_preemptions`` property;
    ``num_swapped_out_blocks``, ``num_swapped_in_seqs`` / ``_blocks``; ``num_departures``
    (running sequences that finished, were aborted or failed); ``num_prompt_tokens`` (of
    requests added),
    ``num_prefill_tokens_computed`` (prompt tokens run through the model),
    ``num_generated_tokens``; ``num_refused_rows`` (planned rows the allocator refused: 0
    unless the block arithmetic has a bug); ``num_multi_step_decodes`` (steps that ran as a
    multi-step decode, :mod:`paxcache.decode_loop`) and ``num_multi_step_iterations`` (the
    iterations they ran); ``num_rope_recomputes`` (sequences recomputed for outgrowing
    ``rope_switch_len``: not preemptions).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        policy: str = "fifo",
        max_model_len: int | None = None,
        eos_token_ids: Collection[int] = (),
        rope_switch_len: int | None = None,
    ) -> None:
        if policy not in ("fifo", "prefill_first"):
            raise ValueError(f"policy must be 'fifo' or 'prefill_first', got {policy!r}")
        if preemption_mode not in ("swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be 'swap' or 'recompute', got {preemption_mode!r}"
            )
        self.block_manager = block_manager
        self.block_size = block_manager.cfg.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.policy = policy
        self.max_model_len = max_model_len or block_manager.cfg.max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.rope_switch_len = rope_switch_len
        # The one queue (R4), in age order (``Sequence.age`` is unique, so its head is the
        # oldest): units of sequences admitted together (a leader, then its waiting followers),
        # never admitted or preempted by recompute (state WAITING), and single sequences whose
        # blocks are parked on the host (state SWAPPED). The state says which; ``waiting`` and
        # ``swapped`` are views.
        self.queued: collections.deque[list[Sequence]] = collections.deque()
        self.running: list[Sequence] = []
        self.num_swaps = 0
        self.num_preemptions_recompute = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_seqs = self.num_swapped_in_blocks = 0
        self.num_departures = 0
        self.num_prompt_tokens = 0
        self.num_prefill_tokens_computed = 0
        self.num_generated_tokens = 0
        self.num_refused_rows = 0
        self.num_multi_step_decodes = self.num_multi_step_iterations = 0
        self.num_rope_recomputes = 0

    # -- queues ---------------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        """Queues a new request's sequences (a leader first, then its followers)."""
        for s in seqs:
            s.group = seqs
        self.num_prompt_tokens += seqs[0].num_prompt
        self.queued.append(seqs)  # the newest of all: the end keeps the queue in age order

    def remove(self, seqs: list[Sequence]) -> None:
        """Drops sequences from every queue; their blocks stay (see :meth:`finish`)."""
        ids = {id(s) for s in seqs}
        running = [s for s in self.running if id(s) not in ids]
        self.num_departures += len(self.running) - len(running)
        self.running = running
        kept: collections.deque[list[Sequence]] = collections.deque()
        for unit in self.queued:
            unit = [s for s in unit if id(s) not in ids]
            if unit:
                kept.append(unit)
        self.queued = kept

    def finish(self, seqs: list[Sequence], reason: str, error: str | None = None) -> None:
        """Ends sequences now (abort, failure): out of every queue, blocks freed, finished
        with ``reason`` (a sequence that already finished keeps its own)."""
        self.remove(seqs)
        self._release(seqs)
        for s in seqs:
            s.finish(reason, error)

    def _release(self, seqs: list[Sequence]) -> None:
        """Frees the blocks of those of ``seqs`` that hold any, in one allocator call."""
        bm = self.block_manager
        bm.free_many([s for s in seqs if s in bm])

    def reset_cache(self, state: object) -> list[Sequence]:
        """Starts the block manager over from an empty ``state`` (the old one is gone, e.g.
        consumed by a failed device step) and returns the live sequences that held blocks:
        their KV is lost, the caller fails them. Queued sequences without blocks are kept."""
        lost = [s for s in self.running + self.swapped if s in self.block_manager]
        self.block_manager.reset(state)
        return lost

    @property
    def num_preemptions(self) -> int:
        """Units preempted, either way."""
        return self.num_swaps + self.num_preemptions_recompute

    @property
    def waiting(self) -> list[list[Sequence]]:
        """The queued units not swapped out (never admitted, or preempted by recompute), in
        age order (a view of :attr:`queued`)."""
        return [u for u in self.queued if u[0].state != SeqState.SWAPPED]

    @property
    def swapped(self) -> list[Sequence]:
        """The queued sequences whose blocks are on the host, in age order (a view of
        :attr:`queued`)."""
        return [u[0] for u in self.queued if u[0].state == SeqState.SWAPPED]

    @property
    def num_waiting(self) -> int:
        return sum(len(u) for u in self.waiting)

    def has_work(self) -> bool:
        return bool(self.queued or self.running)

    def oldest_waiting_arrival(self) -> float | None:
        """``arrival_time`` of the oldest request with a queued sequence, None when none."""
        return min((u[0].arrival_time for u in self.queued), default=None)

    def _queue_head(self) -> list[Sequence] | None:
        """The oldest queued unit, swapped or waiting (R4)."""
        return self.queued[0] if self.queued else None

    def _enqueue(self, unit: list[Sequence]) -> None:
        """Puts a preempted unit back in the queue at its age (R4)."""
        ages = [u[0].age for u in self.queued]
        self.queued.insert(bisect.bisect(ages, unit[0].age), unit)

    def _unit_of(self, seq: Sequence) -> list[Sequence]:
        """``seq``'s unit: its leader (or itself) and the running followers still waiting."""
        lead = seq.leader or seq
        waiting = [f for f in lead.followers if f.leader is lead and f.state == SeqState.RUNNING]
        return [lead, *waiting]

    # -- block arithmetic -----------------------------------------------------------------

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def blocks_needed(self, rows: list[tuple[Sequence, int]]) -> int:
        """Fresh blocks the allocator's ``append`` takes to feed ``rows``, exactly: its own
        arithmetic (:func:`paxcache.allocator.append_need`) on what the scheduler knows. A row
        appends what it feeds beyond its allocation; a partial last block is shared while
        siblings forked with it hold it (``shared_last``: the request's running sequences
        with it set are the holders, its writers ranked in row order)."""
        s = self.block_size
        need = 0
        holders: collections.Counter[str] | None = None
        rank: collections.Counter[str] = collections.Counter()
        for seq, q in rows:
            length = seq.num_allocated
            new = max(0, seq.num_computed + q - length)
            shared = seq.shared_last and new > 0 and length % s != 0
            last_ref = r = 0
            if shared:
                if holders is None:
                    holders = collections.Counter(
                        t.request_id for t in self.running if t.shared_last
                    )
                last_ref, r = holders[seq.request_id], rank[seq.request_id]
                rank[seq.request_id] += 1
            before, after, cow = append_need(length, new, s, shared, last_ref, r)
            need += after - before + cow
        return need

    # -- preemption -----------------------------------------------------------------------

    def _can_swap(self, unit: list[Sequence]) -> bool:
        lead = unit[0]
        bm = self.block_manager
        return (
            self.preemption_mode == "swap"
            and bm.cfg.num_host_blocks > 0
            and len(unit) == 1  # no follower waits for its prompt
            and lead.remaining == 1  # decoding (a prompt is cheaper to recompute)
            and self._blocks(lead.num_allocated) <= bm.num_free_host_blocks
            and not self._outgrown(lead)  # its K/V are stale: R7 recomputes it
        )

    def _outgrown(self, seq: Sequence) -> bool:
        """R7: ``seq`` is longer than ``rope_switch_len`` on K/V of the short factors."""
        limit = self.rope_switch_len
        stale = not seq.rope_long and seq.num_computed > 0
        return limit is not None and stale and len(seq.token_ids) > limit

    def _swap_out(self, seq: Sequence, plan: StepPlan) -> bool:
        """Moves ``seq``'s blocks to the host pool (all or nothing); the copies go in the plan."""
        try:
            pairs = self.block_manager.swap_out(seq)
        except OutOfBlocksError:
            return False
        plan.swap_out += pairs
        plan.swapped_out.append(seq)
        self.num_swapped_out_blocks += len(pairs)
        return True

    def _preempt(self, unit: list[Sequence], plan: StepPlan) -> None:
        """R2: swaps ``unit`` out or frees it for recompute; it waits for a departure (R5)."""
        for s in unit:
            self.running.remove(s)
            s.num_preemptions += 1
            s.preempted_at = self.num_departures
        plan.preempted += unit
        lead = unit[0]
        if self._can_swap(unit) and self._swap_out(lead, plan):
            self.num_swaps += 1
            lead.state = SeqState.SWAPPED
            lead.shared_last = False  # its table now points at private host copies
            self._enqueue([lead])
            return
        self.num_preemptions_recompute += 1
        self._requeue(unit)

    def _requeue(self, unit: list[Sequence]) -> None:
        """Frees a unit's blocks and queues it again (in age order) with its whole history,
        to be computed from the start."""
        self._release(unit)
        for s in unit:
            s.state = SeqState.WAITING
            s.num_computed = 0
            s.num_allocated = 0
            s.shared_last = False
        self._enqueue(unit)

    def _recompute_outgrown(self, plan: StepPlan) -> bool:
        """R7 (longrope, see the module docstring; HF's ``generate`` drops its cache at that
        step): a running sequence that outgrew ``rope_switch_len`` on short-factor K/V is
        freed and allocated again whole at once, so it keeps running; returns whether room
        was made by preempting (R3 then holds)."""
        preempted = False
        outgrown = [s for s in self.running if s.leader is None and self._outgrown(s)]
        for seq in sorted(outgrown, key=_AGE):
            if seq not in self.running:  # preempted as a newer unit of an older one's room
                continue
            self.num_rope_recomputes += 1
            self._release([seq])
            seq.num_computed = seq.num_allocated = 0
            seq.shared_last = False
            while not self._admit([[seq]], reserve=0):
                newest = max(self.running, key=_AGE)
                if newest is not seq:
                    self._preempt(self._unit_of(newest), plan)
                elif len(self.running) == 1:
                    self._fail([seq], self._never_fits([seq], "recomputed"), plan)
                    break
                else:
                    self.running.remove(seq)
                    self._requeue([seq])
                    plan.preempted.append(seq)
                preempted = True
                if seq not in self.running:
                    break
        return preempted

    def _fail(self, seqs: list[Sequence], message: str, plan: StepPlan) -> None:
        """Finishes sequences that can never fit with an error (they report in ``plan``)."""
        self.finish(seqs, "error", message)
        plan.failed += seqs

    def _never_fits(self, seqs: list[Sequence], what: str) -> str:
        return (
            f"sequence of {len(seqs[0].token_ids)} tokens can never be {what}: it needs more "
            f"KV blocks than the cache admits (free {self.block_manager.num_free_blocks} minus "
            "the watermark)"
        )

    # -- the step -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plans the next step: rows, samples, and the admissions, swaps, preemptions and
        failures that make room for them (in the block manager; no KV moves here)."""
        plan = StepPlan()
        recomputed = self.rope_switch_len is not None and self._recompute_outgrown(plan)
        rows = self._plan_running()
        rows, preempted = self._fit(rows, plan)
        preempted = preempted or recomputed
        if not preempted:  # R3
            budget = self.max_num_batched_tokens - sum(q for _, q in rows)
            self._resume(rows, budget, plan)
        if not rows and not self.running:
            # The queue head was not resumed although nothing runs: every block is free, so it
            # never will be (e.g. it grew past ``num_blocks - watermark`` and was preempted).
            head = self._queue_head()
            if head is not None:
                swapped = head[0].state == SeqState.SWAPPED
                self._fail(
                    head, self._never_fits(head, "swapped back in" if swapped else "admitted"), plan
                )

        # One pass over the rows: each one's slot; a row that reaches the end of its tokens
        # samples, so do its followers; its prompt positions, with prompt logprobs.
        plan.rows, slot, samples = rows, self.block_manager.slot, plan.samples
        for i, (seq, q) in enumerate(rows):
            plan.slots.append(slot(seq))
            c = seq.num_computed
            if c + q == len(seq.token_ids):
                samples.append((seq, i))
                for f in seq.followers:
                    if f.state == SeqState.RUNNING and f.leader is seq:
                        samples.append((f, i))
            if seq.prompt_logprobs is not None:
                plan.prompt_positions += [(i, p) for p in range(c, min(c + q, seq.num_prompt - 1))]
        return plan

    def _plan_running(self) -> list[tuple[Sequence, int]]:
        """R1: the running sequences' rows in policy order, the oldest always among them."""
        runnable = [s for s in self.running if s.leader is None]  # followers wait, no rows
        decodes = sorted((s for s in runnable if len(s.token_ids) - s.num_computed == 1), key=_AGE)
        budget = self.max_num_batched_tokens
        if len(decodes) == len(runnable) <= budget:  # all decodes fit: the loop's rows, at once
            return [(s, 1) for s in decodes]
        oldest = min(runnable, key=_AGE)
        prefills = sorted((s for s in runnable if len(s.token_ids) - s.num_computed > 1), key=_AGE)
        order = decodes + prefills if self.policy == "fifo" else prefills + decodes
        rows: list[tuple[Sequence, int]] = []
        oldest_planned = False
        for seq in order:
            held = 0 if oldest_planned or seq is oldest else 1  # one token kept for the oldest
            q = min(seq.remaining, budget - held)
            if q <= 0:
                continue
            rows.append((seq, q))
            budget -= q
            oldest_planned = oldest_planned or seq is oldest
        return rows

    def _fit(
        self, rows: list[tuple[Sequence, int]], plan: StepPlan
    ) -> tuple[list[tuple[Sequence, int]], bool]:
        """R2: preempts the newest units until the rows' new blocks fit in the free blocks.

        Returns the rows still planned and whether anything was preempted.
        """
        preempted = False
        bm = self.block_manager
        while rows and self.blocks_needed(rows) > bm.num_free_blocks:
            unit = self._unit_of(max(self.running, key=_AGE))
            if len(unit) == len(self.running):
                # The oldest unit is all that runs and still does not fit: it never will.
                victim = unit[0]
                message = (
                    f"the KV cache ({bm.num_free_blocks} free blocks) cannot hold "
                    f"this sequence of {len(victim.token_ids)} tokens"
                )
                self._fail(unit, message, plan)
            else:
                self._preempt(unit, plan)
                preempted = True
            alive = {id(s) for s in self.running}
            rows = [(s, q) for s, q in rows if id(s) in alive]
        return rows, preempted

    def _resume(self, rows: list[tuple[Sequence, int]], budget: int, plan: StepPlan) -> None:
        """R4-R6: resumes or admits queued units, oldest first, each with a row this step.

        A swapped unit comes back alone; waiting units are admitted a run at a time, one
        allocator call per run (:meth:`_waiting_run`), with the decisions of admitting them
        one by one: a unit of a run is admitted iff it would have been, after the ones before
        it."""
        while budget > 0 and self.queued:
            unit = self.queued[0]
            if unit[0].state == SeqState.SWAPPED:
                if not self._may_resume(unit, len(self.running)) or not self._swap_in(
                    unit[0], rows, plan
                ):
                    return
                budget = self._start([unit], rows, budget)
                continue
            run = self._waiting_run(budget)
            if not run:
                return
            # R6. The run's own rows take no block (a history is allocated whole at
            # admission, so a first row only computes what it holds: ``blocks_needed`` counts
            # 0 for it): each unit of the run reserves what the units before it would.
            admitted = self._admit(run, self.blocks_needed(rows))
            for _ in admitted:
                plan.admitted += self.queued.popleft()
            budget = self._start(admitted, rows, budget)
            if len(admitted) < len(run):
                return

    def _may_resume(self, unit: list[Sequence], running: int) -> bool:
        """Whether ``unit`` may join ``running`` running sequences: within ``max_num_seqs``,
        and not before a departure since its preemption (R5; with nothing running one has
        happened)."""
        if running + len(unit) > self.max_num_seqs:
            return False
        return not running or all(s.preempted_at < self.num_departures for s in unit)

    def _waiting_run(self, budget: int) -> list[list[Sequence]]:
        """The waiting units at the queue's head that :meth:`_resume` would try to admit one
        after the other if each before it were admitted with no prefix hit: a unit is tried
        while budget is left, and a hit only leaves more (a row feeds what its unit does not
        hold yet). A unit with followers ends the run: they fork into the next free slots
        before a later unit takes one (the slots stay those of one-by-one admissions)."""
        run: list[list[Sequence]] = []
        running, slots = len(self.running), self.block_manager.num_free_slots
        for unit in self.queued:
            if budget <= 0 or unit[0].state == SeqState.SWAPPED or slots < len(unit):
                break
            if not self._may_resume(unit, running):
                break
            run.append(unit)
            running, slots = running + len(unit), slots - len(unit)
            budget -= min(len(unit[0].token_ids), budget)
            if len(unit) > 1:
                break
        return run

    def _swap_in(self, lead: Sequence, rows: list[tuple[Sequence, int]], plan: StepPlan) -> bool:
        """Brings the swapped ``lead`` at the queue's head back (R6: leaving the planned rows'
        blocks and its own decode's free); False, changing nothing, when it does not fit."""
        own = self.blocks_needed([(lead, 1)])  # its decode may start a new block
        try:
            pairs = self.block_manager.swap_in(lead, reserve=self.blocks_needed(rows) + own)
        except OutOfBlocksError:
            return False
        self.queued.popleft()
        plan.swap_in += pairs
        plan.swapped_in.append(lead)
        self.num_swapped_in_seqs += 1
        self.num_swapped_in_blocks += len(pairs)
        return True

    def _start(
        self, units: list[list[Sequence]], rows: list[tuple[Sequence, int]], budget: int
    ) -> int:
        """Runs resumed ``units``, each lead with a row of what the budget leaves; returns the
        budget left."""
        for unit in units:
            for s in unit:
                s.state = SeqState.RUNNING
                self.running.append(s)
            lead = unit[0]
            q = min(lead.remaining, budget)
            rows.append((lead, q))
            budget -= q
        return budget

    def _admit(self, units: list[list[Sequence]], reserve: int) -> list[list[Sequence]]:
        """Allocates each unit's history (blocks visible to lookups once computed), in order
        and in one allocator call, and forks its followers from it; stops at the first unit
        refused because ``reserve`` blocks plus the watermark would not stay free after it.
        Only the last unit may have followers (they fork after the call). Returns the
        admitted units, a prefix of ``units``."""
        bm = self.block_manager
        limit = self.rope_switch_len
        longs = [limit is not None and len(u[0].token_ids) > limit for u in units]
        # Blocks computed with longrope's long factors never serve a short sequence's prefix,
        # nor the other way round: their keys differ.
        items = [
            (u[0], u[0].token_ids, (_LONG_ROPE_SALT, u[0].cache_salt) if long else u[0].cache_salt)
            for u, long in zip(units, longs, strict=True)
        ]
        cached = bm.allocate_many(items, commit=False, reserve=reserve)
        for unit, long, hit in zip(units, longs, cached, strict=False):  # the admitted ones
            lead = unit[0]
            for s in unit:
                s.rope_long = long
            if lead.num_cached_tokens is None:
                lead.num_cached_tokens = hit
            n = len(lead.token_ids)
            lead.num_computed, lead.num_allocated = hit, n
            lead.shared_last = len(unit) > 1
            for f in unit[1:]:
                bm.fork(lead, f)  # cannot fail: the slots were counted
                f.num_computed, f.num_allocated = hit, n
                f.shared_last = True
        return units[: len(cached)]

    # -- after the step -------------------------------------------------------------------

    def postprocess(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """All per-sequence accounting of a step that ran: adopts the block state, advances
        the rows, appends the sampled tokens (and logprobs), applies the stop conditions a
        token decides by itself (stop strings come after, from the output processor:
        :meth:`stop_at`) and frees what finished. A request whose host work raises fails
        alone.

        Returns:
          The sequences whose request has something new to report (a token, a finish or a
          failure), in plan order.
        """
        self.block_manager.adopt(result.state, result.num_free_blocks)
        failed = dict.fromkeys(result.failed_requests)
        row_ok = result.row_ok
        refused = len(plan.rows) - int(row_ok[: len(plan.rows)].sum())
        if refused:  # planned rows have free blocks: a block-arithmetic bug; they run again
            self.num_refused_rows += refused
            logger.warning("the allocator refused %d of %d planned rows", refused, len(plan.rows))
        record_prompt_logprobs(plan, result, failed)
        if result.steps is not None:
            self.num_multi_step_decodes += 1
            self.num_multi_step_iterations += int(np.max(result.steps, initial=0))
        touched: dict[int, Sequence] = {}
        finished: list[Sequence] = []
        if result.steps is None:
            self._advance(plan, np.asarray(row_ok, bool), result, failed, touched, finished)
        else:
            self._advance_loop(plan, result, failed, touched, finished)
        done = [seq for seq in finished if seq.request_id not in failed]
        if done:  # one queue pass and one allocator call, however many finished
            self.remove(done)
            self._release(done)
        if failed:  # a pass over the plan only when a request failed
            for seq in {id(s.group[0]): s for s, _ in plan.rows + plan.samples}.values():
                if seq.request_id in failed:
                    self.finish(seq.group, "error", INTERNAL_ERROR)
                    touched.update((id(s), s) for s in seq.group)
        return list(touched.values())

    def _advance_loop(
        self,
        plan: StepPlan,
        result: StepResult,
        failed: dict,
        touched: dict[int, Sequence],
        finished: list[Sequence],
    ) -> None:
        """A multi-step decode's accounting (every row one token per iteration, sampling its
        own sequence): a row takes its tokens at once (:meth:`_take_chunk`); any row the
        chunk cannot prove equal goes iteration by iteration (:meth:`_advance`), as one step
        each."""
        steps = np.asarray(result.steps)
        slow = np.zeros(len(steps), bool)
        steps_of_row = steps.tolist()
        tokens_of_sample = np.asarray(result.tokens).T.tolist()  # [R][K] Python ints, at once
        done = SeqState.FINISHED
        for j, (seq, row) in enumerate(plan.samples):
            n = steps_of_row[row]
            if n == 0 or seq.request_id in failed or seq.state == done:
                continue
            toks = tokens_of_sample[j][:n]
            if not self._take_chunk(seq, toks, result, j):
                slow[row] = True
                continue
            touched[id(seq)] = seq
            if seq.is_finished:
                finished.append(seq)
        if slow.any():
            for ran, one in result.iterations():
                self._advance(plan, ran & slow, one, failed, touched, finished)
            order = {id(s): s for s, _ in plan.samples if id(s) in touched}  # plan order
            touched.clear()
            touched.update(order)

    def _take_chunk(self, seq: Sequence, toks: list[int], result: StepResult, j: int) -> bool:
        """Appends the ``toks`` a multi-step decode row generated (sample ``j`` of ``result``,
        with logprobs) and applies the stop conditions at once, as ``len(toks)`` single steps
        would; False, changing nothing, when that is not certain (a grammar, a stop or length
        condition before the last token). Stop strings are the output processor's."""
        if seq.matcher is not None:
            return False
        eos, max_len, n = self.eos_token_ids, self.max_model_len, len(toks)
        max_tokens = seq.params.max_tokens
        total = len(seq.token_ids) + n  # once appended; reached_length's rule, inlined:
        if total - 1 - seq.num_prompt >= max_tokens or total - 1 >= max_len:
            return False  # a length stop before the last token
        stops = stop_ids(seq, eos)[1]  # is_stop_token's ids
        if n > 1 and not stops.isdisjoint(toks[:-1]):
            return False  # a stop token before the last token
        self._feed(seq, n)
        seq.token_ids.extend(toks)
        seq.new_ids.extend(toks)
        if seq.logprobs is not None:  # raw, per iteration k: the output processor formats
            r = result
            lps = zip(r.logprob[:n, j], r.top_ids[:n, j], r.top_logprobs[:n, j], strict=True)
            seq.logprobs.extend((t, *lp) for t, lp in zip(toks, lps, strict=True))
        self.num_generated_tokens += n
        last = toks[-1]
        if last in stops or total - seq.num_prompt >= max_tokens or total >= max_len:
            check_stop(seq, last, eos, max_len)  # it finishes: the one rule decides how
        return True

    def stop_at(self, hits: list[tuple[Sequence, int]]) -> None:
        """Ends the sequences whose text reached a stop string (``hits``: each with the
        generated tokens it keeps, found by the output processor): a multi-step decode may
        have generated more, which are dropped as if never sampled. Each finishes with
        ``"stop"`` (a stop string outranks the length or stop token of the same token) and
        its blocks are freed."""
        for seq, keep in hits:
            drop = seq.num_generated - keep
            if drop > 0:  # the step's last tokens, all in new_ids (not yet reported)
                del seq.token_ids[seq.num_prompt + keep :]
                del seq.new_ids[len(seq.new_ids) - drop :]
                if seq.logprobs is not None:
                    del seq.logprobs[keep:]
                self.num_generated_tokens -= drop
                seq.ends_on_stop_token = False
            if seq.is_finished:
                seq.finish_reason = "stop"
        self.finish([seq for seq, _ in hits], "stop")

    def _feed(self, seq: Sequence, q: int) -> None:
        """``q`` more of ``seq``'s tokens went through the model (their K/V are written)."""
        prompt_left = max(0, seq.num_prompt - seq.num_computed)
        self.num_prefill_tokens_computed += min(prompt_left, q)
        seq.num_computed += q
        if seq.num_computed > seq.num_allocated:
            seq.num_allocated = seq.num_computed
            seq.shared_last = False

    def _advance(
        self,
        plan: StepPlan,
        ran: np.ndarray,
        result: StepResult,
        failed: dict,
        touched: dict[int, Sequence],
        finished: list[Sequence],
    ) -> None:
        """One iteration's accounting: the rows that ``ran`` advance, their samples append
        ``result.tokens`` (and logprobs) and meet the stop conditions. A sequence that
        finished in an earlier iteration (a stop string the device does not see) takes
        nothing more."""
        ran = np.asarray(ran).tolist()  # Python bools and ints: no numpy scalar per row
        tokens = np.asarray(result.tokens).tolist()
        eos, max_len = self.eos_token_ids, self.max_model_len
        for i, (seq, q) in enumerate(plan.rows):
            if not ran[i] or seq.request_id in failed or seq.is_finished:
                continue
            self._feed(seq, q)
        for j, (seq, row) in enumerate(plan.samples):
            if not ran[row] or seq.request_id in failed or seq.is_finished:
                continue
            lead = plan.rows[row][0]
            if seq is not lead:  # a follower samples from its leader's last row
                seq.token_ids = lead.token_ids[: lead.num_computed]
                seq.num_computed = lead.num_computed
                seq.num_allocated = lead.num_allocated
                seq.leader = None
                seq.shared_last = True
            tok = tokens[j]
            seq.token_ids.append(tok)
            seq.new_ids.append(tok)
            self.num_generated_tokens += 1
            try:
                if seq.logprobs is not None:  # raw: the output processor formats it
                    lp = (tok, result.logprob[j], result.top_ids[j], result.top_logprobs[j])
                    seq.logprobs.append(lp)
                total = len(seq.token_ids)  # check_stop's conditions, inlined (a call less)
                stops = seq.matcher is not None or tok in stop_ids(seq, eos)[1]
                if stops or total - seq.num_prompt >= seq.params.max_tokens or total >= max_len:
                    check_stop(seq, tok, eos, max_len)  # advances a grammar, decides the finish
            except Exception:  # noqa: BLE001 - this request fails, the others go on
                logger.exception(
                    "request %s failed in its grammar or stop conditions; failing it alone",
                    seq.request_id,
                )
                failed[seq.request_id] = None
                continue
            touched[id(seq)] = seq
            if seq.is_finished:
                finished.append(seq)

    # -- checks ---------------------------------------------------------------------------

    def check_invariants(self, ahead: Mapping[int, int] | None = None) -> dict[str, bool]:
        """Named checks of the queues and of the accounting against the block manager (all
        True when consistent; reads the block state back from the device): see
        :func:`paxcache.scheduler_checks.check_scheduler`. ``ahead``: ``id(seq)`` -> tokens
        of it in a step in flight, which the block state already holds and the accounting
        not yet (:mod:`paxcache.overlap`)."""
        return check_scheduler(self, ahead or {})
