"""Test helpers for Gemma 2 / Gemma 3 text: small HF configs, random HF-named tensors, and a
float64 numpy forward written from transformers 5.24's ``modeling_gemma2.py`` /
``modeling_gemma3.py``, independent of paxcache's model code.

Checked once by hand against transformers 5.24 itself (in a separate venv with torch, not a
CI dependency): random-weight ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` checkpoints
written by ``save_pretrained`` (5 layers, sliding window 4, soft caps, linear-scaled global
RoPE, a different local base) give logits within 6e-6 of :func:`forward_np` and of paxcache,
and HF ``generate``'s greedy tokens equal paxcache's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def gemma_config(model_type: str = "gemma3_text", **overrides: Any) -> dict[str, Any]:
    """A small transformers-5 Gemma config.json dict (V=64, E=32, L=5, H=4, K=2, D=16, F=48,
    sliding window 4, ``query_pre_attn_scalar`` 12)."""
    d: dict[str, Any] = {
        "model_type": model_type,
        "architectures": ["Gemma2ForCausalLM" if model_type == "gemma2" else "Gemma3ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128,
        "sliding_window": 4,
        "query_pre_attn_scalar": 12,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    if model_type == "gemma2":
        d.update(
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    else:
        d.update(
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            layer_types=["sliding_attention"] * 2
            + ["full_attention", "sliding_attention"] * 1
            + ["full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
        )
    d.update(overrides)
    return d


def random_tensors(cfg: dict[str, Any], seed: int = 0, scale: float = 0.3) -> dict[str, np.ndarray]:
    """Random float32 HF-named tensors (``[out, in]`` linears; norms around 0: Gemma's 1 + w)."""
    rng = np.random.default_rng(seed)
    v, e, f = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    h, k, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def r(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": r(v, e), "model.norm.weight": r(e)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            t[p + n + "_layernorm.weight"] = r(e)
        t[p + "self_attn.q_proj.weight"] = r(h * d, e)
        t[p + "self_attn.k_proj.weight"] = r(k * d, e)
        t[p + "self_attn.v_proj.weight"] = r(k * d, e)
        t[p + "self_attn.o_proj.weight"] = r(e, h * d)
        if cfg["model_type"] == "gemma3_text":
            t[p + "self_attn.q_norm.weight"] = r(d)
            t[p + "self_attn.k_norm.weight"] = r(d)
        t[p + "mlp.gate_proj.weight"] = r(f, e)
        t[p + "mlp.up_proj.weight"] = r(f, e)
        t[p + "mlp.down_proj.weight"] = r(e, f)
    if not cfg.get("tie_word_embeddings", True):
        t["lm_head.weight"] = r(v, e)
    return t


def _inv_freq(rp: dict[str, Any], d: int) -> np.ndarray:
    inv = 1.0 / (rp["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d))
    kind = rp.get("rope_type", "default")
    if kind == "linear":
        return inv / rp["factor"]
    assert kind == "default", kind
    return inv


def forward_np(cfg: dict[str, Any], t: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """float64 logits [T, V] of one sequence, following HF's Gemma 2 / Gemma 3 text code.

    ``cfg`` must be in the transformers-5 form (``layer_types``, ``rope_parameters``).
    """
    e, h, k, d = (
        cfg[n] for n in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    eps = cfg["rms_norm_eps"]
    gemma3 = cfg["model_type"] == "gemma3_text"
    t = {name: np.asarray(a, np.float64) for name, a in t.items()}

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:  # Gemma: x * (1 + w), in float32
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + w)

    def gelu_tanh(x: np.ndarray) -> np.ndarray:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    n = len(ids)
    pos = np.arange(n)
    rp = cfg["rope_parameters"]
    tables = {}
    for name in ("full_attention", "sliding_attention"):
        inv = _inv_freq(rp[name] if gemma3 else rp, d)
        ang = pos[:, None] * inv[None]
        ang = np.concatenate([ang, ang], -1)
        tables[name] = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rot * sin

    x = t["model.embed_tokens.weight"][np.asarray(ids)] * np.float32(e**0.5)
    scale = cfg["query_pre_attn_scalar"] ** -0.5
    cap = cfg.get("attn_logit_softcapping")
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."

        def lin(a: np.ndarray, name: str, p: str = p) -> np.ndarray:
            return a @ t[p + name + ".weight"].T

        hs = rms(x, t[p + "input_layernorm.weight"])
        q = lin(hs, "self_attn.q_proj").reshape(n, h, d)
        kk = lin(hs, "self_attn.k_proj").reshape(n, k, d)
        vv = lin(hs, "self_attn.v_proj").reshape(n, k, d)
        if gemma3:
            q = rms(q, t[p + "self_attn.q_norm.weight"])
            kk = rms(kk, t[p + "self_attn.k_norm.weight"])
        cos, sin = tables[kind]
        q, kk = rope(q, cos, sin), rope(kk, cos, sin)
        kk, vv = np.repeat(kk, h // k, axis=1), np.repeat(vv, h // k, axis=1)
        s = np.einsum("qhd,khd->hqk", q, kk) * scale
        if cap is not None:
            s = cap * np.tanh(s / cap)
        mask = pos[None, :] <= pos[:, None]
        if kind == "sliding_attention" and cfg.get("sliding_window") is not None:
            mask &= pos[:, None] - pos[None, :] < cfg["sliding_window"]
        s = np.where(mask[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = lin(np.einsum("hqk,khd->qhd", s, vv).reshape(n, h * d), "self_attn.o_proj")
        x = x + rms(o, t[p + "post_attention_layernorm.weight"])
        hs = rms(x, t[p + "pre_feedforward_layernorm.weight"])
        mlp = lin(gelu_tanh(lin(hs, "mlp.gate_proj")) * lin(hs, "mlp.up_proj"), "mlp.down_proj")
        x = x + rms(mlp, t[p + "post_feedforward_layernorm.weight"])
    x = rms(x, t["model.norm.weight"])
    logits = x @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T
    fcap = cfg.get("final_logit_softcapping")
    return logits if fcap is None else fcap * np.tanh(logits / fcap)
