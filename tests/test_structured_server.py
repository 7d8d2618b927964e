"""Structured output and tool calls through the real server (the bundled tiny model, the real
engine, uvicorn in-process) with the official ``openai`` client; the tool-call parsers and the
streaming of tool calls (:mod:`paxcache.server.structured`) on their own."""

from __future__ import annotations

import json

import httpx
import pytest

from paxcache.server.protocol import ChatCompletionRequest
from paxcache.server.structured import (
    HERMES,
    LLAMA3_JSON,
    ToolPlan,
    ToolStream,
    chat_message,
    chat_plan,
    parse_tool_calls,
    tool_parser,
)

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -999, "maximum": 999},
        "b": {"type": "integer", "minimum": -999, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def person_ok(d: object) -> bool:
    return (
        isinstance(d, dict)
        and set(d) == {"name", "age", "ok"}
        and isinstance(d["name"], str)
        and len(d["name"]) <= 8
        and type(d["age"]) is int
        and 0 <= d["age"] <= 150
        and type(d["ok"]) is bool
    )


def weather_ok(d: object) -> bool:
    return (
        isinstance(d, dict)
        and set(d) == {"city", "unit"}
        and isinstance(d["city"], str)
        and len(d["city"]) <= 12
        and d["unit"] in ("c", "f")
    )


def add_ok(d: object) -> bool:
    return (
        isinstance(d, dict)
        and set(d) == {"a", "b"}
        and all(type(v) is int and -999 <= v <= 999 for v in d.values())
    )


def test_the_structural_checks_can_fail():
    assert person_ok({"name": "x", "age": 3, "ok": True})
    assert not person_ok({"name": "x", "age": 151, "ok": True})
    assert weather_ok({"city": "Paris", "unit": "c"}) and not weather_ok({"city": "P", "unit": "k"})
    assert add_ok({"a": 1, "b": 2}) and not add_ok({"a": 1.5, "b": 2})


# ----------------------------------------------------------------------------------------------
# Parsers and streaming, alone


def test_tool_parser_follows_the_chat_template():
    assert tool_parser(None) == HERMES  # the bundled fallback template
    assert tool_parser("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == HERMES
    assert tool_parser("{{ '<|python_tag|>' }}{% if tools %}{% endif %}") == LLAMA3_JSON
    assert tool_parser("{{ messages[0].content }}") is None


def test_parse_hermes_and_llama3_json_calls():
    text = 'Let me look. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    # Not a call: stays content.
    assert parse_tool_calls("<tool_call>{broken", HERMES) == ("<tool_call>{broken", [])
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
    text += '{"name": "x", "parameters": {}}'
    content, calls = parse_tool_calls(text, LLAMA3_JSON)
    assert content is None and [c["function"]["name"] for c in calls] == ["add", "x"]
    assert parse_tool_calls("plain words", LLAMA3_JSON) == ("plain words", [])


def _feed(plan: ToolPlan, pieces: list[str], reason: str = "stop") -> list[tuple[dict, object]]:
    ts = ToolStream(plan)
    out = [ts.push(p, None) for p in pieces]
    out.append(ts.push("", reason))
    return out


def test_auto_streams_text_until_a_call_marker_and_sends_the_call_whole():
    plan = ToolPlan(mode="auto", tools=TOOLS, parser=HERMES)
    pieces = [
        "Sure",
        ", one sec <tool",
        '_call>{"name": "add", ',
        '"arguments": {"a": 1, "b": 2}}',
        "</tool_call>",
    ]
    out = _feed(plan, pieces)
    content = "".join(d.get("content", "") for d, _ in out)
    assert content == "Sure, one sec "  # the partial marker "<tool" was held back, not sent
    calls = [c for d, _ in out for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "add" and calls[0]["index"] == 0
    assert out[-1][1] == "tool_calls"
    # Without a call the held-back tail is flushed as content at the end.
    out = _feed(plan, ["a < b", " <tool"])
    assert "".join(d.get("content", "") for d, _ in out) == "a < b <tool"
    assert out[-1][1] == "stop"


def test_named_streams_arguments_and_required_sends_calls_whole():
    named = ToolPlan(mode="named", tools=TOOLS, name="add")
    out = _feed(named, ['{"a": 1', ', "b": 2}'])
    first = out[0][0]["tool_calls"][0]
    assert first["function"]["name"] == "add" and first["id"].startswith("call_")
    args = "".join(c["function"]["arguments"] for d, _ in out for c in d.get("tool_calls", []))
    assert json.loads(args) == {"a": 1, "b": 2} and out[-1][1] == "tool_calls"
    req = ToolPlan(mode="required", tools=TOOLS)
    out = _feed(req, ['[{"name": "add", "arguments": {"a": 1, "b": 2}}', "]"])
    assert out[0] == ({}, None)
    calls = out[-1][0]["tool_calls"]
    assert calls[0]["function"]["name"] == "add" and out[-1][1] == "tool_calls"


def test_required_hoists_the_tools_definitions_to_the_root():
    """``#/$defs/...`` references inside a tool's parameters still resolve in the union (the
    grammar library accepts it), and a clash between two tools is a 400."""
    from paxcache import grammar
    from paxcache.server.protocol import APIError

    point = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/pt"}},
        "required": ["p"],
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
    tools = [
        {"type": "function", "function": {"name": "move", "parameters": point}},
        TOOLS[1],
    ]
    body = ChatCompletionRequest.model_validate(
        {"messages": MSGS, "tools": tools, "tool_choice": "required"}
    )
    plan = chat_plan(body, None)
    assert plan.constraint.json["$defs"] == point["$defs"]
    grammar.validate(plan.constraint)
    other = {**point, "$defs": {"pt": {"type": "string"}}}
    tools.append({"type": "function", "function": {"name": "jump", "parameters": other}})
    body = ChatCompletionRequest.model_validate(
        {"messages": MSGS, "tools": tools, "tool_choice": "required"}
    )
    with pytest.raises(APIError, match="differently") as e:
        chat_plan(body, None)
    assert e.value.param == "tools.2.function.parameters"


def test_required_builds_a_union_over_the_tools_with_their_names():
    body = ChatCompletionRequest.model_validate(
        {"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    )
    plan = chat_plan(body, None)
    schema = plan.constraint.json
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]]
    assert names == ["get_weather", "add"]


def test_two_tools_may_share_a_name_and_a_named_choice_takes_the_first():
    first = {"type": "object", "properties": {"a": {"type": "integer"}}}
    second = {"type": "object", "properties": {"b": {"type": "string"}}}
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": schema}}
        for schema in (first, second)
    ]
    for choice, want in (
        ({"type": "function", "function": {"name": "f"}}, first),
        ("required", None),
    ):
        body = ChatCompletionRequest.model_validate(
            {"messages": MSGS, "tools": tools, "tool_choice": choice}
        )
        plan = chat_plan(body, None)
        if want is not None:
            assert plan.constraint.json == want
        else:
            branches = plan.constraint.json["items"]["anyOf"]
            assert [b["properties"]["arguments"] for b in branches] == [first, second]


# ----------------------------------------------------------------------------------------------
# The real server


@pytest.fixture(scope="module")
def server():
    from server_harness import serve_in_thread

    from paxcache import Engine
    from paxcache.server import create_app

    # One token bucket: the warm-up and the constrained variant compile one program each.
    engine = Engine.from_pretrained("tiny", max_num_seqs=8, max_num_batched_tokens=16)
    engine.warmup_structured = True  # as scripts/serve.py sets it
    with serve_in_thread(create_app(engine)) as base:
        yield base


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=120)


def _stopped_valid(texts_reasons, ok) -> int:
    n = 0
    for text, reason in texts_reasons:
        assert reason in ("stop", "length"), reason
        if reason == "stop":
            assert ok(json.loads(text)), text
            n += 1
    return n


def test_json_schema_strict_at_temperature_1_many_seeds(client):
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    r = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        response_format=rf,
        temperature=1.0,
        n=8,
        seed=1,
        max_tokens=80,
    )
    got = [(c.message.content, c.finish_reason) for c in r.choices]
    assert _stopped_valid(got, person_ok) >= 6
    # Completions too.
    r = client.completions.create(
        model="tiny",
        prompt="A person: ",
        temperature=1.0,
        n=8,
        seed=2,
        max_tokens=80,
        extra_body={"response_format": rf},
    )
    assert _stopped_valid([(c.text, c.finish_reason) for c in r.choices], person_ok) >= 6


def test_json_object(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert isinstance(json.loads(c.message.content), dict)
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, response_format={"type": "text"}, temperature=0, max_tokens=8
    )
    assert r.choices[0].message.content  # free text


def test_forced_named_and_required_tool_calls_validate(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            tools=TOOLS,
            temperature=1.0,
            seed=seed,
            max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        c = r.choices[0]
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert weather_ok(json.loads(call.function.arguments)), call.function.arguments
    r = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        n=4,
        seed=5,
        max_tokens=120,
        parallel_tool_calls=False,
    )
    done = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert done
    for c in done:
        (call,) = c.message.tool_calls
        ok = weather_ok if call.function.name == "get_weather" else add_ok
        assert call.function.name in ("get_weather", "add")
        assert ok(json.loads(call.function.arguments)), call.function.arguments


def test_tool_choice_none_and_auto_answer_text(client):
    for choice in ("none", "auto"):
        r = client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            tools=TOOLS,
            tool_choice=choice,
            temperature=0,
            max_tokens=16,
        )
        c = r.choices[0]
        assert c.message.content and not c.message.tool_calls
        assert c.finish_reason in ("stop", "length")


def test_streaming_json_and_tool_calls(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = client.chat.completions.create(
        model="tiny", messages=MSGS, response_format=rf, temperature=0, max_tokens=80, stream=True
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert person_ok(json.loads(text))
    stream = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        tools=TOOLS,
        temperature=0,
        max_tokens=80,
        stream=True,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    calls = [tc for ch in stream if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "add" and calls[0].id.startswith("call_")
    assert add_ok(json.loads("".join(tc.function.arguments or "" for tc in calls)))
    stream = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: greedy decoding would list calls forever
        temperature=0,
        max_tokens=120,
        stream=True,
    )
    chunks = [ch for ch in stream if ch.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    (call,) = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []][:1]
    assert call.function.name in ("get_weather", "add")


def test_a_tool_call_round_trip_renders(client):
    """A conversation holding an earlier assistant tool call and the tool's answer renders
    (arguments reach the template as objects) and generates."""
    msgs = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, tools=TOOLS, temperature=0, max_tokens=4
    )
    assert r.usage.prompt_tokens > 100


BAD = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
        "response_format.json_schema.schema",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "2"}},
            }
        },
        "response_format",
    ),
    ({"tool_choice": "auto"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools.0.function.parameters",
    ),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools.0.function.parameters",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_bad_schemas_and_tools_are_400_naming_the_field_and_the_server_serves_on(
    server, extra, param
):
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 4, **extra}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    ok = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": "tiny", "messages": MSGS, "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200


def test_a_forced_call_cut_short():
    """``length`` on a named call keeps the partial arguments; on a ``required`` array, the
    calls it completed come back as calls, and with none complete the text comes back as
    content (never a call without a name)."""
    msg, fr = chat_message(ToolPlan(mode="named", name="f"), '{"x":', "length")
    assert fr == "length"
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x":'}
    msg, fr = chat_message(ToolPlan(mode="required"), '[{"name": "add", "argu', "length")
    assert fr == "length" and msg == {"role": "assistant", "content": '[{"name": "add", "argu'}
    out = _feed(ToolPlan(mode="required"), ['[{"name": "add", "argu'], reason="length")
    assert out[-1] == ({"content": '[{"name": "add", "argu'}, "length")
    cut = '[{"name": "add", "arguments": {"a": 1}} , {"name":"get_weather","arguments":{"ci'
    msg, fr = chat_message(ToolPlan(mode="required"), cut, "length")
    assert fr == "length" and msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1}'}
    out = _feed(ToolPlan(mode="required"), [cut[:30], cut[30:]], reason="length")
    assert out[-1][1] == "length"
    assert [c["function"]["name"] for c in out[-1][0]["tool_calls"]] == ["add"]
    # Complete arrays, whitespace included, parse whole; an element that is not a call is
    # skipped, and text that is not an array gives no call.
    two = ' [ {"name": "a", "arguments": {}},{"name": "b", "arguments": {"x": [1, 2]}} ]'
    msg, fr = chat_message(ToolPlan(mode="required"), two, "stop")
    assert fr == "tool_calls" and [c["function"]["name"] for c in msg["tool_calls"]] == ["a", "b"]
    assert msg["tool_calls"][1]["function"]["arguments"] == '{"x": [1, 2]}'
    msg, _ = chat_message(ToolPlan(mode="required"), '[1, {"name": "c"}]', "stop")
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["c"]
    msg, fr = chat_message(ToolPlan(mode="required"), '{"name": "c"}', "stop")
    assert fr == "stop" and msg == {"role": "assistant", "content": '{"name": "c"}'}
