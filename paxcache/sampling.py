"""Sampling parameters and a jit-compiled, batched sampler.

``SamplingParams`` describes how one request picks its next tokens (vLLM-style field names).
``sample`` turns a batch of logits ``f32[B, V]`` into tokens, with every row carrying its own
temperature, top-k, top-p, min-p and PRNG key, so rows with different settings share one compiled
call and no Python loop runs over rows.

Randomness is per request, never per batch: the key of a row is derived on the host by
``request_key(seed, step, index)`` from the request's seed, the number of tokens that completion
has generated so far, and the completion index ``j`` (for ``n > 1``). A request's samples
therefore do not depend on its batch position or on what else is in the batch.

Keys are passed to ``sample`` as raw ``threefry2x32`` key data, ``u32[B, 2]`` (what
``jax.random.key_data`` returns for a threefry key); typed key arrays (``jax.random.key``) of
shape ``[B]`` are accepted too.

Filter semantics (as in vLLM): temperature scales the logits first; then top-k keeps the ``k``
largest; top-p keeps the smallest prefix of the sorted distribution (renormalized after top-k)
whose mass reaches ``p``; min-p keeps tokens whose probability is at least ``min_p`` times the
most likely token's; tokens tied with the last one a filter keeps are kept too. The filters are
per-row thresholds found by bisection (no sort over the vocabulary), and they are skipped when
no row in the batch uses them. A row with ``temperature <= GREEDY_EPS`` is greedy (argmax of
the raw logits, lowest id on ties). Reported log-probabilities are the log-softmax of the *raw*
logits (before temperature and filters), as vLLM reports them.
"""

from __future__ import annotations

import dataclasses
import json as _json
import math
import numbers
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GREEDY_EPS",
    "MAX_LOGPROBS",
    "MAX_N",
    "OUTPUT_KINDS",
    "SampleOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "pack_params",
    "random_seed",
    "request_key",
    "request_keys",
    "sequence_keys",
    "sample",
    "token_logprobs",
]

GREEDY_EPS = 1e-5
"""Temperatures at or below this are treated as 0 (greedy); avoids overflow in ``logits / T``."""

MAX_N = 64
"""Largest allowed ``n`` (completions per request)."""

MAX_LOGPROBS = 20
"""Largest allowed ``logprobs`` (top log-probabilities per token), as in OpenAI's API."""

OUTPUT_KINDS = ("cumulative", "delta")
"""``SamplingParams.output_kind`` values: every ``RequestOutput`` carries the whole output so
far (``"cumulative"``), or only what is new since the previous one (``"delta"``)."""

_U64 = (1 << 64) - 1
_I32_MAX = (1 << 31) - 1
_SEED_MIN, _SEED_MAX = -(1 << 63), _U64


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (exactly one field set), enforced by
    :mod:`paxcache.grammar` with a per-token mask applied inside the step.

    Attributes:
      json: a JSON schema (a dict, or its JSON text): the output is one JSON value that
        validates against it.
      json_object: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
      regex: the output matches this regular expression (whole).
      grammar: a Lark grammar (llguidance's dialect) the output must derive.

    Raises:
      ValueError: none or several fields set, or a field of the wrong type.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                f"got {type(self.json).__name__}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
            )
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {v!r}")
        chosen = [k for k in ("json", "regex", "grammar") if getattr(self, k) is not None]
        chosen += ["json_object"] if self.json_object else []
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, grammar; "
                f"got {chosen or 'none'}"
            )

    def key(self) -> str:
        """A canonical string of the constraint (equal constraints, equal keys)."""
        return _json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completions.

    Attributes:
      max_tokens: most tokens to generate per completion, in [1, 2**31 - 1].
      temperature: softmax temperature (>= 0, finite); 0 means greedy.
      top_k: keep only the ``top_k`` most likely tokens, in [0, 2**31 - 1]; 0 turns the filter
        off (a ``top_k`` at or above the vocabulary size keeps every token).
      top_p: nucleus sampling mass in (0, 1]; 1 turns the filter off.
      min_p: keep tokens with probability >= ``min_p`` * max probability, in [0, 1]; 0 is off.
      seed: per-request seed for reproducible sampling, an int in [-2**63, 2**64 - 1];
        ``None`` draws a fresh one.
      stop: stop string(s), matched on detokenized text; the returned text ends before the
        match. Normalized to a tuple of non-empty strings (``None`` -> ``()``).
      stop_token_ids: token ids that end a completion (the id is kept in ``token_ids``), each
        in [0, 2**31 - 1]. Normalized to a tuple of ints (``None`` -> ``()``).
      n: number of completions for the prompt, in [1, ``MAX_N``].
      logprobs: ``None`` for no log-probabilities; an int in [0, ``MAX_LOGPROBS``] reports the
        sampled token's log-probability plus that many top alternatives per token.
      ignore_eos: keep generating past the tokenizer's EOS token.
      output_kind: ``"cumulative"`` (every output holds the whole completion so far) or
        ``"delta"`` (only the tokens, text and logprobs new since the previous output; what a
        streaming server wants: linear, not quadratic, in the output length).
      prompt_logprobs: ``None`` (off), or an int in [0, ``MAX_LOGPROBS``]: the
        log-probability of every prompt token given the tokens before it, plus that many top
        alternatives (vLLM's semantics; the first prompt token has none). Computed in the
        prefill the request runs anyway; such a request does not read the prefix cache (every
        prompt token is computed), see ``RequestOutput.prompt_logprobs``.
      structured_outputs: constrain the output (JSON schema, any JSON object, regex, Lark
        grammar): :class:`StructuredOutputsParams`, or its fields as a dict; ``None`` for free
        text. Needs the ``llguidance`` package (the ``structured`` extra). The reported
        logprobs of a constrained request are those of the constrained distribution (the
        disallowed tokens' logits set to -inf before the log-softmax).

    Every bound is what the engine can represent (int32 token ids and counts, 64-bit seeds,
    finite floats); a server sets tighter limits of its own.

    Raises:
      ValueError: naming the offending field, for any out-of-range or wrongly typed value.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    n: int = 1
    logprobs: int | None = None
    ignore_eos: bool = False
    output_kind: str = "cumulative"
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= _I32_MAX:
            raise ValueError(
                f"max_tokens must be an int in [1, {_I32_MAX}], got {self.max_tokens!r}"
            )
        if (
            not _is_real(self.temperature)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= _I32_MAX:
            raise ValueError(
                f"top_k must be an int in [0, {_I32_MAX}] (0 = off), got {self.top_k!r}"
            )
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (
            not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX
        ):
            raise ValueError(
                f"seed must be None or an int in [-2**63, 2**64 - 1], got {self.seed!r}"
            )
        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS)
        ):
            raise ValueError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got "
                f"{self.prompt_logprobs!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")

        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, (list, tuple)):
            ids = tuple(ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of ints or None, got {ids!r}")
        for t in ids:
            if not _is_int(t) or not 0 <= t <= _I32_MAX:
                raise ValueError(f"stop_token_ids must be ints in [0, {_I32_MAX}], got {t!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))

        so = self.structured_outputs
        if isinstance(so, dict):  # e.g. from JSON (the multi-host wire)
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, a dict or None, got "
                f"{type(so).__name__}"
            )
        object.__setattr__(self, "structured_outputs", so)

    @property
    def greedy(self) -> bool:
        """True when the request samples by argmax (temperature ~ 0)."""
        return self.temperature <= GREEDY_EPS


class SampleOutput(NamedTuple):
    """Result of ``sample`` for a batch of ``B`` rows and ``k = num_logprobs`` alternatives.

    Attributes:
      tokens: i32[B] sampled token ids.
      logprob: f32[B] log-softmax of the raw logits at the sampled token.
      top_ids: i32[B, k] the ``k`` most likely token ids under the raw logits, best first.
      top_logprobs: f32[B, k] their log-probabilities.
    """

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


# ----------------------------------------------------------------------------------------------
# Host-side key derivation.


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorized SplitMix64 finalizer on uint64 (wrap-around arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def request_keys(
    seeds: Sequence[int] | np.ndarray,
    steps: Sequence[int] | np.ndarray,
    indices: Sequence[int] | np.ndarray,
) -> np.ndarray:
    """Batched ``request_key``: ``u32[B, 2]`` raw threefry keys, one per row.

    Args:
      seeds: [B] request seeds (any Python ints; taken modulo 2**64).
      steps: [B] tokens generated so far by each row's completion.
      indices: [B] completion index ``j`` in ``0..n-1``.

    Returns:
      u32[B, 2] keys, a pure function of each row's ``(seed, step, index)``.
    """
    if isinstance(seeds, np.ndarray) and seeds.dtype == np.uint64:
        s = seeds.ravel()
    else:  # Python ints, exactly: np.ravel of a list mixing ints past 2**63 makes floats
        flat = seeds.ravel().tolist() if isinstance(seeds, np.ndarray) else seeds
        s = np.asarray([int(v) & _U64 for v in flat], dtype=np.uint64)
    t = np.asarray(steps, dtype=np.int64).ravel().astype(np.uint64)
    j = np.asarray(indices, dtype=np.int64).ravel().astype(np.uint64)
    if not (s.shape == t.shape == j.shape):
        raise ValueError(
            f"seeds, steps and indices must have the same length, got {s.shape}, {t.shape}, "
            f"{j.shape}"
        )
    h = _splitmix64(s)
    h = _splitmix64(h ^ t)
    h = _splitmix64(h ^ (j * np.uint64(0x632BE59BD9B4E019)))
    hi = (h >> np.uint64(32)).astype(np.uint32)
    lo = (h & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return np.stack([hi, lo], axis=-1)


def sequence_keys(
    seqs: Sequence[Any],
    num_rows: int,
    ahead: Sequence[int] = (0,),
    *,
    zeros_if_greedy: bool = False,
) -> np.ndarray:
    """``u32[len(ahead), num_rows, 2]``: for each ``a`` in ``ahead``, row ``j``'s key for the
    sample ``a`` tokens after the next one of ``seqs[j]`` (its ``seed``, ``num_generated``
    and ``index``: :func:`request_keys`' rule); rows past ``len(seqs)`` are padding.

    With ``zeros_if_greedy``, a batch whose every sequence samples greedily (``params.greedy``)
    gets zeros: :func:`sample` reads no key of a greedy row, so the step's tokens are the same
    and the host skips the hashing (a step's inputs)."""
    if zeros_if_greedy and all(seq.params.greedy for seq in seqs):
        return np.zeros((len(ahead), num_rows, 2), np.uint32)
    seeds = np.zeros(num_rows, np.uint64)
    generated = np.zeros(num_rows, np.int64)
    index = np.zeros(num_rows, np.int64)
    n = len(seqs)
    seeds[:n] = [seq.seed & _U64 for seq in seqs]
    generated[:n] = [seq.num_generated for seq in seqs]
    index[:n] = [seq.index for seq in seqs]
    k = len(ahead)
    steps = generated[None, :] + np.asarray(ahead, np.int64)[:, None]  # [k, R]
    keys = request_keys(np.tile(seeds, k), steps.ravel(), np.tile(index, k))
    return keys.reshape(k, num_rows, 2)


def request_key(seed: int, step: int, index: int = 0) -> np.ndarray:
    """The PRNG key for one sampling step of one completion: ``u32[2]`` raw threefry key data.

    Args:
      seed: the request's seed (``SamplingParams.seed``, or ``random_seed()`` when it is None).
      step: number of tokens this completion has generated so far.
      index: completion index ``j`` for ``n > 1``.

    Returns:
      u32[2]; the same inputs always give the same key, whatever else is in the batch.
    """
    return request_keys([seed], [step], [index])[0]


def random_seed() -> int:
    """A fresh 63-bit seed for requests that did not set one."""
    return secrets.randbits(63)


def pack_params(
    params: Sequence[SamplingParams], batch_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-row filter arrays for ``sample``, padded with greedy rows to ``batch_size``.

    Args:
      params: one ``SamplingParams`` per row (repeat a request's params for each of its rows).
      batch_size: pad to this many rows (default ``len(params)``).

    Returns:
      ``(temperature f32[B], top_k i32[B], top_p f32[B], min_p f32[B])`` numpy arrays.
    """
    b = len(params) if batch_size is None else batch_size
    if b < len(params):
        raise ValueError(f"batch_size {b} is smaller than the number of rows {len(params)}")
    temperature = np.zeros(b, np.float32)
    top_k = np.zeros(b, np.int32)
    top_p = np.ones(b, np.float32)
    min_p = np.zeros(b, np.float32)
    for i, p in enumerate(params):
        temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
    return temperature, top_k, top_p, min_p


# ----------------------------------------------------------------------------------------------
# Device-side sampler.


def _as_typed_keys(keys: jax.Array) -> jax.Array:
    if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        return keys
    if keys.ndim != 2 or keys.shape[-1] != 2:
        raise ValueError(f"keys must be u32[B, 2] raw threefry key data, got shape {keys.shape}")
    return jax.random.wrap_key_data(keys.astype(jnp.uint32), impl="threefry2x32")


def _order_key(x: jax.Array) -> jax.Array:
    """f32 -> u32 with the same order (``a < b`` iff ``key(a) < key(b)``, NaN aside)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    flipped = bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))  # negatives: reverse their order
    return jax.lax.bitcast_convert_type(flipped, jnp.uint32) ^ jnp.uint32(0x80000000)


def _largest_threshold(
    lo: jax.Array, hi: jax.Array, ok: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """Per row, the largest ``t`` in ``[lo, hi]`` with ``ok(t)``, by bisection on u32 keys.

    ``ok(t)`` (bool[B] for t u32[B]) must be monotone (true up to some t*, false after) and
    true at ``lo``. 32 halvings of a u32 interval are exact.
    """

    def body(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        gap = hi - lo
        mid = lo + gap // 2 + gap % 2  # ceil((lo + hi) / 2) without u32 overflow
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, jnp.maximum(lo, hi)))
    return lo


def _filtered_sample(
    scaled: jax.Array, gumbel: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    """Samples with top-k / top-p / min-p filters. scaled, gumbel: f32[B, V] -> i32[B].

    Sort-free: each filter becomes a per-row threshold on the logits, found by bisection over
    their order-preserving u32 keys (a few dozen masked reductions over ``[B, V]`` instead of a
    sort; ties at a threshold are all kept). Same semantics as ``_filtered_sample_sorted``.
    """
    v = scaled.shape[-1]
    key = _order_key(scaled)  # u32[B, V]
    k_min = jnp.min(key, axis=-1)
    k_max = jnp.max(key, axis=-1)
    # top-k: the largest t with #{key >= t} >= k (k_min for a row without one). Each search
    # is 32 masked passes over [B, V]: a batch where no row has the filter skips it.
    k = jnp.where(top_k <= 0, v, jnp.minimum(top_k, v))
    t_k = jax.lax.cond(
        jnp.any(k < v),
        lambda: _largest_threshold(k_min, k_max, lambda t: jnp.sum(key >= t[:, None], -1) >= k),
        lambda: k_min,
    )

    def nucleus() -> jax.Array:
        # top-p over the distribution renormalized after top-k: the largest t whose kept mass
        # reaches top_p of the top-k mass (the smallest most-likely set with that mass).
        probs = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
        mass_k = jnp.sum(jnp.where(key >= t_k[:, None], probs, 0.0), axis=-1)
        target = top_p * mass_k
        t_p = _largest_threshold(
            t_k,
            k_max,
            lambda t: jnp.sum(jnp.where(key >= t[:, None], probs, 0.0), axis=-1) >= target,
        )
        return jnp.where(top_p >= 1.0, t_k, t_p)

    t = jax.lax.cond(jnp.any(top_p < 1.0), nucleus, lambda: t_k)
    keep = key >= t[:, None]
    # min-p: p_i >= min_p * p_max  <=>  logit_i - logit_max >= log(min_p). Ratios are unchanged
    # by renormalization, so the order of filters does not matter for this one.
    log_min_p = jnp.log(jnp.maximum(min_p, 0.0))[:, None]  # log(0) = -inf: keeps everything
    keep &= (scaled - jnp.max(scaled, axis=-1, keepdims=True)) >= log_min_p
    # Gumbel noise is indexed by token id, as in the unfiltered path, so a row whose filters
    # keep everything samples the same token on either path.
    return jnp.argmax(jnp.where(keep, scaled + gumbel, -jnp.inf), axis=-1).astype(jnp.int32)


def _filtered_sample_sorted(
    scaled: jax.Array, gumbel: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    """Oracle for ``_filtered_sample``: the same filters by a full sort (O(V log V) per row).

    Kept for tests; ``sample`` uses the sort-free threshold search.
    """
    v = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1, stable=True)  # i32[B, V], most likely first
    s_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v, dtype=jnp.int32)[None, :]
    k = jnp.where(top_k <= 0, v, jnp.minimum(top_k, v))[:, None]
    keep = rank < k
    # top-p on the distribution renormalized after top-k: keep while the mass *before* a token
    # is below p (so the first token is always kept).
    masked = jnp.where(keep, s_logits, -jnp.inf)
    probs = jax.nn.softmax(masked, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < top_p[:, None]
    keep = keep.at[:, 0].set(True)
    # min-p: p_i >= min_p * p_max  <=>  logit_i - logit_max >= log(min_p). Ratios are unchanged
    # by renormalization, so the order of filters does not matter for this one.
    log_min_p = jnp.log(jnp.maximum(min_p, 0.0))[:, None]  # log(0) = -inf: keeps everything
    keep &= (s_logits - s_logits[:, :1]) >= log_min_p
    # Gumbel noise is indexed by token id (not rank) so that a row samples the same token here as
    # in the unfiltered path whenever its filters keep everything.
    noisy = jnp.where(keep, s_logits + jnp.take_along_axis(gumbel, order, axis=-1), -jnp.inf)
    pos = jnp.argmax(noisy, axis=-1)
    return jnp.take_along_axis(order, pos[:, None], axis=-1)[:, 0].astype(jnp.int32)


@partial(jax.jit, static_argnames=("num_logprobs",))
def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    keys: jax.Array,
    num_logprobs: int = 0,
    logprobs_wanted: jax.Array | None = None,
) -> SampleOutput:
    """Samples one token per row, each row with its own settings and key.

    Args:
      logits: f32[B, V] (other float dtypes are upcast to f32).
      temperature: f32[B]; rows with ``temperature <= GREEDY_EPS`` take the argmax.
      top_k: i32[B]; 0 (or negative) = off.
      top_p: f32[B] in (0, 1]; 1 = off.
      min_p: f32[B] in [0, 1]; 0 = off.
      keys: u32[B, 2] raw threefry key data (see ``request_keys``) or typed keys ``key<fry>[B]``.
      num_logprobs: static number ``k`` of top log-probabilities to return per row.
      logprobs_wanted: optional ``bool[]``, whether any row reports logprobs: when False the
        log-softmax and the top-``k`` search (a sort-like pass over ``[B, V]``) are skipped
        and ``logprob``, ``top_ids`` and ``top_logprobs`` are zeros. None: always computed.

    Returns:
      ``SampleOutput(tokens i32[B], logprob f32[B], top_ids i32[B, k], top_logprobs f32[B, k])``.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    temperature = jnp.asarray(temperature, jnp.float32).reshape(b)
    top_k = jnp.asarray(top_k, jnp.int32).reshape(b)
    top_p = jnp.asarray(top_p, jnp.float32).reshape(b)
    min_p = jnp.asarray(min_p, jnp.float32).reshape(b)
    typed = _as_typed_keys(keys)

    greedy_rows = temperature <= GREEDY_EPS
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled() -> jax.Array:
        t = jnp.where(greedy_rows, 1.0, temperature)[:, None]
        scaled = logits / t
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(typed)
        needs_filter = jnp.any(
            ~greedy_rows & (((top_k > 0) & (top_k < v)) | (top_p < 1.0) | (min_p > 0.0))
        )
        tok = jax.lax.cond(
            needs_filter,
            lambda: _filtered_sample(scaled, gumbel, top_k, top_p, min_p),
            lambda: jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32),
        )
        return jnp.where(greedy_rows, greedy_tok, tok)

    tokens = jax.lax.cond(jnp.all(greedy_rows), lambda: greedy_tok, sampled)

    return token_logprobs(logits, tokens, num_logprobs=num_logprobs, wanted=logprobs_wanted)


def token_logprobs(
    logits: jax.Array,
    tokens: jax.Array,
    *,
    num_logprobs: int,
    wanted: jax.Array | None = None,
) -> SampleOutput:
    """Log-probabilities of given tokens under raw logits (no temperature or filters), with
    each row's top ``num_logprobs``; traceable (``sample`` and the step's prompt logprobs).

    Args:
      logits: ``f32[B, V]`` (any float dtype; computed in f32).
      tokens: ``i32[B]`` the token whose log-probability each row reports.
      num_logprobs: static ``k``.
      wanted: optional ``bool[]``, whether any row reads them: False skips the log-softmax
        over ``[B, V]`` and the top-``k`` search (a runtime ``lax.cond``), giving zeros.
        None: always computed.

    Returns:
      ``SampleOutput(tokens, logprob f32[B], top_ids i32[B, k], top_logprobs f32[B, k])``.
    """
    b, v = logits.shape
    k = max(0, min(num_logprobs, v))

    def computed() -> tuple[jax.Array, jax.Array, jax.Array]:
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        logprob = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
        if k == 0:
            return logprob, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
        top_logprobs, top_ids = jax.lax.top_k(logp, k)
        return logprob, top_ids.astype(jnp.int32), top_logprobs

    def skipped() -> tuple[jax.Array, jax.Array, jax.Array]:
        zeros = jnp.zeros((b, k), jnp.float32)
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, k), jnp.int32), zeros

    if wanted is None:
        logprob, top_ids, top_logprobs = computed()
    else:  # a batch where no row reports logprobs skips the passes over the vocabulary
        logprob, top_ids, top_logprobs = jax.lax.cond(
            jnp.asarray(wanted, bool).reshape(()), computed, skipped
        )
    return SampleOutput(tokens, logprob, top_ids, top_logprobs)
