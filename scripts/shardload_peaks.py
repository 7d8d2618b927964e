"""Peak memory of sharded loading on simulated CPU devices, for a synthetic checkpoint.

Writes a random-weight Llama checkpoint (one safetensors file per layer, as big hub
checkpoints are sharded), then loads it at each ``--tp`` in a fresh process with that many
simulated CPU devices (``tests/_shardload_worker.py peaks``) and prints, per tp: the model's
bytes, the largest tensor, the peak host memory the load allocated (tracemalloc: numpy and
safetensors buffers), the peak and final anonymous RSS growth of the process (on CPU the
"devices" live in host memory too, so this includes every device's shard), and the bytes each
device holds.

Usage::

    python scripts/shardload_peaks.py --layers 16 --hidden 1024 --tp 1 2 4 8 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "_shardload_worker.py"


def write_checkpoint(path: Path, cfg: dict, seed: int = 0) -> None:
    """A random float32 checkpoint, one file per layer (+ one for the rest) and an index."""
    sys.path.insert(0, str(ROOT))
    from paxcache.models.loading import hf_param_shapes, load_config

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    shapes = hf_param_shapes(load_config(path))
    rng = np.random.default_rng(seed)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        parts = name.split(".")
        key = f"layer{int(parts[2]):04d}" if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(name)
    weight_map = {}
    for key, names in groups.items():
        fname = f"model-{key}.safetensors"
        tensors = {
            n: (rng.standard_normal(shapes[n], np.float32) * 0.02).astype(np.float32) for n in names
        }
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
        del tensors
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def measure(path: Path, tp: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={tp}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, str(WORKER), str(out), "peaks", str(path), str(tp)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"worker failed at tp={tp}:\n{proc.stderr[-4000:]}")
        rep = json.loads(out.read_text())
    return {"stats": rep["stats"], **rep[f"tp{tp}"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--checkpoint", type=Path, help="reuse (or keep) the checkpoint here")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    cfg = {
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or Path(tmp) / "ckpt"
        if not (path / "config.json").is_file():
            write_checkpoint(path, cfg)
        rows = [measure(path, tp) for tp in args.tp]
    mib = 2**20
    print(
        f"{'tp':>3} {'model MiB':>10} {'largest MiB':>12} {'host peak MiB':>14} "
        f"{'RssAnon peak MiB':>17} {'RssAnon end MiB':>16} {'per-device MiB':>15} {'s':>6}"
    )
    for r in rows:
        per_dev = max(r["bytes_per_device"].values())
        print(
            f"{r['tp']:>3} {r['stats']['model_bytes'] / mib:>10.1f} "
            f"{r['stats']['largest_tensor_bytes'] / mib:>12.1f} "
            f"{r['host_peak_traced'] / mib:>14.1f} {r['rss_anon_peak_delta'] / mib:>17.1f} "
            f"{r['rss_anon_end_delta'] / mib:>16.1f} {per_dev / mib:>15.1f} {r['seconds']:>6.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"config": cfg, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
