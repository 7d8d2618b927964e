#!/usr/bin/env python
"""One command for a short visit to a GPU machine: environment, kernels, then the engine.

Stages, in order, each in its own process under a watchdog (a stage that hangs or dies is
recorded and the next one runs):

1. ``environment``: JAX, jaxlib, the devices, compute capability, memory, ``nvidia-smi -L``.
2. ``kernels``: ``scripts/gpu_check.py --quick`` (Hopper): every Mosaic GPU kernel against its
   oracle on NaN-poisoned pages, then decode attention as a fraction of the measured device
   copy bandwidth, the Mosaic and Triton kernels side by side with the XLA path and JAX's
   bundled ``pallas.ops.gpu.paged_attention``; its own ``gpu_check.jsonl``.
3. ``engine``: a random Llama-3-8B-shaped bf16 model (32 layers, hidden 4096, 32 / 8 heads,
   head_dim 128, intermediate 14336, vocab 128256) in an :class:`paxcache.Engine` at 64
   sequences: warm-up seconds per compiled step shape, generated tokens per second, and the
   engine's decode step against a dense-cache decode loop of the same model and batch.

Output: JSON lines in ``$OUT`` (or ``--out``), at most six files: ``session.jsonl`` (one line
per stage: status, seconds, and the environment), ``gpu_check.jsonl`` and
``gpu_check_tracebacks.txt`` (the kernel stage), ``engine.jsonl``. ``--dry-run`` runs every
stage on the CPU at toy sizes (the tests do).

    bash scripts/gpu_session.sh            # on the GPU machine, about ten minutes
    bash scripts/gpu_session.sh --dry-run  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: Watchdog seconds per stage (GPU; a dry run gets ``DRY_TIMEOUT`` for each).
TIMEOUTS = {"environment": 60, "kernels": 240, "engine": 330}
DRY_TIMEOUT = 900

#: The engine stage's model: Llama-3-8B's shapes (random weights).
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
TOY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def write(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()


# ------------------------------------------------------------------------------ stages


def stage_environment(out: Path, dry: bool) -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    env: dict[str, Any] = dict(
        python=sys.version.split()[0],
        jax=jax.__version__,
        jaxlib=getattr(jax.lib, "__version__", None) or jax.__version__,
        backend=jax.default_backend(),
        devices=[str(d) for d in jax.devices()],
        device_kind=dev.device_kind,
        compute_capability=getattr(dev, "compute_capability", None),
    )
    try:
        stats = dev.memory_stats() or {}
        env["memory_bytes_limit"] = stats.get("bytes_limit")
    except Exception as e:  # noqa: BLE001 - CPU devices may have none
        env["memory_stats_error"] = str(e)[:200]
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        env["nvidia_smi"] = smi.stdout.strip()[:500]
    except Exception as e:  # noqa: BLE001 - not on a GPU machine
        env["nvidia_smi"] = f"unavailable: {type(e).__name__}"
    return env


def stage_kernels(out: Path, dry: bool) -> dict[str, Any]:
    dump = tempfile.mkdtemp(prefix="gpu_session_ptxas_")  # outside $OUT: six files at most
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out)]
    cmd += ["--dry-run", "--only", "decode"] if dry else ["--quick", "--dump-dir", dump]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    result: dict[str, Any] = dict(returncode=proc.returncode, stderr_tail=proc.stderr[-800:])
    path = out / "gpu_check.jsonl"
    if path.exists():
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        result["summary"] = next((r for r in rows if r.get("case") == "summary"), None)
    return result


def stage_engine(out: Path, dry: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_peer import decode_step_comparison

    from paxcache import Engine, SamplingParams
    from paxcache.models import ByteTokenizer, LlamaConfig, LlamaForCausalLM

    rec = out / "engine.jsonl"
    shape = TOY if dry else LLAMA3_8B
    seqs = 2 if dry else 64
    dtype = jnp.float32 if dry else jnp.bfloat16
    t0 = time.perf_counter()
    model = LlamaForCausalLM(LlamaConfig(**shape), dtype=dtype, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    init_s = time.perf_counter() - t0
    write(rec, dict(case="model", init_s=round(init_s, 1), dtype=str(jnp.dtype(dtype)), **shape))
    t0 = time.perf_counter()
    eng = Engine(
        model,
        ByteTokenizer(),
        max_num_seqs=seqs,
        max_num_batched_tokens=16 if dry else 256,
        max_model_len=256 if dry else 1024,
        **(
            {"num_blocks": int(os.environ["GPU_SESSION_NUM_BLOCKS"])}
            if os.environ.get("GPU_SESSION_NUM_BLOCKS")
            else {}
        ),
    )
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.warmup()
    warm_s = time.perf_counter() - t0
    stats = eng.stats()
    shapes = max(1, len(eng.buckets))
    write(
        rec,
        dict(
            case="warmup",
            engine_build_s=round(build_s, 1),
            warmup_s=round(warm_s, 1),
            step_shapes=shapes,
            compile_s_per_shape=round(warm_s / shapes, 2),
            num_blocks=stats.get("num_total_blocks"),
            kernel_impls=stats.get("kernel_impls"),
        ),
    )
    rng = np.random.default_rng(0)
    new_tokens = 4 if dry else 128
    lengths = rng.integers(4, 13, seqs) if dry else rng.integers(16, 129, seqs)
    prompts = [list(map(int, rng.integers(0, 256, int(n)))) for n in lengths]
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    eng.generate(prompts[:2], sp)  # any first-call cost outside the timing
    t0 = time.perf_counter()
    outs = eng.generate(prompts, sp)
    gen_s = time.perf_counter() - t0
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    write(
        rec,
        dict(
            case="generate",
            sequences=seqs,
            prompt_tokens=sum(map(len, prompts)),
            generated_tokens=generated,
            seconds=round(gen_s, 3),
            tokens_per_s=round(generated / gen_s, 1),
        ),
    )
    cmp = decode_step_comparison(eng, iters=2 if dry else 20, seed=0)
    write(rec, dict(case="decode_step_vs_dense", **cmp))
    return dict(tokens_per_s=round(generated / gen_s, 1), **{k: cmp[k] for k in cmp if "over" in k})


STAGES = {"environment": stage_environment, "kernels": stage_kernels, "engine": stage_engine}


# ------------------------------------------------------------------------------ driver


def run_stage(name: str, out: Path, dry: bool) -> dict[str, Any]:
    """Runs one stage in a child process under its watchdog; its result or why it has none."""
    timeout = DRY_TIMEOUT if dry else TIMEOUTS[name]
    cmd = [sys.executable, __file__, "--stage", name, "--out", str(out)]
    cmd += ["--dry-run"] if dry else []
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(stage=name, status="hung", seconds=round(time.perf_counter() - t0, 1))
    row: dict[str, Any] = dict(stage=name, seconds=round(time.perf_counter() - t0, 1))
    last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    try:
        row["result"] = json.loads(last[0]) if last else None
    except json.JSONDecodeError:
        row["result"] = None
    row["status"] = "ok" if proc.returncode == 0 and row["result"] is not None else "failed"
    if row["status"] != "ok":
        row["returncode"] = proc.returncode
        row["stderr_tail"] = proc.stderr[-1500:]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes")
    ap.add_argument("--out", default=None, help="output directory (default: $OUT)")
    ap.add_argument("--stage", choices=sorted(STAGES), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--only", default=None, help="comma-separated stages to run")
    args = ap.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_session_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.stage:  # a child: run it, print its result as the last stdout line
        result = STAGES[args.stage](out, args.dry_run)
        print(json.dumps(result, default=str), flush=True)
        return 0
    names = args.only.split(",") if args.only else list(STAGES)
    session = out / "session.jsonl"
    failed = []
    for name in names:
        row = run_stage(name, out, args.dry_run)
        write(session, row)
        print(json.dumps(row, default=str)[:2000], flush=True)
        if row["status"] != "ok":
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
