"""Graceful shutdown (paxcache/server/shutdown.py): drain with 503s, then the server aborts
what is still running itself, before the shutdown timeout ends.

In-process: the app around the fake engine under a ``DrainingServer`` in a thread (the drain
started by calling its signal handler). Subprocess: ``scripts/serve.py`` with the bundled
tiny model, a real SIGTERM and ``--shutdown-timeout 2``.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import uvicorn
from server_harness import FakeEngine, free_port

from paxcache.server import create_app
from paxcache.server.shutdown import DrainingServer

LONG = {"prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def _read_stream(base: str, body: dict, out: dict, key: str, headers=None) -> None:
    """POSTs a streaming completion; stores its status and ``data:`` events under ``key``."""
    try:
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body, headers=headers, timeout=60
        ) as s:
            events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
            out[key] = (s.status_code, events)
    except httpx.HTTPError as e:  # an incomplete read is what this file proves never happens
        out[key] = ("error", repr(e))


def _post(base: str, body: dict, out: dict, key: str, headers=None) -> None:
    try:
        out[key] = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
    except httpx.HTTPError as e:
        out[key] = ("error", repr(e))


def _check_aborted_stream(status, events: list[str]) -> None:
    """A stream the shutdown cut: a last chunk with a finish reason, an error event, [DONE]."""
    assert status == 200, events
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    last = json.loads(events[-3])
    assert last["choices"][0]["finish_reason"] == "abort", last
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-3])
    assert 0 < len("".join(texts)) < LONG["max_tokens"]  # cut, not finished


def _check_503_json(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["x-request-id"].startswith("req-")
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert error["request_id"] == r.headers["x-request-id"]


def test_shutdown_drains_then_aborts_streams_and_requests_before_the_timeout():
    engine = FakeEngine(step_delay=0.01)  # 200 tokens: 2 s, longer than the timeout
    app = create_app(engine)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")
    server = DrainingServer(config, app.state.shutdown, shutdown_timeout_s=1.2)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not (server.started and httpx.get(f"{base}/health").status_code == 200):
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)

    out: dict = {}
    short = {**LONG, "max_tokens": 30, "stream": True}  # 0.3 s: finishes while draining
    workers = [
        threading.Thread(target=_read_stream, args=(base, {**LONG, "stream": True}, out, "s1")),
        threading.Thread(
            target=_read_stream, args=(base, {**LONG, "n": 2, "stream": True}, out, "s2")
        ),
        threading.Thread(target=_read_stream, args=(base, short, out, "short")),
        threading.Thread(target=_post, args=(base, LONG, out, "plain")),
    ]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 10
    while len(engine.reqs) < 4:  # all four running in the engine
        assert time.monotonic() < deadline, engine.reqs
        time.sleep(0.01)
    t_signal = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)  # what the signal does
    time.sleep(0.15)
    late = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    _check_503_json(late)  # the socket is open: a 503, not connection refused
    assert late.headers["connection"] == "close"
    health = httpx.get(f"{base}/health")
    assert health.status_code == 503 and health.json()["status"] == "shutting down"
    assert httpx.get(f"{base}/metrics").status_code == 200  # scrapes still served

    for w in workers:
        w.join(10)
    thread.join(10)
    elapsed = time.monotonic() - t_signal
    assert not thread.is_alive()
    assert elapsed < 1.2 + 0.5, elapsed  # ended within the timeout (plus thread join slack)

    status, events = out["short"]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"]
    assert "error" not in "".join(events)  # finished while draining, untouched
    _check_aborted_stream(*out["s1"])
    status, events = out["s2"]
    assert status == 200 and events[-1] == "[DONE]"
    reasons = {
        json.loads(e)["choices"][0]["index"]: json.loads(e)["choices"][0]["finish_reason"]
        for e in events[:-2]
    }
    assert reasons == {0: "abort", 1: "abort"}  # both choices of n=2 end
    _check_503_json(out["plain"])
    assert len(engine.aborted) == 3 and not engine.reqs  # through the engine's abort path


# ----------------------------------------------------------------------------------------------
# The real server under a real SIGTERM


@pytest.fixture()
def real_short_timeout():
    from test_server import API_KEY, ServerProcess, _real_skip_reason

    reason = _real_skip_reason()
    if reason:
        pytest.skip(reason)
    server = ServerProcess("--shutdown-timeout", "2", env={"PAXCACHE_API_KEY": API_KEY})
    try:
        yield server
    finally:
        server.close()


def test_real_sigterm_past_the_timeout_ends_every_request_with_an_answer(real_short_timeout):
    real = real_short_timeout
    headers = real.headers()
    long = {**LONG, "max_tokens": 900}  # far longer than 2 s on CPU
    out: dict = {}
    workers = [
        threading.Thread(
            target=_read_stream, args=(real.base, {**long, "stream": True}, out, f"s{i}", headers)
        )
        for i in range(4)
    ]
    workers.append(threading.Thread(target=_post, args=(real.base, long, out, "plain", headers)))
    for w in workers:
        w.start()
    deadline = time.monotonic() + 30
    while True:  # every request running in the engine
        text = httpx.get(f"{real.base}/metrics", headers=headers).text
        running = [ln for ln in text.splitlines() if ln.startswith("paxcache_requests_running ")]
        if running and float(running[0].split()[1]) >= 5:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    t_signal = time.monotonic()
    real.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    _check_503_json(
        httpx.post(f"{real.base}/v1/completions", json={"prompt": "x"}, headers=headers)
    )
    assert real.proc.wait(30) == 0, real.output
    assert time.monotonic() - t_signal < 2 + 1.5, real.output  # the timeout, plus exit slack
    for w in workers:
        w.join(10)
    for i in range(4):
        _check_aborted_stream(*out[f"s{i}"])
    _check_503_json(out["plain"])
