"""Test helpers for gpt-oss: a small HF config, random checkpoints in the float and the MXFP4
expert layouts, and a float64 numpy forward of transformers 5.24's ``GptOssForCausalLM``
(eager attention with sinks, yarn RoPE, the biased top-k-softmax router, the clamped SwiGLU
experts with HF's interleaved ``gate_up_proj``), independent of paxcache's model code.

Checked against transformers itself: ``tests/fixtures/gpt_oss_tiny_hf.npz`` holds, for the
checkpoints :func:`random_gpt_oss_tensors` writes from seeds 1 (float) and 2 (MXFP4),
transformers' float32 logits and greedy ``generate`` tokens (``GptOssForCausalLM.
from_pretrained``, eager attention; the MXFP4 one with ``Mxfp4Config(dequantize=True)``),
and transformers' ``convert_moe_packed_tensors`` of one random MXFP4 tensor; written by
``python tests/hf_gpt_oss_reference.py OUT.npz`` in /work/hfvenv (the only place that needs
torch and transformers). :func:`checksum` guards that the seeds still give those tensors.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

IDS = [3, 17, 5, 9, 22, 41, 8, 1, 60, 33, 12, 7]  # longer than the window (4)
GENERATE = 8  # tokens of the saved greedy generate
FP4 = np.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def gpt_oss_config(**overrides: Any) -> dict[str, Any]:
    """A small gpt-oss config.json (V=64, E=32, L=3 alternating sliding(4)/full, H=4, K=2,
    D=8, 4 experts top-2, Fm=32; yarn RoPE), in transformers 5's ``rope_parameters`` form."""
    d: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
        },
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    d.update(overrides)
    return d


def _dims(cfg: dict[str, Any]) -> tuple[int, ...]:
    return (
        cfg["vocab_size"],
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["num_local_experts"],
    )


def dequant_np(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 ``[..., G, 16]`` codes + ``[..., G]`` e8m0 scales -> float64 ``[..., G * 32]``
    (written from the OCP MX spec: low nibble first, value * 2 ** (scale - 127))."""
    vals = np.stack([FP4[blocks & 15], FP4[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1)


def random_gpt_oss_tensors(
    cfg: dict[str, Any], seed: int = 0, layout: str = "float"
) -> dict[str, np.ndarray]:
    """Random float32 HF-named tensors (uint8 ``*_blocks`` / ``*_scales`` experts for
    ``layout="mxfp4"``). Expert weights are large enough that the SwiGLU clamp (7) bites and
    the router is decisive."""
    rng = np.random.default_rng(seed)
    v, e, fm, n_layers, h, k, d, x = _dims(cfg)

    def r(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {
        "model.embed_tokens.weight": r(v, e, scale=1.0),
        "model.norm.weight": 1 + r(e),
        "lm_head.weight": r(v, e),
    }
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + r(e)
        t[p + "post_attention_layernorm.weight"] = 1 + r(e)
        for name, out in (("q", h * d), ("k", k * d), ("v", k * d)):
            t[p + f"self_attn.{name}_proj.weight"] = r(out, e, scale=0.4)
            t[p + f"self_attn.{name}_proj.bias"] = r(out)
        t[p + "self_attn.o_proj.weight"] = r(e, h * d)
        t[p + "self_attn.o_proj.bias"] = r(e)
        t[p + "self_attn.sinks"] = r(h, scale=1.5)
        t[p + "mlp.router.weight"] = r(x, e, scale=3.0)
        t[p + "mlp.router.bias"] = r(x, scale=0.5)
        ex = p + "mlp.experts."
        t[ex + "gate_up_proj_bias"] = r(x, 2 * fm, scale=0.5)
        t[ex + "down_proj_bias"] = r(x, e)
        if layout == "float":
            t[ex + "gate_up_proj"] = r(x, e, 2 * fm, scale=1.5)
            t[ex + "down_proj"] = r(x, fm, e, scale=0.05)
            continue
        for name, rows, cols, base in (("gate_up_proj", 2 * fm, e, 127), ("down_proj", e, fm, 119)):
            t[ex + name + "_blocks"] = rng.integers(0, 256, (x, rows, cols // 32, 16), np.uint8)
            t[ex + name + "_scales"] = rng.integers(
                base - 1, base + 1, (x, rows, cols // 32), np.uint8
            )
    return t


def checksum(t: dict[str, np.ndarray]) -> float:
    """A fingerprint of a tensor set (sum of |values| over sorted names)."""
    return float(sum(np.abs(t[n].astype(np.float64)).sum() for n in sorted(t)))


def write_checkpoint(path: Path, cfg: dict[str, Any], t: dict[str, np.ndarray]) -> Path:
    """config.json (with ``quantization_config`` mxfp4 when the experts are packed) and
    model.safetensors."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    path.mkdir(parents=True, exist_ok=True)
    if "model.layers.0.mlp.experts.gate_up_proj_blocks" in t:
        cfg = dict(cfg, quantization_config={"quant_method": "mxfp4"})
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _experts_np(t: dict[str, np.ndarray], ex: str) -> tuple[np.ndarray, np.ndarray]:
    """(gate_up [X, E, 2Fm], down [X, Fm, E]) in HF's in-memory layout, float64."""
    if ex + "gate_up_proj" in t:
        return t[ex + "gate_up_proj"], t[ex + "down_proj"]
    gu = dequant_np(t[ex + "gate_up_proj_blocks"], t[ex + "gate_up_proj_scales"])
    down = dequant_np(t[ex + "down_proj_blocks"], t[ex + "down_proj_scales"])
    return np.swapaxes(gu, 1, 2), np.swapaxes(down, 1, 2)  # HF transposes after dequant


def yarn_np(cfg: dict[str, Any]) -> tuple[np.ndarray, float]:
    """HF ``_compute_yarn_parameters``: (inverse frequencies, attention factor), float64."""
    rp = cfg.get("rope_parameters") or {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}
    d, base, factor = cfg["head_dim"], rp["rope_theta"], rp["factor"]
    orig = rp["original_max_position_embeddings"]
    att = rp.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def dim(rot: float) -> float:
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim(rp.get("beta_fast") or 32), dim(rp.get("beta_slow") or 1)
    if rp.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    hi = hi + 0.001 if lo == hi else hi
    pos = base ** (np.arange(0, d, 2) / d)
    ramp = np.clip((np.arange(d // 2) - lo) / (hi - lo), 0, 1)
    return (1 / (factor * pos)) * ramp + (1 / pos) * (1 - ramp), att


def gpt_oss_forward_np(cfg: dict[str, Any], t: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """float64 logits [T, V] of one sequence (no cache), following HF's gpt-oss code."""
    _, e, fm, n_layers, h, k, d, x_n = _dims(cfg)
    top_k, eps, limit = cfg["num_experts_per_tok"], cfg["rms_norm_eps"], cfg["swiglu_limit"]
    alpha = cfg.get("swiglu_alpha", 1.702)
    t64 = {n: a.astype(np.float64) if a.dtype != np.uint8 else a for n, a in t.items()}

    def rms(a: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w * a / np.sqrt(np.mean(a * a, -1, keepdims=True) + eps)

    n = len(ids)
    pos = np.arange(n)
    inv, att = yarn_np(cfg)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None] * att, np.sin(ang)[:, None] * att  # [T, 1, D/2]

    def rope(a: np.ndarray) -> np.ndarray:  # HF _apply_rotary_emb: halves, no concat
        a1, a2 = a[..., : d // 2], a[..., d // 2 :]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], -1)

    xs = t64["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(n_layers):
        p = f"model.layers.{i}."

        def lin(a: np.ndarray, name: str, p: str = p) -> np.ndarray:
            return a @ t64[p + name + ".weight"].T + t64[p + name + ".bias"]

        hs = rms(xs, t64[p + "input_layernorm.weight"])
        q = rope(lin(hs, "self_attn.q_proj").reshape(n, h, d))
        kk = rope(lin(hs, "self_attn.k_proj").reshape(n, k, d))
        vv = lin(hs, "self_attn.v_proj").reshape(n, k, d)
        kk, vv = np.repeat(kk, h // k, axis=1), np.repeat(vv, h // k, axis=1)
        s = np.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d)
        mask = pos[None, :] <= pos[:, None]
        if cfg["layer_types"][i] == "sliding_attention":
            mask &= pos[None, :] > pos[:, None] - cfg["sliding_window"]
        s = np.where(mask[None], s, -np.inf)
        sink = np.broadcast_to(t64[p + "self_attn.sinks"][:, None, None], (h, n, 1))
        s = np.concatenate([s, sink], -1)  # the sink joins the softmax, then is dropped
        s = np.exp(s - s.max(-1, keepdims=True))
        s = (s / s.sum(-1, keepdims=True))[..., :-1]
        o = np.einsum("hqk,khd->qhd", s, vv).reshape(n, h * d)
        xs = xs + lin(o, "self_attn.o_proj")
        hs = rms(xs, t64[p + "post_attention_layernorm.weight"])
        logits = hs @ t64[p + "mlp.router.weight"].T + t64[p + "mlp.router.bias"]
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]  # torch.topk ties: lower
        w = np.take_along_axis(logits, top, -1)
        w = np.exp(w - w.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        ex = p + "mlp.experts."
        gate_up, down = _experts_np(t64, ex)
        gu_b, down_b = t64[ex + "gate_up_proj_bias"], t64[ex + "down_proj_bias"]
        out = np.zeros_like(hs)
        for row in range(n):
            for j in range(top_k):
                xe = top[row, j]
                gu = hs[row] @ gate_up[xe] + gu_b[xe]
                g, u = np.minimum(gu[0::2], limit), np.clip(gu[1::2], -limit, limit)
                act = (u + 1) * g / (1 + np.exp(-g * alpha))
                out[row] += w[row, j] * (act @ down[xe] + down_b[xe])
        xs = xs + out
    return rms(xs, t64["model.norm.weight"]) @ t64["lm_head.weight"].T


def _write_hf_fixture(out: Path) -> None:  # pragma: no cover - run by hand in /work/hfvenv
    import tempfile  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from transformers import GptOssForCausalLM, Mxfp4Config  # noqa: PLC0415
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: PLC0415

    cfg = gpt_oss_config()
    saved: dict[str, np.ndarray] = {}
    for layout, seed in (("float", 1), ("mxfp4", 2)):
        t = random_gpt_oss_tensors(cfg, seed, layout)
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(Path(tmp), cfg, t)
            kw = {"quantization_config": Mxfp4Config(dequantize=True)} if layout == "mxfp4" else {}
            model = GptOssForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, attn_implementation="eager", **kw
            ).eval()
            with torch.no_grad():
                ids = torch.tensor([IDS])
                saved[f"{layout}_logits"] = model(ids).logits[0].numpy()
                gen = model.generate(ids, max_new_tokens=GENERATE, do_sample=False)
            saved[f"{layout}_generate"] = gen[0, len(IDS) :].numpy()
        saved[f"{layout}_checksum"] = np.float64(checksum(t))
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (2, 3, 2, 16), np.uint8)
    scales = rng.integers(120, 135, (2, 3, 2), np.uint8)
    ref = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    saved.update(mxfp4_blocks=blocks, mxfp4_scales=scales, mxfp4_hf_dequant=ref.numpy())
    np.savez(out, **saved)


if __name__ == "__main__":  # pragma: no cover
    _write_hf_fixture(Path(sys.argv[1]))
