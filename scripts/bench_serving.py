#!/usr/bin/env python
"""Serving benchmark: paxcache's continuous-batching engine vs static batching, same KV memory.

One seeded offline workload (all requests arrive at t=0; varied prompt and output lengths;
optionally a shared prefix) runs through:

* ``paged``: :class:`paxcache.Engine` (continuous batching, paged KV, chunked prefill, prefix
  caching) with ``--num-blocks`` blocks of ``--block-size`` tokens;
* ``static``: the same model with a dense, padded per-request cache at the *same* KV memory:
  every request reserves ``max_len = max prompt + max output`` tokens, so
  ``num_blocks * block_size // max_len`` requests run per batch, and a batch runs until its
  longest request is done (static batching, as before paging). It uses the same compiled
  forward and attention kernels over contiguous per-request regions, so the comparison
  isolates the memory management and scheduling.

Reported: throughput (generated tok/s), time to first token and time per output token
(p50/p99), KV memory utilization (token slots holding a token / slots allocated, sampled
every step), prefix-cache hit rate, prefill tokens computed vs prompt tokens, preemptions,
compilations, and the share of a decode step spent on block allocation (the fused step
timed against the same step fed a precomputed block table).

Other modes: ``--url URL`` drives a running server over HTTP (``scripts/bench_http.py``);
``--tp N`` runs the tensor-parallel benchmark (``scripts/bench_tp.py``); ``--peer
transformers`` runs transformers' ``generate_batch`` and the engine with its defaults on the
same HF checkpoint and workload, in the same run, and prints the ratio
(``scripts/bench_peer.py``; needs the ``bench`` extra).

Usage:
  python scripts/bench_serving.py                       # tiny model, default workload
  python scripts/bench_serving.py --shared-prefix 192   # prefix-caching workload
  python scripts/bench_serving.py --url http://127.0.0.1:8000
  python scripts/bench_serving.py --peer transformers   # vs transformers, random HF Llama
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paxcache import Engine, SamplingParams  # noqa: E402
from paxcache import step as step_lib  # noqa: E402
from paxcache.attention import build_metadata  # noqa: E402
from paxcache.scheduler import StepPlan  # noqa: E402


def make_workload(args):
    rng = np.random.default_rng(args.seed)
    prefix = list(map(int, rng.integers(0, 256, args.shared_prefix)))
    reqs = []
    for _ in range(args.num_requests):
        p_len = int(rng.integers(args.min_prompt, args.max_prompt + 1))
        o_len = int(rng.integers(args.min_output, args.max_output + 1))
        prompt = prefix + list(map(int, rng.integers(0, 256, p_len)))
        reqs.append((prompt, o_len))
    return reqs


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


_slot_view = jax.jit(lambda st: (st.block_tables, st.seq_lens, st.active, st.swapped))


def kv_utilization(engine) -> float | None:
    """Token slots holding a token / slots of the blocks in use (referenced blocks only)."""
    st = engine.block_manager.state
    s = engine.block_size
    tables, lens, active, swapped = jax.device_get(_slot_view(st))
    live = active & ~swapped
    fill: dict[int, int] = {}
    for slot in np.nonzero(live)[0]:
        n = int(lens[slot])
        for c in range(-(-n // s)):
            b = int(tables[slot, c])
            if b >= 0:
                fill[b] = max(fill.get(b, 0), min(s, n - c * s))
    if not fill:
        return None
    return sum(fill.values()) / (len(fill) * s)


def run_paged(model, tok, reqs, args):
    eng = Engine(
        model,
        tok,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        num_host_blocks=args.host_blocks,
        preemption_mode="swap" if args.host_blocks else "recompute",
    )
    t0 = time.perf_counter()
    eng.warmup()
    warm_s = time.perf_counter() - t0
    kv_utilization(eng)  # compile the probe before the timed run
    compiles_after_warmup = eng.stats()["num_compilations"]
    logging.getLogger(__name__).warning("warm-up done; timed run starts")
    arrival = time.perf_counter()
    first, last_t, n_out = {}, {}, {}
    for i, (prompt, o_len) in enumerate(reqs):
        eng.add_request(str(i), prompt, SamplingParams(max_tokens=o_len, ignore_eos=True))
    utils = []
    steps = 0
    probe_s = 0.0  # time spent measuring utilization, excluded from the timings
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        now = time.perf_counter() - probe_s
        if steps % args.util_every == 0:
            t_probe = time.perf_counter()
            u = kv_utilization(eng)
            if u is not None:
                utils.append(u)
            probe_s += time.perf_counter() - t_probe
        for o in outs:
            c = o.outputs[0]
            if c.new_token_ids:
                first.setdefault(o.request_id, now)
                last_t[o.request_id] = now
                n_out[o.request_id] = len(c.token_ids)
    wall = time.perf_counter() - probe_s - arrival
    logging.getLogger(__name__).warning("timed run done")
    st = eng.stats()
    gen = sum(n_out.values())
    ttft = [first[k] - arrival for k in first]
    tpot = [(last_t[k] - first[k]) / (n_out[k] - 1) for k in first if n_out[k] > 1]
    res = {
        "wall_s": wall,
        "steps": steps,
        "generated_tokens": gen,
        "throughput_tok_s": gen / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "kv_utilization_mean": statistics.fmean(utils) if utils else None,
        "kv_utilization_min": min(utils) if utils else None,
        "prefix_cache_hit_rate": st["prefix_cache_hit_rate"],
        "prompt_tokens": st["num_prompt_tokens"],
        "prefill_tokens_computed": st["num_prefill_tokens_computed"],
        "prefill_computed_fraction": st["num_prefill_tokens_computed"]
        / max(1, st["num_prompt_tokens"]),
        "num_preemptions": st["num_preemptions"],
        "num_swaps": st["num_swaps"],
        "num_compilations": st["num_compilations"],
        "compilations_after_warmup": st["num_compilations"] - compiles_after_warmup,
        "warmup_s": warm_s,
        "leaked_blocks": st["num_total_blocks"] - st["num_free_blocks"],
    }
    res["alloc_share"] = allocation_share(eng, args)
    return res


def allocation_share(eng, args):
    """Times a full decode batch through the fused step vs the same step without allocator."""
    r = eng.max_num_seqs
    rng = np.random.default_rng(1)
    # Admit r sequences with random lengths, through the real allocator.
    s = eng.block_size
    lens = rng.integers(s, min(eng.max_model_len - 2, 8 * s), r)
    for i, n in enumerate(lens):
        eng.add_request(
            f"alloc{i}",
            list(map(int, rng.integers(0, 256, int(n)))),
            SamplingParams(max_tokens=10_000, ignore_eos=True),
        )
    while any(sq.remaining > 1 for sq in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    bm = eng.block_manager
    seqs = sorted(eng.scheduler.running, key=bm.slot)[:r]
    # One decode row per sequence (no samples), as the scheduler would plan it.
    plan = StepPlan(rows=[(sq, 1) for sq in seqs], slots=[bm.slot(sq) for sq in seqs])
    inputs, _ = step_lib.prepare_inputs(plan, eng._shapes)
    fused = eng._jit_step
    config = dataclasses.replace(eng._step_config, fuse_allocator=False)
    plain = jax.jit(functools.partial(step_lib.step, config=config), donate_argnums=(0, 1))

    def timeit(fn, state, kv):
        for _ in range(3):
            state, kv, out = fn(state, kv, eng._params, inputs)
        jax.block_until_ready(out.sampled.tokens)
        ts = []
        for _ in range(args.alloc_iters):
            t0 = time.perf_counter()
            state, kv, out = fn(state, kv, eng._params, inputs)
            jax.block_until_ready(out.sampled.tokens)
            ts.append(time.perf_counter() - t0)
        return state, kv, ts

    state, kv = bm.state, eng._device_kv()
    # Interleave the two so bursts of load on a shared machine hit both; compare the fastest
    # (least disturbed) runs, the most repeatable statistic on a noisy host.
    f_ts, p_ts = [], []
    for _ in range(5):
        state, kv, tf = timeit(fused, state, kv)
        state, kv, tp = timeit(plain, state, kv)
        f_ts += tf
        p_ts += tp
    bm.adopt(state)
    eng._kv = eng._with_host_pool(kv)
    tf, tp = float(np.min(f_ts)), float(np.min(p_ts))
    for i in range(len(lens)):
        eng.abort(f"alloc{i}")
    return {
        "batch": len(seqs),
        "fused_step_ms": tf * 1e3,
        "precomputed_table_step_ms": tp * 1e3,
        "share": max(0.0, (tf - tp) / tf),
    }


def run_static(model, reqs, args):
    """Static batching over a dense, padded per-request cache at the same KV memory."""
    max_len = max(len(p) + o for p, o in reqs)
    s = args.block_size
    m = -(-max_len // s)
    batch = max(1, (args.num_blocks * s) // (m * s))
    num_blocks = batch * m
    cfg = model.config
    kv_shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, num_blocks, s, cfg.head_dim)
    graphdef, params = nnx.split(model)
    tables = jnp.arange(num_blocks, dtype=jnp.int32).reshape(batch, m)  # contiguous regions

    @jax.jit
    def step(params, k, v, tokens, q_lens, kv_lens):
        md = build_metadata(tables, kv_lens, q_lens, batch, tokens.shape[0], s)
        mdl = nnx.merge(graphdef, params)
        last = md.cu_q_lens[1:] - 1
        logits, (k, v) = mdl.forward_paged(tokens, (k, v), md, logits_indices=jnp.maximum(last, 0))
        return k, v, jnp.argmax(logits, -1).astype(jnp.int32)

    k = jnp.zeros(kv_shape, model.dtype)
    v = jnp.zeros(kv_shape, model.dtype)
    # Warm up the two shapes (prefill of a padded batch, decode).
    max_prompt = max(len(p) for p, _ in reqs)
    pre_t = batch * max_prompt
    for t in (pre_t, batch):
        k, v, out = step(
            params,
            k,
            v,
            jnp.zeros(t, jnp.int32),
            jnp.zeros(batch, jnp.int32),
            jnp.zeros(batch, jnp.int32),
        )
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    gen = 0
    first, done_t = [], []
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        bsz = len(group)
        # Prefill: every prompt padded to the batch's longest (dense, padded).
        tokens = np.zeros(pre_t, np.int32)
        q_lens = np.zeros(batch, np.int32)
        kv_lens = np.zeros(batch, np.int32)
        off = 0
        for j, (p, _) in enumerate(group):
            tokens[off : off + len(p)] = p
            off += len(p)
            q_lens[j] = kv_lens[j] = len(p)
        k, v, nxt = step(params, k, v, tokens, q_lens, kv_lens)
        nxt = np.asarray(nxt)
        now = time.perf_counter()
        first.extend([now - t0] * bsz)
        steps = max(o for _, o in group)
        for d in range(1, steps):  # the batch runs until its longest request is done
            q_lens = np.array([1] * bsz + [0] * (batch - bsz), np.int32)
            kv_lens = kv_lens + q_lens
            k, v, nxt = step(params, k, v, nxt[:batch].astype(np.int32), q_lens, kv_lens)
            nxt = np.asarray(nxt)
            del d
        jax.block_until_ready(nxt)
        gen += sum(o for _, o in group)
        done_t.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    return {
        "batch_size": batch,
        "max_len": max_len,
        "wall_s": wall,
        "generated_tokens": gen,
        "throughput_tok_s": gen / wall,
        "ttft_p50_s": pct(first, 50),
        "ttft_p99_s": pct(first, 99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--url", default=None, help="benchmark a running server over HTTP")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel benchmark")
    ap.add_argument(
        "--peer",
        choices=["transformers"],
        default=None,
        help="compare with a peer engine (scripts/bench_peer.py; other flags pass through)",
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--min-output", type=int, default=8)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--shared-prefix", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=384)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--host-blocks", type=int, default=0)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--no-static", action="store_true", help="skip the static baseline")
    ap.add_argument("--util-every", type=int, default=1)
    ap.add_argument("--alloc-iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args, rest = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    if args.url:
        sys.exit(
            subprocess.call(
                [sys.executable, str(ROOT / "scripts/bench_http.py"), "--url", args.url, *rest]
            )
        )
    if args.peer:
        # The peer benchmark has its own workload flags; --model passes through when given.
        model = [] if args.model == "tiny" else ["--model", args.model]
        out = [] if args.out is None else ["--out", args.out]
        cmd = [sys.executable, str(ROOT / "scripts/bench_peer.py"), *model, *out, *rest]
        sys.exit(subprocess.call(cmd))
    if args.tp:
        sys.exit(
            subprocess.call(
                [sys.executable, str(ROOT / "scripts/bench_tp.py"), "--tp", str(args.tp), *rest]
            )
        )

    from paxcache.models import load_pretrained

    model, tok = load_pretrained(args.model, dtype=jnp.float32)
    reqs = make_workload(args)
    paged = run_paged(model, tok, reqs, args)
    static = None if args.no_static else run_static(model, reqs, args)

    dev = jax.devices()[0]
    rows = [
        ("throughput (tok/s)", paged["throughput_tok_s"], static and static["throughput_tok_s"]),
        (
            "TTFT p50 / p99 (s)",
            f"{paged['ttft_p50_s']:.3f} / {paged['ttft_p99_s']:.3f}",
            static and f"{static['ttft_p50_s']:.3f} / {static['ttft_p99_s']:.3f}",
        ),
        (
            "TPOT p50 / p99 (ms)",
            f"{paged['tpot_p50_s'] * 1e3:.2f} / {paged['tpot_p99_s'] * 1e3:.2f}",
            None,
        ),
        (
            "KV utilization mean / min",
            f"{paged['kv_utilization_mean']:.4f} / {paged['kv_utilization_min']:.4f}",
            None,
        ),
        ("prefix-cache hit rate", paged["prefix_cache_hit_rate"], None),
        (
            "prefill tokens computed / prompt",
            f"{paged['prefill_tokens_computed']} / {paged['prompt_tokens']}",
            None,
        ),
        ("preemptions / swaps", f"{paged['num_preemptions']} / {paged['num_swaps']}", None),
        (
            "compilations (after warm-up)",
            f"{paged['num_compilations']} ({paged['compilations_after_warmup']})",
            None,
        ),
        (
            "decode step fused / precomputed (ms)",
            f"{paged['alloc_share']['fused_step_ms']:.3f} / "
            f"{paged['alloc_share']['precomputed_table_step_ms']:.3f}",
            None,
        ),
        ("allocation share of a decode step", f"{paged['alloc_share']['share']:.2%}", None),
    ]
    print(
        f"\nserving benchmark: {args.model} on {dev.platform} ({dev.device_kind}), "
        f"{len(reqs)} requests, {args.num_blocks} blocks x {args.block_size}"
    )
    print(f"{'metric':40s} {'paged (paxcache)':>24s} {'static baseline':>20s}")
    for name, a, b in rows:
        fa = f"{a:.2f}" if isinstance(a, float) else str(a)
        fb = "" if b is None else (f"{b:.2f}" if isinstance(b, float) else str(b))
        print(f"{name:40s} {fa:>24s} {fb:>20s}")
    if static:
        ratio = paged["throughput_tok_s"] / static["throughput_tok_s"]
        print(
            f"{'throughput ratio paged / static':40s} {ratio:>24.2f}   "
            f"(static batch {static['batch_size']}, max_len {static['max_len']})"
        )
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{dev.platform}:{dev.device_kind}",
        "jax": jax.__version__,
        "args": vars(args),
        "paged": paged,
        "static": static,
        "throughput_ratio": (paged["throughput_tok_s"] / static["throughput_tok_s"])
        if static
        else None,
    }
    out = args.out or (
        ROOT
        / "bench/results"
        / (
            f"serving_{dev.platform}_{'prefix_' if args.shared_prefix else ''}"
            f"{dt.date.today():%Y%m%d}.json"
        )
    )
    os.makedirs(Path(out).parent, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
