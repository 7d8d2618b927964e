#!/usr/bin/env python
"""Where an engine step's time goes: each part of the fused step timed as its own jit.

Builds ``Engine.from_pretrained(--model)`` (default: the bundled tiny model; the numbers in
``bench/results/step_profile_*.md`` use the random Llama of ``scripts/bench_peer.py``), runs
``max_num_seqs`` random prompts (16..256 tokens) until every sequence decodes, then times at
that batch, at the decode bucket (T = rows) and at the largest prefill bucket:

* ``allocator``: the batched ``append`` (+ copy-on-write copies) and ``commit``;
* ``metadata``: attention metadata from the block tables;
* ``write_kv`` and ``attention``: one layer's KV write and ragged paged attention (x L);
* ``model_no_attn``: the model forward with attention replaced by a no-op (matmuls, norms,
  RoPE, LM head);
* ``sample``: greedy sampling with and without the top-``MAX_LOGPROBS`` log-probabilities;
* ``fused_step``: the engine's whole compiled step; ``engine_step``: ``Engine.step()`` wall
  time (device step + host scheduling and bookkeeping).

Each is the median of ``--iters`` calls after warm-up, blocking on the result.

    python scripts/profile_step.py --model /path/to/hf_llama
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernels_pallas as kp  # noqa: E402
from paxcache import Engine, SamplingParams, allocator  # noqa: E402
from paxcache.attention import metadata_from_state  # noqa: E402
from paxcache.sampling import MAX_LOGPROBS, sample  # noqa: E402


def bench(fn, *args, iters: int) -> float:
    """Median seconds of ``fn(*args)`` over ``iters`` calls (after 2 warm-up calls)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def fill_decode_batch(eng: Engine, seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = eng.model.config.vocab_size
    for i, n in enumerate(rng.integers(16, 257, eng.max_num_seqs)):
        ids = list(map(int, rng.integers(0, vocab, int(n))))
        eng.add_request(f"p{i}", ids, SamplingParams(max_tokens=100_000, ignore_eos=True))
    while eng.scheduler.waiting or any(
        s.num_computed < s.num_prompt for s in eng.scheduler.running
    ):
        eng.step()


def profile(eng: Engine, t: int, iters: int) -> dict[str, float]:
    """Times the step's parts with T = t rows (decode rows first, then one prefill row run)."""
    cfg = eng.model.config
    r, b = eng.max_num_seqs, eng.cache_config.max_seqs
    bm = eng.block_manager
    seqs = sorted(eng.scheduler.running, key=bm.slot)[:r]
    state, kv, params = bm.state, eng._kv, eng._params
    slot_ids = np.zeros(r, np.int32)
    q_lens = np.zeros(r, np.int32)
    kv_lens = np.zeros(r, np.int32)
    counts = np.zeros(b, np.int32)
    app = np.zeros((b, 1), np.int32)
    for i, sq in enumerate(seqs):
        slot_ids[i], q_lens[i], kv_lens[i] = bm.slot(sq), 1, sq.num_computed + 1
    # The last sequence feeds the remaining rows (a prefill-like chunk over its context).
    q_lens[len(seqs) - 1] = t - (len(seqs) - 1)
    kv_lens[len(seqs) - 1] = max(int(kv_lens[len(seqs) - 1]), int(q_lens[len(seqs) - 1]))
    n = np.int32(len(seqs))
    tokens = np.zeros(t, np.int32)
    out: dict[str, float] = {}

    append = jax.jit(lambda st, c, a: allocator.append(st, c, a, commit=False)[0])
    out["allocator_append_ms"] = bench(append, state, counts, app, iters=iters)
    commit = jax.jit(allocator.commit)
    computed = np.zeros(b, np.int32)
    computed[slot_ids[: len(seqs)]] = kv_lens[: len(seqs)]
    out["allocator_commit_ms"] = bench(commit, state, computed, iters=iters)
    meta = jax.jit(lambda st, s, q, k: metadata_from_state(st, s, q, n, t, k))
    md = meta(state, slot_ids, q_lens, kv_lens)
    out["metadata_ms"] = bench(meta, state, slot_ids, q_lens, kv_lens, iters=iters)

    h, kh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = jnp.ones((t, h, d), eng.model.dtype)
    knew = jnp.ones((t, kh, d), eng.model.dtype)
    layer = jnp.int32(cfg.num_hidden_layers - 1)

    @jax.jit
    def attention(q, cache, md, layer):
        return kp.ragged_paged_attention(
            q, cache, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs, layer=layer
        )

    out["attention_per_layer_ms"] = bench(attention, q, kv.device, md, layer, iters=iters)

    def write(cache, k, md, layer):
        return kp.write_kv(cache, k, k, md.slot_mapping, layer=layer)

    # Donated, as in the engine's step (in place); the cache threads through the calls.
    write = jax.jit(write, donate_argnums=0)
    pages = kv.device
    ts = []
    for _ in range(iters + 2):
        t0 = time.perf_counter()
        pages = jax.block_until_ready(write(pages, knew, md, layer))
        ts.append(time.perf_counter() - t0)
    eng._kv = kv.replace(device=pages)
    out["write_kv_per_layer_ms"] = statistics.median(ts[2:])

    graphdef = eng._step_config.graphdef

    class NoAttention:  # stands in for the model's PagedAttention layer
        def __call__(self, q, k, v, pages, md, layer=None):
            return q, pages

    @jax.jit
    def no_attn(params, tokens, md, rows):
        from flax import nnx

        model = nnx.merge(graphdef, params)
        object.__setattr__(model, "attention", NoAttention())
        small = (jnp.zeros((1,), q.dtype), jnp.zeros((1,), q.dtype))
        return model.forward_paged(tokens, small, md, logits_indices=rows)[0]

    rows = np.arange(r, dtype=np.int32) % t
    logits = no_attn(params, tokens, md, rows)
    out["model_no_attn_ms"] = bench(no_attn, params, tokens, md, rows, iters=iters)

    zf = jnp.zeros(r, jnp.float32)
    zi = jnp.zeros(r, jnp.int32)
    keys = jnp.zeros((r, 2), jnp.uint32)
    args = (logits, zf, zi, jnp.ones(r, jnp.float32), zf, keys)
    out["sample_ms"] = bench(lambda *a: sample(*a, num_logprobs=0), *args, iters=iters)
    out["sample_with_logprobs_ms"] = bench(
        lambda *a: sample(*a, num_logprobs=MAX_LOGPROBS), *args, iters=iters
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--engine-kwargs", default="{}", help="JSON dict of Engine arguments")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)

    eng = Engine.from_pretrained(args.model, **json.loads(args.engine_kwargs))
    eng.warmup()
    fill_decode_batch(eng, args.seed)
    step_s = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        eng.step()
        step_s.append(time.perf_counter() - t0)
    r = len(eng.scheduler.running)
    decode_t = next(x for x in eng.buckets if x >= r)
    res: dict[str, Any] = {
        "engine": {
            "max_num_seqs": eng.max_num_seqs,
            "max_num_batched_tokens": eng.max_num_batched_tokens,
            "num_blocks": eng.cache_config.num_blocks,
            "max_model_len": eng.max_model_len,
            "layers": eng.model.config.num_hidden_layers,
        },
        "engine_step_ms": statistics.median(step_s),
    }
    # The engine's fused step on the same decode batch, device time only.
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_peer import _time_engine_device_step

    res["fused_step_ms"] = statistics.median(_time_engine_device_step(eng, args.iters))
    for t in sorted({decode_t, eng.buckets[-1]}):
        res[f"T={t}"] = profile(eng, t, args.iters)
    for k, v in list(res.items()):
        if k.endswith("_ms"):
            res[k] = round(v * 1e3, 3)
        elif isinstance(v, dict) and k.startswith("T="):
            res[k] = {kk: round(vv * 1e3, 3) for kk, vv in v.items()}
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
