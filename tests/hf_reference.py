"""Test helpers: random HF-format checkpoints and a float64 numpy forward written from HF's
modeling code (Llama / Mistral / Qwen2 / Qwen3 / OLMo 2 / Phi-3), independent of paxcache's
model code (transformers 5.x semantics, checked once against transformers itself).

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
    if model_type in ("mistral", "phi3"):
        d["sliding_window"] = None
    if model_type == "qwen3":
        d["head_dim"] = 16  # Qwen3 sets head_dim apart from hidden_size / heads
    if model_type == "phi3":
        d["pad_token_id"] = 0  # Phi3Config's default (32000) is outside this vocabulary
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
    return (ab, ab) if cfg["model_type"] in ("llama", "qwen3", "olmo2") else (False, False)


def random_tensors(cfg: dict[str, Any], seed: int = 0, scale: float = 0.2) -> dict[str, np.ndarray]:
    """Random float32 HF-named tensors for ``cfg`` (HF [out, in] linear layout)."""
    rng = np.random.default_rng(seed)
    v, e, f, n_layers, h, k, d = _dims(cfg)
    qkv_bias, o_bias = _biases(cfg)

    def r(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    mt = cfg["model_type"]
    t = {"model.embed_tokens.weight": r(v, e), "model.norm.weight": 1 + r(e)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        if mt != "olmo2":
            t[p + "input_layernorm.weight"] = 1 + r(e)
        t[p + "post_attention_layernorm.weight"] = 1 + r(e)
        if mt == "olmo2":
            t[p + "post_feedforward_layernorm.weight"] = 1 + r(e)
        if mt == "phi3":
            t[p + "self_attn.qkv_proj.weight"] = r((h + 2 * k) * d, e)
        else:
            t[p + "self_attn.q_proj.weight"] = r(h * d, e)
            t[p + "self_attn.k_proj.weight"] = r(k * d, e)
            t[p + "self_attn.v_proj.weight"] = r(k * d, e)
        t[p + "self_attn.o_proj.weight"] = r(e, h * d)
        if mt == "qwen3":
            t[p + "self_attn.q_norm.weight"] = 1 + r(d)
            t[p + "self_attn.k_norm.weight"] = 1 + r(d)
        if mt == "olmo2":
            t[p + "self_attn.q_norm.weight"] = 1 + r(h * d)
            t[p + "self_attn.k_norm.weight"] = 1 + r(k * d)
        if qkv_bias:
            t[p + "self_attn.q_proj.bias"] = r(h * d)
            t[p + "self_attn.k_proj.bias"] = r(k * d)
            t[p + "self_attn.v_proj.bias"] = r(k * d)
        if o_bias:
            t[p + "self_attn.o_proj.bias"] = r(e)
        if mt == "phi3":
            t[p + "mlp.gate_up_proj.weight"] = r(2 * f, e)
        else:
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


def _rope_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope settings from either config form (top level + rope_scaling, rope_parameters)."""
    rp = dict(cfg.get("rope_parameters") or {})
    rs = dict(cfg.get("rope_scaling") or {})
    out = {**rp, **rs}
    out["rope_theta"] = cfg.get("rope_theta", rp.get("rope_theta", 10000.0))
    prf = cfg.get("partial_rotary_factor", rp.get("partial_rotary_factor", 1.0))
    out["partial_rotary_factor"] = prf
    out["rope_type"] = out.get("rope_type", out.get("type", "default"))
    return out


def rotary_dim_np(cfg: dict[str, Any]) -> int:
    """int(head_dim * partial_rotary_factor), as HF's rope init computes it."""
    return int(_dims(cfg)[6] * _rope_dict(cfg)["partial_rotary_factor"])


def longrope_np(cfg: dict[str, Any], seq_len: int) -> tuple[np.ndarray, float]:
    """HF's ``_compute_longrope_parameters`` + ``longrope_frequency_update`` (transformers 5):
    (inverse frequencies for a forward over ``seq_len`` tokens, attention factor)."""
    rd = _rope_dict(cfg)
    d = rotary_dim_np(cfg)
    max_pos = cfg["max_position_embeddings"]
    # Phi3Config always carries original_max_position_embeddings (default 4096); it wins.
    orig = cfg.get("original_max_position_embeddings")
    if orig is None:
        orig = rd.get("original_max_position_embeddings")
    if orig is None:
        orig = 4096 if cfg["model_type"] == "phi3" else max_pos
    factor = rd.get("factor") or max_pos / orig
    att = rd.get("attention_factor")
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = np.asarray(rd["long_factor" if seq_len > orig else "short_factor"], np.float64)
    return 1.0 / (ext * rd["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)), att


def inv_freq_np(cfg: dict[str, Any]) -> np.ndarray:
    """HF rotary inverse frequencies incl. 'linear' and 'llama3' rope_scaling (float64)."""
    d = rotary_dim_np(cfg)
    rd = _rope_dict(cfg)
    inv = 1.0 / (rd["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d))
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
    if cfg["model_type"] in ("mistral", "phi3"):
        return [cfg.get("sliding_window")] * n
    if cfg["model_type"] in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        mwl = cfg.get("max_window_layers", n)
        return [cfg["sliding_window"] if i >= mwl else None for i in range(n)]
    return [None] * n


def forward_np(
    cfg: dict[str, Any], t: dict[str, np.ndarray], ids: list[int], mlp: Any = None
) -> np.ndarray:
    """float64 logits [T, V] of one sequence (no cache), following HF's Llama / Mistral / Qwen2
    / Qwen3 / OLMo 2 / Phi-3 code. ``mlp(layer, h [T, E], tensors) -> [T, E]``, when given,
    replaces the SwiGLU MLP of the pre-norm families (tests/hf_moe_reference.py)."""
    _, e, f, n_layers, h, k, d = _dims(cfg)
    mt = cfg["model_type"]
    eps = cfg["rms_norm_eps"]
    t = {name: np.asarray(a, np.float64) for name, a in t.items()}

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)

    rd = rotary_dim_np(cfg)

    def rope(x: np.ndarray) -> np.ndarray:  # HF apply_rotary_pos_emb, partial: first rd dims
        xr, xp = x[..., :rd], x[..., rd:]
        rot = np.concatenate([-xr[..., rd // 2 :], xr[..., : rd // 2]], -1)
        return np.concatenate([xr * cos + rot * sin, xp], -1)

    n = len(ids)
    pos = np.arange(n)
    if _rope_dict(cfg)["rope_type"] in ("longrope", "su"):
        inv, att = longrope_np(cfg, n)  # the whole forward: seq_len = max(position) + 1 = n
    else:
        inv, att = inv_freq_np(cfg), 1.0
    ang = pos[:, None] * inv[None]
    ang = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(ang)[:, None] * att, np.sin(ang)[:, None] * att
    x = t["model.embed_tokens.weight"][np.asarray(ids)]
    windows = layer_windows_np(cfg)
    for i in range(n_layers):
        p = f"model.layers.{i}."

        def lin(a: np.ndarray, name: str, p: str = p) -> np.ndarray:
            y = a @ t[p + name + ".weight"].T
            b = t.get(p + name + ".bias")
            return y if b is None else y + b

        hs = x if mt == "olmo2" else rms(x, t[p + "input_layernorm.weight"])
        if mt == "phi3":  # qkv = qkv_proj(x); q, k, v = consecutive column blocks
            qkv = lin(hs, "self_attn.qkv_proj")
            q, kk, vv = np.split(qkv, [h * d, h * d + k * d], axis=-1)
        else:
            q = lin(hs, "self_attn.q_proj")
            kk = lin(hs, "self_attn.k_proj")
            vv = lin(hs, "self_attn.v_proj")
        if mt == "olmo2":  # q_norm / k_norm over the whole projection, before the head view
            q, kk = (
                rms(q, t[p + "self_attn.q_norm.weight"]),
                rms(kk, t[p + "self_attn.k_norm.weight"]),
            )
        q, kk, vv = q.reshape(n, h, d), kk.reshape(n, k, d), vv.reshape(n, k, d)
        if mt == "qwen3":  # per head, over head_dim
            q, kk = (
                rms(q, t[p + "self_attn.q_norm.weight"]),
                rms(kk, t[p + "self_attn.k_norm.weight"]),
            )
        q, kk = rope(q), rope(kk)
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
        if mt == "olmo2":  # x + norm(attn(x)); x + norm(mlp(x))
            x = x + rms(lin(o, "self_attn.o_proj"), t[p + "post_attention_layernorm.weight"])
            g, u = lin(x, "mlp.gate_proj"), lin(x, "mlp.up_proj")
            mlp = lin(g / (1 + np.exp(-g)) * u, "mlp.down_proj")
            x = x + rms(mlp, t[p + "post_feedforward_layernorm.weight"])
            continue
        x = x + lin(o, "self_attn.o_proj")
        hs = rms(x, t[p + "post_attention_layernorm.weight"])
        if mt == "phi3":  # gate, up = gate_up_proj(x).chunk(2)
            g, u = np.split(lin(hs, "mlp.gate_up_proj"), [f], axis=-1)
        elif mlp is not None:
            x = x + mlp(i, hs, t)
            continue
        else:
            g, u = lin(hs, "mlp.gate_proj"), lin(hs, "mlp.up_proj")
        x = x + lin(g / (1 + np.exp(-g)) * u, "mlp.down_proj")
    x = rms(x, t["model.norm.weight"])
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return x @ head.T
