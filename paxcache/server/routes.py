"""The FastAPI app: :func:`create_app` assembles the engine thread, the middleware, the error
handlers and the routers.

Routers: the service routes here (``GET /health``, ``GET /metrics``, ``GET /v1/models``,
``GET /v1/models/{id}``), the generation routes of :mod:`paxcache.server.completions` and
the tokenizer routes of :mod:`paxcache.server.tokenize`.
Handlers reach the shared state through ``request.app.state.ctx``
(:class:`paxcache.server.context.ServerContext`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from paxcache.server import completions, tokenize
from paxcache.server.context import ServerContext
from paxcache.server.metrics import CONTENT_TYPE, ServerMetrics
from paxcache.server.middleware import install_middleware, request_id
from paxcache.server.openapi import HealthResponse, ModelCard, ModelList, install_openapi, responses
from paxcache.server.protocol import STATUS_TYPES, APIError, ServerLimits, shown
from paxcache.server.runner import EngineRunner
from paxcache.server.tenants import api_keys, key_tenants

__all__ = ["create_app", "service_router"]

logger = logging.getLogger(__name__)


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
      its limits, ``app.state.ctx`` the state its handlers share, ``app.state.shutdown`` the
      :class:`paxcache.server.shutdown.ShutdownGate` a ``DrainingServer`` drives.

    Raises:
      ValueError: an empty or padded API key, or an invalid limit.
    """
    overrides = {"max_queue": max_queue, "max_body_bytes": max_body_bytes}
    limits = dataclasses.replace(
        limits or ServerLimits(), **{k: v for k, v in overrides.items() if v is not None}
    )
    keys = api_keys(api_key)
    metrics = ServerMetrics()
    runner = EngineRunner(
        engine,
        max_queue=limits.max_queue,
        warmup=warmup,
        on_first_token=metrics.first_token,
        on_finish=metrics.request_finished,
        on_tokens=metrics.tokens,
        on_abort=metrics.request_aborted,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        try:
            yield
        finally:
            await asyncio.to_thread(runner.stop)

    app = FastAPI(title="paxcache", version="0.1.0", lifespan=lifespan)
    app.state.ctx = ServerContext.create(engine, runner, limits, metrics, served_model_name)
    metrics.watch(runner, model_name=app.state.ctx.model_name)
    app.state.runner = runner
    app.state.registry = metrics.registry
    app.state.limits = limits
    app.state.shutdown = app.state.ctx.shutdown  # scripts/serve.py's DrainingServer drives it
    install_middleware(app, limits, key_tenants(keys), allowed_hosts, app.state.ctx.shutdown)
    install_error_handlers(app)
    app.include_router(service_router)
    app.include_router(completions.router)
    app.include_router(tokenize.router)
    install_openapi(app, keyed=bool(keys))
    return app


# ----------------------------------------------------------------------------------------------
# Errors: every error leaves as an OpenAI-shaped body carrying the request id.


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    if exc.status >= 500:
        logger.warning("request %s: %d %s", request_id(request), exc.status, exc.message)
    return exc.response(request_id(request))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes a 400 naming the first offending field."""
    rid = request_id(request)
    errs = exc.errors()
    if not errs:
        return APIError(400, "invalid request").response(rid)
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # Union branches show up as loc entries like "str" / "list[int]"; keep the field path.
    path = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int")]
    param = ".".join(path) or None
    kind = e.get("type")
    if not path and kind in ("model_attributes_type", "dict_type", "model_type"):
        msg = _not_a_json_object(request)
        return APIError(400, msg).response(rid)
    if kind == "json_invalid":
        msg = "malformed JSON body"
        param = None
    elif kind == "missing" and param is None:
        msg = "missing request body: send a JSON object with 'Content-Type: application/json'"
    elif kind == "missing":
        msg = f"missing required field '{param}'"
    elif kind == "extra_forbidden":
        msg = f"unsupported field '{shown(param or '')}': this server does not honour it"
    elif param is None:
        msg = f"invalid request body: {e.get('msg')}"
    else:
        msg = f"invalid value for '{shown(param)}': {e.get('msg')}"
    msg = msg.replace(": Value error, ", ": ")  # pydantic's prefix on a validator's message
    return APIError(400, msg, param=param).response(rid)


def _not_a_json_object(request: Request) -> str:
    """The 400 message of a body that is not a JSON object (often: a wrong content type)."""
    ctype = request.headers.get("content-type")
    media = (ctype or "").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        got = f"got '{shown(ctype)}'" if ctype else "no Content-Type header"
        return f"the request body must be JSON sent with 'Content-Type: application/json' ({got})"
    return "the request body must be a JSON object"


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's errors (404 unknown route, 405 with its ``Allow`` header) as OpenAI's."""
    response = APIError(
        exc.status_code,
        str(exc.detail),
        type=STATUS_TYPES.get(exc.status_code, "api_error"),
    ).response(request_id(request))
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def _unicode_error(request: Request, exc: UnicodeError) -> JSONResponse:
    return APIError(400, "request body is not valid UTF-8 JSON").response(request_id(request))


def install_error_handlers(app: FastAPI) -> None:
    """Turns every error the app raises into an OpenAI-shaped response."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(UnicodeError, _unicode_error)


# ----------------------------------------------------------------------------------------------
# Service routes

service_router = APIRouter()


@service_router.get(
    "/health",
    response_model=None,
    responses={
        200: {"model": HealthResponse, "description": "Ready"},
        503: {"model": HealthResponse, "description": "Warming up, failed or shutting down"},
    },
)
async def health(request: Request) -> Response:
    """200 once the engine is warmed up and its thread runs; 503 with the reason otherwise."""
    runner = request.app.state.ctx.runner
    if request.app.state.ctx.shutdown.draining:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if runner.ready.is_set() and runner.alive:
        return JSONResponse({"status": "ok"})
    if runner.warmup_error:
        return JSONResponse({"status": "error", "detail": runner.warmup_error}, status_code=503)
    if runner.ready.is_set():
        return JSONResponse({"status": "stopped"}, status_code=503)
    return JSONResponse({"status": "warming up"}, status_code=503)


@service_router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(request.app.state.ctx.metrics.render(), media_type=CONTENT_TYPE)


@service_router.get("/v1/models", response_model=None, responses=responses(ok=ModelList))
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [request.app.state.ctx.model_card()]}


@service_router.get(
    "/v1/models/{model_id:path}", response_model=None, responses=responses(404, ok=ModelCard)
)
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(model_id)
    return ctx.model_card()
