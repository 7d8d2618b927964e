"""OpenAI-compatible HTTP server for a paxcache ``Engine`` (FastAPI + uvicorn, extra ``serve``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as server-sent
events when ``"stream": true``, ending in ``data: [DONE]``), ``POST /tokenize`` and
``POST /detokenize`` (vLLM's shapes), ``GET /v1/models``, ``GET /health``
(503 until the engine is warmed up), ``GET /metrics`` (Prometheus text).

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code", "request_id"}}``:
400 for bad input (FastAPI's 422 is turned into 400; every limit names itself; a missing or
non-JSON body says so), 401 for a missing/wrong API key, 404 for an unknown model, 405 with
``Allow`` for a wrong method, 408 for a body that does not arrive in time, 413 for a body over
the size limit, 429 when the server or the caller's tenant has too many requests in flight,
500 for an internal error, 503 while shutting down or when the engine failed.
``/openapi.json`` lists each route's bodies and these statuses
(:mod:`~paxcache.server.openapi`). SIGTERM drains, then aborts what is left before the
shutdown timeout (:mod:`~paxcache.server.shutdown`). Every response carries an
``x-request-id`` header; the server logs failures with that
id, and clients never see exception text or paths. A request field the server does not honour
is refused, never silently dropped (:mod:`~paxcache.server.fields` holds the table; unknown
non-OpenAI fields are ignored with one warning per name). Extensions beyond OpenAI's fields
(as in vLLM): ``top_k`` (-1 or 0 = off), ``min_p``, ``stop_token_ids``, ``ignore_eos``,
``cache_salt``, ``prompt_logprobs``. ``/v1/completions`` honours ``echo`` (with ``logprobs``:
the prompt's token logprobs first; ``max_tokens: 0``: the prompt alone).

Modules (one job each; the import rules are in ARCHITECTURE.md):

* :mod:`~paxcache.server.protocol`: limits (:class:`ServerLimits`), errors (:class:`APIError`)
  and the request schemas.
* :mod:`~paxcache.server.convert`: request -> engine inputs, engine outputs -> response pieces.
* :mod:`~paxcache.server.runner`: the engine thread (:class:`EngineRunner`) and its exchange
  with the handlers.
* multi-host lockstep (:class:`EngineRound`, :func:`run_follower`) lives beside the engine in
  :mod:`paxcache.multihost` and is re-exported here.
* :mod:`~paxcache.server.context`, :mod:`~paxcache.server.streaming`: what handlers share,
  and server-sent events with a stall timeout.
* :mod:`~paxcache.server.routes`: :func:`create_app` and the service routes;
  :mod:`~paxcache.server.completions`: the two generation routes;
  :mod:`~paxcache.server.tokenize`: ``/tokenize`` and ``/detokenize``;
  :mod:`~paxcache.server.fields`: which request fields are honoured or refused;
  :mod:`~paxcache.server.echo`: echo and prompt logprobs;
  :mod:`~paxcache.server.structured`: ``response_format``, ``tools`` and ``tool_choice`` (the
  engine constraint, and tool calls parsed and streamed back).
* :mod:`~paxcache.server.middleware`, :mod:`~paxcache.server.tenants`: request ids, API keys
  and the ``Host`` check, body limits; tenants, their cache salts and in-flight limits.
* :mod:`~paxcache.server.metrics`: the Prometheus collector and the server's own metrics.
* :mod:`~paxcache.server.shutdown`: the SIGTERM drain (``DrainingServer``);
  :mod:`~paxcache.server.openapi`: the OpenAPI document.

Security (the threat model is in SECURITY.md): authentication runs before the body is read;
every limit of :class:`ServerLimits` answers a 400 or 429 naming it; each API key is a tenant
with its own prefix-cache salt; a streaming client that reads nothing for
``stream_stall_timeout_s`` is dropped and its blocks freed; chat templates render in a
sandbox, off the event loop.
"""

from __future__ import annotations

from paxcache.multihost import EngineRound, RoundAdd, RoundError, run_follower
from paxcache.server.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ServerLimits,
)
from paxcache.server.routes import create_app
from paxcache.server.runner import EngineRunner

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUEUE",
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "EngineRound",
    "EngineRunner",
    "RoundAdd",
    "RoundError",
    "ServerLimits",
    "create_app",
    "run_follower",
]
