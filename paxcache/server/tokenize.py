"""The tokenizer routes: ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes).

``/tokenize`` takes ``{"model"?, "prompt", "add_special_tokens"?}`` or ``{"model"?,
"messages", "add_generation_prompt"?, "add_special_tokens"?}`` (and ``return_token_strs``)
and answers ``{"count", "max_model_len", "tokens", "token_strs"}``. A text prompt is encoded
with the tokenizer's special tokens unless ``add_special_tokens`` is false (vLLM's default,
and what ``/v1/completions`` feeds); messages render through the checkpoint's chat template
(sandboxed, as the chat endpoint does) and, when ``add_special_tokens`` is not given, tokenize
to exactly the ids ``/v1/chat/completions`` feeds the model. ``/detokenize`` takes
``{"model"?, "tokens"}`` and answers ``{"prompt"}``.

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
from paxcache.server.protocol import APIError, ChatMessage, Text, shown

__all__ = ["DetokenizeRequest", "TokenizeRequest", "router"]

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
