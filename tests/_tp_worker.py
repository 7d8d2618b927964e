"""Tensor-parallel checks on 4 simulated CPU devices, run by ``tests/test_sharding.py`` in a
subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=4``) so the rest of the
suite keeps one device. Writes one JSON report; the tests assert on it.

Usage: ``python tests/_tp_worker.py OUT.json [fast|k4]`` (``k4``: a model with 4 kv heads,
run by the slow test), or ``python tests/_tp_worker.py OUT.json multihost PROCESS_ID PORT``:
one of two processes (2 CPU devices each) joined by ``jax.distributed`` into one tp=4 mesh
spanning both, as on a multi-host TPU slice.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import kernels_pallas as kpl  # noqa: E402
from kernels_pallas.kv_layout import merge_kv, split_kv  # noqa: E402
from paxcache import Engine, SamplingParams, multihost, sharding  # noqa: E402
from paxcache.attention import build_metadata, paged_attention_op  # noqa: E402
from paxcache.models import ByteTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

BS = 8
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def make_model(num_kv_heads: int, num_heads: int = 8) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=260,  # divisible by 2 and 4: the lm_head is split over the vocabulary
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=8,
        max_position_embeddings=64,
        eos_token_id=257,
    )
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    # 20 > the 16-token step budget: chunked prefill; 2 prompts share a 16-token prefix.
    ps = [list(map(int, rng.integers(0, 256, n))) for n in (3, 20, 9, 14)]
    ps.append(ps[1][:16] + [7, 8])
    return ps


def engine(model, tp: int, **kw) -> Engine:
    args = dict(num_blocks=32, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, tp=tp)
    args.update(kw)
    return Engine(model, ByteTokenizer(), **args)


def step_args(eng: Engine, t: int) -> tuple:
    return eng._empty_step_args(t)


def forbidden_shapes(eng: Engine) -> set[tuple[int, ...]]:
    """Shapes a gathered KV cache or weight would have: whole, per layer, per layer-slice."""
    shapes = set()
    x = eng._kv.device.kv
    shapes.add(tuple(x.shape))
    shapes.add(tuple(x.shape[1:]))
    for leaf in jax.tree.leaves(eng._params):
        if leaf.sharding.is_fully_replicated:
            continue
        shapes.add(tuple(leaf.shape))
        if leaf.ndim >= 2:
            shapes.add(tuple(leaf.shape[1:]))  # one layer of a stacked [L, ...] weight
    return shapes


def hlo_report(eng: Engine) -> dict:
    t = eng.buckets[0]
    text = eng._jit_step.lower(*step_args(eng, t)).compile().as_text()
    colls = sharding.collectives(text)
    bad = sorted({(op, s) for op, s in colls if op != "all-reduce" and s in forbidden_shapes(eng)})
    e = eng.model.config.hidden_size
    return {
        "ops": sorted({op for op, _ in colls}),
        "bad": [[op, list(s)] for op, s in bad],
        "all_gather_shapes": sorted({str(s) for op, s in colls if op == "all-gather"}),
        "hidden_all_reduces": sum(1 for op, s in colls if op == "all-reduce" and s == (t, e)),
    }


def specs_of(tree) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        out[name.removesuffix("/value")] = {
            "spec": str(leaf.sharding.spec) if isinstance(leaf.sharding, NamedSharding) else "",
            "shard_shape": list(leaf.addressable_shards[0].data.shape),
            "num_devices": len(leaf.sharding.device_set),
        }
    return out


def kv_heads_per_device(pages: jax.Array) -> int:
    """Kv heads in one device's shard of ``[L, N, S, C, P, Dp]`` pages (``C * P / 2``)."""
    shard = pages.addressable_shards[0].data.shape
    return shard[3] * shard[4] // 2


def engine_report(model, tp: int, ps, **kw) -> tuple[Engine, dict]:
    t0 = time.perf_counter()
    eng = engine(model, tp, **kw)
    outs = eng.generate(ps, GREEDY)
    kv, host = eng._kv.device, eng._kv.host
    rep = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "kv_spec": str(kv.kv.sharding.spec) if isinstance(kv.kv.sharding, NamedSharding) else "",
        "kv_shape": list(kv.kv.shape),
        "kv_shard_shape": list(kv.kv.addressable_shards[0].data.shape),
        "kv_heads": kv.num_kv_heads,
        "kv_heads_per_device": kv_heads_per_device(kv.kv),
        "kv_devices": len(kv.kv.sharding.device_set),
        "host_spec": str(host.kv.sharding.spec)
        if host is not None and isinstance(host.kv.sharding, NamedSharding)
        else "",
        "host_memory_kind": None if host is None else host.kv.sharding.memory_kind,
        "state_replicated": all(
            x.sharding.is_fully_replicated and len(x.sharding.device_set) == tp
            for x in jax.tree.leaves(eng.block_manager.state)
        ),
        "params": specs_of(eng._params),
        "stats": {k: eng.stats()[k] for k in ("num_free_blocks", "num_total_blocks")},
    }
    st = eng.stats()
    rep["stats"].update(num_preemptions=st["num_preemptions"], num_swaps=st["num_swaps"])
    if tp > 1:
        rep["hlo"] = hlo_report(eng)
    rep["seconds"] = time.perf_counter() - t0
    return eng, rep


def attention_op_report(tp: int, kv_heads: int) -> dict:
    """paged_attention_op with and without the mesh on the same random inputs."""
    rng = np.random.default_rng(1)
    h, d, n, s, layers = 8, 8, 12, 4, 2
    kc = sharding.cache_kv_heads(kv_heads, tp)
    tables = np.full((3, 6), -1, np.int32)
    tables[0, :3], tables[1, :2], tables[2, :4] = [4, 0, 7], [2, 9], [1, 3, 5, 11]
    kv_lens, q_lens = np.array([10, 5, 13]), np.array([3, 5, 1])
    md = build_metadata(jnp.asarray(tables), kv_lens, q_lens, 3, 12, s)
    q = jnp.asarray(rng.normal(size=(12, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(12, kv_heads, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(12, kv_heads, d)), jnp.float32)
    base = rng.normal(size=(layers, kv_heads, n, s, d)).astype(np.float32)
    rep = kc // kv_heads
    kp_full, vp_full = np.repeat(base, rep, axis=1), np.repeat(base * 2, rep, axis=1)
    mesh = sharding.make_mesh(tp)
    shd = sharding.kv_sharding(mesh)

    def cache(kp_, vp_) -> kpl.PagedKVCache:
        """Head-major ``[L, K, N, S, D]`` K and V as a cache (the token-major layout)."""
        ones = jnp.ones(layers, jnp.float32)
        kv = merge_kv(jnp.moveaxis(jnp.asarray(kp_), 1, 3), jnp.moveaxis(jnp.asarray(vp_), 1, 3))
        return kpl.PagedKVCache(kv=kv, k_scale=ones, v_scale=ones)

    def op(q, k, v, kv, layer, use_mesh: bool):
        return paged_attention_op(q, k, v, kv, md, layer=layer, mesh=mesh if use_mesh else None)

    run = jax.jit(op, static_argnames="use_mesh")
    layer = jnp.int32(1)
    ref_out, ref_kv = run(q, k, v, cache(jnp.asarray(base), jnp.asarray(base * 2)), layer, False)
    ref_k = jnp.repeat(split_kv(ref_kv.kv, kv_heads)[0], rep, axis=3)  # the replicated layout
    kv = cache(kp_full, vp_full)
    kv = kv.replace(kv=jax.device_put(kv.kv, shd))
    qs = jax.device_put(q, NamedSharding(mesh, P(None, "tp")))
    out, new_kv = run(qs, k, v, kv, layer, True)
    new_k = split_kv(new_kv.kv, kc)[0]
    return {
        "out_err": float(jnp.max(jnp.abs(out - ref_out))),
        "k_err": float(jnp.max(jnp.abs(new_k - ref_k))),
        "pages_still_sharded": new_kv.kv.sharding.spec == P(None, None, None, "tp"),
    }


def checker_control() -> dict:
    """The HLO check is not vacuous: a step that gathers the cache is caught."""
    mesh = sharding.make_mesh(4)
    x = jax.device_put(jnp.zeros((2, 4, 8, 4, 8)), sharding.kv_sharding(mesh))
    gathered = jax.jit(lambda a: a * 2, out_shardings=sharding.replicated(mesh))
    colls = sharding.collectives(gathered.lower(x).compile().as_text())
    return {"caught": any(op == "all-gather" and s == (2, 4, 8, 4, 8) for op, s in colls)}


def error_report(model_k2) -> dict:
    errs = {}
    cases = {
        "tp3_heads": (model_k2, 3),
        "tp8_devices": (model_k2, 8),
        "tp4_kv6": (make_model(6, num_heads=12), 4),
    }
    for name, (m, tp) in cases.items():
        try:
            engine(m, tp)
            errs[name] = None
        except ValueError as e:
            errs[name] = f"{type(e).__name__}: {e}"
    return errs


def main() -> None:
    out_path = sys.argv[1]
    suite = sys.argv[2] if len(sys.argv) > 2 else "fast"
    t0 = time.perf_counter()
    if suite == "multihost":
        pid, port = int(sys.argv[3]), int(sys.argv[4])
        multihost.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
    report: dict = {"num_devices": len(jax.devices())}
    ps = prompts()
    if suite == "fast":
        m2 = make_model(2)
        _, report["k2_tp1"] = engine_report(m2, 1, ps)
        # tp=2 under memory pressure with swap preemption (the host pool is sharded too).
        _, report["k2_tp2"] = engine_report(
            m2, 2, ps, num_blocks=8, watermark=0.0, preemption_mode="swap", num_host_blocks=16
        )
        _, report["k2_tp4"] = engine_report(m2, 4, ps)
        report["errors"] = error_report(m2)
        report["attn_tp2_k2"] = attention_op_report(2, 2)
        report["attn_tp4_k2"] = attention_op_report(4, 2)
        report["checker_control"] = checker_control()
    elif suite == "multihost":
        report["num_local_devices"] = len(jax.local_devices())
        eng = engine(make_model(2), 4)
        # As a multi-host server would: only process 0 has the requests; it sends them.
        ps = sharding.broadcast_from_leader(ps if jax.process_index() == 0 else None)
        outs = eng.generate(ps, GREEDY)
        report["tokens"] = [o.outputs[0].token_ids for o in outs]
        kv_devices = eng._kv.device.kv.sharding.device_set
        report["kv_spans_processes"] = len({d.process_index for d in kv_devices})
    elif suite == "k4":
        m4 = make_model(4)
        for tp in (1, 2, 4):
            _, report[f"k4_tp{tp}"] = engine_report(m4, tp, ps)
        report["attn_tp4_k4"] = attention_op_report(4, 4)
    else:
        raise SystemExit(f"unknown suite {suite!r}")
    report["seconds"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
