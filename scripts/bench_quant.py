"""Quality of quantized weights on the bundled tiny model: perplexity on held-out text and
greedy-token agreement with the unquantized (bfloat16) model.

Held-out text: ``bench/data/heldout_quant.txt`` (Python written for this benchmark; the tiny
model was trained on the standard library's own top-level ``*.py`` files, scripts/train_tiny.py).

For each of ``bf16``, ``int8``, ``int8-w8a8``, ``fp8`` (bfloat16 compute, weights as
named; dense forward) and ``kv-bf16``, ``kv-int8``, ``kv-fp8`` (bf16 weights; the paged
forward writes every token's K/V into a bf16 / int8 / e4m3 cache, 8-bit with the per-layer
scales the engine calibrates, ``paxcache.kv_quant``, and attends over the dequantized pages;
``kv-bf16`` separates the paged path's own rounding from the 8-bit cache's): the perplexity
over the whole text (non-overlapping windows of ``--window`` tokens); and over ``--prompts``
prompts (``--prompt-len`` tokens cut from the text), the bf16 model's greedy continuation of
``--new-tokens`` tokens, then the fraction of those positions where the other model's argmax
on the same context is the same token (``agreement``, teacher-forced), and the fraction of
prompts whose own greedy continuation equals bf16's exactly (``exact_continuations``,
free-running).

Usage:
    python scripts/bench_quant.py [--json bench/results/quant_tiny_YYYYMMDD.json]
        [--schemes bf16,kv-int8]
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

import kernels_pallas as kp
from paxcache import kv_quant
from paxcache.attention import build_metadata
from paxcache.models import load_pretrained
from paxcache.models import quantize as quant

HELDOUT = Path(__file__).resolve().parent.parent / "bench" / "data" / "heldout_quant.txt"
KV_SCHEMES = {"kv-bf16": "auto", "kv-int8": "int8", "kv-fp8": "fp8"}  # bf16 weights
SCHEMES = ("bf16", *quant.QUANTIZATIONS, *KV_SCHEMES)
BLOCK = 16  # KV block size of the paged forward


def _forward(model):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))
    return lambda ids: fn(state, jnp.asarray(ids, jnp.int32))


def _paged_forward(model, kv_dtype, scales):
    """``ids [B, T] -> logits [B, T, V]`` through the paged path: every row one sequence,
    prefilled into a fresh cache of ``kv_dtype`` (8-bit: with ``scales``), attention over it."""
    graphdef, state = nnx.split(model)
    cfg = model.config

    @jax.jit
    def fn(st, cache, ids):
        b, t = ids.shape
        m = -(-t // BLOCK)
        tables = jnp.arange(b * m, dtype=jnp.int32).reshape(b, m)
        lens = jnp.full((b,), t, jnp.int32)
        md = build_metadata(tables, lens, lens, b, b * t, BLOCK)
        logits, _ = nnx.merge(graphdef, st).forward_paged(ids.reshape(-1), cache, md)
        return logits.reshape(b, t, -1)

    def forward(ids):
        ids = jnp.asarray(ids, jnp.int32)
        b, t = ids.shape
        cache = kp.init_kv_cache(
            cfg.num_hidden_layers,
            b * -(-t // BLOCK),
            BLOCK,
            cfg.num_key_value_heads,
            cfg.head_dim,
            kv_dtype,
            **scales,
        )
        return fn(state, cache, ids)

    return forward


def _kv_scales(model, tok, kv_dtype):
    """The per-layer scales :class:`paxcache.Engine` calibrates for this model and cache."""
    cfg = model.config

    def make_cache(num_blocks, block_size):
        dims = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads)
        return kp.init_kv_cache(*dims, cfg.head_dim, model.dtype)

    graphdef, state = nnx.split(model)
    ids = kv_quant.calibration_ids(tok, cfg.max_position_embeddings)
    return kv_quant.calibrate_scales(graphdef, state, ids, make_cache, kv_dtype, block_size=BLOCK)


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
    p.add_argument(
        "--schemes",
        default=",".join(SCHEMES),
        help=f"comma-separated subset of {','.join(SCHEMES)} (bf16 always runs: the reference)",
    )
    args = p.parse_args(argv)
    schemes = ["bf16", *(s for s in args.schemes.split(",") if s and s != "bf16")]
    unknown = sorted(set(schemes) - set(SCHEMES))
    if unknown:
        p.error(f"unknown scheme(s) {unknown}; choose from {list(SCHEMES)}")

    models, forwards, kv_info = {}, {}, {}
    for scheme in schemes:
        q = None if scheme in ("bf16", *KV_SCHEMES) else scheme
        models[scheme], tok = load_pretrained("tiny", dtype=jnp.bfloat16, quantization=q)
        if scheme in KV_SCHEMES:
            kv_dtype = kv_quant.resolve_kv_dtype(KV_SCHEMES[scheme], jnp.bfloat16)
            scales = _kv_scales(models[scheme], tok, kv_dtype) if kv_dtype.itemsize == 1 else {}
            forwards[scheme] = _paged_forward(models[scheme], kv_dtype, scales)
            kv_info[scheme] = {
                "kv_cache_dtype": kv_dtype.name,
                "scales": kv_quant.scale_stats(scales),
            }
    ids = np.asarray(tok.encode(HELDOUT.read_text()), np.int32)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(ids) - args.prompt_len, args.prompts)
    prompts = np.stack([ids[s : s + args.prompt_len] for s in starts])
    t = args.prompt_len

    rows = {}
    ref = None
    for scheme, model in models.items():
        t0 = time.perf_counter()
        fwd = forwards.get(scheme) or _forward(model)
        ppl = perplexity(fwd, ids, args.window)
        own = greedy(fwd, prompts, args.new_tokens)
        if ref is None:
            ref = own
        forced = np.asarray(jnp.argmax(fwd(ref[:, :-1])[:, t - 1 :], axis=-1))
        quantized = scheme in quant.QUANTIZATIONS
        qbytes, bf16_bytes = quant.quantized_bytes(model) if quantized else (0, 0)
        rows[scheme] = {
            "perplexity": ppl,
            "agreement": float(np.mean(forced == ref[:, t:])),
            "exact_continuations": float(np.mean(np.all(own[:, t:] == ref[:, t:], axis=1))),
            "layer_bytes_vs_bf16": qbytes / bf16_bytes if bf16_bytes else 1.0,
            "seconds": time.perf_counter() - t0,
            **({"kv": kv_info[scheme]} if scheme in kv_info else {}),
        }
    base = rows["bf16"]["perplexity"]
    for row in rows.values():
        row["ppl_vs_bf16"] = row["perplexity"] / base - 1.0

    print(f"{'scheme':<10} {'ppl':>8} {'vs bf16':>8} {'agree':>7} {'exact':>7} {'bytes':>6}")
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
