"""One completion of a request, as the scheduler accounts for it; and its stop conditions.

A :class:`Sequence` is plain host data. The scheduler (:mod:`paxcache.scheduler`) owns every
field but the text state at the end: its ``postprocess`` appends the tokens (and their
``logprobs``) and applies the stop conditions a token decides by itself (:func:`check_stop`);
the engine's ``OutputProcessor`` (:mod:`paxcache.outputs`) owns ``text``, ``emitted``,
``decoder`` and ``num_detokenized``: it detokenizes, finds stop strings (the scheduler then
ends those sequences, :meth:`~paxcache.scheduler.Scheduler.stop_at`) and builds the outputs.

Unified token accounting (prefill, chunked prefill, decode and recompute are one thing):
``token_ids`` holds the prompt followed by the generated tokens; ``num_computed`` of them have
their K/V in the cache; ``num_allocated`` of them are covered by the sequence's blocks (the
allocator's ``seq_lens`` of its slot). A step feeds ``token_ids[num_computed : num_computed +
q]``; when that reaches the end of ``token_ids`` the step also samples the next token.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Collection, Hashable
from typing import Any

from paxcache.config import CacheConfig
from paxcache.errors import SequenceTooLongError
from paxcache.sampling import SamplingParams

__all__ = [
    "SeqState",
    "Sequence",
    "check_prompt",
    "check_stop",
    "is_stop_token",
    "new_request",
    "reached_length",
    "stop_ids",
]


class SeqState:
    """Where a sequence is."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_arrival = itertools.count()


@dataclasses.dataclass(eq=False, repr=False)
class Sequence:
    """One completion of a request (``n`` of them for ``SamplingParams.n > 1``).

    Sequences compare and hash by identity: the block manager keys its slots by them.

    Attributes:
      request_id: the owning request.
      index: completion index ``j`` in ``0..n-1``.
      token_ids: prompt followed by generated tokens.
      num_prompt: prompt length (original prompt, not counting generated tokens).
      params: the request's sampling parameters.
      seed: the request's seed (fixed at arrival).
      cache_salt: the request's tenant key for the prefix cache (any hashable, None = none).
      arrival: arrival order (ties broken by index): the age order of every scheduling rule.
      arrival_time: ``time.monotonic()`` when the request arrived.
      group: every sequence of the request (shared list, ``index`` order).
      state: a :class:`SeqState` value.
      num_computed: tokens whose K/V is in the cache.
      num_allocated: tokens covered by the sequence's blocks.
      followers: sequences forked from this one at admission (``n > 1``). While one still
        waits for this sequence's prompt (its ``leader`` is this sequence) it has no rows of
        its own and is preempted and resumed with it; after the first sample it is independent.
      leader: the sequence this one follows, while it waits.
      shared_last: its last, partially filled block may be shared with a sibling (just
        forked): its next write may copy on write.
      num_preemptions: times this sequence was preempted (swap or recompute).
      preempted_at: the scheduler's departure count when it was last preempted (rule R5).
      rope_long: its K/V in the cache were computed for a sequence longer than the model's
        longrope switch length (``Scheduler.rope_switch_len``): with the long factors.
      num_cached_tokens: prompt tokens found in the prefix cache at its first admission
        (None until admitted).
      finish_reason: None while live, else ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``.
      error: why it failed, when ``finish_reason == "error"``.
      text: detokenized output so far (ends before a matched stop string).
      emitted: characters of ``text`` already reported.
      logprobs: per generated token, when the request asked for logprobs (else None): as the
        step returned it, ``(token_id, logprob, top_ids, top_logprobs)``, until the output
        processor formats it as ``{"token_id", "logprob", "top"}``.
      prompt_logprobs: the leader of a request with ``params.prompt_logprobs``: one entry per
        prompt token, ``None`` for the first and for those not computed yet, else
        ``{"token_id", "logprob", "rank", "top"}``; None otherwise.
      decoder: the incremental detokenizer (``push(id) -> str``, ``flush() -> str``).
      num_detokenized: generated tokens the output processor has taken into ``text`` (a
        token that ended the sequence by itself counts, untaken).
      ends_on_stop_token: its last token ended it by itself (EOS or a stop token id): that
        token is not detokenized.
      stop_reason: vLLM's: the stop token id or stop string that ended it (None for EOS and
        every other finish).
      new_ids: tokens generated in the current step (cleared once reported).
      matcher: its grammar state (:class:`paxcache.grammar.Matcher`) when the request is
        constrained, else None. It has consumed exactly the generated tokens, so preemption
        (recompute or swap, which keep ``token_ids``) leaves it consistent.
      stop_cache: :func:`stop_ids`' answer, made at its first call.
    """

    request_id: str
    index: int
    token_ids: list[int]
    num_prompt: int
    params: SamplingParams
    seed: int
    cache_salt: Hashable | None = None
    arrival: int = dataclasses.field(default_factory=lambda: next(_arrival))
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    group: list[Sequence] = dataclasses.field(default_factory=list)
    state: str = SeqState.WAITING
    num_computed: int = 0
    num_allocated: int = 0
    followers: list[Sequence] = dataclasses.field(default_factory=list)
    leader: Sequence | None = None
    shared_last: bool = False
    num_preemptions: int = 0
    preempted_at: int = -1
    rope_long: bool = False
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    # Output state.
    text: str = ""
    emitted: int = 0
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None
    decoder: Any = None
    num_detokenized: int = 0
    ends_on_stop_token: bool = False
    stop_reason: int | str | None = None
    new_ids: list[int] = dataclasses.field(default_factory=list)
    matcher: Any = None
    # (the EOS ids and params it was made for, the ids, the ids as a frozenset)
    stop_cache: tuple[Any, Any, tuple[int, ...], frozenset[int]] | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}#{self.index}, {self.state}, "
            f"tokens={len(self.token_ids)}, computed={self.num_computed})"
        )

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

    def finish(self, reason: str, error: str | None = None) -> None:
        """Marks the sequence finished (a finished one keeps its first reason)."""
        if self.is_finished:
            return
        self.state = SeqState.FINISHED
        self.finish_reason = reason
        self.error = error


PROMPT_LOGPROBS_SALT = "paxcache:prompt_logprobs"
"""First item of the cache salt of a request with ``prompt_logprobs`` (see
:func:`new_request`)."""


def new_request(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    seed: int,
    cache_salt: Hashable | None = None,
    make_decoder: Callable[[], Any] = lambda: None,
    make_matcher: Callable[[], Any] = lambda: None,
) -> list[Sequence]:
    """The ``params.n`` sequences of a new request, in index order (each with its own
    decoder and, for a constrained request, its own grammar matcher).

    The first is the leader; the others follow it (they wait for its prompt, are admitted
    with it by forking its blocks, and sample their first token from its last prompt row),
    and share its arrival, so the request is one unit in the age order.

    A request with ``params.prompt_logprobs`` computes every prompt token (the log-probability
    of a token comes from the logits at the one before it, which a prefix-cache hit skips): it
    gets a cache salt of its own, ``(PROMPT_LOGPROBS_SALT, request_id, cache_salt)``, so its
    lookups miss and nothing else reads its blocks (recompute, as vLLM does).
    """
    if params.prompt_logprobs is not None:
        cache_salt = (PROMPT_LOGPROBS_SALT, request_id, cache_salt)
    seqs = [
        Sequence(
            request_id=request_id,
            index=j,
            token_ids=list(prompt_ids),
            num_prompt=len(prompt_ids),
            params=params,
            seed=seed,
            cache_salt=cache_salt,
            logprobs=[] if params.logprobs is not None else None,
            decoder=make_decoder(),
            matcher=make_matcher(),
        )
        for j in range(params.n)
    ]
    lead = seqs[0]
    if params.prompt_logprobs is not None:
        lead.prompt_logprobs = [None] * len(prompt_ids)
    lead.followers = seqs[1:]
    for f in seqs[1:]:
        f.leader = lead
        f.arrival, f.arrival_time = lead.arrival, lead.arrival_time
    return seqs


def is_stop_token(params: SamplingParams, tok: int, eos_ids: Collection[int]) -> bool:
    """Whether ``tok`` ends a sequence of ``params`` by itself: EOS (unless ``ignore_eos``) or
    one of its stop token ids (neither is detokenized)."""
    return (tok in eos_ids and not params.ignore_eos) or tok in (params.stop_token_ids or ())


def stop_ids(seq: Sequence, eos_ids: Collection[int]) -> tuple[tuple[int, ...], frozenset[int]]:
    """The token ids that end ``seq`` by themselves (:func:`is_stop_token`: EOS, sorted, unless
    ``ignore_eos``, then its ``stop_token_ids``), as a tuple and as a frozenset; made once
    per sequence (for one ``eos_ids`` object and ``params``)."""
    cache, p = seq.stop_cache, seq.params
    if cache is not None and cache[0] is eos_ids and cache[1] is p:
        return cache[2], cache[3]
    eos = [] if p.ignore_eos else sorted(int(t) for t in eos_ids)
    ids = (*eos, *(int(t) for t in p.stop_token_ids or ()))
    seq.stop_cache = (eos_ids, p, ids, frozenset(ids))
    return ids, seq.stop_cache[3]


def reached_length(seq: Sequence, max_model_len: int, more: int = 0) -> bool:
    """Whether ``seq``, with ``more`` tokens yet to append, has ``max_tokens`` generated or
    ``max_model_len`` tokens (a ``"length"`` finish)."""
    generated, total = seq.num_generated + more, len(seq.token_ids) + more
    return generated >= seq.params.max_tokens or total >= max_model_len


def check_stop(seq: Sequence, tok: int, eos_ids: Collection[int], max_model_len: int) -> None:
    """Finishes ``seq`` if ``tok`` (just appended to it) ends it by itself: EOS (unless
    ``ignore_eos``) or a stop token id (``"stop"``; that token is not detokenized:
    ``ends_on_stop_token``), a grammar that can take no more tokens (``"stop"``),
    ``max_tokens`` generated or ``max_model_len`` reached (both ``"length"``). Stop strings
    need the text: the output processor finds them (:meth:`paxcache.outputs.OutputProcessor.
    detokenize`).

    Raises:
      ValueError: the token is outside the sequence's grammar (its matcher refused it).
    """
    p = seq.params
    if seq.matcher is not None and not seq.matcher.consume(tok):
        raise ValueError(f"token {tok} is not allowed by the grammar: {seq.matcher.error}")
    if is_stop_token(p, tok, eos_ids):
        seq.ends_on_stop_token = True
        if not (tok in eos_ids and not p.ignore_eos):  # a stop token id: vLLM reports it
            seq.stop_reason = tok
        seq.finish("stop")
    elif seq.matcher is not None and seq.matcher.is_stopped():
        seq.finish("stop")
    elif reached_length(seq, max_model_len):
        seq.finish("length")


def check_prompt(
    ids: Collection[int], *, vocab_size: int, max_model_len: int, cache_config: CacheConfig
) -> None:
    """Checks that a prompt of token ``ids`` can ever run.

    Raises:
      ValueError: empty, or ids outside ``[0, vocab_size)``.
      SequenceTooLongError: it leaves no room to generate within ``max_model_len``, or needs
        more blocks than the cache can ever admit.
    """
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise SequenceTooLongError(
            f"prompt of {len(ids)} tokens leaves no room to generate: max_model_len is "
            f"{max_model_len}"
        )
    need = cache_config.blocks_for(len(ids) + 1)
    admit = cache_config.num_blocks - cache_config.watermark_blocks
    if need > admit:
        raise SequenceTooLongError(
            f"prompt of {len(ids)} tokens needs {need} KV blocks but the cache can admit at "
            f"most {admit}"
        )
