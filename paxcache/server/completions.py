"""The generation endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

Each handler reads in one direction: validate the body (:mod:`paxcache.server.convert`),
tokenize (off the event loop), reserve the tenant's slots, submit to the engine thread
(:meth:`paxcache.server.context.ServerContext.submit`), then stream the deltas as server-sent
events or collect the whole result into one JSON response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from paxcache.server.context import ServerContext
from paxcache.server.convert import (
    chat_logprobs,
    chat_prompt,
    check_chat_limits,
    check_limits,
    check_token_ids,
    completion_logprobs,
    completion_prompts,
    finish_reason,
    request_error,
    sampling_params,
    tokenize,
    usage,
)
from paxcache.server.echo import (
    check_prompt_logprobs,
    echo_plan,
    echo_text,
    prompt_entries,
    vllm_prompt_logprobs,
)
from paxcache.server.fields import check_fields
from paxcache.server.middleware import request_id
from paxcache.server.openapi import ChatCompletionResponse, CompletionResponse, responses
from paxcache.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from paxcache.server.runner import Progress
from paxcache.server.structured import (
    ToolStream,
    chat_message,
    chat_plan,
    check_constraint,
    response_format_constraint,
)

__all__ = ["router"]

router = APIRouter()


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


async def _prompt_ids(ctx: ServerContext, prompt: str | list[int]) -> list[int]:
    """One completions prompt as token ids (text is tokenized in a worker thread)."""
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if ctx.tokenizer is None:
            raise APIError(400, "this engine has no tokenizer; send token ids")
        ids = await asyncio.to_thread(tokenize, ctx.tokenizer, prompt)
    else:
        check_token_ids(prompt, ctx.vocab_size)
        ids = prompt
    ctx.check_prompt_len(ids, "prompt")
    return ids


@router.post(
    "/v1/completions",
    response_model=None,
    responses=responses(400, 404, 429, 503, ok=CompletionResponse, stream=True),
)
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    ctx.check_model(body.model)
    check_fields(body, "completions")
    check_limits(body, ctx.limits, ctx.vocab_size, body.logprobs, "logprobs")
    check_prompt_logprobs(body, ctx.limits)
    echo = echo_plan(body, ctx.tokenizer is not None)
    raw = completion_prompts(body, ctx.limits)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    ctx.check_max_tokens(max_tokens, "max_tokens")
    params = sampling_params(
        body, max_tokens=max(1, max_tokens), logprobs=body.logprobs, logprobs_param="logprobs"
    )
    params = echo.params(params)
    spec = response_format_constraint(body.response_format)
    if spec is not None:  # compiled off the event loop: a bad schema is a 400 here
        await asyncio.to_thread(check_constraint, spec, "response_format")
        params = dataclasses.replace(params, structured_outputs=spec)
    prompts = [await _prompt_ids(ctx, q) for q in raw]
    echoed = []
    if echo.echo:
        echoed = [echo_text(ctx.tokenizer, q, p) for q, p in zip(raw, prompts, strict=True)]
    release = ctx.tenant_slots(request, len(prompts) * body.n)
    try:
        rid, ids, exchange = await ctx.submit(request, prompts, params, "cmpl", body.cache_salt)
    except BaseException:
        release()
        raise
    head = {"id": rid, "object": "text_completion", "created": int(time.time())}
    head["model"] = ctx.model_name
    prompt_lps: dict[int, list | None] = {}  # tag -> the engine's prompt logprobs

    def piece(idx: int, text: str, entries: list[dict] | None, first: bool) -> tuple[str, Any]:
        """A choice's text and logprobs: the echoed prompt first (``first``), no generated
        tokens with ``max_tokens: 0``."""
        if echo.drop_generated:
            text, entries = "", []
        if first and echo.echo:
            tag = idx // body.n
            text = echoed[tag] + text
            if echo.echo_logprobs is not None:
                k = echo.echo_logprobs
                entries = prompt_entries(prompts[tag], prompt_lps.get(tag), k) + (entries or [])
        if body.logprobs is None:
            return text, None
        return text, completion_logprobs(ctx.tokenizer, entries or [])

    def ending(reason: str | None) -> str | None:
        """``max_tokens: 0`` ends at its length whatever the dropped token was (EOS, a stop)."""
        if echo.drop_generated and reason == "stop":
            return "length"
        return reason

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        started: set[int] = set()

        def on_progress(tag: int, prog: Progress) -> None:
            if prog.prompt_logprobs is not None:
                prompt_lps[tag] = prog.prompt_logprobs

        def make_chunk(idx: int, delta: str, fr: str | None, lps: list | None) -> dict:
            first = idx not in started
            started.add(idx)
            text, logprobs = piece(idx, delta, lps, first)
            choice = {"index": idx, "text": text, "logprobs": logprobs, "finish_reason": ending(fr)}
            chunk = {**head, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            return chunk

        usage_fn = _usage_chunk(head, include_usage)
        if usage_fn is not None and echo.drop_generated:
            usage_fn = _no_completion_tokens(usage_fn)
        return ctx.stream(ids, exchange, body.n, make_chunk, [], usage_fn, release, on_progress)

    try:
        outs = await ctx.collect(request, ids, exchange)
    finally:
        release()
    for o in outs:
        err = request_error(o)
        if err is not None:
            raise err
    choices = []
    for tag, out in enumerate(outs):
        prompt_lps[tag] = out.prompt_logprobs
        for index, comp in out.completions.items():
            idx = tag * body.n + index
            text, logprobs = piece(idx, "".join(comp.texts), comp.logprobs, first=True)
            choice = {
                "index": idx,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(ending(comp.finish_reason)),
                "stop_reason": comp.stop_reason if ending(comp.finish_reason) == "stop" else None,
            }
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    ctx.tokenizer, out.prompt_logprobs, body.prompt_logprobs
                )
            choices.append(choice)
    choices.sort(key=lambda ch: ch["index"])
    use = usage(outs)
    if echo.drop_generated:
        use = {**use, "completion_tokens": 0, "total_tokens": use["prompt_tokens"]}
    return JSONResponse({**head, "choices": choices, "usage": use, "system_fingerprint": None})


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses=responses(400, 404, 429, 503, ok=ChatCompletionResponse, stream=True),
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    ctx.check_model(body.model)
    check_fields(body, "chat")
    if ctx.tokenizer is None:
        raise APIError(400, "this engine has no tokenizer; chat is unavailable")
    check_limits(body, ctx.limits, ctx.vocab_size, body.top_logprobs, "top_logprobs")
    check_chat_limits(body, ctx.limits)
    check_prompt_logprobs(body, ctx.limits)
    max_tokens = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    ctx.check_max_tokens(max_tokens, param)
    lp = (body.top_logprobs or 0) if body.logprobs else None
    # Validate the sampling fields before the (checkpoint-defined) template runs.
    params = sampling_params(
        body, max_tokens=max_tokens or 1, logprobs=lp, logprobs_param="top_logprobs"
    )
    plan = chat_plan(body, getattr(ctx.tokenizer, "chat_template", None))
    if plan.constraint is not None:  # compiled off the event loop: a bad schema is a 400 here
        await asyncio.to_thread(check_constraint, plan.constraint, plan.constraint_param)
        params = dataclasses.replace(params, structured_outputs=plan.constraint)
    prompt_ids = await asyncio.to_thread(
        chat_prompt, ctx.tokenizer, body.messages, request_id(request), tools=plan.tools
    )
    ctx.check_prompt_len(prompt_ids, "messages")
    if max_tokens is None:
        limit = ctx.max_model_len
        max_tokens = limit - len(prompt_ids) if limit is not None else 256
    params = dataclasses.replace(
        params, max_tokens=max_tokens, prompt_logprobs=body.prompt_logprobs
    )
    release = ctx.tenant_slots(request, body.n)
    try:
        rid, ids, exchange = await ctx.submit(
            request, [prompt_ids], params, "chatcmpl", body.cache_salt
        )
    except BaseException:
        release()
        raise
    head = {"id": rid, "object": "chat.completion", "created": int(time.time())}
    head["model"] = ctx.model_name

    def logprobs(entries: list[dict] | None) -> dict | None:
        return chat_logprobs(ctx.tokenizer, entries or []) if lp is not None else None

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_head = {**head, "object": "chat.completion.chunk", "system_fingerprint": None}

        def chunk(idx: int, delta: dict, fr: str | None, lps: dict | None) -> dict:
            choice = {"index": idx, "delta": delta, "logprobs": lps, "finish_reason": fr}
            ch = {**chunk_head, "choices": [choice]}
            if include_usage:
                ch["usage"] = None
            return ch

        streams: dict[int, ToolStream] = {}  # per choice: content and tool-call deltas

        def make_chunk(idx: int, delta: str, fr: str | None, lps: list | None) -> dict:
            d, fr = streams.setdefault(idx, ToolStream(plan)).push(delta, fr)
            return chunk(idx, d, fr, logprobs(lps))

        first = [chunk(j, {"role": "assistant", "content": ""}, None, None) for j in range(body.n)]
        usage_head = {**head, "object": "chat.completion.chunk"}
        return ctx.stream(
            ids,
            exchange,
            body.n,
            make_chunk,
            first,
            _usage_chunk(usage_head, include_usage),
            release,
        )

    try:
        outs = await ctx.collect(request, ids, exchange)
    finally:
        release()
    err = request_error(outs[0])
    if err is not None:
        raise err
    choices = [
        {
            "index": index,
            "message": message,
            "logprobs": logprobs(comp.logprobs),
            "finish_reason": fr,
            "stop_reason": comp.stop_reason if fr in ("stop", "tool_calls") else None,
        }
        for index, comp in outs[0].completions.items()
        for message, fr in [
            chat_message(plan, "".join(comp.texts), finish_reason(comp.finish_reason))
        ]
    ]
    choices.sort(key=lambda ch: ch["index"])
    resp = {**head, "choices": choices, "usage": usage(outs), "system_fingerprint": None}
    if body.prompt_logprobs is not None:  # vLLM's extension
        k = body.prompt_logprobs
        resp["prompt_logprobs"] = vllm_prompt_logprobs(ctx.tokenizer, outs[0].prompt_logprobs, k)
    return JSONResponse(resp)


def _no_completion_tokens(
    usage_fn: Callable[[dict[str, Any]], dict],
) -> Callable[[dict[str, Any]], dict]:
    """The usage chunk of ``max_tokens: 0`` (echo only): no completion tokens."""
    return lambda u: usage_fn({**u, "completion_tokens": 0, "total_tokens": u["prompt_tokens"]})


def _usage_chunk(
    head: dict[str, Any], include_usage: bool
) -> Callable[[dict[str, Any]], dict] | None:
    """The final ``usage`` chunk of a stream (``stream_options.include_usage``), or None."""
    if not include_usage:
        return None
    return lambda u: {**head, "choices": [], "usage": u}
