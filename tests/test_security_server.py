"""Hostile requests and other tenants, against the server (SECURITY.md).

Every test here reproduces an attack first (it failed before the fix) and checks the defense:
auth before the body is read, limits that name themselves, per-tenant cache salts, a client
that stops reading, lone surrogates -- each against the real engine while a second tenant is
being served; then, with a stand-in engine, hostile chat templates, internal errors that
never reach the client, ``Host`` checks, tenants and their salts, key files and connection
limits. tests/test_security.py holds the checkpoint, engine and multi-host channel attacks;
tests/test_server.py the protocol tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_security import ESCAPES, _bpe_tokenizer, _idle

from paxcache.models import HFTokenizer


@pytest.fixture(scope="module")
def engine():
    """The real tiny engine, configured as tests/test_security.py's."""
    from paxcache import Engine

    return Engine.from_pretrained(
        "tiny", max_num_seqs=4, max_num_batched_tokens=16, num_blocks=96, block_size=16
    )


# ----------------------------------------------------------------------------------------------
# The server, with the real engine and two tenants

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"


@pytest.fixture()
def served(engine):
    """The real engine behind the real app, keys for two tenants, short timeouts."""
    import contextlib

    from test_server import serve_in_thread

    from paxcache.server import ServerLimits, create_app

    @contextlib.contextmanager
    def serve(**limits):
        lim = ServerLimits(
            **{
                "stream_stall_timeout_s": 2.0,
                "body_timeout_s": 2.0,
                "max_inflight_per_tenant": 6,
                **limits,
            }
        )
        app = create_app(engine, api_key=[KEY_A, KEY_B], limits=lim, warmup=False)
        with serve_in_thread(app) as base:
            yield base, app

    return serve


def _deep_schema(depth: int) -> dict:
    """A ``response_format`` whose schema nests ``depth`` arrays (the grammar library's
    recursion limit refuses it: a 400, not a crash)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _assert_clean_error(r, status_range=(400, 500)) -> dict:
    assert status_range[0] <= r.status_code < status_range[1], (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["request_id"] == r.headers["x-request-id"]
    for leak in ("Traceback", 'File "', "/work", "site-packages", ".py"):
        assert leak not in r.text, (leak, r.text[:300])
    return err


class _Tenant:
    """Tenant B's streaming request, run in a thread while tenant A attacks."""

    def __init__(self, base: str, body: dict) -> None:
        import threading

        self.base, self.body = base, body
        self.text, self.error, self.seconds = "", None, None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import time

        import httpx

        t0 = time.monotonic()
        try:
            with httpx.stream(
                "POST",
                f"{self.base}/v1/completions",
                json={**self.body, "stream": True},
                headers=_auth(KEY_B),
                timeout=120,
            ) as s:
                assert s.status_code == 200, s.read()
                for line in s.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ev = json.loads(line[6:])
                        assert "error" not in ev, ev
                        self.text += ev["choices"][0]["text"]
        except BaseException as e:  # noqa: BLE001
            self.error = e
        self.seconds = time.monotonic() - t0

    def __enter__(self) -> _Tenant:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(120)


VICTIM = {"prompt": "def quicksort(xs):\n", "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def _victim_reference(engine) -> str:
    from paxcache import SamplingParams

    params = SamplingParams(max_tokens=48, ignore_eos=True)
    return engine.generate([VICTIM["prompt"]], params)[0].outputs[0].text


def _hostile_requests(vocab: int) -> list[tuple[str, object, str | None]]:
    """(path, JSON body or raw bytes, the param the 400 must name or None)."""
    chat = "/v1/chat/completions"
    cmpl = "/v1/completions"
    msg = [{"role": "user", "content": "hi"}]
    return [
        (cmpl, {"prompt": "x", "top_k": 2**40, "temperature": 1}, "top_k"),
        (cmpl, {"prompt": "x", "top_k": vocab + 1, "temperature": 1}, "top_k"),
        (cmpl, {"prompt": "x", "stop": ["ab"] * 85_000}, "stop"),
        (cmpl, {"prompt": "x", "stop": ["s" * 5000]}, "stop"),
        (cmpl, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (cmpl, {"prompt": "x", "stop_token_ids": [10**12]}, "stop_token_ids"),
        (cmpl, {"prompt": "x", "stop_token_ids": [vocab]}, "stop_token_ids"),
        (cmpl, {"prompt": "x", "stop_token_ids": list(range(100))}, "stop_token_ids"),
        (cmpl, {"prompt": ["x"] * 4096, "n": 16}, "prompt"),
        (cmpl, {"prompt": ["x"] * 8, "n": 16}, "n"),
        (cmpl, {"prompt": "x", "n": 65}, "n"),
        (cmpl, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (cmpl, {"prompt": "x", "seed": 2**64}, "seed"),
        (cmpl, {"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
        (cmpl, {"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
        (cmpl, {"prompt": list(range(1, 200)) * 500}, "prompt"),
        (cmpl, {"prompt": "x", "temperature": float("nan")}, "temperature"),
        (cmpl, {"prompt": "x", "top_p": float("inf")}, "top_p"),
        (cmpl, {"prompt": "x", "cache_salt": "s" * 1000}, "cache_salt"),
        (cmpl, {"prompt": "x", "cache_salt": ""}, "cache_salt"),
        (cmpl, {"prompt": "x", "logit_bias": {"1": 100}}, "logit_bias"),
        (cmpl, {"prompt": "x", "response_format": {"type": "json_schema"}}, None),
        (cmpl, {"prompt": "x", "response_format": _deep_schema(900)}, "response_format"),
        (cmpl, {"prompt": "\ud800"}, "prompt"),
        (cmpl, {"prompt": "x", "model": "\ud800"}, "model"),
        (cmpl, {"prompt": "x", "stop": ["\udfff"]}, "stop"),
        (cmpl, {"prompt": "x", "cache_salt": "\ud800"}, "cache_salt"),
        (cmpl, {"prompt": "x", "user": "\ud800"}, "user"),
        (chat, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
        (
            chat,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
            None,
        ),
        (chat, {"messages": msg * 600}, "messages"),
        (chat, {"messages": msg, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (chat, {"messages": msg, "n": 65}, "n"),
        (chat, {"messages": msg, "tools": [{"type": "function"}]}, "tools.0.function"),
        (cmpl, b"[" * 200_000 + b"]" * 200_000, None),
        (cmpl, b'{"prompt": "\xff\xfe"}', None),
        (cmpl, b'{"prompt": "x", "n": 1e400}', None),
        (cmpl, b"\x00" * 100, None),
    ]


def test_hostile_requests_are_4xx_and_the_other_tenant_is_served(engine, served) -> None:
    import time

    import httpx

    want = _victim_reference(engine)
    vocab = engine.model.config.vocab_size
    with served() as (base, _):
        with _Tenant(base, VICTIM) as alone:
            pass
        assert alone.error is None and alone.text == want
        with _Tenant(base, VICTIM) as victim:
            for path, body, param in _hostile_requests(vocab):
                t0 = time.monotonic()
                if isinstance(body, bytes):
                    headers = {**_auth(KEY_A), "content-type": "application/json"}
                    r = httpx.post(f"{base}{path}", content=body, headers=headers, timeout=30)
                else:
                    content = json.dumps(body).encode()  # NaN/inf as JSON extensions
                    headers = {**_auth(KEY_A), "content-type": "application/json"}
                    r = httpx.post(f"{base}{path}", content=content, headers=headers, timeout=30)
                err = _assert_clean_error(r, (400, 414))
                if param is not None:
                    assert err["param"] == param, (path, str(body)[:80], err)
                assert time.monotonic() - t0 < 10, (path, str(body)[:80])
        assert victim.error is None, victim.error
        assert victim.text == want  # untouched: the same greedy text as alone
        assert victim.seconds < 3 * alone.seconds + 10, (victim.seconds, alone.seconds)
        ok = httpx.post(
            f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=_auth(KEY_A)
        )
        assert ok.status_code == 200


def test_auth_is_checked_before_the_body_is_read(served) -> None:
    import socket
    import time
    from urllib.parse import urlparse

    import httpx

    with served() as (base, _):
        # A malformed body without a key is a 401, not a 400: the body is never parsed.
        r = httpx.post(f"{base}/v1/completions", content=b"{oops")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # Headers announce a body that never comes: the 401 still arrives at once.
        u = urlparse(base)
        with socket.create_connection((u.hostname, u.port), timeout=5) as s:
            t0 = time.monotonic()
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 900000\r\n\r\n"
            )
            head = s.recv(4096)
            assert head.startswith(b"HTTP/1.1 401"), head[:100]
            assert time.monotonic() - t0 < 1.5  # < the 2 s body timeout
        for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
            assert httpx.get(f"{base}{path}").status_code == 401, path
            assert httpx.get(f"{base}{path}", headers=_auth(KEY_B)).status_code == 200, path
        assert httpx.get(f"{base}/health").status_code == 200
        r = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY_A}x"})
        assert r.status_code == 401


def test_a_slow_body_gets_408_and_frees_the_connection(served) -> None:
    import socket
    import time
    from urllib.parse import urlparse

    with served() as (base, _):
        u = urlparse(base)
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            t0 = time.monotonic()
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + KEY_A.encode() + b"\r\nContent-Length: 100\r\n\r\n"
                b'{"prompt":'
            )
            head = s.recv(4096)
            assert head.startswith(b"HTTP/1.1 408"), head[:200]
            assert b"body_timeout_s" in head
            assert 1.5 < time.monotonic() - t0 < 6


def _never_reading_client(base: str, body: dict, key: str | None):
    """A socket that sends a streaming request and never reads (a tiny receive window)."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(base)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect((u.hostname, u.port))
    data = json.dumps({**body, "stream": True}).encode()
    auth = b"Authorization: Bearer " + key.encode() + b"\r\n" if key else b""
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + auth
        + b"Content-Length: %d\r\n\r\n" % len(data)
        + data
    )
    return s


def test_a_client_that_stops_reading_is_dropped_while_others_are_served() -> None:
    """Fast version (a stand-in engine that fills the socket buffers in a moment); the real
    engine's version is marked slow (it takes ~20 s to fill loopback's buffers)."""
    import time

    import httpx
    from test_server import FakeEngine, serve_in_thread

    from paxcache.server import ServerLimits

    class Verbose(FakeEngine):
        """Every token decodes to 8 KiB of text: the socket buffers fill within a second."""

        def step(self):
            outs = super().step()
            for o in outs:
                for c in o.outputs:
                    c.text *= 8192
            return outs

    engine = Verbose(max_model_len=1 << 22, max_num_seqs=16)
    _, app = _fake_app(engine=engine, limits=ServerLimits(stream_stall_timeout_s=1.0))
    with serve_in_thread(app) as base:
        hog = {"prompt": "x", "max_tokens": 1 << 21, "n": 4, "temperature": 1}
        s = _never_reading_client(base, hog, None)
        try:
            deadline = time.monotonic() + 60
            while not app.state.runner.num_inflight:
                time.sleep(0.01)
            t0 = time.monotonic()
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "y", "max_tokens": 5})
            assert r.status_code == 200 and time.monotonic() - t0 < 5
            while app.state.runner.num_inflight:
                assert time.monotonic() < deadline, "the stalled stream was never aborted"
                time.sleep(0.05)
        finally:
            s.close()
        assert len(engine.aborted) == 1 and not engine.reqs
        assert "paxcache_streams_stalled_total 1.0" in httpx.get(f"{base}/metrics").text


@pytest.mark.slow
def test_a_client_that_stops_reading_is_dropped_and_its_blocks_freed(engine, served) -> None:
    import time

    import httpx

    want = _victim_reference(engine)
    with served(stream_stall_timeout_s=1.5) as (base, app):
        hog = {"prompt": "x", "max_tokens": 900, "n": 4, "logprobs": 20, "temperature": 1}
        s = _never_reading_client(base, {**hog, "ignore_eos": True}, KEY_A)
        try:
            with _Tenant(base, VICTIM) as victim:
                pass
            assert victim.error is None and victim.text == want
            runner = app.state.runner
            deadline = time.monotonic() + 60
            while runner.num_inflight or engine.has_unfinished_requests():
                assert time.monotonic() < deadline, "the stalled stream was never aborted"
                time.sleep(0.1)
        finally:
            s.close()
        metrics = httpx.get(f"{base}/metrics", headers=_auth(KEY_B)).text
        assert "paxcache_streams_stalled_total 1.0" in metrics
        _idle(engine)


def test_one_tenant_cannot_take_every_slot(engine, served) -> None:
    import threading

    import httpx

    with served(max_inflight_per_tenant=4) as (base, _):
        codes: list[int] = []
        body = {"prompt": "x", "max_tokens": 64, "ignore_eos": True, "n": 2}

        def flood() -> None:
            r = httpx.post(f"{base}/v1/completions", json=body, headers=_auth(KEY_A), timeout=120)
            codes.append(r.status_code)
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "tenant_limit"
                assert "max_inflight_per_tenant" in r.json()["error"]["message"]

        threads = [threading.Thread(target=flood) for _ in range(6)]
        for t in threads:
            t.start()
        r = httpx.post(
            f"{base}/v1/completions",
            json={"prompt": "y", "max_tokens": 4},
            headers=_auth(KEY_B),
            timeout=120,
        )
        for t in threads:
            t.join(120)
        assert r.status_code == 200  # the other tenant is not refused
        assert codes.count(200) >= 2 and 429 in codes, codes


def test_prefix_cache_hits_never_cross_tenants_or_salts(served) -> None:
    import httpx

    prompt = "# tenant secret: 7f3a9c\n" * 6  # several blocks

    with served() as (base, _):

        def cached(key: str, **extra) -> int:
            r = httpx.post(
                f"{base}/v1/completions",
                json={"prompt": prompt, "max_tokens": 1, **extra},
                headers=_auth(key),
                timeout=60,
            )
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(KEY_A) == 0
        hit = cached(KEY_A)
        assert hit >= 32  # the same tenant reuses its own cache
        assert cached(KEY_B) == 0  # another tenant never sees it
        assert cached(KEY_B, cache_salt="shared") == 0
        assert cached(KEY_A, cache_salt="shared") == 0  # salts are namespaced per key
        assert cached(KEY_A, cache_salt="shared") == hit
        # Streaming usage reports cached tokens too.
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 1,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers=_auth(KEY_B),
        ) as s:
            events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == hit


# ----------------------------------------------------------------------------------------------
# The server with a stand-in engine: templates, leaks, hosts, keys, connection limits


def _fake_app(**kw):
    from test_server import FakeEngine

    from paxcache.server import create_app

    engine = kw.pop("engine", None) or FakeEngine()
    return engine, create_app(engine, **kw)


@pytest.mark.parametrize("template", ESCAPES[:3])
def test_a_hostile_chat_template_is_a_5xx_naming_the_template_and_runs_nothing(
    tmp_path: Path, template: str
) -> None:
    import httpx
    from test_server import FakeEngine, serve_in_thread

    marker = tmp_path / "pwned"
    _bpe_tokenizer(tmp_path / "ckpt", template.replace("MARKER", str(marker)))
    engine = FakeEngine()
    engine.tokenizer = HFTokenizer(tmp_path / "ckpt")
    _, app = _fake_app(engine=engine)
    with serve_in_thread(app) as base:
        r = httpx.post(
            f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        err = _assert_clean_error(r, (500, 501))
        assert "chat template" in err["message"] and "chat_template" in err["message"]
        assert str(tmp_path) not in r.text
        assert not marker.exists()
        ok = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200


def test_a_template_rejecting_the_messages_is_a_400(tmp_path: Path) -> None:
    import httpx
    from test_server import FakeEngine, serve_in_thread

    _bpe_tokenizer(tmp_path, "{{ raise_exception('Only user and assistant roles are supported') }}")
    engine = FakeEngine()
    engine.tokenizer = HFTokenizer(tmp_path)
    _, app = _fake_app(engine=engine)
    with serve_in_thread(app) as base:
        r = httpx.post(
            f"{base}/v1/chat/completions", json={"messages": [{"role": "system", "content": "x"}]}
        )
        err = _assert_clean_error(r, (400, 401))
        assert err["param"] == "messages" and "roles are supported" in err["message"]


def test_internal_errors_never_reach_the_client(caplog) -> None:
    import httpx
    from test_server import FakeEngine, serve_in_thread

    class Leaky(FakeEngine):
        fail_add = False

        def add_request(self, *a, **kw):
            if self.fail_add:
                raise RuntimeError("cannot open /root/.secret/weights.bin")
            return super().add_request(*a, **kw)

    engine = Leaky()
    _, app = _fake_app(engine=engine)
    with serve_in_thread(app) as base:
        engine.fail_add = True
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        _assert_clean_error(r, (503, 504))
        assert "secret" not in r.text
        engine.fail_add = False
        engine.fail_steps = 1
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        _assert_clean_error(r, (503, 504))
        assert "injected" not in r.text
        # A bug in a route: a 500 with the request id, the details only in the log.
        app.state.runner.submit = None  # type: ignore[assignment]
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
        err = _assert_clean_error(r, (500, 501))
        assert "NoneType" not in r.text
    assert any(err["request_id"] in rec.getMessage() for rec in caplog.records)


def test_allowed_hosts_refuse_other_host_headers() -> None:
    import httpx
    from test_server import serve_in_thread

    _, app = _fake_app(allowed_hosts=["localhost", "127.0.0.1"])
    with serve_in_thread(app) as base:
        assert httpx.get(f"{base}/health").status_code == 200  # Host: 127.0.0.1:port
        for host in ("evil.example", "localhost.evil.example", "127.0.0.1.nip.io:80"):
            r = httpx.get(f"{base}/health", headers={"Host": host})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
        assert httpx.get(f"{base}/health", headers={"Host": "LOCALHOST:9"}).status_code == 200


def test_without_keys_the_client_salt_is_used_and_tenants_are_addresses() -> None:
    import httpx
    from test_server import serve_in_thread

    engine, app = _fake_app()
    with serve_in_thread(app) as base:
        for salt in (None, "s1"):
            body = {"prompt": "x", "max_tokens": 1}
            if salt:
                body["cache_salt"] = salt
            assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
    assert engine.salts == [None, "s1"]


def test_with_keys_every_request_gets_its_tenants_salt() -> None:
    import httpx
    from test_server import serve_in_thread

    engine, app = _fake_app(api_key=[KEY_A, KEY_B])
    with serve_in_thread(app) as base:
        for key, salt in ((KEY_A, None), (KEY_B, None), (KEY_A, "x"), (KEY_B, "x")):
            body = {"prompt": "x", "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
            r = httpx.post(f"{base}/v1/completions", json=body, headers=_auth(key))
            assert r.status_code == 200
    a, b, ax, bx = engine.salts
    assert len({a, b, ax, bx}) == 4 and None not in engine.salts
    assert KEY_A not in str(engine.salts)  # salts name the tenant by a hash, never the key


def _serve_script():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "serve.py"
    spec = importlib.util.spec_from_file_location("paxcache_serve_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_serve_reads_keys_from_the_environment_and_a_file(tmp_path: Path, caplog) -> None:
    serve = _serve_script()
    keyfile = tmp_path / "keys"
    keyfile.write_text("# tenants\nfile-key-1\n\nfile-key-2\n")
    args = serve.parse_args(["--api-key-file", str(keyfile)])
    assert serve.api_keys(args, {"PAXCACHE_API_KEY": "env-a, env-b"}) == [
        "file-key-1",
        "file-key-2",
        "env-a",
        "env-b",
    ]
    args = serve.parse_args(["--api-key", "cli"])
    assert serve.api_keys(args, {}) == ["cli"]
    assert any("process list" in r.getMessage() for r in caplog.records)


def test_serve_sets_uvicorn_connection_limits() -> None:
    serve = _serve_script()
    kw = serve.uvicorn_config_kwargs(serve.parse_args([]))
    assert kw["limit_concurrency"] > 0 and kw["timeout_keep_alive"] > 0
    assert kw["h11_max_incomplete_event_size"] == 16 * 1024
    assert not isinstance(kw["http"], str)  # the header-timeout protocol


def test_a_connection_that_never_finishes_its_headers_is_closed() -> None:
    import socket
    import threading
    import time

    import uvicorn
    from test_server import _free_port

    serve = _serve_script()
    _, app = _fake_app()
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            http=serve.header_timeout_protocol(1.0),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            t0 = time.monotonic()
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            for _ in range(8):  # trickle header bytes: uvicorn's keep-alive timer never fires
                time.sleep(0.25)
                try:
                    s.sendall(b"X")
                except OSError:
                    break
            assert s.recv(100) == b""  # closed by the server
            assert time.monotonic() - t0 < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(20)
