"""Soak (slow): a real ``scripts/serve.py`` (bundled tiny model, CPU) under minutes of mixed
traffic with disconnects: plain and streamed completions (some streams dropped mid-way), n=2,
echo with prompt logprobs, logprobs, chat with ``json_object``, token-id prompts. It fails on
any 5xx, on a step program compiled after warm-up (``paxcache_compilations_total`` moves),
on the server's RSS or memory-map count growing steadily after warm-up, or on running requests
and KV blocks not returning to 0.

``PAXCACHE_SOAK_S`` sets the traffic's duration in seconds (default 120).
"""

from __future__ import annotations

import collections
import json
import os
import random
import threading
import time

import httpx
import pytest
from serve_process import serve_process
from server_harness import metric_values, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # warm-up: minutes on a busy CPU

DURATION_S = float(os.environ.get("PAXCACHE_SOAK_S", "120"))
WORKERS = 6


def _memory(pid: int) -> tuple[float, int]:
    """(RSS in MiB, memory maps) of process ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for _ in f)
    return rss / 1024, maps


def _one_request(client: httpx.Client, rng: random.Random, statuses: collections.Counter) -> None:
    kind = rng.choice(["plain", "stream", "drop", "n2", "echo", "logprobs", "json", "ids"])
    words = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(20))
    prompt = words[: rng.randint(1, 100)]
    body: dict = {"prompt": prompt, "max_tokens": rng.randint(1, 24), "temperature": 0.7}
    path = "/v1/completions"
    if kind == "n2":
        body |= {"n": 2, "seed": rng.randint(0, 1000)}
    elif kind == "echo":
        body |= {"echo": True, "logprobs": 2, "max_tokens": rng.choice([0, 1, 4])}
    elif kind == "logprobs":
        body |= {"logprobs": 3}
    elif kind == "ids":
        body["prompt"] = [rng.randrange(256) for _ in range(rng.randint(1, 90))]
    elif kind == "json":
        path = "/v1/chat/completions"
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 16,
            "response_format": {"type": "json_object"},
        }
    if kind in ("stream", "drop"):
        body |= {"stream": True, "max_tokens": 200 if kind == "drop" else 16}
        with client.stream("POST", path, json=body) as r:
            statuses[r.status_code] += 1
            for i, _ in enumerate(r.iter_lines()):
                if kind == "drop" and i >= 3:
                    break  # the client goes away mid-stream
        return
    statuses[client.post(path, json=body).status_code] += 1


def _growth(samples: list[tuple[float, float, int]]) -> tuple[float, float]:
    """(RSS MiB, maps) growth: the mean of the last third of the samples over that of the
    middle third (the first third is the settling after warm-up)."""
    third = max(1, len(samples) // 3)
    mid, last = samples[third : 2 * third], samples[-third:]
    mean = lambda xs, k: sum(x[k] for x in xs) / len(xs)  # noqa: E731
    return mean(last, 1) - mean(mid, 1), mean(last, 2) - mean(mid, 2)


def test_soak_mixed_load_with_disconnects_leaks_nothing_and_compiles_nothing():
    args = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32"]  # 8 step programs
    with serve_process(*args) as (base, pid):
        before = metric_values(httpx.get(f"{base}/metrics").text)
        statuses: collections.Counter = collections.Counter()
        errors: list[BaseException] = []
        samples: list[tuple[float, float, int]] = []
        stop = time.monotonic() + DURATION_S

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(base_url=base, timeout=120) as client:
                while time.monotonic() < stop:
                    try:
                        _one_request(client, rng, statuses)
                    except httpx.HTTPError as e:  # a dropped stream is not one
                        errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(WORKERS)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            samples.append((time.monotonic(), *_memory(pid)))
            time.sleep(2.0)
        for t in threads:
            t.join()
        idle = wait_idle(base, timeout=60)
        after = metric_values(idle)
        rss_growth, maps_growth = _growth(samples)
        report = json.dumps(
            {
                "statuses": dict(statuses),
                "samples": len(samples),
                "rss_mib": [round(samples[0][1]), round(samples[-1][1])],
                "maps": [samples[0][2], samples[-1][2]],
                "rss_growth_mib": round(rss_growth, 1),
                "maps_growth": round(maps_growth, 1),
            }
        )
        print(report)
        assert not errors, errors[:3]
        assert sum(statuses.values()) > 0 and not any(s >= 500 for s in statuses), report
        assert after["paxcache_compilations_total"] == before["paxcache_compilations_total"]
        assert after["paxcache_requests_running"] == after["paxcache_kv_blocks_used"] == 0
        usage = [ln for ln in idle.splitlines() if ln.startswith("vllm:kv_cache_usage_perc{")]
        assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0, usage
        # Steady growth after warm-up: more than 64 MiB or 10 % of RSS, 200 maps or 10 %.
        rss_mid = samples[len(samples) // 2][1]
        assert rss_growth < max(64.0, 0.1 * rss_mid), report
        assert maps_growth < max(200.0, 0.1 * samples[len(samples) // 2][2]), report
