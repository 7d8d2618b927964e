"""``POST /tokenize`` and ``POST /detokenize`` (paxcache/server/tokenize.py), vLLM's shapes,
against the app around the fake engine (a byte-level tokenizer, as the bundled tiny model's)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_harness import FakeEngine, serve_in_thread

from paxcache.server import create_app

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine()
    with serve_in_thread(create_app(engine, max_queue=64)) as base:
        yield base, engine


def _post(base: str, path: str, body: dict, **kw) -> httpx.Response:
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    content = json.dumps(body).encode()  # ASCII escapes: lone surrogates can be sent
    return httpx.post(f"{base}{path}", content=content, headers=headers, timeout=30, **kw)


def test_tokenize_prompt_shape_and_special_tokens(served):
    base, engine = served
    r = _post(base, "/tokenize", {"model": "fake-model", "prompt": "hé"})
    assert r.status_code == 200, r.text
    got = r.json()
    bos = engine.tokenizer.bos_token_id
    assert got == {
        "count": 4,
        "max_model_len": engine.max_model_len,
        "tokens": [bos, *"hé".encode()],
        "token_strs": None,
    }
    plain = _post(base, "/tokenize", {"prompt": "hé", "add_special_tokens": False}).json()
    assert plain["tokens"] == list("hé".encode()) and plain["count"] == 3


def test_tokenize_counts_what_the_completions_endpoint_feeds(served):
    base, _ = served
    count = _post(base, "/tokenize", {"prompt": "abc def"}).json()["count"]
    r = _post(base, "/v1/completions", {"prompt": "abc def", "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == count


def test_tokenize_messages_is_what_the_chat_endpoint_feeds(served):
    base, _ = served
    got = _post(base, "/tokenize", {"messages": MSGS}).json()
    chat = _post(base, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}).json()
    assert got["count"] == chat["usage"]["prompt_tokens"] == len(got["tokens"])
    text = _post(base, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"]
    assert text.endswith("<|assistant|>\n") and "héllo" in text
    no_gen = _post(base, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()
    text = _post(base, "/detokenize", {"tokens": no_gen["tokens"]}).json()["prompt"]
    assert not text.endswith("<|assistant|>\n") and no_gen["count"] < got["count"]


def test_token_strs(served):
    base, _ = served
    got = _post(base, "/tokenize", {"prompt": "ab", "return_token_strs": True}).json()
    assert got["token_strs"] == ["<bos>", "a", "b"]  # special tokens spelled, as vLLM does


@settings(max_examples=25, deadline=None)
@given(text=st.text(min_size=0, max_size=40))
def test_tokenize_detokenize_round_trip(served, text):
    base, _ = served
    toks = _post(base, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert toks["count"] == len(text.encode())
    back = _post(base, "/detokenize", {"model": "fake-model", "tokens": toks["tokens"]}).json()
    assert back == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": "x", "messages": MSGS}, 400, None),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "unknown": 1}, 400, "unknown"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": MSGS * 300}, 400, "messages"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, 10**30]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ],
)
def test_bad_tokenizer_requests_get_a_400_naming_the_field(served, path, body, status, param):
    base, _ = served
    r = _post(base, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["request_id"] == r.headers["x-request-id"]
    if param is not None:
        assert err["param"] == param, err
    assert _post(base, "/tokenize", {"prompt": "ok"}).status_code == 200


def test_tokenizer_routes_need_the_api_key():
    app = create_app(FakeEngine(), api_key="k1")
    with serve_in_thread(app) as base:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [97]})):
            assert _post(base, path, body).status_code == 401
            ok = _post(base, path, body, headers={"Authorization": "Bearer k1"})
            assert ok.status_code == 200, ok.text


def test_tokenizer_info_is_what_lm_eval_remote_reads(served):
    """lm-eval's ``tokenizer_backend=remote``: ``GET /tokenizer_info`` names the special
    tokens as strings, and encoding their spelling through ``/tokenize`` (as it does, with
    ``add_special_tokens: false``) gives their ids; ``add_bos_token`` matches what a text
    prompt gets."""
    base, engine = served
    r = httpx.get(f"{base}/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    tok = engine.tokenizer
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["model_max_length"] == engine.max_model_len
    for name, want in (("bos_token", tok.bos_token_id), ("eos_token", tok.eos_token_id)):
        ids = _post(base, "/tokenize", {"prompt": info[name], "add_special_tokens": False})
        assert ids.json()["tokens"] == [want]
    with_bos = _post(base, "/tokenize", {"prompt": "x"}).json()["tokens"]
    assert info["add_bos_token"] == (with_bos[0] == tok.bos_token_id)
    assert httpx.post(f"{base}/tokenizer_info", timeout=30).status_code == 405
