"""OpenAI request -> engine inputs, engine outputs -> OpenAI response pieces.

Inbound: the per-request limits every endpoint shares (:func:`check_limits`, each refusal a
400 naming its limit), the prompts of a completions request, chat rendering (the checkpoint's
template, sandboxed in :mod:`paxcache.models.tokenizer`) and tokenization, and the
:class:`paxcache.sampling.SamplingParams` of a request (``output_kind="delta"``: the runner
coalesces deltas). Outbound: ``usage``, the two ``logprobs`` shapes (legacy completions and
chat), finish reasons and server-sent-event framing.

Pure functions of their arguments (no app state), so every rule here is testable alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from paxcache.outputs import INTERNAL_ERROR
from paxcache.sampling import SamplingParams
from paxcache.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    ServerLimits,
)
from paxcache.server.runner import Progress

__all__ = [
    "chat_logprobs",
    "chat_prompt",
    "chat_token_ids",
    "check_chat_limits",
    "check_limits",
    "check_token_ids",
    "completion_logprobs",
    "completion_prompts",
    "finish_reason",
    "request_error",
    "sampling_params",
    "sse",
    "tokenize",
    "usage",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Inbound


def _check_in_vocab(ids: Sequence[int], vocab_size: int, what: str, param: str) -> None:
    """400 naming the first id outside ``[0, vocab_size)`` (``what`` formats it)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        where = f"outside the vocabulary [0, {vocab_size})"
        raise APIError(400, f"{what.format(bad)} {where}", param=param)


def _too_many(param: str, what: str, limit: int, name: str) -> APIError:
    return APIError(400, f"{what}; at most {limit} are allowed (limit {name})", param=param)


def completion_prompts(body: CompletionRequest, limits: ServerLimits) -> list[str | list[int]]:
    """The prompts of a completions request, within ``max_prompts`` and ``max_choices``."""
    p = body.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif isinstance(p[0], int):
        raw = [list(p)]
    else:
        raw = list(p)
    if len(raw) > limits.max_prompts:
        raise _too_many("prompt", f"{len(raw)} prompts", limits.max_prompts, "max_prompts")
    if len(raw) * body.n > limits.max_choices:
        what = f"{len(raw)} prompts x n={body.n} = {len(raw) * body.n} completions"
        raise _too_many("n", what, limits.max_choices, "max_choices")
    return raw


def check_chat_limits(body: ChatCompletionRequest, limits: ServerLimits) -> None:
    """The chat-only limits: ``max_messages``, ``max_choices``, ``top_logprobs`` needs
    ``logprobs``."""
    if len(body.messages) > limits.max_messages:
        what = f"{len(body.messages)} messages"
        raise _too_many("messages", what, limits.max_messages, "max_messages")
    if body.n > limits.max_choices:
        raise _too_many("n", f"n={body.n} completions", limits.max_choices, "max_choices")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")


def check_limits(
    body: SamplingFields,
    limits: ServerLimits,
    vocab_size: int | None,
    logprobs: int | None,
    logprobs_param: str,
) -> None:
    """The per-request limits every endpoint shares (400 naming the limit)."""
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise APIError(
            400,
            f"{logprobs_param}={logprobs}; at most {limits.max_logprobs} (limit max_logprobs)",
            param=logprobs_param,
        )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > limits.max_stop:
        raise _too_many("stop", f"{len(stops)} stop strings", limits.max_stop, "max_stop")
    for s in stops:
        if len(s) > limits.max_stop_chars:
            raise APIError(
                400,
                f"a stop string has {len(s)} characters; at most {limits.max_stop_chars} are "
                "allowed (limit max_stop_chars)",
                param="stop",
            )
    ids = body.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        what = f"{len(ids)} stop_token_ids"
        raise _too_many("stop_token_ids", what, limits.max_stop_token_ids, "max_stop_token_ids")
    if vocab_size is not None:
        _check_in_vocab(ids, vocab_size, "stop_token_ids holds {},", "stop_token_ids")
        if body.top_k is not None and body.top_k > vocab_size:
            raise APIError(
                400,
                f"top_k={body.top_k} exceeds the vocabulary size {vocab_size} "
                "(use -1 or 0 for no top-k filter)",
                param="top_k",
            )
    if body.cache_salt is not None and not 0 < len(body.cache_salt) <= limits.max_cache_salt_chars:
        raise APIError(
            400,
            f"cache_salt must have 1 to {limits.max_cache_salt_chars} characters "
            "(limit max_cache_salt_chars)",
            param="cache_salt",
        )


def sampling_params(
    body: SamplingFields, *, max_tokens: int, logprobs: int | None, logprobs_param: str
) -> SamplingParams:
    """The engine's ``SamplingParams`` for a request; fields it cannot honour are refused."""
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
        output_kind="delta",
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        param = logprobs_param if field == "logprobs" else field
        raise APIError(400, str(e), param=param if param in kwargs else None) from None


def check_token_ids(ids: Sequence[int], vocab_size: int | None) -> None:
    """A token-id prompt: not empty, every id inside the vocabulary."""
    if not ids:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if vocab_size is not None:
        _check_in_vocab(ids, vocab_size, "prompt token id {} is", "prompt")


def tokenize(tokenizer: Any, prompt: str) -> list[int]:
    """A text prompt's token ids (400 when it tokenizes to nothing)."""
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return ids


def _message_text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(part.text for part in m.content)


def _template_message(m: ChatMessage) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": m.role, "content": _message_text(m)}
    if m.tool_calls:  # arguments as objects, as templates (and vLLM) expect them
        msg["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type,
                "function": {
                    "name": c.function.name,
                    "arguments": _json_or_text(c.function.arguments),
                },
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _json_or_text(s: str) -> Any:
    try:
        return json.loads(s)
    except (json.JSONDecodeError, RecursionError):
        return s


def _render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
) -> str:
    msgs = [_template_message(m) for m in messages]
    fn = getattr(tokenizer, "apply_chat_template", None)
    if fn is not None:
        kwargs: dict[str, Any] = {}
        if not add_generation_prompt:
            kwargs["add_generation_prompt"] = False
        if tools:
            kwargs["tools"] = tools
        return fn(msgs, **kwargs)
    # Documented fallback: "<|role|>\ncontent\n" per message, then "<|assistant|>\n".
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs)
    return text + "<|assistant|>\n" if add_generation_prompt else text


def chat_token_ids(tokenizer: Any, text: str) -> list[int]:
    """Tokenizes a rendered chat prompt with special tokens (BOS where the tokenizer adds one),
    dropping the duplicate BOS when the template already wrote one."""
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        ids = ids[1:]
    if not ids:
        raise APIError(400, "the rendered chat prompt is empty", param="messages")
    return ids


def chat_prompt(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    request_id: str | None,
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool | None = None,
    tools: list[dict] | None = None,
) -> list:
    """Renders (the checkpoint's template, sandboxed, with the request's ``tools``) and
    tokenizes a chat; runs in a worker thread. Template errors become 400 (the template
    rejected the messages) or 500.

    ``add_special_tokens`` None (the chat endpoint) tokenizes as :func:`chat_token_ids`; a
    bool (``/tokenize``) encodes the rendered text with or without the tokenizer's specials.
    """
    from paxcache.models.tokenizer import ChatTemplateError

    try:
        text = _render_chat(tokenizer, messages, add_generation_prompt, tools)
        if add_special_tokens is not None:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return chat_token_ids(tokenizer, text)
    except ChatTemplateError as e:
        if e.client_error:
            raise APIError(400, e.public_message, param="messages") from None
        logger.error("request %s: %s", request_id, e)
        raise APIError(
            500, f"{e.public_message} (see the server log)", type="server_error", code="template"
        ) from None


# ----------------------------------------------------------------------------------------------
# Outbound


def usage(progress: Sequence[Progress]) -> dict[str, Any]:
    """OpenAI ``usage`` over a request's prompts (each prompt counted once), with
    ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache)."""
    p = sum(x.prompt_tokens or 0 for x in progress)
    c = sum(len(comp.token_ids) for x in progress for comp in x.completions.values())
    cached = sum(x.cached or 0 for x in progress)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def request_error(progress: Progress) -> APIError | None:
    """The error a finished engine request ended with (500 for the engine's internal error,
    else 400), or None."""
    reasons = [comp.finish_reason for comp in progress.completions.values()]
    if not progress.error and "error" not in reasons:
        return None
    if progress.error == INTERNAL_ERROR:
        return APIError(500, INTERNAL_ERROR, type="server_error")
    return APIError(400, progress.error or "the engine could not complete this request")


def _token_str(tokenizer: Any, tid: int) -> str:
    try:
        return tokenizer.decode([tid])
    except Exception:  # noqa: BLE001
        return f"<{tid}>"


def completion_logprobs(
    tokenizer: Any, entries: Sequence[dict], offset: int = 0
) -> dict[str, list]:
    """Legacy completions ``logprobs`` object from the engine's per-token entries
    (``{"token_id", "logprob", "top": [(id, logprob), ...]}``; ``logprob`` None and ``top``
    None for a token without context: the first of an echoed prompt)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        s = _token_str(tokenizer, int(e.get("token_id", -1)))
        tokens.append(s)
        lp = e.get("logprob", 0.0)
        lps.append(None if lp is None else float(lp))  # None: an echoed first prompt token
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


def chat_logprobs(tokenizer: Any, entries: Sequence[dict]) -> dict[str, list]:
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


def finish_reason(reason: str | None) -> str | None:
    """OpenAI finish reasons: an aborted completion (server shutdown) reports "stop"."""
    return "stop" if reason == "abort" else reason


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
