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
from forward branches). Trip counts and the cost of a loop iteration: derived from the dump's
loop tree, the kernel's block sizes and the shape, per kernel, as ``scripts/kernel_trips.py``
documents and implements them.

``kv_read_bytes``: the KV bytes each kernel brings into VMEM, page-rounded (the keys per
kernel as ``scripts/kernel_trips.py`` derives them, times ``K * 2 * D * itemsize``): for a
prefill chunk, how often its blocks re-read the context.

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
CACHE_CAP_BYTES = 4 << 30  # either kernel's cache for one layer: at most 4 GiB (v5e has 16)


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundle_dump import Dump, parse_dump  # noqa: E402 - the script's own folder
from kernel_trips import (  # noqa: E402
    _cdiv,
    paxcache_paged_cycles,
    paxcache_paged_read_keys,
    paxcache_ragged_cycles,
    paxcache_ragged_read_keys,
    rpa_cycles,
    rpa_read_keys,
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
    per = kv_bytes(a.ctx, a.kv_heads, a.head_dim, _itemsize(_kv_dtype(a)))
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


def _kv_dtype(a: argparse.Namespace) -> str:
    """The cache's dtype (``--kv-dtype``, default ``--dtype``, the queries' dtype)."""
    return getattr(a, "kv_dtype", None) or a.dtype


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "float8_e4m3fn": 1}[dtype]


def _cache_pages(a: argparse.Namespace, want: int, dtype: str) -> int:
    """``want`` pages of a one-layer cache of ``dtype``, at most ``CACHE_CAP_BYTES`` of them."""
    return min(want, CACHE_CAP_BYTES // kv_bytes(a.page, a.kv_heads, a.head_dim, _itemsize(dtype)))


# --------------------------------------------------------------------------------------------
# Compiling (child process: one target, one case, one kernel family)
# --------------------------------------------------------------------------------------------


def _abstract(shape: Sequence[int], dtype: Any, device: Any) -> Any:
    import jax
    from jax.sharding import make_single_device_sharding

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=make_single_device_sharding(device))


def paxcache_cache(kp: Any, device: Any, blocks: int, a: argparse.Namespace) -> Any:
    """Abstract cache for paxcache's public ops: the opaque ``init_kv_cache`` pytree when the
    package has it (every leaf placed on ``device``), else the ``(k_pages, v_pages)`` pair of
    ``[L, K, N, S, D]`` arrays."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(_kv_dtype(a))
    if hasattr(kp, "kv_cache_shape"):  # the cache's abstract leaves, nothing computed
        tree = kp.kv_cache_shape(1, blocks, a.page, a.kv_heads, a.head_dim, dtype, platform="tpu")
        return jax.tree.map(lambda x: _abstract(x.shape, x.dtype, device), tree)
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
    # The tables are abstract (no page is addressed at compile time), so a batch whose pages
    # would not fit a chip's HBM (256 x 32K tokens of Llama-3-8B: 32 GiB) shares a cache of
    # at most CACHE_CAP_BYTES, as a served batch's sequences share one cache.
    blocks = _cache_pages(a, max(nseq * m + 1, RPA_PAGES), _kv_dtype(a))
    cache = paxcache_cache(kp, device, blocks, a)
    dtype = jnp.dtype(a.dtype)
    i32 = jnp.int32
    opaque = not isinstance(cache, tuple)
    # the kernels' head dim is the one the pages store (head_dim 64 is lane-padded to 128)
    stored = kp.stored_head_dim(a.head_dim, "tpu") if hasattr(kp, "stored_head_dim") else a.head_dim
    sizes = dict(kv_heads=a.kv_heads, head_dim=stored, itemsize=_itemsize(_kv_dtype(a)))
    blocks = rag.ragged_blocks(device.device_kind)  # the op's choice for this chip
    if hasattr(rag, "step_pages"):  # the op's own rule
        pages = rag.step_pages(
            blocks, a.page, m, kv_heads=a.kv_heads, head_dim=stored,
            q_itemsize=dtype.itemsize, kv_itemsize=sizes["itemsize"],
        )  # fmt: skip
    else:  # older builds: the table's keys within one KV budget for every chip
        pages = default_pages_per_compute_block(a.page, m, blocks.keys, **sizes)
    if hasattr(dec, "decode_pages_per_step"):
        import inspect

        if "device_kind" in inspect.signature(dec.decode_pages_per_step).parameters:
            sizes_dec = dict(sizes, device_kind=device.device_kind)  # the chip's budget
        else:  # older builds: one budget for every chip
            sizes_dec = sizes
        dec_pages = dec.decode_pages_per_step(a.page, m, **sizes_dec)
    else:
        dec_pages = default_pages_per_compute_block(a.page, m, 128, **sizes)
    meta = dict(page=a.page, kv_heads=a.kv_heads, max_blocks=m, pages_per_step=pages)
    meta["fused"] = bool(a.fused)
    if hasattr(rag, "masked_step_widths"):  # the widths a masked step is compiled at
        meta["masked_widths"] = rag.masked_step_widths(pages, a.page)

    def cache_args(c: Any) -> tuple:
        return (c,) if opaque else tuple(c)

    def ragged(q, c, kvl, bt, cu, n, *new):
        fused = dict(new_kv=new, max_q_len=1 if case == "decode" else None) if new else {}
        return kp.ragged_paged_attention(q, *cache_args(c), kvl, bt, cu, n, layer=0, **fused)

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
        if a.fused:  # the new rows' K, V and slots: the ops' fused form (the RPA peer's too)
            kv = _abstract((t, a.kv_heads, a.head_dim), dtype, device)
            args = (*args, kv, kv, _abstract((t,), i32, device))
        # fused: the pages are donated, as the engine donates them (else XLA copies them all)
        jax.jit(ragged, donate_argnums=(1,) if a.fused else ()).trace(*args).lower().compile()
        rows = blocks.rows  # the kernel's own rule when it has one (older builds: the table)
        if hasattr(rag, "block_rows"):
            rows = rag.block_rows(blocks, a.kv_heads, stored, dtype.itemsize)
        tq = rag.default_queries_per_block(t, a.heads // a.kv_heads, rows)
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
            if not a.fused:  # fused: the ragged op's decode kernel, compiled above
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
    # ~16K pages, within the same per-layer cap as paxcache's (16K pages of 64 tokens of a
    # head_dim-256 model are 8 GiB, which with its copy overflows v5e's 16 GiB of HBM)
    pages = _cache_pages(a, RPA_PAGES, a.dtype)
    shape = rpa.get_kv_cache_shape(pages, a.page, a.kv_heads, a.head_dim, dtype)
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
        if a.ragged_blocks:  # a sweep: this chip's table entry replaced for this compile
            import dataclasses

            from kernels_pallas.tpu import ragged_paged_attention as rag

            rows, keys, headroom, *more = (int(x) for x in a.ragged_blocks.split(","))
            limits = ("kv_budget", "vmem_cap", "logits_budget")[: len(more)]  # optional, MiB
            extra = {k: x * 1024 * 1024 for k, x in zip(limits, more, strict=True)}
            if extra.get("logits_budget") == 0:  # 0: the step's keys not capped by logits
                extra["logits_budget"] = None
            rag.RAGGED_BLOCKS[device.device_kind] = dataclasses.replace(
                rag.ragged_blocks(device.device_kind),  # the chip's other limits kept
                rows=rows, keys=keys, headroom=headroom * 1024 * 1024, **extra,
            )  # fmt: skip
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
        f"--chunk={a.chunk}", *([f"--kv-dtype={a.kv_dtype}"] if a.kv_dtype else []),
        *(["--fused"] if a.fused else []),
        *([f"--ragged-blocks={a.ragged_blocks}"] if a.ragged_blocks else []),
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
    peer = a.rpa_wheel and _kv_dtype(a) == a.dtype  # the peer runs here on a float cache only
    families = ["paxcache"] + (["rpa"] if peer else [])
    peer_error = None
    key_bytes = kv_bytes(1, a.kv_heads, a.head_dim, _itemsize(_kv_dtype(a)))  # K and V
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
                    read = paxcache_paged_read_keys(dec, k["dec_lengths"])
                    read += paxcache_ragged_read_keys(k, _q_lens(case, a), a.ctx, k["first_seq"])
                    row["kv_read_bytes"] = read * key_bytes
                    rows.append(row)
                    continue
                dump = _dump_for(dumps, k["name"])
                if k["variant"] == "paged":
                    cyc = paxcache_paged_cycles(dump, k, [a.ctx] * a.batch)
                    read = paxcache_paged_read_keys(k, [a.ctx] * a.batch)
                else:
                    cyc = paxcache_ragged_cycles(dump, k, _q_lens(case, a), a.ctx)
                    read = paxcache_ragged_read_keys(k, _q_lens(case, a), a.ctx)
                rows.append(_row("paxcache", k["name"], target, case, cyc, nbytes, flops,
                                 clock, bw, peak, dump))  # fmt: skip
                rows[-1]["kv_read_bytes"] = read * key_bytes
        else:
            names, cyc, shapes, read = [], 0.0, [], 0
            for k in meta["kernels"]:
                dump = _dump_for(dumps, k["name"])
                names.append(dump.name)
                cyc += rpa_cycles(dump, k, k["q_lens"], a.ctx)
                read += rpa_read_keys(k, k["q_lens"], a.ctx)
                shapes.append(dump.summary())
            row = _row(
                "rpa_v3", "+".join(names), target, case, cyc, nbytes, flops, clock, bw, peak, None
            )
            row["static_code"] = shapes
            row["kv_read_bytes"] = read * key_bytes
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
    if m:
        return m.group(0)
    m = re.search(
        r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\).*?space=(\w+)", err
    )
    if m:  # e.g. a block table prefetched whole into SMEM
        need, have, space = int(m.group(1)), int(m.group(2)), m.group(3)
        return f"{space} exceeded: {need / 2**20:.1f} MiB asked, {have / 2**20:.1f} MiB there"
    m = re.search(r"Ran out of memory on HBM[^\n]*", err)
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
            "bundles_per_useful_flop", "mxu_ceiling", "ratio_to_rpa", "kv_read_mib")  # fmt: skip

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    def cell(r: dict, h: str) -> Any:
        if h == "kv_read_mib":  # KV bytes read (kernel_trips), in MiB
            return r["kv_read_bytes"] / 2**20 if "kv_read_bytes" in r else None
        return r.get(h)

    cells = [head] + [tuple(fmt(cell(r, h)) for h in head) for r in rows]
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
    p.add_argument(
        "--kv-dtype", default=None, choices=["bfloat16", "float32", "int8", "float8_e4m3fn"],
        help="the KV cache's dtype (default --dtype; 8-bit: paxcache only, no peer row)",
    )  # fmt: skip
    p.add_argument(
        "--fused", action="store_true",
        help="paxcache with the step's KV write fused (new_kv=), as the engine's step runs it",
    )  # fmt: skip
    p.add_argument(
        "--ragged-blocks", default=None,
        metavar="ROWS,KEYS,HEADROOM_MIB[,KV_MIB[,CAP_MIB[,LOGITS_MIB]]]",
        help="sweep: the ragged kernel's block sizes (and optionally its KV double buffer's, "
        "the kernel's VMEM and the step's f32 logits limits; LOGITS_MIB 0: none) for the "
        "target instead of its table entry; the limits not given are the entry's, so KEYS "
        "is still capped by its logits budget (v5e, v6e: 32 MiB) unless LOGITS_MIB is given",
    )  # fmt: skip
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
    fields = a.ragged_blocks.split(",") if a.ragged_blocks else []
    if fields and not (3 <= len(fields) <= 6 and all(f.strip().isdigit() for f in fields)):
        p.error(f"--ragged-blocks {a.ragged_blocks!r}: 3 to 6 whole numbers, comma-separated")
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
