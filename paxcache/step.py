"""The fused device step: its inputs (:class:`StepInputs`), how they are built from a plan
(:func:`prepare_inputs`), and the jit-compiled program (:func:`step`).

One call of ``step(state, kv, params, inputs)`` runs, on the device and without returning to
Python in between: the allocator's batched ``append`` (one new token per growing row) →
copy-on-write block copies → attention metadata → the model's paged forward (its own
:class:`~paxcache.nn.PagedAttention` writes K/V and attends, every layer under ``lax.scan``) →
sampling → prefix-cache ``commit``. The block state and the KV cache are donated by the
caller and come back updated; the host reads back only :class:`StepOutputs`.

Everything static (the model's structure, kernel choice, mesh) is in :class:`StepConfig`; the
process holds one ``jax.jit`` of the step per config (:func:`jitted_step`), so engines of the
same model structure share its traced and compiled programs. The arrays are one pytree,
:class:`StepInputs`, built by :func:`prepare_inputs` in stages named by purpose
(:func:`prepare_tokens`, :func:`prepare_sampling`). Token counts are padded to the engine's
buckets and rows to ``R = max_num_seqs``, so each bucket compiles once.

Extending the inputs (e.g. a per-row allowed-token bitmask, prompt-logprob rows): add a field
``x: jax.Array | None = None`` to :class:`StepInputs` (or a sub-struct), fill it in a new stage
of :func:`prepare_inputs` only when a plan needs it, and read it in :func:`step` under ``if
inputs.x is not None``. ``None`` is an empty pytree node, so a step without the field traces
and runs exactly as before, and one with it is its own compiled program (a bucket of its own);
no call site changes. Warm-up and ahead-of-time compilation build their inputs with the same
:func:`prepare_inputs` (:func:`empty_inputs`). ``StepInputs.prompt_logprobs``
(:class:`PromptLogprobInputs`, filled by :func:`prepare_prompt_logprobs`) is built this way:
the rows of requests with ``SamplingParams.prompt_logprobs`` join the sampled rows in the one
forward's ``logits_indices``, and :func:`read_result` fetches their log-probabilities only when
the plan had any.

Shape letters: T tokens (the bucket), R rows (``max_num_seqs``), B allocator slots, V
vocabulary, K top log-probabilities.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.buckets import power_of_two_buckets
from paxcache import allocator, decode_loop, kv_cache, packing
from paxcache.attention import metadata_from_state
from paxcache.sampling import MAX_LOGPROBS, SampleOutput, sample, sequence_keys, token_logprobs
from paxcache.scheduler import StepPlan, StepResult

__all__ = [
    "PromptLogprobInputs",
    "SamplingInputs",
    "StepConfig",
    "StepInputs",
    "StepOutputs",
    "StepShapes",
    "StepVariant",
    "apply_allowed",
    "default_batch_limits",
    "default_dtype",
    "resolve_batch_limits",
    "empty_inputs",
    "log_first_use",
    "prepare_allowed",
    "prepare_inputs",
    "prepare_prompt_logprobs",
    "prepare_sampling",
    "prepare_tokens",
    "read_result",
    "step",
    "jitted_step",
    "loop_buckets",
    "token_buckets",
    "tracing_for",
    "warmup_variants",
]

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """The token-count buckets of a step budget: powers of two from ``smallest``, then the
    budget itself (e.g. 256 -> 16, 32, 64, 128, 256): the repository's one padding rule,
    :func:`kernels_pallas.buckets.power_of_two_buckets`."""
    return power_of_two_buckets(max_tokens, smallest)


# Default (max_num_seqs, max_num_batched_tokens) by backend, chosen like vLLM's (which picks
# them by hardware and usage): enough rows and tokens per step to keep the device busy, few
# enough that the largest step stays short (decode latency for everyone waits on it) and the
# warm-up compiles few buckets.
# * TPU / GPU: vLLM's OpenAI-server defaults on most GPUs (256 sequences, 2048 tokens).
# * CPU: a matmul over few rows is bound by reading the weights, so a decode step of 64 rows
#   costs little more than one of 32 and halves the steps of a busy batch (1.6x the
#   throughput on the workload of scripts/bench_peer.py); a 256-token step already runs the
#   matmuls at full speed, while 1024 tokens made the XLA attention path (which gathers
#   each token row's context) the bottleneck: 3x slower (bench/results/step_profile_*.md).
DEFAULT_BATCH_LIMITS = {"cpu": (64, 256)}
DEFAULT_BATCH_LIMITS_ACCELERATOR = (256, 2048)


def default_dtype(backend: str | None = None) -> Any:
    """The weights / activations / KV dtype the engine loads a model in by default on
    ``backend`` (default: JAX's): float32 on the CPU (XLA:CPU has no native bf16 and upcasts
    it over whole arrays), bfloat16 on TPU and GPU (the kernels' dtype)."""
    return jnp.float32 if (backend or jax.default_backend()) == "cpu" else jnp.bfloat16


def default_batch_limits(backend: str) -> tuple[int, int]:
    """``(max_num_seqs, max_num_batched_tokens)`` the engine uses on ``backend`` by default."""
    return DEFAULT_BATCH_LIMITS.get(backend, DEFAULT_BATCH_LIMITS_ACCELERATOR)


def resolve_batch_limits(
    backend: str, max_num_seqs: int | None, max_num_batched_tokens: int | None
) -> tuple[int, int]:
    """The given limits, ``None`` replaced by ``backend``'s defaults.

    Raises:
      ValueError: a limit that is not a positive int.
    """
    seqs_default, tokens_default = default_batch_limits(backend)
    limits = {
        "max_num_seqs": seqs_default if max_num_seqs is None else max_num_seqs,
        "max_num_batched_tokens": (
            tokens_default if max_num_batched_tokens is None else max_num_batched_tokens
        ),
    }
    for name, val in limits.items():
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    return limits["max_num_seqs"], limits["max_num_batched_tokens"]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static configuration of the step (hashable: part of the compiled program's identity).

    Attributes:
      graphdef: the model's NNX graph definition (``nnx.split(model)[0]``); its parameters
        are the step's ``params`` argument.
      impl: kernel implementation for every op of the step (``"auto"``, ``"reference"``,
        ``"pallas"``, ...; see :mod:`kernels_pallas`).
      interpret: run Pallas kernels in interpret mode.
      mesh: the tensor-parallel mesh (``tp`` axis) or None.
      num_logprobs: top log-probabilities computed per sample (static K).
      fuse_allocator: run ``append`` / copy-on-write / ``commit`` inside the step. False
        (benchmarks only: ``scripts/bench_serving.py``) reads the block tables as they are,
        the same step fed a precomputed block table.
    """

    graphdef: Any
    impl: str = "auto"
    interpret: bool = False
    mesh: jax.sharding.Mesh | None = None
    num_logprobs: int = MAX_LOGPROBS
    fuse_allocator: bool = True


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The padded shapes of the inputs.

    Attributes:
      buckets: token-count buckets, ascending (a step runs the smallest that fits).
      max_rows: R, rows (and samples) per step.
      vocab_size: V (``top_k`` is clamped to it).
      decode_variant: decode-only plans get their own program (``StepInputs.decode_only``):
        on TPU, where the decode kernel beats the ragged one; elsewhere the attention is the
        same for both and one program serves every plan.
      decode_steps: K, the most decode iterations one program runs (:mod:`.decode_loop`);
        1: every step is one iteration.
      rope_lens: the inputs carry ``StepInputs.rope_lens`` (a model whose RoPE depends on the
        sequence's length: longrope); otherwise they do not (every leaf costs dispatch time).
    """

    buckets: tuple[int, ...]
    max_rows: int
    vocab_size: int
    decode_variant: bool = False
    decode_steps: int = 1
    rope_lens: bool = False

    def bucket(self, num_tokens: int) -> int:
        """The smallest bucket holding ``num_tokens``."""
        for t in self.buckets:
            if t >= num_tokens:
                return t
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")


@flax.struct.dataclass
class SamplingInputs:
    """Per-sample inputs: sample ``j`` draws its token from the logits of one token row.

    Attributes:
      logits_rows: ``i32[R]`` the token row (index into ``StepInputs.token_ids``) whose
        logits sample ``j`` uses: the last token of its sequence's row (a follower of an
        ``n > 1`` request shares its leader's). Padding samples: 0.
      temperature: ``f32[R]``; 0 = greedy.
      top_k: ``i32[R]``; 0 = off, at most V.
      top_p: ``f32[R]``; 1 = off.
      min_p: ``f32[R]``; 0 = off.
      keys: ``u32[R, 2]`` raw threefry keys, a pure function of (seed, tokens generated,
        completion index): a request's draws do not depend on its batch.
      logprobs_wanted: ``bool[]`` whether any sample reports logprobs (``logprobs`` not
        None): otherwise the step skips the log-softmax and the top-``num_logprobs`` search
        over the vocabulary (and reads none back: :func:`read_result`).
    """

    logits_rows: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    keys: jax.Array
    logprobs_wanted: jax.Array


@flax.struct.dataclass
class PromptLogprobInputs:
    """Token rows whose full-vocabulary log-probabilities the step computes (prompt logprobs).

    Entry ``k`` reads the logits of token row ``rows[k]`` and reports the log-probability of
    ``targets[k]`` (the next prompt token) and the top ``StepConfig.num_logprobs``; padding
    entries (``rows = targets = 0``) are computed and ignored. ``P`` is the token bucket ``T``:
    every fed token may need one, so a bucket compiles one such program.

    Attributes:
      rows: ``i32[P]`` indices into ``StepInputs.token_ids``.
      targets: ``i32[P]`` the token whose log-probability entry ``k`` reports.
    """

    rows: jax.Array
    targets: jax.Array


@flax.struct.dataclass
class StepInputs:
    """Everything a step reads besides the state, the cache and the weights.

    Row ``i < num_rows`` feeds ``q_lens[i]`` tokens of the sequence in allocator slot
    ``slot_ids[i]``: ``token_ids[cu_i : cu_i + q_lens[i]]`` with ``cu_i = sum(q_lens[:i])``,
    the last tokens of its ``kv_lens[i]``. Rows ``>= num_rows`` and tokens past the real ones
    are padding (never written, never read).

    Attributes:
      token_ids: ``i32[T]`` the fed tokens, rows packed in order.
      slot_ids: ``i32[R]`` allocator slot of each row.
      q_lens: ``i32[R]`` tokens each row feeds.
      kv_lens: ``i32[R]`` each row's sequence length after the step.
      num_rows: ``i32[]`` real rows.
      grows: ``bool[R]`` the row's last token lies past its sequence's allocation: the
        allocator appends it (one block when it starts one, plus a copy-on-write when the
        last block is shared).
      sampling: the per-sample inputs (:class:`SamplingInputs`).
      prompt_logprobs: :class:`PromptLogprobInputs`, or None when no row of the plan needs
        prompt log-probabilities (the step then runs the program it always runs).
      allowed: ``i32[R, ceil(V/32)]`` per-sample allowed-token bitmask (bit ``t % 32`` of
        word ``t // 32``: token ``t`` may be sampled), or None when no sample of the plan is
        constrained (:func:`prepare_allowed`). Unconstrained samples' rows are all ones.
      decode_only: static; every row feeds one token and row ``i`` is the ``i``-th token
        (set by :func:`prepare_tokens` when ``StepShapes.decode_variant`` asks for it): the
        step runs the attention's decode kernel (``max_q_len=1``), a program of its own.
      decode_loop: :class:`paxcache.decode_loop.DecodeLoopInputs` of a multi-step decode
        (up to K iterations in one program), or None (one iteration).
      rope_lens: ``i32[R]`` each row's sequence length as the host knows it (every token it
        holds, a prompt's chunks still to come included): what decides length-dependent
        RoPE (:attr:`paxcache.attention.AttentionMetadata.rope_lens`); None: ``kv_lens``.
    """

    token_ids: jax.Array
    slot_ids: jax.Array
    q_lens: jax.Array
    kv_lens: jax.Array
    num_rows: jax.Array
    grows: jax.Array
    sampling: SamplingInputs
    prompt_logprobs: PromptLogprobInputs | None = None
    allowed: jax.Array | None = None
    decode_only: bool = flax.struct.field(pytree_node=False, default=False)
    decode_loop: decode_loop.DecodeLoopInputs | None = None
    rope_lens: jax.Array | None = None


@flax.struct.dataclass
class StepOutputs:
    """What the host reads back after a step.

    Attributes:
      sampled: ``SampleOutput(tokens i32[R], logprob f32[R], top_ids i32[R, K],
        top_logprobs f32[R, K])`` for sample ``j`` of the plan.
      row_ok: ``bool[R]`` row ``i`` got its blocks and ran.
      num_free_blocks: ``i32[]`` free device blocks after the step.
      prompt_logprobs: ``SampleOutput(targets i32[P], logprob f32[P], top_ids i32[P, K],
        top_logprobs f32[P, K])`` for the entries of ``inputs.prompt_logprobs``, or None.
      prompt_rank: ``i32[P]`` each target's rank in its distribution (1 = most likely), or
        None.
      steps: ``i32[R]`` iterations row ``i`` ran, for a multi-step decode (``sampled`` then
        holds ``[K, R, ...]`` arrays, iteration first); None for one step.
    """

    sampled: SampleOutput
    row_ok: jax.Array
    num_free_blocks: jax.Array
    prompt_logprobs: SampleOutput | None = None
    prompt_rank: jax.Array | None = None
    steps: jax.Array | None = None


# ----------------------------------------------------------------------------------------------
# Building the inputs from a plan (host, numpy)


def prepare_tokens(plan: StepPlan, shapes: StepShapes) -> tuple[dict[str, np.ndarray], list[int]]:
    """The token and row arrays of ``plan``.

    Returns:
      ``({token_ids, slot_ids, q_lens, kv_lens, num_rows, grows}, row_ends)`` (and
      ``rope_lens`` when ``shapes.rope_lens``); ``row_ends[i]``
      is the index in ``token_ids`` of row ``i``'s last token.
    """
    r = shapes.max_rows
    tokens = np.zeros(shapes.bucket(plan.num_tokens), np.int32)
    slot_ids = np.zeros(r, np.int32)
    q_lens = np.zeros(r, np.int32)
    kv_lens = np.zeros(r, np.int32)
    rope_lens = np.zeros(r, np.int32)
    grows = np.zeros(r, bool)
    rows, n = plan.rows, len(plan.rows)
    assert len(plan.slots) == n, "one slot per row"
    computed = [seq.num_computed for seq, _ in rows]
    q_list = [q for _, q in rows]
    fed: list[int] = []  # each row's tokens, in row order (a decode row's one token)
    for (seq, q), c in zip(rows, computed, strict=True):
        fed.extend(seq.token_ids[c : c + q])
    assert len(fed) == sum(q_list), "a row feeds tokens past its sequence's end"
    tokens[: len(fed)] = fed
    row_ends = (np.cumsum(q_list, dtype=np.int64) - 1).tolist()
    slot_ids[:n], q_lens[:n] = plan.slots, q_list
    kv_lens[:n] = np.add(computed, q_list)
    rope_lens[:n] = [len(seq.token_ids) for seq, _ in rows]
    extra = kv_lens[:n] - np.asarray([seq.num_allocated for seq, _ in rows], np.int64)
    assert not np.any(extra > 1), "at most one new token per step beyond the allocation"
    grows[:n] = extra > 0
    arrays = dict(
        token_ids=tokens,
        slot_ids=slot_ids,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_rows=np.int32(len(plan.rows)),
        grows=grows,
    )
    if shapes.rope_lens:
        arrays["rope_lens"] = rope_lens
    return arrays, row_ends


def wants_decode_variant(impl: str, backend: str) -> bool:
    """Whether decode-only steps get their own program: where the TPU kernels run (a TPU
    backend with ``impl="auto"`` / ``"pallas"``, or the TPU kernels forced, interpret mode
    too), the decode kernel is several times faster than the ragged one. The XLA and GPU
    paths run one attention for every batch, so one program is enough there."""
    if impl == "pallas_tpu":
        return True
    return (impl in ("auto", "pallas") and backend == "tpu") or (
        impl == "pallas" and backend == "cpu"
    )


def decode_buckets(shapes: StepShapes) -> tuple[int, ...]:
    """The token buckets a decode-only step can use (one token per row): those up to the
    first holding ``max_rows`` rows; none without a decode variant."""
    return _row_buckets(shapes) if shapes.decode_variant else ()


def _row_buckets(shapes: StepShapes) -> tuple[int, ...]:
    fit = [t for t in shapes.buckets if t >= shapes.max_rows]
    last = fit[0] if fit else shapes.buckets[-1]
    return tuple(t for t in shapes.buckets if t <= last)


def loop_buckets(shapes: StepShapes) -> tuple[int, ...]:
    """The token buckets a multi-step decode can use (one token per row, up to the first
    bucket holding ``max_rows``); none with ``decode_steps == 1``."""
    return _row_buckets(shapes) if shapes.decode_steps > 1 else ()


def is_decode_only(plan: StepPlan, shapes: StepShapes) -> bool:
    """Whether ``plan`` runs the decode variant: every row feeds exactly one token."""
    return shapes.decode_variant and bool(plan.rows) and all(q == 1 for _, q in plan.rows)


def prepare_sampling(
    plan: StepPlan, row_ends: Seq[int], shapes: StepShapes
) -> tuple[SamplingInputs, set[str]]:
    """The sampling inputs of ``plan``'s samples.

    A request whose values cannot be represented (it raises here) samples greedily in this
    step and is reported in the returned set: it fails, the batch runs.

    Returns:
      ``(sampling inputs, ids of requests that failed here)``.
    """
    r = shapes.max_rows
    logits_rows, top_k = np.zeros(r, np.int32), np.zeros(r, np.int32)
    temperature, min_p = np.zeros(r, np.float32), np.zeros(r, np.float32)
    top_p = np.ones(r, np.float32)
    failed: set[str] = set()

    def put(at: slice, seqs: list) -> None:  # the samples ``seqs`` at rows ``at``
        params = [seq.params for seq in seqs]
        temperature[at] = [p.temperature for p in params]
        top_k[at] = [min(p.top_k, shapes.vocab_size) for p in params]
        top_p[at], min_p[at] = [p.top_p for p in params], [p.min_p for p in params]

    seqs = [seq for seq, _ in plan.samples]
    logits_rows[: len(seqs)] = [row_ends[row] for _, row in plan.samples]
    try:
        put(slice(0, len(seqs)), seqs)  # one array assignment per field (the usual case)
    except Exception:  # noqa: BLE001 - a value that cannot be represented: find whose
        for j, seq in enumerate(seqs):
            try:
                put(slice(j, j + 1), [seq])
            except Exception:  # noqa: BLE001 - this request fails, the batch runs
                temperature[j], top_k[j], top_p[j], min_p[j] = 0.0, 0, 1.0, 0.0
                if seq.request_id not in failed:
                    failed.add(seq.request_id)
                    logger.exception("request %s failed in its sampling inputs", seq.request_id)
    sampling = SamplingInputs(
        logits_rows=logits_rows,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        # Seeds are ints, fixed at arrival: they never fail. Unused by a greedy batch: zeros.
        keys=sequence_keys(seqs, r, zeros_if_greedy=True)[0],
        logprobs_wanted=np.asarray(plan.wants_logprobs, bool),
    )
    return sampling, failed


def prepare_prompt_logprobs(
    plan: StepPlan, row_ends: Seq[int], num_tokens: int
) -> PromptLogprobInputs | None:
    """The prompt-logprob entries of ``plan`` (``plan.prompt_positions``, in order), padded to
    ``num_tokens`` (the bucket); None when it has none."""
    if not plan.prompt_positions:
        return None
    rows = np.zeros(num_tokens, np.int32)
    targets = np.zeros(num_tokens, np.int32)
    for k, (i, p) in enumerate(plan.prompt_positions):
        seq, q = plan.rows[i]
        rows[k] = row_ends[i] - (q - 1) + (p - seq.num_computed)
        targets[k] = seq.token_ids[p + 1]
    return PromptLogprobInputs(rows=rows, targets=targets)


def prepare_allowed(plan: StepPlan, shapes: StepShapes) -> tuple[np.ndarray | None, set[str]]:
    """The allowed-token bitmask of ``plan``'s samples: ``i32[R, ceil(V/32)]``, all ones but
    for the samples of constrained sequences (their grammar matcher fills their row), or None
    when no sample is constrained (the step then runs its unconstrained program).

    A request whose matcher failed (or raises here) is reported in the returned set and
    samples unconstrained in this step: it fails, the batch runs.

    Returns:
      ``(bitmask or None, ids of requests that failed here)``.
    """
    rows = [(seq.matcher, j) for j, (seq, _) in enumerate(plan.samples) if seq.matcher is not None]
    if not rows:
        return None, set()
    from paxcache import grammar  # only constrained plans need the grammar library

    mask = np.full((shapes.max_rows, grammar.bitmask_words(shapes.vocab_size)), -1, np.int32)
    failed: set[str] = set()
    for m, j in rows:
        if m.error is not None:
            seq = plan.samples[j][0]
            logger.error("request %s: its grammar matcher failed: %s", seq.request_id, m.error)
            failed.add(seq.request_id)
    live = [(m, j) for m, j in rows if plan.samples[j][0].request_id not in failed]
    try:
        if live:
            grammar.fill_bitmask(live, mask)
    except Exception:  # noqa: BLE001 - these requests fail, the batch runs
        logger.exception("filling the allowed-token bitmask failed; failing its requests")
        failed |= {plan.samples[j][0].request_id for _, j in live}
    for _, j in rows:
        if plan.samples[j][0].request_id in failed:
            mask[j] = -1
    return mask, failed


def prepare_inputs(plan: StepPlan, shapes: StepShapes) -> tuple[StepInputs, set[str]]:
    """The step's inputs for ``plan`` (host arrays), and the requests that failed building
    them (see :func:`prepare_sampling`, :func:`prepare_allowed`)."""
    tokens, row_ends = prepare_tokens(plan, shapes)
    sampling, failed = prepare_sampling(plan, row_ends, shapes)
    prompt = prepare_prompt_logprobs(plan, row_ends, tokens["token_ids"].shape[0])
    allowed, failed_masks = prepare_allowed(plan, shapes)
    inputs = StepInputs(
        **tokens,
        sampling=sampling,
        prompt_logprobs=prompt,
        allowed=allowed,
        decode_only=is_decode_only(plan, shapes),
    )
    return inputs, failed | failed_masks


def read_result(
    plan: StepPlan, state: allocator.BlockState, out: StepOutputs, failed: set[str]
) -> StepResult:
    """Reads a step's outputs back to the host in one transfer: the sampled tokens, the row
    flags and the free-block count, plus log-probabilities only where the plan asked."""
    fetch: dict[str, Any] = {
        "tokens": out.sampled.tokens,
        "row_ok": out.row_ok,
        "num_free_blocks": out.num_free_blocks,
    }
    if out.steps is not None:
        fetch["steps"] = out.steps
    if plan.wants_logprobs:
        fetch.update(
            logprob=out.sampled.logprob,
            top_ids=out.sampled.top_ids,
            top_logprobs=out.sampled.top_logprobs,
        )
    if plan.prompt_positions and out.prompt_logprobs is not None:
        fetch.update(
            prompt_logprob=out.prompt_logprobs.logprob,
            prompt_top_ids=out.prompt_logprobs.top_ids,
            prompt_top_logprobs=out.prompt_logprobs.top_logprobs,
            prompt_rank=out.prompt_rank,
        )
    host = jax.device_get(fetch)
    host["num_free_blocks"] = int(host["num_free_blocks"])
    return StepResult(state=state, failed_requests=failed, **host)


def empty_inputs(
    shapes: StepShapes,
    num_tokens: int,
    masked: bool = False,
    decode: bool = False,
    prompt_logprobs: bool = False,
    loop: bool = False,
) -> StepInputs:
    """Inputs of a step of ``num_tokens`` (a bucket) that runs nothing: warm-up, ahead-of-time
    compilation, HLO inspection. ``masked``: the variant with an allowed-token bitmask (all
    tokens allowed; constrained decoding); ``decode``: the decode-only variant;
    ``prompt_logprobs``: the variant that also computes prompt log-probabilities (``echo``,
    ``prompt_logprobs`` requests; padding entries); ``loop``: the multi-step decode of
    ``shapes.decode_steps`` iterations."""
    inputs, _ = prepare_inputs(StepPlan(), dataclasses.replace(shapes, buckets=(num_tokens,)))
    inputs = inputs.replace(decode_only=decode)
    if loop:
        inputs = inputs.replace(decode_loop=decode_loop.empty(shapes.max_rows, shapes.decode_steps))
    if masked:
        from paxcache import grammar

        words = grammar.bitmask_words(shapes.vocab_size)
        inputs = inputs.replace(allowed=np.full((shapes.max_rows, words), -1, np.int32))
    if prompt_logprobs:
        pads = np.zeros(num_tokens, np.int32)
        inputs = inputs.replace(prompt_logprobs=PromptLogprobInputs(rows=pads, targets=pads))
    return inputs


class StepVariant(NamedTuple):
    """One program of the step: its token bucket and which optional inputs it has (the
    arguments of :func:`empty_inputs` after ``shapes``)."""

    num_tokens: int
    masked: bool = False
    decode: bool = False
    prompt_logprobs: bool = False
    loop: bool = False

    def describe(self) -> str:
        """``"step for 64 tokens (constrained) (prompt logprobs)"``."""
        flags = ((self.masked, "constrained"), (self.decode, "decode only"))
        flags += ((self.prompt_logprobs, "prompt logprobs"), (self.loop, "multi-step decode"))
        return f"step for {self.num_tokens} tokens" + "".join(f" ({w})" for on, w in flags if on)


def warmup_variants(
    shapes: StepShapes, masked: bool = False, prompt_logprobs: bool = False
) -> list[StepVariant]:
    """Every program serving can run: each token bucket (and, with a decode variant, each
    of :func:`decode_buckets` decode-only), times the constrained variant when ``masked``,
    times the prompt-logprob variant when ``prompt_logprobs`` (a batch can mix a
    constrained request with an ``echo`` one, so their product too); with
    ``shapes.decode_steps > 1``, the multi-step decode of each of :func:`loop_buckets`."""
    masks = (False, True) if masked else (False,)
    prompts = (False, True) if prompt_logprobs else (False,)
    variants = [StepVariant(t, m, False, p) for p in prompts for m in masks for t in shapes.buckets]
    decode = decode_buckets(shapes)
    variants += [StepVariant(t, m, True, p) for p in prompts for m in masks for t in decode]
    dv = shapes.decode_variant
    return variants + [StepVariant(t, False, dv, False, True) for t in loop_buckets(shapes)]


def log_first_use(inputs: StepInputs, warm: bool) -> None:
    """Called while the step is traced, i.e. about to compile a new program: once the engine
    is warm, logs one line naming the program (warm-up did not cover it; the request that
    needs it waits for the compilation)."""
    if not warm:
        return
    variant = StepVariant(
        int(inputs.token_ids.shape[0]),
        inputs.allowed is not None,
        bool(inputs.decode_only),
        inputs.prompt_logprobs is not None,
        inputs.decode_loop is not None,
    )
    logger.warning("compiling the %s on first use (warm-up did not compile it)", variant.describe())


# ----------------------------------------------------------------------------------------------
# The step (device)


def _append_requests(
    inputs: StepInputs, live: jax.Array, num_slots: int
) -> tuple[jax.Array, jax.Array]:
    """Per-slot ``append`` arguments: ``(counts i32[B], token_ids i32[B, 1])``; a growing
    ``live`` row appends its last token."""
    row_ends = jnp.cumsum(inputs.q_lens) - 1
    last_token = inputs.token_ids[jnp.maximum(row_ends, 0)]
    target = jnp.where(live & inputs.grows, inputs.slot_ids, num_slots)  # B: dropped
    counts = jnp.zeros((num_slots,), jnp.int32).at[target].set(1, mode="drop")
    tokens = jnp.zeros((num_slots, 1), jnp.int32).at[target, 0].set(last_token, mode="drop")
    return counts, tokens


def apply_allowed(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """``logits`` (``f32[R, V]``) with the tokens ``allowed`` (``i32[R, ceil(V/32)]`` bitmask)
    does not allow set to -inf."""
    v = logits.shape[-1]
    ids = jnp.arange(v, dtype=jnp.uint32)
    words = allowed.astype(jnp.uint32)[:, ids // 32]  # [R, V]
    bits = (words >> (ids % 32)[None, :]) & jnp.uint32(1)  # unsigned: a logical shift
    return jnp.where(bits.astype(bool), logits, -jnp.inf)


def step(
    state: allocator.BlockState,
    kv: kv_cache.KVCache,
    params: Any,
    inputs: StepInputs,
    *,
    config: StepConfig,
) -> tuple[allocator.BlockState, kv_cache.KVCache, StepOutputs]:
    """One fused step (see the module docstring); jit it with ``state`` and ``kv`` donated.
    With ``inputs.decode_loop``, up to K decode iterations (:func:`paxcache.decode_loop.run`).

    Args:
      state: the allocator's block state (the rows' sequences already hold their slots).
      kv: the KV cache, device pages only (``[L, N, S, C, P, D]``).
      params: the model's parameters (``nnx.split(model)[1]``, maybe sharded).
      inputs: the step's :class:`StepInputs`, or them packed (:mod:`paxcache.packing`).
      config: static :class:`StepConfig`.

    Returns:
      ``(state, kv, outputs)``.
    """
    if isinstance(inputs, packing.PackedInputs):  # the engine's form: one transfer
        inputs = inputs.unpack()
    model = nnx.merge(config.graphdef, params)
    if inputs.decode_loop is not None:

        def iterate(state, kv, inputs, rows):
            state, kv, row_ok, sampled, _ = _iteration(state, kv, model, inputs, rows, config)
            return state, kv, row_ok, sampled

        state, kv, row_ok, sampled, steps = decode_loop.run(
            state, kv, inputs, iterate, config.num_logprobs
        )
        free = allocator.num_free_blocks(state)
        return state, kv, StepOutputs(sampled, row_ok, free, steps=steps)
    live = jnp.arange(inputs.slot_ids.shape[0]) < inputs.num_rows
    state, kv, row_ok, sampled, prompt = _iteration(state, kv, model, inputs, live, config)
    free = allocator.num_free_blocks(state)
    return state, kv, StepOutputs(sampled, row_ok, free, *prompt)


def _iteration(
    state: allocator.BlockState,
    kv: kv_cache.KVCache,
    model: Any,
    inputs: StepInputs,
    live: jax.Array,
    config: StepConfig,
) -> tuple[allocator.BlockState, kv_cache.KVCache, jax.Array, SampleOutput, tuple]:
    """The step's work on ``inputs`` for the rows ``live`` (``bool[R]``) marks: the others
    append, write and commit nothing. Returns ``(state, kv, row_ok bool[R], sampled,
    (prompt logprobs, prompt ranks) or (None, None))``."""
    num_slots = state.cfg.max_seqs
    live = live & (jnp.arange(inputs.slot_ids.shape[0]) < inputs.num_rows)
    if config.fuse_allocator:
        counts, new_tokens = _append_requests(inputs, live, num_slots)
        state, app = allocator.append(state, counts, new_tokens, commit=False)
        kv = kv_cache.apply_copies(
            kv, app.copy_src, app.copy_dst, impl=config.impl, interpret=config.interpret,
            mesh=config.mesh,
        )  # fmt: skip
        row_ok = app.ok[inputs.slot_ids] & live
    else:
        row_ok = live
    md = metadata_from_state(
        state, inputs.slot_ids, inputs.q_lens, inputs.num_rows, inputs.token_ids.shape[0],
        inputs.kv_lens, impl=config.impl, interpret=config.interpret, mesh=config.mesh,
    )  # fmt: skip
    # A refused row writes nothing (its blocks are not there).
    md = md.replace(slot_mapping=jnp.where(row_ok[md.row_seq], md.slot_mapping, -1))
    if inputs.decode_only:  # one token per row: the attention's decode kernel
        md = md.replace(max_q_len=1)
    if inputs.rope_lens is not None:  # a multi-step loop's later iterations outgrow it
        md = md.replace(rope_lens=jnp.maximum(inputs.kv_lens, inputs.rope_lens))
    s = inputs.sampling
    pl = inputs.prompt_logprobs
    rows = s.logits_rows if pl is None else jnp.concatenate([s.logits_rows, pl.rows])
    logits, pages = model.forward_paged(inputs.token_ids, kv.device, md, logits_indices=rows)
    kv = kv.replace(device=pages)
    prompt_out = prompt_rank = None
    if pl is not None:  # one forward: the samples' rows, then the prompt-logprob rows
        ns = s.logits_rows.shape[0]
        prompt_logits = logits[ns:].astype(jnp.float32)
        prompt_out = token_logprobs(prompt_logits, pl.targets, num_logprobs=config.num_logprobs)
        logp = jax.nn.log_softmax(prompt_logits, axis=-1)
        prompt_rank = 1 + jnp.sum(logp > prompt_out.logprob[:, None], axis=-1, dtype=jnp.int32)
        logits = logits[:ns]
    if inputs.allowed is not None:  # before sampling and logprobs: the constrained distribution
        logits = apply_allowed(logits.astype(jnp.float32), inputs.allowed)
    sampled = sample(
        logits, s.temperature, s.top_k, s.top_p, s.min_p, s.keys,
        num_logprobs=config.num_logprobs, logprobs_wanted=s.logprobs_wanted,
    )  # fmt: skip
    if config.fuse_allocator:
        # Blocks the rows filled become visible to prefix lookups (other slots: no change).
        target = jnp.where(row_ok, inputs.slot_ids, num_slots)
        computed = jnp.zeros((num_slots,), jnp.int32).at[target].set(inputs.kv_lens, mode="drop")
        state = allocator.commit(state, computed)
    return state, kv, row_ok, sampled, (prompt_out, prompt_rank)


class _TraceHook(threading.local):
    on_trace: Callable[[StepInputs], None] | None = None


_trace_hook = _TraceHook()


@contextlib.contextmanager
def tracing_for(on_trace: Callable[[StepInputs], None]) -> Iterator[None]:
    """Calls ``on_trace(inputs)`` whenever a call of a :func:`jitted_step` in this block (this
    thread) traces a new program: the engine that caused the trace counts and logs it."""
    previous, _trace_hook.on_trace = _trace_hook.on_trace, on_trace
    try:
        yield
    finally:
        _trace_hook.on_trace = previous


def _traced_step(*args: Any, config: StepConfig) -> Any:
    """:func:`step` on ``(state, kv, params, inputs)``, telling the trace hook first."""
    if _trace_hook.on_trace is not None:  # runs only while tracing: a new program
        inputs = args[3]
        packed = isinstance(inputs, packing.PackedInputs)
        _trace_hook.on_trace(inputs.structure() if packed else inputs)
    return step(*args, config=config)


@functools.lru_cache(maxsize=64)
def _shared_jit(config: StepConfig) -> Any:
    return jax.jit(functools.partial(_traced_step, config=config), donate_argnums=(0, 1))


def jitted_step(config: StepConfig) -> Any:
    """``jax.jit`` of :func:`step` bound to ``config``, ``state`` and ``kv`` donated: one per
    equal config in the process, so engines of the same model structure, kernels and mesh
    share its traced and compiled programs (a second engine of a model, with any block count
    or scheduling settings, traces only the shapes the first did not). The program depends
    on nothing but ``config`` and the arguments' shapes, dtypes and shardings, which are
    jit's cache key. A config that cannot be hashed gets a jit of its own."""
    try:
        hash(config)
    except TypeError:
        return jax.jit(functools.partial(_traced_step, config=config), donate_argnums=(0, 1))
    return _shared_jit(config)
