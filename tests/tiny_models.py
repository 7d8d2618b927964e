"""Tiny random models the engine and server tests share (one definition, built per module)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from paxcache.models import LlamaConfig, LlamaForCausalLM


def byte_llama(dtype: Any = jnp.float32, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A 2-layer, 64-wide random Llama over the byte tokenizer's 259 ids (EOS 257), 256
    positions, grouped-query attention (4 query heads on 2 kv heads), in ``dtype``, weights
    drawn from ``seed``; ``overrides`` replace config fields."""
    fields = dict(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=257,
    )
    return LlamaForCausalLM(LlamaConfig(**(fields | overrides)), dtype=dtype, rngs=nnx.Rngs(seed))


# The dense forward, jitted: one compile per model structure. Called eagerly, every op of a
# model compiles on its own (10-30 s per config on a loaded 2-core box).
forward = nnx.jit(lambda model, ids: model(ids))
