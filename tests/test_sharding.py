"""Tensor-parallel serving: tp = 1, 2, 4 give the same greedy tokens, KV pages and weights
really are sharded, the compiled step gathers neither, and bad ``tp`` values fail clearly.

Multi-device checks run once, in a subprocess with 4 simulated CPU devices
(``tests/_tp_worker.py``), so this process (and the rest of the suite) keeps one device.
"""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from workers import run_processes, run_worker

from paxcache import Engine, sharding
from paxcache.models import ByteTokenizer, LlamaConfig, LlamaForCausalLM

WORKER = Path(__file__).with_name("_tp_worker.py")


def _run_worker(tmp_path_factory, suite: str) -> dict:
    return run_worker(WORKER, tmp_path_factory.mktemp("tp") / f"{suite}.json", suite)


@pytest.fixture(scope="module")
def tp_report(tmp_path_factory) -> dict:
    return _run_worker(tmp_path_factory, "fast")


def _cfg(h: int = 8, k: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=h,
        num_key_value_heads=k,
        head_dim=8,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def small_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(_cfg(), rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------- in process


def test_param_specs_are_megatron_column_and_row_parallel(small_model):
    _, params = nnx.split(small_model)
    specs = {
        "/".join(str(getattr(p, "key", p)) for p in path[:-1]): s
        for path, s in jax.tree_util.tree_leaves_with_path(
            sharding.param_specs(params, small_model.config, 2),
            is_leaf=lambda x: isinstance(x, P),
        )
    }
    col, row = P(None, None, "tp"), P(None, "tp", None)
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert specs[f"layers/{name}"] == col, name
    for name in ("o_proj", "down_proj"):
        assert specs[f"layers/{name}"] == row, name
    for name in ("layers/input_layernorm", "layers/post_attention_layernorm", "norm"):
        assert specs[name] == P(), name
    assert specs["embed_tokens"] == P()
    assert specs["lm_head"] == P(None, "tp")  # vocab 260 splits over 2


def test_param_specs_replicate_kv_projections_when_tp_exceeds_kv_heads(small_model):
    _, params = nnx.split(small_model)
    specs = sharding.param_specs(params, small_model.config, 4)
    assert specs["layers"]["k_proj"].get_value() == P()
    assert specs["layers"]["v_proj"].get_value() == P()
    assert specs["layers"]["q_proj"].get_value() == P(None, None, "tp")
    assert sharding.cache_kv_heads(2, 4) == 4
    assert sharding.cache_kv_heads(4, 2) == 4


@pytest.mark.parametrize(
    ("h", "k", "tp", "devices", "match"),
    [
        (8, 2, 3, 4, "must divide num_attention_heads=8"),
        (8, 2, 8, 4, "exceeds the 4 available"),
        (12, 6, 4, 4, "num_key_value_heads=6"),
        (8, 2, 0, 4, "positive int"),
        (8, 2, 2.0, 4, "positive int"),
        (8, 2, True, 4, "positive int"),
    ],
)
def test_validate_tp_rejects_bad_values_clearly(h, k, tp, devices, match):
    with pytest.raises(ValueError, match=match):
        sharding.validate_tp(_cfg(h, k), tp, num_devices=devices)


@pytest.mark.parametrize(("h", "k", "tp"), [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 8, 4), (12, 6, 3)])
def test_validate_tp_accepts_splits_and_kv_replication(h, k, tp):
    sharding.validate_tp(_cfg(h, k), tp, num_devices=4)


@pytest.mark.parametrize("tp", [0, -2, 2, "2"])
def test_engine_rejects_bad_tp_on_one_device(small_model, tp):
    with pytest.raises(ValueError, match="tp"):
        Engine(small_model, ByteTokenizer(), num_blocks=8, block_size=8, max_num_seqs=2, tp=tp)


def test_collectives_parses_compiled_hlo_lines():
    text = "\n".join(
        [
            "  %all-gather.6 = f32[4,260]{0,1} all-gather(%x), channel_id=20, dimensions={1}",
            "  %all-reduce.22 = (f32[4]{0}, s32[4]{0}) all-reduce(%a, %b), channel_id=11",
            "  %ags = (f32[2,8]{1,0}, f32[2,16]{1,0}) all-gather-start(%y), dimensions={1}",
            "  %fusion = f32[4]{0} fusion(%all-gather.6), kind=kLoop",
        ]
    )
    assert sharding.collectives(text) == [
        ("all-gather", (4, 260)),
        ("all-reduce", (4,)),
        ("all-reduce", (4,)),
        ("all-gather", (2, 8)),
        ("all-gather", (2, 16)),
    ]


# ----------------------------------------------------------------------------- 4 devices


def test_worker_sees_four_devices(tp_report):
    assert tp_report["num_devices"] == 4


def test_tp_1_2_4_give_the_same_greedy_tokens(tp_report):
    ref = tp_report["k2_tp1"]["tokens"]
    assert len(ref) == 5 and all(len(t) == 8 for t in ref)
    assert tp_report["k2_tp2"]["tokens"] == ref
    assert tp_report["k2_tp4"]["tokens"] == ref


def test_swap_preemption_under_tp2_keeps_tokens_and_frees_everything(tp_report):
    rep = tp_report["k2_tp2"]  # 8 blocks of 8 tokens for 5 prompts of 3-20 (+8) tokens
    assert rep["tokens"] == tp_report["k2_tp1"]["tokens"]
    assert rep["stats"]["num_swaps"] > 0
    assert rep["stats"]["num_free_blocks"] == rep["stats"]["num_total_blocks"]
    assert rep["host_spec"] == "P(None, None, None, 'tp')"
    assert rep["host_memory_kind"] in ("pinned_host", "unpinned_host")


def test_kv_pages_are_split_over_kv_heads(tp_report):
    rep = tp_report["k2_tp2"]
    assert rep["kv_spec"] == "P(None, None, None, 'tp')"  # [L, N, S, C, P, Dp]: split on C
    assert rep["kv_devices"] == 2
    assert rep["kv_heads"] == 2 and rep["kv_shape"][:3] == [2, 8, 8]
    assert rep["kv_heads_per_device"] == 1  # one kv head (its K and V) per device


def test_tp_above_kv_heads_replicates_each_kv_head_once_per_device(tp_report):
    rep = tp_report["k2_tp4"]
    assert rep["kv_spec"] == "P(None, None, None, 'tp')"
    assert rep["kv_heads"] == 4  # Kc = tp = 4 cache heads from K = 2
    assert rep["kv_heads_per_device"] == 1
    assert rep["params"]["layers/k_proj"]["spec"] == "P()"


@pytest.mark.parametrize("tp", [2, 4])
def test_weights_are_really_sharded(tp_report, tp):
    params = tp_report[f"k2_tp{tp}"]["params"]
    assert all(p["num_devices"] == tp for p in params.values())
    assert params["layers/q_proj"]["shard_shape"] == [2, 64, 64 // tp]
    assert params["layers/o_proj"]["shard_shape"] == [2, 64 // tp, 64]
    assert params["layers/gate_proj"]["shard_shape"] == [2, 64, 128 // tp]
    assert params["layers/down_proj"]["shard_shape"] == [2, 128 // tp, 64]
    assert params["lm_head"]["shard_shape"] == [64, 260 // tp]
    assert params["norm"]["spec"] == "P()"


@pytest.mark.parametrize("tp", [2, 4])
def test_block_state_is_replicated(tp_report, tp):
    assert tp_report[f"k2_tp{tp}"]["state_replicated"]


@pytest.mark.parametrize("case", ["k2_tp2", "k2_tp4"])
def test_compiled_step_gathers_no_kv_cache_and_no_weight(tp_report, case):
    hlo = tp_report[case]["hlo"]
    assert hlo["bad"] == [], hlo
    # Megatron: one all-reduce of the [T, E] hidden state after attention and one after the
    # MLP (inside the layer scan), proving the weights are used sharded.
    assert hlo["hidden_all_reduces"] == 2, hlo


def test_hlo_check_catches_a_gathered_cache(tp_report):
    assert tp_report["checker_control"]["caught"]


@pytest.mark.parametrize("case", ["attn_tp2_k2", "attn_tp4_k2"])
def test_sharded_attention_op_equals_unsharded(tp_report, case):
    rep = tp_report[case]
    assert rep["out_err"] < 1e-5 and rep["k_err"] == 0.0
    assert rep["pages_still_sharded"]


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("tp3_heads", "tp=3 must divide num_attention_heads=8"),
        ("tp8_devices", "tp=8 exceeds the 4 available"),
        ("tp4_kv6", "num_key_value_heads=6"),
    ],
)
def test_engine_rejects_bad_tp_clearly_on_four_devices(tp_report, case, match):
    err = tp_report["errors"][case]
    assert err is not None and err.startswith("ValueError") and match in err


@pytest.mark.slow
def test_four_kv_heads_tp_1_2_4_same_tokens_and_split_heads(tmp_path_factory):
    rep = _run_worker(tmp_path_factory, "k4")
    ref = rep["k4_tp1"]["tokens"]
    assert rep["k4_tp2"]["tokens"] == ref and rep["k4_tp4"]["tokens"] == ref
    assert rep["k4_tp2"]["kv_heads_per_device"] == 2
    assert rep["k4_tp4"]["kv_heads_per_device"] == 1
    assert rep["k4_tp4"]["params"]["layers/k_proj"]["spec"] == "P(None, None, 'tp')"
    for tp in (2, 4):
        assert rep[f"k4_tp{tp}"]["hlo"]["bad"] == []
    assert rep["attn_tp4_k4"]["out_err"] < 1e-5


@pytest.mark.slow
def test_two_processes_form_one_tp4_mesh_with_jax_distributed(tp_report, tmp_path):
    """Multi-host as on a TPU pod slice: 2 processes x 2 CPU devices, jax.distributed.
    (Slow: CI's multi-process check is tests/test_multihost_serve.py, two processes joined by
    jax.distributed serving one tp=2 mesh over HTTP.)"""
    ref = tp_report["k2_tp1"]["tokens"]
    for rep in run_processes(WORKER, tmp_path, "multihost"):
        assert rep["num_devices"] == 4 and rep["num_local_devices"] == 2
        assert rep["kv_spans_processes"] == 2
        assert rep["tokens"] == ref
