"""Graceful shutdown (paxcache/server/shutdown.py): drain with 503s, then the server aborts
what is still running itself, before the shutdown timeout ends.

In-process: the app around the fake engine under a ``DrainingServer`` in a thread (the drain
started by calling its signal handler). The real server under a real SIGTERM is the last test
of tests/test_server.py (it reuses that module's server and these checks).
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import uvicorn
from server_harness import FakeEngine, free_port, metric_values

from paxcache.server import create_app
from paxcache.server.shutdown import DrainingServer

LONG = {"prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def read_stream(base: str, body: dict, out: dict, key: str, headers=None) -> None:
    """POSTs a streaming completion; stores its status and ``data:`` events under ``key``."""
    try:
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body, headers=headers, timeout=60
        ) as s:
            events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
            out[key] = (s.status_code, events)
    except httpx.HTTPError as e:  # an incomplete read is what this file proves never happens
        out[key] = ("error", repr(e))


def post_completion(base: str, body: dict, out: dict, key: str, headers=None) -> None:
    try:
        out[key] = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
    except httpx.HTTPError as e:
        out[key] = ("error", repr(e))


def check_aborted_stream(status, events: list[str]) -> None:
    """A stream the shutdown cut: a last chunk with a finish reason, an error event, [DONE]."""
    assert status == 200, events
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    last = json.loads(events[-3])
    assert last["choices"][0]["finish_reason"] == "abort", last
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-3])
    assert "".join(texts)  # it had started; no earlier chunk had a finish reason


def check_503_json(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["x-request-id"].startswith("req-")
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert error["request_id"] == r.headers["x-request-id"]


def test_shutdown_drains_then_aborts_streams_and_requests_before_the_timeout():
    # Seconds wide enough that a loaded CI box (two suites on two cores) does not starve the
    # test thread past the drain: 200 tokens take 4 s, longer than the 3 s timeout.
    timeout_s = 3.0
    engine = FakeEngine(step_delay=0.02)
    app = create_app(engine)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")
    server = DrainingServer(config, app.state.shutdown, shutdown_timeout_s=timeout_s)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not (server.started and httpx.get(f"{base}/health").status_code == 200):
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)

    out: dict = {}
    short = {**LONG, "max_tokens": 30, "stream": True}  # 0.6 s: finishes while draining
    workers = [
        threading.Thread(target=read_stream, args=(base, {**LONG, "stream": True}, out, "s1")),
        threading.Thread(
            target=read_stream, args=(base, {**LONG, "n": 2, "stream": True}, out, "s2")
        ),
        threading.Thread(target=read_stream, args=(base, short, out, "short")),
        threading.Thread(target=post_completion, args=(base, LONG, out, "plain")),
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
    check_503_json(late)  # the socket is open: a 503, not connection refused
    assert late.headers["connection"] == "close"
    health = httpx.get(f"{base}/health")
    assert health.status_code == 503 and health.json()["status"] == "shutting down"
    assert httpx.get(f"{base}/metrics").status_code == 200  # scrapes still served

    for w in workers:
        w.join(10)
    thread.join(10)
    elapsed = time.monotonic() - t_signal
    assert not thread.is_alive()
    assert elapsed < timeout_s + 1.0, elapsed  # ended within the timeout (plus join slack)

    status, events = out["short"]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"]
    assert "error" not in "".join(events)  # finished while draining, untouched
    check_aborted_stream(*out["s1"])
    status, events = out["s2"]
    assert status == 200 and events[-1] == "[DONE]"
    reasons = {
        json.loads(e)["choices"][0]["index"]: json.loads(e)["choices"][0]["finish_reason"]
        for e in events[:-2]
    }
    assert reasons == {0: "abort", 1: "abort"}  # both choices of n=2 end
    check_503_json(out["plain"])
    assert len(engine.aborted) == 3 and not engine.reqs  # through the engine's abort path


def check_real_sigterm(real, shutdown_timeout_s: float) -> None:
    """SIGTERM while five requests run on ``real`` (tests/test_server.py's ``ServerProcess``,
    started with ``--shutdown-timeout``): the short stream finishes while draining; the long
    ones are aborted by the server before the timeout ends, each with an answer; a request
    after the signal gets a 503; the process exits 0."""
    headers = real.headers()
    short = {**LONG, "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
    long = {**LONG, "max_tokens": 900}  # minutes on CPU
    out: dict = {}
    jobs = [(read_stream, short, "short"), (post_completion, long, "plain")]
    jobs += [(read_stream, {**long, "stream": True}, f"s{i}") for i in range(3)]
    workers = [threading.Thread(target=f, args=(real.base, b, out, k, headers)) for f, b, k in jobs]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 30
    while metric_values(httpx.get(f"{real.base}/metrics", headers=headers).text).get(
        "paxcache_requests_running", 0
    ) < len(jobs):
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.05)
    t_signal = time.monotonic()
    real.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    late = httpx.post(f"{real.base}/v1/completions", json={"prompt": "x"}, headers=headers)
    check_503_json(late)  # draining: the socket still answers
    for w in workers:
        w.join(30)
    assert time.monotonic() - t_signal < shutdown_timeout_s + 0.5, (
        out
    )  # every answer within the timeout
    assert real.proc.wait(60) == 0, real.output
    status, lines = out["short"]
    assert status == 200 and lines[-1] == "[DONE]", lines[-3:]
    assert json.loads(lines[-2])["usage"]["completion_tokens"] == 64
    assert json.loads(lines[-3])["choices"][0]["finish_reason"] == "length"
    for i in range(3):
        check_aborted_stream(*out[f"s{i}"])
    check_503_json(out["plain"])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{real.base}/health", timeout=2)
