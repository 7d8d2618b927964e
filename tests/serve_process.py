"""``scripts/serve.py`` in a subprocess, for the slow end-to-end tests (tests/test_soak.py,
tests/test_lm_eval.py): a real server with the bundled tiny model on CPU, as a user starts it.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from server_harness import free_port, real_server_env

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def serve_process(*args: str, ready_timeout: float = 1800.0) -> Iterator[tuple[str, int]]:
    """Starts ``scripts/serve.py --model tiny <args>``; yields ``(base URL, pid)`` once
    ``/health`` answers 200 (after warm-up); SIGTERM and waits on exit."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "scripts/serve.py"), "--model", "tiny"]
    cmd += ["--port", str(port), "--log-level", "info", *args]
    env = real_server_env(PYTHONPATH=str(ROOT))
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed below (a pipe could fill and block)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"serve.py exited: {log.read().decode()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "serve.py never became healthy"
            time.sleep(0.5)
        yield base, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        log.seek(0)
        for line in log.read().decode(errors="replace").splitlines():
            if "warm-up done" in line or "on first use" in line:
                print(f"serve.py: {line}")  # shown with pytest -s: the warm-up's cost
        log.close()
