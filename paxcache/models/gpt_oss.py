"""gpt-oss (HF ``GptOssForCausalLM``, transformers 5) on the mixture-of-experts decoder.

What gpt-oss changes against :mod:`paxcache.models.moe` (everything else, the attention
call, norms, RoPE, the layer loop, the grouped ``ragged_dot`` experts and expert parallelism,
is the shared code):

* **attention sinks**: one learned logit per query head and layer (``self_attn.sinks``,
  ``sinks [L, H]`` here) that joins the softmax denominator only:
  ``softmax([q.k / sqrt(D), sink])[:-1] @ v``. They go to the attention op as an array
  (``kernels_pallas.ragged_paged_attention(..., sinks=)``): the TPU kernels start each
  row's online softmax from its sink; the Mosaic GPU kernels have none, so on a GPU the op
  runs its XLA path and the dispatch says so rather than drop it;
* q/k/v/o biases (``attention_bias``), ``layer_types`` alternating ``sliding_attention``
  (window ``sliding_window``) and ``full_attention``, yarn RoPE
  (:func:`paxcache.models.llama_config.rope_inv_freq`);
* the router: a biased linear, top-k over the *logits*, softmax over the k selected
  (``GptOssTopKRouter``);
* experts with biases and a clamped SwiGLU: ``gate = min(gate, limit)``,
  ``up = clip(up, -limit, limit)``, ``out = (up + 1) * gate * sigmoid(alpha * gate)``
  (``swiglu_limit``, ``swiglu_alpha = 1.702``);
* HF's fused expert tensors: ``mlp.experts.gate_up_proj [X, E, 2Fm]`` whose last axis
  *interleaves* gate (even columns) and up (odd columns), ``gate_up_proj_bias [X, 2Fm]``
  (interleaved alike), ``down_proj [X, Fm, E]``, ``down_proj_bias [X, E]``; the loader reads
  gate and up apart with a strided :class:`~paxcache.models.shards.TensorSource`;
* **MXFP4** expert weights (openai/gpt-oss-20b, ``quantization_config.quant_method:
  "mxfp4"``): ``*_blocks`` uint8 ``[X, out, in / 32, 16]`` (two e2m1 codes a byte, the low
  nibble first) and ``*_scales`` uint8 ``[X, out, in / 32]`` (e8m0: ``2 ** (s - 127)`` per 32
  values), in HF's ``[out, in]`` orientation. They are dequantized to the model dtype at
  load, block by block as each device's shard is read (:func:`mxfp4_reader`), never whole.

Shape letters as in :mod:`paxcache.models.moe` (X experts, Fm expert width, k per token).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Container, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxcache.errors import CheckpointError
from paxcache.models.layer_plan import LayerAttention
from paxcache.models.llama import LlamaForCausalLM
from paxcache.models.llama_config import ConfigError, LlamaConfig
from paxcache.models.moe import _STEP_MESH, MoeConfig, MoeForCausalLM, MoeLayers, moe_mlp
from paxcache.models.shards import LAYER, Block, TensorSource

__all__ = [
    "FP4_VALUES",
    "GptOssConfig",
    "GptOssForCausalLM",
    "GptOssLayers",
    "checkpoint_mxfp4",
    "clamped_swiglu",
    "dequantize_mxfp4",
    "gpt_oss_hf_shapes",
    "gpt_oss_hf_tensors",
    "gpt_oss_sources",
    "mxfp4_reader",
    "route_topk_softmax",
]

LAYER_TYPES = ("sliding_attention", "full_attention")

FP4_VALUES = np.asarray(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
"""The 16 e2m1 (FP4) values by 4-bit code (sign bit 3)."""

MXFP4_BLOCK = 32
"""Values per e8m0 scale (16 bytes of two codes each)."""

# GptOssConfig's defaults (transformers 5.24) for fields a config.json may omit.
_HF_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4,
    "attention_bias": True,
}
_DEFAULT_THETA = 150000.0
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_MXFP4_FIELDS = {"quant_method", "modules_to_not_convert", "dequantize"}


@dataclasses.dataclass(frozen=True)
class GptOssConfig(MoeConfig):
    """A gpt-oss config: :class:`~paxcache.models.moe.MoeConfig` plus gpt-oss's fields.

    Attributes (beyond MoeConfig's; ``sliding_windows`` holds each layer's window):
        layer_types: per layer "sliding_attention" or "full_attention" (length L; empty:
            derived from ``sliding_windows``).
        swiglu_limit: the experts' clamp (gate above, up both sides).
        swiglu_alpha: the sigmoid gain of the experts' SwiGLU.
    """

    layer_types: tuple[str, ...] = ()
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    __hash__ = LlamaConfig.__hash__

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_type != "gpt_oss":
            raise ConfigError(f"GptOssConfig model_type must be 'gpt_oss', got {self.model_type!r}")
        windows = self.layer_windows()
        types = tuple(self.layer_types) or tuple(LAYER_TYPES[w is None] for w in windows)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_hidden_layers or not set(types) <= set(LAYER_TYPES):
            raise ConfigError(
                f"layer_types must be {self.num_hidden_layers} entries of {LAYER_TYPES}, got "
                f"{list(types)[:8]}"
            )
        for i, (t, w) in enumerate(zip(types, windows, strict=True)):
            if t == "full_attention" and w is not None:
                raise ConfigError(f"layer {i} is full_attention but has sliding window {w}")
        for name in ("swiglu_limit", "swiglu_alpha"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ConfigError(f"config field {name} must be a positive number, got {v!r}")
        if not all(self.moe_layer_flags()):
            raise ConfigError("gpt_oss has experts on every layer (no dense MLP layers)")
        if self.qkv_bias != self.o_bias:
            raise ConfigError("gpt_oss attention_bias covers q/k/v/o together")

    def layer_attention(self) -> tuple[LayerAttention, ...]:
        """Per layer: its window (sinks are per-layer arrays, passed at call time)."""
        return tuple(LayerAttention(sliding_window=w) for w in self.layer_windows())

    def num_params(self) -> int:
        """Number of parameters: MoeConfig's plus sinks, router and expert biases."""
        e, fm, x = self.hidden_size, self.moe_intermediate_size, self.num_experts
        per_layer = self.num_attention_heads + x + x * (2 * fm + e)
        return super().num_params() + self.num_hidden_layers * per_layer

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> GptOssConfig:
        """Reads a gpt-oss ``config.json``: transformers 5's ``rope_parameters`` or the hub's
        ``rope_theta`` + ``rope_scaling``; ``layer_types`` (HF's default: even layers
        sliding); HF's defaults for omitted fields.

        Raises:
            ConfigError: an unsupported or malformed field, named.
        """
        if d.get("model_type") != "gpt_oss":
            raise ConfigError(f"not a gpt_oss model_type: {d.get('model_type')!r}")
        full = {**_HF_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
        full["sliding_window"] = d.get("sliding_window", _HF_DEFAULTS["sliding_window"])
        rp, rs = d.get("rope_parameters"), d.get("rope_scaling")
        if rp is not None and not isinstance(rp, Mapping):
            raise ConfigError(f"config field rope_parameters must be an object, got {rp!r}")
        theta = d.get("rope_theta", (rp or {}).get("rope_theta", _DEFAULT_THETA))
        if rp is None and rs is None:
            full["rope_scaling"] = dict(_DEFAULT_ROPE)
        full["rope_theta"] = theta
        base = super().from_hf_dict(full)
        n = base.num_hidden_layers
        types = d.get("layer_types")
        if types is None:
            types = [LAYER_TYPES[(i + 1) % 2 == 0] for i in range(n)]
        if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"config field layer_types must be a list of {LAYER_TYPES}")
        sw = full["sliding_window"]
        windows = tuple(
            int(sw) if t == "sliding_attention" and sw is not None else None for t in types
        )
        return dataclasses.replace(
            base,
            sliding_windows=windows if any(w is not None for w in windows) else (),
            layer_types=tuple(types),
            swiglu_limit=full.get("swiglu_limit", 7.0),
            swiglu_alpha=full.get("swiglu_alpha", 1.702),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers-5 ``config.json`` dict (``rope_parameters``, ``layer_types``)."""
        used = {w for w in self.layer_windows() if w is not None}
        if len(used) > 1:
            raise ConfigError("gpt_oss uses one sliding window size")
        if self.moe_intermediate_size != self.intermediate_size:
            raise ConfigError("gpt_oss's experts are intermediate_size wide")
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        return {
            **self._hf_common_fields(),
            "hidden_act": "silu",
            "attention_bias": self.qkv_bias,
            "rope_parameters": rope,
            "layer_types": list(self.layer_types),
            "sliding_window": used.pop() if used else None,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "swiglu_limit": self.swiglu_limit,
            "swiglu_alpha": self.swiglu_alpha,
        }


# ------------------------------------------------------------------------------------------
# Router and experts (pure functions)
# ------------------------------------------------------------------------------------------


def route_topk_softmax(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """gpt-oss routing: top-k over ``logits [N, X]`` (lower index first on ties, as
    ``torch.topk``), then softmax over the k chosen. Returns (weights f32[N, k], experts
    i32[N, k])."""
    top, experts = jax.lax.top_k(logits.astype(jnp.float32), k)
    return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's activation on float32 projections ``[A, Fm]`` (``GptOssExperts._apply_gate``)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))


# ------------------------------------------------------------------------------------------
# NNX modules
# ------------------------------------------------------------------------------------------


class GptOssLayers(MoeLayers):
    """:class:`~paxcache.models.moe.MoeLayers` plus gpt-oss's per-layer arrays.

    Attributes (beyond MoeLayers'; every layer is sparse, so Lm = L):
        sinks: [L, H] attention sink logits.
        router_bias: [L, X].
        expert_gate_bias, expert_up_bias: [L, X, Fm]; expert_down_bias: [L, X, E].
    """

    MLP_NAMES = (
        *MoeLayers.MLP_NAMES,
        "router_bias",
        "expert_gate_bias",
        "expert_up_bias",
        "expert_down_bias",
    )
    _SPARSE = ("router", "expert_gate", "expert_up", "expert_down", *MLP_NAMES[-4:])

    def __init__(self, cfg: GptOssConfig, *, param_dtype: Any, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, param_dtype=param_dtype, rngs=rngs)
        n, e, fm, x = (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
        )

        def zeros(*shape: int) -> nnx.Param:
            return nnx.Param(jnp.zeros(shape, param_dtype))

        self.sinks = zeros(n, cfg.num_attention_heads)
        self.router_bias = zeros(n, x)
        self.expert_gate_bias = zeros(n, x, fm)
        self.expert_up_bias = zeros(n, x, fm)
        self.expert_down_bias = zeros(n, x, e)

    def stacked(self) -> dict[str, jax.Array]:
        """MoeLayers' scan xs plus ``sinks`` [L, H]."""
        return {**super().stacked(), "sinks": self.sinks[...]}

    def mlp_params(self, layer: jax.Array, sparse: bool) -> dict[str, jax.Array]:
        """One layer's expert weights and biases (every gpt-oss layer is sparse)."""
        if not sparse:
            raise ValueError("gpt_oss has no dense MLP layers")
        return {
            n: jax.lax.dynamic_index_in_dim(getattr(self, n)[...], layer, keepdims=False)
            for n in self._SPARSE
        }


class GptOssForCausalLM(MoeForCausalLM):
    """gpt-oss causal LM (see the module docstring for what differs from MoeForCausalLM).

    Same interface as :class:`~paxcache.models.llama.LlamaForCausalLM`; ``layers`` is a
    :class:`GptOssLayers`.
    """

    config: GptOssConfig

    def __init__(
        self,
        config: GptOssConfig,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        if not isinstance(config, GptOssConfig):
            raise ConfigError(
                f"GptOssForCausalLM needs a GptOssConfig, got {type(config).__name__}"
            )
        LlamaForCausalLM.__init__(self, config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        param_dtype = dtype if param_dtype is None else param_dtype
        self.layers = GptOssLayers(config, param_dtype=param_dtype, rngs=rngs)

    def _attention_kwargs(self, lp: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """The layer's sinks go to the attention call."""
        return {"sinks": lp["sinks"].astype(jnp.float32)}

    def _mlp(self, layer: jax.Array, h: jax.Array) -> jax.Array:
        """The experts of layer ``layer`` (traced) on normed ``h [..., E]``."""
        cfg = self.config
        p = self.layers.mlp_params(layer, True)
        return moe_mlp(
            h,
            p["router"],
            p["expert_gate"],
            p["expert_up"],
            p["expert_down"],
            cfg,
            dtype=self.dtype,
            mesh=_STEP_MESH.get(),
            router_bias=p["router_bias"],
            expert_biases=(p["expert_gate_bias"], p["expert_up_bias"], p["expert_down_bias"]),
            route_fn=lambda logits: route_topk_softmax(logits, cfg.num_experts_per_tok),
            activation=lambda g, u: clamped_swiglu(g, u, cfg.swiglu_limit, cfg.swiglu_alpha),
        )


# ------------------------------------------------------------------------------------------
# HF checkpoint layouts, MXFP4
# ------------------------------------------------------------------------------------------

_EXPERTS = f"model.layers.{LAYER}.mlp.experts."


def checkpoint_mxfp4(config: Mapping[str, Any]) -> bool:
    """Whether a parsed gpt-oss ``config.json`` declares MXFP4 experts.

    Returns:
        True for ``quantization_config.quant_method == "mxfp4"``; False with no
        ``quantization_config`` (any other method is the generic loader's to refuse).

    Raises:
        CheckpointError: an mxfp4 ``quantization_config`` with a field the loader does not
            understand, or ``modules_to_not_convert`` that is not a list of names.
    """
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "mxfp4":
        return False
    where = "config.json: quantization_config"
    unknown = sorted(set(qc) - _MXFP4_FIELDS)
    if unknown:
        raise CheckpointError(f"{where}.{unknown[0]}: field not understood by the loader")
    skip = qc.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise CheckpointError(f"{where}.modules_to_not_convert must be a list of module names")
    return True


def _is_mxfp4(names: Container[str]) -> bool:
    return "model.layers.0.mlp.experts.gate_up_proj_blocks" in names


def gpt_oss_hf_shapes(
    cfg: GptOssConfig, names: Container[str], declared_mxfp4: bool
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The gpt-oss tensors beyond the shared attention ones: (float tensors, uint8 MXFP4
    tensors), name -> HF shape, in the layout ``names`` holds.

    Raises:
        CheckpointError: the layout disagrees with ``quantization_config``, or MXFP4 experts
            whose input widths are not multiples of 32.
    """
    e, fm, x = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    mx = _is_mxfp4(names)
    if mx != declared_mxfp4:
        raise CheckpointError(
            "config.json quantization_config "
            + ("declares mxfp4 but the experts are not stored as *_blocks / *_scales"
               if declared_mxfp4 else "has no mxfp4 but the experts are stored as *_blocks")
        )  # fmt: skip
    if mx and (e % MXFP4_BLOCK or fm % MXFP4_BLOCK):
        raise CheckpointError(
            f"mxfp4 experts need hidden_size ({e}) and intermediate_size ({fm}) to be "
            f"multiples of {MXFP4_BLOCK}"
        )
    floats: dict[str, tuple[int, ...]] = {}
    packed: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        floats[p + "self_attn.sinks"] = (cfg.num_attention_heads,)
        floats[p + "mlp.router.weight"] = (x, e)
        floats[p + "mlp.router.bias"] = (x,)
        ex = p + "mlp.experts."
        floats[ex + "gate_up_proj_bias"] = (x, 2 * fm)
        floats[ex + "down_proj_bias"] = (x, e)
        if not mx:
            floats[ex + "gate_up_proj"] = (x, e, 2 * fm)
            floats[ex + "down_proj"] = (x, fm, e)
            continue
        for name, out, inp in (("gate_up_proj", 2 * fm, e), ("down_proj", e, fm)):
            packed[ex + name + "_blocks"] = (x, out, inp // MXFP4_BLOCK, MXFP4_BLOCK // 2)
            packed[ex + name + "_scales"] = (x, out, inp // MXFP4_BLOCK)
    return floats, packed


def gpt_oss_sources(
    cfg: GptOssConfig, names: Container[str] = ()
) -> dict[tuple[str, ...], TensorSource]:
    """The loader's table entries of gpt-oss's sinks, router and experts.

    Gate and up are the even and odd entries of the fused ``gate_up_proj``'s output axis
    (``interleave``). In the float layout ``gate_up_proj [X, E, 2Fm]`` and ``down_proj
    [X, Fm, E]`` are already ``[in, out]``; MXFP4 tensors are read as the ``[X, out, in]``
    their blocks dequantize to (:func:`mxfp4_reader`), hence transposed.
    """
    mx = _is_mxfp4(names)
    out = {
        ("layers", "sinks"): TensorSource(f"model.layers.{LAYER}.self_attn.sinks"),
        ("layers", "router"): TensorSource(f"model.layers.{LAYER}.mlp.router.weight", True),
        ("layers", "router_bias"): TensorSource(f"model.layers.{LAYER}.mlp.router.bias"),
        ("layers", "expert_down"): TensorSource(_EXPERTS + "down_proj", mx),
        ("layers", "expert_down_bias"): TensorSource(_EXPERTS + "down_proj_bias"),
    }
    for ours, offset in (("expert_gate", 0), ("expert_up", 1)):
        out["layers", ours] = TensorSource(_EXPERTS + "gate_up_proj", mx, interleave=(2, offset))
        out["layers", ours + "_bias"] = TensorSource(
            _EXPERTS + "gate_up_proj_bias", interleave=(2, offset)
        )
    return out


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32: ``blocks`` uint8 ``[..., G, 16]``, ``scales`` uint8 ``[..., G]`` ->
    ``[..., G * 32]`` (value ``2 * j`` from the low nibble of byte ``j``, ``2 * j + 1`` from
    the high one; each group of 32 times ``2 ** (scale - 127)``), as transformers'
    ``convert_moe_packed_tensors`` before its transpose.

    Raises:
        ValueError: shapes that do not pair up, or a non-uint8 input.
    """
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"mxfp4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1:] != (MXFP4_BLOCK // 2,):
        raise ValueError(f"mxfp4 blocks {blocks.shape} do not pair with scales {scales.shape}")
    out = np.empty((*blocks.shape[:-1], MXFP4_BLOCK), np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out *= np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127)[..., None]
    return out.reshape(*blocks.shape[:-2], -1)


def mxfp4_reader(
    read: Callable[[str, Block], np.ndarray], names: Container[str]
) -> Callable[[str, Block], np.ndarray]:
    """``read`` that also serves MXFP4 experts: a block ``[x, out, in]`` of a name with
    ``*_blocks`` / ``*_scales`` in ``names`` is read as the groups of 32 that cover it and
    dequantized (float32), so only that block's bytes are read; other names pass through."""

    def reader(name: str, block: Block) -> np.ndarray:
        if name + "_blocks" not in names:
            return read(name, block)
        *lead, (c0, c1) = block
        g0, g1 = c0 // MXFP4_BLOCK, -(-c1 // MXFP4_BLOCK)
        codes = read(name + "_blocks", (*lead, (g0, g1), (0, MXFP4_BLOCK // 2)))
        scales = read(name + "_scales", (*lead, (g0, g1)))
        values = dequantize_mxfp4(np.asarray(codes), np.asarray(scales))
        return values[..., c0 - g0 * MXFP4_BLOCK : c1 - g0 * MXFP4_BLOCK]

    return reader


def gpt_oss_hf_tensors(model: GptOssForCausalLM) -> dict[str, np.ndarray]:
    """gpt-oss's sinks, routers and experts as HF tensors (the float fused layout that
    transformers' ``save_pretrained`` writes)."""
    layers = model.layers
    a = {n: np.asarray(getattr(layers, n)[...]) for n in (*GptOssLayers._SPARSE, "sinks")}
    out: dict[str, np.ndarray] = {}
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.sinks"] = a["sinks"][i]
        out[p + "mlp.router.weight"] = np.ascontiguousarray(a["router"][i].T)
        out[p + "mlp.router.bias"] = a["router_bias"][i]
        gate_up = np.stack([a["expert_gate"][i], a["expert_up"][i]], axis=-1)
        out[p + "mlp.experts.gate_up_proj"] = gate_up.reshape(*gate_up.shape[:-2], -1)
        bias = np.stack([a["expert_gate_bias"][i], a["expert_up_bias"][i]], axis=-1)
        out[p + "mlp.experts.gate_up_proj_bias"] = bias.reshape(*bias.shape[:-2], -1)
        out[p + "mlp.experts.down_proj"] = a["expert_down"][i]
        out[p + "mlp.experts.down_proj_bias"] = a["expert_down_bias"][i]
    return out
