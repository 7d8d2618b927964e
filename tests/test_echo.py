"""``echo`` with prompt logprobs and vLLM's ``prompt_logprobs`` through the official ``openai``
client, on the real engine (a small random-weight Llama, f32, byte tokenizer) served
in-process: the echoed prompt's logprobs equal the log-softmax of a plain dense forward of the
same model (``model(token_ids)``) within 1e-4, with chunked prefill (a 16-token step budget),
with a warm prefix cache, streaming and not, as lm-eval's loglikelihood requests send them."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import serve_in_thread
from test_prompt_logprobs import TOL, dense_prompt_logprobs
from tiny_models import byte_llama

from paxcache import Engine
from paxcache.models import ByteTokenizer
from paxcache.server import create_app

TEXT = "The quick brown fox jumps over the lazy dog, twice."  # 52 tokens with BOS: 4 chunks


@pytest.fixture(scope="module")
def model():
    return byte_llama()


@pytest.fixture(scope="module")
def served(model):
    engine = Engine(
        model, ByteTokenizer(), num_blocks=64, block_size=8, max_num_seqs=4,
        max_num_batched_tokens=16, model_name="tiny",
    )  # fmt: skip
    with serve_in_thread(create_app(engine)) as base:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)


def _ids(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


def _check_prompt_part(model, ids: list[int], lp) -> None:
    """The first ``len(ids)`` entries of a completions ``logprobs`` object echo the prompt."""
    want, top_ids, _ = dense_prompt_logprobs(model, ids)
    p = len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:p], want, atol=TOL, rtol=0)
    tok = ByteTokenizer()
    assert lp.tokens[:p] == [tok.decode([t]) for t in ids]
    for top, best in zip(lp.top_logprobs[1:p], top_ids[:, 0], strict=True):
        assert len(top) == 1 and tok.decode([int(best)]) in top
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_logprobs_max_tokens_0_equal_the_dense_forward(model, served):
    _, client = served
    out = client.completions.create(model="tiny", prompt=TEXT, echo=True, logprobs=1, max_tokens=0)
    c = out.choices[0]
    assert c.text == TEXT and c.finish_reason == "length"
    assert len(c.logprobs.token_logprobs) == len(_ids(TEXT))
    _check_prompt_part(model, _ids(TEXT), c.logprobs)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(_ids(TEXT))


def test_lm_eval_loglikelihood_request_with_token_ids_and_a_warm_cache(model, served):
    _, client = served
    ids = _ids(TEXT[::-1])
    for _ in range(2):  # warm the prefix cache with this prompt
        warm = client.completions.create(model="tiny", prompt=ids, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens >= 40
    out = client.completions.create(
        model="tiny", prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    c = out.choices[0]
    assert len(c.logprobs.token_logprobs) == len(ids) + 1  # the prompt, then one token
    _check_prompt_part(model, ids, c.logprobs)
    assert c.logprobs.token_logprobs[-1] <= 0.0
    assert c.text.startswith(ByteTokenizer().decode(ids))
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # recomputed for the logprobs


def test_streaming_echo_sends_the_prompt_first_and_matches_non_streaming(model, served):
    _, client = served
    kw = dict(model="tiny", prompt=TEXT, echo=True, logprobs=2, max_tokens=4, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    first = chunks[0].choices[0]
    assert first.text.startswith(TEXT)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.text
    lps = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in
           ch.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert lps[0] is None and len(lps) == len(_ids(TEXT)) + 4
    np.testing.assert_allclose(lps[1:], whole.logprobs.token_logprobs[1:], atol=TOL, rtol=0)


def test_echo_without_logprobs_and_n_choices(served):
    _, client = served
    out = client.completions.create(model="tiny", prompt=["ab", "cd"], echo=True, max_tokens=2, n=2)
    assert len(out.choices) == 4
    for c in out.choices:
        assert c.text.startswith(["ab", "cd"][c.index // 2]) and c.logprobs is None


def test_vllm_prompt_logprobs_extension_on_completions_and_chat(model, served):
    _, client = served
    out = client.completions.create(
        model="tiny", prompt=TEXT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    got = out.choices[0].model_extra["prompt_logprobs"]
    ids = _ids(TEXT)
    want, _, _ = dense_prompt_logprobs(model, ids)
    assert len(got) == len(ids) and got[0] is None
    for entry, tid, lp in zip(got[1:], ids[1:], want, strict=True):
        assert 2 <= len(entry) <= 3 and abs(entry[str(tid)]["logprob"] - lp) < TOL
        assert entry[str(tid)]["rank"] >= 1
        assert {e["rank"] for k, e in entry.items() if k != str(tid)} <= {1, 2}
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == chat.usage.prompt_tokens and plp[0] is None
    assert all(len(e) == 1 for e in plp[1:])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
    ],
)
def test_bad_echo_requests_get_a_400_naming_the_field(served, body, param):
    base, _ = served
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_real_engine_exports_the_vllm_metrics(served):
    base, _ = served
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}
    prompt = [s for s in fams["vllm:prompt_tokens"].samples if s.name.endswith("_total")]
    assert prompt[0].labels == {"model_name": "tiny"} and prompt[0].value > 0
    assert fams["vllm:e2e_request_latency_seconds"].samples
    assert 0.0 <= fams["vllm:kv_cache_usage_perc"].samples[0].value <= 1.0
