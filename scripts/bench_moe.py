"""Mixture-of-experts MLP: the grouped matmul (``jax.lax.ragged_dot`` over expert-sorted tokens,
:func:`paxcache.models.moe.expert_mlp`) against a dense all-experts einsum, and how
``ragged_dot`` lowers per platform.

The dense form runs every expert on every token (work ~ N * X) and masks by the routing
weights; the grouped form runs each expert on its own tokens (work ~ N * k on TPU/GPU, where
``ragged_dot`` lowers to XLA's ``chlo.ragged_dot`` composite, a grouped matmul). Off-accelerator
XLA expands ``ragged_dot`` to a masked dense product over the groups, so the CPU times here
bound the host fallback, not TPU performance; the lowering report shows which form each
platform gets (``jax.export`` for TPU/CUDA needs no chip).

Usage: ``python scripts/bench_moe.py [--tokens 16 128 1024] [--experts 16] [--top-k 2]
[--hidden 256] [--width 512] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import export  # noqa: E402

from paxcache.models.moe import expert_mlp, route  # noqa: E402


def dense_all_experts(x, weights, experts, w_gate, w_up, w_down):
    """Every expert on every token, weighted by the (mostly zero) routing weights."""
    n_experts = w_gate.shape[0]
    dense_w = jnp.zeros((x.shape[0], n_experts), jnp.float32)
    dense_w = dense_w.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    gate = jnp.einsum("ne,xef->nxf", x, w_gate)
    up = jnp.einsum("ne,xef->nxf", x, w_up)
    out = jnp.einsum("nxf,xfe->nxe", jax.nn.silu(gate) * up, w_down)
    return jnp.einsum("nxe,nx->ne", out, dense_w)


def _time(fn, *args, repeat: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def lowering_report() -> dict[str, str]:
    """Which op ``ragged_dot`` becomes in the StableHLO exported for each platform."""
    f = jax.jit(lambda a, w, g: jax.lax.ragged_dot(a, w, g))
    args = (
        jax.ShapeDtypeStruct((64, 32), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 32, 16), jnp.bfloat16),
        jax.ShapeDtypeStruct((8,), jnp.int32),
    )
    out = {}
    for platform in ("tpu", "cuda", "cpu"):
        text = export.export(f, platforms=[platform])(*args).mlir_module()
        out[platform] = (
            "chlo.ragged_dot composite (grouped matmul)"
            if "chlo.ragged_dot" in text
            else "dense masked expansion"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 1024])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    x_n, e, f = args.experts, args.hidden, args.width
    w_gate, w_up = (jnp.asarray(rng.standard_normal((x_n, e, f)) * 0.05, jnp.float32) for _ in "gu")
    w_down = jnp.asarray(rng.standard_normal((x_n, f, e)) * 0.05, jnp.float32)
    grouped = jax.jit(expert_mlp)
    dense = jax.jit(dense_all_experts)
    rows = []
    for n in args.tokens:
        x = jnp.asarray(rng.standard_normal((n, e)), jnp.float32)
        weights, experts = route(jnp.asarray(rng.standard_normal((n, x_n))), args.top_k, True)
        diff = float(
            jnp.max(
                jnp.abs(
                    grouped(x, weights, experts, w_gate, w_up, w_down)
                    - dense(x, weights, experts, w_gate, w_up, w_down)
                )
            )
        )
        t_grouped = _time(grouped, x, weights, experts, w_gate, w_up, w_down)
        t_dense = _time(dense, x, weights, experts, w_gate, w_up, w_down)
        rows.append(
            {
                "tokens": n,
                "ragged_dot_ms": t_grouped * 1e3,
                "dense_einsum_ms": t_dense * 1e3,
                "max_abs_diff": diff,
            }
        )
        print(
            f"N={n:5d} X={x_n} k={args.top_k} E={e} Fm={f}: ragged_dot {t_grouped * 1e3:8.2f} ms"
            f"  dense all-experts einsum {t_dense * 1e3:8.2f} ms  (max |diff| {diff:.1e})"
        )
    lowering = lowering_report()
    for platform, form in lowering.items():
        print(f"ragged_dot lowers for {platform}: {form}")
    if args.json_out:
        report = {
            "backend": jax.default_backend(),
            "rows": rows,
            "lowering": lowering,
            "experts": x_n,
            "top_k": args.top_k,
            "hidden": e,
            "width": f,
        }
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
