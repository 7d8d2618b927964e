"""Sharded loading: a checkpoint goes straight into its tensor-parallel shards, each device
holding only its own, with peak host memory bounded by the largest tensor, not the model.

The multi-device checks run once, in a subprocess with 4 simulated CPU devices
(``tests/_shardload_worker.py``), so this process (and the rest of the suite) keeps one device.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_reference import base_config, random_tensors, write_checkpoint
from jax.sharding import NamedSharding, make_single_device_sharding
from workers import run_processes, run_worker

from kernels_pallas import compat
from paxcache import sharding
from paxcache.models.loading import load_model
from paxcache.models.shards import TensorSource, place_param

WORKER = Path(__file__).with_name("_shardload_worker.py")

# ~56 MB of float32 weights; the largest tensor (embed / lm_head, 4 MB) is 1/14 of it.
BIG = base_config(
    "llama",
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)
SMALL = {
    "phi3_fused": base_config("phi3"),  # fused qkv / gate_up split per block
    "qwen2_bias": base_config("qwen2", vocab_size=64),  # split q/k/v biases
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shardload")
    paths = {"big": write_checkpoint(root / "big", BIG, random_tensors(BIG, scale=0.05))}
    for name, cfg in SMALL.items():
        paths[name] = write_checkpoint(root / name, cfg, random_tensors(cfg))
    return paths


@pytest.fixture(scope="module")
def report(checkpoints, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("shardload_out") / "report.json"
    smalls = [str(checkpoints[n]) for n in SMALL]
    return run_worker(WORKER, out, "fast", str(checkpoints["big"]), *smalls, timeout=600)


# ----------------------------------------------------------------------------- in process


def test_stacked_parameter_is_built_layer_by_layer_from_transposed_row_blocks(tmp_path):
    """The block arithmetic of a fused, transposed, stacked source on one device: rows
    ``[4, 10)`` of each layer's ``[12, 3]`` tensor become layer i of ``[L, 3, 6]``."""
    tensors = {f"w.{i}": np.arange(36, dtype=np.float32).reshape(12, 3) + 100 * i for i in range(3)}
    reads = []

    def read(name, block):
        reads.append((name, block))
        return tensors[name][tuple(slice(a, b) for a, b in block)]

    src = TensorSource("w.{layer}", transpose=True, rows=(4, 10))
    one = make_single_device_sharding(jax.devices()[0])
    arr = place_param(src, (3, 3, 6), np.float32, one, read)
    want = np.stack([tensors[f"w.{i}"][4:10].T for i in range(3)])
    np.testing.assert_array_equal(np.asarray(arr), want)
    assert reads == [(f"w.{i}", ((4, 10), (0, 3))) for i in range(3)]


def test_per_expert_tensors_fill_the_expert_axis_of_a_stacked_parameter():
    """``{expert}`` sources: expert j of layer i is ``e.{i}.{j}`` ``[out, in]``, transposed."""
    tensors = {
        f"e.{i}.{j}": np.arange(12, dtype=np.float32).reshape(4, 3) + 10 * j + 100 * i
        for i in range(2)
        for j in range(3)
    }

    def read(name, block):
        return tensors[name][tuple(slice(a, b) for a, b in block)]

    src = TensorSource("e.{layer}.{expert}", transpose=True)
    one = make_single_device_sharding(jax.devices()[0])
    arr = place_param(src, (2, 3, 3, 4), np.float32, one, read)
    want = np.stack([np.stack([tensors[f"e.{i}.{j}"].T for j in range(3)]) for i in range(2)])
    np.testing.assert_array_equal(np.asarray(arr), want)


def test_single_device_load_is_the_mesh_of_one_case(checkpoints):
    model = load_model(checkpoints["qwen2_bias"])
    for leaf in jax.tree.leaves(model.layers):
        assert compat.is_single_device_sharding(leaf.sharding)


def test_bad_mesh_is_refused_before_any_weight_is_read(checkpoints, monkeypatch):
    import paxcache.models.loading as loading

    def no_read(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loading, "place_param", no_read)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match="'tp' axis"):
        load_model(checkpoints["qwen2_bias"], mesh=mesh)


# ----------------------------------------------------------------------------- 4 devices


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_load_gives_the_unsharded_logits(report, tp):
    np.testing.assert_allclose(report[f"tp{tp}"]["logits"], report["tp1"]["logits"], atol=2e-5)


def test_unsharded_load_matches_the_hf_reference(report):
    np.testing.assert_allclose(report["tp1"]["logits"], report["reference_logits"], atol=1e-4)


def _expected_shard(shape: list[int], spec: list, tp: int) -> list[int]:
    return [
        n // tp if a == sharding.TP_AXIS else n
        for n, a in zip(shape, spec + [None] * (len(shape) - len(spec)), strict=True)
    ]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_device_holds_only_its_shard(report, tp):
    rep = report[f"tp{tp}"]
    model_bytes = report["stats"]["model_bytes"]
    replicated_bytes = 0
    for name, p in rep["params"].items():
        assert len(p["shards"]) == tp, name
        want = _expected_shard(p["shape"], p["spec"], tp)
        assert all(s == want for s in p["shards"].values()), (name, p["shards"], want)
        if sharding.TP_AXIS not in p["spec"]:
            replicated_bytes += math.prod(p["shape"]) * p["itemsize"]
    if tp > 1:  # the Megatron split: q/k/v, o, MLP and lm_head on every device's share
        assert rep["params"]["layers/q_proj"]["spec"] == [None, None, "tp"]
        assert rep["params"]["layers/down_proj"]["spec"] == [None, "tp", None]
        assert rep["params"]["lm_head"]["spec"] == [None, "tp"]
    split_bytes = model_bytes - replicated_bytes
    for nbytes in rep["bytes_per_device"].values():
        assert nbytes == split_bytes // tp + replicated_bytes


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_peak_host_memory_is_bounded_by_the_largest_tensor_not_the_model(report, tp):
    stats, rep = report["stats"], report[f"tp{tp}"]
    largest = stats["largest_tensor_bytes"]
    assert stats["model_bytes"] > 12 * largest  # the bound below is far from the model
    # The slice as read, its transposed / cast copy, and the previous block (JAX's CPU client
    # frees a transfer's source late), each at most the largest tensor, + 1 MiB.
    assert rep["host_peak_traced"] < 3 * largest + (1 << 20), rep["host_peak_traced"]
    # Every block is read once per process: split tensors' blocks once, replicated ones once.
    assert rep["mib_read"] * 2**20 == pytest.approx(stats["model_bytes"], rel=1e-6)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_fused_and_biased_families_load_sharded_like_unsharded(report, name):
    rep = report[name]
    np.testing.assert_allclose(rep["tp2_logits"], rep["tp1_logits"], atol=2e-5)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_quantized_load_at_tp2_gives_the_tp1_quantized_logits_and_scales(report, name):
    """int8 quantized as read: a row-parallel (o_proj) shard holds half the input rows,
    yet its scales come from the whole input axis, so tp=2 stores tp=1's values and scales."""
    rep = report[name]
    assert any(n.startswith("layers/o_proj") for n in rep["q_leaves"]), rep["q_leaves"]
    assert rep["q_leaves_equal"] is True
    specs = rep["q_specs"]
    assert specs["layers/q_proj/value/qvalue"] == [None, None, "tp"]
    assert specs["layers/q_proj/value/scale"] == [None, None, "tp"]
    assert specs["layers/o_proj/value/qvalue"] == [None, "tp", None]
    assert specs["layers/o_proj/value/scale"] == []
    np.testing.assert_allclose(rep["q_tp2_logits"], rep["q_tp1_logits"], atol=2e-4)
    assert not np.allclose(rep["q_tp1_logits"], rep["tp1_logits"], atol=1e-7)  # quantized


def test_engine_from_pretrained_serves_the_loaded_shards_without_a_copy(report):
    rep = report["phi3_fused"]  # the first small checkpoint: fused qkv / gate_up at tp=2
    assert rep["tp2_tokens"] == rep["dense_tokens"]
    assert rep["engine_reuses_loaded_shards"] is True
    assert "tp=3 must divide num_attention_heads=4" in rep["tp3_error"]


@pytest.mark.slow
def test_each_host_reads_only_its_own_devices_shards(checkpoints, report, tmp_path):
    """Two processes x 2 CPU devices under jax.distributed form one tp=4 mesh: each process
    reads only the blocks of its 2 devices (the split weights' half, the replicated ones)."""
    hosts = run_processes(WORKER, tmp_path, "multihost", str(checkpoints["big"]))
    single = report["tp4"]
    replicated = sum(
        math.prod(p["shape"]) * p["itemsize"]
        for p in single["params"].values()
        if sharding.TP_AXIS not in p["spec"]
    )
    split = report["stats"]["model_bytes"] - replicated
    for host in hosts:
        rep = host["tp4"]
        assert rep["mib_read"] * 2**20 == pytest.approx(split / 2 + replicated, rel=1e-6)
        assert len(rep["bytes_per_device"]) == 2
        np.testing.assert_allclose(rep["logits"], report["tp1"]["logits"], atol=2e-5)


def test_named_sharding_of_one_layer_drops_the_layer_axis():
    from paxcache.models.shards import layer_sharding

    mesh = sharding.make_mesh(1)
    s = NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "tp"))
    assert layer_sharding(s).spec == jax.sharding.PartitionSpec(None, "tp")
    with pytest.raises(ValueError, match="layer axis"):
        layer_sharding(NamedSharding(mesh, jax.sharding.PartitionSpec("tp")))
