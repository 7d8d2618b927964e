"""What every route handler shares: the engine's facts, the limits, the engine thread, the
metrics and the tenants, plus a request's session with the engine thread.

:class:`ServerContext` is built once by :func:`paxcache.server.routes.create_app` and kept in
``app.state.ctx``. Its session methods are the only way handlers reach the engine:
:meth:`~ServerContext.submit` (queue one engine request per prompt, wait until all are
accepted), then either :meth:`~ServerContext.collect` (wait for the whole result, aborting
if the client goes away) or :meth:`~ServerContext.stream` (an SSE response).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from paxcache.sampling import SamplingParams
from paxcache.server.metrics import ServerMetrics
from paxcache.server.protocol import APIError, ServerLimits, shown
from paxcache.server.runner import EngineRunner, Exchange, Progress, Sink, Submission, fold
from paxcache.server.shutdown import ShutdownGate
from paxcache.server.streaming import ChunkFn, EventStream, stream_events
from paxcache.server.tenants import TenantSlots, tenant_salt

__all__ = ["ServerContext"]

_DISCONNECT_POLL_S = 0.25


@dataclass
class ServerContext:
    """Shared state of one app.

    Attributes:
      runner: the engine thread.
      limits: the server's limits.
      metrics: the server's metrics.
      tenants: per-tenant in-flight completions.
      model_name: the id clients send and ``/v1/models`` lists.
      model_aliases: ids accepted in ``model`` (the served name and the engine's own).
      max_model_len: the engine's context length (None: unknown).
      tokenizer: the engine's tokenizer (None: token-id prompts only, no chat).
      vocab_size: the model's vocabulary size (None: unknown).
      created: the ``created`` time of the model card.
      shutdown: the shutdown state (draining, and the requests a shutdown must end).
      weights: the served weights' ``quantization`` (None: unquantized), ``weight_dtype`` and
        ``kv_cache_dtype`` (from ``engine.stats()``; empty when the engine has none).
    """

    runner: EngineRunner
    limits: ServerLimits
    metrics: ServerMetrics
    tenants: TenantSlots
    model_name: str
    model_aliases: frozenset[str]
    max_model_len: int | None
    tokenizer: Any
    vocab_size: int | None
    created: int
    shutdown: ShutdownGate
    weights: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        engine: Any,
        runner: EngineRunner,
        limits: ServerLimits,
        metrics: ServerMetrics,
        served_model_name: str | None,
    ) -> ServerContext:
        """Reads the engine's facts (name, context length, tokenizer, vocabulary)."""
        model_name = served_model_name or getattr(engine, "model_name", None) or "paxcache"
        tokenizer = getattr(engine, "tokenizer", None)
        model_cfg = getattr(getattr(engine, "model", None), "config", None)
        return cls(
            runner=runner,
            limits=limits,
            metrics=metrics,
            tenants=TenantSlots(limits.max_inflight_per_tenant),
            model_name=model_name,
            model_aliases=frozenset({model_name, getattr(engine, "model_name", model_name)}),
            max_model_len=int(getattr(engine, "max_model_len", 0) or 0) or None,
            tokenizer=tokenizer,
            vocab_size=getattr(model_cfg, "vocab_size", None)
            or getattr(tokenizer, "vocab_size", None),
            created=int(time.time()),
            shutdown=ShutdownGate(),
            weights=_weights(engine),
        )

    # -- checks ----------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """404 for a ``model`` this server does not serve (None: the served one)."""
        if model is not None and model not in self.model_aliases:
            raise APIError(
                404,
                f"the model '{shown(model)}' does not exist; this server serves "
                f"'{self.model_name}'",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    def check_max_tokens(self, max_tokens: int | None, param: str) -> None:
        """400 when ``max_tokens`` alone does not fit the context."""
        limit = self.max_model_len
        if max_tokens is not None and limit is not None and max_tokens >= limit:
            raise APIError(
                400,
                f"{param}={max_tokens} does not fit the model's maximum context "
                f"length of {limit} tokens",
                param=param,
            )

    def check_prompt_len(self, ids: Sequence[int], param: str) -> None:
        """400 when a prompt leaves no room for one generated token."""
        limit = self.max_model_len
        if limit is not None and len(ids) >= limit:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; the model's maximum context length is "
                f"{limit} (the prompt must leave room for at least one token)",
                param=param,
            )

    def model_card(self) -> dict[str, Any]:
        """The ``/v1/models`` entry of the served model."""
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "paxcache",
        }
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        card.update(self.weights)
        return card

    def tenant_slots(self, request: Request, completions: int) -> Callable[[], None]:
        """Reserves the caller's tenant ``completions`` slots; returns the release.

        Raises:
          APIError: 429 ``tenant_limit``.
        """
        try:
            tenant = request.scope.get("state", {}).get("tenant", "anonymous")
            return self.tenants.acquire(tenant, completions)
        except APIError:
            self.metrics.rejected_tenant.inc()
            raise

    # -- a request's session with the engine thread ---------------------------------------------

    async def submit(
        self,
        request: Request,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        prefix: str,
        cache_salt: str | None,
    ) -> tuple[str, list[str], Exchange]:
        """Submits one engine request per prompt and waits until all are accepted.

        Returns:
          ``(response id, engine request ids, exchange)``.

        Raises:
          APIError: 429 / 503 from the runner, or the engine's refusal of a prompt.
        """
        exchange = Exchange(asyncio.get_running_loop(), len(prompts))
        base = f"{prefix}-{uuid.uuid4().hex}"
        ids = [f"{base}-{i}" if len(prompts) > 1 else base for i in range(len(prompts))]
        salt = tenant_salt(request.scope.get("state", {}), cache_salt)
        subs = [
            Submission(rid, p, params, Sink(exchange, i), salt)
            for i, (rid, p) in enumerate(zip(ids, prompts, strict=True))
        ]
        self.shutdown.track(exchange)  # 503 once a shutdown is aborting what runs
        try:
            self.runner.submit(subs)
        except APIError as e:
            self.shutdown.untrack(exchange)
            if e.status == 429:
                self.metrics.rejected.inc()
            raise
        try:
            await exchange.wait_accepted()
        except BaseException:
            self.shutdown.untrack(exchange)
            self.runner.abort(ids)
            raise
        return base, ids, exchange

    async def collect(self, request: Request, ids: list[str], exchange: Exchange) -> list[Progress]:
        """Waits for every engine request to finish; aborts them if the client disconnects."""
        results = [Progress() for _ in ids]

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
                    raise failure.error()
                if exchange.disconnected:
                    raise APIError(400, "client disconnected")
                for tag, prog in got.items():
                    fold(results[tag], prog)
        except BaseException:
            self.runner.abort(ids)
            raise
        finally:
            watcher.cancel()
            self.shutdown.untrack(exchange)
        return results

    def stream(
        self,
        ids: list[str],
        exchange: Exchange,
        n: int,
        make_chunk: ChunkFn,
        first_chunks: list[dict],
        usage_chunk: Callable[[dict[str, Any]], dict] | None,
        release: Callable[[], None],
        on_progress: Callable[[int, Progress], None] | None = None,
    ) -> EventStream:
        """The SSE response of submitted requests (arguments as in
        :func:`paxcache.server.streaming.stream_events`)."""

        def close() -> None:
            # The client left before the first event: the generator never ran, so abort here.
            if not exchange.streaming:
                self.runner.abort(ids)
            self.shutdown.untrack(exchange)
            release()

        events = stream_events(
            self.runner, ids, exchange, n, make_chunk, first_chunks, usage_chunk, release,
            on_progress,
        )  # fmt: skip
        return EventStream(
            events,
            self.limits.stream_stall_timeout_s,
            on_stall=self.metrics.stalled.inc,
            on_disconnect=exchange.disconnect,
            on_close=close,
        )


def _weights(engine: Any) -> dict[str, Any]:
    """The model card's weight facts from ``engine.stats()`` (empty without them)."""
    stats = getattr(engine, "stats", None)
    if stats is None:
        return {}
    s = stats()
    keys = ("quantization", "weight_dtype", "kv_cache_dtype")
    return {k: s[k] for k in keys if k in s}
