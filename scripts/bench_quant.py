"""Quality of quantized weights on the bundled tiny model: perplexity on held-out text and
greedy-token agreement with the unquantized (bfloat16) model.

Held-out text: ``bench/data/heldout_quant.txt`` (Python written for this benchmark; the tiny
model was trained on the standard library's own top-level ``*.py`` files, scripts/train_tiny.py).

For each of ``bf16``, ``int8``, ``int8-w8a8``, ``fp8`` (bfloat16 compute, weights as
named): the perplexity over the whole text (non-overlapping windows of ``--window`` bytes,
dense forward); and over ``--prompts`` prompts (``--prompt-len`` bytes cut from the text), the
bf16 model's greedy continuation of ``--new-tokens`` tokens, then the fraction of those
positions where the quantized model's argmax on the same context is the same token
(``agreement``, teacher-forced), and the fraction of prompts whose own greedy continuation
equals bf16's exactly (``exact_continuations``, free-running).

Usage:
    python scripts/bench_quant.py [--json bench/results/quant_tiny_YYYYMMDD.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxcache.models import load_pretrained
from paxcache.models import quantize as quant

HELDOUT = Path(__file__).resolve().parent.parent / "bench" / "data" / "heldout_quant.txt"
SCHEMES = ("bf16", *quant.QUANTIZATIONS)


def _forward(model):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))
    return lambda ids: fn(state, jnp.asarray(ids, jnp.int32))


def perplexity(forward, ids: np.ndarray, window: int) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of ``window`` tokens."""
    n = (len(ids) - 1) // window
    rows = np.stack([ids[i * window : i * window + window + 1] for i in range(n)])
    logits = forward(rows[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(rows[:, 1:, None]), axis=-1)
    return float(jnp.exp(jnp.mean(nll)))


def greedy(forward, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """Batched greedy continuation (dense, fixed length): [P, T] -> [P, T + new_tokens]."""
    seqs = np.concatenate([prompts, np.zeros((len(prompts), new_tokens), np.int32)], axis=1)
    t = prompts.shape[1]
    for k in range(new_tokens):
        logits = forward(seqs)
        seqs[:, t + k] = np.asarray(jnp.argmax(logits[:, t + k - 1], axis=-1))
    return seqs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=256, help="perplexity window (tokens)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)

    models = {}
    for scheme in SCHEMES:
        q = None if scheme == "bf16" else scheme
        models[scheme], tok = load_pretrained("tiny", dtype=jnp.bfloat16, quantization=q)
    ids = np.asarray(tok.encode(HELDOUT.read_text()), np.int32)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(ids) - args.prompt_len, args.prompts)
    prompts = np.stack([ids[s : s + args.prompt_len] for s in starts])
    t = args.prompt_len

    rows = {}
    ref = None
    for scheme, model in models.items():
        t0 = time.perf_counter()
        fwd = _forward(model)
        ppl = perplexity(fwd, ids, args.window)
        own = greedy(fwd, prompts, args.new_tokens)
        if ref is None:
            ref = own
        forced = np.asarray(jnp.argmax(fwd(ref[:, :-1])[:, t - 1 :], axis=-1))
        qbytes, bf16_bytes = quant.quantized_bytes(model) if scheme != "bf16" else (0, 0)
        rows[scheme] = {
            "perplexity": ppl,
            "agreement": float(np.mean(forced == ref[:, t:])),
            "exact_continuations": float(np.mean(np.all(own[:, t:] == ref[:, t:], axis=1))),
            "layer_bytes_vs_bf16": qbytes / bf16_bytes if bf16_bytes else 1.0,
            "seconds": time.perf_counter() - t0,
        }
    base = rows["bf16"]["perplexity"]
    for row in rows.values():
        row["ppl_vs_bf16"] = row["perplexity"] / base - 1.0

    print(f"{'weights':<10} {'ppl':>8} {'vs bf16':>8} {'agree':>7} {'exact':>7} {'bytes':>6}")
    for scheme, r in rows.items():
        print(
            f"{scheme:<10} {r['perplexity']:8.4f} {100 * r['ppl_vs_bf16']:+7.2f}% "
            f"{100 * r['agreement']:6.1f}% {100 * r['exact_continuations']:6.1f}% "
            f"{r['layer_bytes_vs_bf16']:6.3f}"
        )
    if args.json is not None:
        out = {
            "date": datetime.date.today().isoformat(),
            "model": "tiny (bundled)",
            "heldout": str(HELDOUT.relative_to(HELDOUT.parent.parent.parent)),
            "heldout_tokens": len(ids),
            "compute_dtype": "bfloat16",
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "python": platform.python_version(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "ppl_note": f"{math.ceil((len(ids) - 1) / args.window)} windows of {args.window}",
            "results": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
