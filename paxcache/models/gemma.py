"""Gemma 2 and Gemma 3 (text) in Flax NNX, on the Llama decoder's shared pieces.

What Gemma changes (HF ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``, transformers 5):

* embeddings scaled by ``sqrt(E)`` rounded to the model dtype, as HF does;
* RMSNorm scales by ``1 + w`` in float32 (``Family.norm_offset``), and "sandwich" norms: input
  and post-attention norms around attention, pre- and post-feed-forward norms around the MLP;
* q/k RMSNorm per head (Gemma 3), the GeLU-tanh gated MLP, tied embeddings by default;
* attention: logits scaled by ``query_pre_attn_scalar ** -0.5``, an attention logit soft cap
  (Gemma 2), per-layer sliding / full attention (``layer_types``, or the older
  ``sliding_window_pattern`` / Gemma 2's implicit alternation);
* RoPE per layer type (Gemma 3: ``rope_local_base_freq`` on sliding layers, ``rope_theta`` and
  ``rope_scaling`` on full layers; transformers 5 nests both in ``rope_parameters``);
* a final logit soft cap.

The layer weights (:class:`~paxcache.models.llama.LlamaLayers`, ``norm_placement="sandwich"``),
norms, RoPE, projections, the MLP and the layer loop with its per-layer attention options
(:mod:`paxcache.models.layer_plan`) are the Llama module's; this module holds the config
translation and the few overrides.

Shape letters as in :mod:`paxcache.models.llama`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from paxcache.models.families import FAMILIES
from paxcache.models.layer_plan import LayerAttention
from paxcache.models.llama import LlamaForCausalLM, _dense, rope_cos_sin
from paxcache.models.llama_config import ConfigError, LlamaConfig, rope_inv_freq

__all__ = ["GEMMA_MODEL_TYPES", "GemmaConfig", "GemmaForCausalLM"]

GEMMA_MODEL_TYPES = tuple(mt for mt, f in FAMILIES.items() if f.config_class == "gemma")
LAYER_TYPES = ("sliding_attention", "full_attention")
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")

# HF's defaults for fields a config.json may omit (Gemma2Config / Gemma3TextConfig).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
    },
    "gemma3_text": {
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
    },
}


@dataclasses.dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    """A Gemma 2 / Gemma 3 text config: :class:`LlamaConfig` plus Gemma's fields.

    Attributes (besides LlamaConfig's; ``sliding_windows`` holds each layer's window):
        layer_types: per layer "sliding_attention" or "full_attention" (length L; empty:
            derived from ``sliding_windows``).
        query_pre_attn_scalar: attention logits are scaled by its ``** -0.5``.
        attn_logit_softcapping: attention logit soft cap, or None.
        final_logit_softcapping: LM-head logit soft cap, or None.
        local_rope_theta: RoPE base of sliding layers (Gemma 3); None: every layer uses
            ``rope_theta`` / ``rope_scaling`` (Gemma 2).
        local_rope_scaling: ``rope_scaling`` of sliding layers (Gemma 3; usually None).
        hidden_activation: the MLP gate activation; only GeLU-tanh.
    """

    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: Mapping[str, Any] | None = None
    hidden_activation: str = "gelu_pytorch_tanh"

    __hash__ = LlamaConfig.__hash__

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_type not in GEMMA_MODEL_TYPES:
            raise ConfigError(
                f"GemmaConfig model_type must be one of {GEMMA_MODEL_TYPES}, got "
                f"{self.model_type!r}"
            )
        windows = self.layer_windows()
        if not self.layer_types:
            object.__setattr__(
                self,
                "layer_types",
                tuple(LAYER_TYPES[w is None] for w in windows),
            )
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(
            LAYER_TYPES
        ):
            raise ConfigError(
                f"layer_types must be {self.num_hidden_layers} entries of {LAYER_TYPES}, got "
                f"{list(self.layer_types)[:8]}"
            )
        for i, (t, w) in enumerate(zip(self.layer_types, windows, strict=True)):
            if t == "full_attention" and w is not None:
                raise ConfigError(f"layer {i} is full_attention but has sliding window {w}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is None and name != "query_pre_attn_scalar":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ConfigError(f"config field {name} must be a positive number, got {v!r}")
        if self.hidden_activation not in _ACTIVATIONS:
            raise ConfigError(
                f"config field hidden_activation={self.hidden_activation!r}; only {_ACTIVATIONS}"
            )
        if self.local_rope_scaling is not None:
            object.__setattr__(self, "local_rope_scaling", dict(self.local_rope_scaling))
        if self.local_rope_theta is not None:
            rope_inv_freq(self.local_rope())  # validates the sliding layers' RoPE

    def local_rope(self) -> LlamaConfig:
        """A config whose RoPE fields are the sliding layers' (for :func:`rope_cos_sin`)."""
        if self.local_rope_theta is None:
            return self
        return dataclasses.replace(
            self,
            rope_theta=self.local_rope_theta,
            rope_scaling=self.local_rope_scaling,
            local_rope_theta=None,
            local_rope_scaling=None,
        )

    def layer_attention(self) -> tuple[LayerAttention, ...]:
        """Per layer: its window, Gemma's scale and soft cap, and its RoPE table's name."""
        scale = float(self.query_pre_attn_scalar) ** -0.5
        cap = self.attn_logit_softcapping
        return tuple(
            LayerAttention(
                sliding_window=w,
                soft_cap=None if cap is None else float(cap),
                sm_scale=scale,
                rope="default" if self.local_rope_theta is None else t,
            )
            for w, t in zip(self.layer_windows(), self.layer_types, strict=True)
        )

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> GemmaConfig:
        """Builds a config from a Gemma 2 / Gemma 3 text ``config.json`` dict.

        Reads transformers 5's ``rope_parameters`` (flat for Gemma 2; per layer type for
        Gemma 3) and ``layer_types``, and the older hub keys ``rope_theta``,
        ``rope_scaling`` (Gemma 3: full layers only), ``rope_local_base_freq`` and
        ``sliding_window_pattern`` (Gemma 2: every other layer sliding, the first one
        included). Missing fields take HF's defaults.

        Raises:
            ConfigError: an unsupported feature (bidirectional attention, an activation other
                than GeLU-tanh, an unknown layer type or RoPE type) or a malformed field, named.
        """
        mt = d.get("model_type")
        if mt not in GEMMA_MODEL_TYPES:
            raise ConfigError(f"not a Gemma model_type: {mt!r}; supported: {GEMMA_MODEL_TYPES}")
        defaults = _DEFAULTS[mt]
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if name not in d:
                raise ConfigError(f"config.json is missing required field {name!r}")
        if d.get("use_bidirectional_attention"):
            raise ConfigError("config.json field use_bidirectional_attention=true is not supported")
        if d.get("mlp_bias"):
            raise ConfigError("config.json field mlp_bias=true is not supported")
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        n = int(d["num_hidden_layers"])
        layer_types = d.get("layer_types")
        if layer_types is None:
            period = 2 if mt == "gemma2" else d.get("sliding_window_pattern")
            period = defaults.get("sliding_window_pattern", 2) if period is None else period
            if isinstance(period, bool) or not isinstance(period, int) or period < 1:
                raise ConfigError(
                    f"config field sliding_window_pattern must be a positive int, got {period!r}"
                )
            layer_types = [LAYER_TYPES[(i + 1) % period == 0] for i in range(n)]
        bad = [t for t in layer_types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"config field layer_types has unsupported entries {bad[:4]}")
        sw = d.get("sliding_window", 4096)
        windows = tuple(
            int(sw) if t == "sliding_attention" and sw is not None else None for t in layer_types
        )
        full, local = _gemma_rope(mt, d, defaults)
        caps = {
            k: d.get(k, defaults[k]) for k in ("attn_logit_softcapping", "final_logit_softcapping")
        }
        ab = bool(d.get("attention_bias", False))
        head_dim = d.get("head_dim")
        heads = int(d.get("num_attention_heads", 8))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or 4),
            head_dim=int(head_dim) if head_dim is not None else 256,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=full[0],
            rope_scaling=full[1],
            max_position_embeddings=int(
                d.get("max_position_embeddings", defaults["max_position_embeddings"])
            ),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            qkv_bias=ab,
            o_bias=ab,
            sliding_windows=windows if any(w is not None for w in windows) else (),
            qk_norm=FAMILIES[mt].qk_norm,
            norm_placement=FAMILIES[mt].norm_placement,
            model_type=mt,
            bos_token_id=d.get("bos_token_id", 2),
            eos_token_id=d.get("eos_token_id", 1),
            pad_token_id=d.get("pad_token_id", 0),
            layer_types=tuple(layer_types),
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
            attn_logit_softcapping=caps["attn_logit_softcapping"],
            final_logit_softcapping=caps["final_logit_softcapping"],
            local_rope_theta=None if local is None else local[0],
            local_rope_scaling=None if local is None else local[1],
            hidden_activation=act,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers-5 ``config.json`` dict (``rope_parameters``, ``layer_types``)."""
        fam = FAMILIES[self.model_type]
        if (self.qk_norm, self.norm_placement) != (fam.qk_norm, fam.norm_placement):
            raise ConfigError(f"{self.model_type} has qk_norm={fam.qk_norm!r}")
        if self.qkv_bias != self.o_bias:
            raise ConfigError(f"{self.model_type} attention_bias covers q/k/v/o together")
        if self.partial_rotary_factor != 1.0:
            raise ConfigError(f"{self.model_type} has no partial_rotary_factor")
        used = {w for w in self.layer_windows() if w is not None}
        if len(used) > 1:
            raise ConfigError(f"{self.model_type} uses one sliding window size")

        def rope(theta: float, scaling: Mapping[str, Any] | None) -> dict[str, Any]:
            return {"rope_type": "default", **(scaling or {}), "rope_theta": theta}

        if self.local_rope_theta is None:
            if self.model_type == "gemma3_text":
                raise ConfigError("gemma3_text needs local_rope_theta (rope_local_base_freq)")
            rope_parameters: dict[str, Any] = rope(self.rope_theta, self.rope_scaling)
        else:
            rope_parameters = {
                "full_attention": rope(self.rope_theta, self.rope_scaling),
                "sliding_attention": rope(self.local_rope_theta, self.local_rope_scaling),
            }
        return {
            **self._hf_common_fields(),
            "hidden_activation": self.hidden_activation,
            "rope_parameters": rope_parameters,
            "attention_bias": self.qkv_bias,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
            "sliding_window": used.pop() if used else None,
            "layer_types": list(self.layer_types),
        }


def _rope_entry(name: str, rp: Any, theta_default: float) -> tuple[float, dict[str, Any] | None]:
    """(theta, rope_scaling or None) from one rope-parameters dict."""
    if rp is None:
        rp = {}
    if not isinstance(rp, Mapping):
        raise ConfigError(f"config field {name} must be an object, got {rp!r}")
    theta = rp.get("rope_theta", theta_default)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ConfigError(
            f"config field {name}.rope_theta must be a positive number, got {theta!r}"
        )
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"config field {name}.partial_rotary_factor is not supported for Gemma")
    kind = rp.get("rope_type", rp.get("type", "default"))
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return float(theta), scaling


def _gemma_rope(
    mt: str, d: Mapping[str, Any], defaults: Mapping[str, Any]
) -> tuple[tuple[float, dict | None], tuple[float, dict | None] | None]:
    """(full layers' (theta, scaling), sliding layers' or None for Gemma 2), as HF's
    ``convert_rope_params_to_dict`` reads the new and the old keys."""
    rp = d.get("rope_parameters")
    theta = d.get("rope_theta")
    if mt == "gemma2":
        merged = dict(rp) if isinstance(rp, Mapping) else {}
        if d.get("rope_scaling"):
            merged.update(d["rope_scaling"])
        if theta is not None:
            merged.setdefault("rope_theta", theta)
        return _rope_entry("rope_parameters", merged, defaults["rope_theta"]), None
    if rp is not None and (
        not isinstance(rp, Mapping) or not set(rp) <= set(LAYER_TYPES) or not rp
    ):
        keys = sorted(rp) if isinstance(rp, Mapping) else rp
        raise ConfigError(
            "gemma3_text config field rope_parameters must map layer types "
            f"{LAYER_TYPES} to rope settings, got {keys!r}"
        )
    rp = {k: dict(v or {}) for k, v in (rp or {}).items()}
    full = rp.get("full_attention") or {}
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    full.setdefault("rope_theta", theta if theta is not None else defaults["rope_theta"])
    local = rp.get("sliding_attention") or {}
    local.setdefault("rope_theta", d.get("rope_local_base_freq", defaults["rope_local_base_freq"]))
    return (
        _rope_entry("rope_parameters.full_attention", full, defaults["rope_theta"]),
        _rope_entry("rope_parameters.sliding_attention", local, defaults["rope_local_base_freq"]),
    )


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text causal LM (see the module docstring for what differs).

    Same attributes, dense and paged forwards and KV cache as
    :class:`~paxcache.models.llama.LlamaForCausalLM`; ``config`` is a :class:`GemmaConfig`.

    Example:
        >>> model = GemmaForCausalLM(GemmaConfig(..., model_type="gemma2"), rngs=nnx.Rngs(0))
        >>> logits = model(jnp.zeros((1, 8), jnp.int32))  # f32[1, 8, V], soft-capped
    """

    config: GemmaConfig

    def embed(self, token_ids: jax.Array) -> jax.Array:
        """i32[...] -> [..., E]: embeddings times ``sqrt(E)`` rounded to the compute dtype."""
        x = jnp.take(self.embed_tokens[...], token_ids, axis=0).astype(self.dtype)
        return x * jnp.asarray(self.config.hidden_size**0.5, self.dtype)

    def rope_tables(
        self, positions: jax.Array, seq_lens: jax.Array | None = None
    ) -> dict[str, tuple[jax.Array, jax.Array]]:
        """RoPE tables per name: ``"default"`` (Gemma 2), or the full and sliding layers'."""
        cfg = self.config
        if cfg.local_rope_theta is None:
            return {"default": rope_cos_sin(cfg, positions, seq_lens)}
        used = set(cfg.layer_types)
        tables = {}
        if "full_attention" in used:
            tables["full_attention"] = rope_cos_sin(cfg, positions, seq_lens)
        if "sliding_attention" in used:
            tables["sliding_attention"] = rope_cos_sin(cfg.local_rope(), positions, seq_lens)
        return tables

    def _finish_layer(
        self, lp: Mapping[str, jax.Array], x: jax.Array, attn: jax.Array
    ) -> jax.Array:
        """o_proj, post-attention norm, residual; pre-FF norm, GeLU-tanh MLP, post-FF norm,
        residual. x: [..., T, E]; attn: [..., T, H, D] -> [..., T, E]."""
        cfg = self.config
        attn = attn.reshape(*attn.shape[:-2], cfg.num_attention_heads * cfg.head_dim)
        o = _dense(attn, lp["o_proj"], lp.get("o_bias"), self.dtype)
        x = x + self._norm(o, lp["post_attention_layernorm"])
        h = self._norm(x, lp["pre_feedforward_layernorm"])
        mlp = self._mlp(lp, h, act=lambda g: jax.nn.gelu(g, approximate=True))
        return x + self._norm(mlp, lp["post_feedforward_layernorm"])

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden [..., E] -> f32[..., V] logits, soft-capped when configured."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits
