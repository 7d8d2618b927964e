"""The server's wire protocol: limits, OpenAI-shaped errors and the request schemas.

Request bodies are strict pydantic models: ``"5"`` is not an int (``5.0`` is), ``"yes"`` is not
a bool, and strings with lone UTF-16 surrogates are refused. Fields a request body does not
declare are kept aside for :mod:`paxcache.server.fields` (a field the server does not honour is
never silently dropped: it is refused, or, when it is no OpenAI field at all, ignored with a
warning); nested objects (messages, ``stream_options``) refuse unknown fields. Every numeric
field is bounded where it enters (``top_k`` at most the vocabulary, seeds 64-bit, ...); the
per-request limits that depend on the deployment are :class:`ServerLimits`.

Errors are :class:`APIError`: ``{"error": {"message", "type", "param", "code", "request_id"}}``
with the HTTP status (the table is in the package docstring, :mod:`paxcache.server`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from paxcache.sampling import MAX_LOGPROBS, MAX_N

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUEUE",
    "STATUS_TYPES",
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "FunctionDefinition",
    "JSONSchemaFormat",
    "NamedToolChoice",
    "ResponseFormat",
    "SafeJSON",
    "SamplingFields",
    "ServerLimits",
    "StreamOptions",
    "Text",
    "TextContentPart",
    "Tool",
    "ToolCall",
    "integral_numbers",
    "internal_error",
    "shown",
]

DEFAULT_MAX_QUEUE = 256
"""Default cap on engine requests in flight (waiting + running); beyond it: 429."""

DEFAULT_MAX_BODY_BYTES = 1 << 20
"""Default cap on a request body (1 MiB); beyond it: 413."""

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
        return SafeJSON(self.body(request_id), status_code=self.status, headers=headers)


class SafeJSON(JSONResponse):
    """JSON with non-ASCII escaped: any string (even a lone surrogate) renders, never raises."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


STATUS_TYPES = {
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
"""OpenAI error ``type`` for each HTTP status the server answers."""


def internal_error() -> APIError:
    """The 500 a client sees when something unexpected failed (details go to the log only)."""
    return APIError(
        500,
        "internal server error; the server logged it under this request id",
        type="server_error",
    )


def shown(value: str, limit: int = 64) -> str:
    """A client-supplied string, shortened, for an error message."""
    return value if len(value) <= limit else value[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Request bodies


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("string contains a lone UTF-16 surrogate (invalid Unicode)") from None
    return s


def _integral(v: Any) -> Any:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [_integral(x) for x in v]
    return v


def integral_numbers(body: Any) -> Any:
    """A body's top-level numbers (and lists of them) with ``5.0`` as ``5``: JSON Schema's
    ``integer`` is any number without a fraction, and strict pydantic would refuse ``5.0``
    (floats fields take ints, so converting every such number is safe). ``"5"`` stays
    refused. Nested objects (tool schemas, ``logit_bias``) are left as sent."""
    if isinstance(body, dict):
        return {k: _integral(v) for k, v in body.items()}
    return body


Text = Annotated[str, AfterValidator(_valid_unicode)]
"""A string that is valid Unicode (JSON can smuggle lone surrogates: ``"\\ud800"``)."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


# Structured output and tools (their rules: paxcache.server.structured).


class JSONSchemaFormat(_Strict):
    """``response_format.json_schema``: a named JSON schema (``strict`` is always honoured:
    the output is generated under the schema)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``text`` (free), ``json_object`` (any JSON object) or
    ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: Text
    arguments: Text


class ToolCall(_Strict):
    """A tool call of an earlier assistant message (sent back with the conversation)."""

    id: Text = Field(min_length=1)
    type: Literal["function"]
    function: FunctionCall


class SamplingFields(_Strict):
    """The fields both endpoints share (OpenAI's, plus vLLM's extensions ``top_k``,
    ``min_p``, ``stop_token_ids``, ``ignore_eos``, ``cache_salt`` and ``prompt_logprobs``).

    Undeclared fields are kept in ``model_extra`` (not refused here): the handlers pass the
    body to :func:`paxcache.server.fields.check_fields`, which refuses the OpenAI fields the
    server does not honour and ignores unknown ones with a warning.
    """

    model_config = ConfigDict(strict=True, extra="allow")

    _integral_numbers = model_validator(mode="before")(integral_numbers)

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
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None  # paxcache.server.structured


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions`` (OpenAI legacy completions)."""

    model_config = ConfigDict(
        strict=True,
        extra="allow",
        json_schema_extra={
            "examples": [
                {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0},
                {"prompt": ["Hello", "Hi"], "max_tokens": 4, "n": 2, "logprobs": 1, "seed": 7},
                {"prompt": "Hello", "max_tokens": 4, "stream": True},
            ]
        },
    )

    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0, le=_INT32_MAX)  # 0: echo only
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)


class TextContentPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    """One chat message, checked as OpenAI checks it: a ``tool`` message answers a call
    (``tool_call_id``, ``content``); only an ``assistant`` message carries ``tool_calls``
    (then ``content`` may be null); the other roles need ``content``. Whether a ``tool``
    message's id names an earlier assistant call is not checked (as vLLM and transformers'
    templates: the template renders it); no JSON schema can relate two messages, and a rule
    the OpenAPI document cannot state would refuse bodies it calls valid."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        role = self.role
        if role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id' (the call it answers)")
        if role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"'tool_call_id' belongs to 'tool' messages, not '{role}'")
        if role != "assistant" and self.tool_calls is not None:
            raise ValueError(f"'tool_calls' belongs to 'assistant' messages, not '{role}'")
        if self.content is None and not (role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{role}' message needs 'content'")
        return self


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    model_config = ConfigDict(
        strict=True,
        extra="allow",
        json_schema_extra={
            "examples": [
                {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
                {
                    "messages": [{"role": "user", "content": "Hello"}],
                    "max_tokens": 4,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ]
        },
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
