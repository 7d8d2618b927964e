"""The Llama-family configuration: :class:`LlamaConfig` (Llama 2/3, Mistral, Qwen2, Qwen3,
OLMo 2, Phi-3), read from and written to HF ``config.json`` dictionaries, and
:class:`ConfigError`. What differs per family is in :mod:`paxcache.models.families`.

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
from paxcache.models.families import FAMILIES, NORM_PLACEMENTS, QK_NORMS
from paxcache.models.layer_plan import LayerAttention

__all__ = [
    "NO_WINDOW",
    "SUPPORTED_MODEL_TYPES",
    "ConfigError",
    "LlamaConfig",
    "rope_attention_scaling",
    "rope_inv_freq",
]

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

# Phi3Config's default original_max_position_embeddings (HF applies it when config.json omits it).
_PHI3_ORIGINAL_MAX_POSITIONS = 4096

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
            {"default", "linear", "llama3", "longrope", "yarn"}. A longrope dict is kept resolved:
            ``short_factor``, ``long_factor`` (R/2 numbers each),
            ``original_max_position_embeddings`` and ``attention_factor``.
        max_position_embeddings: longest supported position.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        qkv_bias: q/k/v projections have a bias (Qwen2; Llama ``attention_bias``).
        o_bias: the output projection has a bias (Llama ``attention_bias``).
        sliding_windows: per-layer sliding window (tokens a query may see, itself included),
            None for full attention. Empty tuple means no layer uses a window.
        qk_norm: "none", "head" (RMSNorm over each head's D, weights [D]: Qwen3) or "full"
            (over the whole q/k projection, weights [H*D] / [K*D]: OLMo 2), before RoPE.
        norm_placement: "pre" (RMSNorm before attention and MLP) or "post" (on their outputs,
            before the residual add, and no input norm: OLMo 2).
        partial_rotary_factor: RoPE rotates the first R = int(D * factor) dims of each head.
        model_type: one of ``SUPPORTED_MODEL_TYPES``.
        bos_token_id, eos_token_id, pad_token_id: special ids (eos may be a tuple).
        kv_cache_absmax: None, or ``(k, v)``: per-layer abs-max bounds of K and V that a
            pre-quantized checkpoint's ``kv_cache_scheme`` fixes (its ``k_scale`` /
            ``v_scale`` times its 8-bit type's largest value; set by the loader, not read from
            config.json). An engine with an 8-bit ``kv_cache_dtype`` takes its cache scales
            from them instead of calibrating.
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
    qk_norm: str = "none"
    norm_placement: str = "pre"
    partial_rotary_factor: float = 1.0
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    kv_cache_absmax: tuple[tuple[float, ...], tuple[float, ...]] | None = None

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
        if FAMILIES[self.model_type].moe and not hasattr(self, "num_experts"):
            raise ConfigError(
                f"model_type {self.model_type!r} is a mixture of experts: use "
                "paxcache.models.MoeConfig (LlamaConfig.from_hf_dict returns one)"
            )
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(
                f"config field qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}"
            )
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ConfigError(
                f"config field norm_placement must be one of {NORM_PLACEMENTS}, "
                f"got {self.norm_placement!r}"
            )
        prf = self.partial_rotary_factor
        if not isinstance(prf, (int, float)) or not 0 < prf <= 1:
            raise ConfigError(f"config field partial_rotary_factor must be in (0, 1], got {prf!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(
                f"partial_rotary_factor {prf} gives {self.rotary_dim} rotary dims of head_dim "
                f"{self.head_dim}; they must be even and at least 2"
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
    def rotary_dim(self) -> int:
        """R: the leading dims of each head that RoPE rotates (D unless partial)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def norm_weight_f32(self) -> bool:
        """RMSNorm scales in float32 before casting back (OLMo 2), not after (Llama)."""
        return FAMILIES[self.model_type].norm_weight_f32

    @property
    def norm_offset(self) -> float:
        """RMSNorm scales by ``norm_offset + weight`` (Gemma: 1), else by the weight (0)."""
        return FAMILIES[self.model_type].norm_offset

    def layer_attention(self) -> tuple[LayerAttention, ...]:
        """Each layer's static attention options (length L): here only its window."""
        return tuple(LayerAttention(sliding_window=w) for w in self.layer_windows())

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
    def rope_switch_len(self) -> int | None:
        """The sequence length past which every position's RoPE changes (longrope:
        ``original_max_position_embeddings``; a sequence longer than it uses the long factors
        for all its tokens, HF's rule), or None when RoPE never depends on the length. A
        sequence that crosses it must have its cached K/V recomputed (the engine's scheduler
        does, as HF's ``generate`` drops its cache there)."""
        rs = self.rope_scaling
        if rs and rs.get("rope_type") == "longrope":
            return int(rs["original_max_position_embeddings"])
        return None

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
        norms = 4 if self.norm_placement == "sandwich" else 2
        per_layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f + norms * e
        if self.qk_norm == "head":
            per_layer += 2 * d
        elif self.qk_norm == "full":
            per_layer += h * d + k * d
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

        Reads both the older top-level ``rope_theta`` / ``rope_scaling`` /
        ``partial_rotary_factor`` and transformers >= 5's ``rope_parameters`` dict.

        Raises:
            ConfigError: unsupported ``model_type``, missing required field, unsupported
                feature (e.g. ``mlp_bias``, an unknown ``rope_scaling`` type), a malformed
                longrope ``rope_scaling``; the message names the field.
        """
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r} in config.json; "
                f"supported: {SUPPORTED_MODEL_TYPES}"
            )
        fam = FAMILIES[model_type]
        if fam.config_class == "gemma" and cls is LlamaConfig:
            from paxcache.models.gemma import GemmaConfig  # noqa: PLC0415 (it imports us)

            return GemmaConfig.from_hf_dict(d)
        if fam.config_class == "gpt_oss" and not hasattr(cls, "swiglu_limit"):
            from paxcache.models.gpt_oss import GptOssConfig  # noqa: PLC0415 (it imports us)

            return GptOssConfig.from_hf_dict(d)
        if fam.moe and not hasattr(cls, "num_experts"):  # Mixtral, Qwen3-MoE: their config
            from paxcache.models.moe import MoeConfig  # noqa: PLC0415 (it imports us)

            return MoeConfig.from_hf_dict(d)
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
        if d.get("clip_qkv") is not None:
            raise ConfigError("config.json field clip_qkv is not supported")
        n_layers = int(d["num_hidden_layers"])

        # Sliding windows per layer.
        windows: tuple[int | None, ...] = ()
        sw = d.get("sliding_window")
        if fam.windows == "all" or (fam.windows == "flag" and d.get("use_sliding_window")):
            if sw is not None:
                windows = (int(sw),) * n_layers
        elif fam.windows == "layered" and d.get("use_sliding_window") and sw is not None:
            layer_types = d.get("layer_types")
            if layer_types is None:
                mwl = int(d.get("max_window_layers", n_layers))
                layer_types = [
                    "sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)
                ]
            windows = tuple(int(sw) if t == "sliding_attention" else None for t in layer_types)
            if all(w is None for w in windows):
                windows = ()
        if fam.bias == "qkv":
            qkv_bias, o_bias = True, False
        elif fam.bias == "none":
            qkv_bias, o_bias = False, False
        else:
            ab = bool(d.get("attention_bias", False))
            qkv_bias, o_bias = ab, ab

        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        partial = d.get("partial_rotary_factor")
        # transformers >= 5 writes both into one dict, rope_parameters = {"rope_theta": ...,
        # "rope_type": ..., scaling fields}; a missed theta would silently rotate wrong.
        rope_params = d.get("rope_parameters")
        if isinstance(rope_params, Mapping):
            if rope_theta is None:
                rope_theta = rope_params.get("rope_theta")
            if partial is None:
                partial = rope_params.get("partial_rotary_factor")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = {
                    k: v
                    for k, v in rope_params.items()
                    if k not in ("rope_theta", "partial_rotary_factor")
                }
        if partial is not None and (
            isinstance(partial, bool) or not isinstance(partial, (int, float))
        ):
            raise ConfigError(
                f"config field partial_rotary_factor must be a number, got {partial!r}"
            )
        max_pos = int(d.get("max_position_embeddings", 2048))
        if isinstance(rope_scaling, Mapping) and _rope_type(rope_scaling) in ("longrope", "su"):
            orig = d.get("original_max_position_embeddings")
            if orig is None and model_type == "phi3":
                orig = rope_scaling.get(
                    "original_max_position_embeddings", _PHI3_ORIGINAL_MAX_POSITIONS
                )
            rope_scaling = _resolve_longrope(rope_scaling, orig, max_pos)
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
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_windows=windows,
            qk_norm=fam.qk_norm,
            norm_placement=fam.norm_placement,
            partial_rotary_factor=float(partial) if partial is not None else 1.0,
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )

    def _hf_common_fields(self) -> dict[str, Any]:
        """The ``config.json`` fields every family writes alike (shapes, norms, tokens)."""
        eos = self.eos_token_id
        return {
            "architectures": [FAMILIES[self.model_type].architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
            "pad_token_id": self.pad_token_id,
        }

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this config (round-trips through from_hf_dict).

        Raises:
            ConfigError: the config uses a feature its ``model_type`` cannot express (e.g.
                q/k norms on a llama, a bias on a phi3, different windows on a mistral).
        """
        fam = FAMILIES[self.model_type]
        if (self.qk_norm, self.norm_placement) != (fam.qk_norm, fam.norm_placement):
            raise ConfigError(
                f"{self.model_type} has qk_norm={fam.qk_norm!r}, norm_placement="
                f"{fam.norm_placement!r}; this config has {self.qk_norm!r}, "
                f"{self.norm_placement!r}"
            )
        d: dict[str, Any] = {
            **self._hf_common_fields(),
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
        }
        if self.partial_rotary_factor != 1.0:
            d["partial_rotary_factor"] = self.partial_rotary_factor
        rs = self.rope_scaling
        if rs and rs.get("rope_type") == "longrope":
            d["original_max_position_embeddings"] = rs["original_max_position_embeddings"]
        if fam.bias == "attention_bias" and self.model_type != "mistral":
            if self.qkv_bias != self.o_bias:
                raise ConfigError(f"{self.model_type} attention_bias covers q/k/v/o together")
            d["attention_bias"] = self.qkv_bias
        elif fam.bias == "qkv" and (not self.qkv_bias or self.o_bias):
            raise ConfigError(f"{self.model_type} always has q/k/v bias and no o bias")
        elif fam.bias != "qkv" and (self.qkv_bias or self.o_bias):
            raise ConfigError(f"{self.model_type} has no attention bias")
        ws = self.layer_windows()
        used = [w for w in ws if w is not None]
        if fam.windows in ("all", "flag"):
            if used and (len(set(used)) > 1 or len(used) != len(ws)):
                raise ConfigError(f"{self.model_type} uses one sliding window on every layer")
            d["sliding_window"] = used[0] if used else None
            if fam.windows == "flag":
                d["use_sliding_window"] = bool(used)
        elif fam.windows == "layered":
            d["use_sliding_window"] = bool(used)
            d["sliding_window"] = used[0] if used else None
            d["max_window_layers"] = self.num_hidden_layers
            if used:
                if len(set(used)) > 1:
                    raise ConfigError(f"{self.model_type} uses one sliding window size")
                d["layer_types"] = [
                    "full_attention" if w is None else "sliding_attention" for w in ws
                ]
        elif used:
            raise ConfigError(f"{self.model_type} has no sliding window")
        return d


def _rope_type(rs: Mapping[str, Any]) -> str:
    return rs.get("rope_type", rs.get("type", "default"))


def _resolve_longrope(rs: Mapping[str, Any], orig: Any, max_pos: int) -> dict[str, Any]:
    """A longrope (alias su) ``rope_scaling`` with HF's defaults made explicit.

    Follows transformers' ``_compute_longrope_parameters``: the pretraining length is the
    config's top-level ``original_max_position_embeddings`` (Phi3Config defaults it to 4096),
    else the rope dict's, else ``max_position_embeddings``; ``factor`` defaults to
    ``max_position_embeddings / original``; ``attention_factor`` defaults to
    ``sqrt(1 + log(factor) / log(original))`` (1 when ``factor <= 1``).

    Raises:
        ConfigError: a missing or malformed field, named.
    """
    if orig is None:
        orig = rs.get("original_max_position_embeddings", max_pos)
    if isinstance(orig, bool) or not isinstance(orig, int) or orig < 2:
        raise ConfigError(
            f"original_max_position_embeddings must be an int >= 2 for longrope, got {orig!r}"
        )
    factor = rs.get("factor")
    if factor is None:
        factor = max_pos / orig
    att = rs.get("attention_factor")
    for name, v in (("factor", factor), ("attention_factor", att)):
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
        ):
            raise ConfigError(f"rope_scaling.{name} must be a positive number, got {v!r}")
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    out: dict[str, Any] = {"rope_type": "longrope"}
    for name in ("short_factor", "long_factor"):
        v = rs.get(name)
        if not isinstance(v, (list, tuple)) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
            for x in v
        ):
            raise ConfigError(
                f"rope_scaling.{name} of type longrope must be a list of positive numbers, "
                f"got {str(v)[:80]}"
            )
        out[name] = [float(x) for x in v]
    out["original_max_position_embeddings"] = orig
    out["attention_factor"] = float(att)
    return out


def rope_inv_freq(cfg: LlamaConfig, long: bool = False) -> jax.Array:
    """f32[R/2] inverse frequencies of the R rotary dims, with HF ``rope_scaling`` applied.

    Args:
        cfg: the config.
        long: for longrope, the frequencies of sequences longer than
            ``original_max_position_embeddings`` (``long_factor``); the short ones otherwise.
            Ignored by the other RoPE types.

    Raises:
        ConfigError: an unsupported type or a missing / malformed field, named.
    """
    d = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = cfg.rope_scaling
    if not rs:
        return inv_freq
    rope_type = _rope_type(rs)
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
    if rope_type in ("longrope", "su"):
        for name in ("short_factor", "long_factor"):
            n = len(rs.get(name) or ())
            if n != d // 2:
                raise ConfigError(
                    f"rope_scaling.{name} has {n} entries, expected rotary_dim / 2 = {d // 2} "
                    f"(head_dim {cfg.head_dim} x partial_rotary_factor "
                    f"{cfg.partial_rotary_factor})"
                )
        if "original_max_position_embeddings" not in rs or "attention_factor" not in rs:
            raise ConfigError(
                "rope_scaling of type longrope needs original_max_position_embeddings and "
                "attention_factor (LlamaConfig.from_hf_dict fills in HF's defaults)"
            )
        ext = jnp.asarray(rs["long_factor" if long else "short_factor"], jnp.float32)
        # HF's order of operations: 1 / (ext * base ** (i / R)).
        return 1.0 / (ext * cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if rope_type == "yarn":
        return _yarn_inv_freq(rs, d, cfg.rope_theta, cfg.max_position_embeddings)
    raise ConfigError(
        f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3, "
        "longrope, yarn"
    )


def _yarn_numbers(rs: Mapping[str, Any], max_pos: int) -> tuple[float, float, int]:
    """(factor, attention_factor, original_max_position_embeddings) of a yarn ``rope_scaling``,
    with HF's defaults (``_compute_yarn_parameters``).

    Raises:
        ConfigError: a missing or malformed field, named.
    """
    orig = rs.get("original_max_position_embeddings", max_pos)
    if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
        raise ConfigError(
            f"rope_scaling.original_max_position_embeddings must be a positive int for yarn, "
            f"got {orig!r}"
        )
    factor = rs.get("factor")
    if factor is None:
        factor = max_pos / orig
    for name in (
        "factor",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    ):
        v = factor if name == "factor" else rs.get(name)
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
        ):
            raise ConfigError(
                f"rope_scaling.{name} of type yarn must be a positive number, got {v!r}"
            )

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rs.get("attention_factor")
    if att is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return float(factor), float(att), orig


def _yarn_inv_freq(rs: Mapping[str, Any], d: int, base: float, max_pos: int) -> jax.Array:
    """YaRN inverse frequencies (HF ``_compute_yarn_parameters``): interpolated by ``factor``
    below the ``beta_slow`` rotation count, extrapolated above ``beta_fast``, a linear ramp
    between; ``truncate`` (default true) rounds the ramp's ends outwards to whole dims."""
    factor, _, orig = _yarn_numbers(rs, max_pos)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # HF: no zero-width ramp
    pos_freqs = base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation


def rope_attention_scaling(cfg: LlamaConfig) -> float:
    """The factor HF multiplies cos and sin by: longrope's and yarn's ``attention_factor``
    (yarn's default ``0.1 * ln(factor) + 1``), else 1."""
    rs = cfg.rope_scaling
    if rs and _rope_type(rs) in ("longrope", "su"):
        return float(rs["attention_factor"])
    if rs and _rope_type(rs) == "yarn":
        return _yarn_numbers(rs, cfg.max_position_embeddings)[1]
    return 1.0
