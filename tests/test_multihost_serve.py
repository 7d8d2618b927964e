"""``scripts/serve.py --multihost``: 2 processes x 1 CPU device joined by ``jax.distributed``
(gloo) into one tp=2 mesh. Process 0 serves HTTP and broadcasts every engine round; process 1
follows it (``paxcache.server.run_follower``). Both must stay in lockstep (no deadlock), give
the single-process greedy text, and exit 0 after process 0 gets SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from paxcache import Engine, SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox"
MAX_TOKENS = 16
# One 16-token bucket: each of the three processes compiles half the step programs a 32-token
# budget needs; the 20-token prompt still takes two rounds of chunked prefill.
ENGINE_ARGS = {"num_blocks": 32, "max_num_seqs": 4, "max_num_batched_tokens": 16}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(
    process_id: int, coord_port: int, http_port: int, log: Path, decode_steps: int
) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "serve.py"),
        "--model",
        "tiny",
        "--multihost",
        "--coordinator-address",
        f"localhost:{coord_port}",
        "--num-processes",
        "2",
        "--process-id",
        str(process_id),
        "--tp",
        "2",
        "--port",
        str(http_port),
        "--num-blocks",
        str(ENGINE_ARGS["num_blocks"]),
        "--max-num-seqs",
        str(ENGINE_ARGS["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(ENGINE_ARGS["max_num_batched_tokens"]),
        "--no-structured-warmup",  # neither is requested here: one step program to warm up
        "--no-prompt-logprobs-warmup",
        "--decode-steps",
        str(decode_steps),
    ]
    with log.open("w") as f:
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)


def _logs(paths: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in paths)


# K = 4: multi-step decode with async scheduling, as accelerators run by default (K = 8 there):
# the next loop's inputs built on device while the one in flight is read, across two
# processes; ~20 s more warm-up, so -m slow.
@pytest.mark.parametrize("decode_steps", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_two_process_tp2_server_serves_greedy_like_one_process_and_exits_cleanly(
    tmp_path, decode_steps
):
    coord, http = _free_port(), _free_port()
    base = f"http://127.0.0.1:{http}"
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [_start(i, coord, http, logs[i], decode_steps) for i in range(2)]
    try:
        # The single-process reference, computed while the two servers start.
        ref = Engine.from_pretrained("tiny", **ENGINE_ARGS).generate(
            [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        )[0]
        deadline = time.monotonic() + 120
        while True:
            for p in procs:
                assert p.poll() is None, f"a process exited early:\n{_logs(logs)}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"not healthy in 120 s:\n{_logs(logs)}"
            time.sleep(0.2)

        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == ref.outputs[0].text, _logs(logs)
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        # A streamed, seedless sampled request: many more rounds, seeds drawn on process 0.
        sampled = dict(body, temperature=0.8, n=2, stream=True)
        with httpx.stream("POST", f"{base}/v1/completions", json=sampled, timeout=60) as s:
            events = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events
        # Process 0 again after that: the hosts are still in lockstep.
        r2 = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r2.json()["choices"][0]["text"] == ref.outputs[0].text

        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in procs]
        assert codes == [0, 0], _logs(logs)
        assert "process 1 done" in logs[1].read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
