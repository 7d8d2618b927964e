"""Overlapped scheduling (``Engine(async_scheduling=True)``): the device runs step N+1 while
the host post-processes step N.

The engine keeps at most one step in flight. Each :meth:`Pipeline.step` call reads exactly one
step, as the synchronous engine does, so both take the same number of calls, but for a step
or so for each stop string or abort the host learned after the next step went out (4):

1. With nothing in flight, the scheduler plans step N and the engine dispatches it (swaps,
   inputs, the jitted step: JAX returns before the device finishes).
2. If step N+1 is N's *continuation* (:func:`continuation`: every row of N samples its own
   sequence's next token, nothing waits or is swapped out, every running sequence is in N, no
   grammar, the blocks N+1 takes are free by the scheduler's own arithmetic), it is
   dispatched at once: its rows are N's sequences feeding one token each, their input tokens
   gathered on the device from N's sampled array (:func:`gather_tokens`), their sampling keys
   one token further on; the block state it reads is N's output, still on the device. This is
   the plan :meth:`Scheduler.schedule <paxcache.scheduler.Scheduler.schedule>` would make
   after N (the same rows; the keys depend on the request only), so the tokens are the
   synchronous engine's.
3. Step N is read (one transfer) and post-processed (tokens, detokenization, stops, frees)
   while N+1 runs; the block manager adopts the newest state. A request that finished in N
   (or was aborted) had a row in N+1 whose token is dropped: one wasted row at most.

4. A step that cannot be continued (prefill rows that do not finish, admissions, preemption,
   constrained rows) is read first; then, once the scheduler has its tokens (the
   scheduler's ``postprocess``: token-level stops, frees), the next step is planned and
   dispatched at once, before the engine detokenizes the one read, finds its stop strings
   and builds its outputs, which then run beside the new step on the device. Its plan is the
   synchronous engine's but for two things the host learns later: requests added, and
   sequences that reach a stop string or are aborted, after it went out (the first wait a
   step; the second cost a wasted row, as in 3). The tokens are the same: each row's depend
   on its own sequence only. With ``decode_steps > 1`` the
decode-only steps run as multi-step decodes (:mod:`paxcache.decode_loop`), and a multi-step
decode is continued the same way (:func:`loop_continuation`) when nothing is queued and every
running sequence is in it: the next loop's inputs are built on the device from the one in
flight (:func:`paxcache.decode_loop.next_inputs`: each row that did not stop feeds its last
sample, its length, keys and token limit as many tokens on as it ran), so the host's round
trip per K tokens is hidden too. A row that stopped runs nothing; one whose sequence the host
then finishes (a stop string) runs up to K wasted iterations, dropped when read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paxcache import decode_loop
from paxcache.packing import PackedInputs
from paxcache.sampling import sequence_keys
from paxcache.scheduler import Scheduler, StepPlan
from paxcache.step import StepInputs, StepShapes, read_result

__all__ = [
    "InFlight",
    "Pipeline",
    "StepFailed",
    "continuation",
    "gather_tokens",
    "loop_continuation",
    "read",
    "warmup_loop_continuation",
]


class StepFailed(Exception):
    """Carrying out a plan raised (the cause is chained); ``failed``: requests already failed."""

    def __init__(self, failed: set[str]) -> None:
        super().__init__("engine step failed")
        self.failed = failed


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose outputs the host has not read.

    Attributes:
      plan: its plan.
      inputs: its :class:`~paxcache.step.StepInputs` as the host built them (host arrays, but
        ``token_ids`` for a continuation); for inputs built on the device (a multi-step
        decode's continuation), their shapes only (``PackedInputs.structure``).
      failed: requests whose host work for it failed (:func:`paxcache.step.prepare_inputs`).
      state: the block state it returns (on the device).
      out: its :class:`~paxcache.step.StepOutputs` (on the device).
      free_after: free device blocks after it, by the scheduler's arithmetic (None for a
        synchronous engine, which never continues a step).
      placed: the inputs it runs on (:class:`~paxcache.packing.PackedInputs`, on the device).
      continuable: False once the multi-step decode it continues was read and ran nothing
        (its blocks were not free): it runs nothing either, and the scheduler plans after it.
      slack: ``id(seq)`` -> tokens a row's sequence had allocated and not computed when it
        went out (a prefill's allocation is made at admission), for a step planned by the
        scheduler; None for a continuation, whose rows had none. What a row feeds past its
        slack is what the block state holds ahead of the host's accounting.
    """

    plan: StepPlan
    inputs: Any
    failed: set[str]
    state: Any
    out: Any
    free_after: int | None
    placed: Any
    continuable: bool = True
    slack: dict[int, int] | None = None


def read(flight: InFlight, state: Any) -> Any:
    """Reads a dispatched step's outputs (:func:`paxcache.step.read_result`: one transfer)
    with ``state`` the block state the block manager is to adopt.

    Raises:
      StepFailed: the transfer (or the step behind it) raised.
    """
    try:
        return read_result(flight.plan, state, flight.out, flight.failed)
    except Exception as e:  # noqa: BLE001 - the engine fails this step's requests
        raise StepFailed(flight.failed) from e


@jax.jit
def gather_tokens(sampled_tokens: jax.Array, sources: jax.Array) -> jax.Array:
    """``i32[T]`` input tokens of a continuation: row ``i`` feeds what sample ``sources[i]``
    (``i32[T]``) of the previous step drew (``sampled_tokens``: ``i32[R]``, on the device);
    padding rows read sample 0 (never written, never read)."""
    return jnp.take(sampled_tokens, sources, mode="clip")


def warmup_gather(sampled_tokens: jax.Array, shapes: StepShapes, max_batched_tokens: int) -> int:
    """Compiles :func:`gather_tokens` for every token bucket a continuation can take (one
    decode row each, 1 to ``R`` rows, at most ``max_batched_tokens``), so that the first
    continuation compiles nothing. ``sampled_tokens``: ``i32[R]``, a warm-up step's own
    sampled tokens (their placement is what serving passes). Returns the buckets warmed."""
    if shapes.decode_steps > 1:  # decode-only steps run as multi-step decodes: no continuation
        return 0
    buckets = sorted(
        {shapes.bucket(n) for n in range(1, min(shapes.max_rows, max_batched_tokens) + 1)}
    )
    for t in buckets:
        gather_tokens(sampled_tokens, np.zeros(t, np.int32)).block_until_ready()
    return len(buckets)


def loop_continuation(
    prev: InFlight, scheduler: Scheduler, state: Any
) -> tuple[StepPlan, PackedInputs] | None:
    """The multi-step decode after ``prev`` (a multi-step decode) when it needs no host
    decision, as ``(plan, inputs on the device)``; None when the scheduler must plan it after
    reading ``prev``. It needs nothing queued (no admission, no swap-in) and every running
    sequence in ``prev``; its inputs are built on the device from ``prev``'s outputs
    (:func:`paxcache.decode_loop.next_inputs`: the rows that did not stop go on, ``state``'s
    blocks permitting), its plan is ``prev``'s (a row whose sequence finished since runs
    nothing or is dropped when read)."""
    plan, inputs = prev.plan, prev.inputs
    if inputs.decode_loop is None or prev.failed or scheduler.queued or not prev.continuable:
        return None
    keep = [not seq.is_finished for seq, _ in plan.samples]
    going = {id(seq) for (seq, _), k in zip(plan.samples, keep, strict=True) if k}
    if not going or len(going) != len(scheduler.running):
        return None
    if any(id(seq) not in going for seq in scheduler.running):
        return None
    loop = inputs.decode_loop
    num_steps, r = loop.keys.shape[0], loop.active.shape[0]
    keep_rows = np.zeros(r, bool)
    keep_rows[: len(keep)] = keep
    # Keys from each row's first sample in prev on: prev is unread, so ``num_generated`` is
    # what it was when prev was planned.
    seqs = [seq for seq, _ in plan.samples]
    keys = sequence_keys(seqs, r, range(2 * num_steps), zeros_if_greedy=True)
    nxt = decode_loop.next_inputs(
        prev.placed, state, prev.out.sampled.tokens, prev.out.steps, keys, keep_rows
    )
    return StepPlan(rows=plan.rows, slots=plan.slots, samples=plan.samples), nxt


def warmup_loop_continuation(placed: PackedInputs, state: Any, out: Any) -> None:
    """Compiles :func:`paxcache.decode_loop.next_inputs` for a warm-up multi-step decode's
    inputs (``placed``: packed and placed as serving passes them) and outputs."""
    loop = placed.structure().decode_loop
    num_steps, r = loop.keys.shape[0], loop.active.shape[0]
    keys = np.zeros((2 * num_steps, r, 2), np.uint32)
    decode_loop.next_inputs(
        placed, state, out.sampled.tokens, out.steps, keys, np.zeros(r, bool)
    ).words.block_until_ready()


def continuation(
    prev: InFlight, scheduler: Scheduler, shapes: StepShapes, max_model_len: int
) -> tuple[StepPlan, StepInputs, int] | None:
    """The step after ``prev`` when it needs no host decision, as ``(plan, inputs with
    placeholder token_ids, fresh blocks it takes)``; None when the scheduler must plan it
    after reading ``prev`` (see the module docstring)."""
    plan, inputs = prev.plan, prev.inputs
    if shapes.decode_steps > 1:  # decode-only steps run as multi-step decodes instead
        return None
    if not plan.rows or inputs.decode_loop is not None or inputs.prompt_logprobs is not None:
        return None
    if len(plan.samples) != len(plan.rows):
        return None
    # Sequences that finished (or were aborted) since prev went out are gone: their rows
    # are dropped (prev's own finishes are not known yet: their rows here are wasted).
    keep = [j for j, (seq, _) in enumerate(plan.rows) if not seq.is_finished]
    rows = [plan.rows[j] for j in keep]
    if not rows or scheduler.queued or len(scheduler.running) != len(rows):
        return None
    if len(rows) > scheduler.max_num_batched_tokens:
        return None
    lengths = []
    for j in keep:
        (seq, q), (sampler, row) = plan.rows[j], plan.samples[j]
        if row != j or sampler is not seq or seq.matcher is not None:
            return None
        if seq.request_id in prev.failed:
            return None
        length = seq.num_computed + q  # after prev
        if length + 1 > max_model_len:
            return None
        switch = scheduler.rope_switch_len  # longrope: the scheduler recomputes it first
        if switch is not None and not seq.rope_long and length + 1 > switch:
            return None
        lengths.append(length)
    block = scheduler.block_size
    need = sum(1 for n in lengths if n % block == 0)  # the new token starts a block
    if prev.free_after is None or need > prev.free_after:
        return None
    r, n = shapes.max_rows, len(rows)
    t = shapes.bucket(n)
    sources = np.zeros(t, np.int32)
    sources[:n] = keep
    kv_lens = np.zeros(r, np.int32)
    kv_lens[:n] = np.asarray(lengths) + 1
    q_lens = np.zeros(r, np.int32)
    q_lens[:n] = 1
    grows = np.zeros(r, bool)
    grows[:n] = True
    logits_rows = np.zeros(r, np.int32)
    logits_rows[:n] = np.arange(n)

    def kept(values: Any, pad: float) -> np.ndarray:  # prev's per-sample values, kept rows
        values = np.asarray(values)
        out = np.full(r, pad, values.dtype)
        out[:n] = values[keep]
        return out

    old = inputs.sampling
    sampling = old.replace(
        logits_rows=logits_rows,
        temperature=kept(old.temperature, 0),
        top_k=kept(old.top_k, 0),
        top_p=kept(old.top_p, 1),
        min_p=kept(old.min_p, 0),
        keys=sequence_keys([seq for seq, _ in rows], r, (1,), zeros_if_greedy=True)[0],  # one on
    )
    slots = np.zeros(r, np.int32)
    slots[:n] = np.asarray(inputs.slot_ids)[keep]
    nxt = StepInputs(
        token_ids=sources,  # the sample each row reads: gather_tokens makes them tokens
        slot_ids=slots,
        q_lens=q_lens,
        kv_lens=kv_lens,
        rope_lens=kv_lens if shapes.rope_lens else None,  # decode rows: no token past them
        num_rows=np.asarray(n, np.int32),
        grows=grows,
        sampling=sampling,
        decode_only=shapes.decode_variant,
    )
    next_plan = StepPlan(
        rows=[(seq, 1) for seq, _ in rows],
        slots=[plan.slots[j] for j in keep],
        samples=[(seq, j) for j, (seq, _) in enumerate(rows)],
    )
    return next_plan, nxt, need


class Pipeline:
    """The engine's overlapped step loop: at most one step in flight (module docstring).

    Args:
      engine: the :class:`~paxcache.engine.Engine` whose steps it runs (its ``_dispatch``,
        ``_run`` and ``_recover``; the scheduler stays the engine's).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.inflight: InFlight | None = None
        self.num_continued = 0  # steps dispatched as a continuation (while one was in flight)
        self.num_wasted_rows = 0  # their rows whose sequence had finished when read

    def step(self) -> list[Any]:
        """One call: dispatches the next step when it is a continuation (else the scheduler
        plans one first, when nothing is in flight), then reads and post-processes one step;
        with nothing in flight after it, plans and dispatches the next (:meth:`_dispatch_next`)
        before returning. Returns the sequences touched, as the synchronous step does."""
        eng = self.engine
        touched: list[Any] = []
        flight = self.inflight
        if flight is not None and all(seq.is_finished for seq, _ in flight.plan.rows):
            # Every row's request finished or was aborted since it went out: nothing to read
            # (the manager adopted its state when the step before it was read).
            self.num_wasted_rows += len(flight.plan.rows)
            self.inflight = None
        # The block state the next step starts from: the one the manager holds (the step in
        # flight's output, adopted, with any frees since), unless that step was dispatched
        # just now, in this call: then its own output (the manager's was donated to it).
        fresh = self.inflight is None
        if self.inflight is None:
            plan = eng.scheduler.schedule()
            if not plan.rows:  # swaps only, or nothing: the synchronous path
                return eng._run(plan)
            touched += plan.failed
            try:
                self.inflight = eng._dispatch(plan)
            except StepFailed as e:
                return touched + eng._recover(plan, e)
        prev, self.inflight = self.inflight, None
        nxt = continuation(prev, eng.scheduler, eng._shapes, eng.max_model_len)
        if nxt is not None:
            plan, inputs, need = nxt
            tokens = gather_tokens(prev.out.sampled.tokens, inputs.token_ids)
            inputs = inputs.replace(token_ids=tokens)
            try:
                self.inflight = eng._dispatch(
                    plan,
                    inputs=inputs,
                    state=prev.state if fresh else None,
                    free_after=prev.free_after - need,
                )
            except StepFailed as e:  # it may have consumed prev's state: fail both
                return touched + eng._recover(prev.plan, e)
            self.num_continued += 1
        else:
            base = prev.state if fresh else eng.block_manager.state
            nxt_loop = loop_continuation(prev, eng.scheduler, base)
            if nxt_loop is not None:
                plan, inputs = nxt_loop
                try:
                    self.inflight = eng._dispatch(plan, inputs=inputs, state=base, free_after=None)
                except StepFailed as e:  # it may have consumed prev's state: fail both
                    return touched + eng._recover(prev.plan, e)
                self.num_continued += 1
        if self.inflight is not None:
            newest = self.inflight.state
        else:  # nothing newer in flight: prev's output, or what the manager made of it since
            newest = prev.state if fresh else eng.block_manager.state
        try:
            result = read(prev, newest)
        except StepFailed as e:
            self.inflight = None
            return touched + eng._recover(prev.plan, e)
        if newest is not prev.state:  # its free count is not prev's: read when asked
            result = dataclasses.replace(result, num_free_blocks=None)
        if result.steps is not None and self.inflight is not None and not result.steps.any():
            self.inflight.continuable = False  # built from a loop that ran nothing: the same
        # Rows of a continuation whose sequence finished (or was aborted) after it went out.
        self.num_wasted_rows += sum(1 for seq, _ in prev.plan.rows if seq.is_finished)
        touched += eng.scheduler.postprocess(prev.plan, result)
        if self.inflight is None:  # plan the next step now: it runs while the host reports
            touched += self._dispatch_next()
        return touched

    def _dispatch_next(self) -> list[Any]:
        """Plans and dispatches the step after the one just read and post-processed, before
        the engine detokenizes and reports it (step 4 of the module docstring); the block
        manager adopts the new step's output state at once, so frees until it is read (stop
        strings, aborts) apply to it. Returns the sequences touched now: the plan's failed
        ones, or the requests a failed dispatch failed; a plan without rows (swaps only, or
        nothing to run) is carried out at once."""
        eng = self.engine
        plan = eng.scheduler.schedule()
        if not plan.rows:
            return eng._run(plan)
        try:
            flight = eng._dispatch(plan)
        except StepFailed as e:
            return list(plan.failed) + eng._recover(plan, e)
        eng.block_manager.adopt(flight.state)
        flight.slack = {id(s): s.num_allocated - s.num_computed for s, _ in plan.rows}
        self.inflight = flight
        return list(plan.failed)
