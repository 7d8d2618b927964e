"""The tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``
(vLLM's shapes).

``/tokenize`` takes ``{"model"?, "prompt", "add_special_tokens"?}`` or ``{"model"?,
"messages", "add_generation_prompt"?, "add_special_tokens"?}`` (and ``return_token_strs``)
and answers ``{"count", "max_model_len", "tokens", "token_strs"}``. A text prompt is encoded
with the tokenizer's special tokens unless ``add_special_tokens`` is false (vLLM's default,
and what ``/v1/completions`` feeds); messages render through the checkpoint's chat template
(sandboxed, as the chat endpoint does) and, when ``add_special_tokens`` is not given, tokenize
to exactly the ids ``/v1/chat/completions`` feeds the model. ``/detokenize`` takes
``{"model"?, "tokens"}`` and answers ``{"prompt"}`` (special tokens spelled, e.g. ``<bos>``).
``/tokenizer_info`` answers what vLLM's does (the tokenizer's ``tokenizer_config.json``
settings plus ``tokenizer_class``): ``bos_token``, ``eos_token``, ``pad_token`` as strings,
``add_bos_token`` (true when a text prompt gets BOS first, as ``/v1/completions`` feeds it; a
token-id prompt is fed as sent), ``model_max_length`` and the ``chat_template`` when the
checkpoint has one. lm-eval's ``tokenizer_backend=remote`` reads it, then calls ``/tokenize``
and ``/detokenize``.

Both routes sit behind the same middleware as the others (API key, ``Host`` check, body
limits); tokenizing runs in a worker thread, off the event loop. Undeclared fields are refused
(these are not OpenAI routes: there is no unknown-field leniency to keep).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from paxcache.server.context import ServerContext
from paxcache.server.convert import chat_prompt
from paxcache.server.middleware import request_id
from paxcache.server.openapi import DetokenizeResponse, TokenizeResponse, responses
from paxcache.server.protocol import APIError, ChatMessage, Text, integral_numbers, shown

__all__ = [
    "DetokenizeRequest",
    "TokenizeRequest",
    "TokenizerInfoResponse",
    "router",
    "tokenizer_info",
]

router = APIRouter()

_INT32_LIMIT = 1 << 31


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(_Strict):
    """Body of ``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"prompt": "Hello", "return_token_strs": True},
                {"messages": [{"role": "user", "content": "Hello"}]},
            ]
        },
    )

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Strict):
    """Body of ``POST /detokenize``."""

    model_config = ConfigDict(
        strict=True, extra="forbid", json_schema_extra={"examples": [{"tokens": [72, 105]}]}
    )

    _integral_numbers = model_validator(mode="before")(integral_numbers)

    model: Text | None = None
    tokens: list[int]


def _ctx(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    if ctx.tokenizer is None:
        raise APIError(400, "this engine has no tokenizer")
    return ctx


def _token_strs(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


@router.post("/tokenize", response_model=None, responses=responses(400, 404, ok=TokenizeResponse))
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """Token ids of a prompt or of a rendered chat (see the module docstring)."""
    ctx = _ctx(request)
    ctx.check_model(body.model)
    tok = ctx.tokenizer
    if body.messages is not None:
        if len(body.messages) > ctx.limits.max_messages:
            raise APIError(
                400,
                f"{len(body.messages)} messages; at most {ctx.limits.max_messages} are allowed "
                "(limit max_messages)",
                param="messages",
            )
        ids = await asyncio.to_thread(
            chat_prompt,
            tok,
            body.messages,
            request_id(request),
            add_generation_prompt=body.add_generation_prompt,
            add_special_tokens=body.add_special_tokens,
        )
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(await asyncio.to_thread(tok.encode, body.prompt, add_special_tokens=special))
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": ctx.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }
    if body.return_token_strs:
        out["token_strs"] = await asyncio.to_thread(_token_strs, tok, ids)
    return JSONResponse(out)


@router.post(
    "/detokenize", response_model=None, responses=responses(400, 404, ok=DetokenizeResponse)
)
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    """The text of token ids (every id inside the vocabulary, else 400 naming it)."""
    ctx = _ctx(request)
    ctx.check_model(body.model)
    vocab = ctx.vocab_size or _INT32_LIMIT
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        msg = f"token id {shown(str(bad))} is outside the vocabulary [0, {vocab})"
        raise APIError(400, msg, param="tokens")
    text = await asyncio.to_thread(ctx.tokenizer.decode, body.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


class TokenizerInfoResponse(BaseModel):
    """Body of ``GET /tokenizer_info``: ``tokenizer_class`` plus the tokenizer's settings."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _json_safe(value: Any) -> Any:
    """A tokenizer_config.json value as JSON: token dicts (``{"content": ...}``) -> strings."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and ("special" in value or "__type" in value):
            return value["content"]
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def tokenizer_info(tokenizer: Any, max_model_len: int | None) -> dict[str, Any]:
    """What ``GET /tokenizer_info`` answers for ``tokenizer`` (see the module docstring)."""
    config = getattr(tokenizer, "config", None)
    info: dict[str, Any] = _json_safe(dict(config)) if isinstance(config, dict) else {}
    info.pop("chat_template", None)  # below: the one the server renders
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast" if config else "")
    if not info["tokenizer_class"]:
        info["tokenizer_class"] = type(tokenizer).__name__
    for name in _SPECIAL_NAMES:
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            info[name] = value
        else:
            info.setdefault(name, None)
    bos = tokenizer.bos_token_id
    info["add_bos_token"] = bos is not None and tokenizer.encode("", True)[:1] == [bos]
    info.setdefault("add_eos_token", False)
    if max_model_len is not None:
        info["model_max_length"] = max_model_len
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        info["chat_template"] = template
    return info


@router.get("/tokenizer_info", response_model=TokenizerInfoResponse)
async def get_tokenizer_info(request: Request) -> JSONResponse:
    """The tokenizer's settings in vLLM's ``/tokenizer_info`` shape (see the module docstring)."""
    ctx = _ctx(request)
    info = await asyncio.to_thread(tokenizer_info, ctx.tokenizer, ctx.max_model_len)
    return JSONResponse(info)
