"""A Llama-family decoder in Flax NNX: Llama 2/3, Mistral and Qwen2 from one code path.

Shape letters: B batch, T tokens, E hidden size, F intermediate size, H query heads,
K kv heads, D head dim, L layers, V vocabulary, N blocks, S block size.

Per-layer weights are stacked with a leading ``[L]`` axis and the layers run under
``jax.lax.scan``, so compile time does not grow with depth. Linear weights are stored as
``[in, out]`` (the transpose of HF's ``nn.Linear.weight``). q/k projections keep HF's
*rotate-half* RoPE convention (the first and second halves of each head are the two
rotation coordinates), so HF checkpoints load without permuting rows.

Two forward paths share the per-layer code:

* ``model(token_ids)``: the dense causal forward with no cache (the reference).
* ``model.forward_paged(token_ids, kv_pages, metadata)``: a flat (ragged) batch of tokens whose
  attention and KV writes go through the model's own :class:`paxcache.nn.PagedAttention`
  layer, the same layer a user's model calls (README, "Paged attention in your own Flax
  model"). The step's :class:`~paxcache.attention.AttentionMetadata` gives the positions, the
  block tables and how the op runs (kernel, mesh); the KV pages travel through the scan carry
  so XLA can update them in place.

Numerics: parameters are stored in ``param_dtype``; matmuls run in ``dtype`` with float32
accumulation; RMSNorm statistics, RoPE, softmax and logits are float32.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from paxcache.attention import AttentionMetadata
from paxcache.errors import PaxcacheError
from paxcache.nn import PagedAttention

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
        _rope_inv_freq(self)  # validates rope_scaling

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


# ------------------------------------------------------------------------------------------
# Building blocks (pure functions over arrays)
# ------------------------------------------------------------------------------------------


def _rope_inv_freq(cfg: LlamaConfig) -> jax.Array:
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


def rope_cos_sin(cfg: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE tables for the rotate-half convention.

    Args:
        positions: i32[...] token positions.

    Returns:
        cos, sin: f32[..., D] (each frequency repeated for both halves).
    """
    inv_freq = _rope_inv_freq(cfg)
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x: [..., T, heads, D]`` by ``cos/sin: [..., T, D]`` (HF rotate-half)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[..., None, :] + rot * sin[..., None, :]
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with float32 statistics; returns ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)  # HF order: cast, then scale


def _dense(x: jax.Array, w: jax.Array, b: jax.Array | None, dtype: Any) -> jax.Array:
    y = jnp.einsum(
        "...i,io->...o", x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32
    )
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(dtype)


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    window: jax.Array | int,
    k_valid: jax.Array | None = None,
) -> jax.Array:
    """Causal (optionally windowed) GQA attention over explicit positions.

    Args:
        q: [B, T, H, D] queries (RoPE applied, not pre-scaled).
        k, v: [B, S, K, D].
        q_pos: i32[B, T]; k_pos: i32[B, S] positions.
        window: i32 scalar; query at p sees keys at p - window < pos <= p.
            Use ``NO_WINDOW`` for full causal attention.
        k_valid: optional bool[B, S]; False keys are never attended.

    Returns:
        [B, T, H, D] in q's dtype. Softmax is float32. A query with no visible key
        returns zeros.
    """
    b, t, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    qg = q.reshape(b, t, kh, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    mask = (kp <= qp) & (kp > qp - window)  # [B, T, S]
    if k_valid is not None:
        mask = mask & k_valid[:, None, :]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


# ------------------------------------------------------------------------------------------
# NNX modules
# ------------------------------------------------------------------------------------------


class LlamaLayers(nnx.Module):
    """All decoder layers' weights, stacked on a leading ``[L]`` axis.

    Attributes (shapes; linear weights are ``[in, out]``):
        input_layernorm: [L, E];  post_attention_layernorm: [L, E]
        q_proj: [L, E, H*D]; k_proj, v_proj: [L, E, K*D]; o_proj: [L, H*D, E]
        q_bias: [L, H*D]; k_bias, v_bias: [L, K*D] (when ``qkv_bias``); o_bias: [L, E]
        gate_proj, up_proj: [L, E, F]; down_proj: [L, F, E]
    """

    def __init__(self, cfg: LlamaConfig, *, param_dtype: Any, rngs: nnx.Rngs) -> None:
        n, e, f = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
        hd, kd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        init = jax.nn.initializers.normal(0.02)

        def w(*shape: int) -> nnx.Param:
            return nnx.Param(init(rngs.params(), shape, jnp.float32).astype(param_dtype))

        def ones(*shape: int) -> nnx.Param:
            return nnx.Param(jnp.ones(shape, param_dtype))

        def zeros(*shape: int) -> nnx.Param:
            return nnx.Param(jnp.zeros(shape, param_dtype))

        self.input_layernorm = ones(n, e)
        self.post_attention_layernorm = ones(n, e)
        self.q_proj = w(n, e, hd)
        self.k_proj = w(n, e, kd)
        self.v_proj = w(n, e, kd)
        self.o_proj = w(n, hd, e)
        self.q_bias = zeros(n, hd) if cfg.qkv_bias else None
        self.k_bias = zeros(n, kd) if cfg.qkv_bias else None
        self.v_bias = zeros(n, kd) if cfg.qkv_bias else None
        self.o_bias = zeros(n, e) if cfg.o_bias else None
        self.gate_proj = w(n, e, f)
        self.up_proj = w(n, e, f)
        self.down_proj = w(n, f, e)

    PARAM_NAMES = (
        "input_layernorm",
        "post_attention_layernorm",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "q_bias",
        "k_bias",
        "v_bias",
        "o_bias",
        "gate_proj",
        "up_proj",
        "down_proj",
    )

    def stacked(self) -> dict[str, jax.Array]:
        """The stacked arrays as a dict (None-valued biases omitted), for ``lax.scan`` xs."""
        out = {}
        for name in self.PARAM_NAMES:
            p = getattr(self, name)
            if p is not None:
                out[name] = p[...]
        return out


class LlamaForCausalLM(nnx.Module):
    """Llama-family causal LM (Llama 2/3, Mistral, Qwen2).

    Example:
        >>> model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
        >>> logits = model(jnp.zeros((1, 8), jnp.int32))  # f32[1, 8, V]

    Attributes:
        config: the LlamaConfig.
        dtype: compute dtype for matmuls and activations.
        embed_tokens: [V, E].
        layers: LlamaLayers (stacked [L, ...] weights).
        norm: [E] final RMSNorm weight.
        lm_head: [E, V], or None when embeddings are tied.
        attention: the paged attention layer of every layer (no weights; built with the
            model's heads, head dim and sliding window).
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = config
        self.dtype = jnp.dtype(dtype)
        e, v = config.hidden_size, config.vocab_size
        init = jax.nn.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (v, e), jnp.float32).astype(param_dtype))
        self.layers = LlamaLayers(config, param_dtype=param_dtype, rngs=rngs)
        self.norm = nnx.Param(jnp.ones((e,), param_dtype))
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Param(init(rngs.params(), (e, v), jnp.float32).astype(param_dtype))
        windows = set(config.layer_windows())
        self.attention = PagedAttention(
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            # Layers with different windows cannot share one layer: forward_paged refuses.
            sliding_window=next(iter(windows)) if len(windows) == 1 else None,
        )

    # -- shared per-layer pieces -----------------------------------------------------------

    def _windows(self) -> jax.Array:
        return jnp.asarray(
            [NO_WINDOW if w is None else w for w in self.config.layer_windows()], jnp.int32
        )

    def _qkv(
        self, lp: Mapping[str, jax.Array], x: jax.Array, cos: jax.Array, sin: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Pre-norm + q/k/v projection + RoPE for one layer.

        Args:
            lp: one layer's params (the ``[L]`` axis removed).
            x: [..., T, E] residual stream.
            cos, sin: [..., T, D].

        Returns:
            q: [..., T, H, D], k and v: [..., T, K, D] in the compute dtype.
        """
        cfg, dt = self.config, self.dtype
        h = rms_norm(x, lp["input_layernorm"], cfg.rms_norm_eps)
        q = _dense(h, lp["q_proj"], lp.get("q_bias"), dt)
        k = _dense(h, lp["k_proj"], lp.get("k_bias"), dt)
        v = _dense(h, lp["v_proj"], lp.get("v_bias"), dt)
        lead = x.shape[:-1]
        q = q.reshape(*lead, cfg.num_attention_heads, cfg.head_dim)
        k = k.reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish_layer(
        self, lp: Mapping[str, jax.Array], x: jax.Array, attn: jax.Array
    ) -> jax.Array:
        """Output projection, residual, MLP block for one layer.

        Args:
            x: [..., T, E] residual stream before this layer.
            attn: [..., T, H, D] attention output.

        Returns:
            [..., T, E] residual stream after this layer.
        """
        cfg, dt = self.config, self.dtype
        attn = attn.reshape(*attn.shape[:-2], cfg.num_attention_heads * cfg.head_dim)
        x = x + _dense(attn, lp["o_proj"], lp.get("o_bias"), dt)
        h = rms_norm(x, lp["post_attention_layernorm"], cfg.rms_norm_eps)
        gate = _dense(h, lp["gate_proj"], None, dt)
        up = _dense(h, lp["up_proj"], None, dt)
        act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dt)
        return x + _dense(act, lp["down_proj"], None, dt)

    def embed(self, token_ids: jax.Array) -> jax.Array:
        """i32[...] -> [..., E] embeddings in the compute dtype."""
        return jnp.take(self.embed_tokens[...], token_ids, axis=0).astype(self.dtype)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden states [..., E] -> f32[..., V] logits."""
        w = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.einsum(
            "...e,ev->...v",
            hidden.astype(self.dtype),
            w.astype(self.dtype),
            preferred_element_type=jnp.float32,
        )

    # -- dense reference -------------------------------------------------------------------

    def hidden_states(self, token_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Dense causal forward up to the final norm.

        Args:
            token_ids: i32[B, T].
            positions: optional i32[B, T]; defaults to ``arange(T)``. Attention is causal in
                position order (key position <= query position, within the window).

        Returns:
            [B, T, E] final-normed hidden states in the compute dtype.
        """
        token_ids = jnp.asarray(token_ids)
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids must be i32[B, T], got shape {token_ids.shape}")
        b, t = token_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cos, sin = rope_cos_sin(self.config, positions)
        x = self.embed(token_ids)

        def body(x, xs):
            lp, window = xs
            q, k, v = self._qkv(lp, x, cos, sin)
            attn = dense_attention(q, k, v, positions, positions, window)
            return self._finish_layer(lp, x, attn), None

        x, _ = jax.lax.scan(body, x, (self.layers.stacked(), self._windows()))
        return rms_norm(x, self.norm[...], self.config.rms_norm_eps)

    def __call__(self, token_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Dense causal forward with no cache: i32[B, T] -> f32[B, T, V] logits."""
        return self.compute_logits(self.hidden_states(token_ids, positions))

    # -- paged path ------------------------------------------------------------------------

    def hidden_states_paged(
        self,
        token_ids: jax.Array,
        kv_pages: tuple[jax.Array, jax.Array],
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Flat-batch forward on the paged KV cache, up to the final norm.

        Args:
            token_ids: i32[T] tokens of all sequences in the step, flattened (row order of
                ``metadata``).
            kv_pages: (k_pages, v_pages), each [L, K, N, S, D].
            metadata: the step's attention metadata; ``metadata.positions`` drives RoPE.

        Returns:
            (hidden [T, E] final-normed, (k_pages, v_pages) with this step's K/V written).

        Raises:
            ValueError: layers with different sliding windows (one layer serves them all).
        """
        windows = set(self.config.layer_windows())
        if len(windows) > 1:
            raise ValueError(
                "the paged forward needs one sliding window for every layer, got "
                f"{sorted(windows, key=str)}"
            )
        positions = metadata.positions
        cos, sin = rope_cos_sin(self.config, positions)
        x = self.embed(token_ids)
        n_layers = self.config.num_hidden_layers

        def body(carry, xs):
            x, k_pages, v_pages = carry
            lp, layer = xs
            q, k, v = self._qkv(lp, x, cos, sin)
            attn, (k_pages, v_pages) = self.attention(
                q, k, v, (k_pages, v_pages), metadata, layer=layer
            )
            return (self._finish_layer(lp, x, attn), k_pages, v_pages), None

        k_pages, v_pages = kv_pages
        (x, k_pages, v_pages), _ = jax.lax.scan(
            body,
            (x, k_pages, v_pages),
            (self.layers.stacked(), jnp.arange(n_layers, dtype=jnp.int32)),
        )
        return rms_norm(x, self.norm[...], self.config.rms_norm_eps), (k_pages, v_pages)

    def forward_paged(
        self,
        token_ids: jax.Array,
        kv_pages: tuple[jax.Array, jax.Array],
        metadata: AttentionMetadata,
        logits_indices: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Paged forward: :meth:`hidden_states_paged` plus the LM head.

        Args:
            token_ids, kv_pages, metadata: as in :meth:`hidden_states_paged`.
            logits_indices: optional i32[R] rows of the flat batch to compute logits for
                (e.g. each sequence's last token); all T rows when None.

        Returns:
            (logits f32[T or R, V], (k_pages, v_pages)).
        """
        hidden, kv_pages = self.hidden_states_paged(token_ids, kv_pages, metadata)
        if logits_indices is not None:
            hidden = jnp.take(hidden, logits_indices, axis=0)
        return self.compute_logits(hidden), kv_pages

    def init_kv_pages(
        self, num_blocks: int, block_size: int, dtype: Any | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Zero KV pages (k, v), each [L, K, N, S, D] in ``dtype`` (default compute dtype)."""
        cfg = self.config
        shape = (
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            num_blocks,
            block_size,
            cfg.head_dim,
        )
        dt = self.dtype if dtype is None else dtype
        return jnp.zeros(shape, dt), jnp.zeros(shape, dt)


_NEXT_TOKEN_FNS: dict[Any, Callable[..., jax.Array]] = {}


def _next_token_fn(graphdef: Any) -> Callable[..., jax.Array]:
    fn = _NEXT_TOKEN_FNS.get(graphdef)
    if fn is None:

        @jax.jit
        def fn(state, ids, n):
            logits = nnx.merge(graphdef, state)(ids[None])[0]
            return jnp.argmax(logits[n - 1]).astype(jnp.int32)

        _NEXT_TOKEN_FNS[graphdef] = fn
    return fn


def greedy_generate(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy decoding with the dense path (no cache; for tests and demos, O(T^2) per token).

    The running sequence is padded to a power-of-two bucket (causal attention makes the
    padding invisible), so only a few shapes compile; compiled steps are cached per model
    structure.

    Returns:
        The generated ids (not including the prompt), ending at the first stop id if any.
    """
    if not prompt_ids:
        raise ValueError("greedy_generate needs a non-empty prompt")
    graphdef, state = nnx.split(model)
    next_token = _next_token_fn(graphdef)
    ids = [int(i) for i in prompt_ids]
    out: list[int] = []
    for _ in range(max_new_tokens):
        n = len(ids)
        bucket = max(16, 1 << (n - 1).bit_length())
        padded = jnp.asarray(ids + [0] * (bucket - n), jnp.int32)
        tok = int(next_token(state, padded, n))
        out.append(tok)
        ids.append(tok)
        if tok in stop_ids:
            break
    return out
