"""Gemma 2 and Gemma 3 text: logits against a numpy re-implementation of HF's code (checked by
hand against transformers 5.24: tests/gemma_reference.py), config parsing in the current and the
older hub formats, and the engine's paged path (per-layer windows, soft caps, RoPE bases)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from gemma_reference import forward_np, gemma_config, random_tensors
from hf_reference import write_checkpoint
from tiny_models import forward

from paxcache.models import ConfigError, LlamaConfig, greedy_generate, load_pretrained
from paxcache.models.gemma import GemmaConfig, GemmaForCausalLM
from paxcache.models.loading import load_model, save_pretrained

IDS = [5, 17, 3, 60, 9, 22, 41, 0, 13, 7, 33, 2]
MODEL_TYPES = ("gemma2", "gemma3_text")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_checkpoint_logits_match_numpy_hf_reference(tmp_path: Path, model_type: str) -> None:
    """Window 4 < 12 tokens, soft caps (Gemma 2), linear-scaled global and a different local
    RoPE base (Gemma 3), tied embeddings, sharded safetensors."""
    cfg = gemma_config(model_type)
    tensors = random_tensors(cfg, seed=3)
    model, _ = load_pretrained(write_checkpoint(tmp_path / model_type, cfg, tensors, shards=2))
    assert isinstance(model, GemmaForCausalLM)
    got = np.asarray(forward(model, jnp.asarray([IDS], jnp.int32))[0])
    np.testing.assert_allclose(got, forward_np(cfg, tensors, IDS), atol=2e-5, rtol=2e-5)


def test_older_hub_config_keys_read_like_the_current_format() -> None:
    g2_old = gemma_config("gemma2", rope_theta=10000.0)
    del g2_old["layer_types"], g2_old["rope_parameters"]  # implicit alternation, first sliding
    assert GemmaConfig.from_hf_dict(g2_old) == GemmaConfig.from_hf_dict(gemma_config("gemma2"))
    types = ["sliding_attention"] * 2 + ["full_attention"]
    g3_new = gemma_config("gemma3_text", num_hidden_layers=6, layer_types=types * 2)
    g3_old = dict(
        g3_new,
        rope_theta=1e5,
        rope_local_base_freq=50.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=3,
    )
    del g3_old["layer_types"], g3_old["rope_parameters"]
    old, new = LlamaConfig.from_hf_dict(g3_old), LlamaConfig.from_hf_dict(g3_new)
    assert old == new and isinstance(old, GemmaConfig)
    assert old.layer_windows() == (4, 4, None) * 2
    assert (old.rope_theta, old.local_rope_theta) == (1e5, 50.0)
    assert old.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    kinds = old.layer_attention()
    assert {k.rope for k in kinds} == {"sliding_attention", "full_attention"}
    assert kinds[0].sm_scale == pytest.approx(12**-0.5) and kinds[0].soft_cap is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"layer_types": ["chunked_attention"] * 5}, "layer_types"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}, "rope_parameters"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ],
)
def test_bad_gemma_configs_raise_clear_errors(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LlamaConfig.from_hf_dict(gemma_config("gemma3_text", **change))


def test_save_pretrained_round_trips_a_gemma_model(tmp_path: Path) -> None:
    cfg = gemma_config("gemma3_text", tie_word_embeddings=False)
    model, _ = load_pretrained(write_checkpoint(tmp_path / "a", cfg, random_tensors(cfg)))
    save_pretrained(model, tmp_path / "b")
    again = load_model(tmp_path / "b")
    assert dataclasses.asdict(again.config) == dataclasses.asdict(model.config)
    ids = jnp.asarray([IDS], jnp.int32)
    # jitted: one compile for both (same structure), not one per eager op
    np.testing.assert_array_equal(np.asarray(forward(model, ids)), np.asarray(forward(again, ids)))


@pytest.mark.parametrize(
    "model_type", [pytest.param("gemma2", marks=pytest.mark.slow), "gemma3_text"]
)
def test_engine_greedy_equals_dense_with_short_windows_chunks_and_prefix_hits(
    tmp_path: Path, model_type: str
) -> None:
    """Engine.from_pretrained, window 3 < the prompts, 8-token prefill chunks, then the first
    prompt again (a prefix-cache hit): the paged tokens equal the dense path's greedy ones
    (which equal HF's greedy forward; checked by hand). Mixed sliding and full layers: the
    allocator must not free blocks behind the window."""
    from paxcache import Engine, SamplingParams

    cfg = gemma_config(model_type, sliding_window=3, tie_word_embeddings=False)
    path = write_checkpoint(tmp_path / model_type, cfg, random_tensors(cfg, seed=5, scale=0.25))
    prompts = [IDS[:9], IDS[2:9]]
    n = 6
    want = [greedy_generate(load_model(path), p, n) for p in prompts]
    engine = Engine.from_pretrained(
        path,
        dtype=jnp.float32,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        num_blocks=24,
        block_size=4,
        warmup=False,
    )
    assert engine.sliding_window is None
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    again = engine.generate(prompts[:1], params)[0]
    assert again.num_cached_tokens and again.num_cached_tokens >= 4
    assert again.outputs[0].token_ids == want[0]
    assert len(set(want[0])) > 1


def test_compile_check_reads_the_gemma3_27b_config() -> None:
    """The committed hub config (older keys): 62 layers, 5 sliding (window 1024, base 1e4) to 1
    full (base 1e6, linear x8); the layer loop scans the period of 6 ten times plus 2 layers."""
    from paxcache.compile_check import abstract_model, load_hf_config
    from paxcache.models.layer_plan import layer_segments

    cfg = load_hf_config(Path(__file__).parent / "fixtures" / "gemma3_27b_config.json")
    assert isinstance(cfg, GemmaConfig) and cfg.num_hidden_layers == 62
    assert cfg.layer_windows()[:6] == (1024,) * 5 + (None,)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    segs = layer_segments(cfg.layer_attention())
    assert [(s.start, len(s.pattern), s.repeats) for s in segs] == [(0, 6, 10), (60, 2, 1)]
    assert 27.0e9 < cfg.num_params() < 27.5e9
    model = abstract_model(cfg, jnp.bfloat16)
    assert isinstance(model, GemmaForCausalLM)
    assert model.layers.pre_feedforward_layernorm.shape == (62, 5376)
