#!/usr/bin/env python
"""Drive a running paxcache (or any OpenAI-compatible) server over HTTP and report latency.

    python scripts/serve.py &                       # in another shell
    python scripts/bench_http.py --url http://127.0.0.1:8000 --num-requests 64 --concurrency 8

A seeded workload of streaming ``/v1/completions`` requests (varied prompt and output lengths,
optional shared prefix) runs with bounded concurrency and an optional duration cap. Reports
request and output-token throughput, time to first token (TTFT), time per output token (TPOT,
after the first) and end-to-end latency percentiles, plus errors. ``--json PATH`` writes the
result. ``run_http_benchmark`` is the same as a function (``scripts/bench_serving.py --url``
calls it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

_TEXT = (
    "the quick brown fox jumps over a lazy dog while paged attention reads blocks of keys "
    "and values from a shared pool so that many sequences fit in one cache"
)
_WORDS = _TEXT.split(" ")


@dataclass
class RequestResult:
    ok: bool
    prompt_chars: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    error: str | None = None


@dataclass
class BenchResult:
    url: str
    num_requests: int
    concurrency: int
    duration_s: float
    completed: int
    errors: int
    request_throughput: float
    output_token_throughput: float
    total_output_tokens: int
    ttft_s: dict[str, float] = field(default_factory=dict)
    tpot_s: dict[str, float] = field(default_factory=dict)
    e2e_s: dict[str, float] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1]}


def make_workload(
    num_requests: int,
    *,
    seed: int = 0,
    prompt_words: tuple[int, int] = (4, 48),
    max_tokens: tuple[int, int] = (8, 64),
    shared_prefix_words: int = 0,
) -> list[tuple[str, int]]:
    """A seeded list of ``(prompt, max_tokens)`` pairs."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(_WORDS) for _ in range(shared_prefix_words))
    work = []
    for _ in range(num_requests):
        body = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*prompt_words)))
        prompt = f"{prefix} {body}" if prefix else body
        work.append((prompt, rng.randint(*max_tokens)))
    return work


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str | None,
    prompt: str,
    max_tokens: int,
    temperature: float,
    headers: dict[str, str],
    token_timing: bool = True,
) -> RequestResult:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if token_timing:
        # One log-probability entry per generated token: chunks then carry every token even
        # while the text is held back (incomplete UTF-8, a possible stop string).
        body["logprobs"] = 0
    if model:
        body["model"] = model
    res = RequestResult(ok=False, prompt_chars=len(prompt))
    t0 = time.perf_counter()
    t_first = t_last = None
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = str(ev["error"].get("message"))
                    return res
                if ev.get("usage"):
                    res.output_tokens = int(ev["usage"]["completion_tokens"])
                choice = (ev.get("choices") or [{}])[0]
                lp = choice.get("logprobs") or {}
                if lp.get("tokens") or choice.get("text"):
                    now = time.perf_counter()
                    t_first = t_first or now
                    t_last = now
                    chunks += 1
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    end = time.perf_counter()
    res.ok = True
    res.e2e_s = end - t0
    res.output_tokens = res.output_tokens or chunks
    if t_first is not None:
        res.ttft_s = t_first - t0
        if res.output_tokens > 1 and t_last is not None:
            res.tpot_s = (t_last - t_first) / (res.output_tokens - 1)
    return res


async def _run(
    url: str,
    work: list[tuple[str, int]],
    *,
    concurrency: int,
    duration_s: float | None,
    model: str | None,
    temperature: float,
    api_key: str | None,
    timeout_s: float,
    token_timing: bool,
) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    deadline = None if duration_s is None else time.perf_counter() + duration_s
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def task(prompt: str, max_tokens: int) -> None:
            async with sem:
                if deadline is not None and time.perf_counter() > deadline:
                    return
                results.append(
                    await _one(
                        client, url, model, prompt, max_tokens, temperature, headers, token_timing
                    )
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(task(p, m) for p, m in work))
        return results, time.perf_counter() - t0


def run_http_benchmark(
    url: str,
    *,
    num_requests: int = 64,
    concurrency: int = 8,
    duration_s: float | None = None,
    seed: int = 0,
    prompt_words: tuple[int, int] = (4, 48),
    max_tokens: tuple[int, int] = (8, 64),
    shared_prefix_words: int = 0,
    model: str | None = None,
    temperature: float = 0.0,
    api_key: str | None = None,
    timeout_s: float = 300.0,
    token_timing: bool = True,
) -> BenchResult:
    """Runs the seeded workload against ``url`` and returns throughput and latency stats."""
    url = url.rstrip("/")
    work = make_workload(
        num_requests,
        seed=seed,
        prompt_words=prompt_words,
        max_tokens=max_tokens,
        shared_prefix_words=shared_prefix_words,
    )
    results, elapsed = asyncio.run(
        _run(
            url,
            work,
            concurrency=concurrency,
            duration_s=duration_s,
            model=model,
            temperature=temperature,
            api_key=api_key,
            timeout_s=timeout_s,
            token_timing=token_timing,
        )
    )
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return BenchResult(
        url=url,
        num_requests=len(results),
        concurrency=concurrency,
        duration_s=elapsed,
        completed=len(ok),
        errors=len(results) - len(ok),
        request_throughput=len(ok) / elapsed if elapsed else 0.0,
        output_token_throughput=tokens / elapsed if elapsed else 0.0,
        total_output_tokens=tokens,
        ttft_s=_percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_s=_percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        e2e_s=_percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        first_errors=[r.error for r in results if r.error][:5],
    )


def format_result(res: BenchResult) -> str:
    def ms(d: dict[str, float]) -> str:
        if not d:
            return "n/a"
        return " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in d.items() if k in ("p50", "p99", "mean"))

    lines = [
        f"url {res.url}: {res.completed}/{res.num_requests} ok, {res.errors} errors, "
        f"concurrency {res.concurrency}, {res.duration_s:.1f}s",
        f"throughput: {res.request_throughput:.2f} req/s, "
        f"{res.output_token_throughput:.1f} output tok/s ({res.total_output_tokens} tokens)",
        f"TTFT: {ms(res.ttft_s)}",
        f"TPOT: {ms(res.tpot_s)}",
        f"E2E:  {ms(res.e2e_s)}",
    ]
    lines += [f"error: {e}" for e in res.first_errors]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=None, help="stop starting requests after S")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-words", type=int, nargs=2, default=(4, 48), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX"))
    p.add_argument("--shared-prefix-words", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--no-token-timing",
        action="store_true",
        help="do not ask for logprobs=0 (then tokens are timed by text chunks only)",
    )
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    a = p.parse_args(argv)
    res = run_http_benchmark(
        a.url,
        num_requests=a.num_requests,
        concurrency=a.concurrency,
        duration_s=a.duration,
        seed=a.seed,
        prompt_words=tuple(a.prompt_words),
        max_tokens=tuple(a.max_tokens),
        shared_prefix_words=a.shared_prefix_words,
        model=a.model,
        temperature=a.temperature,
        api_key=a.api_key,
        token_timing=not a.no_token_timing,
    )
    print(format_result(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(asdict(res), f, indent=2)
    return 0 if res.completed else 1


if __name__ == "__main__":
    sys.exit(main())
