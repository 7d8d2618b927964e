"""Static TPU kernel report: steady-state VLIW bundles of paxcache's and RPA v3's attention kernels.

libtpu dumps the final VLIW bundles of every Mosaic kernel it compiles for an abstract topology
(``--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true``). One bundle issues per cycle, so the
bundles a kernel executes (loop bodies times their trip counts, no stalls) are a lower bound on
its time; bytes or useful flops over that time bound the fraction of HBM bandwidth or MXU peak
the kernel can reach. Each compile runs in a fresh subprocess (libtpu reads LIBTPU_INIT_ARGS
once, when it initialises): the script re-runs itself with ``--child``.

Usage::

    JAX_PLATFORMS=cpu PYTHONPATH=. python scripts/kernel_cycles.py --target v5e,v6e \\
        --case decode,prefill,mixed --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 \\
        --page 16 --batch 64 --ctx 4096 --chunk 2048 \\
        --rpa-wheel tpu_inference-0.32.0-py3-none-any.whl --json out.json

Control structure: ``scripts/bundle_dump.py`` (dump format, loops from back edges, regions
from forward branches). The cost of one loop iteration (``iteration_cycles``) is its span,
minus nested loops' spans plus their trip counts times their own iteration cost, minus the
skipped share of each region: a region holding a loop of zero trips is skipped, other regions
get a weight (the fraction of iterations that execute them) from the kernel's model below.

Trip counts (derived from the dump's loop tree, the kernel's block sizes and the shape; every
sequence has ``ctx`` keys; a "program" is one grid step, which Mosaic compiles as the
outermost loop of the kernel, so its trips are the grid size):

* ``paxcache_ragged_paged_attention`` (``kernels_pallas.ragged_paged_attention``, grid
  ``T_pad / TQ``, ``TQ = default_queries_per_block``, ``P = default_pages_per_compute_block``
  (block sizes per chip: ``ragged_blocks(device_kind)``)
  pages of ``S`` keys per step, ``C = P * S``): in a program, the top-level loops are the
  binary search on ``cu_q_lens`` (trips simulated exactly), ``skip_empty`` loops (0 trips:
  every sequence has rows) and the work-item loop (the one holding the MXU ops). A sequence
  overlapping the block with last row at position ``pos_hi`` takes
  ``n = ceil(min(ceil((pos_hi + 1) / S), M) / P)`` work items, each costed on its own path: the
  region that starts the next step's KV DMAs without waiting runs on all but the last item;
  the next sequence's table row and pages (DMAs and a wait) and every other DMA-free region
  after the two step bodies (finishing the output, row prefetch) on the last; of the two step
  bodies (``pl.when(whole)`` / ``pl.when(~whole)``: the first two DMA-free regions, the smaller
  one unmasked) the unmasked one runs when every row of the block is the sequence's and the
  step's last key is at or below the block's first row (``whole``, as the kernel computes
  it), the masked one otherwise. Kernels with a head loop (the nested loop with MXU ops) run
  it ``K`` trips; unrolled heads need none.
* ``paxcache_paged_decode_attention`` (``kernels_pallas.paged_attention``; also the TPU path of
  a decode-only ``ragged_paged_attention(max_q_len=1)``), grid ``(2, B/2)``, one program per
  sequence: the step loop (the MXU loop inside the grid loop) runs
  ``n = ceil(ceil(ctx / S) / P)`` trips with ``P = decode_pages_per_step``; step ``i`` runs the
  next-step DMA region unless it is the last, and the unmasked body when
  ``(i + 1) * P * S <= ctx``, else the masked one. The DMA-issue loops (nested loops without
  MXU ops: one page's K and V copies per trip) run one trip per page copied: in step ``i``
  ``min(P, ceil(ctx / S) - (i + 1) * P)`` (the next step's pages), in the program body
  ``min(P, ceil(ctx / S))`` (the first step's).
* RPA v3 (``ragged_paged_attention`` of tpu-inference, default block sizes
  ``(bq, bkv, bq_c, bkv_c)`` from ``get_default_block_sizes``; grid (1,)): its decode kernel
  (``RPAd-*``) takes the decode rows, its prefill kernel (``RPAp-*``, ``static_q_len = chunk``)
  the chunk (the mixed case runs both; the row sums them). The sequence loop runs once per
  sequence of the kernel; the query-block loop ``ceil(q_len / bq)`` trips (absent when that is
  statically 1); for query block ``i`` the KV-block loop ``ceil(min(ctx, gap + (i + 1) * bq) /
  bkv)`` trips (``gap = ctx - q_len``), and in KV block ``j`` the compute loop (the loop with
  MXU ops) ``ceil(min(eff - j * bkv, bkv) / bkv_c)`` (``eff`` the block's visible length); the
  KV-cache update loop (a nested loop without MXU ops) runs over the pages the block's new
  tokens touch on the last query block and is skipped otherwise. Regions of the sequence loop
  before its first nested loop that start DMAs (the prologue: first sequence only) and after
  its last one (the epilogue: last sequence only) have weight 0; all other regions weight 1.

Units: a decode unit is one sequence, its bytes the logical KV it reads
(``ctx * K * 2 * D * itemsize``); useful flops are ``4 * H * D`` per causal (query row,
visible key) pair; ``ratio_to_rpa`` divides paxcache's cycles per KiB (decode) or bundles per
useful flop (prefill, mixed) by RPA v3's. Cycles are summed over every program on one
TensorCore and compared with per-TensorCore clock, bandwidth and peak.

Checked by compiling the same kernel at two sizes with the same block sizes (paxcache decode
at ctx 4096 and 8192; RPA v3 prefill of a 512-token chunk at ctx 2048 and 4096): the static
code (``static_code`` in the JSON: the loop tree's spans) is identical and the cycles scale as
the trip counts say (``bench/results/kernel_cycles_20261201.md``). RPA's default KV block of a
decode is ``min(16384 keys, ctx)``, so its decode code itself changes with ``ctx``.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: Per-TensorCore clock (Hz), HBM bandwidth (B/s) and bf16 peak (flop/s): the fallback when
#: ``pltpu.get_tpu_info()`` cannot say (it never gives the clock).
CHIPS = {
    "v5e": dict(topology="v5e:2x2", generation=5, clock=1.5e9, bw=819e9, peak=197e12),
    "v6e": dict(topology="v6e:2x2", generation=6, clock=1.75e9, bw=1640e9, peak=918e12),
    "tpu7x": dict(topology="tpu7x:2x2x1", generation=7, clock=2.2e9, bw=3690e9, peak=1153.5e12),
}
CASES = ("decode", "prefill", "mixed")
RPA_PAGES = 16384  # the peer's serving-sized cache


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundle_dump import (  # noqa: E402 - the script's own folder
    Dump,
    Loop,
    Region,
    iteration_cycles,
    parse_dump,
)

# --------------------------------------------------------------------------------------------
# Work and ceilings
# --------------------------------------------------------------------------------------------


def kv_bytes(ctx: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Logical KV bytes one sequence of ``ctx`` tokens reads (K and V)."""
    return ctx * kv_heads * 2 * head_dim * itemsize


def causal_pairs(q_len: int, ctx: int) -> int:
    """(query row, visible key) pairs of ``q_len`` rows that are the last of ``ctx`` tokens."""
    gap = ctx - q_len
    return q_len * gap + q_len * (q_len + 1) // 2


def case_work(case: str, a: argparse.Namespace) -> tuple[int, int, int]:
    """``(units, bytes, useful flops)`` of a case: units are sequences (decode rows + chunk)."""
    per = kv_bytes(a.ctx, a.kv_heads, a.head_dim, _itemsize(a.dtype))
    f = 4 * a.heads * a.head_dim
    if case == "decode":
        return a.batch, a.batch * per, a.batch * a.ctx * f
    if case == "prefill":
        return 1, per, causal_pairs(a.chunk, a.ctx) * f
    return a.batch + 1, (a.batch + 1) * per, (a.batch * a.ctx + causal_pairs(a.chunk, a.ctx)) * f


def ceilings(
    cycles: float, nbytes: float, flops: float, clock: float, bw: float, peak: float
) -> dict:
    """``cycles_per_kib``, ``hbm_ceiling``, ``bundles_per_useful_flop``, ``mxu_ceiling``."""
    t = cycles / clock
    return dict(
        cycles_per_kib=cycles / (nbytes / 1024.0),
        hbm_ceiling=min(1.0, (nbytes / bw) / t) if t > 0 else None,
        bundles_per_useful_flop=cycles / flops if flops else None,
        mxu_ceiling=min(1.0, (flops / peak) / t) if t > 0 and flops else None,
    )


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "float8_e4m3fn": 1}[dtype]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------
# Trip-count models
# --------------------------------------------------------------------------------------------


def _mxu_child(loop: Loop) -> Loop | None:
    return next((c for c in loop.children if c.mxu or _mxu_child(c)), None)


def _unit_loop(dump: Dump, programs: int = 1) -> Loop:
    """The loop of one program: Mosaic compiles a grid of more than one step as the kernel's
    outermost loop (the top-level loop holding the MXU ops); a one-step grid has none, and the
    whole kernel is then one program (a virtual loop over every bundle, run once)."""
    if programs > 1:
        return next(lp for lp in dump.loops if lp.mxu)
    return Loop(0, len(dump.bundles) - 1, list(dump.loops), list(dump.regions), True)


def _search_trips(cu: Sequence[int], nseq: int, r0: int, lo: int = 0) -> int:
    hi, n = nseq, 0
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cu[mid + 1] > r0 else (mid + 1, hi)
        n += 1
    return n


def _step_regions(loop: Loop) -> tuple[list, list, list, list]:
    """A step loop's plain regions: ``(next step's DMAs, next sequence's DMAs, [unmasked,
    masked] bodies, once per sequence)``. The two bodies are ``pl.when(whole)`` /
    ``pl.when(~whole)`` alternatives: the first two regions without DMAs when there are more
    than two such (the masked one is the larger); other DMA-free regions finish a sequence."""
    plain = [r for r in loop.regions if not r.loops]
    step = [r for r in plain if r.dma_start and not r.dma_wait]
    seq = [r for r in plain if r.dma_start and r.dma_wait]
    rest = [r for r in plain if not r.dma_start]
    bodies = sorted(rest[:2], key=lambda r: r.span) if len(rest) > 2 else []
    once = [r for r in rest if r not in bodies]
    return step, seq, bodies, once


def _step_weight(loop: Loop, first: bool, last: bool, whole: bool) -> Callable:
    step, seq, bodies, once = _step_regions(loop)

    def weight(lp: Loop, rg: Region) -> float:
        if lp is not loop:
            return 1.0
        if rg in step:
            return 0.0 if last else 1.0
        if rg in seq or rg in once:
            return 1.0 if last else 0.0
        if bodies and rg is bodies[0]:
            return 1.0 if whole else 0.0
        if bodies and rg is bodies[1]:
            return 0.0 if whole else 1.0
        return 1.0

    return weight


def paxcache_ragged_cycles(
    dump: Dump, meta: dict, q_lens: Sequence[int], ctx: int, first_seq: int = 0
) -> float:
    """Static cycles of ``paxcache_ragged_paged_attention`` for sequences of ``q_lens`` rows,
    the first ``first_seq`` of them left to the decode kernel (skipped: no work items)."""
    tq, p, s, kh = meta["tq"], meta["pages_per_step"], meta["page"], meta["kv_heads"]
    m = meta["max_blocks"]
    keys = p * s
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    grid = _unit_loop(dump, _cdiv(cu[-1], tq))
    work = next(c for c in grid.children if c.mxu)
    head = _mxu_child(work)  # a head loop (older kernels) or unrolled heads (None)
    search = grid.children[0] if grid.children[0] is not work else None
    search_iter = iteration_cycles(search, lambda c: None) if search else 0.0
    head_total = kh * iteration_cycles(head, lambda _: None) if head else 0.0

    def nested_work(c: Loop) -> float | None:
        return head_total if c is head else None  # skip_empty loops: 0 trips

    total = 0.0
    for qb in range(_cdiv(cu[-1], tq)):
        r0, r1 = qb * tq, qb * tq + tq
        work_cost = 0.0
        busy = False
        for sq, q in enumerate(q_lens):
            lo, hi = max(cu[sq], r0), min(cu[sq + 1], r1)
            if hi <= lo or sq < first_seq:
                continue
            busy = True
            off = ctx - q - cu[sq]
            n = _cdiv(min((hi - 1 + off + s) // s, m), p)
            for i in range(n):
                whole = lo == r0 and hi == r1 and i * keys + keys - 1 <= lo + off
                w = _step_weight(work, i == 0, i == n - 1, whole)
                work_cost += iteration_cycles(work, nested_work, w)
        n_search = _search_trips(cu, len(q_lens), r0, min(first_seq, len(q_lens)))

        def nested(
            c: Loop, w: float = work_cost, ns: int = n_search, busy: bool = busy
        ) -> float | None:
            if c is work:
                return w if busy else None  # a program with no sequence of its own
            if c is search:
                return ns * search_iter if ns else None
            return None  # skip_empty: every sequence has rows

        total += iteration_cycles(grid, nested)
    return total


def paxcache_paged_cycles(dump: Dump, meta: dict, lengths: Sequence[int]) -> float:
    """Static cycles of ``paxcache_paged_decode_attention``: one program per row of
    ``lengths`` (0 = a padding row: no steps, no copies), rows padded to the two halves."""
    p, s, kh = meta["pages_per_step"], meta["page"], meta["kv_heads"]
    rows = len(lengths)
    programs = 2 * _cdiv(rows, 2) if rows >= 2 else 1
    lengths = list(lengths) + [0] * (programs - rows)
    grid = _unit_loop(dump, programs)
    step = _mxu_child(grid)
    head = _mxu_child(step)  # a head loop (older kernels) or unrolled heads (None)
    head_total = kh * iteration_cycles(head, lambda _: None) if head else 0.0

    def copies(c: Loop, count: int) -> float | None:
        """A DMA-issue loop (no MXU ops) copying ``count`` pages: one trip per page."""
        return count * iteration_cycles(c, lambda _: None) if count > 0 else None

    def program(ctx: int) -> float:
        pages = _cdiv(ctx, s)
        n = _cdiv(pages, p)
        step_total = 0.0
        for i in range(n):
            whole = (i + 1) * p * s <= ctx
            w = _step_weight(step, i == 0, i == n - 1, whole)
            nxt = min(p, pages - (i + 1) * p)  # the next step's pages, issued in this one

            def in_step(c: Loop, nxt: int = nxt) -> float | None:
                return head_total if c is head else copies(c, nxt)

            step_total += iteration_cycles(step, in_step, w)

        def in_program(c: Loop) -> float | None:
            if c is step:
                return step_total if n else None
            return copies(c, min(p, pages))  # the first step's

        return iteration_cycles(grid, in_program)

    cost = {ctx: program(ctx) for ctx in set(lengths)}
    return sum(cost[ctx] for ctx in lengths)


def rpa_cycles(dump: Dump, meta: dict, q_lens: Sequence[int], ctx: int) -> float:
    """Static cycles of one RPA v3 kernel (grid (1,)) for its sequences of ``ctx`` keys."""
    bq, bkv, bkv_c, page = meta["bq_sz"], meta["bkv_sz"], meta["bkv_csz"], meta["page"]
    seq = next(lp for lp in dump.loops if lp.mxu)  # grid (1,): the sequence loop is top-level
    chain = [seq]
    while (c := _mxu_child(chain[-1])) is not None:
        chain.append(c)
    compute = chain[-1]
    bkv_loop = chain[-2]
    bq_loop = chain[-3] if len(chain) >= 4 else None
    compute_iter = iteration_cycles(compute, lambda _: None)
    first = min((c.start for c in seq.children), default=seq.end)
    last = max((c.end for c in seq.children), default=seq.start)

    def seq_weight(lp: Loop, rg: Region) -> float:
        if rg.loops:
            return 1.0
        if rg.end <= first and rg.dma_start:
            return 0.0  # prologue: the first sequence only
        return 0.0 if rg.start > last else 1.0  # epilogue: the last sequence only

    total = 0.0
    for q in q_lens:
        actual_bq = min(bq, q) if meta["static_q_len"] else bq
        gap = ctx - q
        bq_costs = []
        for i in range(_cdiv(q, actual_bq)):
            eff = min(ctx, gap + (i + 1) * actual_bq)
            bkv_total = 0.0
            for j in range(_cdiv(eff, bkv)):
                n_c = _cdiv(max(min(eff - j * bkv, bkv), 0), bkv_c)
                lo, hi = j * bkv, min((j + 1) * bkv, ctx)
                upd = 0
                if i == _cdiv(q, actual_bq) - 1 and hi > max(lo, gap):
                    upd = _cdiv(hi, page) - max(lo, gap) // page

                def nested(c: Loop, n_c: int = n_c, upd: int = upd) -> float | None:
                    if c is compute:
                        return n_c * compute_iter if n_c else None
                    if not upd:
                        return None
                    return upd * iteration_cycles(c, lambda _: None)  # KV-cache update

                bkv_total += iteration_cycles(bkv_loop, nested)
            if bq_loop is None:
                bq_costs.append(bkv_total)
            else:
                bq_costs.append(
                    iteration_cycles(bq_loop, lambda c, t=bkv_total: t if c is bkv_loop else None)
                )
        inner = bq_loop or bkv_loop
        total += iteration_cycles(
            seq, lambda c, t=sum(bq_costs), x=inner: t if c is x else None, seq_weight
        )
    root = _unit_loop(dump)  # code outside the sequence loop runs once per call
    return iteration_cycles(root, lambda c: total if c is seq else None)


# --------------------------------------------------------------------------------------------
# Compiling (child process: one target, one case, one kernel family)
# --------------------------------------------------------------------------------------------


def _abstract(shape: Sequence[int], dtype: Any, device: Any) -> Any:
    import jax
    from jax.sharding import SingleDeviceSharding

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=SingleDeviceSharding(device))


def paxcache_cache(kp: Any, device: Any, blocks: int, a: argparse.Namespace) -> Any:
    """Abstract cache for paxcache's public ops: the opaque ``init_kv_cache`` pytree when the
    package has it (every leaf placed on ``device``), else the ``(k_pages, v_pages)`` pair of
    ``[L, K, N, S, D]`` arrays."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(a.dtype)
    if hasattr(kp, "init_kv_cache"):
        tree = jax.eval_shape(
            lambda: kp.init_kv_cache(1, blocks, a.page, a.kv_heads, a.head_dim, dtype=dtype)
        )
        return jax.tree.map(lambda x: _abstract(x.shape, x.dtype, device), tree)
    shape = (1, a.kv_heads, blocks, a.page, a.head_dim)
    return (_abstract(shape, dtype, device), _abstract(shape, dtype, device))


def _q_lens(case: str, a: argparse.Namespace) -> list[int]:
    if case == "decode":
        return [1] * a.batch
    if case == "prefill":
        return [a.chunk]
    return [1] * a.batch + [a.chunk]


def _compile_paxcache(case: str, a: argparse.Namespace, device: Any) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import kernels_pallas as kp
    from kernels_pallas.tpu import paged_attention as dec
    from kernels_pallas.tpu import ragged_paged_attention as rag
    from kernels_pallas.tpu._attention_common import default_pages_per_compute_block

    q_lens = _q_lens(case, a)
    nseq, t = len(q_lens), sum(q_lens)
    m = _cdiv(a.ctx, a.page)
    # The page count is a runtime bound for these kernels, but a small cache lets XLA place it
    # in VMEM, which turns every page DMA into vector copy loops: use a serving-sized cache.
    blocks = max(nseq * m + 1, RPA_PAGES)
    cache = paxcache_cache(kp, device, blocks, a)
    dtype = jnp.dtype(a.dtype)
    i32 = jnp.int32
    opaque = not isinstance(cache, tuple)
    sizes = dict(kv_heads=a.kv_heads, head_dim=a.head_dim, itemsize=dtype.itemsize)
    blocks = rag.ragged_blocks(device.device_kind)  # the op's choice for this chip
    pages = default_pages_per_compute_block(a.page, m, blocks.keys, **sizes)
    if hasattr(dec, "decode_pages_per_step"):
        dec_pages = dec.decode_pages_per_step(a.page, m, **sizes)
    else:
        dec_pages = default_pages_per_compute_block(a.page, m, 128, **sizes)
    meta = dict(page=a.page, kv_heads=a.kv_heads, max_blocks=m, pages_per_step=pages)

    def cache_args(c: Any) -> tuple:
        return (c,) if opaque else tuple(c)

    def ragged(q, c, kvl, bt, cu, n):
        return kp.ragged_paged_attention(q, *cache_args(c), kvl, bt, cu, n, layer=0)

    def paged(q, c, lengths, bt):
        return kp.paged_attention(q, *cache_args(c), lengths, bt, layer=0)

    with jax.default_device(device):
        q = _abstract((t, a.heads, a.head_dim), dtype, device)
        args = (
            q,
            cache,
            _abstract((nseq,), i32, device),
            _abstract((nseq, m), i32, device),
            _abstract((nseq + 1,), i32, device),
            _abstract((), i32, device),
        )
        # The ragged op compiles both kernels (each under a lax.cond): the leading one-row
        # sequences run on the decode kernel (rows = min(T, B) programs, the others length 0),
        # the rest on the ragged kernel from ``first_seq`` on. A decode batch is all leading
        # one-row sequences: both ops run the decode kernel alone (one row); a prefill chunk
        # runs the ragged kernel alone.
        jax.jit(ragged).trace(*args).lower().compile()
        tq = rag.default_queries_per_block(t, a.heads // a.kv_heads, blocks.rows)
        if case == "mixed":
            dec_lengths = [a.ctx] * a.batch + [0] * (min(t, nseq) - a.batch)
            out = [
                dict(
                    meta, variant="split", tq=tq, dec_pages_per_step=dec_pages,
                    name="paxcache_paged_decode_attention+paxcache_ragged_paged_attention",
                    first_seq=a.batch, dec_lengths=dec_lengths,
                )
            ]  # fmt: skip
        elif case == "prefill":
            out = [dict(meta, variant="ragged", name="paxcache_ragged_paged_attention", tq=tq)]
        else:
            jax.jit(paged).trace(*args[:4]).lower().compile()
            out = [
                dict(meta, variant="paged", name="paxcache_paged_decode_attention",
                     pages_per_step=dec_pages)
            ]  # fmt: skip
    return out


def load_rpa(wheel: str, generation: int) -> Any:
    """RPA v3's ``kernel`` module loaded by path under stub parent packages (the package's
    ``__init__`` imports vllm); ``get_tpu_version`` patched to ``generation``."""
    root = Path(wheel)
    if root.is_file():
        dest = Path(tempfile.mkdtemp(prefix="rpa_wheel_"))
        with zipfile.ZipFile(root) as z:
            z.extractall(dest)
        root = dest
    hits = sorted(root.glob("**/kernels/ragged_paged_attention/v3/kernel.py"))
    if not hits:
        raise SystemExit(f"--rpa-wheel {wheel}: no kernels/ragged_paged_attention/v3/kernel.py")
    v3 = hits[0].parent
    pkg = "tpu_inference.kernels.ragged_paged_attention.v3"
    parts = pkg.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        mod = types.ModuleType(name)
        mod.__path__ = []  # type: ignore[attr-defined]
        sys.modules[name] = mod
    loaded = {}
    for leaf in ("util", "kernel"):
        spec = importlib.util.spec_from_file_location(f"{pkg}.{leaf}", v3 / f"{leaf}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"{pkg}.{leaf}"] = mod
        if leaf == "kernel":
            loaded["util"].get_tpu_version = lambda: generation
        spec.loader.exec_module(mod)
        mod.get_tpu_version = lambda: generation
        loaded[leaf] = mod
    return loaded["kernel"]


def _compile_rpa(case: str, a: argparse.Namespace, device: Any, generation: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    rpa = load_rpa(a.rpa_wheel, generation)
    q_lens = _q_lens(case, a)
    nseq, t = len(q_lens), sum(q_lens)
    pps = _cdiv(a.ctx, a.page)
    dtype = jnp.dtype(a.dtype)
    i32 = jnp.int32
    chunk = a.chunk if case != "decode" else None
    shape = rpa.get_kv_cache_shape(RPA_PAGES, a.page, a.kv_heads, a.head_dim, dtype)
    with jax.default_device(device):
        q = _abstract((t, a.heads, a.head_dim), dtype, device)
        kv = _abstract((t, a.kv_heads, a.head_dim), dtype, device)
        args = (
            q,
            kv,
            kv,
            _abstract(shape, dtype, device),
            _abstract((nseq,), i32, device),
            _abstract((nseq * pps,), i32, device),
            _abstract((nseq + 1,), i32, device),
            _abstract((3,), i32, device),
        )

        def f(*xs):
            return rpa.ragged_paged_attention(
                *xs, sm_scale=a.head_dim**-0.5, chunk_prefill_size=chunk
            )

        jax.jit(f).trace(*args).lower().compile()
        out = []
        kinds = [("DECODE", "d", [1] * a.batch)] if case != "prefill" else []
        if case != "decode":
            kinds.append(("PREFILL", "p", [a.chunk]))
        for kind, sym, lens in kinds:
            bs = rpa.get_default_block_sizes(
                dtype, dtype, a.heads, a.kv_heads, _cdiv(a.head_dim, 128) * 128, a.page, t,
                nseq, pps, case=getattr(rpa.RpaCase, kind),
            )  # fmt: skip
            blocks = f"bq_{bs['bq_sz']}_{bs['bq_csz']}-bkv_{bs['bkv_sz']}_{bs['bkv_csz']}"
            name = f"RPA{sym}-p_{a.page}-{blocks}"
            out.append(dict(bs, variant=kind.lower(), name=name, page=a.page, q_lens=lens,
                            static_q_len=1 if kind == "DECODE" else a.chunk))  # fmt: skip
    return out


def child_main(a: argparse.Namespace) -> None:
    """Compile one family for one target and case (dump written by libtpu); print JSON meta."""
    import jax
    from jax.experimental import topologies

    chip = CHIPS[a.target]
    device = topologies.get_topology_desc(chip["topology"], platform="tpu").devices[0]
    info: dict[str, float] = {}
    try:
        from jax.experimental.pallas import tpu as pltpu

        with jax.default_device(device):
            ti = pltpu.get_tpu_info()
        cores = max(1, int(getattr(ti, "num_cores", 1) or 1))
        info = dict(bw=ti.mem_bw_bytes_per_second / cores, peak=ti.bf16_ops_per_second / cores)
    except Exception:  # noqa: BLE001 - older jax or unknown chip: the table
        info = {}
    if a.child == "paxcache":
        kernels = _compile_paxcache(a.case, a, device)
    else:
        kernels = _compile_rpa(a.case, a, device, chip["generation"])
    print("KERNEL_CYCLES_META " + json.dumps(dict(kernels=kernels, info=info)))


# --------------------------------------------------------------------------------------------
# Parent: spawn compiles, read dumps, report
# --------------------------------------------------------------------------------------------

_DUMP_NAME = re.compile(r"^\d+-(.+?)(?:\.\d+)?-\d+-final_bundles\.txt$")


def find_dumps(directory: str) -> dict[str, str]:
    """Kernel name -> path of its ``final_bundles`` text in a dump folder."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*-final_bundles.txt"))):
        m = _DUMP_NAME.match(os.path.basename(path))
        if m:
            out[m.group(1)] = path
    return out


def _shape_flags(a: argparse.Namespace) -> list[str]:
    return [
        f"--heads={a.heads}", f"--kv-heads={a.kv_heads}", f"--head-dim={a.head_dim}",
        f"--dtype={a.dtype}", f"--page={a.page}", f"--batch={a.batch}", f"--ctx={a.ctx}",
        f"--chunk={a.chunk}",
    ]  # fmt: skip


def compile_family(family: str, target: str, case: str, a: argparse.Namespace) -> tuple[dict, dict]:
    """Compile one family in a fresh process; returns ``(meta, {name: Dump})``."""
    with tempfile.TemporaryDirectory(prefix="kernel_cycles_") as d:
        filt = "paxcache" if family == "paxcache" else "RPA"
        # deviceless compiles never touch a TPU: another libtpu process's lockfile must not
        # stop this one
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        env["LIBTPU_INIT_ARGS"] = (
            env.get("LIBTPU_INIT_ARGS", "")
            + f" --xla_jf_dump_to={d} --xla_jf_dump_llo_text=true --xla_jf_dump_to_filter={filt}"
            " --xla_jf_dump_llo_pass_label_regex=final_bundles"
        ).strip()
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        cmd = [sys.executable, os.path.abspath(__file__), f"--child={family}",
               f"--target={target}", f"--case={case}", *_shape_flags(a)]  # fmt: skip
        if a.rpa_wheel:
            cmd.append(f"--rpa-wheel={a.rpa_wheel}")
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        line = next((x for x in r.stdout.splitlines() if x.startswith("KERNEL_CYCLES_META ")), None)
        if r.returncode != 0 or line is None:
            tail = "\n".join((r.stderr or "").strip().splitlines()[-15:])
            why = _compile_verdict(r.stderr or "")
            raise RuntimeError(
                f"{family} {target} {case}: compile failed (rc {r.returncode}) {why}\n{tail}"
            )
        meta = json.loads(line.split(" ", 1)[1])
        dumps = {}
        for name, path in find_dumps(d).items():
            dumps[name] = parse_dump(Path(path).read_text(), name)
        return meta, dumps


def _dump_for(dumps: dict[str, Dump], name: str) -> Dump:
    if name in dumps:
        return dumps[name]
    hits = [k for k in dumps if k.startswith(name)]
    if not hits:
        raise RuntimeError(f"no final_bundles dump for kernel {name!r} (have {sorted(dumps)})")
    return dumps[hits[0]]


def measure(target: str, case: str, a: argparse.Namespace) -> list[dict]:
    """Rows of one target and case: every paxcache kernel, then RPA v3 (when given)."""
    chip = CHIPS[target]
    _, nbytes, flops = case_work(case, a)
    rows = []
    families = ["paxcache"] + (["rpa"] if a.rpa_wheel else [])
    peer_error = None
    for family in families:
        try:
            meta, dumps = compile_family(family, target, case, a)
        except RuntimeError as e:
            if family == "paxcache":
                raise
            peer_error = str(e).splitlines()[0]
            print(f"RPA v3 {target} {case}: {peer_error}", file=sys.stderr)
            continue
        clock = chip["clock"]
        bw = meta["info"].get("bw") or chip["bw"]
        peak = meta["info"].get("peak") or chip["peak"]
        if family == "paxcache":
            for k in meta["kernels"]:
                if k["variant"] == "split":  # decode kernel + ragged kernel, one row
                    dec_name, rag_name = k["name"].split("+")
                    dec_dump, dump = _dump_for(dumps, dec_name), _dump_for(dumps, rag_name)
                    dec = dict(k, pages_per_step=k["dec_pages_per_step"])
                    cyc = paxcache_paged_cycles(dec_dump, dec, k["dec_lengths"])
                    cyc += paxcache_ragged_cycles(
                        dump, k, _q_lens(case, a), a.ctx, first_seq=k["first_seq"]
                    )
                    row = _row("paxcache", k["name"], target, case, cyc, nbytes, flops,
                               clock, bw, peak, None)  # fmt: skip
                    row["static_code"] = [dec_dump.summary(), dump.summary()]
                    rows.append(row)
                    continue
                dump = _dump_for(dumps, k["name"])
                if k["variant"] == "paged":
                    cyc = paxcache_paged_cycles(dump, k, [a.ctx] * a.batch)
                else:
                    cyc = paxcache_ragged_cycles(dump, k, _q_lens(case, a), a.ctx)
                rows.append(_row("paxcache", k["name"], target, case, cyc, nbytes, flops,
                                 clock, bw, peak, dump))  # fmt: skip
        else:
            names, cyc, shapes = [], 0.0, []
            for k in meta["kernels"]:
                dump = _dump_for(dumps, k["name"])
                names.append(dump.name)
                cyc += rpa_cycles(dump, k, k["q_lens"], a.ctx)
                shapes.append(dump.summary())
            row = _row(
                "rpa_v3", "+".join(names), target, case, cyc, nbytes, flops, clock, bw, peak, None
            )
            row["static_code"] = shapes
            rows.append(row)
    peer = next((r for r in rows if r["kernel"] == "rpa_v3"), None)
    key = "cycles_per_kib" if case == "decode" else "bundles_per_useful_flop"
    for r in rows:
        if r["kernel"] == "paxcache":
            r["ratio_to_rpa"] = r[key] / peer[key] if peer and peer[key] else None
            if peer_error:
                r["rpa_error"] = peer_error
    return rows


def _compile_verdict(err: str) -> str:
    """The compiler's one-line reason in a failed compile's output (e.g. VMEM exceeded)."""
    m = re.search(r"Ran out of memory in memory space \w+\. Used \S+ of \S+ \w+\.", err)
    return m.group(0) if m else ""


def _row(kernel, name, target, case, cyc, nbytes, flops, clock, bw, peak, dump) -> dict:  # noqa: ANN001
    row = dict(kernel=kernel, name=name, target=target, case=case, static_cycles=cyc)
    row.update(ceilings(cyc, nbytes, flops, clock, bw, peak))
    row["ratio_to_rpa"] = None
    row["kv_bytes"], row["useful_flops"] = nbytes, flops
    row["clock_hz"], row["hbm_bytes_per_s"], row["peak_flops"] = clock, bw, peak
    if dump is not None:
        row["static_code"] = dump.summary()
    return row


def format_table(rows: Sequence[dict]) -> str:
    """A fixed-width table of the report's main columns."""
    head = ("kernel", "name", "target", "case", "cycles_per_kib", "hbm_ceiling",
            "bundles_per_useful_flop", "mxu_ceiling", "ratio_to_rpa")  # fmt: skip

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [head] + [tuple(fmt(r.get(h)) for h in head) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(head))) for c in cells)


def _csv(kind: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(s: str) -> list[str]:
        vals = [v.strip() for v in s.split(",") if v.strip()]
        bad = [v for v in vals if v not in kind]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"{s!r}: choose from {', '.join(kind)}")
        return vals

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The CLI (``--target`` and ``--case`` take comma lists)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--target", type=_csv(tuple(CHIPS)), default=["v5e"])
    p.add_argument("--case", type=_csv(CASES), default=["decode"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--rpa-wheel", default=None, help="tpu-inference .whl or unpacked folder")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per compile")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the report; returns the exit status."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.child:
        a.target, a.case = a.target[0], a.case[0]
        child_main(a)
        return 0
    if a.case != ["decode"] and a.chunk > a.ctx:
        p.error(f"--chunk {a.chunk} exceeds --ctx {a.ctx}")
    rows: list[dict] = []
    failed = []
    for target in a.target:
        for case in a.case:
            try:
                rows.extend(measure(target, case, a))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failed.append(f"{target} {case}: {e}")
                print(f"FAILED {target} {case}: {e}", file=sys.stderr)
    print(format_table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if failed and not rows else 0


if __name__ == "__main__":
    sys.exit(main())
