"""Expert-parallel checks on 4 simulated CPU devices, run by ``tests/test_moe.py`` in a
subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=4``) so the rest of the suite
keeps one device. Writes one JSON report; the tests assert on it.

Usage: ``python tests/_ep_worker.py OUT.json [fast|full]`` (``fast``: one device against
``tp=2, ep=2``; ``full``: every layout of ``LAYOUTS``, run by the slow test).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from paxcache import Engine, SamplingParams, sharding  # noqa: E402
from paxcache.models import (  # noqa: E402
    ByteTokenizer,
    MoeConfig,
    MoeForCausalLM,
    load_model,
    load_pretrained,
)
from paxcache.models.moe import MoeLayers  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from hf_moe_reference import moe_config, random_moe_tensors  # noqa: E402
from hf_reference import write_checkpoint  # noqa: E402

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
# (tp, ep) layouts compared with one device.
LAYOUTS = {"fast": ((2, 2),), "full": ((1, 2), (2, 2), (1, 4), (2, 1))}


def make_model() -> MoeForCausalLM:
    """Qwen3-MoE-shaped: 4 experts, top-2, layer 1 dense; routing made decisive."""
    cfg = MoeConfig(
        vocab_size=260,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        qk_norm="head",
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=False,
        mlp_only_layers=(1,),
        eos_token_id=257,
    )
    model = MoeForCausalLM(cfg, rngs=nnx.Rngs(0))
    model.layers.router.set_value(model.layers.router[...] * 40.0)
    model.layers.expert_down.set_value(model.layers.expert_down[...] * 20.0)
    return model


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    ps = [list(map(int, rng.integers(0, 256, n))) for n in (3, 20)]
    ps.append(ps[1][:16] + [7, 8])  # a prefix hit
    return ps


def run(model: MoeForCausalLM, tp: int, ep: int) -> dict:
    t0 = time.perf_counter()
    eng = Engine(
        model,
        ByteTokenizer(),
        num_blocks=32,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=16,  # < 20: chunked prefill
        tp=tp,
        ep=ep,
        warmup=False,  # compile only the buckets the prompts use
    )
    outs = eng.generate(prompts(), GREEDY)
    rep: dict = {"tokens": [o.outputs[0].token_ids for o in outs]}
    layers = eng._params["layers"]
    for name in ("expert_gate", "expert_down", "router", "q_proj"):
        leaf = layers[name].get_value()
        rep[name] = {
            "spec": str(getattr(leaf.sharding, "spec", "")),
            "shard_shape": list(leaf.addressable_shards[0].data.shape),
        }
    rep["mesh"] = {k: int(v) for k, v in eng.mesh.shape.items()} if eng.mesh else {}
    rep["kv_shard_shape"] = list(eng._kv.device.kv.addressable_shards[0].data.shape)
    shard = rep["kv_shard_shape"]
    rep["kv_heads_per_device"] = shard[3] * shard[4] // 2  # [L, N, S, C, P, Dp]
    rep["prefix_hit_rate"] = eng.stats()["prefix_cache_hit_rate"]
    if eng.mesh is not None:
        t = eng.buckets[0]
        text = eng._jit_step.lower(*eng._empty_step_args(t)).compile().as_text()
        colls = sharding.collectives(text)
        whole = {tuple(layers[n].get_value().shape[1:]) for n in ("expert_gate", "expert_down")}
        rep["gathers_experts"] = any(s in whole for op, s in colls if op == "all-gather")
        rep["ops"] = sorted({op for op, _ in colls})
    rep["seconds"] = time.perf_counter() - t0
    return rep


# (HF config, expert layout) checkpoints loaded straight into tp=2, ep=2 shards.
CHECKPOINTS = {
    "mixtral_legacy": (moe_config("mixtral"), "legacy"),
    "qwen3_moe_dense_layer_fused": (
        moe_config("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1]),
        "fused",
    ),
}


def sharded_loads(tp: int = 2, ep: int = 2) -> dict:
    """Per checkpoint: whether ``load_pretrained(tp=, ep=)`` equals the one-device load, and
    each MLP parameter's spec and shard shape."""
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (cfg, layout) in CHECKPOINTS.items():
            path = write_checkpoint(Path(tmp) / name, cfg, random_moe_tensors(cfg, 3, layout))
            one = load_model(path)
            model, _ = load_pretrained(path, tp=tp, ep=ep)
            same = jax.tree.map(
                lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                nnx.state(one, nnx.Param),
                nnx.state(model, nnx.Param),
            )
            rep: dict = {"equal": all(jax.tree.leaves(same))}
            for n in MoeLayers.MLP_NAMES:
                leaf = getattr(model.layers, n)
                if leaf is not None:
                    arr = leaf.get_value()
                    rep[n] = {
                        "spec": list(map(str, arr.sharding.spec)),
                        "shard_shape": list(arr.addressable_shards[0].data.shape),
                        "devices": len(arr.sharding.device_set),
                    }
            out[name] = rep
    return out


def main() -> None:
    t0 = time.perf_counter()
    model = make_model()
    report: dict = {"num_devices": len(jax.devices()), "ref": run(model, 1, 1)}
    dense_ref = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray([prompts()[1]])))[0]
    suite = sys.argv[2] if len(sys.argv) > 2 else "fast"
    for tp, ep in LAYOUTS[suite]:
        report[f"tp{tp}_ep{ep}"] = run(model, tp, ep)
    report["loads"] = sharded_loads()
    report["dense_argmax"] = [int(i) for i in dense_ref.argmax(-1)]
    report["seconds"] = time.perf_counter() - t0
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
