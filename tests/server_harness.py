"""Test harness for the server: a fake engine with the ``Engine`` interface, and serving an
app in-process (uvicorn in a thread on a free loopback port).

Used by tests/test_server.py (which re-exports these names for the other test modules),
tests/test_security.py and tests/test_stress.py.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from paxcache.errors import DuplicateSequenceError, SequenceTooLongError
from paxcache.models.tokenizer import ByteTokenizer
from paxcache.outputs import CompletionOutput, RequestOutput
from paxcache.sampling import SamplingParams

__all__ = [
    "FakeEngine",
    "free_port",
    "metric_values",
    "real_server_env",
    "serve_in_thread",
    "wait_idle",
]


def real_server_env(**extra: str) -> dict[str, str]:
    """The environment of a real ``scripts/serve.py`` a test starts: this process's, on the
    CPU, with the ``XLA_FLAGS`` the suite started with (tests/conftest.py compiles the suite's
    own programs without LLVM's optimizations; a server runs as a user's does)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    user_flags = os.environ.get("PAXCACHE_TEST_USER_XLA_FLAGS")
    if user_flags is not None and "XLA_FLAGS" not in extra:
        env["XLA_FLAGS"] = user_flags
    return env


# ----------------------------------------------------------------------------------------------
# A fake engine with the Engine interface


class FakeEngine:
    """Deterministic stand-in for ``paxcache.Engine``: one token per request per step.

    Greedy completions spell ``"hello world, "`` repeatedly (shifted by the prompt length);
    sampled ones draw lowercase letters from ``random.Random((seed, index, step))``. Every
    request holds ``ceil((prompt + generated) / block_size)`` blocks while alive. Honours
    ``output_kind="delta"`` and models a prefix cache per ``cache_salt`` (a prompt seen before
    under the same salt reports its whole blocks as cached).
    """

    model_name = "fake-model"

    def __init__(
        self,
        *,
        step_delay: float = 0.0,
        max_model_len: int = 256,
        num_blocks: int = 4096,
        block_size: int = 16,
        max_num_seqs: int = 8,
        partial_outputs: bool = False,
    ) -> None:
        self.partial_outputs = partial_outputs
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.reqs: dict[str, dict] = {}
        self.fail_steps = 0
        self.gate = threading.Event()
        self.gate.set()
        self.generated = 0
        self.warmed_up = False
        self.aborted: list[str] = []
        self.lock = threading.Lock()  # proves single-thread ownership: never contended
        self.seen: set[tuple] = set()  # (cache_salt, prompt ids) already prefilled
        self.salts: list = []  # cache_salt of every request added
        self.prompt_tokens = self.prefix_queries = self.prefix_hits = 0

    def warmup(self) -> None:
        self.warmed_up = True

    def add_request(self, request_id: str, prompt, params: SamplingParams, cache_salt=None) -> None:
        if request_id in self.reqs:
            raise DuplicateSequenceError(request_id)
        if params.n > self.max_num_seqs:  # as the real Engine: a prompt's n run together
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.salts.append(cache_salt)
        key = (cache_salt, tuple(ids))
        cached = (len(ids) // self.block_size) * self.block_size if key in self.seen else 0
        self.seen.add(key)
        self.prompt_tokens += len(ids)
        self.prefix_queries += len(ids) // self.block_size
        self.prefix_hits += cached // self.block_size
        if len(ids) + params.max_tokens > self.max_model_len:
            raise SequenceTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        self.reqs[request_id] = {
            "prompt": prompt if isinstance(prompt, str) else None,
            "ids": ids,
            "params": params,
            "seed": seed,
            "outs": [
                CompletionOutput(index=j, logprobs=[] if params.logprobs is not None else None)
                for j in range(params.n)
            ],
            "order": len(self.reqs) + len(self.aborted) + self.generated,
            "cached": cached,
            "sent": [(0, 0, 0)] * params.n,  # delta: (tokens, text chars, logprobs) reported
        }

    def _next_token(self, r: dict, j: int, step: int) -> int:
        p: SamplingParams = r["params"]
        if p.greedy:
            text = "hello world, "
            return ord(text[(len(r["ids"]) + step) % len(text)])
        rng = random.Random(hash((r["seed"], j, step)))
        return ord(rng.choice("abcdefghijklmnopqrstuvwxyz "))

    def step(self) -> list[RequestOutput]:
        assert self.lock.acquire(blocking=False), "engine used from two threads at once"
        try:
            self.gate.wait()
            if self.step_delay:
                time.sleep(self.step_delay)
            if self.fail_steps:
                self.fail_steps -= 1
                raise RuntimeError("injected engine failure")
            results = []
            for rid in list(self.reqs)[: self.max_num_seqs]:
                r = self.reqs[rid]
                p: SamplingParams = r["params"]
                progressed = []
                for c in r["outs"]:
                    c.new_token_ids, c.new_text = [], ""
                    if c.finish_reason is not None:
                        continue
                    progressed.append(c)
                    tok = self._next_token(r, c.index, len(c.token_ids))
                    c.token_ids.append(tok)
                    self.generated += 1
                    c.new_token_ids = [tok]
                    if c.logprobs is not None:
                        c.logprobs.append(
                            {
                                "token_id": tok,
                                "logprob": -0.25,
                                "top": [(tok, -0.25), (32, -2.0)][: p.logprobs],
                            }
                        )
                    text = self.tokenizer.decode(c.token_ids)
                    if tok in p.stop_token_ids:
                        c.finish_reason, c.stop_reason = "stop", tok
                    for s in p.stop:
                        if s in text:
                            text = text[: text.index(s)]
                            c.finish_reason, c.stop_reason = "stop", s
                    c.new_text = text[len(c.text) :]
                    c.text = text
                    if c.finish_reason is None and len(c.token_ids) >= p.max_tokens:
                        c.finish_reason = "length"
                finished = all(c.finish_reason is not None for c in r["outs"])
                shown = progressed if self.partial_outputs else r["outs"]
                results.append(
                    RequestOutput(
                        request_id=rid,
                        prompt=r["prompt"],
                        prompt_token_ids=list(r["ids"]),
                        outputs=[self._report(r, c) for c in shown],
                        finished=finished,
                        num_cached_tokens=r["cached"],
                    )
                )
                if finished:
                    del self.reqs[rid]
            return results
        finally:
            self.lock.release()

    @staticmethod
    def _report(r: dict, c: CompletionOutput) -> CompletionOutput:
        out = CompletionOutput(**vars(c))
        if r["params"].output_kind != "delta":
            return out
        n_tok, n_text, n_lp = r["sent"][c.index]
        # As the engine: hold back text a stop string may still cut (deltas cannot shrink).
        hold = max((len(s) for s in r["params"].stop), default=1) - 1
        visible = len(c.text) if c.finish_reason else max(n_text, len(c.text) - hold)
        out.token_ids = c.token_ids[n_tok:]
        out.text = c.text[n_text:visible]
        out.logprobs = None if c.logprobs is None else c.logprobs[n_lp:]
        r["sent"][c.index] = (len(c.token_ids), visible, len(c.logprobs or []))
        return out

    def abort(self, request_id: str) -> None:
        if self.reqs.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def stats(self) -> dict:
        used = sum(
            -(-(len(r["ids"]) + max(len(c.token_ids) for c in r["outs"])) // self.block_size)
            for r in self.reqs.values()
        )
        running = min(len(self.reqs), self.max_num_seqs)
        return {
            "num_total_blocks": self.num_blocks,
            "num_free_blocks": self.num_blocks - used,
            "kv_usage": used / self.num_blocks,
            "prefix_cache_hit_rate": 0.0,
            "num_preemptions": 0,
            "num_swaps": 0,
            "num_compilations": 3,
            "num_running": running,
            "num_waiting": len(self.reqs) - running,
            "num_swapped": 0,
            "num_generated_tokens": self.generated,
            "num_prompt_tokens": self.prompt_tokens,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "block_size": self.block_size,
            "device": "cpu",
            "kv_cache_bytes": 0,
        }


# ----------------------------------------------------------------------------------------------
# Serving an app in-process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, *, wait_ready: bool = True, ready_timeout: float = 600.0) -> Iterator[str]:
    """Serves ``app`` with uvicorn in a daemon thread; yields its base URL.

    With ``wait_ready`` (the default) it first waits until ``/health`` says the engine's warm-up
    has finished (200, or 503 with a status other than "warming up"), so a test's requests never
    race a real engine's warm-up; ``wait_ready=False`` yields as soon as uvicorn listens.
    """
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    base = f"http://127.0.0.1:{port}"
    if wait_ready:
        deadline = time.monotonic() + ready_timeout
        while True:
            r = httpx.get(f"{base}/health", timeout=30)
            if r.status_code == 200 or r.json().get("status") != "warming up":
                break
            assert time.monotonic() < deadline, "engine warm-up did not finish"
            time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(20)


def wait_idle(
    base: str,
    engine: FakeEngine | None = None,
    timeout: float = 10.0,
    headers: dict[str, str] | None = None,
) -> str:
    """Waits until /metrics reports nothing running and no blocks used; returns the text."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base}/metrics", headers=headers).text
        vals = metric_values(text)
        if (
            vals.get("paxcache_requests_running") == 0
            and vals.get("paxcache_kv_blocks_used") == 0
            and vals.get("paxcache_requests_inflight") == 0
        ):
            return text
        assert time.monotonic() < deadline, f"server not idle: {vals}"
        time.sleep(0.05)


def metric_values(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out
