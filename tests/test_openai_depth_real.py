"""Issue 16's server checks on the real ``scripts/serve.py`` with the bundled tiny model
(float32 on CPU), through the official ``openai`` client and raw HTTP: echo with prompt
logprobs as lm-eval sends it (equal to a plain dense forward of the same checkpoint within
1e-4), tokenize round trips, the gateway metric names, and no field silently ignored.

Slow (a server subprocess compiles its step shapes at start-up): ``pytest -m slow``.
"""

from __future__ import annotations

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import API_KEY, ServerProcess, _real_skip_reason

pytestmark = pytest.mark.slow

TOL = 1e-4
PROMPT = "def main():\n    print('hello')\n"


@pytest.fixture(scope="module")
def real():
    reason = _real_skip_reason()
    if reason:
        pytest.skip(reason)
    server = ServerProcess(env={"PAXCACHE_API_KEY": API_KEY})
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def dense():
    from paxcache.models import load_pretrained

    model, tok = load_pretrained("tiny")

    def logprobs(ids: list[int]) -> np.ndarray:
        logits = model(jnp.asarray(ids, jnp.int32)[None])[0].astype(jnp.float32)
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        return logp[np.arange(len(ids) - 1), ids[1:]]

    return logprobs, tok


def _post(real, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{real.base}{path}", json=body, headers=real.headers(), timeout=60)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_style_echo_equals_the_dense_forward(real, dense, max_tokens):
    logprobs, tok = dense
    client = real.client()
    model = client.models.list().data[0].id
    ids = tok.encode(PROMPT)
    for prompt in (PROMPT, ids):
        out = client.completions.create(
            model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens,
            temperature=0,
        )  # fmt: skip
        lp = out.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None
        got = lp.token_logprobs[1 : len(ids)]
        np.testing.assert_allclose(got, logprobs(ids), atol=TOL, rtol=0)
        assert out.choices[0].text.startswith(tok.decode(ids))
        assert out.usage.completion_tokens == max_tokens


def test_tokenize_round_trip_with_the_api_key(real):
    got = _post(real, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
    back = _post(real, "/detokenize", {"tokens": got["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    assert httpx.post(f"{real.base}/tokenize", json={"prompt": "x"}).status_code == 401


def test_gateway_metric_names(real):
    text = httpx.get(f"{real.base}/metrics", headers=real.headers()).text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ):
        assert name in names, name


def test_refused_fields_name_themselves_and_unknown_ones_are_ignored_once(real):
    msgs = [{"role": "user", "content": "hi"}]
    for body in ({"logit_bias": {"1": 3}}, {"reasoning_effort": "low"}, {"store": True}):
        r = _post(real, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(body)), r.text
    for _ in range(3):
        r = _post(real, "/v1/completions", {"prompt": "x", "max_tokens": 1, "x_trace_tag": 1})
        assert r.status_code == 200, r.text
    warned = [ln for ln in real.lines if "'x_trace_tag'" in ln]
    assert len(warned) == 1, real.output[-2000:]
