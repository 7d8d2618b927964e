"""OpenAI-compatible HTTP server for a paxcache ``Engine`` (FastAPI + uvicorn, extra ``serve``).

Architecture: one background thread (``EngineRunner``) owns the engine. Request handlers never
touch the engine; they hand requests to the thread through a lock-protected queue and receive
its events through an :class:`_Exchange` (``loop.call_soon_threadsafe``). The thread loops:
abort requests whose clients went away, add pending requests, ``engine.step()``, and dispatch
each ``RequestOutput`` to its request's exchange; it sleeps on a condition variable when there
is nothing to do (no busy spin). The engine isolates failures per request (a request whose
host work or device step fails finishes with an error, the others go on); should
``engine.step()`` itself raise, the requests in flight fail with a 503 and the server keeps
serving.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as server-sent
events when ``"stream": true``, ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``
(503 until the engine is warmed up), ``GET /metrics`` (Prometheus text).

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code", "request_id"}}``:
400 for bad input (FastAPI's 422 is turned into 400; every limit below names itself), 401 for
a missing/wrong API key, 404 for an unknown model, 408 for a body that does not arrive in
time, 413 for a body over the size limit, 429 when the server or the caller's tenant has too
many requests in flight, 500 for an internal error, 503 while shutting down or when the engine
failed. Every response carries an ``x-request-id`` header; the server logs failures with that
id, and clients never see exception text or paths.

Security (the threat model is in SECURITY.md):

* Authentication runs as ASGI middleware *before* the body is read. With API keys, every route
  but ``/health`` needs ``Authorization: Bearer KEY`` (``/metrics``, ``/docs`` and
  ``/openapi.json`` too). ``allowed_hosts`` checks the ``Host`` header (DNS rebinding).
* Limits (:class:`ServerLimits`, each with a 400 or 429 naming it): body size and read time,
  prompts per request and prompts x ``n``, chat messages, stop strings (count and length, as
  OpenAI: 4), stop token ids, logprobs, ``cache_salt`` length, requests in flight in total and
  per tenant. Every numeric field is bounded where it enters (``top_k`` at most the
  vocabulary, seeds 64-bit, ...). Unknown fields are refused (a field the server does not
  honour is never silently dropped); strings with lone surrogates are refused.
* Tenants: each API key is a tenant; without keys, each client address is. A tenant's
  requests get its own prefix-cache salt (``cache_salt``, vLLM's field, namespaced by the
  key), so no tenant can time another's cached prompts; see the README's prefix-cache threat
  model. ``usage.prompt_tokens_details.cached_tokens`` reports the hits.
* Streaming goes through a coalescing exchange (a slow reader holds one pending update per
  completion, not one per token) and a request whose client reads nothing for
  ``stream_stall_timeout_s`` is aborted and its blocks freed.
* Chat templates come from the checkpoint and render in a sandbox
  (``paxcache.models.tokenizer``), off the event loop.

Multi-host (``jax.process_count() > 1``): every process must make the same engine calls in the
same order, and only process 0 serves HTTP. Each round, process 0's engine thread first
broadcasts that round as an ``EngineRound`` (new requests, aborts, whether to sample stats, a
shutdown flag), then applies it and steps; every other process runs ``run_follower``. Both
live in :mod:`paxcache.multihost` (re-exported here).

Extensions beyond OpenAI's fields (as in vLLM): ``top_k`` (-1 or 0 = off), ``min_p``,
``stop_token_ids``, ``ignore_eos``, ``cache_salt``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as prometheus_generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from paxcache.errors import PaxcacheError
from paxcache.multihost import HEARTBEAT_S as _HEARTBEAT_S
from paxcache.multihost import EngineRound, RoundAdd, RoundError, run_follower
from paxcache.multihost import broadcast_round as _broadcast
from paxcache.multihost import process_count as _process_count
from paxcache.multihost import with_leader_seed as _with_leader_seed
from paxcache.outputs import INTERNAL_ERROR, RequestOutput
from paxcache.sampling import MAX_LOGPROBS, MAX_N, SamplingParams

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUEUE",
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "EngineRound",
    "EngineRunner",
    "RoundError",
    "ServerLimits",
    "create_app",
    "run_follower",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 256
"""Default cap on engine requests in flight (waiting + running); beyond it: 429."""

DEFAULT_MAX_BODY_BYTES = 1 << 20
"""Default cap on a request body (1 MiB); beyond it: 413."""

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_DISCONNECT_POLL_S = 0.25
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1
_INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and per-tenant limits; each refusal (400, 408, 413 or 429) names its limit.

    Attributes:
      max_queue: engine requests in flight, all tenants (one per prompt; the ``n``
        completions of a prompt count once). Beyond it: 429 ``queue_full``.
      max_inflight_per_tenant: completions (prompts x ``n``) one tenant (an API key, or a
        client address without keys) may have in flight. Beyond it: 429 ``tenant_limit``.
      max_body_bytes: request body size (413).
      body_timeout_s: seconds for the whole body to arrive (408).
      max_prompts: prompts in one ``/v1/completions`` request.
      max_choices: prompts x ``n`` in one request.
      max_messages: messages in one chat request.
      max_stop: stop strings per request (OpenAI allows 4).
      max_stop_chars: characters in one stop string.
      max_stop_token_ids: ids in ``stop_token_ids``.
      max_logprobs: ``logprobs`` / ``top_logprobs``.
      max_cache_salt_chars: characters in ``cache_salt``.
      stream_stall_timeout_s: a streaming client that reads nothing for this long is dropped
        and its request aborted (its KV blocks freed).
    """

    max_queue: int = DEFAULT_MAX_QUEUE
    max_inflight_per_tenant: int = 128
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = 30.0
    max_prompts: int = 32
    max_choices: int = MAX_N
    max_messages: int = 512
    max_stop: int = 4
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64
    max_logprobs: int = MAX_LOGPROBS
    max_cache_salt_chars: int = 256
    stream_stall_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "float":
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                ok = ok and math.isfinite(v)
            else:
                ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
            if not ok:
                raise ValueError(f"ServerLimits.{f.name} must be positive, got {v!r}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"ServerLimits.max_logprobs must be <= {MAX_LOGPROBS}")
        if self.max_choices > MAX_N * self.max_prompts:
            raise ValueError("ServerLimits.max_choices must be <= MAX_N * max_prompts")


# ----------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """An error answered with an OpenAI-style JSON body and the given HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self, request_id: str | None = None) -> dict[str, Any]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if request_id is not None:
            err["request_id"] = request_id
        return {"error": err}

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return _SafeJSON(self.body(request_id), status_code=self.status, headers=headers)


class _SafeJSON(JSONResponse):
    """JSON with non-ASCII escaped: any string (even a lone surrogate) renders, never raises."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def _internal_error() -> APIError:
    return APIError(
        500,
        "internal server error; the server logged it under this request id",
        type="server_error",
    )


def _shown(value: str, limit: int = 64) -> str:
    """A client-supplied string, shortened, for an error message."""
    return value if len(value) <= limit else value[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Request bodies (strict: "5" is not an int, "yes" is not a bool; unknown fields are refused).


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("string contains a lone UTF-16 surrogate (invalid Unicode)") from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]
"""A string that is valid Unicode (JSON can smuggle lone surrogates: ``"\\ud800"``)."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: Text | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=_INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_UINT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None
    cache_salt: Text | None = None


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions`` (OpenAI legacy completions)."""

    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)


class TextContentPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


# ----------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------
# Between the engine thread and a handler


@dataclass
class _Failed:
    """An event telling a handler its engine request failed."""

    status: int
    message: str
    type: str = "invalid_request_error"


_ACCEPTED = "accepted"


class _Progress:
    """What one engine request produced since a handler last looked: text pieces, token ids
    and logprobs per completion (from ``output_kind="delta"`` outputs, concatenated only when
    taken), so a slow reader holds O(its output), whatever the number of steps."""

    __slots__ = ("cached", "completions", "error", "finished", "prompt_tokens")

    def __init__(self) -> None:
        self.completions: dict[int, list] = {}  # index -> [text pieces, ids, logprobs, reason]
        self.finished = False
        self.error: str | None = None
        self.prompt_tokens: int | None = None
        self.cached: int | None = None

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            acc = self.completions.get(c.index)
            if acc is None:
                acc = self.completions[c.index] = [[], [], None, None]
            if c.text:
                acc[0].append(c.text)
            acc[1].extend(c.token_ids)
            if c.logprobs is not None:
                if acc[2] is None:
                    acc[2] = []
                acc[2].extend(c.logprobs)
            if c.finish_reason is not None:
                acc[3] = c.finish_reason
        self.finished = self.finished or out.finished
        self.error = self.error or out.error
        if out.prompt_token_ids:
            self.prompt_tokens = len(out.prompt_token_ids)
        if out.num_cached_tokens is not None:
            self.cached = out.num_cached_tokens


class _Exchange:
    """One HTTP request's side of its engine requests (tags ``0..k-1``).

    The engine thread calls :meth:`deliver` (through ``loop.call_soon_threadsafe``); the
    handler awaits :meth:`wait_accepted`, then :meth:`take` repeatedly. Outputs are folded into
    one :class:`_Progress` per tag until taken (coalescing: bounded by the output, not by the
    number of steps)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num: int) -> None:
        self.loop = loop
        self.num = num
        self.changed = asyncio.Event()
        self.pending: dict[int, _Progress] = {}
        self.accepted: set[int] = set()
        self.refusal: _Failed | None = None  # a request the engine did not accept
        self.failure: _Failed | None = None  # an accepted request that failed later
        self.disconnected = False
        self.streaming = False  # a stream generator started (and owns the cleanup)

    def disconnect(self) -> None:
        """The client went away: wakes the handler (``take`` returns at once from now on)."""
        self.disconnected = True
        self.changed.set()

    def deliver(self, tag: int, event: Any) -> None:  # on the event loop
        if event is _ACCEPTED:
            self.accepted.add(tag)
        elif isinstance(event, _Failed):
            if tag in self.accepted:
                self.failure = self.failure or event
            else:
                self.refusal = self.refusal or event
        elif isinstance(event, RequestOutput):
            self.pending.setdefault(tag, _Progress()).add(event)
        self.changed.set()

    async def wait_accepted(self) -> None:
        """Returns once every engine request was added; raises the first refusal."""
        while self.refusal is None and len(self.accepted) < self.num:
            self.changed.clear()
            await self.changed.wait()
        if self.refusal is not None:
            f = self.refusal
            raise APIError(f.status, f.message, type=f.type)

    async def take(self) -> tuple[dict[int, _Progress], _Failed | None]:
        """Waits for news; returns the progress per tag since the last call (and a failure)."""
        while not self.pending and self.failure is None and not self.disconnected:
            self.changed.clear()
            await self.changed.wait()
        got, self.pending = self.pending, {}
        return got, self.failure


class _Sink:
    """Where the engine thread delivers one engine request's events."""

    def __init__(self, exchange: _Exchange, tag: int) -> None:
        self.exchange = exchange
        self.tag = tag
        self.t_submit = time.monotonic()
        self.got_first_token = False

    def put(self, event: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the handler's loop is gone (shutdown)
            self.exchange.loop.call_soon_threadsafe(self.exchange.deliver, self.tag, event)


@dataclass
class _Submission:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: _Sink
    cache_salt: str | None = None


# ----------------------------------------------------------------------------------------------
# The engine thread


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
      multihost: broadcast each round to :func:`run_follower` on the other processes (see the
        module docstring); ``None``: when ``jax.process_count() > 1``.
    """

    def __init__(
        self,
        engine: Any,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        warmup: bool = True,
        stats_interval_s: float = 0.1,
        multihost: bool | None = None,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self._warmup = warmup
        self._stats_interval_s = stats_interval_s
        self._cond = threading.Condition()
        self._pending: deque[_Submission] = deque()
        self._aborts: list[str] = []
        self._inflight = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._last_stats_t = 0.0
        self.ready = threading.Event()
        self.warmup_error: str | None = None
        self.stats_snapshot: dict[str, Any] = {}
        self.num_engine_errors = 0
        self.ttft = None  # set by create_app: prometheus Histogram or None
        self.on_finish: Callable[[RequestOutput, float], None] | None = None
        self._multihost = _process_count() > 1 if multihost is None else multihost

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

    def submit(self, subs: Sequence[_Submission]) -> None:
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

    def _refresh_stats(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_t < self._stats_interval_s:
            return
        self._last_stats_t = now
        try:
            self.stats_snapshot = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - metrics must never take the server down
            logger.exception("engine.stats() failed")

    def _has_work(self) -> bool:
        try:
            return bool(self.engine.has_unfinished_requests())
        except Exception:  # noqa: BLE001
            logger.exception("engine.has_unfinished_requests() failed")
            return False

    def _run(self) -> None:
        if self._warmup:
            try:
                t0 = time.monotonic()
                self.engine.warmup()
                logger.info("engine warm-up done in %.1fs", time.monotonic() - t0)
            except Exception:  # noqa: BLE001
                logger.exception("engine warm-up failed")
                self.warmup_error = "warm-up failed (see the server log)"
        self._refresh_stats(force=True)
        if self.warmup_error is None:
            self.ready.set()
        while True:
            try:
                if not self._iterate():
                    return
            except Exception:  # noqa: BLE001 - keep serving whatever went wrong
                logger.exception("engine loop error; failing the requests in flight")
                self.num_engine_errors += 1
                self._fail_all(503, "engine error", "engine_error")
                time.sleep(0.01)

    def _iterate(self) -> bool:
        """One loop iteration; False when the thread should exit."""
        with self._cond:
            pending = list(self._pending)
            self._pending.clear()
            aborts = dict.fromkeys(self._aborts)  # ordered: every host aborts in the same order
            self._aborts.clear()
            stopping = self._stopping
        stats_due = False
        if self._multihost:
            pending, stats_due = self._broadcast_round(pending, aborts, stopping)
        if stopping:
            self._fail_all(503, "server is shutting down", "service_unavailable", pending)
            self._refresh_stats(force=True)
            return False
        for rid in aborts:
            self._abort_one(rid)
        for sub in pending:
            if sub.request_id in aborts:
                self._done()
            else:
                self._add(sub)
        if self._has_work():
            self._step()
            if not self._multihost:
                self._refresh_stats(force=False)
            elif stats_due:  # decided before the broadcast, so followers sample stats too
                self._refresh_stats(force=True)
            return True
        self._refresh_stats(force=True)
        with self._cond:
            if not (self._pending or self._aborts or self._stopping):
                self._cond.wait(_HEARTBEAT_S if self._multihost else None)
        return True

    def _broadcast_round(
        self, pending: list[_Submission], aborts: dict[str, None], stopping: bool
    ) -> tuple[list[_Submission], bool]:
        """Multi-host: sends this round to :func:`run_follower` before anything is applied.

        Returns the pending submissions (unseeded ones get a seed drawn here, the same on every
        host) and whether stats are sampled after this round's step.
        """
        subs = [dataclasses.replace(s, params=_with_leader_seed(s.params)) for s in pending]
        stats_due = time.monotonic() - self._last_stats_t >= self._stats_interval_s
        rnd = EngineRound(
            stop=stopping,
            # On shutdown the leader aborts (``_fail_all``) the requests it tracks, in order.
            aborts=tuple(self._sinks) if stopping else tuple(aborts),
            adds=()
            if stopping
            else tuple(
                RoundAdd(s.request_id, s.prompt, s.params, s.cache_salt)
                for s in subs
                if s.request_id not in aborts
            ),
            stats=stats_due,
        )
        _broadcast(rnd)
        return subs, stats_due

    def _add(self, sub: _Submission) -> None:
        try:
            self.engine.add_request(
                sub.request_id, sub.prompt, sub.params, cache_salt=sub.cache_salt
            )
        except PaxcacheError as e:  # our own messages: safe to show
            sub.sink.put(_Failed(400, str(e)))
            self._done()
            return
        except ValueError:
            logger.warning("request %s refused by the engine", sub.request_id, exc_info=True)
            sub.sink.put(_Failed(400, "the engine refused this request"))
            self._done()
            return
        except Exception:  # noqa: BLE001
            logger.exception("engine.add_request(%s) failed", sub.request_id)
            sub.sink.put(_Failed(503, "engine error", "engine_error"))
            self._done()
            return
        self._sinks[sub.request_id] = sub.sink
        sub.sink.put(_ACCEPTED)

    def _abort_one(self, rid: str) -> None:
        sink = self._sinks.pop(rid, None)
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001
            logger.exception("engine.abort(%r) failed", rid)
        if sink is not None:
            self._done()

    def _fail_all(
        self, status: int, message: str, type_: str, pending: Sequence[_Submission] = ()
    ) -> None:
        for sub in pending:
            sub.sink.put(_Failed(status, message, type_))
        self._done(len(pending))
        for rid, sink in list(self._sinks.items()):
            sink.put(_Failed(status, message, type_))
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
        self._done(len(self._sinks))
        self._sinks.clear()

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception:  # noqa: BLE001
            logger.exception(
                "engine.step() failed; failing the %d requests in flight", len(self._sinks)
            )
            self.num_engine_errors += 1
            self._fail_all(503, "engine error", "engine_error")
            return
        now = time.monotonic()
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if not sink.got_first_token and any(o.token_ids for o in out.outputs):
                sink.got_first_token = True
                if self.ttft is not None:
                    self.ttft.observe(now - sink.t_submit)
            sink.put(out)
            if out.finished:
                del self._sinks[out.request_id]
                self._done()
                if self.on_finish is not None:
                    with contextlib.suppress(Exception):
                        self.on_finish(out, now - sink.t_submit)


# ----------------------------------------------------------------------------------------------
# Metrics


class _EngineStatsCollector:
    """Exposes the engine thread's latest ``engine.stats()`` snapshot as Prometheus metrics."""

    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: ANN201 - prometheus_client protocol
        s = self.runner.stats_snapshot
        total = float(s.get("num_total_blocks", 0))
        free = float(s.get("num_free_blocks", total))
        gauges = {
            "paxcache_requests_running": ("Requests running in the engine.", s.get("num_running")),
            "paxcache_requests_waiting": ("Requests waiting in the engine.", s.get("num_waiting")),
            "paxcache_requests_swapped": ("Requests swapped to host.", s.get("num_swapped")),
            "paxcache_kv_blocks_used": ("Device KV blocks in use.", total - free),
            "paxcache_kv_blocks_total": ("Device KV blocks.", total),
            "paxcache_kv_cache_usage_ratio": (
                "Share of device KV blocks in use.",
                s.get("kv_usage"),
            ),
            "paxcache_prefix_cache_hit_rate": (
                "Prefix cache hit rate (tokens).",
                s.get("prefix_cache_hit_rate"),
            ),
            "paxcache_requests_inflight": (
                "Requests accepted by the server, not finished.",
                self.runner.num_inflight,
            ),
            "paxcache_oldest_waiting_request_age_seconds": (
                "Seconds since the oldest request with a queued (waiting or swapped) sequence "
                "arrived.",
                s.get("oldest_waiting_age_s"),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value or 0.0))
        labelled = {
            "paxcache_preemptions_by_mode_total": (
                "Preemptions by mode.",
                "mode",
                {"swap": "num_preemptions_swap", "recompute": "num_preemptions_recompute"},
            ),
            "paxcache_swapped_sequences_total": (
                "Sequences moved between device and host memory.",
                "direction",
                {"out": "num_swapped_out_seqs", "in": "num_swapped_in_seqs"},
            ),
            "paxcache_swapped_blocks_total": (
                "KV blocks moved between device and host memory.",
                "direction",
                {"out": "num_swapped_out_blocks", "in": "num_swapped_in_blocks"},
            ),
        }
        for name, (doc, label, keys) in labelled.items():
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, key in keys.items():
                family.add_metric([value], float(s.get(key) or 0.0))
            yield family
        counters = {
            "paxcache_generated_tokens_total": ("Tokens generated.", s.get("num_generated_tokens")),
            "paxcache_preemptions_total": ("Sequences preempted.", s.get("num_preemptions")),
            "paxcache_compilations_total": (
                "Step-function compilations.",
                s.get("num_compilations"),
            ),
            "paxcache_swaps_total": ("Swap operations.", s.get("num_swaps")),
            "paxcache_engine_errors_total": (
                "Engine steps that raised.",
                self.runner.num_engine_errors,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value or 0.0))
        kernels = GaugeMetricFamily(
            "paxcache_kernel_info",
            "Implementation each kernel op runs (1 per op); fallback: why the kernel is not used.",
            labels=["op", "impl", "fallback"],
        )
        for op, impl in sorted((s.get("kernel_impls") or {}).items()):
            family, _, why = impl.partition(" (fallback: ")
            kernels.add_metric([op, family, why.removesuffix(")")], 1.0)
        yield kernels


# ----------------------------------------------------------------------------------------------
# ASGI middleware (outermost first): request context -> auth -> body limits -> the app


def _scope_state(scope: dict) -> dict:
    return scope.setdefault("state", {})


def _request_id(scope_or_request: Any) -> str | None:
    scope = getattr(scope_or_request, "scope", scope_or_request)
    return scope.get("state", {}).get("request_id")


def _header(scope: dict, name: bytes) -> bytes | None:
    value = None
    for k, v in scope.get("headers", ()):
        if k == name:
            value = v
    return value


async def _send_error(send: Any, scope: dict, err: APIError) -> None:
    """Answers ``err`` directly from middleware (no request body is read)."""
    body = json.dumps(err.body(_request_id(scope)), ensure_ascii=True).encode("ascii")
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _RequestContextMiddleware:
    """Gives every request an id (``x-request-id`` on every response, ``request_id`` in error
    bodies, in the logs), checks the ``Host`` header when ``allowed_hosts`` is set, and turns
    any exception that escapes the app into a logged 500 without details."""

    def __init__(self, app: Any, allowed_hosts: frozenset[str] | None) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"req-{uuid.uuid4().hex[:24]}"
        _scope_state(scope)["request_id"] = rid
        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", ()))
                headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        if self.allowed_hosts is not None and not self._host_ok(scope):
            await _send_error(
                send_with_id,
                scope,
                APIError(400, "invalid Host header (not in --allowed-hosts)", code="invalid_host"),
            )
            return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - never a traceback to the client
            logger.exception("request %s (%s %s) failed", rid, scope.get("method"), scope["path"])
            if not started:
                await _send_error(send_with_id, scope, _internal_error())

    def _host_ok(self, scope: dict) -> bool:
        raw = _header(scope, b"host")
        if raw is None:
            return False
        host = raw.decode("latin-1").strip().lower()
        if host.startswith("["):  # [v6]:port
            host = host[: host.find("]") + 1] if "]" in host else host
        else:
            host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return "*" in self.allowed_hosts or host in self.allowed_hosts


class _AuthMiddleware:
    """With API keys, every route but ``/health`` needs ``Authorization: Bearer KEY``; checked
    before the body is read. Records the caller's tenant (``key-<hash>``, or the client
    address when no keys are set) in the request state."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app: Any, keys: Mapping[str, str]) -> None:
        self.app = app
        self.keys = [(k.encode(), tenant) for k, tenant in keys.items()]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = _scope_state(scope)
        if not self.keys:
            client = scope.get("client")
            state["tenant"] = f"addr-{client[0]}" if client else "addr-unknown"
            state["tenant_keyed"] = False
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        if tenant is None and scope["path"] not in self.OPEN_PATHS:
            await _send_error(
                send,
                scope,
                APIError(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer KEY')",
                    type="authentication_error",
                    code="invalid_api_key",
                ),
            )
            return
        state["tenant"] = tenant
        state["tenant_keyed"] = True
        await self.app(scope, receive, send)

    def _tenant(self, scope: dict) -> str | None:
        header = _header(scope, b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        found = None
        for key, tenant in self.keys:  # compare against every key: no timing of which matched
            if secrets.compare_digest(token, key):
                found = tenant
        return found


class _BodyLimitMiddleware:
    """Reads a request body up front, within ``max_bytes`` (413) and ``timeout_s`` (408),
    then replays it to the app; ``receive`` then passes through (disconnect detection)."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = APIError(
            413, f"request body too large (limit max_body_bytes={self.max_bytes} bytes)"
        )
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                await _send_error(send, scope, APIError(400, "invalid Content-Length header"))
                return
            if n > self.max_bytes:
                await _send_error(send, scope, too_big)
                return
        elif scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        deadline = time.monotonic() + self.timeout_s
        while more:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                await _send_error(
                    send,
                    scope,
                    APIError(
                        408,
                        f"request body not received within body_timeout_s={self.timeout_s:g}",
                    ),
                )
                return
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(send, scope, too_big)
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# ----------------------------------------------------------------------------------------------
# Per-tenant concurrency


class _TenantSlots:
    """Completions in flight per tenant (``ServerLimits.max_inflight_per_tenant``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight: dict[str, int] = {}

    def acquire(self, tenant: str, n: int) -> Callable[[], None]:
        """Reserves ``n`` completions; returns the (idempotent) release.

        Raises:
          APIError: 429 ``tenant_limit`` when the tenant would exceed its limit.
        """
        used = self.inflight.get(tenant, 0)
        if used + n > self.limit:
            raise APIError(
                429,
                f"too many requests in flight for this API key or client: {used} completions "
                f"running, this request adds {n} (limit max_inflight_per_tenant={self.limit}); "
                "retry later",
                type="rate_limit_error",
                code="tenant_limit",
            )
        self.inflight[tenant] = used + n
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self.inflight.get(tenant, 0) - n
                if left > 0:
                    self.inflight[tenant] = left
                else:
                    self.inflight.pop(tenant, None)

        return release


# ----------------------------------------------------------------------------------------------
# Streaming with a stall timeout


class _EventStream(Response):
    """Server-sent events from an async iterator of strings.

    Each send must complete within ``stall_timeout_s``: a client that stops reading (its socket
    buffers full) is dropped and the iterator closed, which aborts its engine requests. A
    client that disconnects is noticed at once (``http.disconnect``): ``on_disconnect`` wakes
    the iterator, which then ends by itself (no reliance on task cancellation, which
    ``asyncio.wait_for`` can swallow on Python < 3.12).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        stall_timeout_s: float,
        *,
        on_stall: Callable[[], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.events = events
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall
        self.on_disconnect = on_disconnect
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.closed = False
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        rid = _request_id(scope)

        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                if self.closed:
                    return
                body = {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
                try:
                    await asyncio.wait_for(send(body), self.stall_timeout_s)
                except TimeoutError:
                    logger.warning(
                        "request %s: client read nothing for %gs; aborting its stream",
                        rid,
                        self.stall_timeout_s,
                    )
                    if self.on_stall is not None:
                        self.on_stall()
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.closed = True
            if self.on_disconnect is not None:
                self.on_disconnect()

        pumping = asyncio.ensure_future(pump())
        watching = asyncio.ensure_future(watch_disconnect())
        try:
            await asyncio.wait([pumping, watching], return_when=asyncio.FIRST_COMPLETED)
            if not pumping.done():  # disconnected: the iterator was woken and ends by itself
                await asyncio.wait([pumping], timeout=self.stall_timeout_s)
        finally:
            watching.cancel()
            if not pumping.done():
                pumping.cancel()
            await asyncio.gather(pumping, watching, return_exceptions=True)
            await self.events.aclose()  # runs the generator's cleanup: aborts what is unfinished
            if self.on_close is not None:  # also when the generator never started
                self.on_close()
        if not pumping.cancelled() and pumping.exception() is not None:
            raise pumping.exception()


# ----------------------------------------------------------------------------------------------
# Request -> engine helpers


def _too_many(param: str, what: str, limit: int, name: str) -> APIError:
    return APIError(400, f"{what}; at most {limit} are allowed (limit {name})", param=param)


def _completion_prompts(body: CompletionRequest, limits: ServerLimits) -> list[str | list[int]]:
    """The prompts of a completions request, within ``max_prompts`` and ``max_choices``."""
    p = body.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif isinstance(p[0], int):
        raw = [list(p)]
    else:
        raw = list(p)
    if len(raw) > limits.max_prompts:
        raise _too_many("prompt", f"{len(raw)} prompts", limits.max_prompts, "max_prompts")
    if len(raw) * body.n > limits.max_choices:
        what = f"{len(raw)} prompts x n={body.n} = {len(raw) * body.n} completions"
        raise _too_many("n", what, limits.max_choices, "max_choices")
    return raw


def _check_chat_limits(body: ChatCompletionRequest, limits: ServerLimits) -> None:
    if len(body.messages) > limits.max_messages:
        what = f"{len(body.messages)} messages"
        raise _too_many("messages", what, limits.max_messages, "max_messages")
    if body.n > limits.max_choices:
        raise _too_many("n", f"n={body.n} completions", limits.max_choices, "max_choices")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")


def _check_limits(
    body: _SamplingFields,
    limits: ServerLimits,
    vocab_size: int | None,
    logprobs: int | None,
    logprobs_param: str,
) -> None:
    """The per-request limits every endpoint shares (400 naming the limit)."""
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise APIError(
            400,
            f"{logprobs_param}={logprobs}; at most {limits.max_logprobs} (limit max_logprobs)",
            param=logprobs_param,
        )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > limits.max_stop:
        raise _too_many("stop", f"{len(stops)} stop strings", limits.max_stop, "max_stop")
    for s in stops:
        if len(s) > limits.max_stop_chars:
            raise APIError(
                400,
                f"a stop string has {len(s)} characters; at most {limits.max_stop_chars} are "
                "allowed (limit max_stop_chars)",
                param="stop",
            )
    ids = body.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        what = f"{len(ids)} stop_token_ids"
        raise _too_many("stop_token_ids", what, limits.max_stop_token_ids, "max_stop_token_ids")
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                400,
                f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size})",
                param="stop_token_ids",
            )
        if body.top_k is not None and body.top_k > vocab_size:
            raise APIError(
                400,
                f"top_k={body.top_k} exceeds the vocabulary size {vocab_size} "
                "(use -1 or 0 for no top-k filter)",
                param="top_k",
            )
    if body.cache_salt is not None and not 0 < len(body.cache_salt) <= limits.max_cache_salt_chars:
        raise APIError(
            400,
            f"cache_salt must have 1 to {limits.max_cache_salt_chars} characters "
            "(limit max_cache_salt_chars)",
            param="cache_salt",
        )


def _sampling_params(
    body: _SamplingFields, *, max_tokens: int, logprobs: int | None, logprobs_param: str
) -> SamplingParams:
    if body.presence_penalty or body.frequency_penalty:
        raise APIError(
            400,
            "presence_penalty and frequency_penalty are not supported (use 0)",
            param="presence_penalty" if body.presence_penalty else "frequency_penalty",
        )
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    top_k = body.top_k if body.top_k is not None else 0
    kwargs = dict(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if top_k < 0 else top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        n=body.n,
        logprobs=logprobs,
        ignore_eos=body.ignore_eos,
        output_kind="delta",
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        param = logprobs_param if field == "logprobs" else field
        raise APIError(400, str(e), param=param if param in kwargs else None) from None


def _check_token_ids(ids: Sequence[int], vocab_size: int | None) -> None:
    if not ids:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                400,
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                param="prompt",
            )


def _message_text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(part.text for part in m.content)


def _render_chat(tokenizer: Any, messages: Sequence[ChatMessage]) -> str:
    msgs = [{"role": m.role, "content": _message_text(m)} for m in messages]
    fn = getattr(tokenizer, "apply_chat_template", None)
    if fn is not None:
        return fn(msgs)
    # Documented fallback: "<|role|>\ncontent\n" per message, then "<|assistant|>\n".
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs) + "<|assistant|>\n"


def _chat_token_ids(tokenizer: Any, text: str) -> list[int]:
    """Tokenizes a rendered chat prompt with special tokens (BOS where the tokenizer adds one),
    dropping the duplicate BOS when the template already wrote one."""
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        ids = ids[1:]
    if not ids:
        raise APIError(400, "the rendered chat prompt is empty", param="messages")
    return ids


def _chat_prompt(tokenizer: Any, messages: Sequence[ChatMessage], request_id: str | None) -> list:
    """Renders (the checkpoint's template, sandboxed) and tokenizes a chat; runs in a worker
    thread. Template errors become 400 (the template rejected the messages) or 500."""
    from paxcache.models.tokenizer import ChatTemplateError

    try:
        return _chat_token_ids(tokenizer, _render_chat(tokenizer, messages))
    except ChatTemplateError as e:
        if e.client_error:
            raise APIError(400, e.public_message, param="messages") from None
        logger.error("request %s: %s", request_id, e)
        raise APIError(
            500, f"{e.public_message} (see the server log)", type="server_error", code="template"
        ) from None


def _tokenize(tokenizer: Any, prompt: str) -> list[int]:
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return ids


def _usage(progress: Sequence[_Progress]) -> dict[str, Any]:
    """OpenAI ``usage`` over a request's prompts (each prompt counted once), with
    ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache)."""
    p = sum(x.prompt_tokens or 0 for x in progress)
    c = sum(len(acc[1]) for x in progress for acc in x.completions.values())
    cached = sum(x.cached or 0 for x in progress)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _request_error(progress: _Progress) -> APIError | None:
    reasons = [acc[3] for acc in progress.completions.values()]
    if not progress.error and "error" not in reasons:
        return None
    if progress.error == INTERNAL_ERROR:
        return APIError(500, INTERNAL_ERROR, type="server_error")
    return APIError(400, progress.error or "the engine could not complete this request")


def _token_str(tokenizer: Any, tid: int) -> str:
    try:
        return tokenizer.decode([tid])
    except Exception:  # noqa: BLE001
        return f"<{tid}>"


def _completion_logprobs(
    tokenizer: Any, entries: Sequence[dict], offset: int = 0
) -> dict[str, list]:
    """Legacy completions ``logprobs`` object from the engine's per-token entries
    (``{"token_id", "logprob", "top": [(id, logprob), ...]}``)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        s = _token_str(tokenizer, int(e.get("token_id", -1)))
        tokens.append(s)
        lps.append(float(e.get("logprob", 0.0)))
        top = e.get("top") or []
        tops.append({_token_str(tokenizer, int(t)): float(lp) for t, lp in top} if top else None)
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_logprobs(tokenizer: Any, entries: Sequence[dict]) -> dict[str, list]:
    """Chat ``logprobs`` object (``{"content": [{"token", "logprob", "bytes", ...}]}``)."""
    content = []
    for e in entries:
        s = _token_str(tokenizer, int(e.get("token_id", -1)))
        top = [
            {
                "token": _token_str(tokenizer, int(t)),
                "logprob": float(lp),
                "bytes": list(_token_str(tokenizer, int(t)).encode()),
            }
            for t, lp in (e.get("top") or [])
        ]
        content.append(
            {
                "token": s,
                "logprob": float(e.get("logprob", 0.0)),
                "bytes": list(s.encode()),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def _finish_reason(reason: str | None) -> str | None:
    """OpenAI finish reasons: an aborted completion (server shutdown) reports "stop"."""
    return "stop" if reason == "abort" else reason


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _tenant_salt(state: Mapping[str, Any], cache_salt: str | None) -> str | None:
    """The engine ``cache_salt`` for a request: with API keys, the tenant's own namespace (its
    default salt, or its ``cache_salt`` inside it); without keys, the client's ``cache_salt``
    (None: the shared cache)."""
    if not state.get("tenant_keyed"):
        return cache_salt
    tenant = state["tenant"]
    return tenant if cache_salt is None else f"{tenant}/{cache_salt}"


def _key_tenants(keys: Sequence[str]) -> dict[str, str]:
    """API key -> tenant name (``key-`` + a hash prefix: the key itself is never logged)."""
    return {k: "key-" + hashlib.sha256(k.encode()).hexdigest()[:16] for k in keys}


# ----------------------------------------------------------------------------------------------
# App factory


def create_app(
    engine: Any,
    *,
    api_key: str | Sequence[str] | None = None,
    max_queue: int | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int | None = None,
    warmup: bool = True,
    limits: ServerLimits | None = None,
    allowed_hosts: Sequence[str] | None = None,
) -> FastAPI:
    """Builds the OpenAI-compatible app around an engine.

    The engine thread starts with the app's lifespan (uvicorn, or ``TestClient`` used as a
    context manager) and is joined when the app shuts down.

    Args:
      engine: a ``paxcache.Engine`` (or anything with its interface).
      api_key: one key or several (one per tenant). If set, every route but ``/health`` needs
        ``Authorization: Bearer <key>``, checked before the body is read.
      max_queue: overrides ``limits.max_queue``.
      served_model_name: the model id clients send and ``/v1/models`` lists (default
        ``engine.model_name``).
      max_body_bytes: overrides ``limits.max_body_bytes``.
      warmup: run ``engine.warmup()`` in the engine thread before ``/health`` reports ready.
      limits: the :class:`ServerLimits` (default: its defaults).
      allowed_hosts: if set, requests whose ``Host`` header (without port) is not listed get
        400 (``"*"`` allows any); guards a key-less server against DNS rebinding.

    Returns:
      The FastAPI app; ``app.state.runner`` is its ``EngineRunner``, ``app.state.limits``
      its limits.
    """
    limits = limits or ServerLimits()
    overrides = {"max_queue": max_queue, "max_body_bytes": max_body_bytes}
    limits = dataclasses.replace(limits, **{k: v for k, v in overrides.items() if v is not None})
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not isinstance(k, str) or not k or k != k.strip() for k in keys):
        raise ValueError("API keys must be non-empty strings without surrounding whitespace")
    model_name = served_model_name or getattr(engine, "model_name", None) or "paxcache"
    model_aliases = {model_name, getattr(engine, "model_name", model_name)}
    max_model_len = int(getattr(engine, "max_model_len", 0) or 0) or None
    tokenizer = getattr(engine, "tokenizer", None)
    model_cfg = getattr(getattr(engine, "model", None), "config", None)
    vocab_size = getattr(model_cfg, "vocab_size", None) or getattr(tokenizer, "vocab_size", None)
    created = int(time.time())
    runner = EngineRunner(engine, max_queue=limits.max_queue, warmup=warmup)
    tenants = _TenantSlots(limits.max_inflight_per_tenant)

    registry = CollectorRegistry()
    registry.register(_EngineStatsCollector(runner))
    runner.ttft = Histogram(
        "paxcache_time_to_first_token_seconds",
        "Time from request arrival to its first generated token.",
        buckets=_TTFT_BUCKETS,
        registry=registry,
    )
    e2e = Histogram(
        "paxcache_e2e_request_latency_seconds",
        "Time from request arrival to its last token.",
        buckets=_LATENCY_BUCKETS,
        registry=registry,
    )
    finished = Counter(
        "paxcache_requests_finished",
        "Engine requests finished, by reason.",
        ["finish_reason"],
        registry=registry,
    )
    rejected = Counter(
        "paxcache_requests_rejected", "Requests refused with 429 (queue full).", registry=registry
    )
    rejected_tenant = Counter(
        "paxcache_requests_rejected_tenant",
        "Requests refused with 429 (the tenant's in-flight limit).",
        registry=registry,
    )
    stalled = Counter(
        "paxcache_streams_stalled",
        "Streams dropped because the client stopped reading.",
        registry=registry,
    )

    def on_finish(out: RequestOutput, latency: float) -> None:
        e2e.observe(latency)
        for o in out.outputs:
            finished.labels(finish_reason=str(o.finish_reason)).inc()

    runner.on_finish = on_finish

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        try:
            yield
        finally:
            await asyncio.to_thread(runner.stop)

    app = FastAPI(title="paxcache", version="0.1.0", lifespan=lifespan)
    app.state.runner = runner
    app.state.registry = registry
    app.state.limits = limits
    # Added innermost first: the request context wraps auth, which wraps the body limits.
    app.add_middleware(
        _BodyLimitMiddleware, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s
    )
    app.add_middleware(_AuthMiddleware, keys=_key_tenants(keys))
    app.add_middleware(
        _RequestContextMiddleware,
        allowed_hosts=frozenset(h.lower() for h in allowed_hosts) if allowed_hosts else None,
    )

    # -- error handlers -------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 500:
            logger.warning("request %s: %d %s", _request_id(request), exc.status, exc.message)
        return exc.response(_request_id(request))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        rid = _request_id(request)
        errs = exc.errors()
        if not errs:
            return APIError(400, "invalid request").response(rid)
        e = errs[0]
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # Union branches show up as loc entries like "str" / "list[int]"; keep the field path.
        path = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int")]
        param = ".".join(path) or None
        kind = e.get("type")
        if kind == "json_invalid":
            msg = "malformed JSON body"
            param = None
        elif kind == "missing":
            msg = f"missing required field '{param}'"
        elif kind == "extra_forbidden":
            msg = f"unsupported field '{_shown(param or '')}': this server does not honour it"
        elif param is None:
            msg = f"invalid request body: {e.get('msg')}"
        else:
            msg = f"invalid value for '{_shown(param)}': {e.get('msg')}"
        return APIError(400, msg, param=param).response(rid)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(
            exc.status_code,
            str(exc.detail),
            type=_STATUS_TYPES.get(exc.status_code, "api_error"),
        ).response(_request_id(request))

    @app.exception_handler(UnicodeError)
    async def _unicode_error(request: Request, exc: UnicodeError) -> JSONResponse:
        return APIError(400, "request body is not valid UTF-8 JSON").response(_request_id(request))

    # -- helpers --------------------------------------------------------------------------------

    def check_model(model: str | None) -> None:
        if model is not None and model not in model_aliases:
            raise APIError(
                404,
                f"the model '{_shown(model)}' does not exist; this server serves '{model_name}'",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    def check_max_tokens(max_tokens: int | None, param: str) -> None:
        if max_tokens is not None and max_model_len is not None and max_tokens >= max_model_len:
            raise APIError(
                400,
                f"{param}={max_tokens} does not fit the model's maximum context "
                f"length of {max_model_len} tokens",
                param=param,
            )

    def check_prompt_len(ids: Sequence[int], param: str) -> None:
        if max_model_len is not None and len(ids) >= max_model_len:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; the model's maximum context length is "
                f"{max_model_len} (the prompt must leave room for at least one token)",
                param=param,
            )

    async def submit(
        request: Request,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        prefix: str,
        cache_salt: str | None,
    ) -> tuple[str, list[str], _Exchange]:
        """Submits one engine request per prompt and waits until all are accepted."""
        exchange = _Exchange(asyncio.get_running_loop(), len(prompts))
        base = f"{prefix}-{uuid.uuid4().hex}"
        ids = [f"{base}-{i}" if len(prompts) > 1 else base for i in range(len(prompts))]
        salt = _tenant_salt(request.scope.get("state", {}), cache_salt)
        subs = [
            _Submission(rid, p, params, _Sink(exchange, i), salt)
            for i, (rid, p) in enumerate(zip(ids, prompts, strict=True))
        ]
        try:
            runner.submit(subs)
        except APIError as e:
            if e.status == 429:
                rejected.inc()
            raise
        try:
            await exchange.wait_accepted()
        except BaseException:
            runner.abort(ids)
            raise
        return base, ids, exchange

    async def collect(request: Request, ids: list[str], exchange: _Exchange) -> list[_Progress]:
        """Waits for every engine request to finish; aborts them if the client disconnects."""
        results = [_Progress() for _ in ids]

        async def watch() -> None:
            while True:
                await asyncio.sleep(_DISCONNECT_POLL_S)
                if await request.is_disconnected():
                    exchange.disconnect()
                    return

        watcher = asyncio.create_task(watch())
        try:
            while not all(r.finished for r in results):
                got, failure = await exchange.take()
                if failure is not None:
                    raise APIError(failure.status, failure.message, type=failure.type)
                if exchange.disconnected:
                    raise APIError(400, "client disconnected")
                for tag, prog in got.items():
                    _fold(results[tag], prog)
        except BaseException:
            runner.abort(ids)
            raise
        finally:
            watcher.cancel()
        return results

    async def stream_events(
        ids: list[str],
        exchange: _Exchange,
        n: int,
        make_chunk: Callable[[int, str, str | None, list[dict] | None], dict],
        first_chunks: list[dict],
        usage_chunk: Callable[[dict[str, Any]], dict] | None,
        release: Callable[[], None],
    ) -> AsyncIterator[str]:
        totals = [_Progress() for _ in ids]
        reported: set[int] = set()
        exchange.streaming = True
        try:
            for ch in first_chunks:
                yield _sse(ch)
            while not all(t.finished for t in totals):
                got, failure = await exchange.take()
                if exchange.disconnected:
                    return
                if failure is not None:
                    yield _sse(APIError(failure.status, failure.message, type=failure.type).body())
                    break
                for tag, prog in got.items():
                    for index, (texts, _, lps, reason) in sorted(prog.completions.items()):
                        idx = tag * n + index
                        delta = "".join(texts)
                        fr = _finish_reason(reason)
                        if delta or lps or (fr is not None and idx not in reported):
                            if fr is not None:
                                reported.add(idx)
                            yield _sse(make_chunk(idx, delta, fr, lps))
                    _fold(totals[tag], prog, keep_text=False)
                    err = _request_error(totals[tag]) if prog.finished else None
                    if err is not None:
                        yield _sse(err.body())
            else:
                if usage_chunk is not None:
                    yield _sse(usage_chunk(_usage(totals)))
            yield "data: [DONE]\n\n"
        finally:
            # Client gone, stalled or a failure: abort what is still running.
            unfinished = [rid for rid, t in zip(ids, totals, strict=True) if not t.finished]
            runner.abort(unfinished)
            release()

    def stream_closer(
        ids: list[str], exchange: _Exchange, release: Callable[[], None]
    ) -> Callable[[], None]:
        """Cleanup for a stream whose generator never ran (the client left before the first
        event): abort its requests and free the tenant's slots (``release`` is idempotent)."""

        def close() -> None:
            if not exchange.streaming:
                runner.abort(ids)
            release()

        return close

    def tenant_slots(request: Request, completions: int) -> Callable[[], None]:
        try:
            tenant = request.scope.get("state", {}).get("tenant", "anonymous")
            return tenants.acquire(tenant, completions)
        except APIError:
            rejected_tenant.inc()
            raise

    # -- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if runner.ready.is_set() and runner.alive:
            return JSONResponse({"status": "ok"})
        if runner.warmup_error:
            return JSONResponse({"status": "error", "detail": runner.warmup_error}, status_code=503)
        if runner.ready.is_set():
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "warming up"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus_generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "paxcache"}
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        return card

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(
                400, "best_of must equal n (best_of > n is not supported)", param="best_of"
            )
        _check_limits(body, limits, vocab_size, body.logprobs, "logprobs")
        raw = _completion_prompts(body, limits)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        check_max_tokens(max_tokens, "max_tokens")
        params = _sampling_params(
            body, max_tokens=max_tokens, logprobs=body.logprobs, logprobs_param="logprobs"
        )
        prompts: list[list[int]] = []
        for q in raw:
            if isinstance(q, str):
                if not q:
                    raise APIError(400, "prompt must not be empty", param="prompt")
                if tokenizer is None:
                    raise APIError(400, "this engine has no tokenizer; send token ids")
                q = await asyncio.to_thread(_tokenize, tokenizer, q)  # noqa: PLW2901
            else:
                _check_token_ids(q, vocab_size)
            check_prompt_len(q, "prompt")
            prompts.append(q)
        release = tenant_slots(request, len(prompts) * body.n)
        try:
            rid, ids, exchange = await submit(request, prompts, params, "cmpl", body.cache_salt)
        except BaseException:
            release()
            raise
        now = int(time.time())
        want_lp = body.logprobs is not None

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def make_chunk(idx: int, delta: str, fr: str | None, lp: list | None) -> dict:
                ch = {
                    "id": rid,
                    "object": "text_completion",
                    "created": now,
                    "model": model_name,
                    "choices": [
                        {
                            "index": idx,
                            "text": delta,
                            "logprobs": _completion_logprobs(tokenizer, lp or [])
                            if want_lp
                            else None,
                            "finish_reason": fr,
                        }
                    ],
                }
                if include_usage:
                    ch["usage"] = None
                return ch

            def usage_chunk(u: dict[str, Any]) -> dict:
                return {
                    "id": rid,
                    "object": "text_completion",
                    "created": now,
                    "model": model_name,
                    "choices": [],
                    "usage": u,
                }

            return _EventStream(
                stream_events(
                    ids,
                    exchange,
                    body.n,
                    make_chunk,
                    [],
                    usage_chunk if include_usage else None,
                    release,
                ),
                limits.stream_stall_timeout_s,
                on_stall=stalled.inc,
                on_disconnect=exchange.disconnect,
                on_close=stream_closer(ids, exchange, release),
            )

        try:
            outs = await collect(request, ids, exchange)
        finally:
            release()
        for o in outs:
            err = _request_error(o)
            if err is not None:
                raise err
        choices = []
        for tag, out in enumerate(outs):
            for index, (texts, _, lps, reason) in out.completions.items():
                choices.append(
                    {
                        "index": tag * body.n + index,
                        "text": "".join(texts),
                        "logprobs": _completion_logprobs(tokenizer, lps or []) if want_lp else None,
                        "finish_reason": _finish_reason(reason),
                    }
                )
        choices.sort(key=lambda ch: ch["index"])
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": now,
                "model": model_name,
                "choices": choices,
                "usage": _usage(outs),
                "system_fingerprint": None,
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this engine has no tokenizer; chat is unavailable")
        _check_limits(body, limits, vocab_size, body.top_logprobs, "top_logprobs")
        _check_chat_limits(body, limits)
        max_tokens = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        check_max_tokens(max_tokens, param)
        lp = (body.top_logprobs or 0) if body.logprobs else None
        # Validate the sampling fields before the (checkpoint-defined) template runs.
        params = _sampling_params(
            body, max_tokens=max_tokens or 1, logprobs=lp, logprobs_param="top_logprobs"
        )
        prompt_ids = await asyncio.to_thread(
            _chat_prompt, tokenizer, body.messages, _request_id(request)
        )
        check_prompt_len(prompt_ids, "messages")
        if max_tokens is None:
            max_tokens = max_model_len - len(prompt_ids) if max_model_len is not None else 256
        params = dataclasses.replace(params, max_tokens=max_tokens)
        release = tenant_slots(request, body.n)
        try:
            rid, ids, exchange = await submit(
                request, [prompt_ids], params, "chatcmpl", body.cache_salt
            )
        except BaseException:
            release()
            raise
        now = int(time.time())

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(idx: int, delta: dict, fr: str | None, lp_: dict | None) -> dict:
                ch = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": now,
                    "model": model_name,
                    "system_fingerprint": None,
                    "choices": [
                        {"index": idx, "delta": delta, "logprobs": lp_, "finish_reason": fr}
                    ],
                }
                if include_usage:
                    ch["usage"] = None
                return ch

            def make_chunk(idx: int, delta: str, fr: str | None, lps: list | None) -> dict:
                return chunk(
                    idx,
                    {"content": delta} if delta else {},
                    fr,
                    _chat_logprobs(tokenizer, lps or []) if lp is not None else None,
                )

            def usage_chunk(u: dict[str, Any]) -> dict:
                return {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": now,
                    "model": model_name,
                    "choices": [],
                    "usage": u,
                }

            first = [
                chunk(j, {"role": "assistant", "content": ""}, None, None) for j in range(body.n)
            ]
            return _EventStream(
                stream_events(
                    ids,
                    exchange,
                    body.n,
                    make_chunk,
                    first,
                    usage_chunk if include_usage else None,
                    release,
                ),
                limits.stream_stall_timeout_s,
                on_stall=stalled.inc,
                on_disconnect=exchange.disconnect,
                on_close=stream_closer(ids, exchange, release),
            )

        try:
            outs = await collect(request, ids, exchange)
        finally:
            release()
        err = _request_error(outs[0])
        if err is not None:
            raise err
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": "".join(texts)},
                "logprobs": _chat_logprobs(tokenizer, lps or []) if lp is not None else None,
                "finish_reason": _finish_reason(reason),
            }
            for index, (texts, _, lps, reason) in outs[0].completions.items()
        ]
        choices.sort(key=lambda ch: ch["index"])
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": now,
                "model": model_name,
                "choices": choices,
                "usage": _usage(outs),
                "system_fingerprint": None,
            }
        )

    return app


def _fold(total: _Progress, new: _Progress, keep_text: bool = True) -> None:
    """Adds ``new`` (progress since the last take) into ``total`` (a request's whole result;
    streaming keeps only counts and finish state, not the text it already sent)."""
    for index, (texts, ids, lps, reason) in new.completions.items():
        acc = total.completions.setdefault(index, [[], [], None, None])
        if keep_text:
            acc[0].extend(texts)
            if lps is not None:
                if acc[2] is None:
                    acc[2] = []
                acc[2].extend(lps)
        acc[1].extend(ids)
        if reason is not None:
            acc[3] = reason
    total.finished = total.finished or new.finished
    total.error = total.error or new.error
    if new.prompt_tokens is not None:
        total.prompt_tokens = new.prompt_tokens
    if new.cached is not None:
        total.cached = new.cached
