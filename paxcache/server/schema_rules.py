"""The request schemas of ``GET /openapi.json`` tightened to what the server enforces.

pydantic documents each field's type and its static range; the server also checks limits that
depend on the deployment (:class:`paxcache.server.protocol.ServerLimits`, the vocabulary, the
model length) and rules between fields. :func:`tighten_requests` writes those into the
request schemas, so that a body the schema accepts is a body the server accepts, and a body
it refuses gets a 400 (Schemathesis's ``positive_data_acceptance`` and
``negative_data_rejection``; tests/test_openapi.py). What no JSON schema can say (a text or
chat prompt past the context window, a named ``tool_choice`` among the ``tools``, prompts x
``n`` within ``max_choices``) stays a 400 naming the problem, described in the field's
``description``.
"""

from __future__ import annotations

from typing import Any

from paxcache.server.fields import undeclared_field_schemas
from paxcache.server.protocol import ServerLimits

__all__ = ["tighten_requests"]


def _branch(prop: dict[str, Any], kind: str) -> dict[str, Any]:
    """The non-null ``anyOf`` branch of ``prop`` of JSON type ``kind`` (or ``prop`` itself)."""
    for b in prop.get("anyOf", [prop]):
        if b.get("type") == kind:
            return b
    raise KeyError(kind)


def _items_of(prop: dict[str, Any], item_kind: str) -> dict[str, Any]:
    for b in prop.get("anyOf", [prop]):
        if b.get("type") == "array" and b.get("items", {}).get("type") == item_kind:
            return b
    raise KeyError(item_kind)


def _token_ids(arr: dict[str, Any], vocab_size: int | None, max_len: int | None) -> None:
    arr["items"] = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        arr["items"]["maximum"] = vocab_size - 1
    if max_len is not None:
        arr["maxItems"] = max_len


def _sampling(
    s: dict[str, Any], limits: ServerLimits, vocab_size: int | None, max_model_len: int | None
) -> None:
    p = s["properties"]
    # pydantic writes integer bounds as floats; 2**63 as a float is not the bound the server holds.
    _branch(p["seed"], "integer").update(minimum=-(1 << 63), maximum=(1 << 64) - 1)
    if vocab_size is not None:
        _branch(p["top_k"], "integer")["maximum"] = vocab_size
    _branch(p["stop"], "string").update(minLength=1, maxLength=limits.max_stop_chars)
    stops = _items_of(p["stop"], "string")
    stops["maxItems"] = limits.max_stop
    stops["items"].update(minLength=1, maxLength=limits.max_stop_chars)
    _token_ids(_branch(p["stop_token_ids"], "array"), vocab_size, None)
    _branch(p["stop_token_ids"], "array")["maxItems"] = limits.max_stop_token_ids
    for name in ("presence_penalty", "frequency_penalty"):
        p[name].update(minimum=0.0, maximum=0.0, description="Not supported: 0 only")
    logit_bias = _branch(p["logit_bias"], "object")
    logit_bias.update(maxProperties=0, description="Not supported: empty or null only")
    _branch(p["cache_salt"], "string").update(minLength=1, maxLength=limits.max_cache_salt_chars)
    _branch(p["prompt_logprobs"], "integer")["maximum"] = limits.max_logprobs
    if max_model_len is not None:
        _branch(p["max_tokens"], "integer")["maximum"] = max_model_len - 1
    rules = s.setdefault("allOf", [])
    # vLLM's rule: prompt_logprobs is not streamed.
    rules.append(
        {
            "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
            "then": {"properties": {"prompt_logprobs": {"type": "null"}}},
        }
    )


def _completion(
    s: dict[str, Any], limits: ServerLimits, vocab_size: int | None, max_model_len: int | None
) -> None:
    p = s["properties"]
    p.pop("best_of", None)  # accepted only equal to n: a no-op, left undocumented
    _branch(p["suffix"], "string").update(maxLength=0, description="Not supported: empty only")
    _branch(p["logprobs"], "integer")["maximum"] = limits.max_logprobs
    prompt = p["prompt"]
    texts = _items_of(prompt, "string")
    ids = _items_of(prompt, "integer")
    lists = _items_of(prompt, "array")
    max_ids = None if max_model_len is None else max_model_len - 1
    # No maxLength on text: how many tokens a text makes is known only by tokenizing it (a
    # bound safe for every text, 4 UTF-8 bytes a character, would refuse most texts that fit);
    # a prompt past the context is a 400 naming the model length.
    texts.update(minItems=1, maxItems=limits.max_prompts)
    _token_ids(ids, vocab_size, max_ids)
    ids["minItems"] = 1
    lists.update(minItems=1, maxItems=limits.max_prompts)
    _token_ids(lists["items"], vocab_size, max_ids)
    lists["items"]["minItems"] = 1
    prompt["description"] = (
        "Text, texts, token ids, or lists of token ids (ids inside the vocabulary); each "
        "prompt must leave room in the context for one generated token (400 otherwise)"
    )
    rules = s.setdefault("allOf", [])
    # prompts x n <= max_choices is stated in words only: exactly it takes one anyOf branch per
    # largest n a number of prompts allows (15 by default), past what Schemathesis 4.32 can
    # generate from (combined with the rules below).
    p["n"]["description"] = (
        f"Completions per prompt; prompts x n at most {limits.max_choices} (limit max_choices)"
    )
    # max_tokens 0 only with echo (score the prompt, generate nothing).
    rules.append(
        {
            "if": {"properties": {"echo": {"const": False}}},
            "then": {"properties": {"max_tokens": {"anyOf": [{"type": "null"}, {"minimum": 1}]}}},
        }
    )


def _chat(s: dict[str, Any], limits: ServerLimits, max_model_len: int | None) -> None:
    p = s["properties"]
    p["messages"]["maxItems"] = limits.max_messages
    p["n"]["maximum"] = min(p["n"]["maximum"], limits.max_choices)
    _branch(p["top_logprobs"], "integer")["maximum"] = limits.max_logprobs
    if max_model_len is not None:
        _branch(p["max_completion_tokens"], "integer")["maximum"] = max_model_len - 1
    rules = s.setdefault("allOf", [])
    # OpenAI's rule: top_logprobs (above 0) needs logprobs.
    rules.append(
        {
            "if": {"properties": {"logprobs": {"const": False}}},
            "then": {"properties": {"top_logprobs": {"anyOf": [{"type": "null"}, {"const": 0}]}}},
        }
    )


def _tools(s: dict[str, Any]) -> None:
    """paxcache.server.structured.chat_plan's rules that a schema can say (two tools with one
    name, or a named ``tool_choice`` not in ``tools``, it cannot: 400s naming them)."""
    no_tools = {
        "anyOf": [{"not": {"required": ["tools"]}}, {"properties": {"tools": {"type": "null"}}}]
    }
    empty = {"properties": {"tools": {"maxItems": 0}}}
    none = {"anyOf": [{"type": "null"}, {"const": "none"}]}
    s.setdefault("allOf", []).extend(
        [
            {"if": {"anyOf": [no_tools, empty]}, "then": {"properties": {"tool_choice": none}}},
            {"if": no_tools, "then": {"properties": {"parallel_tool_calls": {"type": "null"}}}},
        ]
    )
    s["properties"]["tools"]["description"] = (
        "Functions the model may call; their names unique, a named `tool_choice` among them"
    )


def _response_format(s: dict[str, Any]) -> None:
    """``json_schema`` with type ``json_schema`` (then required), never with ``text`` (a
    schema the grammar library cannot compile is a 400 naming it)."""
    js = {"$ref": "#/components/schemas/JSONSchemaFormat"}
    s["allOf"] = [
        {
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"required": ["json_schema"], "properties": {"json_schema": js}},
        },
        {
            "if": {"properties": {"type": {"const": "text"}}},
            "then": {"properties": {"json_schema": {"type": "null"}}},
        },
    ]


def _message(s: dict[str, Any]) -> None:
    """OpenAI's message rules (paxcache.server.protocol.ChatMessage)."""
    tool = {"properties": {"role": {"const": "tool"}}}
    assistant = {"properties": {"role": {"const": "assistant"}}}
    text = {"not": {"type": "null"}}
    s["allOf"] = [
        {
            "if": tool,
            "then": {
                "required": ["tool_call_id", "content"],
                "properties": {"tool_call_id": {"type": "string", "minLength": 1}, "content": text},
            },
            "else": {"properties": {"tool_call_id": {"type": "null"}}},
        },
        {
            "if": assistant,
            "then": {
                "anyOf": [
                    {"required": ["content"], "properties": {"content": text}},
                    {
                        "required": ["tool_calls"],
                        "properties": {"tool_calls": {"type": "array", "minItems": 1}},
                    },
                ]
            },
            "else": {
                "required": ["content"],
                "properties": {"content": text, "tool_calls": {"type": "null"}},
            },
        },
    ]


def _tokenize(s: dict[str, Any], limits: ServerLimits) -> None:
    p = s["properties"]
    p["messages"]["anyOf"][0]["maxItems"] = limits.max_messages
    # Exactly one of prompt and messages.
    s["oneOf"] = [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": False}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": False}},
    ]


def tighten_requests(
    schemas: dict[str, Any],
    limits: ServerLimits,
    *,
    vocab_size: int | None,
    max_model_len: int | None,
    max_num_seqs: int | None = None,
) -> None:
    """Writes the server's limits and cross-field rules into the request schemas (in place).

    Args:
      schemas: the document's ``components.schemas``.
      limits: the server's :class:`ServerLimits`.
      vocab_size: the model's vocabulary (token ids are below it), if known.
      max_model_len: the model's context length, if known.
      max_num_seqs: the engine's most running sequences: a prompt's ``n`` completions run
        together, so ``n`` is at most this (the engine refuses more: 400).
    """
    for name, endpoint in (("CompletionRequest", "completions"), ("ChatCompletionRequest", "chat")):
        props = schemas[name]["properties"]
        for field, schema in undeclared_field_schemas(endpoint).items():
            props.setdefault(field, schema)  # declared fields keep their own schema
        _sampling(schemas[name], limits, vocab_size, max_model_len)
    _completion(schemas["CompletionRequest"], limits, vocab_size, max_model_len)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        n = schemas[name]["properties"]["n"]
        n["maximum"] = min(n["maximum"], limits.max_choices, max_num_seqs or limits.max_choices)
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]
    _branch(prompt, "string")["minLength"] = 1  # an empty text prompt is refused
    _items_of(prompt, "string")["items"]["minLength"] = 1
    _chat(schemas["ChatCompletionRequest"], limits, max_model_len)
    _tools(schemas["ChatCompletionRequest"])
    params = schemas["FunctionDefinition"]["properties"]["parameters"]
    _branch(params, "object")["properties"] = {"type": {"const": "object"}}
    _message(schemas["ChatMessage"])
    _response_format(schemas["ResponseFormat"])
    _tokenize(schemas["TokenizeRequest"], limits)
    _token_ids(schemas["DetokenizeRequest"]["properties"]["tokens"], vocab_size, None)
