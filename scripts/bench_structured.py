#!/usr/bin/env python
"""Constrained-decoding overhead: decode throughput of N concurrent JSON-schema-constrained
requests vs N unconstrained ones (and a half-and-half mix), same engine, same run.

Every request has the same prompt length and generates exactly ``--max-tokens`` tokens (the
unconstrained ones ignore EOS; the constrained ones follow a schema, an array of at least 1000
small objects, that cannot be complete before ``--max-tokens``), so the workloads do the same
device work and differ only by the grammar: the host fills each constrained row's
allowed-token bitmask (llguidance) and the step runs its masked variant (logits of disallowed
tokens set to -inf before sampling). Workloads are interleaved and repeated; the table shows
the median of each.

Also reported: host time to fill the bitmask of N rows (``fill_ms``, median over the steps of
one constrained run), and whether an unconstrained batch's step inputs carry no mask (the
program it runs is exactly the one without structured-output support).

Usage:
  python scripts/bench_structured.py                  # tiny model, 32 requests, 64 tokens
  python scripts/bench_structured.py --num-requests 64 --max-tokens 128 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paxcache import Engine, SamplingParams, grammar  # noqa: E402
from paxcache import step as step_lib  # noqa: E402
from paxcache.sampling import StructuredOutputsParams  # noqa: E402

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "ok"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 1000}


def run(engine: Engine, prompts: list[list[int]], constrained: list[bool], args) -> dict:
    """One workload to completion: throughput of the generated tokens over the whole run."""
    spec = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    for i, (p, c) in enumerate(zip(prompts, constrained, strict=True)):
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=i,
            ignore_eos=not c,
            structured_outputs=spec if c else None,
        )
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    steps = tokens = 0
    reasons: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
                tokens += len(c.token_ids)
        steps += 1
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "steps": steps,
        "tokens": tokens,
        "tok_per_s": tokens / seconds,
        "finish_reasons": reasons,
    }


def fill_time(engine: Engine, prompts: list[list[int]], args) -> tuple[float, bool]:
    """Median host time to fill the bitmask of every constrained row of a step, over the
    decode steps of one all-constrained run; and whether an unconstrained plan has no mask."""
    spec = StructuredOutputsParams(json=SCHEMA)
    eng = engine
    eng.add_request("free", prompts[0], SamplingParams(max_tokens=2))
    plan = eng.scheduler.schedule()
    inputs, _ = step_lib.prepare_inputs(plan, eng._shapes)
    no_mask = inputs.allowed is None
    eng.abort("free")
    comp = grammar.GrammarCompiler(eng.tokenizer, eng.model.config.vocab_size, [257])
    matchers = [comp.matcher(spec) for _ in prompts]
    rng = np.random.default_rng(0)
    mask = np.full((len(prompts), grammar.bitmask_words(comp.vocab_size)), -1, np.int32)
    times = []
    for _ in range(args.max_tokens):
        t = time.perf_counter()
        grammar.fill_bitmask([(m, j) for j, m in enumerate(matchers)], mask)
        times.append(time.perf_counter() - t)
        for j, m in enumerate(matchers):  # advance each by a random allowed token
            bits = np.unpackbits(mask[j].view(np.uint8), bitorder="little")[: comp.vocab_size]
            allowed = np.flatnonzero(bits)
            assert m.consume(int(rng.choice(allowed)))
    return statistics.median(times) * 1e3, no_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    n = args.num_requests
    engine = Engine.from_pretrained(args.model, max_num_seqs=n, max_num_batched_tokens=max(256, n))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(32, 127, args.prompt_len))) for _ in range(n)]
    workloads = {
        "unconstrained": [False] * n,
        "constrained": [True] * n,
        "mixed": [j % 2 == 0 for j in range(n)],
    }
    # Warm-up: compile both step variants at every bucket the runs use.
    for flags in workloads.values():
        run(engine, prompts, flags, args)
    results: dict[str, list[dict]] = {k: [] for k in workloads}
    for _ in range(args.repeats):
        for name, flags in workloads.items():
            results[name].append(run(engine, prompts, flags, args))
    fill_ms, no_mask = fill_time(engine, prompts, args)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    base = med("unconstrained", "tok_per_s")
    rows = []
    for name in workloads:
        tps = med(name, "tok_per_s")
        rows.append(
            {
                "workload": name,
                "requests": n,
                "tok_per_s": tps,
                "vs_unconstrained": tps / base,
                "overhead_pct": 100 * (1 - tps / base),
                "seconds": med(name, "seconds"),
                "steps": med(name, "steps"),
                "finish_reasons": results[name][-1]["finish_reasons"],
            }
        )
    print(f"\n{n} concurrent requests x {args.max_tokens} tokens, {args.model}, ", end="")
    print(f"{jax.default_backend()}, median of {args.repeats}")
    print(f"{'workload':<14} {'tok/s':>9} {'vs unconstr.':>13} {'overhead':>9} {'steps':>6}")
    for r in rows:
        print(
            f"{r['workload']:<14} {r['tok_per_s']:>9.1f} {r['vs_unconstrained']:>13.3f} "
            f"{r['overhead_pct']:>8.1f}% {r['steps']:>6.0f}"
        )
    print(f"host bitmask fill for {n} rows: {fill_ms:.3f} ms per step (median)")
    print(f"unconstrained batch carries no mask (its original program): {no_mask}")
    stamp = dt.datetime.now().strftime("%Y%m%d")
    out = Path(
        args.out or ROOT / "bench" / "results" / f"structured_{jax.default_backend()}_{stamp}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "backend": jax.default_backend(),
                "schema": SCHEMA,
                "rows": rows,
                "runs": results,
                "fill_ms_per_step": fill_ms,
                "unconstrained_has_no_mask": no_mask,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
