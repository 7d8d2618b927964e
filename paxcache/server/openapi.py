"""The OpenAPI document (``GET /openapi.json``): what each route answers, as it answers it.

Routes declare their own success bodies and the errors they raise themselves with
:func:`responses` (the response models below). :func:`install_openapi` then adds what the
ASGI layers answer on every route (:mod:`paxcache.server.middleware`): 400 (a bad
``Content-Length``, a ``Host`` not allowed, a malformed or missing body), 401 (with API keys;
not ``/health``), 408 and 413 (the body), 500 (an internal error), 503 (draining for a
shutdown; not ``/health`` and ``/metrics``, which say so themselves), each with the OpenAI
error body and the ``x-request-id`` header. FastAPI's 422 is removed: the server never
answers it (its validation errors are 400s).

The response models document; handlers build plain dicts (tests/test_openapi.py checks each
answer against this document with Schemathesis).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from paxcache.server.protocol import STATUS_TYPES
from paxcache.server.schema_rules import tighten_requests

__all__ = [
    "ChatCompletionResponse",
    "CompletionResponse",
    "DetokenizeResponse",
    "ErrorResponse",
    "HealthResponse",
    "ModelCard",
    "ModelList",
    "TokenizeResponse",
    "install_openapi",
    "responses",
]

_ERROR_DESCRIPTIONS = {
    400: "Bad request: the message and `param` name the problem",
    401: "Missing or wrong API key",
    404: "Unknown model",
    408: "Request body not received in time",
    413: "Request body over the size limit",
    429: "Too many requests in flight (server queue or the caller's tenant)",
    500: "Internal error (logged under the request id)",
    503: "Shutting down, or the engine failed",
}

FINISH_REASONS = Literal["stop", "length", "tool_calls", "abort"]
"""``abort``: the request was ended by the server (shutdown) or its engine failed."""


# ----------------------------------------------------------------------------------------------
# Response models


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(
        description="OpenAI error type, e.g. " + ", ".join(set(STATUS_TYPES.values()))
    )
    param: str | None
    code: str | None
    request_id: str | None = Field(default=None, description="The x-request-id header's value")


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FINISH_REASONS | None
    stop_reason: int | str | None = Field(
        default=None,
        description="vLLM's: the stop token id or stop string that ended the choice (null "
        "when it ended otherwise)",
    )
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(
        default=None, description="vLLM's extension (with `prompt_logprobs`)"
    )


class CompletionResponse(BaseModel):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FINISH_REASONS | None
    stop_reason: int | str | None = Field(
        default=None,
        description="vLLM's: the stop token id or stop string that ended the choice (null "
        "when it ended otherwise)",
    )


class ChatCompletionResponse(BaseModel):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok", "warming up", "error", "stopped", "shutting down"]
    detail: str | None = None


# ----------------------------------------------------------------------------------------------
# Declarations


_REQUEST_ID = {
    "x-request-id": {
        "description": "The request's id (in the server's log, and in error bodies)",
        "schema": {"type": "string"},
    }
}
_SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event (OpenAPI 3.1: the schema of each event)",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "A chunk as JSON (`choices` with `delta` / `text` and "
            "`finish_reason`; with `stream_options.include_usage`, a last chunk with `usage`), "
            "or an ErrorResponse as JSON when the request fails mid-stream; the last event is "
            "`[DONE]`",
        },
        "event": {"type": "string"},
    },
}
_SSE = {"text/event-stream": {"schema": _SSE_EVENT}}


def responses(
    *errors: int, ok: type[BaseModel] | None = None, stream: bool = False
) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=``: its 200 body (``ok``; ``stream``: also server-sent events,
    ``data: {chunk}`` lines ending in ``data: [DONE]``) and the error statuses it raises."""
    out: dict[int | str, dict[str, Any]] = {}
    if ok is not None:
        out[200] = {"model": ok}
        if stream:
            out[200]["content"] = dict(_SSE)
            out[200]["description"] = "JSON, or server-sent events with `stream: true`"
    for status in errors:
        out[status] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
    return out


def _error_response(status: int) -> dict[str, Any]:
    return {
        "description": _ERROR_DESCRIPTIONS[status],
        "headers": dict(_REQUEST_ID),
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }


def _middleware_statuses(path: str, keyed: bool) -> Iterable[int]:
    yield from (400, 408, 413, 500)
    if keyed and path != "/health":
        yield 401
    if path not in ("/health", "/metrics"):
        yield 503


def install_openapi(app: FastAPI, *, keyed: bool) -> None:
    """Makes ``app.openapi()`` the document described in the module docstring.

    Args:
      app: the app, its routes included.
      keyed: the server checks API keys (every route but ``/health`` may answer 401).
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error.pop("$defs", {}))
        schemas["ErrorResponse"] = error
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        ctx = app.state.ctx
        tighten_requests(
            schemas,
            ctx.limits,
            vocab_size=ctx.vocab_size,
            max_model_len=ctx.max_model_len,
            max_num_seqs=getattr(ctx.runner.engine, "max_num_seqs", None),
        )
        for path, ops in doc.get("paths", {}).items():
            for op in ops.values():
                answers = op.setdefault("responses", {})
                answers.pop("422", None)
                for status in _middleware_statuses(path, keyed):
                    answers.setdefault(str(status), _error_response(status))
                for answer in answers.values():
                    answer.setdefault("headers", {}).update(_REQUEST_ID)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
