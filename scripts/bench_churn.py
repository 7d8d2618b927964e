#!/usr/bin/env python
"""A host-bound churn workload: the engine's scheduling modes against the synchronous engine.

The bundled tiny model serves many short requests that arrive a few per step: prompts of 4-40
characters, 2-48 new tokens, greedy or seeded sampling, and a mix of stop strings, stop token
ids and requests aborted a few steps after they arrive (each request's draw fixed by the
workload seed). Each mode runs the same workloads, repetitions interleaved (sync, then each
other mode, per repetition), and reports:

* ``wall_s``: the median wall time of a whole workload (``Engine.step()`` calls until every
  request finished, aborts included), and ``wall_over_sync``: that over the synchronous
  engine's in the same run (below 1.0: faster);
* ``tokens_per_s``: tokens reported (finished requests' ``token_ids``) over that time;
* ``same_outputs``: every request not aborted ends with the synchronous engine's token ids,
  text and finish reason, and an aborted one's token ids are a prefix of the synchronous
  engine's (or extend them): an overlapped engine admits a request added between steps one
  step later (the step after the one in flight), so an abort issued a fixed number of
  ``step()`` calls after arrival may cut it a token earlier; ``aborted_differently`` counts
  those.

Modes: ``sync`` (``async_scheduling=False, decode_steps=1``), ``default`` (the engine's
defaults on this backend: overlapped scheduling; one decode step per program on CPU) and
``overlap_k8`` (overlapped, ``decode_steps=8``). On a 2-core CPU box the "device" is XLA:CPU's
threads on the same cores as the host thread, so overlapping host work slows the step it
overlaps (see ``scripts/bench_host.py``'s ``fused_busy_core_ms``).

    python scripts/bench_churn.py [--requests 160] [--arrivals 8] [--reps 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from paxcache import Engine, SamplingParams  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "sync": {"async_scheduling": False, "decode_steps": 1},
    "default": {},
    "overlap_k8": {"async_scheduling": True, "decode_steps": 8},
}

Request = tuple[str, str, SamplingParams, int | None]  # (id, prompt, params, abort after)


def workload(seed: int, num_requests: int) -> list[Request]:
    """``num_requests`` short requests, each drawn from ``seed``: (id, prompt, params, steps
    after arrival at which it is aborted, or None)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num_requests):
        prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(4, 40)))
        kw: dict[str, Any] = dict(
            max_tokens=rng.randint(2, 48), temperature=rng.choice([0.0, 0.0, 0.8]), seed=i
        )
        draw = rng.random()
        if draw < 0.3:
            kw["stop"] = [rng.choice(["e", "th", " a", "\n"])]
        elif draw < 0.4:
            kw["stop_token_ids"] = [rng.randint(97, 104)]
        abort_after = rng.randint(1, 6) if rng.random() < 0.15 else None
        reqs.append((f"q{i}", prompt, SamplingParams(**kw), abort_after))
    return reqs


def serve(eng: Engine, reqs: list[Request], arrivals: int) -> tuple[float, int, dict]:
    """Runs ``reqs`` through ``eng``, ``arrivals`` added before each step; returns (wall
    seconds, steps, {request id: (token ids, text, finish reason)})."""
    pending = list(reqs)
    live: dict[str, int | None] = {}
    age: dict[str, int] = {}
    final: dict[str, tuple] = {}
    steps = 0
    t0 = time.perf_counter()
    while pending or eng.has_unfinished_requests():
        for rid, prompt, params, abort_after in pending[:arrivals]:
            eng.add_request(rid, prompt, params)
            live[rid], age[rid] = abort_after, 0
        del pending[:arrivals]
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                final[out.request_id] = (tuple(c.token_ids), c.text, c.finish_reason)
        steps += 1
        for rid, abort_after in list(live.items()):
            if rid in final:
                del live[rid]
                continue
            age[rid] += 1
            if abort_after is not None and age[rid] >= abort_after:
                eng.abort(rid)
                del live[rid]
    return time.perf_counter() - t0, steps, final


def _prefix(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether the shorter of ``a`` and ``b`` starts the other."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=160, help="requests per workload")
    ap.add_argument("--arrivals", type=int, default=8, help="requests added per step")
    ap.add_argument("--reps", type=int, default=3, help="workloads (seeds) per mode")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--json", dest="json_out", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    engines = {}
    for mode, kw in MODES.items():
        eng = Engine.from_pretrained("tiny", max_num_seqs=args.max_num_seqs, **kw)
        eng.warmup()
        serve(eng, workload(10_000, min(args.requests, 32)), args.arrivals)  # warm caches
        engines[mode] = eng
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, int] = dict.fromkeys(MODES, 0)
    steps: dict[str, int] = dict.fromkeys(MODES, 0)
    mismatched: dict[str, int] = dict.fromkeys(MODES, 0)
    cut_elsewhere: dict[str, int] = dict.fromkeys(MODES, 0)
    for rep in range(args.reps):
        reqs = workload(rep, args.requests)
        outs = {}
        for mode, eng in engines.items():
            wall, n, final = serve(eng, reqs, args.arrivals)
            walls[mode].append(wall)
            steps[mode] += n
            tokens[mode] += sum(len(ids) for ids, _, _ in final.values())
            outs[mode] = final
        aborted = {rid for rid, _, _, after in reqs if after is not None}
        for mode in MODES:
            sync, got = outs["sync"], outs[mode]
            for rid in set(sync) | set(got):
                a, b = sync.get(rid), got.get(rid)
                if a == b:
                    continue
                if rid in aborted and a and b and _prefix(a[0], b[0]):
                    cut_elsewhere[mode] += 1
                else:
                    mismatched[mode] += 1
    base = statistics.median(walls["sync"])
    rows = []
    for mode, eng in engines.items():
        wall = statistics.median(walls[mode])
        rows.append(
            {
                "mode": mode,
                "async_scheduling": eng.async_scheduling,
                "decode_steps": eng.decode_steps,
                "wall_s": round(wall, 3),
                "wall_over_sync": round(wall / base, 3),
                "walls_s": [round(w, 3) for w in walls[mode]],
                "tokens_per_s": round(tokens[mode] / sum(walls[mode]), 1),
                "steps": steps[mode],
                "same_outputs": mismatched[mode] == 0,
                "mismatched_requests": mismatched[mode],
                "aborted_differently": cut_elsewhere[mode],
            }
        )
    cols = ("mode", "async_scheduling", "decode_steps", "wall_s", "wall_over_sync")
    cols += ("tokens_per_s", "steps", "same_outputs")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if args.json_out:
        doc = {
            "date": time.strftime("%Y-%m-%d"),
            "backend": jax.default_backend(),
            "device": str(jax.devices()[0]),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "args": vars(args),
            "rows": rows,
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r["same_outputs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
