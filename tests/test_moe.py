"""Mixtral and Qwen3-MoE: logits equal a float64 numpy port of HF's MoE code (checked once
against transformers 5.24, see tests/hf_moe_reference.py) in both HF expert layouts; routing
ties go to the lower expert; the grouped matmul equals a per-expert loop and its expert-
parallel shards sum to it; the engine's paged greedy tokens equal the dense path's through
chunked prefill and prefix hits; ``tp``/``ep`` on 4 simulated devices give the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_moe_reference import moe_config, moe_forward_np, random_moe_tensors
from hf_reference import write_checkpoint
from tiny_models import forward
from workers import run_worker

from paxcache import Engine, SamplingParams
from paxcache.errors import CheckpointError
from paxcache.models import (
    ByteTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MoeConfig,
    MoeForCausalLM,
    UnsupportedModelError,
    greedy_generate,
    load_model,
    save_pretrained,
)
from paxcache.models.moe import expert_mlp, route

IDS = [3, 17, 5, 9, 22, 41, 8, 1, 60, 33, 12, 7]
FIXTURES = Path(__file__).with_name("fixtures")
WORKER = Path(__file__).with_name("_ep_worker.py")

VARIANTS = {
    "mixtral": moe_config("mixtral"),
    "mixtral_window_3": moe_config("mixtral", sliding_window=3),
    # A dense layer between sparse ones, unnormalized top-k.
    "qwen3_moe_mlp_only_layer": moe_config(
        "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False
    ),
    # Every second layer sparse (layer 1 only), window on every layer.
    "qwen3_moe_sparse_step_2_window": moe_config(
        "qwen3_moe", decoder_sparse_step=2, use_sliding_window=True, sliding_window=4
    ),
}


def _logits(model, ids) -> np.ndarray:
    return np.asarray(forward(model, jnp.asarray([ids])))[0]


@pytest.mark.parametrize(
    ("variant", "layout"),
    [(v, "legacy") for v in sorted(VARIANTS) if v != "mixtral"]
    + [("mixtral", "fused"), ("qwen3_moe_mlp_only_layer", "fused")],
)
def test_logits_match_numpy_hf_reference(tmp_path: Path, variant: str, layout: str) -> None:
    cfg = VARIANTS[variant]
    tensors = random_moe_tensors(cfg, seed=1, layout=layout)
    model = load_model(write_checkpoint(tmp_path / "c", cfg, tensors))
    assert isinstance(model, MoeForCausalLM)
    np.testing.assert_allclose(_logits(model, IDS), moe_forward_np(cfg, tensors, IDS), atol=2e-3)


def test_config_reads_num_experts_and_num_local_experts_and_hf_defaults() -> None:
    hub = moe_config("qwen3_moe")
    written = {k: v for k, v in hub.items() if k not in ("num_experts", "norm_topk_prob")}
    written["num_local_experts"] = 4
    a, b = LlamaConfig.from_hf_dict(hub), LlamaConfig.from_hf_dict(written)
    assert isinstance(a, MoeConfig) and a.num_experts == b.num_experts == 4
    assert a.norm_topk_prob and not b.norm_topk_prob  # Qwen3MoeConfig's default: False
    mix = LlamaConfig.from_hf_dict(moe_config("mixtral"))
    assert mix.norm_topk_prob and mix.moe_intermediate_size == mix.intermediate_size
    q = LlamaConfig.from_hf_dict(
        moe_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    )
    assert q.moe_layer_flags() == (False, True, False, False)


def test_a_plain_llama_config_refuses_an_moe_model_type() -> None:
    with pytest.raises(ValueError, match="mixture of experts"):
        LlamaConfig(64, 16, 16, 1, 2, model_type="mixtral")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_experts_per_tok", 5, "num_experts_per_tok"),
        ("num_experts", 0, "num_experts"),
        ("mlp_only_layers", [7], "mlp_only_layers"),
        ("decoder_sparse_step", 0, "decoder_sparse_step"),
    ],
)
def test_bad_expert_fields_are_refused_naming_the_field(
    tmp_path: Path, field: str, value: object, match: str
) -> None:
    cfg = moe_config("qwen3_moe", **{field: value})
    path = write_checkpoint(tmp_path / "c", cfg, {"x": np.zeros(1, np.float32)})
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(path)


def test_save_pretrained_round_trips_experts_and_dense_layers(tmp_path: Path) -> None:
    cfg = VARIANTS["qwen3_moe_mlp_only_layer"]
    model = load_model(write_checkpoint(tmp_path / "a", cfg, random_moe_tensors(cfg, seed=2)))
    save_pretrained(model, tmp_path / "b")
    again = load_model(tmp_path / "b")
    assert again.config == model.config
    np.testing.assert_array_equal(_logits(model, IDS), _logits(again, IDS))


def test_quantized_load_of_an_moe_model_is_refused_naming_it(tmp_path: Path) -> None:
    cfg = VARIANTS["mixtral"]
    path = write_checkpoint(tmp_path / "a", cfg, random_moe_tensors(cfg, seed=3))
    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        load_model(path, quantization="int8")


# -- routing and the grouped matmul -----------------------------------------------------


def test_top_k_ties_go_to_the_lower_expert_index() -> None:
    logits = jnp.asarray([[1.0, 3.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, 1.0, 5.0]])
    weights, experts = route(logits, 2, normalize=True)
    np.testing.assert_array_equal(np.asarray(experts), [[1, 2], [0, 1], [1, 3]])
    np.testing.assert_allclose(np.asarray(weights), 0.5, rtol=1e-6)


def _loop_reference(x, weights, experts, wg, wu, wd) -> np.ndarray:
    out = np.zeros(x.shape, np.float64)
    for n in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[n, j]
            g, u = x[n] @ wg[e], x[n] @ wu[e]
            out[n] += weights[n, j] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return out


@pytest.mark.parametrize(("n", "x", "k"), [(1, 4, 1), (13, 8, 3)])
def test_grouped_matmul_equals_a_loop_over_experts_and_shards_sum_to_it(n, x, k) -> None:
    rng = np.random.default_rng(n)
    e, f = 8, 6
    xs = rng.standard_normal((n, e)).astype(np.float32)
    wg, wu = (rng.standard_normal((x, e, f)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((x, f, e)).astype(np.float32)
    weights, experts = route(jnp.asarray(rng.standard_normal((n, x)) * 3), k, normalize=False)
    want = _loop_reference(xs, np.asarray(weights), np.asarray(experts), wg, wu, wd)
    mlp = jax.jit(expert_mlp)
    got = mlp(xs, weights, experts, wg, wu, wd)
    chex.assert_trees_all_close(np.asarray(got), want, atol=1e-4, rtol=1e-4)
    half = x // 2  # expert parallelism: two shards of the experts, each its own share
    parts = [
        mlp(xs, weights, experts, wg[s], wu[s], wd[s], first_expert=s.start)
        for s in (slice(0, half), slice(half, x))
    ]
    chex.assert_trees_all_close(np.asarray(parts[0] + parts[1]), want, atol=1e-4, rtol=1e-4)


# -- engine -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["mixtral_window_3", "qwen3_moe_mlp_only_layer"])
def test_engine_paged_greedy_equals_dense_greedy(tmp_path: Path, variant: str) -> None:
    """Chunked prefill (8-token steps), a prefix hit (the third prompt shares the first's
    first 8 tokens = 2 blocks) and decode on the paged cache give the dense path's tokens."""
    cfg = VARIANTS[variant]
    path = write_checkpoint(tmp_path / "c", cfg, random_moe_tensors(cfg, seed=8))
    prompts = [IDS[:10], IDS[2:9], IDS[:8] + [50, 51]]
    n = 5
    dense = load_model(path)
    want = [greedy_generate(dense, p, n) for p in prompts]
    engine = Engine.from_pretrained(
        path, max_num_seqs=2, max_num_batched_tokens=8, num_blocks=24, block_size=4, warmup=False
    )
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert engine.stats()["prefix_cache_hit_rate"] > 0
    assert len({t for w in want for t in w}) > 2  # not a degenerate constant output


def _abstract_moe() -> MoeForCausalLM:
    cfg = MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        model_type="mixtral",
    )
    return nnx.eval_shape(lambda: MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))  # refused before use


@pytest.mark.parametrize(
    ("which", "ep", "match"),
    [
        ("moe", 3, "ep=3 must divide num_experts=4"),
        ("moe", 2, "exceeds the 1 available"),
        ("dense", 2, "needs a mixture-of-experts model"),
        ("moe", 0, "ep must be a positive int"),
    ],
)
def test_engine_refuses_bad_ep_clearly(which: str, ep: int, match: str) -> None:
    if which == "dense":
        model = nnx.eval_shape(
            lambda: LlamaForCausalLM(LlamaConfig(64, 16, 16, 1, 2), rngs=nnx.Rngs(0))
        )
    else:
        model = _abstract_moe()
    with pytest.raises(ValueError, match=match):
        Engine(model, ByteTokenizer(), num_blocks=8, block_size=4, ep=ep, warmup=False)


# -- fixtures for compile_check -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "billions", "experts"),
    [("qwen3_30b_a3b_config.json", 30.5, 128), ("mixtral_8x7b_config.json", 46.7, 8)],
)
def test_committed_moe_configs_build_abstract_models_of_the_published_size(
    name: str, billions: float, experts: int
) -> None:
    from paxcache.compile_check import abstract_model, load_hf_config

    cfg = load_hf_config(FIXTURES / name)
    model = abstract_model(cfg, jnp.bfloat16)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == cfg.num_params()
    assert abs(n / 1e9 - billions) < 0.1
    assert model.layers.expert_gate.shape[1] == experts


# -- expert parallelism on 4 simulated devices ----------------------------------------------


def _run_worker(tmp_path: Path, suite: str) -> dict:
    return run_worker(WORKER, tmp_path / f"{suite}.json", suite)


def _check_layouts(report: dict) -> None:
    ref = report["ref"]["tokens"]
    assert len({t for seq in ref for t in seq}) > 3
    for key, rep in report.items():
        if not key.startswith("tp"):
            continue
        tp, ep = (int(v) for v in key.removeprefix("tp").split("_ep"))
        assert rep["tokens"] == ref, key
        assert not rep["gathers_experts"], key
        x = 4 // ep
        assert rep["expert_gate"]["shard_shape"] == [2, x, 32, 16 // tp], key
        assert rep["expert_down"]["shard_shape"] == [2, x, 16 // tp, 32], key
        assert rep["kv_heads_per_device"] == 2 // tp, key  # kv heads split over tp only
        assert rep["mesh"] == ({"ep": ep, "tp": tp} if ep > 1 else {"tp": tp}), key


@pytest.fixture(scope="module")
def fast_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fast ep worker's report, run once for the tests below."""
    return _run_worker(tmp_path_factory.mktemp("ep_fast"), "fast")


def test_tp2_ep2_gives_the_single_device_tokens_with_experts_split(fast_report: dict) -> None:
    report = fast_report
    assert report["num_devices"] == 4
    _check_layouts(report)
    assert "tp2_ep2" in report


def test_checkpoints_load_straight_into_their_ep_tp_shards(fast_report: dict) -> None:
    loads = fast_report["loads"]
    assert set(loads) == {"mixtral_legacy", "qwen3_moe_dense_layer_fused"}
    for name, rep in loads.items():
        assert rep["equal"], name  # the same values as the one-device load, both layouts
        assert rep["expert_gate"]["spec"] == ["None", "ep", "None", "tp"], name
        assert rep["expert_down"]["spec"] == ["None", "ep", "tp", "None"], name
        sparse = 2  # Mixtral: both layers; Qwen3-MoE: layers 0 and 2
        assert rep["expert_gate"]["shard_shape"] == [sparse, 4 // 2, 32, 16 // 2], name
        assert rep["expert_down"]["shard_shape"] == [sparse, 4 // 2, 16 // 2, 32], name
        assert rep["expert_up"]["devices"] == 4, name
    assert "gate_proj" in loads["qwen3_moe_dense_layer_fused"]  # its dense layer, loaded too
    assert "gate_proj" not in loads["mixtral_legacy"]


@pytest.mark.slow
def test_every_tp_ep_layout_gives_the_single_device_tokens(tmp_path: Path) -> None:
    report = _run_worker(tmp_path, "full")
    _check_layouts(report)
    assert {"tp1_ep2", "tp2_ep2", "tp1_ep4", "tp2_ep1"} <= set(report)
