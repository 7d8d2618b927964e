"""Compile paxcache for a TPU chip without one: the engine's programs, or the kernel grid.

Runs libtpu's real compiler (``pip install "jax[tpu]"``) on an abstract TPU topology, so a
model and chip can be checked before renting one.

Usage::

    # the engine for an HF config (no weights), 4 chips of a v5e:2x2 slice:
    python scripts/compile_check.py --target v5e:2x2 --config /ckpt/llama3-8b/config.json \\
        --dtype bfloat16 --tp 4 --json out.json
    # the kernel grid (bf16/f32, head_dim 64..256, G 1..8, block 8..128, ...):
    python scripts/compile_check.py --target v6e:2x2 [--wide]

With ``--config`` it compiles every warm-up bucket of the engine's fused step and every swap
program, and prints per program: compiled yes/no, compile seconds, XLA's memory analysis per
chip next to the engine's own KV sizing for the chip's HBM, and the kernel each op got.
The exit status is 1 when anything failed to compile, did not fit the chip's HBM, or fell
back from its Mosaic kernel to XLA; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile only: never probe for a local TPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402

from paxcache import compile_check  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="v5e:2x2", help="TPU topology, e.g. v5e:2x2, v6e:2x2")
    p.add_argument("--config", help="HF config.json (or its directory); omit for the kernel grid")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel chips of the topology")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel groups (MoE models)")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int8-w8a8", "fp8"],
        help="layer weights quantized (abstractly) with this scheme",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8"],
        help="KV cache dtype: auto = --dtype; int8 / fp8 (e4m3) pages with per-layer scales",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="default: the engine's TPU default (256)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="default: the engine's TPU default (2048)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="multi-step decode iterations (default: the engine's TPU default, 8)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--num-host-blocks",
        type=int,
        default=None,
        help="host swap pool in blocks (default: 4 full-length sequences; 0: no swap programs)",
    )
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: the engine's sizing)"
    )
    p.add_argument("--hbm-gib", type=float, default=None, help="HBM per chip (default: compiler's)")
    p.add_argument("--wide", action="store_true", help="kernel grid: the wide grid")
    p.add_argument("--json", dest="json_out", help="write the report as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    hbm = None if args.hbm_gib is None else int(args.hbm_gib * (1 << 30))
    try:
        if args.config:
            report = compile_check.check_engine(
                args.target,
                compile_check.load_hf_config(args.config),
                dtype=getattr(jnp, args.dtype),
                tp=args.tp,
                ep=args.ep,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size,
                num_host_blocks=args.num_host_blocks,
                max_model_len=args.max_model_len,
                hbm_bytes=hbm,
                num_blocks=args.num_blocks,
                quantization=args.quantization,
                kv_cache_dtype=args.kv_cache_dtype,
                decode_steps=args.decode_steps,
            )
        else:
            report = compile_check.check_kernels(args.target, wide=args.wide)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(compile_check.format_report(report))
    if args.json_out:
        Path(args.json_out).write_text(compile_check.to_json(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
