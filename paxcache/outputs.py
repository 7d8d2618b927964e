"""Request and completion outputs returned by the engine (vLLM-compatible field names), the
engine's per-request record that builds them (:class:`RequestState`), and the one output
processor (:class:`OutputProcessor`): detokenization, stop strings, logprob entries, deltas."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

INTERNAL_ERROR = "internal error while processing this request"
"""``RequestOutput.error`` of a request that failed inside the engine (the details are logged,
never reported: they may hold paths or internals)."""


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions.

    Attributes:
      index: which of the ``n`` completions this is.
      token_ids: every generated token so far (cumulative); with
        ``SamplingParams(output_kind="delta")`` only the tokens new since the previous output.
      text: the detokenized text so far, ending before a matched stop string (delta: the new
        text only).
      finish_reason: ``None`` while running, else ``"stop"``, ``"length"``, ``"abort"`` or
        ``"error"``.
      logprobs: per generated token, ``{"token_id", "logprob", "top": [(id, logprob), ...]}``
        when the request asked for logprobs, else ``None`` (delta: the new tokens' entries).
      new_token_ids: the tokens generated in the step that produced this output.
      new_text: the text added in the step that produced this output.
      stop_reason: the stop token id or stop string that ended the completion (vLLM's
        field; None for EOS, a length finish and while running).
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict] | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """Everything known about one request after a step (or at the end of ``generate``).

    Attributes:
      request_id: the id given to ``add_request``.
      prompt: the prompt text (``None`` for a token-id prompt).
      prompt_token_ids: the prompt's tokens (one list, shared by all of the request's outputs).
      outputs: the completions (with ``output_kind="delta"``, possibly only those that
        progressed).
      finished: no more outputs will come for this request.
      error: why the request failed, if it did (its completions finish with ``"error"``).
      num_cached_tokens: prompt tokens served from the prefix cache at admission (``None``
        until the request is admitted); OpenAI's ``usage.prompt_tokens_details.cached_tokens``.
      num_preemptions: times a completion of this request was preempted so far (swap or
        recompute; a prompt shared by waiting completions counts once per completion).
      prompt_logprobs: with ``SamplingParams.prompt_logprobs``, vLLM's shape: one entry per
        prompt token, ``None`` for the first, then ``{"token_id", "logprob", "rank", "top":
        [(id, logprob), ...]}`` (the token given the ones before it, its rank in that
        distribution, 1 = most likely, and the top ``prompt_logprobs`` alternatives); set
        once the whole prompt is computed (with ``output_kind="delta"``: in that one output
        only). None otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    prompt_logprobs: list[dict | None] | None = None


class RequestState:
    """The engine's record of one live request: its sequences (each a
    :class:`paxcache.sequence.Sequence`) and what its outputs have reported so far.

    Args:
      request_id: the id given to ``add_request``.
      prompt: the prompt text (None for token ids).
      prompt_ids: the prompt's tokens.
      params: its ``SamplingParams``.
      seqs: its ``n`` sequences, in index order.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: Any,
        seqs: list[Any],
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_ids)  # every output shares this one list
        self.params = params
        self.seqs = seqs
        # output_kind="delta": tokens / logprobs of each completion already reported.
        self.sent_tokens = [0] * len(seqs)
        self.sent_logprobs = [0] * len(seqs)
        self.formatted_logprobs = [0] * len(seqs)  # entries of each seq's logprobs formatted
        self.sent_prompt_logprobs = False
        self.prompt_logprobs_ready = False
        # Characters of text held back: a stop string's length less one.
        self._hold = max((len(s) for s in params.stop or ()), default=1) - 1
        self._delta = params.output_kind == "delta"

    def _format_logprobs(self, i: int, entries: list) -> None:
        """Sequence ``i``'s logprob entries as the step returned them, ``(token_id, logprob,
        top_ids, top_logprobs)``, formatted in place as ``{"token_id", "logprob", "top":
        [(id, logprob), ...]}`` (the top ``params.logprobs``; a constrained row's disallowed
        tokens have -inf and are not reported)."""
        k = self.params.logprobs or 0
        for e in range(self.formatted_logprobs[i], len(entries)):
            tok, lp, top_ids, top_lps = entries[e]
            top = [(int(top_ids[r]), float(top_lps[r])) for r in range(k)]
            entries[e] = {
                "token_id": int(tok),
                "logprob": float(lp),
                "top": [t for t in top if t[1] > float("-inf")],
            }
        self.formatted_logprobs[i] = len(entries)

    def output(self, *, finished: bool) -> RequestOutput:
        """The request's output now (cumulative, or only what is new with
        ``output_kind="delta"``); text that may still turn out to be the start of a stop
        string is held back until it cannot."""
        comps = []
        hold, delta, seqs = self._hold, self._delta, self.seqs
        for i, s in enumerate(seqs):
            if s.logprobs is not None:
                self._format_logprobs(i, s.logprobs)
            text, emitted = s.text, s.emitted
            text_len = len(text)
            visible = text_len if s.is_finished else max(emitted, text_len - hold)
            new_text = text[emitted:visible] if visible > emitted else ""
            s.emitted = visible
            if delta:  # only what is new: linear in the output length, however long
                start = s.num_prompt + self.sent_tokens[i]
                token_ids = s.token_ids[start:]
                self.sent_tokens[i] += len(token_ids)
                logprobs = None
                if s.logprobs is not None:
                    logprobs = s.logprobs[self.sent_logprobs[i] :]
                    self.sent_logprobs[i] = len(s.logprobs)
                text = new_text
            else:
                token_ids = s.token_ids[s.num_prompt :]  # a copy
                logprobs = list(s.logprobs) if s.logprobs is not None else None
                if visible != text_len:
                    text = text[:visible]
            comps.append(
                CompletionOutput(
                    s.index,
                    token_ids,
                    text,
                    s.finish_reason,
                    logprobs,
                    s.new_ids,
                    new_text,
                    s.stop_reason if s.finish_reason == "stop" else None,
                )
            )
            s.new_ids = []  # reported: this list now belongs to the output
        first = seqs[0]
        prompt_lps = first.prompt_logprobs
        if prompt_lps is not None:
            if not self.prompt_logprobs_ready:
                self.prompt_logprobs_ready = all(e is not None for e in prompt_lps[1:])
            if not self.prompt_logprobs_ready or (delta and self.sent_prompt_logprobs):
                prompt_lps = None
            elif delta:
                self.sent_prompt_logprobs = True
        error, preemptions = first.error, first.num_preemptions
        if len(seqs) > 1:  # n > 1
            for s in seqs[1:]:
                error = error or s.error
                preemptions += s.num_preemptions
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            comps,
            finished,
            error,
            first.num_cached_tokens,
            preemptions,
            list(prompt_lps) if prompt_lps is not None else None,
        )


class OutputProcessor:
    """The engine's one owner of live requests and of the outputs they report.

    It holds a :class:`RequestState` per request added and not yet reported finished, and
    turns the sequences a step touched (from ``Scheduler.postprocess``) into one
    :class:`RequestOutput` per request, in the order first touched; an abort's final output is
    queued here and reported with the next step's.
    """

    def __init__(self) -> None:
        self._requests: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    def requests(self) -> list[RequestState]:
        """The live requests, in the order they were added."""
        return list(self._requests.values())

    def add(self, req: RequestState) -> None:
        """Starts tracking ``req`` (its id must not be live: the engine checks first)."""
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already live")
        self._requests[req.request_id] = req

    def abort(self, request_id: str) -> RequestState | None:
        """Stops tracking ``request_id`` and queues its final output (the caller has finished
        its sequences); None for an unknown or finished id."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._pending.append(req.output(finished=True))
        return req

    def detokenize(self, touched: list[Any]) -> tuple[list[tuple[Any, int]], list[str]]:
        """Takes the tokens a step appended to the ``touched`` sequences into their text, and
        looks for their stop strings, as each token is added (a multi-step decode's row adds
        several at once: one ``push_chunk`` when it has no stop strings).

        Returns:
          ``(stops, failed)``: each sequence whose text reached a stop string, with the
          generated tokens it keeps (through the one that completed the string; the text is
          cut before the string), for the scheduler to end
          (:meth:`~paxcache.scheduler.Scheduler.stop_at`); the ids of requests whose
          detokenization raised (logged; the engine fails them alone).
        """
        stops: list[tuple[Any, int]] = []
        failed: dict[str, None] = {}
        for seq in touched:
            _detokenize_one(seq, stops, failed)
        return stops, list(failed)

    def process(self, touched: list[Any]) -> list[RequestOutput]:
        """The outputs of one step: the queued abort outputs, then one per live request with
        a touched sequence (``touched``: sequences with ``request_id``, ``is_finished`` and this
        step's ``new_ids``, which are cleared once reported). A request whose sequences all
        finished is reported finished and forgotten."""
        outputs, self._pending = self._pending, []
        reqs = {s.request_id: self._requests.get(s.request_id) for s in touched}
        for req in reqs.values():
            if req is not None:
                outputs.append(self._output(req))
        return outputs

    def report(
        self, touched: list[Any], end: Callable[[list[tuple[Any, int]], list[str]], None]
    ) -> list[RequestOutput]:
        """:meth:`detokenize` then :meth:`process`, in one pass over ``touched`` (a step's
        host work is mostly passes over its rows): a request with one sequence that reached
        no stop string and did not fail gets its output as its sequence is detokenized; the
        others' are built after ``end(stops, failed)``, called once when there are any
        (:meth:`detokenize`'s two lists: the engine's scheduler ends those sequences and
        fails those requests), in the order their requests were first touched, as
        :meth:`process` orders them."""
        outputs: list[Any]
        outputs, self._pending = self._pending, []
        requests = self._requests
        stops: list[tuple[Any, int]] = []
        failed: dict[str, None] = {}
        later: list[tuple[int, RequestState]] = []  # (place in outputs, request)
        seen: set[str] = set()
        for seq in touched:
            rid = seq.request_id
            hit = _detokenize_one(seq, stops, failed)
            if rid in seen:
                continue
            seen.add(rid)
            req = requests.get(rid)
            if req is None:
                continue
            if hit or len(req.seqs) > 1:  # its sequences may change, or be touched later
                later.append((len(outputs), req))
                outputs.append(None)
            else:
                outputs.append(self._output(req))
        if stops or failed:
            end(stops, list(failed))
        for place, req in later:
            outputs[place] = self._output(req)
        return outputs

    def _output(self, req: RequestState) -> RequestOutput:
        """``req``'s output now; a request whose sequences all finished is forgotten."""
        seqs = req.seqs
        finished = seqs[0].is_finished if len(seqs) == 1 else all(s.is_finished for s in seqs)
        if finished:
            self._requests.pop(req.request_id, None)
        return req.output(finished=finished)


def _detokenize_one(seq: Any, stops: list[tuple[Any, int]], failed: dict[str, None]) -> bool:
    """:meth:`OutputProcessor.detokenize` of one sequence (:func:`_take_text`): a stop string
    goes to ``stops``, a request whose detokenization raised to ``failed`` (logged). Returns
    whether either happened now."""
    if seq.decoder is None or seq.request_id in failed:
        return False
    try:
        keep = _take_text(seq)
    except Exception:  # noqa: BLE001 - this request fails, the others go on
        logger.exception("request %s failed while detokenizing", seq.request_id)
        if seq.is_finished:  # by its last token: the failure is what it reports
            seq.finish_reason, seq.error = "error", INTERNAL_ERROR
        failed[seq.request_id] = None
        return True
    if keep is None:
        return False
    stops.append((seq, keep))
    return True


def _take_text(seq: Any) -> int | None:
    """Detokenizes ``seq``'s generated tokens not yet in its text (all but a last token that
    ended it by itself) and finds its first stop string among them: returns the generated
    tokens to keep when one completed one (the text is cut before it), else None. A sequence
    that finished by length (or by its grammar) without stop strings flushes the characters
    its decoder held back."""
    start, end = seq.num_detokenized, seq.num_generated
    seq.num_detokenized = end
    if seq.is_finished and seq.ends_on_stop_token:
        end -= 1
    base = seq.num_prompt
    stops = seq.params.stop or ()
    if stops:
        longest = max(len(s) for s in stops)
        for n in range(start, end):
            seq.text += seq.decoder.push(seq.token_ids[base + n])
            window = max(0, seq.emitted - longest)
            found = ((seq.text.find(s, window), s) for s in stops)
            hits = [(i, s) for i, s in found if i >= 0]
            if hits:
                at, string = min(hits, key=lambda hit: hit[0])  # the first listed on a tie
                seq.text = seq.text[:at]
                seq.stop_reason = string
                return n + 1
        return None
    if end - start == 1:
        seq.text += seq.decoder.push(seq.token_ids[base + start])
    elif end > start:
        seq.text += seq.decoder.push_chunk(seq.token_ids[base + start : base + end])
    reason = seq.finish_reason
    if reason == "length" or (reason == "stop" and seq.matcher is not None):
        seq.text += seq.decoder.flush()
    return None
