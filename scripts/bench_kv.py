"""Benchmark KV movement: swap throughput (device <-> pinned_host) and copy_blocks throughput.

A "block" here is one KV-cache block of a whole model: K and V for every layer
(default: Llama-3-8B-like, 32 layers x 8 kv heads x 16 tokens x 128 dims in bf16 = 2 MiB).
Swaps move 1, 16 and 256 such blocks in each direction through ``kernels_pallas.swap_blocks``
(gather, one transfer, scatter, destination donated) and are compared with a plain
``jax.device_put`` of the same number of bytes between the two memory kinds. copy_blocks copies
the same counts device -> device (all layers) under a donated jit.

On the CPU backend swap_blocks copies block to block (device and pinned_host are the same
RAM); the generic gather / one transfer / scatter program (the GPU path) is timed as well
("gen." columns).

Prints a table and writes ``bench/results/kv_<platform>_<date>.json``.

    python scripts/bench_kv.py                 # defaults above
    python scripts/bench_kv.py --layers 4 --reps 3 --counts 1 16
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import logging
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import make_single_device_sharding

from kernels_pallas import kv_ops
from paxcache.kv_cache import KVCache, host_memory_kind

logger = logging.getLogger("bench_kv")


def _time(fn, reps: int) -> float:
    """Best wall time of ``fn()`` over ``reps`` calls (it must block until its result is
    ready); the minimum, because the shared benchmark machines are noisy."""
    fn()  # warm-up / compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    dev = jax.devices()[0]
    hkind = host_memory_kind(dev)
    max_p = max(args.counts)
    n = 2 * max_p + 16  # device blocks: copy_blocks needs p sources + p fresh destinations
    nh = max_p + 16
    cache = KVCache.create(
        args.layers,
        args.kv_heads,
        args.head_dim,
        n,
        args.block_size,
        jnp.dtype(args.dtype),
        num_host_blocks=nh,
        fill_value=1.0,
    )
    per_block = cache.bytes_per_block
    logger.info(
        "platform=%s device=%s block=%d layers x %d heads x %d tokens x %d dims %s = %.2f MiB "
        "(K+V); pools: %d device + %d host blocks",
        jax.default_backend(),
        dev.device_kind,
        args.layers,
        args.kv_heads,
        args.block_size,
        args.head_dim,
        args.dtype,
        per_block / 2**20,
        n,
        nh,
    )
    dev_sh = make_single_device_sharding(dev)
    host_sh = make_single_device_sharding(dev, memory_kind=hkind)
    rng = np.random.default_rng(0)
    rows = []
    state = {"kv": cache.device.kv, "hkv": cache.host.kv}

    for p in args.counts:
        src = rng.permutation(n)[:p].astype(np.int32)  # device blocks
        dst = rng.permutation(nh)[:p].astype(np.int32)  # host blocks
        nbytes = p * per_block

        def swap_out(src=src, dst=dst, moves="auto"):
            state["hkv"] = kv_ops.swap_pages(state["kv"], state["hkv"], src, dst, xla_moves=moves)
            jax.block_until_ready(state["hkv"])

        def swap_in(src=src, dst=dst, moves="auto"):
            state["kv"] = kv_ops.swap_pages(state["hkv"], state["kv"], dst, src, xla_moves=moves)
            jax.block_until_ready(state["kv"])

        shape = (2, args.layers, args.kv_heads, p, args.block_size, args.head_dim)
        on_dev = jax.device_put(jnp.ones(shape, jnp.dtype(args.dtype)), dev_sh)
        on_host = jax.device_put(on_dev, host_sh)

        def put_d2h(x=on_dev):
            jax.device_put(x, host_sh).block_until_ready()

        def put_h2d(x=on_host):
            jax.device_put(x, dev_sh).block_until_ready()

        copy_fn = jax.jit(lambda kv, s, d: kv_ops.copy_pages(kv, s, d), donate_argnums=(0,))
        pairs = rng.permutation(n)[: 2 * p].reshape(2, p).astype(np.int32)
        cs_j, cd_j = jnp.asarray(pairs[0]), jnp.asarray(pairs[1])

        def copy(cs_j=cs_j, cd_j=cd_j, copy_fn=copy_fn):
            state["kv"] = copy_fn(state["kv"], cs_j, cd_j)
            jax.block_until_ready(state["kv"])

        t = {
            "swap_out": _time(swap_out, args.reps),
            "device_put_d2h": _time(put_d2h, args.reps),
            "swap_in": _time(swap_in, args.reps),
            "device_put_h2d": _time(put_h2d, args.reps),
            "copy_blocks": _time(copy, args.reps),
        }
        if jax.default_backend() == "cpu":
            # Also time the generic gather / one transfer / scatter program (the GPU path).
            t["swap_out_generic"] = _time(functools.partial(swap_out, moves="loop"), args.reps)
            t["swap_in_generic"] = _time(functools.partial(swap_in, moves="loop"), args.reps)
        del on_dev, on_host
        row = {"blocks": p, "bytes": nbytes}
        for key, sec in t.items():
            row[f"{key}_s"] = sec
            row[f"{key}_GBps"] = nbytes / sec / 1e9
        row["swap_out_vs_device_put"] = t["device_put_d2h"] / t["swap_out"]
        row["swap_in_vs_device_put"] = t["device_put_h2d"] / t["swap_in"]
        rows.append(row)

    generic = "swap_out_generic_GBps" in rows[0]
    header = (
        f"{'blocks':>6} {'MiB':>8} | {'swap_out':>9} {'put d2h':>9} {'ratio':>6} | "
        f"{'swap_in':>9} {'put h2d':>9} {'ratio':>6} | {'copy_blk':>9}"
        + (f" | {'out gen.':>9} {'in gen.':>9}" if generic else "")
        + "   (GB/s)"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['blocks']:>6} {r['bytes'] / 2**20:>8.1f} | {r['swap_out_GBps']:>9.2f} "
            f"{r['device_put_d2h_GBps']:>9.2f} {r['swap_out_vs_device_put']:>6.2f} | "
            f"{r['swap_in_GBps']:>9.2f} {r['device_put_h2d_GBps']:>9.2f} "
            f"{r['swap_in_vs_device_put']:>6.2f} | {r['copy_blocks_GBps']:>9.2f}"
            + (
                f" | {r['swap_out_generic_GBps']:>9.2f} {r['swap_in_generic_GBps']:>9.2f}"
                if generic
                else ""
            )
        )
    logger.info("\n".join(lines))

    now = dt.datetime.now(dt.timezone.utc)
    result = {
        "date_utc": now.isoformat(timespec="seconds"),
        "platform": jax.default_backend(),
        "device_kind": dev.device_kind,
        "jax_version": jax.__version__,
        "host_memory_kind": hkind,
        "block": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "block_size": args.block_size,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "bytes_per_block_k_plus_v": per_block,
        },
        "reps": args.reps,
        "timing": "best wall time per call over reps, after one warm-up call",
        "rows": rows,
    }
    out = pathlib.Path(
        args.out or f"bench/results/kv_{jax.default_backend()}_{now.strftime('%Y%m%d')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
