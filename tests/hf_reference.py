"""Test helpers: random HF-format checkpoints and a float64 numpy forward written from HF's
modeling code (Llama / Mistral / Qwen2), independent of paxcache's model code.

Used by tests/test_models.py and tests/test_loading.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file


def base_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """A small HF config.json dict (V=64, E=32, L=2, H=4, K=2, D=8, F=48)."""
    d: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if model_type == "mistral":
        d["sliding_window"] = None
    d.update(overrides)
    return d


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    e, h = cfg["hidden_size"], cfg["num_attention_heads"]
    k = cfg.get("num_key_value_heads") or h
    d = cfg.get("head_dim") or e // h
    return cfg["vocab_size"], e, cfg["intermediate_size"], cfg["num_hidden_layers"], h, k, d


def _biases(cfg: dict[str, Any]) -> tuple[bool, bool]:
    if cfg["model_type"] == "qwen2":
        return True, False
    ab = bool(cfg.get("attention_bias", False))
    return (ab, ab) if cfg["model_type"] == "llama" else (False, False)


def random_tensors(cfg: dict[str, Any], seed: int = 0, scale: float = 0.2) -> dict[str, np.ndarray]:
    """Random float32 HF-named tensors for ``cfg`` (HF [out, in] linear layout)."""
    rng = np.random.default_rng(seed)
    v, e, f, n_layers, h, k, d = _dims(cfg)
    qkv_bias, o_bias = _biases(cfg)

    def r(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": r(v, e), "model.norm.weight": 1 + r(e)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + r(e)
        t[p + "post_attention_layernorm.weight"] = 1 + r(e)
        t[p + "self_attn.q_proj.weight"] = r(h * d, e)
        t[p + "self_attn.k_proj.weight"] = r(k * d, e)
        t[p + "self_attn.v_proj.weight"] = r(k * d, e)
        t[p + "self_attn.o_proj.weight"] = r(e, h * d)
        if qkv_bias:
            t[p + "self_attn.q_proj.bias"] = r(h * d)
            t[p + "self_attn.k_proj.bias"] = r(k * d)
            t[p + "self_attn.v_proj.bias"] = r(k * d)
        if o_bias:
            t[p + "self_attn.o_proj.bias"] = r(e)
        t[p + "mlp.gate_proj.weight"] = r(f, e)
        t[p + "mlp.up_proj.weight"] = r(f, e)
        t[p + "mlp.down_proj.weight"] = r(e, f)
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = r(v, e)
    return t


def write_checkpoint(
    path: Path,
    cfg: dict[str, Any],
    tensors: dict[str, np.ndarray],
    shards: int = 1,
) -> Path:
    """Writes config.json and model.safetensors (or ``shards`` files + index.json)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def inv_freq_np(cfg: dict[str, Any]) -> np.ndarray:
    """HF rotary inverse frequencies incl. 'linear' and 'llama3' rope_scaling (float64)."""
    d = _dims(cfg)[6]
    inv = 1.0 / (cfg.get("rope_theta", 10000.0) ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"]
    assert kind == "llama3", kind
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(f)
        elif wavelen > old / lo:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.asarray(out)


def layer_windows_np(cfg: dict[str, Any]) -> list[int | None]:
    n = cfg["num_hidden_layers"]
    if cfg["model_type"] == "mistral":
        return [cfg.get("sliding_window")] * n
    if cfg["model_type"] == "qwen2" and cfg.get("use_sliding_window"):
        mwl = cfg.get("max_window_layers", n)
        return [cfg["sliding_window"] if i >= mwl else None for i in range(n)]
    return [None] * n


def forward_np(cfg: dict[str, Any], t: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """float64 logits [T, V] of one sequence, following HF's Llama/Mistral/Qwen2 code."""
    _, e, _, n_layers, h, k, d = _dims(cfg)
    eps = cfg["rms_norm_eps"]
    t = {name: np.asarray(a, np.float64) for name, a in t.items()}

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)

    def rot_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)

    n = len(ids)
    pos = np.arange(n)
    ang = pos[:, None] * inv_freq_np(cfg)[None]
    ang = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x = t["model.embed_tokens.weight"][np.asarray(ids)]
    windows = layer_windows_np(cfg)
    for i in range(n_layers):
        p = f"model.layers.{i}."

        def lin(a: np.ndarray, name: str, p: str = p) -> np.ndarray:
            y = a @ t[p + name + ".weight"].T
            b = t.get(p + name + ".bias")
            return y if b is None else y + b

        hs = rms(x, t[p + "input_layernorm.weight"])
        q = lin(hs, "self_attn.q_proj").reshape(n, h, d)
        kk = lin(hs, "self_attn.k_proj").reshape(n, k, d)
        vv = lin(hs, "self_attn.v_proj").reshape(n, k, d)
        q = q * cos + rot_half(q) * sin
        kk = kk * cos + rot_half(kk) * sin
        kk = np.repeat(kk, h // k, axis=1)  # HF repeat_kv: head j serves queries j*G..j*G+G-1
        vv = np.repeat(vv, h // k, axis=1)
        s = np.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d)
        mask = pos[None, :] <= pos[:, None]
        if windows[i] is not None:
            mask &= pos[None, :] > pos[:, None] - windows[i]
        s = np.where(mask[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, vv).reshape(n, h * d)
        x = x + lin(o, "self_attn.o_proj")
        hs = rms(x, t[p + "post_attention_layernorm.weight"])
        g = lin(hs, "mlp.gate_proj")
        x = x + lin(g / (1 + np.exp(-g)) * lin(hs, "mlp.up_proj"), "mlp.down_proj")
    x = rms(x, t["model.norm.weight"])
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return x @ head.T
