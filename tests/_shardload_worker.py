"""Sharded loading on simulated CPU devices, run by ``tests/test_shardload.py`` (and
``scripts/shardload_peaks.py``) in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` so the caller keeps one device.
Writes one JSON report; the callers assert on it or print it.

Usage:
  ``python tests/_shardload_worker.py OUT.json fast BIG_CKPT SMALL_CKPT...`` loads
  ``BIG_CKPT`` at tp = 1, 2, 4 measuring peak host memory (tracemalloc: every numpy and
  safetensors allocation; RssAnon sampled every 2 ms), and each ``SMALL_CKPT`` at tp = 1, 2
  (logits, and the engine's greedy tokens through ``Engine.from_pretrained(..., tp=2)``).
  ``python tests/_shardload_worker.py OUT.json multihost BIG_CKPT PROCESS_ID PORT``: one of
  two processes (2 devices each) loading ``BIG_CKPT`` into one tp=4 mesh over both.
  ``python tests/_shardload_worker.py OUT.json peaks CKPT TP...``: the peaks only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
import tracemalloc

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from paxcache import Engine, SamplingParams, multihost, sharding  # noqa: E402
from paxcache.models.loading import load_model, load_pretrained  # noqa: E402

IDS = [5, 17, 3, 60, 9, 22, 41, 0, 13, 7, 33, 2]


class _LoadLog(logging.Handler):
    """Keeps the loader's summary record (bytes and slices read by this process)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("loaded "):
            self.records.append(record)


LOG = _LoadLog()
_loader_logger = logging.getLogger("paxcache.models.loading")
_loader_logger.addHandler(LOG)
_loader_logger.setLevel(logging.DEBUG)


def _rss_anon() -> int:
    """Anonymous resident memory of this process (file-backed mmap pages excluded)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class _RssSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _rss_anon()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.002)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, _rss_anon())


def _mesh(tp: int):
    return None if tp == 1 else sharding.make_mesh(tp)


def _params(model) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        name = "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        out[name.removesuffix("/value")] = leaf
    return out


def logits(model) -> np.ndarray:
    """The model's logits for ``IDS``, gathered to every process."""
    graphdef, state = nnx.split(model)
    leaf = jax.tree.leaves(state)[0]
    where = leaf.sharding
    if isinstance(where, jax.sharding.NamedSharding):
        where = sharding.replicated(where.mesh)
    ids = sharding.place(np.asarray([IDS], np.int32), where)
    fn = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)[0], out_shardings=where)
    return np.asarray(fn(state, ids).addressable_shards[0].data)


def shard_report(model) -> dict:
    """Per parameter: global shape, spec, each addressable device's shard shape; and the
    bytes every device holds."""
    per_device: dict[str, int] = {}
    params = {}
    for name, arr in _params(model).items():
        shards = {}
        for s in arr.addressable_shards:
            nbytes = math.prod(s.data.shape) * s.data.dtype.itemsize
            per_device[str(s.device)] = per_device.get(str(s.device), 0) + nbytes
            shards[str(s.device)] = list(s.data.shape)
        spec = arr.sharding.spec if isinstance(arr.sharding, jax.sharding.NamedSharding) else ()
        params[name] = {
            "shape": list(arr.shape),
            "itemsize": arr.dtype.itemsize,
            "spec": [None if a is None else str(a) for a in spec],
            "shards": shards,
        }
    return {"params": params, "bytes_per_device": per_device}


def measured_load(path: str, tp: int, with_logits: bool = True) -> dict:
    """Loads ``path`` at ``tp`` under tracemalloc and an RssAnon sampler."""
    import gc

    gc.collect()
    rss0 = _rss_anon()
    sampler = _RssSampler()
    sampler.start()
    tracemalloc.start()
    t0 = time.perf_counter()
    model = load_model(path, mesh=_mesh(tp))
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - t0
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_peak = sampler.stop()
    rss_end = _rss_anon()
    rec = LOG.records[-1]
    rep = {
        "tp": tp,
        "seconds": seconds,
        "host_peak_traced": traced_peak,
        "rss_anon_peak_delta": rss_peak - rss0,
        "rss_anon_end_delta": rss_end - rss0,
        "mib_read": float(rec.args[2]),
        "slices": int(rec.args[3]),
        **shard_report(model),
    }
    if with_logits:
        rep["logits"] = logits(model).tolist()
    return rep


def model_stats(path: str) -> dict:
    """Model bytes and the largest checkpoint tensor, from the safetensors headers."""
    from safetensors import safe_open

    from paxcache.models.loading import _tensor_files

    largest, total = 0, 0
    files = _tensor_files(__import__("pathlib").Path(path))
    for name, fpath in files.items():
        with safe_open(str(fpath), framework="np") as f:
            sl = f.get_slice(name)
            n = math.prod(sl.get_shape()) * 4  # float32 params
        largest, total = max(largest, n), total + n
    return {"model_bytes": total, "largest_tensor_bytes": largest}


def reference_logits(path: str) -> list:
    """HF's model in numpy (tests/hf_reference.py) on the checkpoint's own tensors."""
    from hf_reference import forward_np
    from safetensors.numpy import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    return np.asarray(forward_np(cfg, tensors, IDS)).tolist()


def small_report(path: str, with_engine: bool) -> dict:
    """Logits at tp = 1, 2; with ``with_engine``, the greedy tokens of
    ``Engine.from_pretrained(..., tp=2)`` and of the dense forward of the tp = 1 load."""
    from paxcache.models import greedy_generate

    rep: dict = {}
    models = {tp: load_model(path, mesh=_mesh(tp)) for tp in (1, 2)}
    for tp, m in models.items():
        rep[f"tp{tp}_logits"] = logits(m).tolist()
    rep.update(quantized_report(path))
    if not with_engine:
        return rep
    rep["dense_tokens"] = greedy_generate(models[1], IDS, 6)
    eng = Engine.from_pretrained(
        path, tp=2, num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=8
    )
    out = eng.generate([IDS], SamplingParams(max_tokens=6, ignore_eos=True))
    rep["tp2_tokens"] = out[0].outputs[0].token_ids

    def pointers(tree) -> list[int]:
        return [
            s.data.unsafe_buffer_pointer()
            for x in jax.tree.leaves(tree)
            for s in x.addressable_shards
        ]

    # The engine uses the loaded shards as they are: the same buffers, no copy.
    rep["engine_reuses_loaded_shards"] = pointers(nnx.state(eng.model, nnx.Param)) == pointers(
        eng._params
    )
    try:
        load_pretrained(path, tp=3)
        rep["tp3_error"] = None
    except ValueError as e:
        rep["tp3_error"] = str(e)
    return rep


def quantized_report(path: str, scheme: str = "int8") -> dict:
    """Quantized at load at tp = 1, 2: logits, whether every quantized leaf (values, scales)
    is identical, and the shardings of a column- and a row-parallel weight's leaves.

    Weight-only int8: with ``int8-w8a8`` the per-token activation rounding can flip where
    tp=2's float sums differ from tp=1's in the last bit, so its logits are not comparable
    at float tolerance (its values and scales are still identical)."""
    t0 = time.perf_counter()
    models = {tp: load_model(path, mesh=_mesh(tp), quantization=scheme) for tp in (1, 2)}
    rep: dict = {f"q_tp{tp}_logits": logits(m).tolist() for tp, m in models.items()}
    leaves = {tp: _params(m) for tp, m in models.items()}
    quantized = [n for n in leaves[1] if n.endswith(("qvalue", "scale"))]
    rep["q_leaves"] = quantized
    rep["q_leaves_equal"] = all(
        np.array_equal(np.asarray(leaves[1][n]), np.asarray(leaves[2][n])) for n in quantized
    )
    rep["q_specs"] = {
        n: [None if a is None else str(a) for a in leaves[2][n].sharding.spec]
        for n in quantized
        if n.startswith(("layers/q_proj", "layers/o_proj"))
    }
    rep["q_seconds"] = time.perf_counter() - t0
    return rep


def main() -> None:
    out_path, suite = sys.argv[1], sys.argv[2]
    report: dict = {}
    t0 = time.perf_counter()
    if suite == "fast":
        big, smalls = sys.argv[3], sys.argv[4:]
        report["stats"] = model_stats(big)
        for tp in (1, 2, 4):
            report[f"tp{tp}"] = measured_load(big, tp)
        report["reference_logits"] = reference_logits(big)
        for k, path in enumerate(smalls):
            report[os.path.basename(path)] = small_report(path, with_engine=k == 0)
    elif suite == "peaks":
        path, tps = sys.argv[3], [int(t) for t in sys.argv[4:]]
        report["stats"] = model_stats(path)
        for tp in tps:
            rep = measured_load(path, tp, with_logits=False)
            rep.pop("params")
            report[f"tp{tp}"] = rep
    elif suite == "multihost":
        path, pid, port = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        multihost.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
        report["num_devices"] = len(jax.devices())
        report["num_local_devices"] = len(jax.local_devices())
        report["tp4"] = measured_load(path, 4)
    else:
        raise SystemExit(f"unknown suite {suite!r}")
    report["seconds"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
