"""No request field is silently dropped (paxcache/server/fields.py, README "Request fields").

The README's field table is parsed and must equal ``fields.FIELDS``; then every row is sent
to a served app (the fake engine of tests/server_harness.py): an honoured value must be
served (200), a refused one must get a 400 whose ``param`` names the field. Unknown fields are
ignored with one warning per name.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest
from server_harness import FakeEngine, serve_in_thread

from paxcache.server import create_app
from paxcache.server.fields import FIELDS, reset_warnings

REPO = Path(__file__).resolve().parents[1]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BASE = {
    "completions": {"prompt": "x", "max_tokens": 1},
    "chat": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
}

# field -> (additions a server honours, additions it refuses); None: not applicable. A key
# (field, endpoint) overrides the field's entry for that endpoint.
SAMPLES: dict = {
    "model": ({"model": "fake-model"}, None),
    "prompt": ({"prompt": ["a", "b"]}, None),
    "messages": (
        {"messages": [{"role": "system", "content": "s"}, *BASE["chat"]["messages"]]},
        None,
    ),
    "max_tokens": ({"max_tokens": 2}, None),
    "max_completion_tokens": ({"max_completion_tokens": 2}, None),
    "temperature": ({"temperature": 0.5}, None),
    "top_p": ({"top_p": 0.9}, None),
    "n": ({"n": 2}, None),
    "stop": ({"stop": ["z"]}, None),
    "seed": ({"seed": 3}, None),
    "stream": ({"stream": True}, None),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, None),
    ("logprobs", "completions"): ({"logprobs": 2}, None),
    ("logprobs", "chat"): ({"logprobs": True}, None),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, None),
    "echo": ({"echo": True, "logprobs": 1}, None),
    "user": ({"user": "u-1"}, None),
    "safety_identifier": ({"safety_identifier": "s-1"}, None),
    "prompt_cache_key": ({"prompt_cache_key": "k"}, None),
    "presence_penalty": ({"presence_penalty": 0}, {"presence_penalty": 0.5}),
    "frequency_penalty": ({"frequency_penalty": 0.0}, {"frequency_penalty": -0.5}),
    "logit_bias": ({"logit_bias": {}}, {"logit_bias": {"1": 5.0}}),
    "best_of": ({"best_of": 1}, {"best_of": 3}),
    "suffix": ({"suffix": ""}, {"suffix": "end"}),
    "store": ({"store": False}, {"store": True}),
    "metadata": ({"metadata": {}}, {"metadata": {"k": "v"}}),
    "modalities": ({"modalities": ["text"]}, {"modalities": ["text", "audio"]}),
    "service_tier": ({"service_tier": "auto"}, {"service_tier": "flex"}),
    "audio": (None, {"audio": {"voice": "alloy", "format": "mp3"}}),
    "prediction": (None, {"prediction": {"type": "content", "content": "x"}}),
    "reasoning_effort": (None, {"reasoning_effort": "low"}),
    "verbosity": (None, {"verbosity": "low"}),
    "web_search_options": (None, {"web_search_options": {}}),
    "functions": (None, {"functions": [{"name": "f", "parameters": {}}]}),
    "function_call": (None, {"function_call": "auto"}),
    "response_format": ({"response_format": {"type": "json_object"}}, None),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, None),
    "tool_choice": ({"tool_choice": "none"}, None),
    "parallel_tool_calls": (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "parallel_tool_calls": False,
        },
        None,
    ),
    "top_k": ({"top_k": 5}, None),
    "min_p": ({"min_p": 0.1}, None),
    "stop_token_ids": ({"stop_token_ids": [7]}, None),
    "ignore_eos": ({"ignore_eos": True}, None),
    "cache_salt": ({"cache_salt": "salt"}, None),
    "prompt_logprobs": ({"prompt_logprobs": 1}, None),
    "repetition_penalty": ({"repetition_penalty": 1}, {"repetition_penalty": 1.2}),
    "min_tokens": ({"min_tokens": 0}, {"min_tokens": 4}),
    "guided_json": (None, {"guided_json": {"type": "object"}}),
    "guided_regex": (None, {"guided_regex": "a+"}),
    "guided_choice": (None, {"guided_choice": ["a", "b"]}),
    "guided_grammar": (None, {"guided_grammar": "root ::= 'a'"}),
    "structured_outputs": (None, {"structured_outputs": {"json": {}}}),
    "use_beam_search": ({"use_beam_search": False}, {"use_beam_search": True}),
    "allowed_token_ids": (None, {"allowed_token_ids": [1, 2]}),
    "bad_words": (None, {"bad_words": ["x"]}),
}


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine()
    with serve_in_thread(create_app(engine, max_queue=64)) as base:
        yield base


def _readme_table() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("### Request fields", 1)[1].split("\n#", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows]


def test_readme_table_is_the_servers_table():
    got = _readme_table()
    want = [[f"`{r.name}`", r.origin, r.completions, r.chat, r.note] for r in FIELDS]
    assert got == want


def _cases() -> list[tuple[str, str, str]]:
    return [
        (r.name, endpoint, getattr(r, endpoint))
        for r in FIELDS
        for endpoint in PATHS
        if getattr(r, endpoint) != "-"
    ]


def _sample(name: str, endpoint: str) -> tuple[dict | None, dict | None]:
    return SAMPLES.get((name, endpoint)) or SAMPLES[name]


@pytest.mark.parametrize(("name", "endpoint", "status"), _cases())
def test_each_field_behaves_as_its_table_row_says(served, name, endpoint, status):
    ok, bad = _sample(name, endpoint)
    url = f"{served}{PATHS[endpoint]}"
    if status in ("honoured", "partly"):
        assert ok is not None, f"{name}: no honoured sample"
        r = httpx.post(url, json={**BASE[endpoint], **ok}, timeout=30)
        assert r.status_code == 200, r.text
    if status in ("partly", "refused"):
        assert bad is not None, f"{name}: no refused sample"
        r = httpx.post(url, json={**BASE[endpoint], **bad}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"], err


def test_every_field_has_a_sample_and_null_means_unset(served):
    for r in FIELDS:
        for endpoint in PATHS:
            if getattr(r, endpoint) == "-" or r.name in ("prompt", "messages"):
                continue
            _sample(r.name, endpoint)
            body = {**BASE[endpoint], r.name: None}
            if r.name == "n":
                continue  # n has a default, null is a type error (as on OpenAI)
            resp = httpx.post(f"{served}{PATHS[endpoint]}", json=body, timeout=30)
            assert resp.status_code in (200, 400), resp.text
            if resp.status_code == 400:  # only a declared field's type check may refuse null
                assert "invalid value" in resp.json()["error"]["message"], (r.name, resp.text)


def test_a_field_of_the_other_endpoint_is_refused(served):
    r = httpx.post(f"{served}/v1/chat/completions", json={**BASE["chat"], "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{served}/v1/completions", json={**BASE["completions"], "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_unknown_fields_are_ignored_with_one_warning_per_name(served, caplog):
    reset_warnings()
    caplog.set_level(logging.WARNING, logger="paxcache.server.fields")
    for endpoint in ("completions", "chat", "completions"):
        for name in ("x_client_tag", "temprature"):
            body = {**BASE[endpoint], name: 1.5}
            r = httpx.post(f"{served}{PATHS[endpoint]}", json=body, timeout=30)
            assert r.status_code == 200, r.text
    warned = [rec.getMessage() for rec in caplog.records if rec.name == "paxcache.server.fields"]
    assert len(warned) == 2, warned
    assert any("'x_client_tag'" in m for m in warned) and any("'temprature'" in m for m in warned)
    assert all(re.search(r"once per field name", m) for m in warned)


def test_a_known_field_with_a_wrong_type_is_still_refused(served):
    for body in ({"temperature": "hot"}, {"store": "yes"}, {"safety_identifier": 5}):
        r = httpx.post(f"{served}/v1/chat/completions", json={**BASE["chat"], **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == next(iter(body)), r.text
