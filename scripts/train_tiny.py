#!/usr/bin/env python
"""Trains the bundled tiny byte-level Llama (paxcache/models/tiny/) on CPU, reproducibly.

Corpus: the Python standard library's own top-level source files (``Lib/*.py`` of the running
interpreter, found via ``sysconfig.get_paths()["stdlib"]``), sorted by name; every 10th file
is held out for validation. Each file is encoded as ``BOS + utf-8 bytes + EOS``.

Model: vocab 259 (256 bytes + BOS/EOS/PAD), hidden 256, 4 layers, 8 query heads, 2 kv heads
(GQA), head_dim 32, SwiGLU 704, tied embeddings, ~2.9M params.

Training: AdamW (written here in a few lines of jax), warmup + cosine schedule, gradient
clipping, fixed seeds (numpy batch sampler + model init), float32.

Usage:
    python scripts/train_tiny.py [--steps 2000] [--out paxcache/models/tiny]
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxcache.models.llama import LlamaConfig, LlamaForCausalLM, greedy_generate
from paxcache.models.loading import TINY_DIR, save_pretrained
from paxcache.models.tokenizer import ByteTokenizer

log = logging.getLogger("train_tiny")

BOS, EOS, PAD = 256, 257, 258


def tiny_config() -> LlamaConfig:
    """The bundled tiny model's architecture."""
    return LlamaConfig(
        vocab_size=259,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        model_type="llama",
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )


def load_corpus(val_every: int = 10) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Returns (train ids, val ids, file names) from the stdlib's top-level .py files."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if not files:
        raise RuntimeError(f"no .py files in {stdlib}")
    train, val = [], []
    for i, f in enumerate(files):
        data = Path(f).read_bytes()
        ids = np.concatenate([[BOS], np.frombuffer(data, np.uint8).astype(np.int32), [EOS]])
        (val if i % val_every == 0 else train).append(ids)
    return (
        np.concatenate(train).astype(np.int32),
        np.concatenate(val).astype(np.int32),
        [os.path.basename(f) for f in files],
    )


def sample_batch(rng: np.random.Generator, data: np.ndarray, batch: int, seq: int) -> np.ndarray:
    """i32[batch, seq + 1] random windows of the token stream."""
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    return np.stack([data[s : s + seq + 1] for s in starts])


def lr_at(step: jax.Array, peak: float, warmup: int, total: int) -> jax.Array:
    """Linear warmup then cosine decay to 10% of peak."""
    step = step.astype(jnp.float32)
    warm = peak * (step + 1) / warmup
    frac = jnp.clip((step - warmup) / max(1, total - warmup), 0.0, 1.0)
    cos = peak * (0.1 + 0.9 * 0.5 * (1 + jnp.cos(math.pi * frac)))
    return jnp.where(step < warmup, warm, cos)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--out", type=Path, default=TINY_DIR)
    ap.add_argument("--bench", type=int, default=0, help="time N steps and exit")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)

    train, val, names = load_corpus()
    log.info("corpus: %d files, %d train / %d val bytes", len(names), len(train), len(val))
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(args.seed))
    log.info("model: %d params", cfg.num_params())
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        m = nnx.merge(graphdef, params)
        logits = m(batch[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(nll)

    b1, b2, eps = 0.9, 0.95, 1e-8

    @jax.jit
    def train_step(params, mu, nu, step, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        scale = jnp.minimum(1.0, 1.0 / (gnorm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, grads)
        t = (step + 1).astype(jnp.float32)
        lr = lr_at(step, args.lr, args.warmup, args.steps)

        def upd(p, m, v):
            mhat = m / (1 - b1**t)
            vhat = v / (1 - b2**t)
            wd = args.weight_decay if p.ndim >= 2 else 0.0  # no decay on norms
            return p - lr * (mhat / (jnp.sqrt(vhat) + eps) + wd * p)

        params = jax.tree.map(upd, params, mu, nu)
        return params, mu, nu, loss, gnorm

    eval_loss = jax.jit(loss_fn)
    mu = jax.tree.map(jnp.zeros_like, params)
    nu = jax.tree.map(jnp.zeros_like, params)
    rng = np.random.default_rng(args.seed)
    val_rng = np.random.default_rng(args.seed + 1)
    val_batches = [
        sample_batch(val_rng, val, args.batch, args.seq) for _ in range(args.eval_batches)
    ]

    def evaluate(params) -> float:
        return float(np.mean([eval_loss(params, jnp.asarray(b)) for b in val_batches]))

    total = args.bench or args.steps
    t0 = time.time()
    history = []
    for step in range(total):
        batch = jnp.asarray(sample_batch(rng, train, args.batch, args.seq))
        params, mu, nu, loss, gnorm = train_step(params, mu, nu, jnp.int32(step), batch)
        if step == 0:
            loss.block_until_ready()
            log.info("compiled + first step in %.1fs", time.time() - t0)
            t1 = time.time()
        if (step + 1) % 25 == 0 or step == total - 1:
            loss_f, gnorm_f = float(loss), float(gnorm)
            el = time.time() - t1
            log.info(
                "step %d loss %.4f gnorm %.3f  (%.2fs/step)",
                step + 1,
                loss_f,
                gnorm_f,
                el / max(1, step),
            )
        if not args.bench and ((step + 1) % 200 == 0 or step == total - 1):
            vl = evaluate(params)
            history.append({"step": step + 1, "train_loss": float(loss), "val_loss": vl})
            log.info("step %d val loss %.4f (%.3f bits/byte)", step + 1, vl, vl / math.log(2))
    if args.bench:
        return

    train_s = time.time() - t0
    nnx.update(model, params)
    tok = ByteTokenizer()
    samples = {}
    for prompt in ("def ", "import ", "class "):
        out = greedy_generate(model, tok.encode(prompt), 48, stop_ids=(EOS,))
        samples[prompt] = prompt + tok.decode(out)
        log.info("sample %r -> %r", prompt, samples[prompt])
    save_pretrained(model, args.out)
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "ByteTokenizer",
                "paxcache_tokenizer": "byte",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "special_token_ids": {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD},
                "note": "UTF-8 bytes are ids 0..255; see paxcache.models.ByteTokenizer",
            },
            indent=2,
        )
        + "\n"
    )
    final = history[-1]
    train_log = {
        "corpus": "Python standard library top-level *.py files (sysconfig stdlib), sorted; "
        "every 10th file held out for validation",
        "python_version": platform.python_version(),
        "num_files": len(names),
        "train_bytes": len(train),
        "val_bytes": len(val),
        "params": cfg.num_params(),
        "args": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("out", "bench")
        },
        "final_val_loss_nats_per_byte": final["val_loss"],
        "final_val_bits_per_byte": final["val_loss"] / math.log(2),
        "history": history,
        "train_seconds": round(train_s, 1),
        "jax_version": jax.__version__,
        "greedy_samples": samples,
    }
    (args.out / "train_log.json").write_text(json.dumps(train_log, indent=2) + "\n")
    log.info("saved to %s (val loss %.4f) in %.0fs", args.out, final["val_loss"], train_s)


if __name__ == "__main__":
    main()
