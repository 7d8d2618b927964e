"""vLLM's ``stop_reason`` on every choice the server returns, whole and streamed."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import FakeEngine, serve_in_thread

from paxcache.server import create_app


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(step_delay=0.002)
    with serve_in_thread(create_app(engine, max_queue=64)) as base:
        yield base, engine


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_choice_ended_by_a_stop_string_says_which_in_stop_reason(fake, path):
    """vLLM's ``stop_reason``: the stop string (or stop token id) that ended the choice, null
    on every other streamed chunk and for a choice that ended at its length."""
    base, _ = fake
    body = {"model": "fake-model", "max_tokens": 12, "temperature": 0, "stop": [" w"]}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    whole = httpx.post(base + path, json=body, timeout=30).json()["choices"][0]
    chunks = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += json.loads(line[len("data: ") :])["choices"]
    ended = [c for c in chunks if c.get("finish_reason")]
    assert whole["finish_reason"] == "stop" and whole["stop_reason"] == " w"
    assert [(c["finish_reason"], c["stop_reason"]) for c in ended] == [("stop", " w")]
    assert all(c.get("stop_reason") is None for c in chunks if not c.get("finish_reason"))
    longer = httpx.post(base + path, json={**body, "stop": None, "max_tokens": 2}, timeout=30)
    assert longer.json()["choices"][0]["stop_reason"] is None
