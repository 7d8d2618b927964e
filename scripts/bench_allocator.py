"""Benchmark: one decode step (one new token per running sequence) of the block allocator.

Compares the jitted, batched ``allocator.append`` (donated state, synchronised every step)
with a per-sequence Python allocator (``tests/model_allocator.py``, one ``append_one`` call per
sequence, as vLLM v0 does) for B in {64, 256, 1024, 4096} running sequences of random lengths
up to 512 tokens, block size 16. The allocators take turns in rounds and the median step time
is reported (robust to other processes on a shared machine). Prints a table and writes JSON (default
``bench/results/allocator_cpu.json``).

Usage:
    python scripts/bench_allocator.py [--steps 300] [--batch 64 256 1024 4096] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from model_allocator import ModelAllocator  # noqa: E402

from paxcache import allocator  # noqa: E402
from paxcache.config import CacheConfig  # noqa: E402

log = logging.getLogger("bench_allocator")

BLOCK_SIZE = 16
MAX_LEN = 512


def _config(batch: int, steps: int, caching: bool) -> CacheConfig:
    m = -(-(MAX_LEN + steps + 1) // BLOCK_SIZE) + 1
    return CacheConfig(
        num_blocks=batch * m,
        block_size=BLOCK_SIZE,
        max_seqs=batch,
        max_blocks_per_seq=m,
        watermark=0.0,
        enable_prefix_caching=caching,
    )


def _lengths(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, MAX_LEN + 1, size=batch).astype(np.int32)


class _JaxRunner:
    """Jitted batched ``allocator.append`` on a donated state."""

    def __init__(self, batch: int, total_steps: int, caching: bool, seed: int) -> None:
        cfg = _config(batch, total_steps, caching)
        alloc = jax.jit(allocator.allocate, donate_argnums=0)
        state = allocator.init(cfg)
        tokens = np.zeros(cfg.max_model_len, np.int32)
        for slot, n in enumerate(_lengths(batch, seed)):
            state, res = alloc(state, np.int32(slot), tokens, np.int32(n))
            assert bool(res.ok)
        self.state = state
        self.step_fn = jax.jit(allocator.append, donate_argnums=0)
        self.ones = jax.device_put(np.ones(batch, np.int32))
        self.ok = True

    def step(self) -> None:
        self.state, res = self.step_fn(self.state, self.ones)
        jax.block_until_ready(self.state)
        self.res = res

    def check(self) -> None:
        assert bool(np.all(np.asarray(self.res.ok)))
        checks = jax.device_get(allocator.check_invariants(self.state))
        assert all(bool(v) for v in checks.values()), checks


class _PythonRunner:
    """Per-sequence Python allocator: one ``append_one`` call per running sequence."""

    def __init__(self, batch: int, total_steps: int, seed: int) -> None:
        self.model = ModelAllocator(_config(batch, total_steps, False))
        self.batch = batch
        for slot, n in enumerate(_lengths(batch, seed)):
            assert self.model.allocate(slot, int(n))

    def step(self) -> None:
        append_one = self.model.append_one
        for slot in range(self.batch):
            ok, _ = append_one(slot, 1)
        self.ok = ok

    def check(self) -> None:
        assert self.ok


def bench(batch: int, steps: int, warmup: int, rounds: int, seed: int) -> dict[str, float]:
    """Median microseconds per decode step for each allocator.

    The allocators take turns in ``rounds`` rounds of ``steps // rounds`` steps each, so a
    burst of load from other processes hits all of them alike.
    """
    total = steps + warmup
    runners = {
        "python": _PythonRunner(batch, total, seed),
        "jax": _JaxRunner(batch, total, False, seed),
        "jax_prefix_caching": _JaxRunner(batch, total, True, seed),
    }
    for runner in runners.values():
        for _ in range(warmup):
            runner.step()
    times: dict[str, list[float]] = {k: [] for k in runners}
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for name, runner in runners.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                runner.step()
                times[name].append(time.perf_counter() - t0)
    for runner in runners.values():
        runner.check()
    return {k: float(np.median(v)) * 1e6 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "bench", "results", "allocator_cpu.json")
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    rows = []
    header = f"{'B':>6} {'python us':>10} {'jax us':>9} {'jax+pc us':>10} {'speedup':>8}"
    log.info(header)
    for batch in args.batch:
        t = bench(batch, args.steps, args.warmup, args.rounds, args.seed)
        py, jx, jpc = t["python"], t["jax"], t["jax_prefix_caching"]
        row = {
            "batch": batch,
            "python_us_per_step": round(py, 2),
            "jax_us_per_step": round(jx, 2),
            "jax_prefix_caching_us_per_step": round(jpc, 2),
            "speedup": round(py / jx, 2),
            "speedup_prefix_caching": round(py / jpc, 2),
        }
        rows.append(row)
        log.info(f"{batch:>6} {py:>10.1f} {jx:>9.1f} {jpc:>10.1f} {py / jx:>7.2f}x")
    dev = jax.devices()[0]
    result = {
        "benchmark": "allocator decode step (append one token per sequence)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{dev.platform}: {dev.device_kind}",
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        "jax_version": jax.__version__,
        "block_size": BLOCK_SIZE,
        "max_initial_len": MAX_LEN,
        "statistic": "median microseconds per step",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "results": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    log.info(f"wrote {args.out}")


if __name__ == "__main__":
    main()
