#!/usr/bin/env python
"""paxcache's engine against transformers' continuous batching, same checkpoint, same run.

The workload (defaults): a random HF Llama (4 layers, hidden 512, 8 query / 2 kv heads,
head_dim 64, intermediate 1376, vocab 2048, float32) saved as an HF checkpoint directory;
64 requests with prompts of 16..256 random tokens; 64 greedy new tokens each, EOS ignored.

Runs, alternating, ``--repeats`` times each:

* ``transformers``: ``model.generate_batch`` (continuous batching over a paged cache, its
  defaults), after one untimed warm-up call;
* ``paxcache``: ``Engine.from_pretrained(path)`` with its *defaults*; the first
  ``generate`` (cold: includes any compilation) is reported apart, then the warm calls.

Reported: generated tok/s of each, the ratio paxcache / transformers (median, min, max over
the repeats), how many of the requests' outputs are identical, and a decode-step comparison:
the engine's fused decode step at a full batch (``max_num_seqs`` rows) against the same
model's decode step over a dense, unpaged ``[L, B, K, max_len, D]`` cache (no allocator, no
block tables) at the same batch and lengths.

Needs the ``bench`` extra (``pip install -e '.[bench]'``: torch, transformers). Writes
``bench/results/peer_transformers_<platform>_<date>.json``.

    python scripts/bench_serving.py --peer transformers
    python scripts/bench_peer.py --repeats 3 --model /path/to/hf_llama
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

logger = logging.getLogger("bench_peer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", default="transformers", choices=["transformers"])
    ap.add_argument(
        "--model", default=None, help="HF Llama directory (default: a random one, made here)"
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each, alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-iters", type=int, default=20, help="timed decode steps per variant")
    ap.add_argument("--no-step", action="store_true", help="skip the decode-step comparison")
    ap.add_argument(
        "--engine-kwargs",
        default="{}",
        help="JSON dict of Engine keyword arguments (default: none, the engine's defaults)",
    )
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------ checkpoint


def make_random_llama(path: Path, args: argparse.Namespace) -> None:
    """A random HF Llama checkpoint (transformers' own init, seeded) in ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    LlamaForCausalLM(cfg).save_pretrained(path)


def make_workload(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.num_requests)
    return [list(map(int, rng.integers(0, vocab, int(n)))) for n in lens]


# ------------------------------------------------------------------------------ runners


class TransformersRunner:
    """transformers' ``generate_batch`` (continuous batching, paged cache), greedy."""

    def __init__(self, path: Path, max_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.gen_cfg = GenerationConfig(
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=-1,  # ignore EOS: exactly max_tokens each
            pad_token_id=0,
        )

    def generate(self, prompts: list[list[int]], warmup: bool = False) -> list[list[int]]:
        # warmup=True runs dummy batches at the largest shapes first (CUDA graph capture on
        # a GPU; on CPU it only costs time): done once, untimed, then off for timed calls.
        with self.torch.inference_mode():
            out = self.model.generate_batch(
                inputs=prompts, generation_config=self.gen_cfg, warmup=warmup
            )
        # Request ids are "req_<i>" in input order; sort by the index to be safe.
        items = sorted(out.items(), key=lambda kv: int(str(kv[0]).rsplit("_", 1)[-1]))
        return [list(map(int, o.generated_tokens)) for _, o in items]


class PaxcacheRunner:
    """``Engine.from_pretrained(path)`` with its defaults (or ``--engine-kwargs``)."""

    def __init__(self, path: Path, max_tokens: int, engine_kwargs: dict[str, Any]) -> None:
        from paxcache import Engine, SamplingParams

        t0 = time.perf_counter()
        self.engine = Engine.from_pretrained(str(path), **engine_kwargs)
        self.construct_s = time.perf_counter() - t0
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        outs = self.engine.generate(prompts, self.params)
        return [list(o.outputs[0].token_ids) for o in outs]


def timed(fn, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = fn(prompts)
    return time.perf_counter() - t0, out


# ------------------------------------------------------------------------------ decode step


def decode_step_comparison(engine: Any, iters: int, seed: int) -> dict[str, Any]:
    """The engine's fused decode step vs a dense-cache decode step, same model and batch.

    Both run ``R = max_num_seqs`` decode rows at the same lengths (random, in 16..256). The
    paged step is the engine's compiled step (allocator append, metadata, paged attention,
    sampling, commit); the dense one keeps K/V in a contiguous ``[L, R, K, max_len, D]``
    array, writes the new token at its position and attends over a length mask, then takes
    the argmax: the least a decode step can do for this model.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from paxcache import SamplingParams

    rng = np.random.default_rng(seed)
    r = engine.max_num_seqs
    lens = rng.integers(16, 257, r)
    vocab = engine.model.config.vocab_size
    for i, n in enumerate(lens):
        engine.add_request(
            f"step{i}",
            list(map(int, rng.integers(0, vocab, int(n)))),
            SamplingParams(max_tokens=100_000, ignore_eos=True),
        )
    # Run until every sequence is decoding (prompts done).
    while engine.scheduler.waiting or any(
        s.num_computed < s.num_prompt for s in engine.scheduler.running
    ):
        engine.step()
    step_s = []
    for _ in range(iters):  # whole engine.step(): device step + host scheduling/bookkeeping
        t0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
    kv_lens = np.array([s.num_computed for s in engine.scheduler.running], np.int32)

    # Device-only time of the engine's compiled step at this batch: block until ready on
    # the outputs of each call (inputs built as the engine builds them).
    device_s = _time_engine_device_step(engine, iters)
    for i in range(r):
        engine.abort(f"step{i}")

    # Dense baseline.
    model = engine.model
    cfg = model.config
    graphdef, params = nnx.split(model)
    max_len = int(kv_lens.max()) + iters + 8
    shape = (cfg.num_hidden_layers, r, cfg.num_key_value_heads, max_len, cfg.head_dim)

    @jax.jit
    def dense_step(params, k_cache, v_cache, tokens, lengths):
        mdl = nnx.merge(graphdef, params)
        return _dense_decode(mdl, k_cache, v_cache, tokens, lengths)

    dense_step = jax.jit(dense_step, donate_argnums=(1, 2))
    k_cache = jnp.zeros(shape, model.dtype)
    v_cache = jnp.zeros(shape, model.dtype)
    tokens = jnp.zeros(r, jnp.int32)
    lengths = jnp.asarray(kv_lens)
    for _ in range(3):
        k_cache, v_cache, tokens = dense_step(params, k_cache, v_cache, tokens, lengths)
    tokens.block_until_ready()
    dense_s = []
    for _ in range(iters):
        t0 = time.perf_counter()
        k_cache, v_cache, tokens = dense_step(params, k_cache, v_cache, tokens, lengths)
        tokens.block_until_ready()
        dense_s.append(time.perf_counter() - t0)
    res = {
        "batch": r,
        "mean_kv_len": float(kv_lens.mean()),
        "engine_step_ms_p50": 1e3 * statistics.median(step_s),
        "engine_device_step_ms_p50": 1e3 * statistics.median(device_s),
        "dense_step_ms_p50": 1e3 * statistics.median(dense_s),
    }
    res["device_step_over_dense"] = res["engine_device_step_ms_p50"] / res["dense_step_ms_p50"]
    res["engine_step_over_dense"] = res["engine_step_ms_p50"] / res["dense_step_ms_p50"]
    return res


def _dense_decode(model, k_cache, v_cache, tokens, lengths):
    """One decode token per row over a dense cache. k_cache: [L, R, K, Lmax, D]."""
    import jax
    import jax.numpy as jnp

    from paxcache.models.llama import rms_norm, rope_cos_sin

    cfg = model.config
    pos = lengths  # the new token's position
    cos, sin = rope_cos_sin(cfg, pos[:, None])  # [R, 1, D]
    x = model.embed(tokens[:, None])  # [R, 1, E]
    kmax = k_cache.shape[3]
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    valid = jnp.arange(kmax)[None, :] <= pos[:, None]  # [R, Lmax]
    rows = jnp.arange(tokens.shape[0])

    def body(carry, xs):
        x, kc, vc = carry
        lp, idx = xs
        q, k, v = model._qkv(lp, x, cos, sin)  # q [R, 1, H, D], k/v [R, 1, K, D]
        kl = kc[idx].at[rows, :, pos].set(k[:, 0])  # [R, K, Lmax, D]
        vl = vc[idx].at[rows, :, pos].set(v[:, 0])
        kc = kc.at[idx].set(kl)
        vc = vc.at[idx].set(vl)
        qg = q[:, 0].reshape(q.shape[0], cfg.num_key_value_heads, g, cfg.head_dim)
        s = jnp.einsum("rkgd,rktd->rkgt", qg, kl) * cfg.head_dim**-0.5
        s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("rkgt,rktd->rkgd", p, vl).reshape(q.shape[0], 1, -1, cfg.head_dim)
        return (model._finish_layer(lp, x, o), kc, vc), None

    (x, k_cache, v_cache), _ = jax.lax.scan(
        body,
        (x, k_cache, v_cache),
        (model.layers.stacked(), jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)),
    )
    h = rms_norm(x[:, 0], model.norm[...], cfg.rms_norm_eps)
    nxt = jnp.argmax(model.compute_logits(h), axis=-1).astype(jnp.int32)
    return k_cache, v_cache, nxt


def _time_engine_device_step(engine: Any, iters: int) -> list[float]:
    """Times the engine's compiled step on its running (all-decode) batch, device only.

    The inputs are those the engine builds (``paxcache.step.prepare_inputs``) for a decode of
    every running sequence (one new token each, appended by the fused allocator, each
    sampling); the same inputs run ``iters`` times (the allocator appends a slot each time;
    the sequences are aborted afterwards).
    """
    from paxcache import step as step_lib
    from paxcache.scheduler import StepPlan

    bm = engine.block_manager
    seqs = list(engine.scheduler.running)[: engine.max_num_seqs]
    plan = StepPlan(
        rows=[(sq, 1) for sq in seqs],
        slots=[bm.slot(sq) for sq in seqs],
        samples=[(sq, i) for i, sq in enumerate(seqs)],
    )
    inputs, _ = step_lib.prepare_inputs(plan, engine._shapes)
    inputs = engine._place_inputs(inputs)  # on the device, as the engine's own calls
    state, kv = bm.state, engine._device_kv()
    ts = []
    for _ in range(iters + 2):
        t0 = time.perf_counter()
        state, kv, out = engine._jit_step(state, kv, engine._params, inputs)
        out.sampled.tokens.block_until_ready()
        ts.append(time.perf_counter() - t0)
    bm.adopt(state)
    engine._kv = engine._with_host_pool(kv)
    return ts[2:]


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("jax", "absl", "httpx", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    engine_kwargs = json.loads(args.engine_kwargs)

    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="paxcache_peer_")
        path = Path(tmp.name)
        make_random_llama(path, args)
        logger.info("random Llama checkpoint in %s", path)
    else:
        path = Path(args.model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    # One workload per run (the first for the cold call), so no run hits the prefix cache of
    # an earlier one; each timed repeat gives both engines the same prompts.
    workloads = [make_workload(args, vocab, args.seed + i) for i in range(args.repeats + 1)]
    prompts = workloads[0]
    n_gen = args.num_requests * args.max_tokens
    logger.info(
        "%d requests, prompts %d..%d tokens (%d total), %d new tokens each",
        len(prompts),
        min(map(len, prompts)),
        max(map(len, prompts)),
        sum(map(len, prompts)),
        args.max_tokens,
    )

    hf = TransformersRunner(path, args.max_tokens)
    t_hf_warm, _ = timed(lambda p: hf.generate(p, warmup=True), prompts[:8])
    logger.info("transformers warm-up call: %.1fs", t_hf_warm)

    pax = PaxcacheRunner(path, args.max_tokens, engine_kwargs)
    logger.info("paxcache Engine constructed in %.1fs", pax.construct_s)
    t_cold, pax_out = timed(pax.generate, prompts)
    compiles_after_first = pax.engine.stats()["num_compilations"]
    logger.info("paxcache first generate (cold): %.2fs, %.0f tok/s", t_cold, n_gen / t_cold)

    hf_s, pax_s, same, first_diff = [], [], [], []
    for i in range(args.repeats):
        work = workloads[i + 1]
        t, hf_out = timed(hf.generate, work)
        hf_s.append(t)
        logger.info("[%d] transformers: %.2fs, %.0f tok/s", i, t, n_gen / t)
        t, pax_out = timed(pax.generate, work)
        pax_s.append(t)
        logger.info("[%d] paxcache:     %.2fs, %.0f tok/s", i, t, n_gen / t)
        same.append(sum(a == b for a, b in zip(hf_out, pax_out, strict=True)))
        first_diff.append(
            [
                next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
                for a, b in zip(hf_out, pax_out, strict=True)
                if a != b
            ]
        )
    compiles_in_warm = pax.engine.stats()["num_compilations"] - compiles_after_first
    ratios = [h / p for h, p in zip(hf_s, pax_s, strict=True)]

    step = None
    if not args.no_step:
        step = decode_step_comparison(pax.engine, args.step_iters, args.seed + 1)

    import jax
    import torch
    import transformers

    dev = jax.devices()[0]
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{dev.platform}:{dev.device_kind}",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "versions": {
            "jax": jax.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "args": vars(args),
        "engine": {
            "max_num_seqs": pax.engine.max_num_seqs,
            "max_num_batched_tokens": pax.engine.max_num_batched_tokens,
            "num_blocks": pax.engine.cache_config.num_blocks,
            "buckets": list(pax.engine.buckets),
            "construct_s": pax.construct_s,
        },
        "generated_tokens": n_gen,
        "transformers_warmup_call_s": t_hf_warm,
        "transformers_s": hf_s,
        "paxcache_s": pax_s,
        "paxcache_cold_s": t_cold,
        "transformers_tok_s": [n_gen / t for t in hf_s],
        "paxcache_tok_s": [n_gen / t for t in pax_s],
        "paxcache_cold_tok_s": n_gen / t_cold,
        "ratio": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "all": ratios,
        },
        "cold_ratio": statistics.median(hf_s) / t_cold,
        "compilations_in_warm_runs": compiles_in_warm,
        "identical_outputs": same,
        "num_requests": len(prompts),
        "first_divergence_index": first_diff,
        "decode_step": step,
    }
    print(
        f"\npeer benchmark on {dev.platform} ({os.cpu_count()} cpus): {len(prompts)} requests, "
        f"{args.max_tokens} new tokens each"
    )
    print(
        f"  transformers {transformers.__version__} generate_batch: "
        + ", ".join(f"{n_gen / t:.0f}" for t in hf_s)
        + " tok/s"
    )
    print(
        f"  paxcache (Engine defaults: max_num_seqs {pax.engine.max_num_seqs}, "
        f"max_num_batched_tokens {pax.engine.max_num_batched_tokens}): "
        + ", ".join(f"{n_gen / t:.0f}" for t in pax_s)
        + f" tok/s warm; first call {n_gen / t_cold:.0f} tok/s"
    )
    print(
        f"  ratio paxcache / transformers: {statistics.median(ratios):.2f}x "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}); identical outputs "
        f"{'/'.join(map(str, same))} of {len(prompts)} per run;"
        f" compilations in warm runs {compiles_in_warm}"
    )
    if step:
        print(
            f"  decode step at batch {step['batch']}: engine device step "
            f"{step['engine_device_step_ms_p50']:.1f} ms, whole engine.step() "
            f"{step['engine_step_ms_p50']:.1f} ms, dense-cache step "
            f"{step['dense_step_ms_p50']:.1f} ms (device {step['device_step_over_dense']:.2f}x"
            f" dense)"
        )
    out = args.out or (
        ROOT / "bench/results" / f"peer_transformers_{dev.platform}_{dt.date.today():%Y%m%d}.json"
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
