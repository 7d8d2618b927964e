"""Which OpenAI request fields the server honours, which it refuses, and what it does with
fields OpenAI does not define.

No field is silently dropped. Every field of OpenAI's ``/v1/completions`` and
``/v1/chat/completions`` request bodies is in :data:`FIELDS`, with its status per endpoint:

* ``honoured``: the server does what OpenAI documents (notes say how: ``user`` is accepted and
  changes nothing, as it changes nothing about the output on OpenAI's side either);
* ``partly``: honoured for some values, refused with a 400 naming the field for the others
  (``presence_penalty`` other than 0, ``store: true``, ...);
* ``refused``: any value but ``null`` is a 400 naming the field.

The vLLM extensions that clients send to OpenAI-compatible servers are listed the same way
(``top_k``, ``min_p``, ... honoured; ``repetition_penalty`` other than 1, ``guided_json``, ...
refused). A field that is neither (a client's own field, or a typo) is ignored, with one
warning in the log per field name per process, as vLLM does; a known field with a wrong type
is still a 400, and a field of the other endpoint (``prompt`` in a chat request) is refused.
The README's field table is checked against :data:`FIELDS` by ``tests/test_fields.py``, so
the two cannot drift.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from paxcache.server.protocol import APIError, shown

__all__ = ["FIELDS", "FieldRule", "check_fields", "reset_warnings", "undeclared_field_schemas"]

logger = logging.getLogger(__name__)

Status = Literal["honoured", "partly", "refused", "-"]


@dataclass(frozen=True)
class FieldRule:
    """One request field: its status on each endpoint (``-``: not a field there), a note for
    the README table, and where the field comes from (``OpenAI`` or ``vLLM``, the extensions
    vLLM defines that clients send to OpenAI-compatible servers)."""

    name: str
    completions: Status
    chat: Status
    note: str
    origin: Literal["OpenAI", "vLLM"] = "OpenAI"


FIELDS: tuple[FieldRule, ...] = (
    FieldRule("model", "honoured", "honoured", "the served name or the engine's own; else 404"),
    FieldRule("prompt", "honoured", "-", "text, token ids, or a list of either"),
    FieldRule("messages", "-", "honoured", "text content (a string or text parts)"),
    FieldRule("max_tokens", "honoured", "honoured", "completions: 0 with `echo` scores the prompt"),
    FieldRule("max_completion_tokens", "-", "honoured", "wins over `max_tokens`"),
    FieldRule("temperature", "honoured", "honoured", "0 is greedy"),
    FieldRule("top_p", "honoured", "honoured", ""),
    FieldRule("n", "honoured", "honoured", "within the `max_choices` limit"),
    FieldRule("stop", "honoured", "honoured", "up to 4 strings"),
    FieldRule("seed", "honoured", "honoured", "per request, independent of the batch"),
    FieldRule("stream", "honoured", "honoured", "server-sent events"),
    FieldRule("stream_options", "honoured", "honoured", "`include_usage`"),
    FieldRule("logprobs", "honoured", "honoured", "completions: 0 to 20; chat: a bool"),
    FieldRule("top_logprobs", "-", "honoured", "0 to 20, with `logprobs: true`"),
    FieldRule("echo", "honoured", "-", "the prompt (and its logprobs) before the completion"),
    FieldRule("user", "honoured", "honoured", "accepted; changes nothing"),
    FieldRule("safety_identifier", "-", "honoured", "accepted; changes nothing"),
    FieldRule("prompt_cache_key", "-", "honoured", "accepted; prefix caching is automatic"),
    FieldRule("presence_penalty", "partly", "partly", "0 only"),
    FieldRule("frequency_penalty", "partly", "partly", "0 only"),
    FieldRule("logit_bias", "partly", "partly", "empty only"),
    FieldRule("best_of", "partly", "-", "equal to `n` only"),
    FieldRule("suffix", "partly", "-", "empty only"),
    FieldRule("store", "-", "partly", "`false` only: nothing is stored"),
    FieldRule("metadata", "-", "partly", "empty only (it labels stored completions)"),
    FieldRule("modalities", "-", "partly", '`["text"]` only'),
    FieldRule("service_tier", "-", "partly", '`"auto"` or `"default"` only'),
    FieldRule("audio", "-", "refused", "no audio output"),
    FieldRule("prediction", "-", "refused", "no predicted outputs"),
    FieldRule("reasoning_effort", "-", "refused", "no reasoning models"),
    FieldRule("verbosity", "-", "refused", ""),
    FieldRule("web_search_options", "-", "refused", "no web search"),
    FieldRule("functions", "-", "refused", "legacy; use `tools`"),
    FieldRule("function_call", "-", "refused", "legacy; use `tool_choice`"),
    FieldRule(
        "response_format",
        "honoured",
        "honoured",
        "`text`, `json_object`, `json_schema` (`strict`): constrained decoding (llguidance)",
    ),
    FieldRule("tools", "-", "honoured", "function tools; passed to the chat template"),
    FieldRule(
        "tool_choice",
        "-",
        "honoured",
        "`none`, `auto` (parsed: Hermes, Llama-3 JSON), `required` and a named function "
        "(generated under the schema)",
    ),
    FieldRule("parallel_tool_calls", "-", "honoured", "false: at most one call with `required`"),
    FieldRule("top_k", "honoured", "honoured", "0 or -1: off", "vLLM"),
    FieldRule("min_p", "honoured", "honoured", "", "vLLM"),
    FieldRule("stop_token_ids", "honoured", "honoured", "", "vLLM"),
    FieldRule("ignore_eos", "honoured", "honoured", "", "vLLM"),
    FieldRule("cache_salt", "honoured", "honoured", "isolates prefix-cache hits", "vLLM"),
    FieldRule("prompt_logprobs", "honoured", "honoured", "0 to 20; not with `stream`", "vLLM"),
    FieldRule("repetition_penalty", "partly", "partly", "1 only", "vLLM"),
    FieldRule("min_tokens", "partly", "partly", "0 only", "vLLM"),
    FieldRule("guided_json", "refused", "refused", "", "vLLM"),
    FieldRule("guided_regex", "refused", "refused", "", "vLLM"),
    FieldRule("guided_choice", "refused", "refused", "", "vLLM"),
    FieldRule("guided_grammar", "refused", "refused", "", "vLLM"),
    FieldRule("structured_outputs", "refused", "refused", "", "vLLM"),
    FieldRule("use_beam_search", "partly", "partly", "`false` only", "vLLM"),
    FieldRule("allowed_token_ids", "refused", "refused", "", "vLLM"),
    FieldRule("bad_words", "refused", "refused", "", "vLLM"),
)
"""Every OpenAI request field of both endpoints (the OpenAI API reference, 2025) and the
vLLM extensions clients commonly send, in the README table's order."""

_ENDPOINTS = ("completions", "chat")


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == [] or v == ""


# Fields the request schemas declare, whose values are checked here (partly honoured).
_VALUE_RULES: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "presence_penalty": (lambda v, body: not v, "presence_penalty is not supported (use 0)"),
    "frequency_penalty": (lambda v, body: not v, "frequency_penalty is not supported (use 0)"),
    "logit_bias": (lambda v, body: not v, "logit_bias is not supported"),
    "suffix": (lambda v, body: not v, "suffix is not supported"),
    "best_of": (
        lambda v, body: v is None or v == body.n,
        "best_of must equal n (best_of > n is not supported)",
    ),
}

# Fields the schemas do not declare (raw JSON values): (accepted?, what is accepted).
_UNDECLARED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (lambda v: v is False, "only false is supported (nothing is stored)"),
    "metadata": (_empty, "only an empty object is supported (nothing is stored)"),
    "modalities": (lambda v: v == ["text"], 'only ["text"] is supported'),
    "service_tier": (lambda v: v in ("auto", "default"), 'only "auto" or "default"'),
    "safety_identifier": (lambda v: isinstance(v, str), "must be a string"),
    "prompt_cache_key": (lambda v: isinstance(v, str), "must be a string"),
    "repetition_penalty": (lambda v: v == 1 and not isinstance(v, bool), "only 1 is supported"),
    "min_tokens": (lambda v: v == 0 and not isinstance(v, bool), "only 0 is supported"),
    "use_beam_search": (lambda v: v is False, "only false is supported"),
}


_KNOWN = {e: frozenset(r.name for r in FIELDS if getattr(r, e) != "-") for e in _ENDPOINTS}
_ALL_KNOWN = _KNOWN["completions"] | _KNOWN["chat"]

# What check_fields accepts of each _UNDECLARED field, as JSON schemas (null is "not set").
_UNDECLARED_SCHEMAS: dict[str, dict[str, Any]] = {
    "store": {"enum": [False]},
    "metadata": {"anyOf": [{"type": "object", "maxProperties": 0}, {"enum": [{}, [], ""]}]},
    "modalities": {"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1},
    "service_tier": {"enum": ["auto", "default"]},
    "safety_identifier": {"type": "string"},
    "prompt_cache_key": {"type": "string"},
    "repetition_penalty": {"type": "number", "const": 1},
    "min_tokens": {"type": "integer", "const": 0},
    "use_beam_search": {"enum": [False]},
}


def undeclared_field_schemas(endpoint: Literal["completions", "chat"]) -> dict[str, Any]:
    """JSON schemas of the known fields the request model leaves undeclared, as
    :func:`check_fields` takes them: a refused field (or the other endpoint's) only as null,
    a partly honoured one with its accepted values or null. The OpenAPI document lists them,
    so that a body it calls valid is one the server accepts (tests/test_openapi.py)."""
    out: dict[str, Any] = {}
    for name in sorted(_ALL_KNOWN):
        ok = _UNDECLARED_SCHEMAS.get(name) if name in _KNOWN[endpoint] else None
        out[name] = {"anyOf": [ok, {"type": "null"}]} if ok else {"type": "null"}
    return out


_MAX_WARNED = 1024  # distinct names remembered; beyond it, unknown fields are ignored quietly
_warned: set[str] = set()
_warned_lock = threading.Lock()


def reset_warnings() -> None:
    """Forgets which unknown field names were warned about (tests)."""
    with _warned_lock:
        _warned.clear()


def _warn_once(name: str, endpoint: str) -> None:
    with _warned_lock:
        if name in _warned or len(_warned) >= _MAX_WARNED:
            return
        _warned.add(name)
    logger.warning(
        "ignoring the unknown request field %r of %s (neither an OpenAI field nor a known "
        "extension); logged once per field name",
        shown(name),
        endpoint,
    )


def check_fields(body: BaseModel, endpoint: Literal["completions", "chat"]) -> None:
    """Refuses (400 naming it) each OpenAI field of ``body`` the server does not honour for its
    value; ignores, with one warning per name, fields OpenAI does not define.

    Args:
      body: the validated request (its schema keeps undeclared fields in ``model_extra``).
      endpoint: which endpoint's field list applies.

    Raises:
      APIError: 400 with ``param`` the refused field.
    """
    declared = type(body).model_fields
    for name, (ok, message) in _VALUE_RULES.items():
        if name in declared and not ok(getattr(body, name), body):
            raise APIError(400, message, param=name)
    for name, value in (body.model_extra or {}).items():
        if value is None:
            continue  # null is "not set", for every field
        if name in _KNOWN[endpoint]:
            rule = _UNDECLARED.get(name)
            if rule is None:
                raise APIError(400, f"'{name}' is not supported by this server", param=name)
            if not rule[0](value):
                raise APIError(400, f"'{name}': {rule[1]}", param=name)
        elif name in _ALL_KNOWN:  # the other endpoint's field: never silently dropped
            raise APIError(400, f"'{name}' is not a field of this endpoint", param=name)
        else:
            _warn_once(name, endpoint)
