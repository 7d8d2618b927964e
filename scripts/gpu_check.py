"""One-command check of the Mosaic GPU (Hopper) paged attention kernels on a real GPU.

    python scripts/gpu_check.py                 # compile + check vs oracle + time (~3-5 min)
    python scripts/gpu_check.py --quick         # fewer cases, B/context grid trimmed
    python scripts/gpu_check.py --full --sweep  # every g x d x S case + kv_stages/splits sweep
    python scripts/gpu_check.py --interpret     # CPU smoke run of this script (tiny sizes)

1. Correctness: compiles ``kernels_pallas.gpu.attention`` for a grid of head configurations,
   head dims, block sizes, dtypes, soft cap and sliding window (unwritten page slots are NaN)
   and compares with the oracles in ``kernels_pallas.reference``. Every case is reported; a
   compile error is printed (first lines) and the run continues.
2. Timing (bf16, 32 query / 8 KV heads, head_dim 128, block_size 16): decode for
   B in {8, 64, 256} x context in {512, 2048, 8192} and one ragged mixed batch. For each:
   time per call, KV bytes read, GB/s and % of the measured device copy bandwidth, side by
   side with the XLA reference and JAX's bundled GPU paged attention
   (``jax.experimental.pallas.ops.gpu.paged_attention``, Triton) on identical inputs.

Writes a JSON report to ``--out`` (default ``bench/results/``) and exits non-zero if any
correctness case fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import reference
from kernels_pallas.gpu import attention as ga

log = logging.getLogger("gpu_check")


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def make_pages(rng, kv_heads, n, s, d, kv_lens, m, dtype, nan_fill=True):
    """Random distinct block tables; NaN in unwritten slots when ``nan_fill``."""
    b = len(kv_lens)
    tables = np.full((b, m), -1, np.int32)
    perm = rng.permutation(n)
    written = np.zeros((n, s), bool)
    nxt = 0
    for i, length in enumerate(kv_lens):
        nb = -(-int(length) // s)
        tables[i, :nb] = perm[nxt : nxt + nb]
        if nan_fill:
            for j in range(nb):
                written[perm[nxt + j], : min(s, int(length) - j * s)] = True
        nxt += nb
    k = rng.standard_normal((kv_heads, n, s, d), np.float32)
    v = rng.standard_normal((kv_heads, n, s, d), np.float32)
    if nan_fill:
        k[:, ~written] = np.nan
        v[:, ~written] = np.nan
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables)


def timeit(fn, *args, iters=20):
    jax.block_until_ready(fn(*args))  # compile + warm
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


# ---------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------


def correctness_cases(quick: bool, interpret: bool, full: bool = False):
    cases = []
    gs = (1, 4, 8)
    ds = (64, 128, 256)
    ss = (8, 16, 32, 64)
    dtypes = (jnp.bfloat16, jnp.float16)
    if quick or interpret:
        return [
            dict(kind="decode", g=4, d=128, s=16, dtype=jnp.bfloat16, cap=None, win=None),
            dict(kind="decode", g=8, d=64, s=8, dtype=jnp.bfloat16, cap=30.0, win=40),
            dict(kind="decode", g=1, d=256, s=64, dtype=jnp.float16, cap=None, win=None),
            dict(kind="ragged", g=4, d=128, s=16, dtype=jnp.bfloat16, cap=None, win=None),
            dict(kind="ragged", g=8, d=64, s=32, dtype=jnp.bfloat16, cap=20.0, win=25),
            dict(kind="decode", g=4, d=128, s=16, dtype=jnp.float32, cap=None, win=None),
        ][: 3 if interpret else None]
    for i, (g, d) in enumerate((g, d) for g in gs for d in ds):
        for s in ss if full else (ss[i % len(ss)],):
            cases.append(dict(kind="decode", g=g, d=d, s=s, dtype=dtypes[(g + s) % 2],
                              cap=None, win=None))  # fmt: skip
    for g in gs:
        cases.append(dict(kind="decode", g=g, d=128, s=16, dtype=jnp.bfloat16, cap=30.0, win=100))
        for s in (8, 32):
            for win in (None, 37) if full else ((None, 37)[s == 32],):
                cases.append(dict(kind="ragged", g=g, d=128, s=s, dtype=jnp.bfloat16,
                                  cap=25.0 if win else None, win=win))  # fmt: skip
    cases.append(dict(kind="ragged", g=4, d=256, s=16, dtype=jnp.float16, cap=None, win=None))
    cases.append(dict(kind="decode", g=4, d=128, s=16, dtype=jnp.float32, cap=None, win=None))
    return cases


def run_case(c, interpret: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    kv_heads = 1 if interpret else 2
    s, d, g = c["s"], c["d"], c["g"]
    m = max(2, 256 // s) if not interpret else max(2, 64 // s)
    kw = dict(sm_scale=d**-0.5, soft_cap=c["cap"], sliding_window=c["win"])
    if c["kind"] == "decode":
        cap = m * s
        lens = np.array([1, 0, s, cap, 2 * s + 3, cap - 5][: 4 if interpret else None], np.int32)
        n = int(sum(-(-int(x) // s) for x in lens)) + 4
        k, v, tables = make_pages(rng, kv_heads, n, s, d, lens, m, c["dtype"])
        q = jnp.asarray(rng.standard_normal((len(lens), kv_heads * g, d)), c["dtype"])
        out = ga.paged_attention_gpu(q, k, v, jnp.asarray(lens), tables, interpret=interpret, **kw)
        want = reference.paged_attention_reference(q, k, v, jnp.asarray(lens), tables, **kw)
    else:
        cap = m * s
        rows = [(1, cap - 3), (min(40, cap), min(40, cap)), (9, cap), (3, 19), (1, 1)]
        q_lens = [a for a, _ in rows] + [2]
        kv_lens = np.array([b for _, b in rows] + [3], np.int32)
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        t = int(cu[len(rows)]) + 3
        cu = np.minimum(cu, t)
        n = int(sum(-(-int(x) // s) for x in kv_lens)) + 4
        k, v, tables = make_pages(rng, kv_heads, n, s, d, kv_lens, m, c["dtype"])
        q = jnp.asarray(rng.standard_normal((t, kv_heads * g, d)), c["dtype"])
        args = (q, k, v, jnp.asarray(kv_lens), tables, jnp.asarray(cu), jnp.int32(len(rows)))
        out = ga.ragged_paged_attention_gpu(*args, interpret=interpret, **kw)
        want = reference.ragged_paged_attention_reference(*args, **kw)
    out = np.asarray(out, np.float32)
    want = np.asarray(want, np.float32)
    tol = 1e-5 if c["dtype"] == jnp.float32 else 2e-2
    finite = bool(np.isfinite(out).all())
    err = float(np.max(np.abs(out - want) / (1.0 + np.abs(want))))
    return finite and err <= tol, err, finite


def check_correctness(quick: bool, interpret: bool, full: bool = False):
    results = []
    for c in correctness_cases(quick, interpret, full):
        name = (f"{c['kind']} g={c['g']} d={c['d']} s={c['s']} {jnp.dtype(c['dtype']).name}"
                f" cap={c['cap']} win={c['win']}")  # fmt: skip
        t0 = time.perf_counter()
        try:
            ok, err, finite = run_case(c, interpret)
            status = "ok" if ok else "MISMATCH"
            msg = f"max_rel_err={err:.2e} finite={finite}"
        except Exception as e:  # report and continue: one bad config must not hide the rest
            ok, status = False, "ERROR"
            msg = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
            msg = " | ".join(msg[:6])
        dt = time.perf_counter() - t0
        print(f"[{status:8s}] {name:55s} {msg} ({dt:.1f}s)", flush=True)
        results.append(dict(case=name, status=status, detail=msg, seconds=round(dt, 2)))
    return results


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def copy_bandwidth(interpret: bool) -> float:
    n = (1 << 20) if interpret else (1 << 30)  # bytes of bf16 data
    x = jnp.ones((n // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = timeit(f, x, iters=10)
    return 2 * n / t / 1e9  # read + write


def bundled_paged_attention():
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as pa

        return pa.paged_attention
    except Exception as e:  # pragma: no cover - depends on the installed JAX
        log.warning("bundled GPU paged attention unavailable: %s", e)
        return None


def bench(quick: bool, interpret: bool, bw: float, do_sweep: bool = False):
    h, kvh, d, s = 32, 8, 128, 16
    dtype = jnp.bfloat16
    if interpret:
        h, kvh, grid_b, grid_ctx = 8, 2, (2,), (64,)
    else:
        grid_b = (8, 64) if quick else (8, 64, 256)
        grid_ctx = (512, 2048) if quick else (512, 2048, 8192)
    bundled = None if interpret else bundled_paged_attention()
    rows = []
    rng = np.random.default_rng(0)
    for b in grid_b:
        for ctx in grid_ctx:
            m = ctx // s
            lens = np.full((b,), ctx, np.int32)
            k, v, tables = make_pages(rng, kvh, b * m, s, d, lens, m, dtype, nan_fill=False)
            q = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
            lens = jnp.asarray(lens)
            kv_bytes = 2 * b * ctx * kvh * d * jnp.dtype(dtype).itemsize
            row = dict(kind="decode", B=b, context=ctx, kv_bytes=kv_bytes)
            impls = {
                "paxcache_mgpu": jax.jit(
                    lambda q, k, v, ln, tb: ga.paged_attention_gpu(
                        q, k, v, ln, tb, sm_scale=d**-0.5, interpret=interpret
                    )
                ),
                "xla_reference": jax.jit(
                    lambda q, k, v, ln, tb: reference.paged_attention_reference(
                        q, k, v, ln, tb, sm_scale=d**-0.5
                    )
                ),
            }
            if bundled is not None:
                impls["jax_bundled_triton"] = jax.jit(
                    lambda q, k, v, ln, tb: bundled(q * d**-0.5, k, v, tb, ln)
                )
            for name, fn in impls.items():
                try:
                    t = timeit(fn, q, k, v, lens, tables, iters=5 if interpret else 20)
                    gbs = kv_bytes / t / 1e9
                    row[name] = dict(ms=round(t * 1e3, 4), GBps=round(gbs, 1),
                                     pct_copy_bw=round(100 * gbs / bw, 1))  # fmt: skip
                except Exception as e:
                    row[name] = dict(error=str(e).splitlines()[0][:200])
            print(json.dumps(row), flush=True)
            rows.append(row)
            del k, v
    # One ragged mixed batch: 48 decode rows at 2048, 4 chunked prefills of 256 at 2048,
    # 2 whole prefills of 512.
    if not interpret:
        rows.append(bench_ragged(h, kvh, d, s, dtype, bw, rng))
        if do_sweep:
            rows.extend(sweep(h, kvh, d, s, dtype, bw, rng, quick))
    return rows


def sweep(h, kvh, d, s, dtype, bw, rng, quick):
    """Tuning sweep of pipeline depth and KV splits (to choose the defaults on this GPU)."""
    out = []
    shapes = [(64, 2048)] if quick else [(64, 2048), (8, 8192)]
    for b, ctx in shapes:
        m = ctx // s
        lens = np.full((b,), ctx, np.int32)
        k, v, tables = make_pages(rng, kvh, b * m, s, d, lens, m, dtype, nan_fill=False)
        q = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
        kv_bytes = 2 * b * ctx * kvh * d * jnp.dtype(dtype).itemsize
        for stages in (2, 3):
            for splits in (None, 1, 2, 4, 8):
                fn = jax.jit(
                    lambda q, k, v, ln, tb, st=stages, sp=splits: ga.paged_attention_gpu(
                        q, k, v, ln, tb, sm_scale=d**-0.5, kv_stages=st, num_splits=sp
                    )
                )
                row = dict(kind="sweep", B=b, context=ctx, kv_stages=stages, num_splits=splits)
                try:
                    t = timeit(fn, q, k, v, jnp.asarray(lens), tables)
                    gbs = kv_bytes / t / 1e9
                    row.update(ms=round(t * 1e3, 4), GBps=round(gbs, 1),
                               pct_copy_bw=round(100 * gbs / bw, 1))  # fmt: skip
                except Exception as e:
                    row["error"] = str(e).splitlines()[0][:200]
                print(json.dumps(row), flush=True)
                out.append(row)
        del k, v
    return out


def bench_ragged(h, kvh, d, s, dtype, bw, rng):
    spec = [(1, 2048)] * 48 + [(256, 2048)] * 4 + [(512, 512)] * 2
    q_lens = [a for a, _ in spec]
    kv_lens = np.array([b for _, b in spec], np.int32)
    m = 2048 // s
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1])
    n = int(sum(-(-int(x) // s) for x in kv_lens))
    k, v, tables = make_pages(rng, kvh, n, s, d, kv_lens, m, dtype, nan_fill=False)
    q = jnp.asarray(rng.standard_normal((t, h, d)), dtype)
    args = (q, k, v, jnp.asarray(kv_lens), tables, jnp.asarray(cu), jnp.int32(len(spec)))
    kv_bytes = 2 * int(kv_lens.sum()) * kvh * d * jnp.dtype(dtype).itemsize
    row = dict(kind="ragged_mixed", T=t, seqs=len(spec), kv_bytes=kv_bytes)
    impls = {
        "paxcache_mgpu": jax.jit(
            lambda *a: ga.ragged_paged_attention_gpu(*a, sm_scale=d**-0.5)
        ),
        "xla_reference": jax.jit(
            lambda *a: reference.ragged_paged_attention_xla(*a, sm_scale=d**-0.5)
        ),
    }  # fmt: skip
    for name, fn in impls.items():
        try:
            tt = timeit(fn, *args)
            gbs = kv_bytes / tt / 1e9
            row[name] = dict(ms=round(tt * 1e3, 4), GBps=round(gbs, 1),
                             pct_copy_bw=round(100 * gbs / bw, 1))  # fmt: skip
        except Exception as e:
            row[name] = dict(error=str(e).splitlines()[0][:200])
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases and sizes")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (tiny sizes)")
    ap.add_argument("--full", action="store_true", help="every g x d x block_size case")
    ap.add_argument("--sweep", action="store_true", help="also sweep kv_stages x num_splits")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--out", default="bench/results", help="directory for the JSON report")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    backend = jax.default_backend()
    if backend != "gpu" and not args.interpret:
        print(f"backend is {backend!r}: run on a GPU, or pass --interpret for a CPU smoke run")
        return 2
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind} ({backend})", flush=True)
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=dev.device_kind,
        jax=jax.__version__,
        interpret=args.interpret,
    )
    t0 = time.perf_counter()
    report["correctness"] = check_correctness(args.quick, args.interpret, args.full)
    if not args.skip_bench:
        bw = copy_bandwidth(args.interpret)
        print(f"measured copy bandwidth: {bw:.1f} GB/s", flush=True)
        report["copy_bandwidth_GBps"] = round(bw, 1)
        report["bench"] = bench(args.quick, args.interpret, bw, args.sweep)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    kind = "interpret" if args.interpret else dev.device_kind.replace(" ", "_")
    path = os.path.join(args.out, f"gpu_check_{kind}_{stamp}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    bad = [r for r in report["correctness"] if r["status"] != "ok"]
    print(f"{len(report['correctness']) - len(bad)}/{len(report['correctness'])} cases ok; "
          f"report: {path} ({report['seconds']}s)")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
