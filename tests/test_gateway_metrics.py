"""Gateway metrics under vLLM's names (paxcache/server/metrics.py): they parse as Prometheus
text, carry vLLM's ``model_name`` label, and move with the traffic."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import FakeEngine, serve_in_thread, wait_idle

from paxcache.server import create_app

GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)
COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:request_success",
)
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
)


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine(step_delay=0.002)
    with serve_in_thread(create_app(engine, served_model_name="gw-model")) as base:
        yield base, engine


def _scrape(base: str) -> dict[str, dict[tuple, float]]:
    """metric sample name -> {sorted label items: value}, through prometheus_client's parser."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _one(samples: dict, name: str, **labels: str) -> float:
    want = {"model_name": "gw-model", **labels}
    got = [v for k, v in samples.get(name, {}).items() if dict(k).items() >= want.items()]
    assert len(got) == 1, (name, samples.get(name))
    return got[0]


def test_vllm_metric_names_parse_with_the_model_label_and_move(served):
    base, _ = served
    before = _scrape(base)
    for name in GAUGES:
        assert 0.0 <= _one(before, name) <= (1.0 if "perc" in name else 1e9), name
    for name in COUNTERS:
        _one(before, name + "_total", **({"finished_reason": "stop"} if "success" in name else {}))
    prompt = "tell me a story"
    r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 6})
    assert r.status_code == 200, r.text
    with httpx.stream(
        "POST",
        f"{base}/v1/completions",
        json={"prompt": prompt, "max_tokens": 5, "stream": True},
        timeout=30,
    ) as s:
        assert s.status_code == 200
        list(s.iter_lines())
    wait_idle(base)
    after = _scrape(base)
    assert _one(after, "vllm:prompt_tokens_total") - _one(
        before, "vllm:prompt_tokens_total"
    ) == 2 * (len(prompt.encode()) + 1)
    gen = _one(after, "vllm:generation_tokens_total") - _one(before, "vllm:generation_tokens_total")
    assert gen == 11

    def moved(name: str) -> float:
        return _one(after, name) - _one(before, name)

    # 16 prompt tokens (BOS + 15 bytes) = one block, looked up twice, found the second time.
    assert moved("vllm:prefix_cache_queries_total") == 2
    assert moved("vllm:prefix_cache_hits_total") == 1
    ok = _one(after, "vllm:request_success_total", finished_reason="length")
    assert ok - _one(before, "vllm:request_success_total", finished_reason="length") == 2
    for name in HISTOGRAMS:
        moved = _one(after, name + "_count") - _one(before, name + "_count")
        want = 9 if name == "vllm:inter_token_latency_seconds" else 2  # (6 - 1) + (5 - 1) gaps
        assert moved == want, name
        assert _one(after, name + "_bucket", le="+Inf") == _one(after, name + "_count")
    assert _one(after, "vllm:num_requests_running") == 0
    assert _one(after, "vllm:kv_cache_usage_perc") == 0.0


def test_aborted_requests_count_under_abort_with_their_latency():
    """Every ending counts, as in vLLM: a stream the client drops (n=2: two completions), a
    non-streaming request whose client goes away, and an explicit ``runner.abort`` each count
    under ``finished_reason="abort"`` and in the end-to-end histogram (once per request)."""
    engine = FakeEngine(step_delay=0.005, max_model_len=1 << 20)
    app = create_app(engine, served_model_name="gw-model")
    long = {"prompt": "abc", "max_tokens": 500_000, "temperature": 0}

    def counts() -> tuple[float, float, float]:
        s = _scrape(base)
        return (
            _one(s, "vllm:request_success_total", finished_reason="abort"),
            _one(s, "vllm:e2e_request_latency_seconds_count"),
            _one(s, "vllm:request_success_total", finished_reason="stop")
            + _one(s, "vllm:request_success_total", finished_reason="length"),
        )

    def wait_for(want_aborts: float) -> None:
        deadline = time.monotonic() + 10
        while counts()[0] < want_aborts:
            assert time.monotonic() < deadline, counts()
            time.sleep(0.02)

    with serve_in_thread(app) as base:
        aborts0, e2e0, done0 = counts()
        with httpx.stream(
            "POST", f"{base}/v1/completions", json={**long, "n": 2, "stream": True}, timeout=30
        ) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    break  # closes the connection mid-stream
        wait_for(aborts0 + 2)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=long, timeout=0.3)
        wait_for(aborts0 + 3)

        t = threading.Thread(
            target=_swallow,
            args=(lambda: httpx.post(f"{base}/v1/completions", json=long, timeout=3.0),),
        )
        t.start()
        deadline = time.monotonic() + 5
        while not engine.reqs:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        app.state.runner.abort(list(engine.reqs))
        wait_for(aborts0 + 4)
        t.join(10)
        wait_idle(base, engine)
        aborts, e2e, done = counts()
        assert (aborts - aborts0, e2e - e2e0, done - done0) == (4, 3, 0)


def _swallow(fn) -> None:
    with contextlib.suppress(httpx.HTTPError):
        fn()
