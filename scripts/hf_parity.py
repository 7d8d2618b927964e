"""Parity with transformers on random checkpoints that transformers itself writes.

Two steps, because transformers needs torch, which paxcache does not depend on:

    # in a side environment with torch + transformers (pip install torch transformers):
    python scripts/hf_parity.py write OUT_DIR [CASE ...] [--lens 19,11,26]
    # in paxcache's environment:
    python scripts/hf_parity.py check OUT_DIR [CASE ...] [--tp N --ep N]

``write`` builds each case's config with ``AutoConfig.for_model`` (shapes and options the
unit tests do not use: windows shorter than the prompts, llama3 / linear / yarn / longrope
RoPE, explicit head_dim, q/k norms, MoE routing options, soft caps, sinks), draws random
weights (float32), saves them with ``save_pretrained`` and records, per prompt, the logits
and the greedy tokens of ``generate`` and of a no-cache forward per token. ``check`` loads
each directory with ``load_pretrained`` (dense logits) and ``Engine.from_pretrained``
(8-token chunked prefill, 4-token blocks, then the first prompt again for a prefix hit) and
prints the largest logit difference and whether the engine's greedy tokens equal HF's.
``--tp`` / ``--ep`` need that many devices (on a CPU:
``XLA_FLAGS=--xla_force_host_platform_device_count=4``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)  # fmt: skip
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}  # fmt: skip
_YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 64}  # fmt: skip
_LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
             "long_factor": [2.0 + 0.3 * i for i in range(8)]}  # fmt: skip
SSF = ["sliding_attention", "full_attention", "sliding_attention"]
CASES: dict[str, dict[str, Any]] = {
    "llama_l3rope": dict(model_type="llama", rope_scaling=_LLAMA3, rope_theta=5e5,
                         attention_bias=True, head_dim=24),
    "llama_tied_linear": dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=4,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral_window": dict(model_type="mistral", sliding_window=5, head_dim=32),
    "qwen2_window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=6,
                         max_window_layers=1, num_key_value_heads=1),
    "qwen3": dict(model_type="qwen3", head_dim=32, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=40, norm_topk_prob=False, decoder_sparse_step=2,
                      mlp_only_layers=[2]),
    "qwen3_moe_norm": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=3,
                           moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral_window": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=7),
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                   attn_logit_softcapping=30.0, final_logit_softcapping=20.0,
                   hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=32, sliding_window=5, layer_types=SSF,
                        query_pre_attn_scalar=32, rope_local_base_freq=1e4, rope_theta=1e6,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "phi3_longrope": dict(model_type="phi3", original_max_position_embeddings=64,
                          rope_scaling=_LONGROPE, partial_rotary_factor=1.0),
    "phi3_partial": dict(model_type="phi3", partial_rotary_factor=0.5, sliding_window=None),
    "olmo2": dict(model_type="olmo2", num_key_value_heads=4),
    "gpt_oss": dict(model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=4, layer_types=SSF, rope_scaling=_YARN, num_attention_heads=8,
                    intermediate_size=64),
}  # fmt: skip
NEW_TOKENS = 10


def write(out: Path, names: list[str], lens: list[int]) -> None:
    """Checkpoints and HF's reference outputs (needs torch and transformers)."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in lens]
    for i, name in enumerate(names):
        kw = dict(COMMON) | CASES[name]
        model_type = kw.pop("model_type")
        cfg = AutoConfig.for_model(model_type, **kw)
        cfg._attn_implementation = "eager"
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
        gemma = model_type.startswith("gemma")  # (1 + w) norms: weights around 0
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() >= 2:  # routers a little sharper: decisive top-k
                    p.normal_(0, 0.3 if "router" in pname or "gate.weight" in pname else 0.15)
                elif "norm" in pname:
                    p.normal_(0.0 if gemma else 1.0, 0.1)
                else:  # biases, sinks
                    p.normal_(0, 0.5)
        path = out / name
        model.save_pretrained(path, safe_serialization=True)
        ref: dict[str, Any] = {"prompts": np.array(json.dumps(prompts))}
        with torch.no_grad():
            for j, p in enumerate(prompts):
                ids = torch.tensor([p])
                ref[f"logits{j}"] = model(ids).logits[0].float().numpy()
                gen = model.generate(
                    ids,
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                ref[f"gen{j}"] = gen[0, len(p) :].numpy()
                seq = list(p)
                for _ in range(NEW_TOKENS):  # no cache: the whole sequence per token
                    seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
                ref[f"fwd{j}"] = np.array(seq[len(p) :])
        np.savez(path / "ref.npz", **ref)
        print(f"{name}: written", flush=True)


def check(out: Path, names: list[str], tp: int, ep: int) -> int:
    """Dense logits and engine greedy tokens against the recorded references."""
    import jax.numpy as jnp
    import numpy as np

    from paxcache import Engine, SamplingParams
    from paxcache.models import load_pretrained

    bad = 0
    for name in names:
        path = out / name
        ref = np.load(path / "ref.npz")
        prompts = json.loads(str(ref["prompts"]))
        model, _ = load_pretrained(path, jnp.float32)
        logits = [np.asarray(model(jnp.asarray([p], jnp.int32))[0]) for p in prompts]
        err = max(float(np.abs(x - ref[f"logits{j}"]).max()) for j, x in enumerate(logits))
        engine = Engine.from_pretrained(
            path, dtype=jnp.float32, max_num_seqs=len(prompts), max_num_batched_tokens=8,
            num_blocks=128, block_size=4, warmup=False, tp=tp, ep=ep,
        )  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        again = engine.generate(prompts[:1], params)[0]
        same = [tokens[j] == ref[f"gen{j}"].tolist() for j in range(len(prompts))]
        ok = err < 2e-3 and all(same) and again.outputs[0].token_ids == tokens[0]
        bad += not ok
        verdict = "ok" if ok else "MISMATCH"
        print(
            f"{name}: max |logit diff| {err:.2e}, engine == HF generate {same}, prefix hit "
            f"{again.num_cached_tokens} tokens: {verdict}",
            flush=True,
        )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["write", "check"])
    ap.add_argument("out", type=Path)
    ap.add_argument("cases", nargs="*", help=f"default: all of {sorted(CASES)}")
    ap.add_argument("--lens", default="19,11,26", help="prompt lengths (write)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    a = ap.parse_args(argv)
    names = a.cases or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}")
    if a.mode == "write":
        os.makedirs(a.out, exist_ok=True)
        write(a.out, names, [int(n) for n in a.lens.split(",")])
        return 0
    return check(a.out, names, a.tp, a.ep)


if __name__ == "__main__":
    sys.exit(main())
