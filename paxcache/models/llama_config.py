"""The Llama-family configuration: :class:`LlamaConfig` (Llama 2/3, Mistral, Qwen2), read from
and written to HF ``config.json`` dictionaries, and :class:`ConfigError`.

Kept apart from the model (:mod:`paxcache.models.llama`, which re-exports these names) so the
checkpoint loader and tools can read a configuration without building a model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from paxcache.errors import PaxcacheError

__all__ = ["NO_WINDOW", "SUPPORTED_MODEL_TYPES", "ConfigError", "LlamaConfig", "rope_inv_freq"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# Window value meaning "no sliding window" in per-layer window arrays (fits in int32).
NO_WINDOW = 2**30


class ConfigError(PaxcacheError):
    """An HF config.json field is missing, inconsistent or unsupported (a ValueError)."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model hyper-parameters, named as in HF ``config.json``.

    Attributes:
        vocab_size: V.
        hidden_size: E.
        intermediate_size: F (SwiGLU width).
        num_hidden_layers: L.
        num_attention_heads: H.
        num_key_value_heads: K (H % K == 0; K == H is MHA, K < H is GQA).
        head_dim: D; defaults to ``hidden_size // num_attention_heads``.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: None, or HF's dict with ``rope_type``/``type`` in
            {"default", "linear", "llama3"}.
        max_position_embeddings: longest supported position.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        qkv_bias: q/k/v projections have a bias (Qwen2; Llama ``attention_bias``).
        o_bias: the output projection has a bias (Llama ``attention_bias``).
        sliding_windows: per-layer sliding window (tokens a query may see, itself included),
            None for full attention. Empty tuple means no layer uses a window.
        model_type: "llama", "mistral" or "qwen2".
        bos_token_id, eos_token_id, pad_token_id: special ids (eos may be a tuple).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        if self.sliding_windows:
            object.__setattr__(self, "sliding_windows", tuple(self.sliding_windows))
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"config field {name} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if self.sliding_windows and len(self.sliding_windows) != self.num_hidden_layers:
            raise ConfigError(
                f"sliding_windows has {len(self.sliding_windows)} entries, expected "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        for w in self.sliding_windows:
            if w is not None and (not isinstance(w, int) or w <= 0):
                raise ConfigError(f"sliding window must be a positive int or None, got {w!r}")
        rope_inv_freq(self)  # validates rope_scaling

    def __hash__(self) -> int:
        # rope_scaling is a dict; hash a canonical JSON form so the config (static data of the
        # NNX graph) can key jit caches.
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True, default=str))

    # Derived, convenience ------------------------------------------------------------------

    @property
    def num_kv_groups(self) -> int:
        """H // K: query heads per kv head."""
        return self.num_attention_heads // self.num_key_value_heads

    def layer_windows(self) -> tuple[int | None, ...]:
        """Sliding window of each layer (None = full causal attention), length L."""
        if not self.sliding_windows:
            return (None,) * self.num_hidden_layers
        return self.sliding_windows

    @property
    def sliding_window(self) -> int | None:
        """The one window shared by every windowed layer, or None if no layer uses one.

        Raises:
            ConfigError: if windowed layers use different sizes (query ``layer_windows()``).
        """
        ws = {w for w in self.layer_windows() if w is not None}
        if not ws:
            return None
        if len(ws) > 1:
            raise ConfigError(f"layers use different sliding windows {sorted(ws)}")
        return ws.pop()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All end-of-sequence ids as a tuple (possibly empty)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def num_params(self) -> int:
        """Number of parameters (counting a tied embedding once)."""
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        h, k = self.num_attention_heads, self.num_key_value_heads
        per_layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f + 2 * e
        if self.qkv_bias:
            per_layer += h * d + 2 * k * d
        if self.o_bias:
            per_layer += e
        n = self.num_hidden_layers * per_layer + self.vocab_size * e + e
        if not self.tie_word_embeddings:
            n += self.vocab_size * e
        return n

    # HF conversion ------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        """Builds a config from the parsed HF ``config.json``.

        Raises:
            ConfigError: unsupported ``model_type``, missing required field, unsupported
                feature (e.g. ``mlp_bias``, an unknown ``rope_scaling`` type).
        """
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r} in config.json; "
                f"supported: {SUPPORTED_MODEL_TYPES}"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        for name in required:
            if name not in d:
                raise ConfigError(f"config.json is missing required field {name!r}")
        if d.get("mlp_bias"):
            raise ConfigError("config.json field mlp_bias=true is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json hidden_act={d['hidden_act']!r}; only 'silu'")
        n_layers = int(d["num_hidden_layers"])

        # Sliding windows per layer.
        windows: tuple[int | None, ...] = ()
        sw = d.get("sliding_window")
        if model_type == "mistral":
            if sw is not None:
                windows = (int(sw),) * n_layers
        elif model_type == "qwen2" and d.get("use_sliding_window") and sw is not None:
            layer_types = d.get("layer_types")
            if layer_types is None:
                mwl = int(d.get("max_window_layers", n_layers))
                layer_types = [
                    "sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)
                ]
            windows = tuple(int(sw) if t == "sliding_attention" else None for t in layer_types)
            if all(w is None for w in windows):
                windows = ()
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            ab = bool(d.get("attention_bias", False))
            qkv_bias, o_bias = ab, ab

        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        # transformers >= 5 writes both into one dict, rope_parameters = {"rope_theta": ...,
        # "rope_type": ..., scaling fields}; a missed theta would silently rotate wrong.
        rope_params = d.get("rope_parameters")
        if isinstance(rope_params, Mapping):
            if rope_theta is None:
                rope_theta = rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        head_dim = d.get("head_dim")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            head_dim=int(head_dim) if head_dim is not None else None,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_windows=windows,
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this config (round-trips through from_hf_dict)."""
        d: dict[str, Any] = {
            "architectures": [
                {
                    "llama": "LlamaForCausalLM",
                    "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM",
                }[self.model_type]
            ],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            if self.qkv_bias != self.o_bias:
                raise ConfigError("llama attention_bias covers q/k/v/o together")
            d["attention_bias"] = self.qkv_bias
        elif self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias):
            raise ConfigError("qwen2 always has q/k/v bias and no o bias")
        elif self.model_type == "mistral" and (self.qkv_bias or self.o_bias):
            raise ConfigError("mistral has no attention bias")
        ws = self.layer_windows()
        used = [w for w in ws if w is not None]
        if self.model_type == "mistral":
            if used and (len(set(used)) > 1 or len(used) != len(ws)):
                raise ConfigError("mistral uses one sliding window on every layer")
            d["sliding_window"] = used[0] if used else None
        elif self.model_type == "qwen2":
            d["use_sliding_window"] = bool(used)
            d["sliding_window"] = used[0] if used else None
            d["max_window_layers"] = self.num_hidden_layers
            if used:
                if len(set(used)) > 1:
                    raise ConfigError("qwen2 uses one sliding window size")
                d["layer_types"] = [
                    "full_attention" if w is None else "sliding_attention" for w in ws
                ]
        elif used:
            raise ConfigError("llama has no sliding window")
        return d


def rope_inv_freq(cfg: LlamaConfig) -> jax.Array:
    """f32[D/2] inverse frequencies, with HF ``rope_scaling`` applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = cfg.rope_scaling
    if not rs:
        return inv_freq
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        factor = float(rs["factor"])
        return inv_freq / factor
    if rope_type == "llama3":
        try:
            factor = float(rs["factor"])
            low = float(rs["low_freq_factor"])
            high = float(rs["high_freq_factor"])
            old_len = float(rs["original_max_position_embeddings"])
        except KeyError as e:
            raise ConfigError(f"rope_scaling of type llama3 is missing field {e.args[0]!r}") from e
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)
    raise ConfigError(
        f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3"
    )
