#!/usr/bin/env python
"""Cold vs warm start of ``scripts/serve.py``: seconds until ``/health`` says ready.

Starts the server ``--starts`` times in a row with the same ``--model`` and a fresh
``--compile-cache`` directory (the first start compiles every step shape and fills it, the
later ones load from it), timing each start from process launch to the first 200 from
``/health``; stops each with SIGTERM. Prints the times, the ratio of each later start to the
first, and the warm-up summary line of each start; writes
``bench/results/startup_<platform>_<date>.json``.

    python scripts/bench_startup.py --model /path/to/hf_llama
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_until_healthy(
    model: str, cache: str, extra: list[str], timeout: float
) -> tuple[float, str]:
    """Launches serve.py, waits for a healthy /health, stops it; (seconds, its stderr)."""
    port = free_port()
    cmd = [
        sys.executable, str(ROOT / "scripts/serve.py"), "--model", model, "--port", str(port),
        "--compile-cache", cache, *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        while True:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"not healthy after {timeout}s")
            if proc.poll() is not None:
                raise RuntimeError(f"serve.py exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        elapsed = time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    return elapsed, err.decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=None)
    args, extra = ap.parse_known_args(argv)
    times, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="paxcache_startup_") as cache:
        for i in range(args.starts):
            t, log = start_until_healthy(args.model, cache, extra, args.timeout)
            m = re.search(r"warm-up done[^\n]*", log)
            times.append(t)
            summaries.append(m.group(0) if m else None)
            print(f"start {i + 1}: healthy after {t:.1f}s | {summaries[-1]}", flush=True)
    ratios = [t / times[0] for t in times[1:]]
    print("later starts / first: " + ", ".join(f"{r:.2f}" for r in ratios))
    import jax

    platform = jax.devices()[0].platform
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform,
        "cpus": os.cpu_count(),
        "model": args.model,
        "extra_args": extra,
        "seconds_to_healthy": times,
        "ratio_to_first": ratios,
        "warmup_summaries": summaries,
    }
    out = args.out or ROOT / "bench/results" / f"startup_{platform}_{dt.date.today():%Y%m%d}.json"
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
