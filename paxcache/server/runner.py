"""The engine thread and its exchange with the request handlers.

One background thread (:class:`EngineRunner`) owns the engine. Request handlers never touch
the engine; they hand requests to the thread through a lock-protected queue
(:meth:`EngineRunner.submit`, :meth:`EngineRunner.abort`) and receive its events through an
:class:`Exchange` (``loop.call_soon_threadsafe``). The thread loops: it takes the queue into an
``EngineRound`` (abort requests whose clients went away, add pending requests, sample stats or
not), applies it with :meth:`paxcache.multihost.EngineLoop.run_round` (the aborts, the adds,
``engine.step()``), and dispatches the result (acceptances and refusals before the step, then
each ``RequestOutput``) to its requests' exchanges; it sleeps on a condition variable when
there is nothing to do (no busy spin). The engine isolates failures per request (a request
whose host work or device step fails finishes with an error, the others go on); should
``engine.step()`` itself raise, the requests in flight fail with a 503 and the server keeps
serving.

Coalescing: outputs are ``output_kind="delta"`` and folded into one :class:`Progress` per
engine request until the handler takes them, so a slow streaming reader holds one pending
update per completion, not one per token.

Multi-host: with ``jax.process_count() > 1`` each loop iteration first broadcasts its round
to the followers (:mod:`paxcache.multihost`), which apply it with the same ``EngineLoop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from paxcache.errors import PaxcacheError
from paxcache.multihost import (
    HEARTBEAT_S,
    EngineLoop,
    EngineRound,
    RoundAdd,
    RoundResult,
    broadcast_round,
    process_count,
    with_leader_seed,
)
from paxcache.outputs import RequestOutput
from paxcache.sampling import SamplingParams
from paxcache.server.protocol import DEFAULT_MAX_QUEUE, APIError

__all__ = [
    "ACCEPTED",
    "CompletionProgress",
    "EngineRunner",
    "Exchange",
    "Failed",
    "Progress",
    "Sink",
    "Submission",
    "fold",
]

logger = logging.getLogger(__name__)


@dataclass
class Failed:
    """An event telling a handler its engine request failed."""

    status: int
    message: str
    type: str = "invalid_request_error"

    def error(self) -> APIError:
        return APIError(self.status, self.message, type=self.type)


ACCEPTED = "accepted"
"""The event telling a handler the engine added its request."""


@dataclass(slots=True)
class CompletionProgress:
    """What one completion of an engine request produced over some outputs.

    Attributes:
      texts: text pieces, in order (joined only when taken).
      token_ids: generated token ids.
      logprobs: per-token logprob entries, or None (the request asked for none).
      finish_reason: the completion's finish reason, once it finished.
      stop_reason: vLLM's: the stop token id or stop string that ended it (None otherwise).
    """

    texts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def merge(self, later: CompletionProgress, keep_text: bool = True) -> None:
        """Appends ``later`` (what came after ``self``): its token ids and finish reason, and
        with ``keep_text`` its text pieces and logprob entries (streaming totals keep only
        the counts and the finish state)."""
        if keep_text:
            self.texts.extend(later.texts)
            if later.logprobs is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(later.logprobs)
        self.token_ids.extend(later.token_ids)
        if later.finish_reason is not None:
            self.finish_reason = later.finish_reason
            self.stop_reason = later.stop_reason


class Progress:
    """What one engine request produced since a handler last looked: text pieces, token ids
    and logprobs per completion (from ``output_kind="delta"`` outputs, concatenated only when
    taken), so a slow reader holds O(its output), whatever the number of steps.

    Attributes:
      completions: completion index -> its :class:`CompletionProgress`.
      finished: the engine request finished.
      error: the engine's error message, if it failed.
      prompt_tokens: prompt length (once known).
      cached: prompt tokens served from the prefix cache (once known).
      prompt_logprobs: the request's ``RequestOutput.prompt_logprobs`` (once reported).
    """

    __slots__ = ("cached", "completions", "error", "finished", "prompt_logprobs", "prompt_tokens")

    def __init__(self) -> None:
        self.completions: dict[int, CompletionProgress] = {}
        self.finished = False
        self.error: str | None = None
        self.prompt_tokens: int | None = None
        self.cached: int | None = None
        self.prompt_logprobs: list | None = None

    def add(self, out: RequestOutput) -> None:
        """Adds a delta output: the rule :func:`fold` adds a later :class:`Progress` by."""
        for c in out.outputs:
            self._completion(c.index).merge(
                CompletionProgress(
                    [c.text] if c.text else [],
                    c.token_ids,
                    c.logprobs,
                    c.finish_reason,
                    c.stop_reason,
                )
            )
        self._update(
            out.finished,
            out.error,
            len(out.prompt_token_ids) if out.prompt_token_ids else None,
            out.num_cached_tokens,
            out.prompt_logprobs,
        )

    def _completion(self, index: int) -> CompletionProgress:
        acc = self.completions.get(index)
        if acc is None:
            acc = self.completions[index] = CompletionProgress()
        return acc

    def _update(
        self,
        finished: bool,
        error: str | None,
        prompt_tokens: int | None,
        cached: int | None,
        prompt_logprobs: list | None,
    ) -> None:
        """The request's fields after later news (None: nothing new)."""
        self.finished = self.finished or finished
        self.error = self.error or error
        if prompt_tokens is not None:
            self.prompt_tokens = prompt_tokens
        if cached is not None:
            self.cached = cached
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs


def fold(total: Progress, new: Progress, keep_text: bool = True) -> None:
    """Adds ``new`` (progress since the last take) into ``total`` (a request's whole result;
    streaming keeps only counts and finish state, not the text it already sent)."""
    for index, piece in new.completions.items():
        total._completion(index).merge(piece, keep_text)
    total._update(
        new.finished,
        new.error,
        new.prompt_tokens,
        new.cached,
        new.prompt_logprobs if keep_text else None,
    )


class Exchange:
    """One HTTP request's side of its engine requests (tags ``0..k-1``).

    The engine thread calls :meth:`deliver` (through ``loop.call_soon_threadsafe``); the
    handler awaits :meth:`wait_accepted`, then :meth:`take` repeatedly. Outputs are folded into
    one :class:`Progress` per tag until taken (coalescing: bounded by the output, not by the
    number of steps)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num: int) -> None:
        self.loop = loop
        self.num = num
        self.changed = asyncio.Event()
        self.pending: dict[int, Progress] = {}
        self.accepted: set[int] = set()
        self.refusal: Failed | None = None  # a request the engine did not accept
        self.failure: Failed | None = None  # an accepted request that failed later
        self.disconnected = False
        self.streaming = False  # a stream generator started (and owns the cleanup)

    def disconnect(self) -> None:
        """The client went away: wakes the handler (``take`` returns at once from now on)."""
        self.disconnected = True
        self.changed.set()

    def shut_down(self, failure: Failed) -> bool:
        """The server ends this request (shutdown): wakes the handler with ``failure`` (a
        refusal while some engine request is not yet accepted). Returns whether it was still
        waiting on the engine."""
        waiting = not (self.disconnected or self.failure or self.refusal)
        if len(self.accepted) < self.num:
            self.refusal = self.refusal or failure
        else:
            self.failure = self.failure or failure
        self.changed.set()
        return waiting

    def deliver(self, tag: int, event: Any) -> None:  # on the event loop
        if event is ACCEPTED:
            self.accepted.add(tag)
        elif isinstance(event, Failed):
            if tag in self.accepted:
                self.failure = self.failure or event
            else:
                self.refusal = self.refusal or event
        elif isinstance(event, RequestOutput):
            self.pending.setdefault(tag, Progress()).add(event)
        self.changed.set()

    async def wait_accepted(self) -> None:
        """Returns once every engine request was added; raises the first refusal."""
        while self.refusal is None and len(self.accepted) < self.num:
            self.changed.clear()
            await self.changed.wait()
        if self.refusal is not None:
            raise self.refusal.error()

    async def take(self) -> tuple[dict[int, Progress], Failed | None]:
        """Waits for news; returns the progress per tag since the last call (and a failure)."""
        while not self.pending and self.failure is None and not self.disconnected:
            self.changed.clear()
            await self.changed.wait()
        got, self.pending = self.pending, {}
        return got, self.failure


class Sink:
    """Where the engine thread delivers one engine request's events."""

    def __init__(self, exchange: Exchange, tag: int) -> None:
        self.exchange = exchange
        self.tag = tag
        self.t_submit = time.monotonic()
        self.got_first_token = False
        self.first_token_s: float | None = None  # seconds from submission to the first token
        self.t_last_token = 0.0
        self.num_tokens = 0  # generated, over all completions
        self.completions = 1  # the request's n, once the engine accepted it

    def put(self, event: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the handler's loop is gone (shutdown)
            self.exchange.loop.call_soon_threadsafe(self.exchange.deliver, self.tag, event)


@dataclass
class Submission:
    """One engine request a handler queues: ``engine.add_request(request_id, prompt, params,
    cache_salt=cache_salt)``, its events going to ``sink``."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: Sink
    cache_salt: str | None = None


class EngineRunner:
    """Owns the engine in one background thread; handlers talk to it only through ``submit``
    and ``abort``.

    Args:
      engine: an object with the ``Engine`` interface (``add_request(..., cache_salt=)``,
        ``step``, ``abort``, ``has_unfinished_requests``, ``stats``, ``warmup``).
      max_queue: most engine requests in flight (submitted and not finished) before ``submit``
        refuses (the server answers 429).
      warmup: call ``engine.warmup()`` in the thread before reporting ready.
      stats_interval_s: how often, at most, ``engine.stats()`` is sampled while busy (always when
        the engine goes idle).
      multihost: broadcast each round to :func:`paxcache.multihost.run_follower` on the
        other processes; ``None``: when ``jax.process_count() > 1``.
      on_first_token: called with the seconds from submission to a request's first token.
      on_finish: called with a finished request's last output, its seconds since submission,
        the seconds from submission to its first token (None without one) and the tokens it
        generated (all completions).
      on_tokens: called when a request that already had tokens gets more, with the seconds
        since its previous ones and how many came (inter-token latency).
      on_abort: called when a request ends without finishing (aborted: client gone, stall,
        shutdown, ``abort``; or failed by an engine error), with the reason (``"abort"`` /
        ``"error"``), its completions, seconds since submission, seconds to its first token
        (None without one) and the tokens it generated.
    """

    def __init__(
        self,
        engine: Any,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        warmup: bool = True,
        stats_interval_s: float = 0.1,
        multihost: bool | None = None,
        on_first_token: Callable[[float], None] | None = None,
        on_finish: Callable[[RequestOutput, float, float | None, int], None] | None = None,
        on_tokens: Callable[[float, int], None] | None = None,
        on_abort: Callable[[str, int, float, float | None, int], None] | None = None,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self._warmup = warmup
        self._stats_interval_s = stats_interval_s
        self._cond = threading.Condition()
        self._pending: deque[Submission] = deque()
        self._aborts: list[str] = []
        self._inflight = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop = EngineLoop(engine)  # engine thread only; its ``live`` are the sinks' ids
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._unanswered: dict[int, Submission] = {}  # this round's, not yet answered
        self.ready = threading.Event()
        self.warmup_error: str | None = None
        self.stats_snapshot: dict[str, Any] = {}
        self.num_engine_errors = 0
        self.on_first_token = on_first_token
        self.on_finish = on_finish
        self.on_tokens = on_tokens
        self.on_abort = on_abort
        self._multihost = process_count() > 1 if multihost is None else multihost

    # -- called from handlers (any thread) ----------------------------------------------------

    @property
    def num_inflight(self) -> int:
        """Engine requests submitted and not yet finished, failed or aborted."""
        return self._inflight

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Starts the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="paxcache-engine", daemon=True)
            self._thread.start()

    def submit(self, subs: Sequence[Submission]) -> None:
        """Queues requests for the engine thread, all or none.

        Raises:
          APIError: 503 when stopping, 429 when ``max_queue`` would be exceeded.
        """
        with self._cond:
            if self._stopping:
                raise APIError(503, "server is shutting down", type="service_unavailable")
            if self._inflight + len(subs) > self.max_queue:
                raise APIError(
                    429,
                    f"server busy: {self._inflight} requests in flight (limit max_queue="
                    f"{self.max_queue}); retry later",
                    type="rate_limit_error",
                    code="queue_full",
                )
            self._inflight += len(subs)
            self._pending.extend(subs)
            self._cond.notify()

    def abort(self, request_ids: Sequence[str]) -> None:
        """Asks the engine thread to abort requests (unknown or finished ids are ignored)."""
        if not request_ids:
            return
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Stops the thread; requests still in flight get a 503 "shutting down" error.

        Args:
          timeout: how long to wait for the thread (default 30 s, or 1 s while it is still
            warming up: a compilation cannot be interrupted, so do not wait for it).
        """
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if timeout is None:
            timeout = 30.0 if self.ready.is_set() else 1.0
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %ss", timeout)

    # -- the engine thread ---------------------------------------------------------------------

    def _done(self, k: int = 1) -> None:
        with self._cond:
            self._inflight -= k

    def _ended(self, sink: Sink, params: SamplingParams | None, reason: str) -> None:
        """A request ended without finishing: tell ``on_abort`` (metrics count every ending)."""
        if self.on_abort is None:
            return
        completions = sink.completions if params is None else max(1, int(params.n or 1))
        with contextlib.suppress(Exception):
            self.on_abort(
                reason,
                completions,
                time.monotonic() - sink.t_submit,
                sink.first_token_s,
                sink.num_tokens,
            )

    def _take_stats(self, stats: dict[str, Any] | None) -> None:
        if stats is not None:
            self.stats_snapshot = stats

    def _start_engine(self) -> None:
        """Warms the engine up (when asked), samples its stats, and reports ready (unless the
        warm-up failed): what every follower does first too."""
        if self._warmup:
            self.warmup_error = self._loop.warmup()
        self._take_stats(self._loop.sample_stats())
        if self.warmup_error is None:
            self.ready.set()

    def _run(self) -> None:
        self._start_engine()
        while True:
            result = self._round()
            if result is None:
                time.sleep(0.01)
                continue
            if result.stopped:
                return
            if not result.stepped:  # idle: sleep until there is news (multi-host: a heartbeat)
                with self._cond:
                    if not (self._pending or self._aborts or self._stopping):
                        self._cond.wait(HEARTBEAT_S if self._multihost else None)

    def _round(self) -> RoundResult | None:
        """One :meth:`_iterate`; should anything in it raise outside the engine calls (which
        ``EngineLoop`` isolates), e.g. the broadcast to the other hosts, the requests in flight
        and the round's submissions not yet answered fail with a 503 and None is returned: the
        server keeps serving."""
        try:
            return self._iterate()
        except Exception:  # noqa: BLE001 - keep serving whatever went wrong
            logger.exception("engine loop error; failing the requests in flight")
            self.num_engine_errors += 1
            self._loop.abort_live()
            unanswered, self._unanswered = list(self._unanswered.values()), {}
            self._fail_pending(unanswered, 503, "engine error", "engine_error")
            self._fail_sinks(list(self._sinks), 503, "engine error", "engine_error")
            return None

    def _iterate(self) -> RoundResult:
        """One round: takes the queue, builds the round (broadcast first when multi-host),
        applies it with ``EngineLoop.run_round`` (the code every follower runs) and delivers
        what it did."""
        with self._cond:
            pending = list(self._pending)
            self._pending.clear()
            aborts = dict.fromkeys(self._aborts)  # ordered: every host aborts in the same order
            self._aborts.clear()
            stopping = self._stopping
        if self._multihost:  # unseeded requests get a seed drawn here, the same on every host
            pending = [
                s
                if s.params.seed is not None
                else dataclasses.replace(s, params=with_leader_seed(s.params))
                for s in pending
            ]
        self._unanswered = {id(sub): sub for sub in pending}  # until _admitted answers each
        rnd = EngineRound(
            stop=stopping,
            # On shutdown every request in flight is aborted, in order.
            aborts=tuple(self._loop.live) if stopping else tuple(aborts),
            adds=()
            if stopping
            else tuple(
                RoundAdd(s.request_id, s.prompt, s.params, s.cache_salt)
                for s in pending
                if s.request_id not in aborts
            ),
            # Decided before the round, so followers sample stats when process 0 does.
            stats=time.monotonic() - self._loop.last_stats_t >= self._stats_interval_s,
        )
        if self._multihost:
            broadcast_round(rnd)  # before anything is applied
        result = self._loop.run_round(rnd, admitted=lambda r: self._admitted(pending, aborts, r))
        self._take_stats(result.stats)
        if result.stopped:
            self._unanswered = {}
            self._fail_pending(pending, 503, "server is shutting down", "service_unavailable")
            self._fail_sinks(
                list(self._sinks), 503, "server is shutting down", "service_unavailable"
            )
        elif result.step_error is not None:
            self.num_engine_errors += 1
            self._fail_sinks(result.aborted_on_error, 503, "engine error", "engine_error")
        self._deliver(result.outputs)
        return result

    def _admitted(
        self, pending: list[Submission], aborts: dict[str, None], result: RoundResult
    ) -> None:
        """The round's aborts and adds are applied: answer them (before the step)."""
        for rid in aborts:
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                self._done()
                self._ended(sink, None, "abort")
        for sub in pending:
            self._unanswered.pop(id(sub), None)
            if sub.request_id in aborts:
                self._done()
                self._ended(sub.sink, sub.params, "abort")
                continue
            err = result.refused.get(sub.request_id)
            if err is None:
                sub.sink.completions = max(1, int(sub.params.n or 1))
                self._sinks[sub.request_id] = sub.sink
                sub.sink.put(ACCEPTED)
                continue
            if isinstance(err, PaxcacheError):  # our own messages: safe to show
                sub.sink.put(Failed(400, str(err)))
            elif isinstance(err, ValueError):
                logger.warning("request %s refused by the engine", sub.request_id, exc_info=err)
                sub.sink.put(Failed(400, "the engine refused this request"))
            else:
                logger.error("engine.add_request(%s) failed", sub.request_id, exc_info=err)
                sub.sink.put(Failed(503, "engine error", "engine_error"))
            self._done()

    def _fail_pending(
        self, pending: Sequence[Submission], status: int, message: str, type_: str
    ) -> None:
        """Submissions never added end with ``Failed(status, message, type_)``."""
        reason = "abort" if type_ == "service_unavailable" else "error"  # shutdown: aborted
        for sub in pending:
            sub.sink.put(Failed(status, message, type_))
            self._ended(sub.sink, sub.params, reason)
        self._done(len(pending))

    def _fail_sinks(
        self, request_ids: Sequence[str], status: int, message: str, type_: str
    ) -> None:
        """Requests in flight (already aborted in the engine) end with ``Failed(...)``."""
        reason = "abort" if type_ == "service_unavailable" else "error"  # shutdown: aborted
        for rid in request_ids:
            sink = self._sinks.pop(rid, None)
            if sink is None:
                continue
            sink.put(Failed(status, message, type_))
            self._ended(sink, None, reason)
            self._done()

    def _deliver(self, outs: Sequence[RequestOutput]) -> None:
        """A step's outputs to their requests' sinks (and the latency callbacks)."""
        now = time.monotonic()
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            new = sum(len(o.new_token_ids) for o in out.outputs)
            if new and not sink.got_first_token:
                sink.got_first_token = True
                sink.first_token_s = now - sink.t_submit
                if self.on_first_token is not None:
                    with contextlib.suppress(Exception):
                        self.on_first_token(sink.first_token_s)
            elif new and self.on_tokens is not None:
                with contextlib.suppress(Exception):
                    self.on_tokens(now - sink.t_last_token, new)
            if new:
                sink.t_last_token = now
                sink.num_tokens += new
            sink.put(out)
            if out.finished:
                del self._sinks[out.request_id]
                self._done()
                if self.on_finish is not None:
                    with contextlib.suppress(Exception):
                        self.on_finish(
                            out, now - sink.t_submit, sink.first_token_s, sink.num_tokens
                        )
