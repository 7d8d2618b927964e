"""Multi-step decode: up to ``K`` decode iterations in one compiled program.

When a step holds only decode rows (one token each, every row sampling its own next token, no
grammar, no prompt logprobs), the engine can hand the device ``K`` iterations at once
(``Engine(decode_steps=K)``): each iteration is the single step's work (allocator ``append``
→ model → sampling → ``commit``) with the previous iteration's sampled tokens as its input,
under one ``lax.while_loop``. A row stops on the device when it samples an EOS or stop token
id or reaches its token limit (``max_tokens``, ``max_model_len``); the loop exits when every
row has stopped, when the next iteration's blocks are not all free (the host then schedules
as usual: preemption and admission stay the scheduler's), after the first finish when a
request waits for a slot (``exit_on_finish``), or after ``K`` iterations. Stop strings,
detokenization, streaming and aborts are the host's, applied to the returned tokens
(:meth:`Scheduler.postprocess <paxcache.scheduler.Scheduler.postprocess>` and the output
processor), so the tokens are those of ``K`` single steps. With overlapped scheduling the
loop after one in flight is built on the device (:func:`next_inputs`).

Here: the loop's extra inputs (:class:`DecodeLoopInputs`), which plans may run it
(:func:`eligible`), building the inputs (:func:`prepare`) and the device loop (:func:`run`,
called by :func:`paxcache.step.step` with the single iteration as a function).

Shape letters: K iterations, R rows, T tokens (the bucket, ``T >= num_rows``), B allocator
slots, E stop ids per row.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from paxcache import allocator, packing
from paxcache.sampling import SampleOutput, sequence_keys
from paxcache.scheduler import Scheduler, StepPlan
from paxcache.sequence import stop_ids

__all__ = [
    "MAX_STOP_IDS",
    "DecodeLoopInputs",
    "eligible",
    "empty",
    "for_plan",
    "next_inputs",
    "prepare",
    "resolve_decode_steps",
    "run",
]

MAX_STOP_IDS = 16  # E: EOS + stop token ids a row may have on the device (more: single steps)

# Decode iterations per program by default. TPU / GPU: a host round trip (schedule, inputs,
# transfer, post-processing: ~5-8 ms at 256 rows, scripts/bench_host.py) is a large part of
# a 10-15 ms decode step, and 8 tokens per stream chunk is what vLLM's multi-step scheduling
# ran. CPU (tests, laptops): 1, the step every test and the equality tests compare against.
DEFAULT_DECODE_STEPS = {"cpu": 1}
DEFAULT_DECODE_STEPS_ACCELERATOR = 8


def resolve_decode_steps(decode_steps: int | None, backend: str) -> int:
    """``decode_steps``, or ``backend``'s default for None.

    Raises:
      ValueError: not a positive int.
    """
    if decode_steps is None:
        return DEFAULT_DECODE_STEPS.get(backend, DEFAULT_DECODE_STEPS_ACCELERATOR)
    if not isinstance(decode_steps, int) or isinstance(decode_steps, bool) or decode_steps < 1:
        raise ValueError(f"decode_steps must be a positive int, got {decode_steps!r}")
    return decode_steps


@flax.struct.dataclass
class DecodeLoopInputs:
    """What the loop reads besides the first iteration's :class:`~paxcache.step.StepInputs`.

    Attributes:
      keys: ``u32[K, R, 2]`` the sampling key of sample ``j`` in iteration ``k`` (the
        single step's key for that many generated tokens: the same draws).
      stop_ids: ``i32[R, E]`` token ids that stop row ``j`` (EOS unless ``ignore_eos``, and
        ``stop_token_ids``), padded with -1.
      max_new: ``i32[R]`` tokens row ``j`` may still generate (``max_tokens``,
        ``max_model_len``); padding rows 1.
      exit_on_finish: ``bool[]`` leave the loop after an iteration in which a row stopped
        (a queued request waits for its slot or blocks).
      active: ``bool[R]`` rows that run the first iteration: the plan's rows (a pipelined
        continuation, :func:`next_inputs`, leaves out those that stopped in the loop before).
    """

    keys: jax.Array
    stop_ids: jax.Array
    max_new: jax.Array
    exit_on_finish: jax.Array
    active: jax.Array


def eligible(plan: StepPlan, eos_ids: Collection[int]) -> bool:
    """Whether ``plan`` can run as a multi-step decode: rows feed one token each, sample ``j``
    is row ``j``'s own sequence, no grammar and no prompt logprobs, and every row's stop ids
    fit in ``MAX_STOP_IDS``."""
    return _eligible_stop_ids(plan, eos_ids) is not None


def _eligible_stop_ids(plan: StepPlan, eos_ids: Collection[int]) -> list[tuple[int, ...]] | None:
    """Each sample's stop ids when ``plan`` is :func:`eligible`, else None (one pass)."""
    if not plan.rows or plan.prompt_positions or len(plan.samples) != len(plan.rows):
        return None
    ids = []
    for j, ((seq, q), (sampler, row)) in enumerate(zip(plan.rows, plan.samples, strict=True)):
        if q != 1 or row != j or sampler is not seq or seq.matcher is not None:
            return None
        ids.append(stop_ids(seq, eos_ids)[0])
        if len(ids[-1]) > MAX_STOP_IDS:
            return None
    return ids


def prepare(
    plan: StepPlan,
    max_rows: int,
    num_steps: int,
    *,
    eos_ids: Collection[int],
    max_model_len: int,
    exit_on_finish: bool,
    rope_switch_len: int | None = None,
    stop_id_lists: list[tuple[int, ...]] | None = None,
) -> DecodeLoopInputs:
    """The loop inputs of an :func:`eligible` ``plan`` (host arrays) for ``num_steps`` (K)
    iterations; ``max_rows`` is R. Keys follow :func:`paxcache.step.prepare_sampling`'s
    rule ``(seed, tokens generated, completion index)``. With ``rope_switch_len``
    (longrope), a row whose K/V hold the short factors stops iterating once its sequence
    reaches one token past it: the scheduler recomputes it before its next token
    (``Scheduler._recompute_outgrown``). ``stop_id_lists``: each sample's stop ids, when
    known (:func:`paxcache.sequence.stop_ids`)."""
    r = max_rows
    seqs = [seq for seq, _ in plan.samples]
    n = len(seqs)
    stops = np.full((r, MAX_STOP_IDS), -1, np.int32)
    ids = stop_id_lists if stop_id_lists is not None else [stop_ids(s, eos_ids)[0] for s in seqs]
    widths = set(map(len, ids))
    if len(widths) == 1:  # one array op (every row has as many stop ids: the usual case)
        width = widths.pop()
        stops[:n, :width] = np.asarray(ids, np.int32).reshape(n, width)
    else:
        for j, row_ids in enumerate(ids):
            stops[j, : len(row_ids)] = row_ids
    max_new = np.ones(r, np.int32)
    if n:
        lens = np.fromiter((len(seq.token_ids) for seq in seqs), np.int64, n)
        generated = lens - np.fromiter((seq.num_prompt for seq in seqs), np.int64, n)
        max_tokens = np.fromiter((seq.params.max_tokens for seq in seqs), np.int64, n)
        left = np.minimum(max_tokens - generated, max_model_len - lens)
        if rope_switch_len is not None:  # short-factor rows stop one token past the switch
            short = np.fromiter((not seq.rope_long for seq in seqs), bool, n)
            left = np.where(short, np.minimum(left, rope_switch_len - lens + 1), left)
        max_new[:n] = np.maximum(1, left)
    return DecodeLoopInputs(
        keys=sequence_keys(seqs, r, range(num_steps), zeros_if_greedy=True),
        stop_ids=stops,
        max_new=max_new,
        exit_on_finish=np.asarray(exit_on_finish),
        active=np.arange(r) < len(plan.samples),
    )


def for_plan(plan: StepPlan, scheduler: Scheduler, shapes: Any) -> DecodeLoopInputs | None:
    """The loop inputs of ``plan`` for ``shapes.decode_steps`` iterations and
    ``shapes.max_rows`` rows, or None when that is 1 or the plan is not :func:`eligible`;
    stop ids and limits from ``scheduler``, which also says whether a request waits (the
    loop then ends at the first finish, to give it the slot)."""
    eos = scheduler.eos_token_ids
    ids = _eligible_stop_ids(plan, eos) if shapes.decode_steps > 1 else None
    if ids is None:
        return None
    return prepare(
        plan,
        shapes.max_rows,
        shapes.decode_steps,
        eos_ids=eos,
        max_model_len=scheduler.max_model_len,
        exit_on_finish=scheduler.num_waiting > 0,
        rope_switch_len=scheduler.rope_switch_len,
        stop_id_lists=ids,
    )


def empty(max_rows: int, num_steps: int) -> DecodeLoopInputs:
    """Inputs of a loop that runs nothing (warm-up, ahead-of-time compilation)."""
    return prepare(
        StepPlan(), max_rows, num_steps, eos_ids=(), max_model_len=1, exit_on_finish=False
    )


def _stops(loop: DecodeLoopInputs, tokens: jax.Array, steps: jax.Array) -> jax.Array:
    """``bool[R]``: row ``j`` stops after sampling ``tokens[j]`` as its ``steps[j]``-th token
    of the loop: a stop id, or its token limit."""
    return jnp.any(tokens[:, None] == loop.stop_ids, axis=-1) | (steps >= loop.max_new)


def _next_blocks_free(
    state: allocator.BlockState, slot_ids: jax.Array, active: jax.Array
) -> jax.Array:
    """``bool[]``: every ``active`` row (``slot_ids i32[R]``) can append one token now."""
    num_slots = state.cfg.max_seqs
    target = jnp.where(active, slot_ids, num_slots)
    counts = jnp.zeros((num_slots,), jnp.int32).at[target].set(1, mode="drop")
    return jnp.all(allocator.can_append(state, counts)[slot_ids] | ~active)


class _Carry(NamedTuple):
    """The loop's state between iterations."""

    k: jax.Array  # i32[]: iterations run
    state: Any  # the block state
    kv: Any  # the KV cache
    tokens: jax.Array  # i32[T]: the next iteration's input tokens
    kv_lens: jax.Array  # i32[R]: each row's length after the next iteration
    active: jax.Array  # bool[R]: the row is still decoding
    first_ok: jax.Array  # bool[R]: the row ran iteration 0 (the single step's row_ok)
    steps: jax.Array  # i32[R]: iterations the row ran
    out: SampleOutput  # [K, R, ...]: every iteration's samples
    stopped: jax.Array  # bool[]: some row stopped


# Iteration: (state, kv, inputs of this iteration, rows still decoding bool[R]) ->
# (state, kv, row_ok bool[R], sampled SampleOutput of [R] arrays).
Iteration = Callable[[Any, Any, Any, jax.Array], tuple[Any, Any, jax.Array, SampleOutput]]


def run(
    state: allocator.BlockState, kv: Any, inputs: Any, iterate: Iteration, num_logprobs: int
) -> tuple[allocator.BlockState, Any, jax.Array, SampleOutput, jax.Array]:
    """Up to K iterations of ``iterate`` (the single step) on the device.

    Args:
      state: the block state (donated by the caller's jit).
      kv: the KV cache.
      inputs: the first iteration's :class:`~paxcache.step.StepInputs`, a decode-only plan
        with ``inputs.decode_loop`` set.
      iterate: one iteration (the single step's work on ``inputs`` with a row mask).
      num_logprobs: top log-probabilities per sample (the step's static K).

    Returns:
      ``(state, kv, row_ok bool[R], sampled, steps i32[R])``: ``row_ok`` row ``j`` ran its
      first iteration (or was not to: ``loop.active``); ``sampled`` holds ``[K, R, ...]``
      arrays (iteration ``k``, sample ``j``); ``steps[j]`` iterations row ``j`` ran (its
      tokens are ``sampled.tokens[:steps[j], j]``).
    """
    loop: DecodeLoopInputs = inputs.decode_loop
    num_steps, r = loop.keys.shape[0], inputs.slot_ids.shape[0]
    t = inputs.token_ids.shape[0]
    first = inputs.replace(decode_loop=None)
    live = (jnp.arange(r) < inputs.num_rows) & loop.active

    def one(c: _Carry) -> _Carry:
        step_inputs = first.replace(
            token_ids=c.tokens,
            kv_lens=c.kv_lens,
            # After iteration 0 every continuing row appends the token it sampled.
            grows=jnp.where(c.k == 0, inputs.grows, c.active),
            sampling=first.sampling.replace(keys=loop.keys[c.k]),
        )
        state, kv, ran, sampled = iterate(c.state, c.kv, step_inputs, c.active)
        steps = c.steps + ran.astype(jnp.int32)
        hit = _stops(loop, sampled.tokens, steps)
        going = ran & ~hit
        n = min(t, r)  # decode rows are tokens: row j feeds token j
        tokens = c.tokens.at[:n].set(jnp.where(going[:n], sampled.tokens[:n], c.tokens[:n]))
        return _Carry(
            k=c.k + 1,
            state=state,
            kv=kv,
            tokens=tokens,
            kv_lens=c.kv_lens + going.astype(jnp.int32),
            active=going,
            first_ok=jnp.where(c.k == 0, ran, c.first_ok),
            steps=steps,
            out=jax.tree.map(lambda buf, x: buf.at[c.k].set(x), c.out, sampled),
            stopped=c.stopped | jnp.any(ran & hit),
        )

    def more(c: _Carry) -> jax.Array:
        fits = _next_blocks_free(c.state, inputs.slot_ids, c.active)
        go_on = (c.k < num_steps) & jnp.any(c.active) & fits & ~(loop.exit_on_finish & c.stopped)
        return (c.k == 0) | go_on

    k = num_logprobs
    out = SampleOutput(
        tokens=jnp.zeros((num_steps, r), jnp.int32),
        logprob=jnp.zeros((num_steps, r), jnp.float32),
        top_ids=jnp.zeros((num_steps, r, k), jnp.int32),
        top_logprobs=jnp.zeros((num_steps, r, k), jnp.float32),
    )
    start = _Carry(
        k=jnp.int32(0),
        state=state,
        kv=kv,
        tokens=inputs.token_ids,
        kv_lens=inputs.kv_lens,
        active=live,
        first_ok=jnp.zeros((r,), bool),
        steps=jnp.zeros((r,), jnp.int32),
        out=out,
        stopped=jnp.asarray(False),
    )
    end = jax.lax.while_loop(more, one, start)
    # A row the loop was not asked to run (loop.active) was not refused.
    return end.state, end.kv, end.first_ok | ~loop.active, end.out, end.steps


@jax.jit
def next_inputs(
    inputs: Any,
    state: allocator.BlockState,
    tokens: jax.Array,
    steps: jax.Array,
    keys: jax.Array,
    keep: jax.Array,
) -> Any:
    """The inputs of the loop after the one that ran on ``inputs``, built on the device
    before that one is read (:func:`paxcache.overlap.loop_continuation`): what the scheduler
    would plan once it read it, when nothing waits. A row goes on when the host still runs
    its sequence, it ran that loop and stopped in none of its iterations; it feeds the last
    token it sampled, at its length plus the iterations it ran, with the keys and token limit
    that many tokens further on. When the blocks of one more token are not free for every
    row going on (the scheduler would preempt), no row runs: the loop is one empty iteration
    and the host plans the next step itself.

    Args:
      inputs: the loop's :class:`~paxcache.step.StepInputs` (``decode_loop`` set; on the
        device), or them packed (:mod:`paxcache.packing`): the result is then packed too.
      state: the block state the loop returned.
      tokens: ``i32[K, R]`` its samples; ``steps``: ``i32[R]`` iterations each row ran.
      keys: ``u32[2K, R, 2]`` each row's keys from the loop's first sample on
        (:func:`~paxcache.sampling.sequence_keys` before the loop is read).
      keep: ``bool[R]`` rows whose sequence the host still runs.
    """
    if isinstance(inputs, packing.PackedInputs):  # the engine's form, and the step's
        return packing.pack(next_inputs(inputs.unpack(), state, tokens, steps, keys, keep))
    loop = inputs.decode_loop
    num_steps, r = tokens.shape
    rows = jnp.arange(r)
    last = tokens[jnp.maximum(steps - 1, 0), rows]
    stopped = _stops(loop, last, steps)
    going = keep & loop.active & (steps > 0) & ~stopped
    going &= _next_blocks_free(state, inputs.slot_ids, going)
    n = min(inputs.token_ids.shape[0], r)  # decode rows are tokens: row j feeds token j
    token_ids = inputs.token_ids.at[:n].set(jnp.where(going[:n], last[:n], inputs.token_ids[:n]))
    kv_lens = inputs.kv_lens + jnp.where(going, steps, 0)
    ahead = steps[None, :] + jnp.arange(num_steps)[:, None]  # [K, R]: the keys' offsets
    return inputs.replace(
        token_ids=token_ids,
        kv_lens=kv_lens,
        rope_lens=None if inputs.rope_lens is None else kv_lens,
        grows=going,
        decode_loop=loop.replace(
            keys=keys[jnp.minimum(ahead, keys.shape[0] - 1), rows[None, :]],
            max_new=jnp.maximum(loop.max_new - steps, 1),
            exit_on_finish=jnp.asarray(False),
            active=going,
        ),
    )
