"""Benchmark tensor-parallel serving: per-device KV memory and throughput for tp = 1, 2, 4...

Builds a random Llama-shaped model (or loads ``--model tiny|PATH``), and for each ``--tp``
value an :class:`paxcache.Engine` with the same number of KV blocks; warms it up (every
step shape compiled), then times ``engine.generate`` on a fixed batch of random prompts
(greedy, ``ignore_eos``). Reports per device: KV cache bytes, weight bytes; and output
tokens/s, total (prompt + output) tokens/s, mean step time.

On a CPU host the devices are simulated (``--xla_force_host_platform_device_count``, set
here when missing): they share the same cores and RAM, so expect *lower* throughput with
larger tp (the all-reduces are real copies and nothing runs in parallel); the memory numbers
are exact. On real chips the weights and KV per chip shrink by tp and decode, being
memory-bound, speeds up until the per-layer all-reduces dominate.

Prints a table and writes ``bench/results/tp_<platform>_<date>.json``.

    python scripts/bench_tp.py --tp 1 2 4
    python scripts/bench_tp.py --tp 2 --model tiny --num-prompts 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import pathlib
import re
import time
import zlib
from typing import Any

logger = logging.getLogger("bench_tp")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="tp degrees to run")
    ap.add_argument("--model", default="random", help="random | tiny | HF directory")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="default: batch fits")
    ap.add_argument("--reps", type=int, default=2, help="timed generate() runs (best kept)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    return ap.parse_args(argv)


def _simulate_devices(n: int) -> None:
    """On CPU, ask XLA for ``n`` host devices (must run before jax initializes)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _shard_bytes(x: Any) -> int:
    """Bytes of ``x`` held by its first device."""
    return int(x.addressable_shards[0].data.nbytes)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark for every ``args.tp``; returns the JSON-able result."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from paxcache import Engine, SamplingParams
    from paxcache.models import ByteTokenizer, LlamaConfig, LlamaForCausalLM, load_pretrained

    dtype = jnp.dtype(args.dtype)
    if args.model == "random":
        cfg = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=max(256, args.prompt_len + args.max_tokens),
        )
        model = LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        tokenizer = ByteTokenizer()
        name = "random"
    else:
        model, tokenizer = load_pretrained(args.model, dtype=dtype)
        cfg = model.config
        name = args.model
    vocab = min(cfg.vocab_size, 256)
    rng = np.random.default_rng(0)
    prompts = [
        list(map(int, rng.integers(0, vocab, args.prompt_len))) for _ in range(args.num_prompts)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    seq_len = args.prompt_len + args.max_tokens
    num_blocks = args.num_blocks or args.num_prompts * -(-seq_len // args.block_size) + 8

    rows = []
    for tp in args.tp:
        t0 = time.perf_counter()
        eng = Engine(
            model,
            tokenizer,
            model_name=name,
            num_blocks=num_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=seq_len,
            enable_prefix_caching=False,
            tp=tp,
        )
        eng.warmup()
        setup_s = time.perf_counter() - t0
        compiles_before = eng.stats()["num_compilations"]
        best = None
        tokens: list[list[int]] = []
        for rep in range(max(1, args.reps)):
            t0 = time.perf_counter()
            ids = [f"r{rep}-{i}" for i in range(len(prompts))]
            for rid, p in zip(ids, prompts, strict=True):
                eng.add_request(rid, p, params)
            final: dict[str, Any] = {}
            n_steps = 0
            while eng.has_unfinished_requests():
                n_steps += 1
                for o in eng.step():
                    if o.finished:
                        final[o.request_id] = o
            dt_s = time.perf_counter() - t0
            if best is None or dt_s < best[0]:
                best = (dt_s, n_steps)
            tokens = [final[i].outputs[0].token_ids for i in ids]
        elapsed, n_steps = best
        out_tokens = sum(len(t) for t in tokens)
        kv = eng._kv.device
        row = {
            "tp": tp,
            "kv_heads_in_cache": int(kv.num_kv_heads),
            "kv_bytes_per_device": _shard_bytes(kv.kv),
            "kv_bytes_total": int(kv.kv.nbytes),
            "weight_bytes_per_device": sum(_shard_bytes(x) for x in jax.tree.leaves(eng._params)),
            "num_blocks": num_blocks,
            "output_tokens": out_tokens,
            "seconds": elapsed,
            "steps": n_steps,
            "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (out_tokens + args.num_prompts * args.prompt_len) / elapsed,
            "mean_step_ms": 1e3 * elapsed / max(n_steps, 1),
            "setup_and_warmup_s": setup_s,
            "compilations_in_timed_runs": eng.stats()["num_compilations"] - compiles_before,
            "tokens_crc32": zlib.crc32(json.dumps(tokens).encode()),
        }
        rows.append(row)
        logger.info("tp=%d done: %.1f tok/s", tp, row["output_tokens_per_s"])
        del eng
    same = len({r["tokens_crc32"] for r in rows}) == 1
    return {
        "benchmark": "tp",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "simulated_devices": jax.default_backend() == "cpu",
        "model": name,
        "config": {
            "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size,
            "intermediate": cfg.intermediate_size,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "vocab": cfg.vocab_size,
            "dtype": str(dtype),
        },
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "block_size": args.block_size,
        },
        "same_tokens_across_tp": same,
        "rows": rows,
    }


def _table(result: dict[str, Any]) -> str:
    head = (
        f"{'tp':>3} {'Kc':>3} {'KV/dev MiB':>11} {'W/dev MiB':>10} {'out tok/s':>10} "
        f"{'all tok/s':>10} {'step ms':>8} {'steps':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(
            f"{r['tp']:>3} {r['kv_heads_in_cache']:>3} {r['kv_bytes_per_device'] / 2**20:>11.2f} "
            f"{r['weight_bytes_per_device'] / 2**20:>10.2f} {r['output_tokens_per_s']:>10.1f} "
            f"{r['total_tokens_per_s']:>10.1f} {r['mean_step_ms']:>8.1f} {r['steps']:>6}"
        )
    lines.append(f"same greedy tokens for every tp: {result['same_tokens_across_tp']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _simulate_devices(max(args.tp))
    result = run(args)
    import jax

    platform = re.sub(r"[^a-z0-9]+", "-", jax.default_backend().lower())
    now = dt.datetime.now(dt.timezone.utc)
    out = pathlib.Path(args.out or f"bench/results/tp_{platform}_{now.strftime('%Y%m%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(_table(result))  # noqa: T201 (a script's report)
    print(f"wrote {out}")  # noqa: T201
    return result


if __name__ == "__main__":
    main()
