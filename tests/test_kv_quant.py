"""The engine's 8-bit KV cache (``kv_cache_dtype="int8" | "fp8"``): the option is checked before
any work, the same byte budget buys 2x (bf16) / 4x (f32) the blocks, per-layer scales come
from a calibration pass and follow the data, greedy tokens and log-probabilities stay close to
the float-KV engine's, and swap / copy-on-write / prefix sharing move the 8-bit pages intact.

Small random models keep compiles short; the agreement test uses the bundled trained tiny
model, whose next-token distributions are peaked like a real model's (a random model's nearly
flat logits flip argmaxes on any rounding).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import byte_llama

from paxcache import Engine, SamplingParams, kv_quant
from paxcache.models import ByteTokenizer, LlamaForCausalLM, load_pretrained

BS = 8
ENGINE_ARGS = dict(block_size=BS, max_num_seqs=4, max_num_batched_tokens=32, warmup=False)


def _model(dtype=jnp.float32, k_gain: float = 1.0) -> LlamaForCausalLM:
    model = byte_llama(dtype)
    if k_gain != 1.0:
        k = model.layers.k_proj
        k.set_value(k.get_value() * k_gain)
    return model


@pytest.fixture(scope="module")
def model():
    return _model()


def _engine(model, **kw) -> Engine:
    return Engine(model, ByteTokenizer(), **{**ENGINE_ARGS, "num_blocks": 64, **kw})


@pytest.mark.parametrize(
    "value, match",
    [("int4", "'int4'"), ("bfloat16", "'bfloat16'"), (None, "None"), ("INT8", "'INT8'")],
)
def test_unknown_kv_cache_dtype_is_refused_naming_value_and_choices(model, value, match):
    choices = r"kv_cache_dtype must be one of \['auto', 'int8', 'fp8'\], got "
    with pytest.raises(ValueError, match=choices + match):
        _engine(model, kv_cache_dtype=value)


def test_from_pretrained_refuses_a_bad_kv_cache_dtype_before_loading(monkeypatch):
    import paxcache.models

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before kv_cache_dtype was checked")

    monkeypatch.setattr(paxcache.models, "load_pretrained", no_load)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Engine.from_pretrained("tiny", kv_cache_dtype="e5m2")


def test_8bit_kv_with_the_gpu_kernels_forced_is_refused(model):
    with pytest.raises(ValueError, match="GPU attention kernels read float pages only"):
        _engine(model, kv_cache_dtype="int8", impl="pallas_gpu", interpret=True)


def test_8bit_kv_without_a_tokenizer_is_refused_clearly(model):
    with pytest.raises(ValueError, match="no tokenizer"):
        Engine(model, None, kv_cache_dtype="int8", num_blocks=8, block_size=8)


@pytest.mark.parametrize(
    "dtype, kv, ratio",
    [(jnp.float32, "int8", 4), (jnp.float32, "fp8", 4), (jnp.bfloat16, "int8", 2)],
)
def test_same_byte_budget_holds_more_8bit_blocks(dtype, kv, ratio):
    model = _model(dtype)
    budget = 24 * 2 * 2 * 2 * BS * 16 * 4  # 24 f32 blocks of K and V (L=2, K=2, D=16)
    base = _engine(model, num_blocks=None, kv_memory_bytes=budget)
    small = _engine(model, num_blocks=None, kv_memory_bytes=budget, kv_cache_dtype=kv)
    assert small.bytes_per_block * ratio == base.bytes_per_block
    assert small.cache_config.num_blocks == ratio * base.cache_config.num_blocks
    st = small.stats()
    assert st["kv_cache_dtype"] == jnp.dtype(kv_quant.resolve_kv_dtype(kv, dtype)).name
    assert st["kv_cache_bytes"] <= budget
    assert base.stats()["kv_scales"] is None


def test_calibrated_scales_are_per_layer_and_follow_the_keys(model):
    eng = _engine(model, kv_cache_dtype="int8")
    scales = eng.stats()["kv_scales"]
    k, v = np.asarray(scales["k"]), np.asarray(scales["v"])
    assert k.shape == v.shape == (model.config.num_hidden_layers,)
    assert np.isfinite(k).all() and np.isfinite(v).all() and (k > 0).all() and (v > 0).all()
    assert not np.allclose(k, 1.0) and len(set(k.tolist())) == len(k)  # measured, per layer
    # The cache holds these scales (device pages and host pool alike).
    np.testing.assert_allclose(np.asarray(eng._kv.device.k_scale), k, rtol=1e-6)
    # Ten times larger keys: layer 0's K scale is ten times larger, its V scale unchanged (its
    # inputs are the same); later layers see other inputs, but their keys grow too.
    loud = _engine(_model(k_gain=10.0), kv_cache_dtype="int8").stats()["kv_scales"]
    k10, v10 = np.asarray(loud["k"]), np.asarray(loud["v"])
    np.testing.assert_allclose(k10[0] / k[0], 10.0, rtol=1e-3)
    np.testing.assert_allclose(v10[0], v[0], rtol=1e-5)
    assert (k10 / k > 4).all()


def test_scales_from_absmax_map_the_calibrated_maximum_below_qmax():
    s = kv_quant.scales_from_absmax([2.0, 0.0], jnp.int8, margin=1.25)
    np.testing.assert_allclose(s[0] * 127, 2.5, rtol=1e-6)
    assert s[1] > 0  # an all-zero layer still gets a valid scale
    np.testing.assert_allclose(kv_quant.scales_from_absmax([448.0], jnp.float8_e4m3fn, 1.0), 1.0)
    with pytest.raises(ValueError, match="non-finite"):
        kv_quant.scales_from_absmax([np.inf], jnp.int8)
    with pytest.raises(ValueError, match="not an 8-bit"):
        kv_quant.scales_from_absmax([1.0], jnp.float32)


HELDOUT = Path(__file__).resolve().parents[1] / "bench" / "data" / "heldout_quant.txt"


def _tiny_agreement(kv: str) -> dict[str, float]:
    """The bundled tiny model's greedy continuations (4 held-out prompts of 32 tokens, 16 new
    tokens each) with a ``kv`` cache against the float cache's: ``agreement`` (fraction of
    equal tokens, free-running: a flip changes the rest of its row), and over the positions
    whose context is still identical, ``max_gap`` / ``mean_gap`` (the largest / mean
    difference of the sampled token's log-probability) and ``clear_flips`` (tokens that differ
    although the float model's top-2 log-probabilities are more than 0.5 apart)."""
    model, tok = load_pretrained("tiny", dtype=jnp.float32)
    ids = tok.encode(HELDOUT.read_text())
    starts = np.random.default_rng(0).integers(0, len(ids) - 32, 4)
    prompts = [ids[s : s + 32] for s in starts]
    sp = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    args = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=16, warmup=False)
    runs = {}
    for d in ("auto", kv):
        eng = Engine(model, tok, num_blocks=24, max_model_len=64, kv_cache_dtype=d, **args)
        runs[d] = [o.outputs[0] for o in eng.generate(prompts, sp)]
    want = np.asarray([c.token_ids for c in runs["auto"]])
    got = np.asarray([c.token_ids for c in runs[kv]])
    lp = {d: np.asarray([[e["logprob"] for e in c.logprobs] for c in runs[d]]) for d in runs}
    top = [[e["top"] for e in c.logprobs] for c in runs["auto"]]
    margin = np.asarray([[t[0][1] - t[1][1] for t in row] for row in top])
    same = np.cumprod(np.pad(want == got, ((0, 0), (1, 0)), constant_values=True), axis=1)
    same = same[:, :-1].astype(bool)  # every earlier token agrees
    gaps = np.abs(lp["auto"] - lp[kv])[same & (want == got)]
    return {
        "agreement": float(np.mean(want == got)),
        "max_gap": float(np.max(gaps)),
        "mean_gap": float(np.mean(gaps)),
        "clear_flips": int(np.sum(same & (want != got) & (margin > 0.5))),
    }


def test_int8_kv_engine_agrees_with_the_float_kv_engine_on_the_tiny_model():
    # Measured (CPU, f32 compute): agreement 100%, logprob gap max 0.14, mean 0.009.
    r = _tiny_agreement("int8")
    assert r["agreement"] >= 0.9, r
    assert r["max_gap"] < 0.3 and r["mean_gap"] < 0.03, r
    assert r["clear_flips"] == 0, r


@pytest.mark.slow
def test_fp8_kv_engine_agrees_with_the_float_kv_engine_on_the_tiny_model():
    # Measured: agreement 96.9% (a flip where the float top-2 were 0.22 apart), logprob gap
    # max 0.10, mean 0.016.
    r = _tiny_agreement("fp8")
    assert r["agreement"] >= 0.9, r
    assert r["max_gap"] < 0.3 and r["mean_gap"] < 0.05, r
    assert r["clear_flips"] == 0, r


def test_swap_fork_and_prefix_sharing_move_8bit_pages_intact(model):
    """Under memory pressure with swap preemption, n=2 forks (copy-on-write of the partial
    last block) and a shared prompt prefix, an int8 engine produces the tokens it produces
    for the same requests one at a time (no pressure): the 8-bit pages travel (device <->
    host, block to block) as stored, under the same scales."""
    rng = np.random.default_rng(3)
    shared = list(map(int, rng.integers(0, 256, 20)))  # 2.5 blocks of shared prefix
    prompts = [shared + list(map(int, rng.integers(0, 256, n))) for n in (3, 17, 9, 12)]
    params = [
        SamplingParams(max_tokens=16, ignore_eos=True, n=2 if i % 2 else 1)
        for i in range(len(prompts))
    ]
    eng = _engine(
        model,
        kv_cache_dtype="int8",
        num_blocks=10,
        watermark=0.0,
        max_model_len=64,
        max_num_batched_tokens=16,  # one step program
        preemption_mode="swap",
        num_host_blocks=16,
    )
    alone = [eng.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert eng.stats()["num_preemptions"] == 0
    together = eng.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in together] == [
        [c.token_ids for c in o.outputs] for o in alone
    ]
    assert all(len(o.outputs) == 2 for o in together[1::2])
    st = eng.stats()
    assert st["num_swaps"] > 0 and st["num_swapped_in_blocks"] > 0
    assert st["prefix_cache_hits"] > 0
    assert st["num_free_blocks"] == st["num_total_blocks"]
    assert st["num_free_host_blocks"] == st["num_total_host_blocks"]
    assert all(eng.check_invariants().values())


def test_abstract_engine_builds_an_8bit_cache_without_a_calibration_pass(model):
    """compile_check's engine (abstract values: nothing can run) gets int8 pages of half the
    bf16 bytes, placeholder scales, and no calibration."""
    import jax

    from paxcache import compile_check

    cfg = model.config
    engines = {
        kv: compile_check.AbstractEngine(
            compile_check.abstract_model(cfg, jnp.bfloat16),
            jax.devices("cpu"),
            hbm_bytes=1 << 30,
            target_backend="gpu",
            num_blocks=32,
            kv_cache_dtype=kv,
            **{k: v for k, v in ENGINE_ARGS.items() if k != "warmup"},
        )
        for kv in ("auto", "int8")
    }
    eight = engines["int8"]
    assert eight._kv.device.kv.dtype == jnp.int8 and eight._kv.device.k_scale.shape == (2,)
    assert 2 * eight.bytes_per_block == engines["auto"].bytes_per_block
    assert eight.kv_scales == {}
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        compile_check.check_engine("v5e:1x1", cfg, kv_cache_dtype="int4")


@pytest.mark.parametrize("kv", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_tpu_kernels_on_an_8bit_cache_give_the_xla_path_tokens(model, kv):
    """The engine's step through the TPU kernels (interpreted; they dequantize the 8-bit pages
    in VMEM) samples the same greedy tokens as through the XLA path on the same cache dtype:
    prefill chunks, decodes, a prompt that is a prefix of another."""
    prompts = [list(b"the cache holds eight bits"), list(b"the cache holds")]
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    tokens = {}
    for impl, interpret in (("reference", False), ("pallas_tpu", True)):
        eng = _engine(
            model, kv_cache_dtype=kv, impl=impl, interpret=interpret, max_num_batched_tokens=16
        )
        assert eng.stats()["kv_cache_dtype"] == ("int8" if kv == "int8" else "float8_e4m3fn")
        tokens[impl] = [o.outputs[0].token_ids for o in eng.generate(prompts, sp)]
    assert tokens["pallas_tpu"] == tokens["reference"]
