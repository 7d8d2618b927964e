"""The HF model families the Llama code path serves, and how each maps onto it.

Llama, Mistral, Qwen2, Qwen3, OLMo 2 and Phi-3 share one decoder (:mod:`paxcache.models.llama`);
Gemma 2 and Gemma 3 text reuse its layer weights, norms, RoPE and attention call in their own
module (:mod:`paxcache.models.gemma`: scaled embeddings, sandwich norms, GeLU-tanh, soft caps,
per-layer-type RoPE). They differ in

* where the RMSNorms sit (``norm_placement``: ``"pre"`` = before attention and MLP, Llama;
  ``"post"`` = on the attention and MLP outputs before the residual add, OLMo 2;
  ``"sandwich"`` = both, with a separate pre-MLP norm, Gemma),
* the RMSNorm scale (``norm_offset``: Gemma scales by ``1 + w``),
* a q/k RMSNorm before RoPE (``qk_norm``: ``"none"``; ``"head"`` = per head over D, Qwen3;
  ``"full"`` = over the whole H*D / K*D projection, OLMo 2),
* which projections have a bias, the sliding-window rule, and
* the HF tensor layout (Phi-3 stores fused ``qkv_proj`` and ``gate_up_proj`` weights).

Mixtral and Qwen3-MoE (``moe=True``) share the same attention and norms; their MLP is a
mixture of experts, built by :mod:`paxcache.models.moe` on top of the same decoder. gpt-oss
(:mod:`paxcache.models.gpt_oss`) adds attention sinks, biased routers and experts and a
clamped SwiGLU to that.

:data:`FAMILIES` holds these per ``model_type``; the config translation
(:meth:`paxcache.models.llama_config.LlamaConfig.from_hf_dict`) and the checkpoint loader
(:mod:`paxcache.models.loading`) read it, so a family is described once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "FAMILIES",
    "NORM_PLACEMENTS",
    "QK_NORMS",
    "Family",
    "hf_layer_sources",
    "layer_shapes",
]

QK_NORMS = ("none", "head", "full")
NORM_PLACEMENTS = ("pre", "post", "sandwich")


@dataclasses.dataclass(frozen=True)
class Family:
    """How one HF ``model_type`` maps onto the Llama code path.

    Attributes:
        model_type: HF ``model_type``.
        architecture: HF ``architectures[0]`` written by ``save_pretrained``.
        qk_norm: "none", "head" (RMSNorm over D of each head) or "full" (over H*D / K*D).
        norm_placement: "pre" (Llama), "post" (OLMo 2: norms on the sublayer outputs) or
            "sandwich" (Gemma: input, post-attention, pre- and post-feed-forward norms).
        bias: "attention_bias" (q/k/v/o biased iff config ``attention_bias``), "qkv" (always
            q/k/v, never o: Qwen2) or "none" (Phi-3).
        windows: "none", "all" (config ``sliding_window`` on every layer: Mistral, Phi-3),
            "layered" (``use_sliding_window``/``max_window_layers``/``layer_types``: Qwen2/3),
            "pattern" (``layer_types`` / ``sliding_window_pattern``: Gemma) or "flag"
            (``sliding_window`` on every layer iff ``use_sliding_window``: Qwen3-MoE).
        fused: the checkpoint holds ``qkv_proj`` and ``gate_up_proj`` (Phi-3).
        norm_weight_f32: RMSNorm scales by its weight in float32 before casting back (OLMo 2);
            otherwise it casts first, then scales (Llama). Equal in float32.
        norm_offset: RMSNorm scales by ``norm_offset + w`` (Gemma: 1; its weights start at 0).
        config_class: the config class, when not the Llama one (``"gemma"``:
            :class:`paxcache.models.gemma.GemmaConfig`; ``"gpt_oss"``:
            :class:`paxcache.models.gpt_oss.GptOssConfig`).
        moe: the MLP is a mixture of experts (:class:`paxcache.models.moe.MoeConfig`).
    """

    model_type: str
    architecture: str
    qk_norm: str = "none"
    norm_placement: str = "pre"
    bias: str = "attention_bias"
    windows: str = "none"
    fused: bool = False
    norm_weight_f32: bool = False
    norm_offset: float = 0.0
    config_class: str = "llama"
    moe: bool = False


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM"),
        Family("mistral", "MistralForCausalLM", windows="all"),
        Family("qwen2", "Qwen2ForCausalLM", bias="qkv", windows="layered"),
        Family("qwen3", "Qwen3ForCausalLM", qk_norm="head", windows="layered"),
        Family(
            "olmo2",
            "Olmo2ForCausalLM",
            qk_norm="full",
            norm_placement="post",
            norm_weight_f32=True,
        ),
        Family("phi3", "Phi3ForCausalLM", bias="none", windows="all", fused=True),
        *(
            Family(
                mt,
                arch,
                qk_norm=qk,
                norm_placement="sandwich",
                windows="pattern",
                norm_weight_f32=True,
                norm_offset=1.0,
                config_class="gemma",
            )
            for mt, arch, qk in (
                ("gemma2", "Gemma2ForCausalLM", "none"),
                ("gemma3_text", "Gemma3ForCausalLM", "head"),
            )
        ),
        Family("mixtral", "MixtralForCausalLM", windows="all", moe=True),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm="head", windows="flag", moe=True),
        Family(
            "gpt_oss",
            "GptOssForCausalLM",
            windows="pattern",
            norm_weight_f32=True,
            config_class="gpt_oss",
            moe=True,
        ),
    )
}


def layer_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """One layer's parameter shapes in our layout (linear weights ``[in, out]``).

    Args:
        cfg: a :class:`~paxcache.models.llama_config.LlamaConfig`.

    Returns:
        Our parameter name -> shape, without the leading ``[L]`` axis; parameters the config
        does not use (biases, q/k norms, the norms of the other placement) are absent. A
        mixture-of-experts config (``num_experts``) has no dense MLP here: its MLP weights are
        :mod:`paxcache.models.moe`'s.
    """
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hd, kd = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out: dict[str, tuple[int, ...]] = {}
    if cfg.norm_placement != "post":
        out["input_layernorm"] = (e,)
    out["post_attention_layernorm"] = (e,)
    if cfg.norm_placement == "sandwich":
        out["pre_feedforward_layernorm"] = (e,)
    if cfg.norm_placement != "pre":
        out["post_feedforward_layernorm"] = (e,)
    out.update(q_proj=(e, hd), k_proj=(e, kd), v_proj=(e, kd), o_proj=(hd, e))
    if cfg.qkv_bias:
        out.update(q_bias=(hd,), k_bias=(kd,), v_bias=(kd,))
    if cfg.o_bias:
        out["o_bias"] = (e,)
    if cfg.qk_norm == "head":
        out.update(q_norm=(d,), k_norm=(d,))
    elif cfg.qk_norm == "full":
        out.update(q_norm=(hd,), k_norm=(kd,))
    if not getattr(cfg, "num_experts", 0):
        out.update(gate_proj=(e, f), up_proj=(e, f), down_proj=(f, e))
    return out


def hf_layer_sources(cfg: Any) -> dict[str, tuple[str, bool, tuple[int, int] | None]]:
    """Where each of one layer's parameters lives in an HF checkpoint.

    Args:
        cfg: a :class:`~paxcache.models.llama_config.LlamaConfig`.

    Returns:
        Our parameter name -> (HF suffix under ``model.layers.{i}.``, transpose?, rows): rows
        is None for a whole tensor, or the ``(start, stop)`` rows (HF ``[out, in]`` layout) of
        a fused tensor. Phi-3's fused ``qkv_proj`` rows are q, then k, then v;
        ``gate_up_proj``'s are gate, then up (HF ``chunk(2)``). Fused weights are split here,
        at load, into our separate q/k/v and gate/up parameters: the decoder, the tensor-
        parallel sharding (column splits of q/k/v and gate/up) and the paged path then stay
        one code path, at no runtime cost (a fused matmul would split again anyway).
    """
    names = {
        "input_layernorm": "input_layernorm.weight",
        "post_attention_layernorm": "post_attention_layernorm.weight",
        "pre_feedforward_layernorm": "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm": "post_feedforward_layernorm.weight",
        "q_proj": "self_attn.q_proj.weight",
        "k_proj": "self_attn.k_proj.weight",
        "v_proj": "self_attn.v_proj.weight",
        "o_proj": "self_attn.o_proj.weight",
        "q_bias": "self_attn.q_proj.bias",
        "k_bias": "self_attn.k_proj.bias",
        "v_bias": "self_attn.v_proj.bias",
        "o_bias": "self_attn.o_proj.bias",
        "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight",
        "gate_proj": "mlp.gate_proj.weight",
        "up_proj": "mlp.up_proj.weight",
        "down_proj": "mlp.down_proj.weight",
    }
    out: dict[str, tuple[str, bool, tuple[int, int] | None]] = {}
    for ours, shape in layer_shapes(cfg).items():
        out[ours] = (names[ours], len(shape) == 2, None)
    if FAMILIES[cfg.model_type].fused:
        d, f = cfg.head_dim, cfg.intermediate_size
        hd, kd = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        qkv, gate_up = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"
        out["q_proj"] = (qkv, True, (0, hd))
        out["k_proj"] = (qkv, True, (hd, hd + kd))
        out["v_proj"] = (qkv, True, (hd + kd, hd + 2 * kd))
        out["gate_proj"] = (gate_up, True, (0, f))
        out["up_proj"] = (gate_up, True, (f, 2 * f))
    return out
