#!/usr/bin/env python
"""Host time of the engine loop: where ``Engine.step()`` spends its time outside the device.

For each model (``micro``: 1 layer, hidden 64, vocab 512, 256 positions, random weights;
``tiny``: the bundled trained model) and each row count (64 and 256 decode rows), fills the
batch with requests, lets every prompt finish its prefill, then times ``--steps`` steady-state
decode steps of ``Engine.step()``. Each step's host thread is split into:

* ``schedule_us``: ``Scheduler.schedule()`` (the plan);
* ``prepare_us``: ``step.prepare_inputs`` (the plan as padded arrays);
* ``dispatch_us``: the call of the jitted step (returns before the device finishes);
* ``wait_us``: ``step.read_result`` (waits for the device, then one transfer back);
* ``postprocess_us``: ``Scheduler.postprocess`` and the output processor
  (``OutputProcessor.report``) less detokenization (appending tokens, stop checks, freeing,
  stop strings, building the outputs); ``detokenize_us``:
  ``IncrementalDecoder.push`` and ``push_chunk`` (a multi-step row's tokens at once, where the
  text allows);
* ``host_us``: the step's wall time less ``dispatch_us`` and ``wait_us`` (on the CPU backend
  the call of a small program runs it in the calling thread, so dispatch holds device time
  there); ``host_cpu_us``: the same on the host thread's CPU clock (``time.thread_time``),
  which leaves out the time XLA:CPU's threads take the host thread's core away: on a CPU the
  "device" shares the host's cores, so an overlapped step's ``host_us`` counts waits for a
  core that an accelerator would not cause; ``device_idle_us``: the wall time from one
  step's ``read_result`` returning to the next step's dispatch (the device has nothing to
  run), per step.

``fused_ms`` is the engine's compiled step alone on the same decode batch (its inputs built
once, then called back to back, blocking on each), ``step_over_fused`` the steady-state
``Engine.step()`` time over it: 1.0 means the host costs nothing. Everything is measured in
one run, as ratios against the fused step of the same build. ``fused_busy_core_ms`` is the
same fused step while another process keeps one CPU core busy: on the CPU backend the
"device" is XLA:CPU's threads on the host's cores, so an overlapped step's host work slows
the step it overlaps (on a 2-core box, 3.6 -> 4.7-6.3 ms at 256 rows), which no accelerator
does.

Modes: ``sync`` (``async_scheduling=False, decode_steps=1``: each step read before the
next is planned), ``overlap`` (``async_scheduling=True``: the next decode step dispatched
before the current one is read; ``device_idle_us_per_step`` is then the host time between a
read and the next dispatch, which the device spends on the step already queued), ``multistep``
(``decode_steps=8``: a decode-only step runs up to 8 iterations in one program; it is timed
for ``--steps / 8`` steps, the same tokens), ``multistep_overlap`` (both, the accelerator
default: the next 8-iteration loop is dispatched before the one in flight is read): each is
measured when the engine takes its arguments, and listed as not built otherwise.
``tokens_per_s_over_sync`` is a row's tokens/s over the sync row of the same model and rows;
``tokens_per_s_over_k1`` a multi-step row's over its single-step twin with the same
scheduling (``multistep`` over ``sync``, ``multistep_overlap`` over ``overlap``).

    python scripts/bench_host.py [--quick] [--json bench/results/host_<date>.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from paxcache import Engine, SamplingParams  # noqa: E402
from paxcache import overlap as overlap_lib  # noqa: E402
from paxcache import step as step_lib  # noqa: E402
from paxcache.models import ByteTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from paxcache.models.tokenizer import IncrementalDecoder  # noqa: E402

MODES = {
    "sync": {"async_scheduling": False, "decode_steps": 1},
    "overlap": {"async_scheduling": True, "decode_steps": 1},
    "multistep": {"async_scheduling": False, "decode_steps": 8},
    "multistep_overlap": {"async_scheduling": True, "decode_steps": 8},
}


def micro_model() -> LlamaForCausalLM:
    """1 layer, hidden 64, vocab 512, 256 positions (random weights, float32)."""
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))


def supported(mode: str) -> bool:
    """Whether this build's ``Engine`` takes the mode's arguments."""
    try:
        from paxcache.engine_config import EngineConfig
    except ImportError:  # a build from before EngineConfig: the options were parameters
        params = inspect.signature(Engine.__init__).parameters
        return all(k in params for k in MODES[mode])
    try:
        EngineConfig.from_kwargs(**MODES[mode])
    except TypeError:  # an option this build does not have
        return False
    return True


class Phases:
    """Accumulates host-thread seconds per phase (wrapping the engine's own calls)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.cpu: dict[str, float] = collections.defaultdict(float)  # host thread's CPU time
        self.last_ready = None  # perf_counter when the last read_result returned
        self.idle: list[float] = []

    def timed(self, name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        return wrapper

    @contextlib.contextmanager
    def installed(self, eng: Engine) -> Iterator[None]:
        sched, outs = eng.scheduler, eng.outputs
        saved = (sched.schedule, sched.postprocess, eng._jit_step)
        # Newer builds: detokenize, then report (detokenize and process in one pass).
        saved_outs = tuple(getattr(outs, n, None) for n in ("process", "detokenize", "report"))
        saved_mod = (step_lib.prepare_inputs, step_lib.read_result, overlap_lib.read_result)
        saved_push = IncrementalDecoder.push
        saved_chunk = getattr(IncrementalDecoder, "push_chunk", None)  # newer builds
        jit_step, read_result = eng._jit_step, step_lib.read_result

        def dispatch(*args: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            if self.last_ready is not None:
                self.idle.append(t0 - self.last_ready)
            out = jit_step(*args)
            self.seconds["dispatch"] += time.perf_counter() - t0
            self.cpu["dispatch"] += time.thread_time() - c0
            return out

        def read(*args: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = read_result(*args)
            self.last_ready = time.perf_counter()
            self.seconds["wait"] += self.last_ready - t0
            self.cpu["wait"] += time.thread_time() - c0
            return out

        sched.schedule = self.timed("schedule", sched.schedule)
        sched.postprocess = self.timed("postprocess", sched.postprocess)
        outs.process = self.timed("postprocess", outs.process)
        if saved_outs[1] is not None:
            outs.detokenize = self.timed("postprocess", saved_outs[1])
        if saved_outs[2] is not None:
            outs.report = self.timed("postprocess", saved_outs[2])
        eng._jit_step = dispatch
        step_lib.prepare_inputs = self.timed("prepare", step_lib.prepare_inputs)
        step_lib.read_result = overlap_lib.read_result = read
        IncrementalDecoder.push = self.timed("detokenize", saved_push)
        if saved_chunk is not None:
            IncrementalDecoder.push_chunk = self.timed("detokenize", saved_chunk)
        try:
            yield
        finally:
            sched.schedule, sched.postprocess, eng._jit_step = saved
            outs.process = saved_outs[0]
            if saved_outs[1] is not None:
                outs.detokenize = saved_outs[1]
            if saved_outs[2] is not None:
                outs.report = saved_outs[2]
            step_lib.prepare_inputs, step_lib.read_result, overlap_lib.read_result = saved_mod
            IncrementalDecoder.push = saved_push
            if saved_chunk is not None:
                IncrementalDecoder.push_chunk = saved_chunk


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """One CPU core kept busy by another process (no GIL shared): what the host thread's
    Python takes from an XLA:CPU step it overlaps (``fused_busy_core_ms``)."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield
    finally:
        spin.kill()
        spin.wait()


def build(model_name: str, rows: int, extra: dict) -> Engine:
    kw = dict(max_num_seqs=rows, max_num_batched_tokens=max(256, rows), block_size=16, **extra)
    if model_name == "micro":
        blocks = rows * (256 // 16) + 16
        return Engine(micro_model(), ByteTokenizer(), num_blocks=blocks, **kw)
    return Engine.from_pretrained("tiny", **kw)


def run_one(model_name: str, rows: int, mode: str, steps: int, iters: int) -> dict[str, Any]:
    eng = build(model_name, rows, MODES[mode])
    eng.warmup()
    rng = np.random.default_rng(0)
    vocab = min(eng.model.config.vocab_size, 256)  # byte ids: every token detokenizes
    budget = eng.max_model_len - 40
    for i in range(rows):
        ids = list(map(int, rng.integers(0, vocab, int(rng.integers(8, 33)))))
        sp = SamplingParams(max_tokens=budget, ignore_eos=True, temperature=0.0)
        eng.add_request(f"r{i}", ids, sp)
    while eng.scheduler.waiting or any(
        s.num_computed < s.num_prompt for s in eng.scheduler.running
    ):
        eng.step()
    for _ in range(3):  # steady state
        eng.step()
    steps = max(4, steps // eng.decode_steps)  # the same tokens in every mode
    phases = Phases()
    walls: list[float] = []
    cpu_total = 0.0  # the host thread's CPU time over the timed steps
    tokens = 0
    with phases.installed(eng):
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            outs = eng.step()
            walls.append(time.perf_counter() - t0)
            cpu_total += time.thread_time() - c0
            tokens += sum(len(s.new_token_ids) for o in outs for s in o.outputs)
    from bench_peer import _time_engine_device_step

    fused = statistics.median(_time_engine_device_step(eng, iters))
    with busy_core():
        fused_busy = statistics.median(_time_engine_device_step(eng, iters))
    total = sum(walls)
    sec = phases.seconds
    step_s = statistics.median(walls)
    host = total - sec["wait"] - sec["dispatch"]
    host_cpu = cpu_total - phases.cpu["wait"] - phases.cpu["dispatch"]
    row = {
        "model": model_name,
        "mode": mode,
        "rows": rows,
        "steps": steps,
        "tokens": tokens,
        "tokens_per_s": round(tokens / total, 1),
        "step_ms": round(step_s * 1e3, 3),
        "fused_ms": round(fused * 1e3, 3),
        "step_over_fused": round(step_s / fused, 3),
        "fused_busy_core_ms": round(fused_busy * 1e3, 3),
        "host_us_per_step": round(host / steps * 1e6, 1),
        "host_us_per_token": round(host / max(tokens, 1) * 1e6, 2),
        "host_cpu_us_per_token": round(host_cpu / max(tokens, 1) * 1e6, 2),
        "device_idle_us_per_step": round(statistics.median(phases.idle) * 1e6, 1)
        if phases.idle
        else None,
    }
    for name in ("schedule", "prepare", "dispatch", "wait", "detokenize"):
        row[f"{name}_us"] = round(sec[name] / steps * 1e6, 1)
    row["postprocess_us"] = round((sec["postprocess"] - sec["detokenize"]) / steps * 1e6, 1)
    return row


COLUMNS = (
    "model", "mode", "rows", "tokens_per_s", "tokens_per_s_over_sync", "tokens_per_s_over_k1",
    "step_ms", "fused_ms",
    "step_over_fused", "fused_busy_core_ms", "host_us_per_token", "host_cpu_us_per_token",
    "device_idle_us_per_step",
    "schedule_us", "prepare_us", "dispatch_us", "wait_us", "postprocess_us", "detokenize_us",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="micro model, 64 rows, few steps")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row")
    ap.add_argument("--json", dest="json_out", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    steps = args.steps or (8 if args.quick else 40)
    iters = 5 if args.quick else 20
    configs = [("micro", 64)] if args.quick else [("micro", 64), ("micro", 256), ("tiny", 64)]
    rows, missing = [], []
    for mode in MODES:
        if not supported(mode):
            missing.append(mode)
            continue
        for model_name, n in configs:
            rows.append(run_one(model_name, n, mode, steps, iters))
            sync = [r for r in rows if r["mode"] == "sync" and r["model"] == model_name]
            sync = [r for r in sync if r["rows"] == n]
            if sync:
                speedup = rows[-1]["tokens_per_s"] / sync[0]["tokens_per_s"]
                rows[-1]["tokens_per_s_over_sync"] = round(speedup, 2)
            rows[-1].setdefault("tokens_per_s_over_sync", None)
            # A multi-step row over its single-step twin with the same scheduling.
            twin = {"multistep": "sync", "multistep_overlap": "overlap"}.get(mode)
            same = [r for r in rows if (r["mode"], r["model"], r["rows"]) == (twin, model_name, n)]
            rows[-1]["tokens_per_s_over_k1"] = (
                round(rows[-1]["tokens_per_s"] / same[0]["tokens_per_s"], 2) if same else None
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(" | ".join(COLUMNS))
    for r in rows:
        print(" | ".join(str(r[c]) for c in COLUMNS))
    for mode in missing:
        print(f"{mode}: not built in this engine (Engine takes no {sorted(MODES[mode])})")
    if args.json_out:
        doc = {
            "date": time.strftime("%Y-%m-%d"),
            "backend": jax.default_backend(),
            "device": str(jax.devices()[0]),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "modes_not_built": missing,
            "rows": rows,
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
