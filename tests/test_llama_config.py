"""HF config.json fields as transformers >= 5 writes them (``rope_parameters``)."""

from __future__ import annotations

import pytest

from paxcache.models import LlamaConfig

BASE = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
)


def test_rope_parameters_theta_is_read():
    cfg = LlamaConfig.from_hf_dict(
        dict(BASE, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    )
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is None


def test_rope_parameters_scaling_is_read():
    rp = {
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = LlamaConfig.from_hf_dict(dict(BASE, rope_parameters=rp))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("extra", [{}, {"rope_theta": 1234.0}])
def test_top_level_rope_theta_still_wins(extra):
    cfg = LlamaConfig.from_hf_dict(dict(BASE, **extra, rope_parameters={"rope_theta": 9.0}))
    assert cfg.rope_theta == extra.get("rope_theta", 9.0)
