"""The Llama-family NNX model (Llama, Mistral, Qwen2/3, OLMo 2, Phi-3): dense path properties,
config parsing, and the paged split."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import base_config, forward_np, inv_freq_np

from paxcache.attention import build_metadata
from paxcache.models import (
    ConfigError,
    LlamaConfig,
    LlamaForCausalLM,
    apply_rope,
    greedy_generate,
    rope_cos_sin,
)
from paxcache.models.llama_config import rope_inv_freq as _rope_inv_freq
from paxcache.models.loading import model_to_hf_tensors

# The dense forward, jitted (one compile per model structure; eagerly every op of the model
# compiles on its own, ~10-30 s per config on a loaded 2-core box).
_fwd = nnx.jit(lambda model, x: model(x))


def make(
    model_type: str = "llama", dtype=jnp.float32, param_dtype=None, seed: int = 0, **hf
) -> LlamaForCausalLM:
    cfg = LlamaConfig.from_hf_dict(base_config(model_type, **hf))
    return LlamaForCausalLM(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed))


def randomize(model: LlamaForCausalLM, seed: int = 0, scale: float = 0.2) -> LlamaForCausalLM:
    """Replaces every param with N(0, scale) noise (+1 for norms) so tests are not degenerate."""
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)

    def noise(path, x):
        n = rng.standard_normal(x.shape) * scale
        if "norm" in str(path[-1]) or "layernorm" in str(path[-1]):
            n = n + 1
        return jnp.asarray(n, x.dtype)

    nnx.update(model, jax.tree_util.tree_map_with_path(noise, state))
    return model


# Phi-3 longrope with partial rotary (D=8, R=4: two factors each); original length 8.
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.7], "long_factor": [1.5, 4.0]}
PHI3_LONGROPE = dict(
    partial_rotary_factor=0.5, rope_scaling=LONGROPE, original_max_position_embeddings=8
)


def ids(b: int, t: int, seed: int = 0, vocab: int = 64) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


# -- dense path ------------------------------------------------------------------------------


def test_dense_forward_returns_f32_logits_of_shape_btv() -> None:
    model = make()
    out = _fwd(model, ids(3, 7))
    chex.assert_shape(out, (3, 7, 64))
    assert out.dtype == jnp.float32
    chex.assert_tree_all_finite(out)


def test_dense_forward_is_causal() -> None:
    model = randomize(make())
    a = ids(1, 10, seed=1)
    b = a.at[0, 6:].set((a[0, 6:] + 1) % 64)
    la, lb = _fwd(model, a), _fwd(model, b)
    chex.assert_trees_all_close(la[:, :6], lb[:, :6], atol=1e-6)
    assert not np.allclose(la[:, 6:], lb[:, 6:])


@pytest.mark.parametrize(
    "variant",
    ["llama", "llama_bias", "mistral", "qwen2", "qwen2_sw", "phi3_longrope"],
)
def test_random_model_matches_numpy_hf_reference(variant: str) -> None:
    """Also checks model_to_hf_tensors' layout (Phi-3: fused again) against the reference.
    (Qwen3 and OLMo 2 from checkpoints: tests/test_loading.py.)"""
    hf = {
        "llama": base_config("llama", tie_word_embeddings=True),
        "llama_bias": base_config("llama", attention_bias=True),
        "mistral": base_config("mistral", sliding_window=5),
        "qwen2": base_config("qwen2", num_key_value_heads=1),
        "qwen2_sw": base_config(
            "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1
        ),
        "phi3_longrope": base_config("phi3", sliding_window=6, **PHI3_LONGROPE),  # 11 > 8: long
    }[variant]
    model = randomize(LlamaForCausalLM(LlamaConfig.from_hf_dict(hf), rngs=nnx.Rngs(0)), seed=2)
    toks = list(np.asarray(ids(1, 11, seed=3)[0]))
    want = forward_np(hf, model_to_hf_tensors(model), toks)
    tol = 1e-5 if hf["model_type"] == "phi3" else 2e-4
    chex.assert_trees_all_close(_fwd(model, jnp.asarray([toks]))[0], want, atol=tol, rtol=tol)


def test_longrope_switches_to_long_factors_past_the_original_length() -> None:
    """HF's rule: a forward over more than original_max_position_embeddings tokens uses the
    long factors for all of them; cos/sin carry the attention factor either way."""
    cfg = LlamaConfig.from_hf_dict(base_config("phi3", **PHI3_LONGROPE))
    factor = 128 / 8  # max_position_embeddings / original_max_position_embeddings
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(
        np.sqrt(1 + np.log(factor) / np.log(8))
    )
    pos = jnp.arange(8, dtype=jnp.int32)
    short, _ = rope_cos_sin(cfg, pos)  # 8 tokens: short
    long, _ = rope_cos_sin(cfg, pos, seq_lens=jnp.asarray(9))  # same positions, 9 tokens
    chex.assert_shape(short, (8, 4))  # R = 4 of D = 8
    inv_s = 1 / (np.asarray([1.0, 1.7]) * 10000.0 ** (np.arange(0, 4, 2) / 4))
    att = cfg.rope_scaling["attention_factor"]
    np.testing.assert_allclose(short[3, :2], np.cos(3 * inv_s) * att, rtol=1e-6)
    assert not np.allclose(short[1:], long[1:])


def test_gqa_equals_mha_with_each_kv_head_repeated_for_its_query_group() -> None:
    gqa = randomize(make(num_key_value_heads=2), seed=4)  # H=4, K=2, D=8: heads 0,1 -> kv 0
    mha = make(num_key_value_heads=4)
    d = 8
    for name in ("embed_tokens", "norm", "lm_head"):
        getattr(mha, name).set_value(getattr(gqa, name)[...])
    for name, value in gqa.layers.stacked().items():
        if name not in ("k_proj", "v_proj"):
            getattr(mha.layers, name).set_value(value)

    def repeat(w):  # [L, E, K*D] -> [L, E, H*D], kv head j serves query heads 2j, 2j+1
        layers, e, _ = w.shape
        return jnp.repeat(w.reshape(layers, e, 2, d), 2, axis=2).reshape(layers, e, 4 * d)

    mha.layers.k_proj.set_value(repeat(gqa.layers.k_proj[...]))
    mha.layers.v_proj.set_value(repeat(gqa.layers.v_proj[...]))
    x = ids(2, 9, seed=5)
    chex.assert_trees_all_close(_fwd(gqa, x), _fwd(mha, x), atol=1e-5)


def test_mistral_sliding_window_limits_what_each_token_sees() -> None:
    model = randomize(make("mistral", sliding_window=3, num_hidden_layers=1), seed=6)
    a = ids(1, 8, seed=7)
    b = a.at[0, 0].set((a[0, 0] + 1) % 64)
    diff = np.abs(np.asarray(_fwd(model, a) - _fwd(model, b)))[0].max(-1)  # [T]
    assert (diff[:3] > 1e-4).all()  # positions 0..2 still see token 0
    np.testing.assert_allclose(diff[3:], 0, atol=1e-6)  # window 3: position 3 sees 1..3


def test_windowed_config_parsing_per_layer() -> None:
    cfg = LlamaConfig.from_hf_dict(
        base_config(
            "qwen2",
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=7,
            max_window_layers=2,
        )
    )
    assert cfg.layer_windows() == (None, None, 7, 7) and cfg.sliding_window == 7
    qwen_off = LlamaConfig.from_hf_dict(base_config("qwen2", sliding_window=7))
    assert qwen_off.sliding_window is None
    assert LlamaConfig.from_hf_dict(base_config("mistral", sliding_window=9)).layer_windows() == (
        9,
        9,
    )


def test_tied_embeddings_share_the_embedding_matrix_as_lm_head() -> None:
    model = randomize(make(tie_word_embeddings=True), seed=8)
    assert model.lm_head is None
    hidden = jnp.ones((2, 32))
    chex.assert_trees_all_close(
        model.compute_logits(hidden), hidden @ model.embed_tokens[...].T, atol=1e-5
    )
    assert model.config.num_params() == sum(
        x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))
    )


def test_bf16_model_stays_close_to_f32() -> None:
    f32 = randomize(make(), seed=9, scale=0.1)
    bf16 = make(dtype=jnp.bfloat16)
    nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(f32, nnx.Param)))
    x = ids(2, 12, seed=10)
    a, b = f32(x), bf16(x)
    assert b.dtype == jnp.float32 and bf16.layers.q_proj[...].dtype == jnp.bfloat16
    err = float(jnp.max(jnp.abs(a - b)))
    assert err < 0.05 * float(jnp.max(jnp.abs(a))), err
    assert float(jnp.mean(jnp.argmax(a, -1) == jnp.argmax(b, -1))) > 0.8


def test_f32_params_with_bf16_compute() -> None:
    model = make(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    assert model.layers.q_proj[...].dtype == jnp.float32
    assert _fwd(model, ids(1, 4)).dtype == jnp.float32


# -- RoPE ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_inverse_frequencies_match_hf_formula(scaling) -> None:
    hf = base_config("llama", head_dim=64, rope_theta=500000.0, rope_scaling=scaling)
    cfg = LlamaConfig.from_hf_dict(hf)
    np.testing.assert_allclose(_rope_inv_freq(cfg), inv_freq_np(hf), rtol=1e-5)


def test_llama3_scaling_keeps_high_and_divides_low_frequencies() -> None:
    rs = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain = _rope_inv_freq(LlamaConfig.from_hf_dict(base_config(head_dim=128, rope_theta=500000.0)))
    scaled = _rope_inv_freq(
        LlamaConfig.from_hf_dict(base_config(head_dim=128, rope_theta=500000.0, rope_scaling=rs))
    )
    assert scaled[0] == plain[0]
    np.testing.assert_allclose(scaled[-1], plain[-1] / 8, rtol=1e-6)


def test_config_with_rope_scaling_dict_is_hashable_for_jit_caches() -> None:
    rs = {"rope_type": "linear", "factor": 2.0}
    a = LlamaConfig.from_hf_dict(base_config(rope_scaling=rs))
    b = LlamaConfig.from_hf_dict(base_config(rope_scaling=dict(rs)))
    assert a == b and hash(a) == hash(b)
    model = LlamaForCausalLM(a, rngs=nnx.Rngs(0))
    assert len(greedy_generate(model, [1, 2, 3], 2)) == 2


def test_rope_scores_depend_only_on_relative_position() -> None:
    cfg = LlamaConfig.from_hf_dict(base_config())
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 8)), jnp.float32)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_cos_sin(cfg, jnp.asarray([pq]))
        ck, sk = rope_cos_sin(cfg, jnp.asarray([pk]))
        return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

    assert score(7, 3) == pytest.approx(score(24, 20), rel=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)


# -- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3"])
def test_config_round_trips_through_hf_dict(model_type: str) -> None:
    extra = {
        "mistral": {"sliding_window": 16},
        "qwen2": {},
        "llama": {"attention_bias": True},
        "qwen3": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        "olmo2": {"attention_bias": True},
        "phi3": {"sliding_window": 16, **PHI3_LONGROPE},
    }
    cfg = LlamaConfig.from_hf_dict(base_config(model_type, **extra[model_type]))
    assert LlamaConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_family_flags_come_from_the_model_type() -> None:
    qwen3 = LlamaConfig.from_hf_dict(base_config("qwen3"))
    olmo2 = LlamaConfig.from_hf_dict(base_config("olmo2", attention_bias=True))
    phi3 = LlamaConfig.from_hf_dict(base_config("phi3", attention_bias=True))
    assert (qwen3.qk_norm, qwen3.norm_placement, qwen3.head_dim) == ("head", "pre", 16)
    assert (olmo2.qk_norm, olmo2.norm_placement, olmo2.qkv_bias, olmo2.o_bias) == (
        "full",
        "post",
        True,
        True,
    )
    assert (phi3.qk_norm, phi3.norm_placement, phi3.qkv_bias) == ("none", "pre", False)
    # transformers >= 5 form: everything under rope_parameters, "su" is longrope's old name.
    rp = {"rope_theta": 500.0, "partial_rotary_factor": 0.5, **LONGROPE, "rope_type": "su"}
    v5 = LlamaConfig.from_hf_dict(
        base_config("phi3", rope_theta=None, rope_parameters=rp, original_max_position_embeddings=8)
    )
    old = LlamaConfig.from_hf_dict(base_config("phi3", rope_theta=500.0, **PHI3_LONGROPE))
    assert v5 == old and old.rotary_dim == 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt_neox"}, "model_type"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "low_freq_factor"),
        ({"head_dim": 7}, "even"),
        ({**PHI3_LONGROPE, "partial_rotary_factor": 1.0}, r"short_factor has 2 entries.*4"),
        ({**PHI3_LONGROPE, "rope_scaling": {**LONGROPE, "long_factor": None}}, "long_factor"),
        ({**PHI3_LONGROPE, "rope_scaling": {**LONGROPE, "short_factor": [1, "x"]}}, "short_f"),
        ({**PHI3_LONGROPE, "original_max_position_embeddings": 0}, "original_max_position"),
        ({"partial_rotary_factor": 0.2}, "partial_rotary_factor"),  # R = 1
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"rope_parameters": {"partial_rotary_factor": "half"}}, "partial_rotary_factor"),
        ({"model_type": "olmo2", "clip_qkv": 8.0}, "clip_qkv"),
    ],
)
def test_bad_configs_raise_clear_errors(change: dict, message: str) -> None:
    hf = base_config("phi3" if "original_max_position_embeddings" in change else "llama")
    hf.update(change)
    with pytest.raises(ConfigError, match=message):
        LlamaConfig.from_hf_dict(hf)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"qk_norm": "layer"}, "qk_norm"),
        ({"norm_placement": "middle"}, "norm_placement"),
    ],
)
def test_bad_family_flags_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            **change,
        )
    llama = LlamaConfig.from_hf_dict(base_config("llama"))
    with pytest.raises(ConfigError, match="qk_norm"):  # a llama config.json cannot say it
        dataclasses.replace(llama, qk_norm="head").to_hf_dict()


def test_missing_required_field_is_named() -> None:
    hf = base_config("llama")
    del hf["intermediate_size"]
    with pytest.raises(ConfigError, match="intermediate_size"):
        LlamaConfig.from_hf_dict(hf)


def test_layers_run_under_a_single_scan() -> None:
    model = make(num_hidden_layers=6)
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids(1, 4))
    prims = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert prims.count("scan") == 1
    scan = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")
    assert scan.params["length"] == 6


# -- paged split -----------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_paged_forward_with_its_own_attention_layer_equals_dense(model_type: str) -> None:
    """Two sequences: prefill in two chunks, then decode steps, pages prefilled with NaN. The
    model's own ``PagedAttention`` layer runs the XLA reference kernels (the metadata says so)
    and reads only what was written (the window comes from the model's config; Qwen2's
    ``layered`` windows: layer 0 full, layer 1 windowed, one paged forward)."""
    hf = {
        "llama": {},
        "mistral": {"sliding_window": 5},
        "qwen2": {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},
    }[model_type]
    model = randomize(make(model_type, **hf), seed=12)
    cfg = model.config
    s, n = 4, 12
    seqs = [np.asarray(ids(1, 14, seed=13)[0]), np.asarray(ids(1, 9, seed=14)[0])]
    tables = jnp.asarray([[7, 2, 10, 0, -1], [5, 11, 3, -1, -1]], jnp.int32)
    cache = model.init_kv_cache(n, s, fill_value=float("nan"))
    dense = [np.asarray(_fwd(model, jnp.asarray(x[None]))[0]) for x in seqs]

    # Steps: (seq, start, stop) chunks processed together in one flat batch per step.
    steps = [
        [(0, 0, 6), (1, 0, 3)],
        [(0, 6, 10), (1, 3, 7)],
        [(0, 10, 11), (1, 7, 8)],
        [(0, 11, 12), (1, 8, 9)],
        [(0, 12, 13)],
        [(0, 13, 14)],
    ]

    @jax.jit
    def run(state, toks, rows, q_lens, kv_lens, num_seqs, cache):
        md = build_metadata(tables[rows], kv_lens, q_lens, num_seqs, 16, s, impl="reference")
        return nnx.merge(graphdef, state).forward_paged(toks, cache, md)

    graphdef, state = nnx.split(model)
    for step in steps:
        toks, want = [], []
        rows, q_lens, kv_lens = [0, 0], [0, 0], [0, 0]  # padded to 2 sequences
        for i, (sid, a, b) in enumerate(step):
            toks += [int(t) for t in seqs[sid][a:b]]
            want += [dense[sid][p] for p in range(a, b)]
            rows[i], q_lens[i], kv_lens[i] = sid, b - a, b
        toks += [0] * (16 - len(toks))  # pad to a fixed bucket; padded rows write nowhere
        logits, cache = run(
            state,
            *(jnp.asarray(a, jnp.int32) for a in (toks, rows, q_lens, kv_lens, len(step))),
            cache,
        )
        chex.assert_shape(logits, (16, cfg.vocab_size))
        chex.assert_trees_all_close(logits[: len(want)], np.stack(want), atol=1e-4)


def test_forward_paged_logits_indices_selects_rows() -> None:
    model = randomize(make(), seed=15)
    cfg = model.config
    toks = ids(1, 6, seed=16)[0]
    six = jnp.asarray([6], jnp.int32)
    md = build_metadata(jnp.asarray([[1, 0]], jnp.int32), six, six, 1, 6, 4, impl="reference")
    cache = model.init_kv_cache(2, 4)
    logits, cache = model.forward_paged(toks, cache, md, logits_indices=jnp.asarray([5, 2]))
    chex.assert_shape(logits, (2, cfg.vocab_size))
    assert (cache.num_layers, cache.num_kv_heads, cache.num_blocks) == (2, 2, 2)
    dense = _fwd(model, toks[None])[0]
    chex.assert_trees_all_close(logits, dense[jnp.asarray([5, 2])], atol=1e-4)


def test_layer_segments_group_layers_by_their_pattern_period() -> None:
    from paxcache.models.layer_plan import Segment, layer_segments

    assert layer_segments("aaaa") == [Segment(0, ("a",), 4)]
    # Gemma 3's 5 sliding + 1 full: 26 layers (Gemma-3-1B) scan the period (6 + a 2-layer tail
    # = 8 bodies, against 9 runs); with 8 layers its three runs are fewer bodies.
    gemma3 = "sssssf" * 4 + "ss"
    assert layer_segments(gemma3) == [Segment(0, tuple("sssssf"), 4), Segment(24, ("s", "s"), 1)]
    assert layer_segments(gemma3[:8]) == [
        Segment(0, ("s",), 5),
        Segment(5, ("f",), 1),
        Segment(6, ("s",), 2),
    ]
    assert layer_segments("sfsfsfs") == [Segment(0, ("s", "f"), 3), Segment(6, ("s",), 1)]
    # Qwen2 layered (no short period): one scan per run of equal kinds.
    assert layer_segments("fffffffffsss") == [Segment(0, ("f",), 9), Segment(9, ("s",), 3)]


def test_model_with_full_and_windowed_layers_scans_each_run_once() -> None:
    model = make(
        "qwen2",
        num_hidden_layers=6,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=4,
    )
    assert model.config.layer_windows() == (None,) * 4 + (3, 3)
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids(1, 4))
    lengths = [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert lengths == [4, 2]
