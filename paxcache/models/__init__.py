"""Llama-family and Gemma 2/3 models in Flax NNX, HF checkpoint loading, the bundled tiny model.

Example:
    >>> from paxcache.models import load_pretrained
    >>> model, tok = load_pretrained("tiny")
    >>> logits = model(jnp.asarray([tok.encode("def ")]))  # f32[1, 4, V]
"""

from paxcache.models.gemma import GemmaConfig, GemmaForCausalLM
from paxcache.models.llama import (
    NO_WINDOW,
    ConfigError,
    LlamaConfig,
    LlamaForCausalLM,
    apply_rope,
    dense_attention,
    greedy_generate,
    rope_cos_sin,
)
from paxcache.models.loading import (
    TINY_DIR,
    CheckpointError,
    MissingFileError,
    MissingTensorError,
    TensorShapeError,
    UnsupportedModelError,
    load_config,
    load_model,
    load_pretrained,
    model_class,
    save_pretrained,
)
from paxcache.models.moe import MoeConfig, MoeForCausalLM
from paxcache.models.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDecoder,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "NO_WINDOW",
    "TINY_DIR",
    "ByteTokenizer",
    "CheckpointError",
    "ConfigError",
    "GemmaConfig",
    "GemmaForCausalLM",
    "HFTokenizer",
    "IncrementalDecoder",
    "LlamaConfig",
    "LlamaForCausalLM",
    "MissingFileError",
    "MoeConfig",
    "MoeForCausalLM",
    "MissingTensorError",
    "TensorShapeError",
    "Tokenizer",
    "UnsupportedModelError",
    "apply_rope",
    "dense_attention",
    "greedy_generate",
    "load_config",
    "load_model",
    "load_pretrained",
    "load_tokenizer",
    "model_class",
    "rope_cos_sin",
    "save_pretrained",
]
