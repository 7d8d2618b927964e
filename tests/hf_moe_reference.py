"""Test helpers for Mixtral and Qwen3-MoE: small HF configs, random checkpoints in both expert
layouts, and a float64 numpy forward of HF's MoE code (transformers 5.24's
``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``: float32 softmax router, ``torch.topk``,
optional renormalization, per-expert SwiGLU, weighted ``index_add_``; Qwen3-MoE's dense
``mlp_only_layers`` / ``decoder_sparse_step`` rule), independent of paxcache's model code.

Checked once by hand against transformers 5.24 in /work/hfvenv on random-weight
``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` checkpoints (4 experts, top-2; the Qwen3-MoE
one with ``mlp_only_layers=[1]`` and ``norm_topk_prob=False``): :func:`moe_forward_np` on the
``save_pretrained`` files is within 1.2e-7 of transformers' logits, and paxcache loads both
layouts within 1.2e-7 with greedy engine tokens equal to ``generate``. ``save_pretrained``
writes the per-expert ("legacy") layout; the in-memory modules hold the fused one
(``mlp.experts.gate_up_proj [X, 2Fm, E]``, ``mlp.experts.down_proj [X, E, Fm]``), which
``save_pretrained(save_original_format=False)`` writes.

Attention, norms and RoPE are :mod:`tests.hf_reference`'s (Mixtral is Mistral's attention,
Qwen3-MoE Qwen3's), with the MLP swapped through ``forward_np(..., mlp=)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hf_reference import base_config, forward_np, random_tensors

# The dense family whose attention each MoE family shares (for tests.hf_reference).
ATTENTION_OF = {"mixtral": "mistral", "qwen3_moe": "qwen3"}


def moe_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """A small HF config (V=64, E=32, L=2, H=4, K=2, 4 experts, top-2, Fm=16)."""
    d = base_config(ATTENTION_OF[model_type])
    d["model_type"] = model_type
    d["num_experts_per_tok"] = 2
    if model_type == "mixtral":
        d.update(num_local_experts=4, intermediate_size=16, sliding_window=None)
    else:  # hub Qwen3-MoE configs say num_experts (transformers 5 writes num_local_experts)
        d.update(
            num_experts=4,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            sliding_window=None,
        )
    d.update(overrides)
    return d


def num_experts(cfg: dict[str, Any]) -> int:
    return cfg.get("num_local_experts", cfg.get("num_experts"))


def sparse_layers(cfg: dict[str, Any]) -> list[bool]:
    """HF's rule: layer i is sparse iff not in mlp_only_layers and (i + 1) % step == 0."""
    step = cfg.get("decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    return [i not in only and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"])]


def _expert_width(cfg: dict[str, Any]) -> int:
    return (
        cfg["intermediate_size"] if cfg["model_type"] == "mixtral" else cfg["moe_intermediate_size"]
    )


def _attention_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    d = dict(cfg, model_type=ATTENTION_OF[cfg["model_type"]])
    if cfg["model_type"] == "qwen3_moe" and cfg.get("use_sliding_window"):
        d["max_window_layers"] = 0  # Qwen3-MoE: the window is on every layer
    return d


def random_moe_tensors(
    cfg: dict[str, Any],
    seed: int = 0,
    layout: str = "legacy",
    router_scale: float = 3.0,
) -> dict[str, np.ndarray]:
    """Random float32 HF-named tensors; ``layout`` "legacy" (per expert, as
    ``save_pretrained`` writes) or "fused" (transformers 5's 3-D ``gate_up_proj``).

    ``router_scale`` makes routing decisive (top-k margins far above float32 noise).
    """
    rng = np.random.default_rng(seed + 1000)
    t = {k: v for k, v in random_tensors(_attention_cfg(cfg), seed).items() if ".mlp." not in k}
    e, f, fm, x = cfg["hidden_size"], cfg["intermediate_size"], _expert_width(cfg), num_experts(cfg)

    def r(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    mixtral = cfg["model_type"] == "mixtral"
    for i, sparse in enumerate(sparse_layers(cfg)):
        p = f"model.layers.{i}."
        if not sparse:
            t[p + "mlp.gate_proj.weight"] = r(f, e)
            t[p + "mlp.up_proj.weight"] = r(f, e)
            t[p + "mlp.down_proj.weight"] = r(e, f)
            continue
        pre = p + ("block_sparse_moe." if mixtral and layout == "legacy" else "mlp.")
        t[pre + "gate.weight"] = r(x, e, scale=router_scale)
        gate, up, down = r(x, fm, e), r(x, fm, e), r(x, e, fm)
        if layout == "fused":
            t[pre + "experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
            t[pre + "experts.down_proj"] = down
            continue
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for j in range(x):
            for name, w in zip(names, (gate[j], up[j], down[j]), strict=True):
                t[f"{pre}experts.{j}.{name}.weight"] = w
    return t


def _expert_weights(t: dict[str, np.ndarray], pre: str, x: int, fm: int, mixtral: bool):
    if pre + "experts.gate_up_proj" in t:
        gu = t[pre + "experts.gate_up_proj"]
        return gu[:, :fm], gu[:, fm:], t[pre + "experts.down_proj"]
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    return tuple(np.stack([t[f"{pre}experts.{j}.{n}.weight"] for j in range(x)]) for n in names)


def moe_forward_np(cfg: dict[str, Any], t: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """float64 logits [T, V] of one sequence, following HF's Mixtral / Qwen3-MoE code."""
    mixtral = cfg["model_type"] == "mixtral"
    x_n, k, fm = num_experts(cfg), cfg["num_experts_per_tok"], _expert_width(cfg)
    normalize = mixtral or cfg.get("norm_topk_prob", False)
    flags = sparse_layers(cfg)

    def mlp(i: int, hs: np.ndarray, t: dict[str, np.ndarray]) -> np.ndarray:
        p = f"model.layers.{i}."

        def swiglu(h, wg, wu, wd):
            g, u = h @ wg.T, h @ wu.T
            return (g / (1 + np.exp(-g)) * u) @ wd.T

        if not flags[i]:
            return swiglu(
                hs, *(t[f"{p}mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
            )
        pre = p + ("block_sparse_moe." if p + "block_sparse_moe.gate.weight" in t else "mlp.")
        logits = hs @ t[pre + "gate.weight"].T  # [T, X]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # torch.topk: lower index on ties
        w = np.take_along_axis(probs, top, axis=-1)
        if normalize:
            w = w / w.sum(-1, keepdims=True)
        wg, wu, wd = _expert_weights(t, pre, x_n, fm, mixtral)
        out = np.zeros_like(hs)
        for n in range(hs.shape[0]):
            for j in range(k):
                ex = top[n, j]
                out[n] += w[n, j] * swiglu(hs[n : n + 1], wg[ex], wu[ex], wd[ex])[0]
        return out

    return forward_np(_attention_cfg(cfg), t, ids, mlp=mlp)
