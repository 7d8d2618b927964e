"""Quantized weights (paxcache.models.quantize): quantized at load from a float checkpoint,
pre-quantized compressed-tensors checkpoints loaded as stored, the int8 dot of W8A8, the
bytes they take, and the engine serving them."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from tiny_models import forward

from paxcache.engine import Engine
from paxcache.errors import CheckpointError
from paxcache.models import (
    LlamaConfig,
    LlamaForCausalLM,
    greedy_generate,
    load_pretrained,
    save_pretrained,
)
from paxcache.models import quantize as quant
from paxcache.models.loading import model_to_hf_tensors
from paxcache.sampling import SamplingParams

CFG = LlamaConfig(
    vocab_size=259,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=257,
)
# Max |logit error| / max |logit| on the random model (measured 0.016 int8, 0.018 W8A8,
# 0.045 fp8 with 3 mantissa bits); a quantization that went wrong is off by ~1.
REL_TOL = {"int8": 0.03, "int8-w8a8": 0.04, "fp8": 0.08}


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def ckpt(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    save_pretrained(model, path)
    return path


@pytest.fixture(scope="module")
def ids() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 16)), jnp.int32)


def _rel_err(out: jax.Array, ref: jax.Array) -> float:
    return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


@pytest.mark.parametrize(
    "scheme", ["int8", pytest.param("int8-w8a8", marks=pytest.mark.slow), "fp8"]
)  # W8A8 by default: test_w8a8_matmuls_lower_to_an_int8_dot and the engine test
def test_quantized_at_load_logits_close_to_unquantized(model, ckpt, ids, scheme):
    qmodel, _ = load_pretrained(ckpt, quantization=scheme)
    assert quant.quantization_of(qmodel) == scheme
    err = _rel_err(forward(qmodel, ids), forward(model, ids))
    assert 0 < err < REL_TOL[scheme], err  # 0 would mean nothing was quantized


def test_quantized_layer_bytes_at_most_52_percent_of_bf16(ckpt):
    qmodel, _ = load_pretrained(ckpt, quantization="int8")
    qbytes, bf16_bytes = quant.quantized_bytes(qmodel)
    assert bf16_bytes == 2 * sum(
        int(np.prod(getattr(qmodel.layers, n).get_value().shape)) for n in quant.LINEAR_WEIGHTS
    )
    assert qbytes <= 0.52 * bf16_bytes, qbytes / bf16_bytes
    w = qmodel.layers.q_proj.get_value()
    assert w.qvalue.dtype == jnp.int8 and w.scale.shape == (2, 1, 128)


def test_w8a8_matmuls_lower_to_an_int8_dot(ckpt, ids):
    qmodel, _ = load_pretrained(ckpt, quantization="int8-w8a8")
    graphdef, state = nnx.split(qmodel)
    hlo = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)).lower(state, ids).as_text()
    int8_dots = re.findall(r"dot_general.*xi8>, tensor<.*xi8>\) -> tensor<.*xi32>", hlo)
    assert len(int8_dots) == len(quant.LINEAR_WEIGHTS), hlo.count("dot_general")
    weight_only, _ = load_pretrained(ckpt, quantization="int8")
    graphdef, state = nnx.split(weight_only)
    hlo = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)).lower(state, ids).as_text()
    assert not re.findall(r"dot_general.*xi8>, tensor<.*xi8>", hlo)


def test_quantize_weight_rounds_scales_up_so_nothing_clips():
    w = np.random.default_rng(1).normal(size=(3, 64, 32)).astype(np.float32)
    absmax = np.max(np.abs(w), axis=1, keepdims=True)
    for scheme, qmax in (("int8", 127), ("fp8", 448)):
        q = quant.quantize_weight(w, scheme)
        assert q.scale.dtype == jnp.bfloat16 and q.scale.shape == (3, 1, 32)
        scale = np.asarray(q.scale, np.float32)
        assert np.all(scale * qmax >= absmax)  # bf16 rounded up: the largest weight fits
        assert np.all(scale * qmax <= absmax * (1 + 2**-7))
        back = np.asarray(q.qvalue, np.float32) * scale
        if scheme == "int8":
            assert np.all(np.abs(back - w) <= scale / 2 * (1 + 1e-5))
        else:  # e4m3: 3 mantissa bits
            assert np.all(np.abs(back - w) <= np.maximum(np.abs(w) * 2**-4, scale * 2**-9))


def test_unknown_quantization_is_refused(ckpt):
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        load_pretrained(ckpt, quantization="int4")


# -- compressed-tensors checkpoints ------------------------------------------------------------

_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def _ct_config(weight_type: str, acts: dict | None) -> dict:
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": weight_type, "symmetric": True,
                    "strategy": "channel", "dynamic": False, "group_size": None,
                    "observer": "minmax"},
        "input_activations": acts,
        "output_activations": None,
    }  # fmt: skip
    fmt = "float-quantized" if weight_type == "float" else "int-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
    }


def _write_compressed_tensors(
    model, path, weight_type: str, acts: dict | None, x_absmax=None, extra=None
):
    """An HF checkpoint in the compressed-tensors layout: quantized ``weight`` [out, in],
    f32 ``weight_scale`` [out, 1], ``input_scale`` [1] for static activations (and the
    ``extra`` tensors)."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = dict(extra or {})
    for name, w in model_to_hf_tensors(model).items():
        if not _LINEAR.match(name):
            tensors[name] = w
            continue
        qmax = 448.0 if weight_type == "float" else 127.0
        scale = (np.max(np.abs(w), axis=1, keepdims=True) / qmax).astype(np.float32)
        ratio = w / scale
        if weight_type == "float":
            tensors[name] = ratio.astype(ml_dtypes.float8_e4m3fn)
        else:
            tensors[name] = np.clip(np.rint(ratio), -127, 127).astype(np.int8)
        base = name.removesuffix(".weight")
        tensors[base + ".weight_scale"] = scale
        if acts is not None and not acts["dynamic"]:
            tensors[base + ".input_scale"] = np.asarray([x_absmax / qmax], np.float32)
    cfg = model.config.to_hf_dict()
    cfg["quantization_config"] = _ct_config(weight_type, acts)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


_CT_CASES = {
    "fp8-dynamic": ("float", {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": True, "symmetric": True}, "fp8"),
    "int8-w8a8-dynamic": ("int", {"num_bits": 8, "type": "int", "strategy": "token",
                                  "dynamic": True, "symmetric": True}, "int8-w8a8"),
    "int8-w8a8-static": ("int", {"num_bits": 8, "type": "int", "strategy": "tensor",
                                 "dynamic": False, "symmetric": True}, "int8-w8a8"),
}  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["fp8-dynamic", "int8-w8a8-static", pytest.param("int8-w8a8-dynamic", marks=pytest.mark.slow)],
)
def test_compressed_tensors_checkpoint_loads_as_stored(model, ids, tmp_path, case):
    weight_type, acts, scheme = _CT_CASES[case]
    path = _write_compressed_tensors(model, tmp_path / case, weight_type, acts, x_absmax=8.0)
    qmodel, _ = load_pretrained(path)
    assert quant.quantization_of(qmodel) == scheme
    w = qmodel.layers.down_proj.get_value()
    want = jnp.float8_e4m3fn if weight_type == "float" else jnp.int8
    assert w.qvalue.dtype == want and w.scale.shape == (2, 1, 128)
    if acts["dynamic"]:
        assert w.act_scale is None
        assert 0 < _rel_err(forward(qmodel, ids), forward(model, ids)) < 0.1
    else:  # one uncalibrated scale (8 / 127) for every layer: the checkpoint's, as stored
        np.testing.assert_allclose(np.asarray(w.act_scale).ravel(), [8 / 127] * 2, rtol=1e-6)
        assert 0 < _rel_err(forward(qmodel, ids), forward(model, ids)) < 0.5
    again, _ = load_pretrained(path, quantization=scheme)  # naming its own scheme is fine
    assert quant.quantization_of(again) == scheme


def _edit_config(path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def test_prequantized_checkpoint_errors_name_the_problem(model, tmp_path):
    path = _write_compressed_tensors(model, tmp_path / "ct", "float", None)
    with pytest.raises(
        CheckpointError, match="quantization='int8' given for a checkpoint pre-quantized as 'fp8'"
    ):
        load_pretrained(path, quantization="int8")
    _edit_config(path, lambda qc: qc.update(mystery_knob=1))
    with pytest.raises(CheckpointError, match=r"quantization_config\.mystery_knob"):
        load_pretrained(path)
    _edit_config(path, lambda qc: (qc.pop("mystery_knob"), qc["config_groups"]["group_0"][
        "weights"].update(num_bits=4)))  # fmt: skip
    with pytest.raises(CheckpointError, match=r"weights\.num_bits: 4"):
        load_pretrained(path)
    _edit_config(path, lambda qc: qc.update(quant_method="awq"))
    with pytest.raises(CheckpointError, match="'awq' .*int4.* not supported"):
        load_pretrained(path)
    _edit_config(path, lambda qc: qc.update(quant_method="somethingelse"))
    with pytest.raises(CheckpointError, match="quant_method: 'somethingelse'"):
        load_pretrained(path)


def test_int8_tensors_without_quantization_config_are_refused(model, tmp_path):
    path = _write_compressed_tensors(model, tmp_path / "ct", "int", None)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="dtype I8"):  # never a silent float load
        load_pretrained(path)


# -- compressed-tensors kv_cache_scheme: the checkpoint's KV cache scales ------------------------

_KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
              "symmetric": True}  # fmt: skip
_K_SCALES, _V_SCALES = [0.011, 0.023], [0.017, 0.005]  # per layer (2 layers)


def _write_kv_scheme(model, path, *, with_weights: bool, names: str = "self_attn.{kv}_scale"):
    """A checkpoint whose ``kv_cache_scheme`` quantizes K and V to fp8 with one scale per
    layer; its weights stay float, or are fp8 compressed-tensors too (``with_weights``)."""
    scales = {
        f"model.layers.{layer}.{names.format(kv=kv)}": np.asarray(scale, np.float32)
        for layer, (k, v) in enumerate(zip(_K_SCALES, _V_SCALES, strict=True))
        for kv, scale in (("k", k), ("v", v))
    }
    if with_weights:
        _write_compressed_tensors(model, path, "float", None, extra=scales)
    else:
        save_pretrained(model, path)
        tensors = {**load_file(str(path / "model.safetensors")), **scales}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.get("quantization_config") or {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
        "quantization_status": "frozen",
    }  # fmt: skip
    qc["kv_cache_scheme"] = dict(_KV_SCHEME)
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "with_weights,names",
    [(False, "self_attn.{kv}_scale"), (True, "self_attn.{kv}_proj.output_scale")],
    ids=["kv-only", "fp8-weights-older-names"],
)
def test_kv_cache_scheme_scales_become_the_engine_cache_scales(
    model, tmp_path, with_weights, names
):
    path = _write_kv_scheme(model, tmp_path / "kv", with_weights=with_weights, names=names)
    loaded, _ = load_pretrained(path)
    k_absmax, v_absmax = loaded.config.kv_cache_absmax
    np.testing.assert_allclose(k_absmax, np.asarray(_K_SCALES) * 448, rtol=1e-6)
    np.testing.assert_allclose(v_absmax, np.asarray(_V_SCALES) * 448, rtol=1e-6)
    assert quant.quantization_of(loaded) == ("fp8" if with_weights else None)
    args = dict(num_blocks=16, block_size=8, max_num_seqs=1, max_num_batched_tokens=8,
                warmup=False)  # fmt: skip
    prompt = [5, 17, 99, 3, 42]
    for kv_dtype, to_range in (("fp8", 1.0), ("int8", 448 / 127)):
        engine = Engine.from_pretrained(path, kv_cache_dtype=kv_dtype, **args)
        stats = engine.stats()
        assert stats["kv_scales_source"] == "checkpoint"
        np.testing.assert_allclose(stats["kv_scales"]["k"], np.asarray(_K_SCALES) * to_range,
                                   rtol=1e-6)  # fmt: skip
        np.testing.assert_allclose(stats["kv_scales"]["v"], np.asarray(_V_SCALES) * to_range,
                                   rtol=1e-6)  # fmt: skip
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out.outputs[0].token_ids) == 4
    plain = Engine.from_pretrained(path, **args)  # a float cache does not use them
    assert plain.stats()["kv_scales_source"] is None and plain.stats()["kv_scales"] is None


def test_kv_cache_scheme_errors_name_the_field_or_tensor(model, tmp_path):
    path = _write_kv_scheme(model, tmp_path / "kv", with_weights=False)
    _edit_config(path, lambda qc: qc["kv_cache_scheme"].update(strategy="channel"))
    with pytest.raises(CheckpointError, match=r"kv_cache_scheme\.strategy: 'channel'"):
        load_pretrained(path)
    _edit_config(path, lambda qc: qc["kv_cache_scheme"].update(strategy="tensor", num_bits=4))
    with pytest.raises(CheckpointError, match=r"kv_cache_scheme\.num_bits: 4"):
        load_pretrained(path)
    _edit_config(path, lambda qc: qc["kv_cache_scheme"].update(num_bits=8, dynamic=True))
    with pytest.raises(CheckpointError, match=r"kv_cache_scheme\.strategy"):
        load_pretrained(path)
    _edit_config(path, lambda qc: qc["kv_cache_scheme"].update(dynamic=False, zero=1))
    with pytest.raises(CheckpointError, match=r"kv_cache_scheme\.zero: field not understood"):
        load_pretrained(path)
    _edit_config(path, lambda qc: qc["kv_cache_scheme"].pop("zero"))
    tensors = dict(load_file(str(path / "model.safetensors")))
    tensors["model.layers.1.self_attn.v_scale"] = np.asarray(-0.5, np.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_scale.*-0\.5"):
        load_pretrained(path)
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.v_scale'"
    ):
        load_pretrained(path)


# -- the engine ----------------------------------------------------------------------------------


def test_engine_serves_a_quantized_model_and_reports_its_dtypes(ckpt):
    engine = Engine.from_pretrained(
        ckpt, quantization="int8-w8a8", num_blocks=16, block_size=8, max_num_seqs=1,
        max_num_batched_tokens=8, warmup=False,
    )  # fmt: skip
    prompt = [5, 17, 99, 3, 42]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
    # The same quantized model, dense path, greedy.
    assert out.outputs[0].token_ids == greedy_generate(engine.model, prompt, 6)
    stats = engine.stats()
    assert stats["quantization"] == "int8-w8a8"
    assert stats["weight_dtype"] == "int8"
    assert stats["kv_cache_dtype"] == "float32"


def test_models_route_and_metrics_show_the_quantization():
    import httpx
    from server_harness import FakeEngine, serve_in_thread

    from paxcache.server import create_app

    class QuantizedFake(FakeEngine):
        def stats(self) -> dict:
            return {
                **super().stats(),
                "quantization": "int8-w8a8",
                "weight_dtype": "int8",
                "kv_cache_dtype": "bfloat16",
            }

    with serve_in_thread(create_app(QuantizedFake())) as base:
        card = httpx.get(f"{base}/v1/models").json()["data"][0]
        text = httpx.get(f"{base}/metrics").text
    assert card["quantization"] == "int8-w8a8" and card["weight_dtype"] == "int8"
    assert card["kv_cache_dtype"] == "bfloat16"
    assert (
        'paxcache_weights_info{kv_cache_dtype="bfloat16",quantization="int8-w8a8",'
        'weight_dtype="int8"} 1.0' in text
    )


def _libtpu_available() -> bool:
    from kernels_pallas import aot

    try:
        aot.tpu_devices("v5e:2x2")
    except ValueError:
        return False
    return True


def _int8_matmuls(hlo: str) -> int:
    """Dots / convolutions of a compiled HLO module whose two operands are both s8."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    count = 0
    for a, b in re.findall(
        r"= \w+\[[^\]]*\]\S* (?:convolution|dot)\(%([\w.\-]+), %([\w.\-]+)\)", hlo
    ):
        count += types.get(a) == "s8" and types.get(b) == "s8"
    return count


@pytest.mark.skipif(not _libtpu_available(), reason="libtpu not installed (pip install 'jax[tpu]')")
def test_w8a8_layer_compiles_to_int8_matmuls_for_tpu_v5e():
    """Deviceless: one W8A8 layer compiled by XLA:TPU for v5e keeps all seven projections on
    int8 operands (the MXU's int8 path), the weights never dequantized."""
    from kernels_pallas import aot

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    for name in quant.LINEAR_WEIGHTS:
        param = getattr(model.layers, name)
        shape = param.get_value().shape
        param.set_value(
            quant.QuantizedWeight(
                qvalue=jax.ShapeDtypeStruct(shape, jnp.int8),
                scale=jax.ShapeDtypeStruct((shape[0], 1, shape[2]), jnp.bfloat16),
                act_qtype="int8",
                scheme="int8-w8a8",
            )
        )
    quant.apply_quantization(model)
    device = aot.tpu_devices("v5e:2x2")[0]
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: aot.spec(x.shape, x.dtype, device), state)
    ids = aot.spec((4, 64), jnp.int32, device)
    with aot.tpu_target([device]):
        fn = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
        hlo = fn.trace(state, ids).lower().compile().as_text()
    assert _int8_matmuls(hlo) == len(quant.LINEAR_WEIGHTS)


@pytest.mark.slow
@pytest.mark.skipif(not _libtpu_available(), reason="libtpu not installed (pip install 'jax[tpu]')")
def test_compile_check_int8_engine_for_v5e_holds_half_the_weight_bytes():
    from paxcache import compile_check

    reports = {
        q: compile_check.check_engine("v5e:2x2", CFG, quantization=q, max_num_seqs=8,
                                      max_num_batched_tokens=64, num_host_blocks=0)
        for q in (None, "int8")
    }  # fmt: skip
    assert all(r["ok"] for r in reports.values()), [r["failures"] for r in reports.values()]
    layer = (
        2
        * CFG.num_hidden_layers
        * sum(  # bf16 bytes of the quantized weights
            CFG.hidden_size * n for n in (128, 64, 64, 128, 256, 256)
        )
        + 2 * CFG.num_hidden_layers * 256 * 128
    )
    saved = (
        reports[None]["engine"]["weights_bytes_per_chip"]
        - reports["int8"]["engine"]["weights_bytes_per_chip"]
    )
    assert 0.47 * layer <= saved <= 0.5 * layer, (saved, layer)
