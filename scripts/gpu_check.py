"""Short visit to a Hopper GPU: check every Mosaic GPU kernel against its oracle, then time it.

    bash scripts/gpu_check.sh --quick        # about 3 minutes on an H100/H200
    bash scripts/gpu_check.sh                # the full grid (about 8 minutes)
    python scripts/gpu_check.py --dry-run    # CPU: the same harness on tiny shapes (interpret)

Made for a borrowed machine with no network and minutes to spare: it runs under the device's
own ``python3`` and JAX (nothing installed; the repository comes in through ``PYTHONPATH``),
and everything it learns is written as it goes, one JSON object per line, to
``$OUT/gpu_check.jsonl`` (or ``--out DIR``), with full tracebacks in ``tracebacks.txt`` there.

1. **Environment** (first line): python, jax, jaxlib, CUDA plugin, driver, ptxas versions,
   device kind and compute capability. Anything but compute capability 9.0 stops the run at
   once (exit status 2): the kernels need Hopper's wgmma and TMA.
2. **Correctness** (every case compiled and compared with ``kernels_pallas.reference``, pages
   NaN wherever no token was written): decode and ragged over head_dim x G x block_size,
   soft cap and sliding window, stacked token-major ``kv_pages [L, N, S, C, P, D]``
   (:mod:`kernels_pallas.kv_layout`, every layer different) read at a traced ``layer=``,
   4K-key contexts with ``num_splits=1`` at pipeline depths 1, 2 and 3 (the stage ring wraps
   dozens of times), the float32 XLA fallback, and XLA's ``write_kv``/``copy_blocks``. Then
   ``ptxas -v`` of every compiled kernel (``MOSAIC_GPU_DUMP_PTXAS`` into ``$OUT/mosaic_dump``):
   registers and any spills (the head_dim 256 risk). If any case fails, timing is skipped
   (exit status 1).
3. **Timing** (bf16): every call runs inside one jit that loops over several disjoint sets of
   blocks of one page pool built on the device, so the working set is at least 256 MB and
   nothing is served from L2; each timed output is then checked against the oracle. Decode
   attention (32 query / 8 KV heads, head_dim 128, block_size 16) for B x context, a ragged
   mixed batch, and XLA's KV writes and block copies, each as GB/s and as a fraction of the
   device copy bandwidth measured the same way; attention also as a ratio to JAX's bundled
   GPU paged attention (``jax.experimental.pallas.ops.gpu.paged_attention``) on the same
   inputs (its head-major ``[K, N, S, D]`` copy of the pages, made outside the timed calls).
   The last line, ``"case": "summary"``, holds the headline: decode at B = 64, context 2048.

A per-case watchdog turns a hang into a recorded ``"status": "timeout"`` line (with every
thread's stack in ``tracebacks.txt``) and exits with status 3; ``gpu_check.sh`` then resumes
with the cases not yet recorded (``--resume``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import functools
import glob
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import kv_layout, kv_ops, reference
from kernels_pallas.gpu import attention as ga
from kernels_pallas.gpu import triton_attention as ta

EXIT_FAILED, EXIT_NOT_HOPPER, EXIT_HANG = 1, 2, 3
MIN_WORKING_SET = 256 << 20
HEADLINE = (64, 2048)  # decode B, context reported in the summary


# ---------------------------------------------------------------------------------------------
# Harness: JSON lines, tracebacks, watchdog
# ---------------------------------------------------------------------------------------------


class Recorder:
    """Appends one JSON object per line to ``DIR/gpu_check.jsonl`` (flushed and fsynced)."""

    def __init__(self, out_dir: str):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "gpu_check.jsonl")
        self.tb_path = os.path.join(out_dir, "tracebacks.txt")
        self.lock = threading.Lock()

    def records(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def done_cases(self) -> set[str]:
        return {r.get("case") for r in self.records()}

    def write(self, record: dict) -> None:
        record = dict(
            record, time=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        )
        with self.lock, open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(json.dumps(record, default=str), flush=True)

    def traceback(self, case: str, text: str) -> None:
        with self.lock, open(self.tb_path, "a") as f:
            f.write(f"===== {case}\n{text}\n")


class Watchdog:
    """Calls ``on_timeout(case)`` if a case runs past ``seconds`` (a hung kernel cannot be
    interrupted from Python, so the default action records the hang and exits the process)."""

    def __init__(self, seconds: float, on_timeout: Callable[[str], None]):
        self.seconds = seconds
        self.on_timeout = on_timeout

    @contextlib.contextmanager
    def guard(self, case: str, seconds: float | None = None):
        timer = threading.Timer(seconds or self.seconds, self.on_timeout, args=(case,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


def hang_and_exit(rec: Recorder) -> Callable[[str], None]:
    def action(case: str) -> None:
        rec.write(dict(case=case, status="timeout", detail="no result before the watchdog"))
        with open(rec.tb_path, "a") as f:
            f.write(f"===== {case}: watchdog, all threads:\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        os._exit(EXIT_HANG)

    return action


def run_case(
    rec: Recorder, dog: Watchdog, case: str, fn: Callable[[], dict], done: set, seconds=None
) -> bool:
    """Run one case under the watchdog; record ok/fail/error with its details. True if ok."""
    if case in done:
        return True
    t0 = time.perf_counter()
    try:
        with dog.guard(case, seconds):
            result = fn()
        ok = bool(result.pop("ok", True))
        rec.write(dict(case=case, status="ok" if ok else "fail", seconds=_secs(t0), **result))
        return ok
    except Exception as e:  # one bad case must not hide the others
        rec.traceback(case, traceback.format_exc())
        detail = " | ".join(traceback.format_exception_only(type(e), e)[-1].strip().splitlines())
        rec.write(dict(case=case, status="error", seconds=_secs(t0), detail=detail[:500]))
        return False


def _secs(t0: float) -> float:
    return round(time.perf_counter() - t0, 2)


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return (out.stdout or out.stderr).strip()
    except Exception as e:  # noqa: BLE001 - recorded, never fatal
        return f"unavailable ({type(e).__name__})"


def environment() -> dict:
    """Versions and device facts (never raises)."""
    dev = jax.devices()[0]
    plugins = {
        d.metadata["Name"]: d.version
        for d in importlib.metadata.distributions()
        if d.metadata["Name"]
        and d.metadata["Name"].lower().replace("_", "-").startswith("jax-cuda")
    }
    bundled = os.path.join(os.path.dirname(jax.__file__), "..", "nvidia", "**", "bin", "ptxas")
    ptxas = sorted({shutil.which("ptxas") or "", *glob.glob(bundled, recursive=True)} - {""})
    import jaxlib

    return dict(
        case="environment",
        python=sys.version.split()[0],
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        cuda_plugins=plugins,
        backend=jax.default_backend(),
        device_kind=dev.device_kind,
        device_count=jax.device_count(),
        compute_capability=getattr(dev, "compute_capability", None),
        driver=_run(
            ["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"]
        ),  # fmt: skip
        ptxas={p: _run([p, "--version"]).splitlines()[-1:] for p in ptxas},
    )


# ---------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------


def make_pages(rng, *, kv_heads, s, d, kv_lens, m, dtype, layers=1, spare=4):
    """Random distinct block tables and stacked token-major pages ``[L, N, S, C, P, D]``
    (:func:`kv_layout.merge_kv` of random K and V); NaN in every slot no token was written
    to (in every layer)."""
    n = int(sum(-(-int(x) // s) for x in kv_lens)) + spare
    tables = np.full((len(kv_lens), m), -1, np.int32)
    perm = rng.permutation(n)
    written = np.zeros((n, s), bool)
    nxt = 0
    for i, length in enumerate(kv_lens):
        nb = -(-int(length) // s)
        tables[i, :nb] = perm[nxt : nxt + nb]
        for j in range(nb):
            written[perm[nxt + j], : min(s, int(length) - j * s)] = True
        nxt += nb
    shape = (layers, n, s, kv_heads, d)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    kv = kv_layout.merge_kv(k, v)
    kv = jnp.where(jnp.asarray(written)[None, :, :, None, None, None], kv, jnp.nan)
    return kv.astype(dtype), jnp.asarray(tables)


def _compare(out, want, dtype) -> dict:
    out = np.asarray(out, np.float32)
    want = np.asarray(want, np.float32)
    tol = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2
    finite = bool(np.isfinite(out).all())
    err = float(np.max(np.abs(out - want) / (1.0 + np.abs(want)))) if out.size else 0.0
    return dict(ok=finite and err <= tol, max_rel_err=round(err, 6), finite=finite)


def decode_case(*, g, d, s, dtype, cap=None, win=None, kv_heads=2, ctx=256, layers=0,
                num_splits=None, kv_stages=None, interpret=False, seed=0) -> dict:  # fmt: skip
    """``layers=0``: one layer (``L = 1``, no ``layer=``); else ``L = layers`` pages, every
    layer different, read at a traced ``layer = L - 1``."""
    rng = np.random.default_rng(seed)
    m = -(-ctx // s)
    lens = np.asarray([1, 0, s, ctx, min(ctx, 2 * s + 3), max(1, ctx - 5)], np.int32)
    kv, tables = make_pages(rng, kv_heads=kv_heads, s=s, d=d, kv_lens=lens, m=m, dtype=dtype,
                            layers=max(1, layers))  # fmt: skip
    q = jnp.asarray(rng.standard_normal((len(lens), kv_heads * g, d)), dtype)
    kw = dict(sm_scale=d**-0.5, soft_cap=cap, sliding_window=win)
    extra = dict(layer=jnp.int32(layers - 1)) if layers else {}
    out = ga.paged_attention_gpu(
        q, kv, jnp.asarray(lens), tables, num_kv_heads=kv_heads, interpret=interpret,
        num_splits=num_splits, kv_stages=kv_stages, **kw, **extra,
    )  # fmt: skip
    want = reference.paged_attention_reference(
        q, kv[max(0, layers - 1)], jnp.asarray(lens), tables, num_kv_heads=kv_heads, **kw
    )
    return _compare(out, want, dtype)


def ragged_case(*, g, d, s, dtype, cap=None, win=None, kv_heads=2, ctx=256, layers=0,
                interpret=False, seed=0) -> dict:  # fmt: skip
    """``layers`` as in :func:`decode_case`."""
    rng = np.random.default_rng(seed)
    m = -(-ctx // s)
    rows = [(1, ctx - 3), (min(40, ctx), min(40, ctx)), (9, ctx), (3, 19), (1, 1)]
    q_lens = [a for a, _ in rows] + [2]
    kv_lens = np.asarray([b for _, b in rows] + [3], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[len(rows)]) + 3
    cu = np.minimum(cu, t)
    kv, tables = make_pages(rng, kv_heads=kv_heads, s=s, d=d, kv_lens=kv_lens, m=m,
                            dtype=dtype, layers=max(1, layers))  # fmt: skip
    q = jnp.asarray(rng.standard_normal((t, kv_heads * g, d)), dtype)
    rest = (jnp.asarray(kv_lens), tables, jnp.asarray(cu), jnp.int32(len(rows)))
    kw = dict(num_kv_heads=kv_heads, sm_scale=0.125, soft_cap=cap, sliding_window=win)
    extra = dict(layer=jnp.int32(layers - 1)) if layers else {}
    out = ga.ragged_paged_attention_gpu(q, kv, *rest, interpret=interpret, **kw, **extra)
    want = reference.ragged_paged_attention_reference(q, kv[max(0, layers - 1)], *rest, **kw)
    return _compare(out, want, dtype)


def kv_ops_case(*, dtype, seed=0) -> dict:
    """XLA write_kv (stacked, traced layer) and copy_blocks against numpy, on merged pages
    ``[L, N, S, C, P, D]`` (K and V of every head differ)."""
    rng = np.random.default_rng(seed)
    shape = (3, 16, 16, 2, 64)  # [L, N, S, K, D]

    def merged(*lead):
        k, v = (jnp.asarray(rng.standard_normal((*lead, *shape[-2:]), np.float32), dtype)
                for _ in "kv")  # fmt: skip
        return kv_layout.merge_kv(k, v)

    kv, new = merged(*shape[:3]), merged(10)  # [L, N, S, C, P, D], [T, C, P, D]
    slots = rng.permutation(16 * 16)[:10].astype(np.int32)
    slots[3] = -1
    out = kv_ops.write_pages(kv, new, jnp.asarray(slots), layer=jnp.int32(1))
    want = np.array(kv, np.float32)
    for t, slot in enumerate(slots):
        if slot >= 0:
            want[1, slot // 16, slot % 16] = np.asarray(new[t], np.float32)
    ok_write = np.array_equal(np.asarray(out, np.float32), want)
    src, dst = np.array([0, 5, -1], np.int32), np.array([7, 9, 2], np.int32)
    out = kv_ops.copy_pages(kv, jnp.asarray(src), jnp.asarray(dst))
    want = np.array(kv, np.float32)
    want[:, [7, 9]] = want[:, [0, 5]]
    ok_copy = np.array_equal(np.asarray(out, np.float32), want)
    return dict(ok=ok_write and ok_copy, write_kv_exact=ok_write, copy_blocks_exact=ok_copy)


def correctness_cases(quick: bool, dry: bool) -> list[tuple[str, Callable[[], dict]]]:
    bf, f16 = jnp.bfloat16, jnp.float16
    it = dict(interpret=True, kv_heads=1, ctx=96) if dry else {}
    cases = []

    def add(name, fn, **kw):
        kw = dict(kw, **{k: v for k, v in it.items() if k in fn.__code__.co_varnames})
        cases.append((name, functools.partial(fn, **kw)))

    if dry:
        add("decode g4 d64 s16 bf16", decode_case, g=4, d=64, s=16, dtype=bf)
        add("decode g1 d64 s128 f32 stacked layer", decode_case, g=1, d=64, s=128,
            dtype=jnp.float32, layers=2)  # fmt: skip
        add("ragged g4 d64 s16 f32 cap win", ragged_case, g=4, d=64, s=16, dtype=jnp.float32,
            cap=20.0, win=11)  # fmt: skip
        add("kv_ops xla f32", kv_ops_case, dtype=jnp.float32)
        return cases
    gs, ds, ss = (1, 2, 4, 8), (64, 128, 256), (8, 16, 32, 64, 128)
    grid = [(g, d, s) for g in gs for d in ds for s in ss]
    if quick:
        grid = [(1, 128, 16), (4, 128, 16), (8, 64, 8), (2, 256, 128), (4, 256, 32)]
    for i, (g, d, s) in enumerate(grid):
        dt = (bf, f16)[i % 2]
        add(f"decode g{g} d{d} s{s} {jnp.dtype(dt).name}", decode_case, g=g, d=d, s=s, dtype=dt)
    for g in (1, 4, 8):
        add(f"decode g{g} d128 s16 bf16 cap win", decode_case, g=g, d=128, s=16, dtype=bf,
            cap=30.0, win=100)  # fmt: skip
        add(f"ragged g{g} d128 s16 bf16", ragged_case, g=g, d=128, s=16, dtype=bf)
        if not quick:
            add(f"ragged g{g} d128 s32 bf16 cap win", ragged_case, g=g, d=128, s=32, dtype=bf,
                cap=25.0, win=37)  # fmt: skip
            add(f"ragged g{g} d256 s64 f16", ragged_case, g=g, d=256, s=64, dtype=f16)
    for stages in (1, 2, 3):  # 4K keys, one split: 64 KV steps through the stage ring
        add(f"decode 4k-keys splits=1 kv_stages={stages}", decode_case, g=4, d=128, s=16,
            dtype=bf, ctx=4096, num_splits=1, kv_stages=stages)  # fmt: skip
    add("decode stacked layer= g4 d128 s16", decode_case, g=4, d=128, s=16, dtype=bf, layers=3)
    add("ragged stacked layer= g4 d128 s32", ragged_case, g=4, d=128, s=32, dtype=bf, layers=3)
    add("decode float32 (XLA fallback)", decode_case, g=4, d=128, s=16, dtype=jnp.float32)
    add("kv_ops xla bf16", kv_ops_case, dtype=bf)
    return cases


# ---------------------------------------------------------------------------------------------
# Timing (one jit over disjoint block sets of a pool built on the device)
# ---------------------------------------------------------------------------------------------


def time_fn(fn, *args, iters: int = 5) -> float:
    """Median wall time of ``fn(*args)`` after a compile + warm-up call."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def copy_bandwidth(nbytes: int, reps: int = 4) -> float:
    """GB/s of an on-device elementwise copy (read + write), reps inside one jit."""
    x = jax.jit(lambda: jnp.zeros((nbytes // 2,), jnp.bfloat16))()

    @jax.jit
    def copy(x):
        return jax.lax.fori_loop(0, reps, lambda i, a: a + jnp.bfloat16(1), x)

    t = time_fn(copy, x)
    return 2 * nbytes * reps / t / 1e9


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _device_normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


@functools.partial(jax.jit, static_argnames=("blocks",), donate_argnums=0)
def _fill_blocks(pages, key, start, blocks):
    chunk = jax.random.normal(key, (pages.shape[0], blocks, *pages.shape[2:]), jnp.float32)
    return jax.lax.dynamic_update_slice_in_dim(pages, chunk.astype(pages.dtype), start, axis=1)


def device_pages(key, shape, dtype, chunk_bytes: int = 1 << 30) -> jax.Array:
    """Random pages ``[L, N, S, C, P, D]`` built on the device about ``chunk_bytes`` of f32
    draws at a time (blocks ``[start, start + blocks)``, donated in place): the peak is the
    pages plus one chunk, not a draw of the whole pool (tens of GB in the full grid)."""
    per_block = 4 * int(np.prod(shape)) // shape[1]
    blocks = max(1, min(shape[1], chunk_bytes // per_block))
    pages = jnp.zeros(shape, dtype)
    for i, start in enumerate(range(0, shape[1], blocks)):
        start = min(start, shape[1] - blocks)  # the last chunk may overlap the one before
        pages = _fill_blocks(pages, jax.random.fold_in(key, i), jnp.int32(start), blocks)
    return pages


@functools.partial(jax.jit, static_argnames=("kv_heads",))
def head_major(kv_pages, kv_heads):
    """Layer 0 of ``kv_pages`` as ``(k, v)``, each ``[K, N, S, D]``: the layout JAX's bundled
    GPU kernel reads (a copy, made once outside the timed calls)."""
    k, v = kv_layout.split_kv(kv_pages[0], kv_heads)  # [N, S, K, D]
    return jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0)


def decode_pool(b, ctx, *, h, kv_heads, d, s, dtype, reps):
    """Pages ``[1, N, S, C, P, D]``, ``reps`` disjoint block-table sets and q, all built on
    the device."""
    m = ctx // s
    n = reps * b * m
    key = jax.random.key(0)
    kkv, kq, kt = jax.random.split(key, 3)
    kv = device_pages(kkv, kv_layout.page_shape(1, n, s, kv_heads, d, dtype), dtype)
    q = _device_normal(kq, (b, h, d), dtype)
    tables = jax.random.permutation(kt, n).reshape(reps, b, m).astype(jnp.int32)
    lens = jnp.full((b,), ctx, jnp.int32)
    return q, kv, lens, tables


def looped(attn):
    """One jit running ``attn`` on every block-table set in turn (outputs summed); ``pages``
    is any pytree of arrays (``kv_pages``, or the bundled kernel's ``(k, v)``)."""

    @jax.jit
    def run(q, pages, lens, tables):
        def body(i, acc):
            return acc + attn(q, pages, lens, tables[i]).astype(jnp.float32)

        return jax.lax.fori_loop(0, tables.shape[0], body, jnp.zeros(q.shape, jnp.float32))

    return run


def bundled_paged_attention():
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as pa

        return pa.paged_attention
    except Exception:  # noqa: BLE001 - depends on the installed JAX
        return None


def decode_impls(*, kv_heads: int, scale: float, interpret: bool) -> dict[str, Callable]:
    """The timed decode implementations, each ``attn(q, pages, lens, tables)``: ``pages`` is
    ``kv_pages``, or for ``jax_bundled`` (when installed; never interpreted) its head-major
    ``(k, v)`` (:func:`head_major`)."""
    kw = dict(num_kv_heads=kv_heads, sm_scale=scale)
    impls = {
        "paxcache_mgpu": lambda q, kv, ln, tb: ga.paged_attention_gpu(
            q, kv, ln, tb, interpret=interpret, **kw
        ),
        "paxcache_triton": lambda q, kv, ln, tb: ta.paged_attention_triton(
            q, kv, ln, tb, interpret=interpret, **kw
        ),
        "xla_reference": lambda q, kv, ln, tb: reference.ragged_paged_attention_xla(
            q, kv, ln, tb, jnp.arange(q.shape[0] + 1, dtype=jnp.int32), q.shape[0], **kw
        ),
    }  # fmt: skip
    bundled = None if interpret else bundled_paged_attention()
    if bundled is not None:  # on its head-major copy of the same pages
        impls["jax_bundled"] = lambda q, kvh, ln, tb: bundled(q * scale, kvh[0], kvh[1], tb, ln)
    return impls


def decode_timing(b, ctx, bw, *, interpret=False, h=32, kv_heads=8, d=128, s=16) -> dict:
    dtype = jnp.bfloat16
    if interpret:
        h, kv_heads, d = 8, 2, 64
    per_rep = 2 * b * ctx * kv_heads * d * jnp.dtype(dtype).itemsize
    reps = 1 if interpret else max(4, -(-MIN_WORKING_SET // per_rep))
    q, kv, lens, tables = decode_pool(b, ctx, h=h, kv_heads=kv_heads, d=d, s=s, dtype=dtype,
                                      reps=reps)  # fmt: skip
    scale = d**-0.5
    kw = dict(num_kv_heads=kv_heads, sm_scale=scale)
    impls = decode_impls(kv_heads=kv_heads, scale=scale, interpret=interpret)
    # The oracle's memory-light form (an online softmax over block columns; the dense oracle
    # would gather [B, context, K, D] in f32): checked against the dense one in the tests.
    b_idx = jnp.arange(b + 1, dtype=jnp.int32)
    want = reference.ragged_paged_attention_xla(q, kv, lens, tables[0], b_idx, b, **kw)
    row = dict(B=b, context=ctx, heads=f"{h}/{kv_heads}", head_dim=d, block_size=s,
               working_set_MB=round(reps * per_rep / 2**20), reps=reps, ok=True)  # fmt: skip
    for name, attn in impls.items():
        pages = None
        try:
            pages = head_major(kv, kv_heads) if name == "jax_bundled" else kv
            t = time_fn(looped(attn), q, pages, lens, tables, iters=1 if interpret else 5)
            t /= reps
            check = _compare(jax.jit(attn)(q, pages, lens, tables[0]), want, dtype)
            gbs = per_rep / t / 1e9
            row[name] = dict(us=round(t * 1e6, 2), GBps=round(gbs, 1),
                             frac_copy_bw=round(gbs / bw, 3), **check)  # fmt: skip
            row["ok"] &= check["ok"] or name == "jax_bundled"
        except Exception as e:  # noqa: BLE001
            row[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            # ours and XLA must run; the bundled one (and Triton, deprecated in JAX) may not
            row["ok"] &= name in ("jax_bundled", "paxcache_triton")
        del pages  # the bundled kernel's copy is freed before the next size
    if "us" in row.get("jax_bundled", {}) and "us" in row.get("paxcache_mgpu", {}):
        row["speedup_vs_bundled"] = round(row["jax_bundled"]["us"] / row["paxcache_mgpu"]["us"], 3)
    if "us" in row.get("paxcache_triton", {}) and "us" in row.get("paxcache_mgpu", {}):
        ratio = row["paxcache_triton"]["us"] / row["paxcache_mgpu"]["us"]
        row["triton_over_mgpu"] = round(ratio, 3)
    return row


def ragged_timing(bw, *, interpret=False, h=32, kv_heads=8, d=128, s=16) -> dict:
    """64 decode rows at 2048, 4 chunked prefills of 256 at 2048, 2 whole prefills of 512
    (570 MB of KV read)."""
    spec = [(1, 2048)] * 64 + [(256, 2048)] * 4 + [(512, 512)] * 2
    if interpret:
        spec = [(1, 64)] * 2 + [(8, 64), (16, 16)]
        h, kv_heads, d = 8, 2, 64
    q_lens = [a for a, _ in spec]
    kv_lens = np.asarray([b for _, b in spec], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    m = int(kv_lens.max()) // s
    n = int(sum(-(-int(x) // s) for x in kv_lens))
    tables = np.full((len(spec), m), -1, np.int32)  # every sequence's blocks, shuffled
    perm, nxt = np.random.default_rng(0).permutation(n), 0
    for i, kv_len in enumerate(kv_lens):
        nb = -(-int(kv_len) // s)
        tables[i, :nb] = perm[nxt : nxt + nb]
        nxt += nb
    kkv, kq = jax.random.split(jax.random.key(2), 2)  # pages built on the device
    kv = device_pages(kkv, kv_layout.page_shape(1, n, s, kv_heads, d, jnp.bfloat16),
                      jnp.bfloat16)  # fmt: skip
    q = _device_normal(kq, (int(cu[-1]), h, d), jnp.bfloat16)
    tables = jnp.asarray(tables)
    args = (q, kv, jnp.asarray(kv_lens), tables, jnp.asarray(cu), jnp.int32(len(spec)))
    kv_bytes = 2 * int(kv_lens.sum()) * kv_heads * d * 2
    kw = dict(num_kv_heads=kv_heads, sm_scale=0.125)
    fn = jax.jit(functools.partial(ga.ragged_paged_attention_gpu, interpret=interpret, **kw))
    t = time_fn(fn, *args, iters=1 if interpret else 10)
    check = _compare(fn(*args), reference.ragged_paged_attention_xla(*args, **kw),
                     jnp.bfloat16)  # fmt: skip
    gbs = kv_bytes / t / 1e9
    return dict(T=int(cu[-1]), seqs=len(spec), us=round(t * 1e6, 2), GBps=round(gbs, 1),
                frac_copy_bw=round(gbs / bw, 3), **check)  # fmt: skip


def kv_ops_timing(bw, *, interpret=False) -> dict:
    """XLA write_kv (256 tokens' K and V into layer 3 of a stacked cache) and copy_blocks
    (64 blocks, every layer), pages donated. The cache is Llama-3-8B-shaped, 32 layers of
    4096 blocks of 16 tokens, 8 kv heads at D = 128 in bf16: 8 GiB of K and V together."""
    dims = (4, 64, 16, 2, 64) if interpret else (32, 4096, 16, 8, 128)  # L, N, S, K, D
    dtype = jnp.bfloat16
    shape = kv_layout.page_shape(*dims, dtype)  # [L, N, S, C, P, D]
    key = jax.random.key(1)
    pages = device_pages(key, shape, dtype)
    t_tok = 256
    new = _device_normal(key, (t_tok, *shape[3:]), dtype)  # merged rows [T, C, P, D]
    slots = jax.random.permutation(key, shape[1] * shape[2])[:t_tok].astype(jnp.int32)
    write = jax.jit(lambda p, n, sl: kv_ops.write_pages(p, n, sl, layer=jnp.int32(3)),
                    donate_argnums=0)  # fmt: skip
    iters = 2 if interpret else 10
    pages = write(pages, new, slots)
    t0 = time.perf_counter()
    for _ in range(iters):
        pages = write(pages, new, slots)
    pages.block_until_ready()
    t_write = (time.perf_counter() - t0) / iters
    pairs = 64
    src = jnp.arange(pairs, dtype=jnp.int32)
    dst = src + pairs
    copy = jax.jit(lambda p, a, b: kv_ops.copy_pages(p, a, b), donate_argnums=0)
    pages = copy(pages, src, dst)
    t0 = time.perf_counter()
    for _ in range(iters):
        pages = copy(pages, src, dst)
    pages.block_until_ready()
    t_copy = (time.perf_counter() - t0) / iters
    itemsize = jnp.dtype(dtype).itemsize
    block_bytes = shape[0] * int(np.prod(shape[2:])) * itemsize  # one block, every layer
    write_bytes = t_tok * int(np.prod(shape[3:])) * itemsize  # K and V of every head
    copy_gbs = 2 * pairs * block_bytes / t_copy / 1e9
    return dict(
        write_kv_us=round(t_write * 1e6, 2), write_kv_bytes=write_bytes,
        copy_blocks_us=round(t_copy * 1e6, 2), copy_blocks_pairs=pairs,
        copy_blocks_GBps=round(copy_gbs, 1), copy_blocks_frac_copy_bw=round(copy_gbs / bw, 3),
    )  # fmt: skip


def ptxas_report(dump_dir: str) -> dict:
    """Registers and spills per compiled kernel from Mosaic GPU's ptxas dumps (D = 256 risk)."""
    lines = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "**", "*"), recursive=True)):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                lines += [x.strip() for x in f if "spill" in x or "Used " in x]
    clean = "0 bytes spill stores, 0 bytes spill loads"
    spilling = [x for x in lines if "spill" in x and clean not in x]
    return dict(ok=True, files=len(glob.glob(os.path.join(dump_dir, "**"), recursive=True)),
                usage=lines[:200], spilling=spilling[:50])  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases (about 3 minutes)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, interpret mode")
    ap.add_argument("--out", default=None, help="output directory (default: $OUT, else "
                    "bench/results/gpu_check_<device>_<date>)")  # fmt: skip
    ap.add_argument("--case-timeout", type=float, default=None,
                    help="watchdog seconds a case (default 240; 1200 with --dry-run)")  # fmt: skip
    ap.add_argument("--resume", action="store_true", help="skip cases already recorded")
    ap.add_argument("--dump-dir", default=None, help="Mosaic GPU ptxas dumps (default: "
                    "OUT/mosaic_dump)")  # fmt: skip
    ap.add_argument("--only", default=None, help="run only cases whose name contains this")
    ap.add_argument("--selftest-hang", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    dry = args.dry_run
    dev = jax.devices()[0]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    out = args.out or os.environ.get("OUT") or os.path.join(
        "bench", "results", f"gpu_check_{dev.device_kind.replace(' ', '_')}_{stamp}")  # fmt: skip
    rec = Recorder(out)
    done = rec.done_cases() if args.resume else set()
    if not args.resume:
        for p in (rec.path, rec.tb_path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
    timeout = args.case_timeout or (1200.0 if dry else 240.0)
    dog = Watchdog(timeout, hang_and_exit(rec))

    dump_dir = args.dump_dir or os.path.join(out, "mosaic_dump")
    if not dry:  # ptxas -v of every Mosaic GPU kernel compiled: registers and spills
        os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")
        os.environ.setdefault("MOSAIC_GPU_DUMP_TO", dump_dir)
    env = environment()
    env.update(mode="dry-run" if dry else "quick" if args.quick else "full")
    if "environment" not in done:
        rec.write(env)
    if not dry and (env["backend"] != "gpu" or str(env["compute_capability"]) != "9.0"):
        rec.write(dict(case="stop", status="stopped", detail=f"needs compute capability 9.0 "
                       f"(Hopper); found backend {env['backend']!r}, capability "
                       f"{env['compute_capability']!r}"))  # fmt: skip
        return EXIT_NOT_HOPPER

    def want(name: str) -> bool:
        return args.only is None or args.only in name

    all_ok = True
    if args.selftest_hang:  # the watchdog's own test (CPU): a case that never finishes
        hang = lambda: time.sleep(1e6) or {}  # noqa: E731
        all_ok &= run_case(rec, dog, "selftest hang", hang, done, args.selftest_hang)
    for name, fn in correctness_cases(args.quick, dry):
        if want(name):
            all_ok &= run_case(rec, dog, f"check: {name}", fn, done)
    if not dry:
        run_case(rec, dog, "ptxas resource usage", lambda: ptxas_report(dump_dir), set())
    if not all_ok:
        rec.write(dict(case="timing", status="skipped", detail="a correctness case failed"))
        return EXIT_FAILED

    bw_bytes = (8 << 20) if dry else (1 << 30)
    bw = {}

    def measure_bw():
        bw["GBps"] = copy_bandwidth(bw_bytes)
        return dict(GBps=round(bw["GBps"], 1), bytes=bw_bytes)

    if not run_case(rec, dog, "copy bandwidth", measure_bw, set()):
        return EXIT_FAILED
    grid = [(8, 64)] if dry else [(64, 2048), (8, 2048), (64, 4096)]
    if not dry and not args.quick:
        grid += [(8, 8192), (256, 2048), (256, 8192), (64, 512)]
    headline = None
    for b, ctx in grid:
        name = f"time: decode B={b} context={ctx}"
        if not want(name):
            continue
        row = {}

        def timed(b=b, ctx=ctx, row=row):
            row.update(decode_timing(b, ctx, bw["GBps"], interpret=dry))
            return dict(row)

        all_ok &= run_case(rec, dog, name, timed, done)
        if (b, ctx) == HEADLINE and row:
            headline = row
    if want("time: ragged"):
        all_ok &= run_case(rec, dog, "time: ragged mixed batch",
                           lambda: ragged_timing(bw["GBps"], interpret=dry), done)  # fmt: skip
    if want("time: kv ops"):
        all_ok &= run_case(rec, dog, "time: kv ops (XLA)",
                           lambda: kv_ops_timing(bw["GBps"], interpret=dry), done)  # fmt: skip
    # Every case recorded so far, by this process or one a hang ended (--resume).
    recs = rec.records()
    bad = [r["case"] for r in recs if r.get("status") not in (None, "ok")]
    headline = headline or next(
        (r for r in recs if r["case"] == f"time: decode B={HEADLINE[0]} context={HEADLINE[1]}"),
        None,
    )
    summary = dict(case="summary", status="fail" if bad else "ok", failed=bad,
                   copy_GBps=round(bw["GBps"], 1))  # fmt: skip
    if headline and "us" in headline.get("paxcache_mgpu", {}):
        summary["decode_bf16_32_8_d128_B64_ctx2048"] = dict(
            frac_copy_bw=headline["paxcache_mgpu"]["frac_copy_bw"],
            speedup_vs_bundled=headline.get("speedup_vs_bundled"),
        )
    rec.write(summary)
    return EXIT_FAILED if bad else 0


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("GPU_CHECK_LOG", "WARNING"),
                        format="%(levelname)s %(name)s: %(message)s")  # fmt: skip
    sys.exit(main())
