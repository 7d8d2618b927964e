"""Tests for the OpenAI-compatible server (paxcache/server/, scripts/serve.py).

Two layers:
- In-process: the app around a small fake engine, served by uvicorn in a thread on a free
  loopback port (fast; covers the protocol, validation, backpressure, faults, disconnects).
- Subprocess: the real ``scripts/serve.py`` with the bundled tiny model and the real engine,
  driven by the official ``openai`` client (skipped while the engine is not importable).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import FakeEngine, real_server_env, serve_in_thread
from server_harness import free_port as _free_port
from server_harness import metric_values as _metric_values
from server_harness import wait_idle as _wait_idle

from paxcache.models.tokenizer import ByteTokenizer
from paxcache.server import create_app

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# The fake engine and in-process serving live in tests/server_harness.py; the underscore names
# stay importable from here (tests/test_security.py and tests/test_stress.py import them).


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(step_delay=0.002)
    app = create_app(engine, max_queue=64)
    with serve_in_thread(app) as base:
        yield base, engine


def _client(base: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=30, **kw
    )


# ----------------------------------------------------------------------------------------------
# In-process tests (fake engine)


def test_health_models_and_warmup(fake):
    base, engine = fake
    assert httpx.get(f"{base}/health").status_code == 200
    assert engine.warmed_up
    models = _client(base).models.list()
    assert [m.id for m in models.data] == ["fake-model"]


def test_health_is_503_until_warmup_done():
    engine = FakeEngine()
    release = threading.Event()
    engine.warmup = lambda: release.wait(10)  # type: ignore[method-assign]
    with serve_in_thread(create_app(engine), wait_ready=False) as base:
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and r.json()["status"] == "warming up"
        release.set()
        deadline = time.monotonic() + 5
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_openai_client_completion_greedy_is_deterministic(fake):
    base, _ = fake
    client = _client(base)
    a = client.completions.create(model="fake-model", prompt="Hi", max_tokens=7, temperature=0)
    b = client.completions.create(model="fake-model", prompt="Hi", max_tokens=7, temperature=0)
    assert a.choices[0].text == b.choices[0].text == "lo worl"  # prompt = BOS + 2 bytes
    assert a.choices[0].finish_reason == "length"
    assert a.usage.prompt_tokens == 3 and a.usage.completion_tokens == 7
    assert a.object == "text_completion" and a.model == "fake-model"


def test_openai_client_streaming_completion_matches_non_streaming(fake):
    base, _ = fake
    client = _client(base)
    full = client.completions.create(model="fake-model", prompt="abc", max_tokens=9, temperature=0)
    chunks = list(
        client.completions.create(
            model="fake-model",
            prompt="abc",
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage.completion_tokens == 9 and not chunks[-1].choices


def test_openai_client_chat_streaming_and_not(fake):
    base, _ = fake
    client = _client(base)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(
        model="fake-model", messages=msgs, max_tokens=6, temperature=0
    )
    assert full.choices[0].message.role == "assistant"
    assert len(full.choices[0].message.content) == 6
    stream = client.chat.completions.create(
        model="fake-model", messages=msgs, max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_default_max_tokens_fills_the_context(fake):
    base, _ = fake
    r = _client(base).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "x"}], temperature=0
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens <= 256


def test_seeded_sampling_reproduces_and_n_gives_distinct_indices(fake):
    base, _ = fake
    client = _client(base)
    kw = dict(model="fake-model", prompt="x", max_tokens=8, temperature=1.0, seed=5, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1


def test_batch_prompts_and_token_id_prompts(fake):
    base, _ = fake
    r = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": ["a", "bb"], "max_tokens": 3, "temperature": 0, "n": 2},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12
    r = httpx.post(
        f"{base}/v1/completions", json={"prompt": [104, 105], "max_tokens": 2, "temperature": 0}
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_ends_at_length_even_if_the_dropped_token_stops(fake, stream):
    # The engine samples one token it then drops; here that token completes the stop string
    # "l" ("Hi" + greedy "lo..."), as an EOS might. The completion is the prompt: "length".
    base, _ = fake
    kw = dict(model="fake-model", prompt="Hi", max_tokens=0, echo=True, temperature=0, stop=["l"])
    if stream:
        chunks = list(_client(base).completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = _client(base).completions.create(**kw).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert (text, reason) == ("Hi", "length")


def test_stop_strings_and_logprobs(fake):
    base, _ = fake
    client = _client(base)
    r = client.completions.create(
        model="fake-model", prompt="Hi", max_tokens=12, temperature=0, stop=[" w"], logprobs=2
    )
    assert r.choices[0].text == "lo" and r.choices[0].finish_reason == "stop"
    assert r.model_dump()["choices"][0]["stop_reason"] == " w"  # vLLM's field
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] == -0.25 and len(lp.top_logprobs[0]) == 2
    c = client.chat.completions.create(
        model="fake-model",
        max_tokens=3,
        temperature=0,
        messages=[{"role": "user", "content": "q"}],
        logprobs=True,
        top_logprobs=1,
    )
    entry = c.choices[0].logprobs.content[0]
    assert entry.logprob == -0.25 and len(entry.top_logprobs) == 1
    assert c.model_dump()["choices"][0]["stop_reason"] is None  # ended by its length


BAD_INPUTS = [
    # (path, body or raw bytes, expected status, expected param or None)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[]", 400, None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 300, "max_tokens": 4}, 400, None),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": 3.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "model": "nope"},
        404,
        "model",
    ),
    ("/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_openai_style_error_and_server_keeps_serving(
    fake, path, body, status, param
):
    base, _ = fake
    if isinstance(body, bytes):
        r = httpx.post(f"{base}{path}", content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(f"{base}{path}", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "request_id"} and err["message"]
    assert err["request_id"] == r.headers["x-request-id"]
    if param is not None:
        assert err["param"] == param, err
    ok = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200


def test_openai_client_raises_its_typed_errors(fake):
    base, _ = fake
    client = _client(base)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake-model", prompt="x", temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_body_size_limit_413_declared_and_chunked():
    app = create_app(FakeEngine(), max_body_bytes=1000)
    with serve_in_thread(app) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413 and "too large" in r.json()["error"]["message"]

        def chunks():
            for _ in range(20):
                yield b" " * 100

        r = httpx.post(
            f"{base}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200


def test_api_key_required_on_every_route_but_health():
    app = create_app(FakeEngine(), api_key="sekret")
    with serve_in_thread(app) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        for path in ("/metrics", "/docs", "/openapi.json", "/v1/models", "/nothing"):
            assert httpx.get(f"{base}{path}").status_code == 401, path
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.get(f"{base}/metrics", headers=auth).status_code == 200
        r = httpx.get(f"{base}/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(
            f"{base}/v1/completions",
            json={"prompt": "x"},
            headers={"Authorization": "Bearer wrong"},
        )
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            _client(base, api_key="wrong").completions.create(model="fake-model", prompt="x")
        r = _client(base, api_key="sekret").completions.create(
            model="fake-model", prompt="x", max_tokens=2
        )
        assert len(r.choices[0].text) == 2


def test_full_queue_gets_429_at_once():
    engine = FakeEngine()
    app = create_app(engine, max_queue=2)
    with serve_in_thread(app) as base:
        engine.gate.clear()  # the engine thread blocks in step(): requests stay in flight
        results: list[int] = []

        def post() -> None:
            results.append(
                httpx.post(
                    f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
                ).status_code
            )

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while app.state.runner.num_inflight < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 429 and time.monotonic() - t0 < 2
        assert r.json()["error"]["code"] == "queue_full"
        engine.gate.set()
        for t in threads:
            t.join(10)
        assert results == [200, 200]
        assert "paxcache_requests_rejected_total 1.0" in httpx.get(f"{base}/metrics").text


def test_engine_failure_fails_only_inflight_requests_and_server_recovers():
    engine = FakeEngine()
    app = create_app(engine)
    with serve_in_thread(app) as base:
        engine.fail_steps = 1
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["type"] == "engine_error"
        # Streaming: the failure arrives as an SSE error event, then [DONE].
        engine.fail_steps = 1
        with httpx.stream(
            "POST", f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}
        ) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 200
        assert "paxcache_engine_errors_total 2.0" in httpx.get(f"{base}/metrics").text
        _wait_idle(base)


def test_concurrent_streams_with_disconnects_free_everything():
    # Dropped streams ask for far more tokens than they could ever finish while the test runs:
    # only an abort on disconnect ends them.
    engine = FakeEngine(step_delay=0.002, max_model_len=1 << 20, max_num_seqs=40)
    app = create_app(engine, max_queue=64)
    with serve_in_thread(app) as base:
        _concurrent_streams_with_disconnects(base, engine)


def _concurrent_streams_with_disconnects(base: str, engine: FakeEngine) -> None:
    n_total, n_drop = 40, 12
    texts: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            drop = i < n_drop
            with httpx.stream(
                "POST",
                f"{base}/v1/completions",
                timeout=30,
                json={
                    "prompt": f"req {i}",
                    "max_tokens": 500_000 if drop else 12,
                    "temperature": 0,
                    "stream": True,
                },
            ) as s:
                got = ""
                for line in s.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    got += json.loads(line[6:])["choices"][0]["text"]
                    if drop and len(got) >= 3:
                        return  # closes the connection mid-stream
                texts[i] = got
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    aborted_before = len(engine.aborted)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_total)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(texts) == n_total - n_drop and all(len(t) == 12 for t in texts.values())
    metrics = _wait_idle(base, engine)
    assert len(engine.aborted) - aborted_before == n_drop
    vals = _metric_values(metrics)
    assert vals["paxcache_requests_waiting"] == 0
    assert vals["paxcache_time_to_first_token_seconds_count"] >= n_total


def test_non_streaming_disconnect_aborts_the_request():
    engine = FakeEngine(step_delay=0.02)
    app = create_app(engine)
    with serve_in_thread(app) as base:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 200}, timeout=0.3
            )
        deadline = time.monotonic() + 5
        while not engine.aborted:
            assert time.monotonic() < deadline, "request was not aborted"
            time.sleep(0.02)
        _wait_idle(base)


def test_metrics_expose_required_names(fake):
    base, _ = fake
    text = httpx.get(f"{base}/metrics").text
    for name in (
        "paxcache_requests_running",
        "paxcache_requests_waiting",
        "paxcache_requests_swapped",
        "paxcache_kv_blocks_used",
        "paxcache_kv_blocks_total",
        "paxcache_prefix_cache_hit_rate",
        "paxcache_generated_tokens_total",
        "paxcache_preemptions_total",
        "paxcache_compilations_total",
        "paxcache_time_to_first_token_seconds_bucket",
    ):
        assert f"\n{name}" in text, name
    assert _metric_values(text)["paxcache_kv_blocks_total"] == 4096


def test_bench_http_drives_a_server_and_reports_percentiles(fake):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from bench_http import format_result, run_http_benchmark
    finally:
        sys.path.pop(0)
    base, _ = fake
    res = run_http_benchmark(base, num_requests=8, concurrency=4, max_tokens=(4, 8), seed=1)
    assert res.completed == 8 and res.errors == 0
    assert 32 <= res.total_output_tokens <= 64
    assert res.ttft_s["p50"] > 0 and res.tpot_s["p99"] > 0
    assert "output tok/s" in format_result(res)


# ----------------------------------------------------------------------------------------------
# The real server: scripts/serve.py with the bundled tiny model, in a subprocess


# Another HF-format checkpoint for the real-server tests (default: the bundled tiny model).
REAL_MODEL = os.environ.get("PAXCACHE_TEST_SERVER_MODEL", "tiny")


def _real_skip_reason() -> str | None:
    try:
        from paxcache.engine import Engine  # noqa: F401
        from paxcache.models import TINY_DIR
    except Exception as e:  # noqa: BLE001
        return f"paxcache.engine not importable yet: {e}"
    if REAL_MODEL == "tiny" and not (Path(TINY_DIR) / "config.json").is_file():
        return "bundled tiny model not present"
    return None


API_KEY = "test-key"


class ServerProcess:
    """``scripts/serve.py`` in a subprocess on a free port; output collected by a thread."""

    def __init__(
        self, *extra: str, startup_timeout: float = 300.0, env: dict[str, str] | None = None
    ) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            str(REPO / "scripts" / "serve.py"),
            "--model",
            REAL_MODEL,
            "--port",
            str(self.port),
            # One 16-token bucket (plain and constrained step): the shapes of the engine of
            # tests/test_structured_server.py, so whichever starts second loads them from the
            # session's compile cache. Extra arguments come last and win.
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "16",
            # No echo / prompt-logprob request is sent here: skip warming those variants.
            "--no-prompt-logprobs-warmup",
            *extra,
        ]
        env = real_server_env(**(env or {}))
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited early:\n{self.output}")
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{self.base}/health", timeout=2)
                if r.status_code == 200:
                    break
                if r.json().get("status") == "error":
                    self.close()
                    raise AssertionError(f"server warm-up failed: {r.text}\n{self.output}")
            if time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"server not healthy after {startup_timeout}s:\n{self.output}")
            time.sleep(0.2)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return _client(self.base, api_key=api_key)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def real():
    reason = _real_skip_reason()
    if reason:
        pytest.skip(reason)
    # The recommended key form; a short shutdown timeout for the last test (SIGTERM).
    server = ServerProcess("--shutdown-timeout", "3", env={"PAXCACHE_API_KEY": API_KEY})
    try:
        yield server
    finally:
        server.close()


def test_real_server_prints_one_startup_line_and_serves_models(real):
    banner = [ln for ln in real.lines if ln.startswith("paxcache serving")]
    assert len(banner) == 1, real.output
    assert f"http://127.0.0.1:{real.port}" in banner[0] and "KV" in banner[0]
    assert "cpu" in banner[0]
    models = real.client().models.list()
    assert len(models.data) == 1


def test_real_completions_and_chat_via_openai_client(real):
    client = real.client()
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt="def add(a, b):", max_tokens=12, temperature=0)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # greedy is deterministic
    assert a.usage.completion_tokens <= 12 and a.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices
    )
    assert streamed == a.choices[0].text
    msgs = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        chat.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_real_seeded_sampling_n_logprobs_and_stop(real):
    client = real.client()
    model = client.models.list().data[0].id
    kw = dict(
        model=model,
        prompt="import ",
        max_tokens=10,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        n=3,
        logprobs=2,
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # the seed reproduces
    assert [c.index for c in a.choices] == [0, 1, 2]
    for c in a.choices:
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) >= 1
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    greedy = (
        client.completions.create(model=model, prompt="import ", max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    stop = greedy[3:5]
    if stop.strip():
        cut = client.completions.create(
            model=model, prompt="import ", max_tokens=24, temperature=0, stop=[stop]
        ).choices[0]
        assert cut.finish_reason == "stop" and cut.text == greedy[: greedy.index(stop)]
        assert cut.model_dump()["stop_reason"] == stop  # the engine's, through the server


REAL_BAD_INPUTS = [
    ({"prompt": "x", "max_tokens": 10**6}, 400),
    ({"prompt": "x" * 100_000, "max_tokens": 4}, 400),  # longer than the model's context
    ({"prompt": "x", "n": 10_000}, 400),
    ({"prompt": "x", "temperature": 7}, 400),
    ({"prompt": "x", "top_p": -1}, 400),
    ({"prompt": "x", "max_tokens": 0}, 400),
    ({"max_tokens": 4}, 400),
    ({"prompt": "x", "model": "no-such-model"}, 404),
]


def test_real_bad_inputs_get_clear_errors_and_server_keeps_serving(real):
    for body, status in REAL_BAD_INPUTS:
        r = httpx.post(f"{real.base}/v1/completions", json=body, headers=real.headers(), timeout=30)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(
        f"{real.base}/v1/completions",
        content=b"{oops",
        headers={**real.headers(), "content-type": "application/json"},
    )
    assert r.status_code == 400
    assert httpx.post(f"{real.base}/v1/completions", json={"prompt": "x"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        real.client(api_key="wrong").models.list()
    ok = real.client().completions.create(
        model=real.client().models.list().data[0].id, prompt="x", max_tokens=2
    )
    assert ok.usage.completion_tokens >= 1


def test_real_40_concurrent_streams_some_disconnect_then_nothing_held(real):
    n_total, n_drop = 40, 10
    done: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        drop = i % 4 == 0
        try:
            with httpx.stream(
                "POST",
                f"{real.base}/v1/completions",
                headers=real.headers(),
                timeout=120,
                json={
                    "prompt": f"# request {i}\n",
                    "max_tokens": 64 if drop else 8,
                    "ignore_eos": drop,
                    "temperature": 0,
                    "stream": True,
                },
            ) as s:
                assert s.status_code == 200, s.read()
                text = ""
                for line in s.iter_lines():
                    if line == "data: [DONE]":
                        done[i] = text
                    elif line.startswith("data: "):
                        ev = json.loads(line[6:])
                        assert "error" not in ev, ev
                        text += ev["choices"][0]["text"]
                        if drop:
                            return  # disconnect after the first chunk
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_total)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not errors, errors[:3]
    assert len(done) == n_total - n_drop
    vals = _metric_values(_wait_idle(real.base, timeout=60, headers=real.headers()))
    assert vals["paxcache_kv_blocks_total"] > 0
    assert vals["paxcache_requests_waiting"] == 0 and vals["paxcache_requests_swapped"] == 0


def test_real_sigterm_finishes_short_requests_aborts_long_ones_and_exits_zero(real):
    # The last test using ``real``: it shuts the module's server down (--shutdown-timeout 3).
    # The scenario and its checks are in tests/test_shutdown.py.
    from test_shutdown import check_real_sigterm

    check_real_sigterm(real, shutdown_timeout_s=3)


def test_completions_that_finish_at_different_steps_are_all_reported():
    # This engine reports only the completions that progressed in a step.
    app = create_app(FakeEngine(partial_outputs=True))
    with serve_in_thread(app) as base:
        body = {
            "prompt": "x",
            "max_tokens": 30,
            "temperature": 1.0,
            "seed": 3,
            "n": 4,
            "stop": ["e", "a"],
        }
        r = httpx.post(f"{base}/v1/completions", json=body).json()
        assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
        lengths = {len(c["text"]) for c in r["choices"]}
        assert len(lengths) > 1  # they did finish at different steps
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as s:
            events = [
                json.loads(ln[6:])
                for ln in s.iter_lines()
                if ln.startswith("data: ") and ln != "data: [DONE]"
            ]
        texts = ["", "", "", ""]
        for ev in events[:-1]:
            texts[ev["choices"][0]["index"]] += ev["choices"][0]["text"]
        assert texts == [c["text"] for c in r["choices"]]
        assert events[-1]["usage"] == r["usage"]


def test_chat_prompt_drops_a_duplicate_bos_written_by_the_template():
    from paxcache.server.convert import chat_token_ids

    class TemplateWithBos(ByteTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            ids = super().encode(text.removeprefix("<s>"), add_special_tokens)
            return [self.bos_token_id, *ids] if text.startswith("<s>") else ids

    tok = TemplateWithBos()
    assert chat_token_ids(tok, "<s>hi") == [256, 104, 105]
    assert chat_token_ids(ByteTokenizer(), "hi") == [256, 104, 105]
