"""Continuous-batching scheduler: host-side, plain Python; decides *what* runs each step.

The scheduler never touches device arrays. It keeps the queues and the per-sequence token
accounting, and produces a :class:`StepPlan` (which sequences run how many tokens) that the
engine turns into one fused, jit-compiled device step. It asks the engine, through the
:class:`CacheOps` callbacks, to admit, preempt or resume sequences; those calls are the only
places the allocator is consulted outside the fused step.

Unified token accounting (prefill, chunked prefill, decode and recompute are one thing):
``seq.token_ids`` holds the prompt followed by the generated tokens; ``seq.num_computed`` of
them have their K/V in the cache. A step feeds ``token_ids[num_computed : num_computed + q]``;
when that reaches the end of ``token_ids`` the step also samples the next token. A decode is
simply ``q == 1``. After a recompute preemption ``num_computed`` is reset to 0 and the whole
history is prefilled again (prefix-cache hits make that cheap).

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
    most ``P + M - 1`` tokens to feed, no more recompute once it is the oldest), and a request
    finishes within ``sum(P_s + M_s)`` steps of its arrival, summed over its own sequences and
    the older sequences alive when it arrived.
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
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, Protocol

from paxcache.sampling import SamplingParams

__all__ = ["CacheOps", "Scheduler", "SeqState", "Sequence", "StepPlan"]


class SeqState:
    """Where a sequence is."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_arrival = itertools.count()


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion of a request (``n`` of them for ``SamplingParams.n > 1``).

    Attributes:
      request_id: the owning request.
      index: completion index ``j`` in ``0..n-1``.
      token_ids: prompt followed by generated tokens.
      num_prompt: prompt length (original prompt, not counting generated tokens).
      params: the request's sampling parameters.
      seed: the request's seed (fixed at arrival).
      arrival: arrival order (ties broken by index): the age order of every rule.
      slot: allocator slot while running or swapped, else -1.
      num_computed: tokens whose K/V is in the cache.
      num_allocated: tokens covered by the slot's blocks (the allocator's ``seq_lens``).
      followers: sequences forked from this one at admission (``n > 1``). While one still
        waits for this sequence's prompt (its ``leader`` is this sequence) it has no rows of
        its own and is preempted and resumed with it; after the first sample it is independent.
      leader: the sequence this one follows, while it waits.
      shared_last: its last, partially filled block may be shared with a sibling (just
        forked): its next write may copy on write.
      num_preemptions: times this sequence was preempted (swap or recompute).
      preempted_at: the scheduler's departure count when it was last preempted (rule R5).
    """

    request_id: str
    index: int
    token_ids: list[int]
    num_prompt: int
    params: SamplingParams
    seed: int
    salt: int = 0
    arrival: int = dataclasses.field(default_factory=lambda: next(_arrival))
    state: str = SeqState.WAITING
    slot: int = -1
    num_computed: int = 0
    num_allocated: int = 0
    followers: list[Sequence] = dataclasses.field(default_factory=list)
    leader: Sequence | None = None
    shared_last: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    preempted_at: int = -1
    # Output state (kept by the engine).
    text: str = ""
    emitted: int = 0
    logprobs: list[dict] | None = None
    decoder: Any = None
    new_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.state == SeqState.FINISHED

    @property
    def age(self) -> tuple[int, int]:
        """Sort key of the age order: smaller is older."""
        return (self.arrival, self.index)


@dataclasses.dataclass
class StepPlan:
    """What one device step runs.

    Attributes:
      rows: ``(seq, q)`` in batch order: ``q`` tokens of ``seq`` are fed.
      samples: ``(seq, row_index)``: ``seq`` samples its next token from the logits of the
        last token of batch row ``row_index`` (a follower samples from its leader's row).
    """

    rows: list[tuple[Sequence, int]]
    samples: list[tuple[Sequence, int]]

    @property
    def num_tokens(self) -> int:
        return sum(q for _, q in self.rows)


class CacheOps(Protocol):
    """What the scheduler needs from the engine's cache (all host-synchronous).

    ``admit`` and ``swap_in`` take a ``reserve``: they refuse (changing nothing) unless
    ``reserve`` blocks plus the watermark are still free afterwards (rule R6).
    """

    block_size: int
    num_host_blocks: int

    def num_free_blocks(self) -> int: ...

    def num_free_host_blocks(self) -> int: ...

    def free_slots(self) -> int: ...

    def admit(self, seqs: list[Sequence], reserve: int = 0) -> bool: ...

    def release(self, seq: Sequence) -> None: ...

    def swap_out(self, seq: Sequence) -> bool: ...

    def swap_in(self, seq: Sequence, reserve: int = 0) -> bool: ...

    def blocks_held(self, seq: Sequence) -> int: ...


class Scheduler:
    """Queues and per-step decisions for continuous batching (rules in the module docstring).

    Args:
      cache: the engine's :class:`CacheOps`.
      max_num_seqs: most sequences in one step (and running at once).
      max_num_batched_tokens: token budget of one step, shared by decodes and prefill chunks.
      preemption_mode: ``"swap"`` or ``"recompute"``.
      policy: ``"fifo"`` or ``"prefill_first"``.
      on_finish: called with a sequence the scheduler itself had to finish (error).

    Counters: ``num_preemptions`` (units preempted) = ``num_preemptions_swap`` +
    ``num_preemptions_recompute``; ``num_swaps`` (sequences swapped out, same as
    ``num_preemptions_swap``); ``num_departures`` (running sequences that finished, were aborted
    or failed).
    """

    def __init__(
        self,
        cache: CacheOps,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        policy: str = "fifo",
        on_finish: Callable[[Sequence], Any] | None = None,
    ) -> None:
        if policy not in ("fifo", "prefill_first"):
            raise ValueError(f"policy must be 'fifo' or 'prefill_first', got {policy!r}")
        if preemption_mode not in ("swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be 'swap' or 'recompute', got {preemption_mode!r}"
            )
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.policy = policy
        self.on_finish = on_finish
        # Queued units, each in age order (R4 merges the two): ``waiting`` holds units of
        # sequences admitted together (a leader, then its waiting followers), never admitted or
        # preempted by recompute; ``swapped`` holds single sequences parked on the host.
        self.waiting: collections.deque[list[Sequence]] = collections.deque()
        self.swapped: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_preemptions_swap = 0
        self.num_preemptions_recompute = 0
        self.num_swaps = 0
        self.num_departures = 0

    # -- queues ---------------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        """Queues a new request's sequences (a leader first, then its followers)."""
        self.waiting.append(seqs)  # the newest of all: the end keeps the queue in age order

    def remove(self, seqs: list[Sequence]) -> None:
        """Drops sequences from every queue (abort / finish); their slots are the engine's."""
        ids = {id(s) for s in seqs}
        running = [s for s in self.running if id(s) not in ids]
        self.num_departures += len(self.running) - len(running)
        self.running = running
        self.swapped = [s for s in self.swapped if id(s) not in ids]
        kept: collections.deque[list[Sequence]] = collections.deque()
        for unit in self.waiting:
            unit = [s for s in unit if id(s) not in ids]
            if unit:
                kept.append(unit)
        self.waiting = kept

    @property
    def num_waiting(self) -> int:
        return sum(len(u) for u in self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _queue_head(self) -> list[Sequence] | None:
        """The oldest queued unit, swapped or waiting (R4)."""
        if self.swapped and (not self.waiting or self.swapped[0].age < self.waiting[0][0].age):
            return [self.swapped[0]]
        return self.waiting[0] if self.waiting else None

    def _unit_of(self, seq: Sequence) -> list[Sequence]:
        """``seq``'s unit: its leader (or itself) and the running followers still waiting."""
        lead = seq.leader or seq
        waiting = [f for f in lead.followers if f.leader is lead and f.state == SeqState.RUNNING]
        return [lead, *waiting]

    # -- block arithmetic -----------------------------------------------------------------

    def _blocks(self, tokens: int) -> int:
        s = self.cache.block_size
        return -(-tokens // s)

    def _blocks_needed(self, rows: list[tuple[Sequence, int]]) -> int:
        """Fresh blocks the allocator's ``append`` takes to feed ``rows``, exactly.

        A row needs a block per block boundary it crosses beyond its allocation, and one more
        when it writes into a partial last block it shares with siblings (copy-on-write), except
        that when every holder of that block writes in the same step the last one keeps it.
        The holders of a request's shared block are its running sequences with
        ``shared_last`` (siblings forked together that have not written yet).
        """
        s = self.cache.block_size
        need = 0
        writers: collections.Counter[str] = collections.Counter()
        for seq, q in rows:
            end = seq.num_computed + q
            need += max(0, self._blocks(end) - self._blocks(seq.num_allocated))
            if seq.shared_last and end > seq.num_allocated and seq.num_allocated % s:
                writers[seq.request_id] += 1
        for rid, w in writers.items():
            holders = sum(1 for t in self.running if t.request_id == rid and t.shared_last)
            need += w - (w == holders)
        return need

    # -- preemption -----------------------------------------------------------------------

    def _can_swap(self, unit: list[Sequence]) -> bool:
        lead = unit[0]
        return (
            self.preemption_mode == "swap"
            and self.cache.num_host_blocks > 0
            and len(unit) == 1  # no follower waits for its prompt
            and lead.remaining == 1  # decoding (a prompt is cheaper to recompute)
            and self.cache.blocks_held(lead) <= self.cache.num_free_host_blocks()
        )

    def _preempt(self, unit: list[Sequence]) -> None:
        """R2: swaps ``unit`` out or frees it for recompute; it waits for a departure (R5)."""
        for s in unit:
            self.running.remove(s)
            s.num_preemptions += 1
            s.preempted_at = self.num_departures
        self.num_preemptions += 1
        lead = unit[0]
        if self._can_swap(unit) and self.cache.swap_out(lead):
            self.num_preemptions_swap += 1
            self.num_swaps += 1
            lead.state = SeqState.SWAPPED
            lead.shared_last = False  # its table now points at private host copies
            ages = [s.age for s in self.swapped]
            self.swapped.insert(bisect.bisect(ages, lead.age), lead)
            return
        # Recompute: free the blocks, queue again (in age order) with the whole history.
        self.num_preemptions_recompute += 1
        for s in unit:
            self.cache.release(s)
            s.state = SeqState.WAITING
            s.num_computed = 0
            s.num_allocated = 0
            s.shared_last = False
        ages = [u[0].age for u in self.waiting]
        self.waiting.insert(bisect.bisect(ages, lead.age), unit)

    def _fail_running(self, unit: list[Sequence], message: str) -> None:
        for s in unit:
            self.running.remove(s)
            self.num_departures += 1
            self._finish_with_error(s, message)

    def _fail_queued(self, seqs: list[Sequence], what: str) -> None:
        for seq in seqs:
            self._finish_with_error(
                seq,
                f"sequence of {len(seq.token_ids)} tokens can never be {what}: it needs more "
                f"KV blocks than the cache admits (free {self.cache.num_free_blocks()} minus "
                "the watermark)",
            )

    def _finish_with_error(self, seq: Sequence, message: str) -> None:
        seq.state = SeqState.FINISHED
        seq.finish_reason = "error"
        seq.error = message
        if self.on_finish is not None:
            self.on_finish(seq)

    # -- the step -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Chooses the sequences and token counts of the next step (may preempt/admit)."""
        rows = self._plan_running()
        rows, preempted = self._fit(rows)
        if not preempted:  # R3
            budget = self.max_num_batched_tokens - sum(q for _, q in rows)
            self._resume(rows, budget)
        if not rows and not self.running:
            # The queue head was not resumed although nothing runs: every block is free, so it
            # never will be (e.g. it grew past ``num_blocks - watermark`` and was preempted).
            head = self._queue_head()
            if head is not None:
                if head[0].state == SeqState.SWAPPED:
                    self.swapped.pop(0)
                    self._fail_queued(head, "swapped back in")
                else:
                    self.waiting.popleft()
                    self._fail_queued(head, "admitted")

        # Samples: a row that reaches the end of its tokens samples; so do its followers.
        samples: list[tuple[Sequence, int]] = []
        for i, (seq, q) in enumerate(rows):
            if seq.num_computed + q == len(seq.token_ids):
                samples.append((seq, i))
                for f in seq.followers:
                    if f.state == SeqState.RUNNING and f.leader is seq:
                        samples.append((f, i))
        return StepPlan(rows=rows, samples=samples)

    def _plan_running(self) -> list[tuple[Sequence, int]]:
        """R1: the running sequences' rows in policy order, the oldest always among them."""
        runnable = [s for s in self.running if s.leader is None]  # followers wait, no rows
        if not runnable:
            return []
        oldest = min(runnable, key=lambda s: s.age)
        decodes = sorted((s for s in runnable if s.remaining == 1), key=lambda s: s.age)
        prefills = sorted((s for s in runnable if s.remaining > 1), key=lambda s: s.age)
        order = decodes + prefills if self.policy == "fifo" else prefills + decodes
        budget = self.max_num_batched_tokens
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

    def _fit(self, rows: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int]], bool]:
        """R2: preempts the newest units until the rows' new blocks fit in the free blocks.

        Returns the rows still planned and whether anything was preempted.
        """
        preempted = False
        while rows and self._blocks_needed(rows) > self.cache.num_free_blocks():
            unit = self._unit_of(max(self.running, key=lambda s: s.age))
            if len(unit) == len(self.running):
                # The oldest unit is all that runs and still does not fit: it never will.
                victim = unit[0]
                self._fail_running(
                    unit,
                    f"the KV cache ({self.cache.num_free_blocks()} free blocks) cannot hold "
                    f"this sequence of {len(victim.token_ids)} tokens",
                )
            else:
                self._preempt(unit)
                preempted = True
            alive = {id(s) for s in self.running}
            rows = [(s, q) for s, q in rows if id(s) in alive]
        return rows, preempted

    def _resume(self, rows: list[tuple[Sequence, int]], budget: int) -> None:
        """R4-R6: resumes or admits queued units, oldest first, each with a row this step."""
        while budget > 0:
            unit = self._queue_head()
            if unit is None:
                return
            if len(self.running) + len(unit) > self.max_num_seqs:
                return
            if self.running and any(s.preempted_at >= self.num_departures for s in unit):
                return  # R5: no departure since it was preempted
            lead = unit[0]
            reserve = self._blocks_needed(rows)  # R6
            if lead.state == SeqState.SWAPPED:
                own = self._blocks_needed([(lead, 1)])  # its decode may start a new block
                if not self.cache.swap_in(lead, reserve + own):
                    return
                self.swapped.pop(0)
            else:
                # The prompt (or history) is allocated whole at admission: its first chunk
                # takes no further block.
                if self.cache.free_slots() < len(unit) or not self.cache.admit(unit, reserve):
                    return
                self.waiting.popleft()
            for s in unit:
                s.state = SeqState.RUNNING
                self.running.append(s)
            q = min(lead.remaining, budget)
            rows.append((lead, q))
            budget -= q
