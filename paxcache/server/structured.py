"""Structured output and tool calls: OpenAI's ``response_format``, ``tools``, ``tool_choice``
and ``parallel_tool_calls``, turned into an engine constraint
(:class:`paxcache.sampling.StructuredOutputsParams`, enforced token by token inside the step)
and, on the way back, into ``message.tool_calls``.

Requests:

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (one
  JSON value valid under the schema; generated under it whatever ``strict`` says).
* ``tool_choice`` (needs ``tools``): ``"none"`` (the model writes text), ``"auto"`` (the
  default with tools: text, parsed for tool calls in the chat template's format, below),
  ``"required"`` (a JSON array of one or more ``{"name", "arguments"}`` calls, generated under
  the union of the tools' parameter schemas, names included; one call when
  ``parallel_tool_calls`` is false), or ``{"type": "function", "function": {"name"}}`` (that
  tool's arguments, generated under its parameter schema). Forced calls come back as
  ``tool_calls`` with ``finish_reason: "tool_calls"`` (``"length"`` if cut short).
* ``tools`` are passed to the chat template (as transformers does); the bundled fallback
  template lists them in a ``<|tools|>`` block.

``auto`` parsers, picked from the chat template: Hermes / Qwen
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; also the fallback template's
format) and Llama-3 JSON (``{"name": ..., "parameters": ...}``, optionally after
``<|python_tag|>``, several separated by ``;``). A template with neither gets no parser: the
text comes back as ``content``.

Streaming: content deltas stream as they come; a named call streams its ``arguments`` as
``delta.tool_calls`` chunks; ``required`` and ``auto`` calls are sent whole when complete
(``auto`` streams the text before a call's opening marker).

Bad input is a 400 naming the field: a schema the grammar library rejects, ``tool_choice``
without ``tools``, a named tool that is not in ``tools``, two tools with one name, a forced
call together with a JSON ``response_format``.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from paxcache import grammar
from paxcache.sampling import StructuredOutputsParams
from paxcache.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ResponseFormat,
    Tool,
)

__all__ = [
    "HERMES",
    "LLAMA3_JSON",
    "ToolPlan",
    "ToolStream",
    "chat_message",
    "chat_plan",
    "check_constraint",
    "forced_calls",
    "parse_tool_calls",
    "response_format_constraint",
    "tool_parser",
]

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def response_format_constraint(rf: ResponseFormat | None) -> StructuredOutputsParams | None:
    """The constraint of a ``response_format`` (None for none or ``text``)."""
    if rf is None or rf.type == "text":
        if rf is not None and rf.json_schema is not None:
            raise APIError(
                400, "json_schema is only allowed with type 'json_schema'", param="response_format"
            )
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    js = rf.json_schema
    if js is None:
        raise APIError(
            400,
            "response_format of type 'json_schema' needs a json_schema object",
            param="response_format.json_schema",
        )
    schema = js.schema_ if js.schema_ is not None else {"type": "object"}
    return StructuredOutputsParams(json=schema)


def check_constraint(spec: StructuredOutputsParams | None, param: str) -> None:
    """400 naming ``param`` when the grammar library rejects ``spec`` (or is missing).
    Compiles the grammar: call it off the event loop."""
    if spec is None:
        return
    try:
        grammar.validate(spec)
    except grammar.GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


@dataclass
class ToolPlan:
    """How a chat request's tools are handled.

    Attributes:
      mode: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``.
      tools: the request's tools as the chat template receives them (dicts), or None.
      name: the forced tool (``"named"``).
      parser: the ``auto`` parser (:data:`HERMES`, :data:`LLAMA3_JSON`) or None.
      constraint: the engine constraint (forced calls, or the ``response_format``'s).
    """

    mode: str = "none"
    tools: list[dict] | None = None
    name: str | None = None
    parser: str | None = None
    constraint: StructuredOutputsParams | None = None
    constraint_param: str = "response_format"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def _parameters(tool: Tool) -> dict:
    p = tool.function.parameters
    return p if p is not None else {"type": "object", "properties": {}}


def _root_definitions(tools: list[Tool]) -> dict[str, dict]:
    """The tools' ``$defs`` / ``definitions``, for the root of the ``required`` union (their
    ``#/$defs/...`` references are relative to the document root). Two tools defining one
    name differently are a 400."""
    merged: dict[str, dict] = {}
    for i, t in enumerate(tools):
        for key in ("$defs", "definitions"):
            defs = _parameters(t).get(key)
            if not isinstance(defs, dict):
                continue
            into = merged.setdefault(key, {})
            for name, d in defs.items():
                if into.setdefault(name, d) != d:
                    raise APIError(
                        400,
                        f"tools.{i}.function.parameters defines {key}/{name} differently from "
                        "another tool; tool_choice 'required' needs one definition per name",
                        param=f"tools.{i}.function.parameters",
                    )
    return merged


def tool_parser(chat_template: str | None) -> str | None:
    """The ``auto`` tool-call format a chat template uses (None: no template, the bundled
    fallback's Hermes format; a template with no known format: None)."""
    if not chat_template:
        return HERMES
    if _HERMES_OPEN in chat_template:
        return HERMES
    if _PYTHON_TAG in chat_template or (
        "tools" in chat_template and '"parameters"' in chat_template
    ):
        return LLAMA3_JSON
    return None


def chat_plan(body: ChatCompletionRequest, chat_template: str | None) -> ToolPlan:
    """Validates ``tools`` / ``tool_choice`` / ``response_format`` of a chat request (no
    grammar compiled yet: :func:`check_constraint`).

    Raises:
      APIError: 400 naming the field at fault.
    """
    rf = response_format_constraint(body.response_format)
    tools = body.tools
    choice = body.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        if body.parallel_tool_calls is not None and tools is None:
            raise APIError(400, "parallel_tool_calls requires tools", param="parallel_tool_calls")
        return ToolPlan(constraint=rf)
    # Two tools may share a name (as vLLM allows; no JSON schema can forbid it): a named
    # tool_choice takes the first of them.
    names = [t.function.name for t in tools]
    for i, t in enumerate(tools):
        check = t.function.parameters
        if check is not None and check.get("type", "object") != "object":
            raise APIError(
                400,
                f"tools.{i}.function.parameters must be a JSON schema of an object",
                param=f"tools.{i}.function.parameters",
            )
    as_dicts = [t.model_dump(exclude_none=True) for t in tools]
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        mode, name = choice, None
    else:
        mode, name = "named", choice.function.name
        if name not in names:
            raise APIError(
                400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
    plan = ToolPlan(mode=mode, tools=as_dicts, name=name, constraint=rf)
    if plan.forced:
        if rf is not None:
            raise APIError(
                400,
                "response_format cannot constrain a forced tool call (tool_choice "
                f"{'required' if mode == 'required' else 'naming a function'})",
                param="response_format",
            )
        plan.constraint_param = "tools"
        if mode == "named":
            tool = tools[names.index(name)]
            plan.constraint = StructuredOutputsParams(json=_parameters(tool))
        else:
            calls = {
                "type": "array",
                "minItems": 1,
                "items": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {
                                "name": {"const": t.function.name},
                                "arguments": _parameters(t),
                            },
                            "required": ["name", "arguments"],
                            "additionalProperties": False,
                        }
                        for t in tools
                    ]
                },
            }
            if body.parallel_tool_calls is False:
                calls["maxItems"] = 1
            calls.update(_root_definitions(tools))
            plan.constraint = StructuredOutputsParams(json=calls)
    elif mode == "auto":
        plan.parser = tool_parser(chat_template)
    return plan


def _call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _json_calls(text: str) -> list[dict] | None:
    """Llama-3 JSON calls: one object or several separated by ``;``; None if it is not that."""
    text = text.strip()
    if text.startswith(_PYTHON_TAG):
        text = text[len(_PYTHON_TAG) :].strip()
    if not text.startswith("{"):
        return None
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("parameters", obj.get("arguments", {}))
        calls.append(_call(obj["name"], args))
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return calls or None


def parse_tool_calls(text: str, parser: str | None) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a model's text in ``parser``'s format; text that is not a
    well-formed call stays content."""
    if parser == HERMES and _HERMES_OPEN in text:
        calls: list[dict] = []
        rest: list[str] = []
        pattern = re.compile(
            re.escape(_HERMES_OPEN) + r"(.*?)(?:" + re.escape(_HERMES_CLOSE) + r"|$)", re.S
        )
        pos = 0
        for m in pattern.finditer(text):
            try:
                obj = json.loads(m.group(1).strip())
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                rest.append(text[pos : m.start()])
                calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
                pos = m.end()
        rest.append(text[pos:])
        content = "".join(rest).strip()
        return (content or None), calls
    if parser == LLAMA3_JSON:
        calls = _json_calls(text) or []
        if calls:
            return None, calls
    return text, []


def _complete_items(text: str) -> list[Any]:
    """The complete elements of a JSON array, in order, whether or not the array itself is
    complete: ``'[{"a": 1}, {"b'`` gives ``[{"a": 1}]``. Text that is not an array gives []."""
    decoder = json.JSONDecoder()
    ws = " \t\r\n"
    pos = len(text) - len(text.lstrip(ws))
    if not text.startswith("[", pos):
        return []
    pos += 1
    items: list[Any] = []
    while True:
        while pos < len(text) and text[pos] in ws:
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return items
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items  # cut short inside this element
        items.append(item)
        while pos < len(text) and text[pos] in ws:
            pos += 1
        if pos >= len(text) or text[pos] != ",":
            return items
        pos += 1


def forced_calls(plan: ToolPlan, text: str) -> list[dict]:
    """The tool calls of a forced (``required`` or named) completion's text. A named call cut
    short (``length``) keeps its partial arguments; a ``required`` array cut short keeps the
    calls it completed (none complete: no call, and its text is returned as content)."""
    if plan.mode == "named":
        return [_call(plan.name or "", text)]
    return [
        _call(it["name"], it.get("arguments", {}))
        for it in _complete_items(text)
        if isinstance(it, dict) and isinstance(it.get("name"), str)
    ]


def chat_message(plan: ToolPlan, text: str, reason: str | None) -> tuple[dict, str | None]:
    """A finished choice's ``message`` and finish reason."""
    calls: list[dict] = []
    content: str | None = text
    if plan.forced:
        calls, content = forced_calls(plan, text), None
    elif plan.mode == "auto" and plan.parser is not None:
        content, calls = parse_tool_calls(text, plan.parser)
    if not calls:
        return {"role": "assistant", "content": text}, reason
    msg = {"role": "assistant", "content": content, "tool_calls": calls}
    return msg, "tool_calls" if reason == "stop" else reason


@dataclass
class ToolStream:
    """Turns one choice's text deltas into chat ``delta`` objects under a :class:`ToolPlan`
    (see the module docstring for what streams when)."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # auto: characters of ``text`` sent as content
    held: bool = False  # auto: a call may have started (the rest is buffered); named: begun
    call_id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def push(self, delta: str, reason: str | None) -> tuple[dict, str | None]:
        """``(delta object, finish reason)`` for this text delta (and the finish reason, on
        the last one)."""
        self.text += delta
        plan = self.plan
        if plan.mode == "named":
            out: dict = {}
            if delta or not self.held:  # the first chunk names the call
                fn: dict = {"arguments": delta}
                call: dict = {"index": 0, "function": fn}
                if not self.held:
                    call.update(id=self.call_id, type="function")
                    fn["name"] = plan.name
                self.held = True
                out = {"tool_calls": [call]}
            return out, ("tool_calls" if reason == "stop" else reason)
        if plan.mode == "required":
            if reason is None:
                return {}, None
            calls = [dict(c, index=i) for i, c in enumerate(forced_calls(plan, self.text))]
            if not calls:  # cut short: the text as content, as chat_message returns it
                return ({"content": self.text} if self.text else {}), reason
            return {"tool_calls": calls}, ("tool_calls" if reason == "stop" else reason)
        if plan.mode == "auto" and plan.parser is not None:
            return self._auto(reason)
        return ({"content": delta} if delta else {}), reason

    def _auto(self, reason: str | None) -> tuple[dict, str | None]:
        if not self.held:
            marker = self._marker_start()
            if marker is None:
                safe = len(self.text) - self._partial_marker()
                out = self.text[self.sent : safe]
            else:
                self.held = True
                out = self.text[self.sent : marker]
            self.sent += len(out)
            if reason is None:
                return ({"content": out} if out else {}), None
        else:
            out = ""
        if reason is None:
            return {}, None
        # Finished: parse what was held back.
        content, calls = parse_tool_calls(self.text[self.sent :], self.plan.parser)
        delta: dict = {}
        text = out + (content or "")
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(calls)]
            return delta, ("tool_calls" if reason == "stop" else reason)
        return delta, reason

    def _marker_start(self) -> int | None:
        if self.plan.parser == LLAMA3_JSON:
            stripped = self.text.lstrip()
            if not stripped:
                return None
            if self.sent == 0 and stripped.startswith(("{", _PYTHON_TAG)):
                return 0
            return None
        i = self.text.find(_HERMES_OPEN, self.sent)
        return None if i < 0 else i

    def _partial_marker(self) -> int:
        """Characters at the end of the text that could begin a marker (held back)."""
        if self.plan.parser == LLAMA3_JSON:
            stripped = self.text.lstrip()
            if not stripped or _PYTHON_TAG.startswith(stripped):
                return len(self.text) - self.sent
            return 0
        for k in range(min(len(_HERMES_OPEN) - 1, len(self.text) - self.sent), 0, -1):
            if _HERMES_OPEN.startswith(self.text[-k:]):
                return k
        return 0
