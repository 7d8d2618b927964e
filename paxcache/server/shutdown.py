"""Graceful shutdown: on SIGTERM/SIGINT the server drains, then ends what is left itself.

With ``T`` = the shutdown timeout, counted from the signal:

1. **Draining.** The listening socket stays open. Every new request but ``GET /health`` and
   ``GET /metrics`` gets a 503 with the OpenAI error body (``Connection: close``); ``/health``
   says ``"shutting down"`` (load balancers take the server out). Requests in flight go on.
2. **Abort.** Once nothing is in flight, or at ``T - grace`` (``grace = min(1 s, T / 4)``), the
   server fails every request still running with a 503 "server is shutting down"
   (:meth:`ShutdownGate.abort_inflight`). Their handlers abort the engine requests through the
   runner's usual abort path (blocks freed, counted as aborts) and answer: a stream sends a
   last chunk with ``finish_reason: "abort"`` for each unfinished choice, an error event and
   ``data: [DONE]``; a non-streaming request gets a JSON 503 carrying its ``x-request-id``.
3. **uvicorn's shutdown.** Sockets and connections close, the lifespan shutdown joins the
   engine thread, and the process exits 0.

A second signal skips the rest of the drain (step 2 at once). uvicorn alone would cancel the
handlers' tasks at the timeout instead, cutting streams with no final event and answering a
bare 500; :class:`DrainingServer` is uvicorn's ``Server`` with that order changed.
"""

from __future__ import annotations

import logging
import time
import weakref
from types import FrameType

import uvicorn

from paxcache.server.protocol import APIError
from paxcache.server.runner import Exchange, Failed

__all__ = ["SHUTTING_DOWN", "DrainingServer", "ShutdownGate"]

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "server is shutting down"


class ShutdownGate:
    """The server's shutdown state, shared by the middleware, the handlers and the server.

    Attributes:
      draining: new requests are refused (503) from now on.
      aborting: requests in flight were ended; new engine submissions are refused.
      active: HTTP requests being handled (counted by the request-context middleware).
      open_paths: paths still served while draining (health checks, metrics scrapes).
    """

    open_paths = frozenset({"/health", "/metrics"})

    def __init__(self) -> None:
        self.draining = False
        self.aborting = False
        self.active = 0
        self._exchanges: weakref.WeakSet[Exchange] = weakref.WeakSet()

    def refuses(self, path: str) -> bool:
        """Whether a new request to ``path`` is answered 503 (draining)."""
        return self.draining and path not in self.open_paths

    def refusal(self) -> APIError:
        """The 503 of a request the server will not start (draining or aborting)."""
        return APIError(503, SHUTTING_DOWN, type="service_unavailable", code="shutting_down")

    def track(self, exchange: Exchange) -> None:
        """Remembers a request's exchange so :meth:`abort_inflight` can end it.

        Raises:
          APIError: 503 once the server is aborting what is in flight.
        """
        if self.aborting:
            raise self.refusal()
        self._exchanges.add(exchange)

    def untrack(self, exchange: Exchange) -> None:
        """Forgets a request that has ended."""
        self._exchanges.discard(exchange)

    def abort_inflight(self) -> int:
        """Fails every request still running with a 503 "server is shutting down"; returns
        how many there were. Idempotent."""
        self.draining = self.aborting = True
        failure = Failed(503, SHUTTING_DOWN, "service_unavailable")
        return sum(ex.shut_down(failure) for ex in list(self._exchanges))


class DrainingServer(uvicorn.Server):
    """uvicorn's ``Server`` that drains, then aborts, before its own shutdown (module doc).

    Args:
      config: the uvicorn config.
      gate: the app's :class:`ShutdownGate` (``app.state.shutdown``).
      shutdown_timeout_s: ``T``, seconds from the signal to the end of the shutdown.
    """

    def __init__(
        self, config: uvicorn.Config, gate: ShutdownGate, shutdown_timeout_s: float
    ) -> None:
        if shutdown_timeout_s < 0:
            raise ValueError(f"shutdown timeout must be >= 0 seconds, got {shutdown_timeout_s}")
        super().__init__(config)
        self.gate = gate
        self.shutdown_timeout_s = shutdown_timeout_s
        self.drain_started: float | None = None  # monotonic time of the first signal
        self._abort_at = 0.0
        self._end_at = 0.0

    @property
    def grace_s(self) -> float:
        """Seconds between aborting what is in flight and the end of the timeout."""
        return min(1.0, self.shutdown_timeout_s / 4)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler: starts the drain (only plain attributes change here; the
        event loop acts on them at its next tick)."""
        if not self.started or self.should_exit:  # not serving yet, or already stopping
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)
        if self.drain_started is None:
            self.begin_drain()
        else:
            self._abort_at = time.monotonic()  # a second signal: abort now

    def begin_drain(self) -> None:
        """Starts draining now (what the first SIGTERM/SIGINT does)."""
        now = time.monotonic()
        self.drain_started = now
        self._end_at = now + self.shutdown_timeout_s
        self._abort_at = self._end_at - self.grace_s
        self.gate.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            self._drain_tick(time.monotonic())
        return await super().on_tick(counter)

    def _drain_tick(self, now: float) -> None:
        if not self.gate.aborting and (self.gate.active == 0 or now >= self._abort_at):
            ended = self.gate.abort_inflight()
            if ended:
                logger.warning(
                    "shutdown: aborted %d request(s) still running after %.1fs",
                    ended,
                    now - (self.drain_started or now),
                )
        # uvicorn's shutdown waits for the rest of the handlers within what is left of T.
        if self.gate.aborting and (self.gate.active == 0 or now >= self._end_at - self.grace_s / 4):
            self.config.timeout_graceful_shutdown = max(0.1, self._end_at - now)
            self.should_exit = True
