#!/usr/bin/env python
"""Host time of two builds in lock step: a change to the engine's host code against a reference.

On a shared 2-core box the speed of Python moves by up to 2x between minutes, so two
``bench_host.py`` runs, even interleaved, cannot show a 10% change. Here each build (a source
tree: this checkout and ``--against``, e.g. a ``git worktree`` of main) runs the same engine in
its own process, both built and warmed up first, and the two are stepped alternately, one
``Engine.step()`` at a time (the order flipped every step), so a slow minute slows both
alike. Each step's host time is taken on the host thread's CPU clock less the dispatch and
the wait for the device (``bench_host.Phases``); the result is each build's host time per
generated token over all its steps, and its ratio to the reference. Fresh processes every
round (``--rounds``), ``--steps`` steps each after three steady-state steps.

    python scripts/bench_host_ab.py --against ../main-ref [--mode multistep] [--rows 256]
        [--rounds 4] [--steps 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# One build's engine, stepped on request: prints READY, then one JSON line per "s" read.
_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1] + "/scripts")
import numpy as np
import bench_host as bh
from paxcache import SamplingParams
mode, rows = sys.argv[2], int(sys.argv[3])
eng = bh.build("micro", rows, bh.MODES[mode])
eng.warmup()
rng = np.random.default_rng(0)
budget = eng.max_model_len - 40
for i in range(rows):
    ids = list(map(int, rng.integers(0, 256, int(rng.integers(8, 33)))))
    sp = SamplingParams(max_tokens=budget, ignore_eos=True, temperature=0.0)
    eng.add_request(f"r{i}", ids, sp)
while eng.scheduler.waiting or any(s.num_computed < s.num_prompt for s in eng.scheduler.running):
    eng.step()
for _ in range(3):
    eng.step()
phases = bh.Phases()
print("READY", flush=True)
with phases.installed(eng):
    for _ in sys.stdin:
        cpu0 = time.thread_time()
        outs = eng.step()
        cpu = time.thread_time() - cpu0 - phases.cpu["wait"] - phases.cpu["dispatch"]
        phases.cpu["wait"] = phases.cpu["dispatch"] = 0.0
        tokens = sum(len(s.new_token_ids) for o in outs for s in o.outputs)
        print(json.dumps({"host_cpu_s": cpu, "tokens": tokens}), flush=True)
"""


def lockstep(
    trees: list[str], mode: str, rows: int, rounds: int, steps: int
) -> dict[str, dict[str, Any]]:
    """Steps one engine per tree alternately; per tree its host CPU seconds, tokens and each
    step's host microseconds per token."""
    acc = {t: {"host_cpu_s": 0.0, "tokens": 0, "per_step": []} for t in trees}
    for _ in range(rounds):
        procs = {
            t: subprocess.Popen(
                [sys.executable, "-c", _CHILD, t, mode, str(rows)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd="/tmp",  # neither tree's package by the working directory
            )
            for t in trees
        }
        try:
            for t, p in procs.items():
                while (line := p.stdout.readline()) and line.strip() != "READY":
                    pass
                if not line:
                    raise RuntimeError(f"the engine of {t} exited before its first step")
            for k in range(steps):
                for t in trees if k % 2 == 0 else trees[::-1]:
                    p = procs[t]
                    p.stdin.write("s\n")
                    p.stdin.flush()
                    r = json.loads(p.stdout.readline())
                    a = acc[t]
                    a["host_cpu_s"] += r["host_cpu_s"]
                    a["tokens"] += r["tokens"]
                    a["per_step"].append(r["host_cpu_s"] / max(r["tokens"], 1) * 1e6)
        finally:
            for p in procs.values():
                p.stdin.close()
                p.wait()
    return acc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="the reference build's source tree")
    ap.add_argument("--mode", default="multistep", help="a bench_host.py mode")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    trees = [str(Path(args.against).resolve()), str(ROOT)]
    acc = lockstep(trees, args.mode, args.rows, args.rounds, args.steps)
    ref = acc[trees[0]]["host_cpu_s"] / max(acc[trees[0]]["tokens"], 1)
    out = []
    print("build | mode | rows | steps | host_cpu_us_per_token | median step | over reference")
    for t in trees:
        a = acc[t]
        per_token = a["host_cpu_s"] / max(a["tokens"], 1)
        row = {
            "build": t,
            "mode": args.mode,
            "rows": args.rows,
            "steps": len(a["per_step"]),
            "host_cpu_us_per_token": round(per_token * 1e6, 3),
            "median_step_host_cpu_us_per_token": round(statistics.median(a["per_step"]), 3),
            "over_reference": round(per_token / ref, 3),
        }
        out.append(row)
        print(" | ".join(str(v) for v in row.values()))
    if args.json_out:
        doc = {"date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "rows": out}
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
