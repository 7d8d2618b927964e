"""OpenAI-compatible HTTP server for a paxcache ``Engine`` (FastAPI + uvicorn, extra ``serve``).

Architecture: one background thread (``EngineRunner``) owns the engine. Request handlers never
touch the engine; they hand requests to the thread through a lock-protected queue and receive
events back on a per-HTTP-request ``asyncio.Queue`` (``loop.call_soon_threadsafe``). The thread
loops: abort requests whose clients went away, add pending requests, ``engine.step()``, and
dispatch each ``RequestOutput`` to its request's queue; it sleeps on a condition variable when
there is nothing to do (no busy spin). An exception from the engine fails only the requests in
flight at that moment (an error response, or a final SSE error event) and the server keeps
serving.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as server-sent
events when ``"stream": true``, ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``
(503 until the engine is warmed up), ``GET /metrics`` (Prometheus text).

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input
(FastAPI's 422 is turned into 400), 401 for a missing/wrong API key, 404 for an unknown model,
413 for a body over the size limit, 429 when too many requests are in flight, 503 while
shutting down or when the engine failed the request.

Multi-host (``jax.process_count() > 1``): every process must make the same engine calls in the
same order (the jitted step is one SPMD program over every host's devices), and only process 0
serves HTTP. Each round, process 0's engine thread first broadcasts (``sharding.
broadcast_from_leader``) that round's new requests, aborts, whether to sample stats, and a
shutdown flag, then applies them and steps; every other process runs :func:`run_follower`,
which receives the same round and makes the same calls. Requests without a seed get one drawn
on process 0, so sampling matches on every host. While idle the leader still sends an empty
round every few seconds (a heartbeat); on shutdown it sends a final round that ends the
followers.

Extensions beyond OpenAI's fields (as in vLLM): ``top_k`` (-1 or 0 = off), ``min_p``,
``stop_token_ids``, ``ignore_eos``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as prometheus_generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from paxcache.outputs import CompletionOutput, RequestOutput
from paxcache.sampling import MAX_LOGPROBS, MAX_N, SamplingParams

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUEUE",
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "EngineRunner",
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
_HEARTBEAT_S = 5.0
"""Multi-host: most seconds between two broadcast rounds while the leader is idle."""


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

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


# ----------------------------------------------------------------------------------------------
# Request bodies (strict: "5" is not an int, "yes" is not a bool).


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions`` (OpenAI legacy completions)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


# ----------------------------------------------------------------------------------------------
# The engine thread


@dataclass
class _Failed:
    """An event telling a handler its engine request failed."""

    status: int
    message: str
    type: str = "invalid_request_error"


_ACCEPTED = "accepted"


class _Sink:
    """Where the engine thread delivers one engine request's events: ``(tag, event)`` pairs."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, tag: int) -> None:
        self.loop = loop
        self.queue = queue
        self.tag = tag
        self.t_submit = time.monotonic()
        self.got_first_token = False

    def put(self, event: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the handler's loop is gone (shutdown)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.tag, event))


@dataclass
class _Submission:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: _Sink


class EngineRunner:
    """Owns the engine in one background thread; handlers talk to it only through ``submit``
    and ``abort``.

    Args:
      engine: an object with the ``Engine`` interface (``add_request``, ``step``, ``abort``,
        ``has_unfinished_requests``, ``stats``, ``warmup``).
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
                    f"server busy: {self._inflight} requests in flight (max {self.max_queue}); "
                    "retry later",
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
            except Exception as e:  # noqa: BLE001
                logger.exception("engine warm-up failed")
                self.warmup_error = f"warm-up failed: {e}"
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
                self._fail_all(503, "engine loop error", "engine_error")
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
        subs = []
        for sub in pending:
            if sub.params.seed is None:
                sub = dataclasses.replace(  # noqa: PLW2901
                    sub, params=dataclasses.replace(sub.params, seed=secrets.randbits(62))
                )
            subs.append(sub)
        stats_due = time.monotonic() - self._last_stats_t >= self._stats_interval_s
        payload = {
            "stop": stopping,
            # On shutdown the leader aborts (``_fail_all``) the requests it tracks, in order.
            "aborts": list(self._sinks) if stopping else list(aborts),
            "adds": []
            if stopping
            else [(s.request_id, s.prompt, s.params) for s in subs if s.request_id not in aborts],
            "stats": stats_due,
        }
        from paxcache import sharding

        sharding.broadcast_from_leader(payload)
        return subs, stats_due

    def _add(self, sub: _Submission) -> None:
        try:
            self.engine.add_request(sub.request_id, sub.prompt, sub.params)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, ValueError):
                sub.sink.put(_Failed(400, str(e)))
            else:
                logger.exception("engine.add_request failed")
                sub.sink.put(_Failed(503, f"engine error: {e}", "engine_error"))
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
        except Exception as e:  # noqa: BLE001
            logger.exception(
                "engine.step() failed; failing the %d requests in flight", len(self._sinks)
            )
            self.num_engine_errors += 1
            self._fail_all(503, f"engine error: {e}", "engine_error")
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


def _process_count() -> int:
    """``jax.process_count()`` if JAX is already imported (never imports it: fake engines)."""
    jax = sys.modules.get("jax")
    return int(jax.process_count()) if jax is not None else 1


def run_follower(engine: Any, *, warmup: bool = True) -> None:
    """Runs ``engine`` on a process other than 0 of a multi-host server, until it shuts down.

    Mirrors process 0's ``EngineRunner`` (see the module docstring): warms up, then each round
    receives process 0's payload and makes the same ``abort`` / ``add_request`` / ``step`` /
    ``stats`` calls in the same order, discarding the outputs. Returns when process 0 sends its
    shutdown round.

    Args:
      engine: this process's ``Engine``, built with the same arguments as process 0's.
      warmup: call ``engine.warmup()`` first (as process 0's ``create_app(warmup=)``).
    """
    from paxcache import sharding

    if warmup:
        try:
            engine.warmup()
        except Exception:  # noqa: BLE001 - the leader keeps going too
            logger.exception("engine warm-up failed")
    live: dict[str, None] = {}  # the leader's sinks: requests added and not finished, in order

    def stats() -> None:
        try:
            engine.stats()
        except Exception:  # noqa: BLE001
            logger.exception("engine.stats() failed")

    def abort(rid: str) -> None:
        live.pop(rid, None)
        try:
            engine.abort(rid)
        except Exception:  # noqa: BLE001
            logger.exception("engine.abort(%r) failed", rid)

    stats()
    while True:
        payload = sharding.broadcast_from_leader(None)
        for rid in payload["aborts"]:
            abort(rid)
        if payload["stop"]:
            stats()
            logger.info("leader shut down; follower exiting")
            return
        for rid, prompt, params in payload["adds"]:
            try:
                engine.add_request(rid, prompt, params)
            except Exception:  # noqa: BLE001 - the leader got the same error and answered it
                continue
            live[rid] = None
        if not engine.has_unfinished_requests():
            stats()
            continue
        try:
            outs = engine.step()
        except Exception:  # noqa: BLE001 - as the leader: fail (abort) the requests in flight
            logger.exception("engine.step() failed; aborting the requests in flight")
            outs = []
            for rid in list(live):
                abort(rid)
        for out in outs:
            if out.finished:
                live.pop(out.request_id, None)
        if payload["stats"]:
            stats()


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
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value or 0.0))
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
# Middleware


class _BodyLimitMiddleware:
    """Answers 413 for request bodies over ``max_bytes`` (declared or actually sent)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send: Any, status: int, message: str) -> None:
        body = json.dumps(APIError(status, message).body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                length = v
        too_big = f"request body too large (limit {self.max_bytes} bytes)"
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                await self._reject(send, 400, "invalid Content-Length header")
                return
            if n > self.max_bytes:
                await self._reject(send, 413, too_big)
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): buffer up to the limit, then replay.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(send, 413, too_big)
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
# Request -> engine helpers


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


def _merge(prev: RequestOutput | None, new: RequestOutput) -> RequestOutput:
    """Folds a step's output into the request's latest state, completion by completion (a step
    may report only the completions that progressed)."""
    if prev is None:
        return new
    by_index = {c.index: c for c in prev.outputs}
    by_index.update({c.index: c for c in new.outputs})
    return RequestOutput(
        request_id=new.request_id,
        prompt=new.prompt if new.prompt is not None else prev.prompt,
        prompt_token_ids=new.prompt_token_ids or prev.prompt_token_ids,
        outputs=[by_index[i] for i in sorted(by_index)],
        finished=new.finished,
        error=new.error or prev.error,
    )


def _usage(outs: Sequence[RequestOutput]) -> dict[str, int]:
    """OpenAI ``usage`` over requests (prompt tokens counted once per prompt)."""
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _check_error(outs: Sequence[RequestOutput]) -> None:
    for o in outs:
        if o.error or any(c.finish_reason == "error" for c in o.outputs):
            raise APIError(
                400,
                o.error or "the engine could not complete this request",
                type="invalid_request_error",
            )


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


def _finish_reason(c: CompletionOutput) -> str | None:
    """OpenAI finish reasons: an aborted completion (server shutdown) reports "stop"."""
    r = c.finish_reason
    return "stop" if r == "abort" else r


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ----------------------------------------------------------------------------------------------
# App factory


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    warmup: bool = True,
) -> FastAPI:
    """Builds the OpenAI-compatible app around an engine.

    The engine thread starts with the app's lifespan (uvicorn, or ``TestClient`` used as a
    context manager) and is joined when the app shuts down.

    Args:
      engine: a ``paxcache.Engine`` (or anything with its interface).
      api_key: if set, every ``/v1/*`` request needs ``Authorization: Bearer <api_key>``.
      max_queue: most engine requests in flight (one per prompt; ``n`` completions of a prompt
        count once) before new requests get 429.
      served_model_name: the model id clients send and ``/v1/models`` lists (default
        ``engine.model_name``).
      max_body_bytes: request body size limit (413 beyond it).
      warmup: run ``engine.warmup()`` in the engine thread before ``/health`` reports ready.

    Returns:
      The FastAPI app; ``app.state.runner`` is its ``EngineRunner``.
    """
    model_name = served_model_name or getattr(engine, "model_name", None) or "paxcache"
    model_aliases = {model_name, getattr(engine, "model_name", model_name)}
    max_model_len = int(getattr(engine, "max_model_len", 0) or 0) or None
    tokenizer = getattr(engine, "tokenizer", None)
    vocab_size = getattr(tokenizer, "vocab_size", None)
    created = int(time.time())
    runner = EngineRunner(engine, max_queue=max_queue, warmup=warmup)

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
    app.add_middleware(_BodyLimitMiddleware, max_bytes=max_body_bytes)

    # -- error handlers -------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        if not errs:
            return APIError(400, "invalid request").response()
        e = errs[0]
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # Union branches show up as loc entries like "str" / "list[int]"; keep the field path.
        path = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int")]
        param = ".".join(path) or None
        if e.get("type") == "json_invalid":
            msg = f"malformed JSON body: {e.get('msg')}"
            param = None
        elif e.get("type") == "missing":
            msg = f"missing required field '{param}'"
        elif param is None:
            msg = f"invalid request body: {e.get('msg')}"
        else:
            msg = f"invalid value for '{param}': {e.get('msg')}"
        return APIError(400, msg, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(
            exc.status_code, str(exc.detail), type=_STATUS_TYPES.get(exc.status_code, "api_error")
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(
            503, f"internal error: {type(exc).__name__}", type="service_unavailable"
        ).response()

    # -- helpers --------------------------------------------------------------------------------

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer KEY')",
                type="authentication_error",
                code="invalid_api_key",
            )

    def check_model(model: str | None) -> None:
        if model is not None and model not in model_aliases:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{model_name}'",
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

    async def submit(
        prompts: Sequence[str | list[int]], params: SamplingParams, prefix: str
    ) -> tuple[str, list[str], asyncio.Queue]:
        """Submits one engine request per prompt and waits until all are accepted."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        base = f"{prefix}-{uuid.uuid4().hex}"
        ids = [f"{base}-{i}" if len(prompts) > 1 else base for i in range(len(prompts))]
        subs = [
            _Submission(rid, p, params, _Sink(loop, queue, i))
            for i, (rid, p) in enumerate(zip(ids, prompts, strict=True))
        ]
        try:
            runner.submit(subs)
        except APIError as e:
            if e.status == 429:
                rejected.inc()
            raise
        # All submissions are added by the engine thread before its next step, so the first
        # len(prompts) events are acceptances or failures.
        failure: _Failed | None = None
        try:
            for _ in prompts:
                _, ev = await queue.get()
                if isinstance(ev, _Failed) and failure is None:
                    failure = ev
        except asyncio.CancelledError:
            runner.abort(ids)
            raise
        if failure is not None:
            runner.abort(ids)
            raise APIError(failure.status, failure.message, type=failure.type)
        return base, ids, queue

    async def collect(
        request: Request, ids: list[str], queue: asyncio.Queue
    ) -> list[RequestOutput]:
        """Waits for every engine request to finish; aborts them if the client disconnects."""
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}

        async def watch() -> None:
            while True:
                await asyncio.sleep(_DISCONNECT_POLL_S)
                if await request.is_disconnected():
                    runner.abort(ids)
                    queue.put_nowait((-1, None))
                    return

        watcher = asyncio.create_task(watch())
        try:
            while len(finals) < len(ids):
                tag, ev = await queue.get()
                if tag < 0:
                    raise APIError(400, "client disconnected")
                if isinstance(ev, _Failed):
                    runner.abort(ids)
                    raise APIError(ev.status, ev.message, type=ev.type)
                if isinstance(ev, RequestOutput):
                    latest[tag] = _merge(latest.get(tag), ev)
                    if ev.finished:
                        finals[tag] = latest[tag]
        except asyncio.CancelledError:
            runner.abort(ids)
            raise
        finally:
            watcher.cancel()
        return [finals[i] for i in range(len(ids))]

    async def stream_events(
        ids: list[str],
        queue: asyncio.Queue,
        n: int,
        make_chunk: Callable[[int, CompletionOutput, str, list[dict] | None], dict],
        first_chunks: list[dict],
        usage_chunk: Callable[[dict[str, int]], dict] | None,
    ) -> AsyncIterator[str]:
        finished: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}
        sent_text: dict[int, str] = {}
        sent_lp: dict[int, int] = {}
        reported: set[int] = set()
        try:
            for ch in first_chunks:
                yield _sse(ch)
            while len(finished) < len(ids):
                tag, ev = await queue.get()
                if isinstance(ev, _Failed):
                    yield _sse(APIError(ev.status, ev.message, type=ev.type).body())
                    break
                if not isinstance(ev, RequestOutput):
                    continue
                for c in ev.outputs:
                    idx = tag * n + c.index
                    prev = sent_text.get(idx, "")
                    # If the engine ever revised its text, fall back to its own delta.
                    delta = c.text[len(prev) :] if c.text.startswith(prev) else c.new_text
                    sent_text[idx] = c.text
                    lp = None
                    if c.logprobs is not None:
                        lp = c.logprobs[sent_lp.get(idx, 0) :]
                        sent_lp[idx] = len(c.logprobs)
                    fr = _finish_reason(c)
                    if delta or lp or (fr is not None and idx not in reported):
                        if fr is not None:
                            reported.add(idx)
                        yield _sse(make_chunk(idx, c, delta, lp))
                latest[tag] = _merge(latest.get(tag), ev)
                if ev.finished:
                    finished[tag] = latest[tag]
                    if ev.error:
                        yield _sse(APIError(400, ev.error).body())
            else:
                if usage_chunk is not None:
                    yield _sse(usage_chunk(_usage(list(finished.values()))))
            yield "data: [DONE]\n\n"
        finally:
            # Client gone (the task was cancelled) or a failure: abort what is still running.
            if len(finished) < len(ids):
                runner.abort([rid for i, rid in enumerate(ids) if i not in finished])

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
    async def list_models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        check_auth(request)
        check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_auth(request)
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(
                400, "best_of must equal n (best_of > n is not supported)", param="best_of"
            )
        p = body.prompt
        prompts: list[str | list[int]]
        if isinstance(p, str):
            prompts = [p]
        elif not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        elif isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = list(p)
        for q in prompts:
            if isinstance(q, list):
                _check_token_ids(q, vocab_size)
            elif not q:
                raise APIError(400, "prompt must not be empty", param="prompt")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        check_max_tokens(max_tokens, "max_tokens")
        params = _sampling_params(
            body, max_tokens=max_tokens, logprobs=body.logprobs, logprobs_param="logprobs"
        )
        rid, ids, queue = await submit(prompts, params, "cmpl")
        now = int(time.time())
        want_lp = body.logprobs is not None

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def make_chunk(idx: int, c: CompletionOutput, delta: str, lp: list | None) -> dict:
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
                            "finish_reason": _finish_reason(c),
                        }
                    ],
                }
                if include_usage:
                    ch["usage"] = None
                return ch

            def usage_chunk(u: dict[str, int]) -> dict:
                return {
                    "id": rid,
                    "object": "text_completion",
                    "created": now,
                    "model": model_name,
                    "choices": [],
                    "usage": u,
                }

            return StreamingResponse(
                stream_events(
                    ids, queue, body.n, make_chunk, [], usage_chunk if include_usage else None
                ),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )

        outs = await collect(request, ids, queue)
        _check_error(outs)
        choices = []
        for tag, out in enumerate(outs):
            for c in out.outputs:
                choices.append(
                    {
                        "index": tag * body.n + c.index,
                        "text": c.text,
                        "logprobs": _completion_logprobs(tokenizer, c.logprobs or [])
                        if want_lp
                        else None,
                        "finish_reason": _finish_reason(c),
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
        check_auth(request)
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this engine has no tokenizer; chat is unavailable")
        prompt_ids = _chat_token_ids(tokenizer, _render_chat(tokenizer, body.messages))
        max_tokens = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        check_max_tokens(max_tokens, param)
        if max_tokens is None:
            n_prompt = len(prompt_ids)
            if max_model_len is not None:
                max_tokens = max_model_len - n_prompt
                if max_tokens < 1:
                    raise APIError(
                        400,
                        f"the messages take {n_prompt} tokens, the model's "
                        f"maximum context length is {max_model_len}",
                        param="messages",
                    )
            else:
                max_tokens = 256
        lp = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        params = _sampling_params(
            body, max_tokens=max_tokens, logprobs=lp, logprobs_param="top_logprobs"
        )
        rid, ids, queue = await submit([prompt_ids], params, "chatcmpl")
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

            def make_chunk(idx: int, c: CompletionOutput, delta: str, lps: list | None) -> dict:
                return chunk(
                    idx,
                    {"content": delta} if delta else {},
                    _finish_reason(c),
                    _chat_logprobs(tokenizer, lps or []) if lp is not None else None,
                )

            def usage_chunk(u: dict[str, int]) -> dict:
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
            return StreamingResponse(
                stream_events(
                    ids, queue, body.n, make_chunk, first, usage_chunk if include_usage else None
                ),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )

        outs = await collect(request, ids, queue)
        _check_error(outs)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(tokenizer, c.logprobs or []) if lp is not None else None,
                "finish_reason": _finish_reason(c),
            }
            for c in outs[0].outputs
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
