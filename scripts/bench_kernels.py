#!/usr/bin/env python
"""Benchmark paged decode and ragged attention: ours vs the XLA reference vs JAX's bundled kernels.

Decode: B in {8, 64, 256} x context in {512, 2048, 8192}, bf16, 32 query / 8 KV heads,
head_dim 128, block_size 16, every sequence at full context, random (non-identity) block
tables. Plus one ragged mixed batch (decode rows + chunked prefills) through
``ragged_paged_attention``.

For every implementation on identical inputs: median time per call, the KV bytes a kernel must
read (each sequence's K and V once), achieved GB/s, and % of the device's measured copy
bandwidth (``x + 1`` over a large buffer: bytes read + written / time).

The cache is one token-major array ``kv_pages [1, N, S, C, P, D]``
(:mod:`kernels_pallas.kv_layout`); the bundled kernels get it in their own layouts (head-major
``k, v [K, N, S, D]`` copies; the TPU ragged kernel's ``[N, S, 2K, D]``, a reshape), made
outside the timed calls.

Implementations (skipped with a note where the backend lacks them):

* ``ours``: ``kernels_pallas`` with ``impl="auto"`` (TPU / GPU Pallas kernel; on CPU this *is*
  the XLA path, so CPU numbers record the reference path for later comparison).
* ``xla_reference``: ``impl="reference"`` (dense oracle for decode, online-softmax XLA scan for
  ragged); skipped when its gathered working set would exceed ``--ref-max-gb``.
* ``jax_tpu_paged`` / ``jax_tpu_ragged``: ``jax.experimental.pallas.ops.tpu`` kernels (TPU).
* ``jax_gpu_paged``: ``jax.experimental.pallas.ops.gpu.paged_attention`` (GPU).

Usage::

    python scripts/bench_kernels.py            # full grid (meant for a TPU/GPU)
    python scripts/bench_kernels.py --quick    # small sizes (CPU)

Prints a table and writes ``bench/results/kernels_<device>_<YYYYMMDD>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import pathlib
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import attention as kpa
from kernels_pallas import kv_layout

log = logging.getLogger("bench_kernels")

H, KH, D, S = 32, 8, 128, 16


# --------------------------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------------------------


def time_fn(fn: Callable[[], jax.Array], iters: int, warmup: int = 2) -> float:
    """Median seconds per call of ``fn`` (already jitted), after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Measured device copy bandwidth in GB/s: (bytes read + written) / time of ``x + 1``
    over a float32 buffer (memory-bound everywhere; bf16 arithmetic is emulated on CPU)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))
    t = time_fn(lambda: f(x), iters)
    return 2 * nbytes / t / 1e9


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def make_pages(key: jax.Array, n: int, dtype) -> jax.Array:
    """Random one-layer pages ``kv_pages [1, N, S, C, P, D]`` (:mod:`kernels_pallas.kv_layout`:
    K and V of every head of a token side by side)."""
    return jax.random.normal(key, kv_layout.page_shape(1, n, S, KH, D, dtype), dtype)


def make_decode_inputs(b: int, ctx: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    m = ctx // S
    n = b * m
    key = jax.random.PRNGKey(seed)
    k1, k2 = jax.random.split(key, 2)
    kv_pages = make_pages(k1, n, dtype)
    q = jax.random.normal(k2, (b, H, D), dtype)
    tables = jnp.asarray(rng.permutation(n).reshape(b, m).astype(np.int32))
    lengths = jnp.full((b,), ctx, jnp.int32)
    return q, kv_pages, lengths, tables


def make_ragged_inputs(n_decode: int, n_prefill: int, chunk: int, ctx: int, dtype, seed: int = 1):
    """``n_decode`` decode rows at ``ctx`` tokens plus ``n_prefill`` chunked prefills of
    ``chunk`` new tokens ending at ``ctx``."""
    rng = np.random.default_rng(seed)
    b = n_decode + n_prefill
    m = ctx // S
    n = b * m
    key = jax.random.PRNGKey(seed)
    k1, k2 = jax.random.split(key, 2)
    q_lens = np.array([1] * n_decode + [chunk] * n_prefill, np.int32)
    t = int(q_lens.sum())
    kv_pages = make_pages(k1, n, dtype)
    q = jax.random.normal(k2, (t, H, D), dtype)
    tables = jnp.asarray(rng.permutation(n).reshape(b, m).astype(np.int32))
    kv_lens = jnp.full((b,), ctx, jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    return q, kv_pages, kv_lens, tables, cu, jnp.int32(b)


def kv_bytes(kv_lens: np.ndarray, dtype) -> int:
    """Bytes of K and V a kernel must read: every sequence's tokens once, all KV heads."""
    return int(np.sum(kv_lens)) * KH * D * 2 * jnp.dtype(dtype).itemsize


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------


def decode_impls(backend: str, ref_ok: bool) -> dict[str, Callable]:
    scale = D**-0.5

    def ours(impl):
        return jax.jit(
            lambda q, kv, ln, bt: kpa.paged_attention_pages(
                q, kv, ln, bt, num_kv_heads=KH, impl=impl
            )
        )

    impls: dict[str, Callable] = {"ours": ours("auto")}
    if ref_ok:
        impls["xla_reference"] = ours("reference")
    # The bundled kernels take head-major k, v [K, N, S, D]: run_case converts the pages
    # (bundled_args) outside the timed call, so they are timed on identical data.
    if backend == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_pa

        impls["jax_tpu_paged"] = jax.jit(
            lambda q, k, v, ln, bt: tpu_pa(
                q * scale, k, v, ln, bt, pages_per_compute_block=min(8, bt.shape[1])
            )
        )
    if backend == "gpu":
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_pa

        impls["jax_gpu_paged"] = jax.jit(
            lambda q, k, v, ln, bt: gpu_pa(
                q * scale, k, v, bt, ln, pages_per_compute_block=min(8, bt.shape[1])
            )
        )
    return impls


def ragged_impls(backend: str, ref_ok: bool) -> dict[str, Callable]:
    def ours(impl):
        return jax.jit(
            lambda q, kv, kl, bt, cu, ns: kpa.ragged_paged_attention_pages(
                q, kv, kl, bt, cu, ns, num_kv_heads=KH, impl=impl
            )
        )

    impls = {"ours": ours("auto")}
    if ref_ok:
        impls["xla_reference"] = ours("reference")
    if backend == "tpu":
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention as tpu_rpa,
        )

        def bundled(q, kv, kl, bt, cu, ns):
            # Its cache layout is [N, S, 2K, D] (K and V interleaved per head): our pages'
            # layer 0 with the packed rows flattened, made outside the timed call (run_case).
            return tpu_rpa(q, kv, kl, bt, cu, ns.reshape(1), sm_scale=D**-0.5)

        impls["jax_tpu_ragged"] = jax.jit(bundled)
    return impls


def tpu_ragged_layout(kv_pages: jax.Array) -> jax.Array:
    """``[1, N, S, C, P, D]`` -> the bundled TPU ragged kernel's ``[N, S, 2K, D]`` (k0, v0,
    k1, v1, ...): the same order as the packed rows (combined head ``2h`` / ``2h + 1``), so a
    reshape of layer 0 (16- and 32-bit pages have no dummy head)."""
    _, n, s, c, p, d = kv_pages.shape
    return kv_pages[0].reshape(n, s, c * p, d)


def head_major(kv_pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[1, N, S, C, P, D]`` -> the bundled paged kernels' ``k, v [K, N, S, D]``."""
    k, v = kv_layout.split_kv(kv_pages[0], KH)  # [N, S, K, D]
    return jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0)


def bundled_args(name: str, args: tuple) -> tuple:
    """``args`` (``q, kv_pages, ...``) in the layout implementation ``name`` takes."""
    if name == "jax_tpu_ragged":
        return (args[0], tpu_ragged_layout(args[1]), *args[2:])
    if name in ("jax_tpu_paged", "jax_gpu_paged"):
        return (args[0], *head_major(args[1]), *args[2:])
    return args


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def run_case(
    kind: str, label: str, impls: dict, args: tuple, nbytes: int, bw: float, iters: int
) -> list[dict]:
    rows = []
    first_out = None
    for name, fn in impls.items():
        row = dict(kind=kind, case=label, impl=name, kv_bytes=nbytes)
        try:
            call_args = jax.block_until_ready(bundled_args(name, args))
            out = jax.block_until_ready(fn(*call_args))
            t = time_fn(lambda fn=fn, a=call_args: fn(*a), iters)
            gbs = nbytes / t / 1e9
            row.update(ms=t * 1e3, gb_s=gbs, pct_copy_bw=100 * gbs / bw)
            o32 = np.asarray(out, np.float32)
            if first_out is None:
                first_out = o32
            else:
                row["max_abs_diff_vs_first"] = float(np.max(np.abs(o32 - first_out)))
        except Exception as e:  # noqa: BLE001 -- record and continue with the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log.warning("%s %s %s failed: %s", kind, label, name, row["error"])
        rows.append(row)
        print(_fmt_row(row), flush=True)
    return rows


def _fmt_row(r: dict) -> str:
    if "error" in r:
        return f"{r['kind']:7s} {r['case']:28s} {r['impl']:15s} ERROR {r['error']}"
    diff = r.get("max_abs_diff_vs_first")
    diff_s = "" if diff is None else f"  diff={diff:.2e}"
    return (
        f"{r['kind']:7s} {r['case']:28s} {r['impl']:15s} {r['ms']:10.3f} ms "
        f"{r['kv_bytes'] / 1e6:10.1f} MB {r['gb_s']:9.2f} GB/s {r['pct_copy_bw']:6.1f}%{diff_s}"
    )


def device_name() -> str:
    dev = jax.devices()[0]
    kind = dev.device_kind if dev.platform != "cpu" else f"cpu-{platform.machine()}"
    return re.sub(r"[^A-Za-z0-9]+", "-", kind).strip("-").lower()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU)")
    ap.add_argument("--batch", type=int, nargs="*", help="decode batch sizes")
    ap.add_argument("--context", type=int, nargs="*", help="decode context lengths")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--ref-max-gb", type=float, default=None, help="skip the XLA reference "
                    "when its gathered K/V working set (f32) exceeds this")  # fmt: skip
    ap.add_argument("--no-ragged", action="store_true")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    backend = jax.default_backend()
    dtype = jnp.dtype(a.dtype)
    if a.quick:
        batches, contexts, iters = a.batch or [8], a.context or [512, 2048], a.iters or 3
        ragged_cfg = dict(n_decode=14, n_prefill=2, chunk=64, ctx=512)
        copy_mb = 256
    else:
        batches, contexts, iters = a.batch or [8, 64, 256], a.context or [512, 2048, 8192], 20
        iters = a.iters or iters
        ragged_cfg = dict(n_decode=60, n_prefill=4, chunk=256, ctx=2048)
        copy_mb = 2048 if backend != "cpu" else 512
    ref_max_gb = a.ref_max_gb if a.ref_max_gb is not None else (4.0 if backend == "cpu" else 24.0)

    bw = copy_bandwidth(copy_mb << 20, iters)
    dev = device_name()
    print(f"device {dev} ({backend}), jax {jax.__version__}, copy bandwidth {bw:.1f} GB/s")
    print(f"{'kind':7s} {'case':28s} {'impl':15s} {'time':>13s} {'KV read':>13s} "
          f"{'achieved':>14s} {'%copy':>7s}")  # fmt: skip

    rows: list[dict] = []
    for b in batches:
        for ctx in contexts:
            args = make_decode_inputs(b, ctx, dtype)
            nbytes = kv_bytes(np.full(b, ctx), dtype)
            ref_gb = 2 * b * ctx * KH * D * 4 / 1e9
            impls = decode_impls(backend, ref_ok=ref_gb <= ref_max_gb)
            rows += run_case("decode", f"B={b} ctx={ctx}", impls, args, nbytes, bw, iters)
            del args
    if not a.no_ragged:
        rc = ragged_cfg
        args = make_ragged_inputs(rc["n_decode"], rc["n_prefill"], rc["chunk"], rc["ctx"], dtype)
        b = rc["n_decode"] + rc["n_prefill"]
        nbytes = kv_bytes(np.full(b, rc["ctx"]), dtype)
        label = f"{rc['n_decode']}dec+{rc['n_prefill']}x{rc['chunk']}pf ctx={rc['ctx']}"
        ref_gb = 2 * b * rc["ctx"] * KH * D * 4 / 1e9
        impls = ragged_impls(backend, ref_ok=ref_gb <= ref_max_gb)
        rows += run_case("ragged", label, impls, args, nbytes, bw, iters)

    result = dict(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        device=dev,
        backend=backend,
        jax_version=jax.__version__,
        config=dict(H=H, KH=KH, D=D, S=S, dtype=a.dtype, quick=a.quick, iters=iters),
        copy_bandwidth_gb_s=bw,
        ragged=ragged_cfg,
        rows=rows,
        notes=(
            "kv_bytes = each sequence's K and V read once; pct_copy_bw = achieved / measured "
            "copy bandwidth. On CPU 'ours' runs the XLA reference path (impl='auto')."
        ),
    )
    if not a.no_save:
        out_dir = pathlib.Path(a.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
        path = out_dir / f"kernels_{dev}_{stamp}{'_quick' if a.quick else ''}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if all("error" not in r or r["impl"] != "ours" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
