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

Policies:
  ``"fifo"``: running decodes first (they never stall behind a long prompt), then prefill
  chunks in arrival order, then resumed swapped sequences and new admissions.
  ``"prefill_first"``: pending prefill chunks first (time to first token), then decodes.

Preemption: when the running sequences need more new blocks than are free, the most recently
arrived running sequence is preempted, by swapping it to host memory (``preemption_mode=
"swap"`` and enough free host blocks) or by recompute (its blocks are freed and it is queued
again, ahead of new requests). A sequence that cannot fit even alone finishes with an error.
"""

from __future__ import annotations

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
      arrival: arrival order (ties broken by index), for preemption order.
      slot: allocator slot while running or swapped, else -1.
      num_computed: tokens whose K/V is in the cache.
      num_allocated: tokens covered by the slot's blocks (the allocator's ``seq_lens``).
      followers: sequences forked from this one at admission (``n > 1``) that wait for its
        prefill to finish and then sample from its last logits.
      leader: the sequence this one follows, while it waits.
      shared_last: its last block may be shared (just forked): a write may copy on write.
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
    """What the scheduler needs from the engine's cache (all host-synchronous)."""

    block_size: int
    num_host_blocks: int

    def num_free_blocks(self) -> int: ...

    def num_free_host_blocks(self) -> int: ...

    def free_slots(self) -> int: ...

    def admit(self, seqs: list[Sequence]) -> bool: ...

    def release(self, seq: Sequence) -> None: ...

    def swap_out(self, seq: Sequence) -> bool: ...

    def swap_in(self, seq: Sequence) -> bool: ...

    def blocks_held(self, seq: Sequence) -> int: ...


class Scheduler:
    """Queues and per-step decisions for continuous batching.

    Args:
      cache: the engine's :class:`CacheOps`.
      max_num_seqs: most sequences in one step (and running at once).
      max_num_batched_tokens: token budget of one step, shared by decodes and prefill chunks.
      preemption_mode: ``"swap"`` or ``"recompute"``.
      policy: ``"fifo"`` or ``"prefill_first"``.
      on_finish: called with a sequence the scheduler itself had to finish (error).
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
        # Units waiting for admission: a list of sequences admitted together (a leader and
        # its followers), in order. Recompute-preempted sequences go to the front.
        self.waiting: collections.deque[list[Sequence]] = collections.deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swaps = 0

    # -- queues ---------------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        """Queues a new request's sequences (a leader first, then its followers)."""
        self.waiting.append(seqs)

    def remove(self, seqs: list[Sequence]) -> None:
        """Drops sequences from every queue (abort / finish); their slots are the engine's."""
        ids = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in ids]
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

    # -- block arithmetic -----------------------------------------------------------------

    def _blocks(self, tokens: int) -> int:
        s = self.cache.block_size
        return -(-tokens // s)

    def _new_blocks(self, seq: Sequence, q: int) -> int:
        """Fresh blocks ``seq`` needs to feed ``q`` tokens (plus a possible copy-on-write)."""
        end = seq.num_computed + q
        need = max(0, self._blocks(end) - self._blocks(seq.num_allocated))
        if (
            seq.shared_last
            and end > seq.num_allocated
            and seq.num_allocated % self.cache.block_size
        ):
            need += 1
        return need

    # -- preemption -----------------------------------------------------------------------

    def _preempt(self, victim: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(victim)
        group = [victim] + [f for f in victim.followers if f.state == SeqState.RUNNING]
        for f in group[1:]:
            self.running.remove(f)
        can_swap = (
            self.preemption_mode == "swap"
            and self.cache.num_host_blocks > 0
            and not victim.followers
            and victim.leader is None
            and victim.remaining == 1
            and self.cache.blocks_held(victim) <= self.cache.num_free_host_blocks()
        )
        if can_swap and self.cache.swap_out(victim):
            self.num_swaps += 1
            victim.state = SeqState.SWAPPED
            self.swapped.append(victim)
            self.swapped.sort(key=lambda s: (s.arrival, s.index))
            return
        # Recompute: free the blocks, requeue at the front with its whole history.
        for s in group:
            self.cache.release(s)
            s.state = SeqState.WAITING
            s.num_computed = 0
            s.num_allocated = 0
            s.shared_last = False
        self.waiting.appendleft(group)

    def _fail(self, seq: Sequence, message: str) -> None:
        self.running.remove(seq)
        self._finish_with_error(seq, message)

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
        budget = self.max_num_batched_tokens
        rows: list[tuple[Sequence, int]] = []
        samples: list[tuple[Sequence, int]] = []

        # 1. Running sequences: decodes and prefill chunks, within the budget and blocks.
        runnable = [s for s in self.running if s.leader is None]
        decodes = sorted((s for s in runnable if s.remaining == 1), key=lambda s: s.arrival)
        prefills = sorted((s for s in runnable if s.remaining > 1), key=lambda s: s.arrival)
        order = decodes + prefills if self.policy == "fifo" else prefills + decodes
        planned: list[tuple[Sequence, int]] = []
        for seq in order:
            if budget <= 0:
                break
            q = min(seq.remaining, budget)
            planned.append((seq, q))
            budget -= q

        # Make the planned rows fit in the free blocks, preempting the newest arrivals.
        while planned:
            need = sum(self._new_blocks(s, q) for s, q in planned)
            if need <= self.cache.num_free_blocks():
                break
            victim = max(self.running, key=lambda s: (s.arrival, s.index))
            leader = victim.leader or victim
            group = [leader] + [f for f in leader.followers if f.state == SeqState.RUNNING]
            if len(group) >= len(self.running):
                # Preempting would leave nothing running: this sequence can never fit.
                self._fail(
                    victim,
                    f"the KV cache ({self.cache.num_free_blocks()} free blocks) cannot hold "
                    f"this sequence of {len(victim.token_ids)} tokens",
                )
            else:
                self._preempt(leader)
            alive = set(map(id, self.running))
            budget += sum(q for s, q in planned if id(s) not in alive)
            planned = [(s, q) for s, q in planned if id(s) in alive]

        rows.extend(planned)

        # 2. Swapped sequences come back before anything new is admitted.
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if self.cache.free_slots() < 1 or not self.cache.swap_in(seq):
                break
            self.swapped.pop(0)
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            q = min(seq.remaining, budget)
            if self._new_blocks(seq, q) <= self.cache.num_free_blocks():
                rows.append((seq, q))
                budget -= q

        # 3. Admit waiting units (FIFO, head-of-line) while slots, blocks and budget allow.
        if not self.swapped:
            while self.waiting and budget > 0:
                unit = self.waiting[0]
                if len(self.running) + len(unit) > self.max_num_seqs:
                    break
                if self.cache.free_slots() < len(unit) or not self.cache.admit(unit):
                    break
                self.waiting.popleft()
                for s in unit:
                    s.state = SeqState.RUNNING
                    self.running.append(s)
                lead = unit[0]
                q = min(lead.remaining, budget)
                if self._new_blocks(lead, q) <= self.cache.num_free_blocks():
                    rows.append((lead, q))
                    budget -= q

        # Nothing can run although work is queued: with nothing running, every block is free,
        # so the head of the queue can never be admitted or resumed (e.g. a sequence that
        # grew past ``num_blocks - watermark`` and was preempted). Fail it instead of hanging.
        if not rows and not self.running:
            if self.swapped:
                self._fail_queued([self.swapped.pop(0)], "swapped back in")
            elif self.waiting:
                self._fail_queued(self.waiting.popleft(), "admitted")

        # Samples: a row that reaches the end of its tokens samples; so do its followers.
        for i, (seq, q) in enumerate(rows):
            if seq.num_computed + q == len(seq.token_ids):
                samples.append((seq, i))
                for f in seq.followers:
                    if f.state == SeqState.RUNNING and f.leader is seq:
                        samples.append((f, i))
        return StepPlan(rows=rows, samples=samples)
