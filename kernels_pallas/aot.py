"""Compile for a TPU without a TPU (libtpu's real compiler on abstract topology devices), and
lower or export for a CUDA GPU generation without a GPU (:func:`cuda_target`).

``pip install "jax[tpu]"`` brings libtpu, whose compiler runs on any host: an abstract
topology (``v5e:2x2``, ``v6e:2x2``, ``v4:2x2x1``, ``v5p:2x2x1`` ...) gives devices that
programs can be lowered and compiled for (Mosaic and XLA:TPU passes included) but not run.

Example::

    from kernels_pallas import aot

    with aot.tpu_target("v5e:2x2") as devices:
        q = aot.spec((64, 32, 128), jnp.bfloat16, devices[0])
        ...
        compiled = jax.jit(fn).trace(q, ...).lower().compile()
        assert "tpu_custom_call" in compiled.as_text()

Inside :func:`tpu_target` the default device is the topology's first device, so
``impl="auto"`` picks the Mosaic TPU kernels exactly as on a live TPU (see
:mod:`kernels_pallas._dispatch`). Set ``JAX_PLATFORMS=cpu`` when no TPU is attached, so
backend initialisation does not probe for one.

CUDA: inside ``cuda_target("8.0")`` (a compute capability) a CUDA lowering or
``jax.export(..., platforms=["cuda"])`` assumes that GPU generation: ``impl="auto"`` chooses
what a live GPU of that capability would (the Mosaic GPU kernels on 9.x, the XLA path
elsewhere, ``kernel_info("cuda")`` says which and why), the Mosaic GPU lowering targets that
architecture (it reads the abstract mesh's device) and the GPU work planning fills that
generation's SM count. Targets nest and can follow each other in one process::

    with aot.cuda_target("8.0"):
        text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, Sharding, make_single_device_sharding

from kernels_pallas import _dispatch

__all__ = [
    "CUDA_GENERATIONS",
    "CudaDevice",
    "HBM_BYTES",
    "KERNEL_OPS",
    "KernelCase",
    "compile_case",
    "cuda_device",
    "cuda_target",
    "hbm_bytes",
    "kernel_grid",
    "spec",
    "tpu_devices",
    "tpu_target",
]

_GIB = 1 << 30

#: HBM per chip by ``device_kind`` (public chip specs), the last resort of :func:`hbm_bytes`:
#: a live chip reports its usable memory (``memory_stats()["bytes_limit"]``) and the TPU
#: compiler states it for abstract devices (15.75 GiB on v5e, 31.25 GiB on v6e).
HBM_BYTES = {
    "TPU v2": 8 * _GIB,
    "TPU v3": 16 * _GIB,
    "TPU v4": 32 * _GIB,
    "TPU v4 lite": 8 * _GIB,
    "TPU v5 lite": 16 * _GIB,  # v5e
    "TPU v5": 95 * _GIB,  # v5p
    "TPU v5p": 95 * _GIB,
    "TPU v6 lite": 32 * _GIB,  # v6e (Trillium)
    "TPU7x": 192 * _GIB,
}


# --------------------------------------------------------------------------------------------
# CUDA targets
# --------------------------------------------------------------------------------------------

#: One representative GPU per compute capability (public specs): ``(device_kind, SMs, memory
#: bytes)``. :func:`cuda_target` describes its device with it; a capability not listed gets
#: the closest lower generation's SM count and memory under a generic name.
CUDA_GENERATIONS: dict[str, tuple[str, int, int]] = {
    "8.0": ("NVIDIA A100-SXM4-80GB", 108, 80 * _GIB),
    "8.6": ("NVIDIA A10", 72, 24 * _GIB),
    "8.9": ("NVIDIA L4", 58, 24 * _GIB),
    "9.0": ("NVIDIA H100 80GB HBM3", 132, 80 * _GIB),
    "10.0": ("NVIDIA B200", 148, 180 * _GIB),
    "12.0": ("NVIDIA RTX PRO 6000 Blackwell", 188, 96 * _GIB),
}


@dataclasses.dataclass(frozen=True)
class CudaDevice(AbstractDevice):
    """An abstract CUDA device: JAX's ``AbstractDevice`` plus the ``compute_capability`` a
    live GPU reports (what the Mosaic GPU lowering reads) and its memory in bytes."""

    compute_capability: str = _dispatch.HOPPER
    memory_bytes: int | None = None


def _capability_key(capability: str) -> tuple[int, int]:
    if not re.fullmatch(r"\d+\.\d+", capability):
        raise ValueError(
            f"cuda_target: compute capability must look like '8.0' or '9.0', got {capability!r}"
        )
    major, minor = capability.split(".")
    return int(major), int(minor)


def cuda_device(capability: str) -> CudaDevice:
    """The abstract device :func:`cuda_target` assumes for ``capability`` (see
    :data:`CUDA_GENERATIONS`).

    Raises:
      ValueError: not a ``"major.minor"`` string.
    """
    key = _capability_key(str(capability))
    known = sorted(CUDA_GENERATIONS, key=_capability_key)
    if str(capability) in CUDA_GENERATIONS:
        kind, sms, memory = CUDA_GENERATIONS[str(capability)]
    else:
        lower = [c for c in known if _capability_key(c) <= key] or known[:1]
        _, sms, memory = CUDA_GENERATIONS[lower[-1]]
        kind = f"NVIDIA GPU sm_{key[0]}{key[1]}"
    return CudaDevice(
        device_kind=kind, num_cores=sms, platform="gpu",
        compute_capability=str(capability), memory_bytes=memory,
    )  # fmt: skip


@contextlib.contextmanager
def cuda_target(capability: str) -> Iterator[CudaDevice]:
    """Lower and export for a CUDA GPU of compute capability ``capability`` ("8.0", "8.9",
    "9.0", "10.0", ...) with no GPU attached; yields its :class:`CudaDevice`.

    Inside, the target platform is CUDA (an abstract mesh of one such device is set, which
    the kernels' dispatch and the Mosaic GPU lowering read) and ``impl="auto"`` chooses per
    that capability: nothing is cached across targets, so several run in one process. Use
    ``ShapeDtypeStruct`` arguments without a sharding (or ``jax.export``); a program placed
    on a concrete mesh is outside this target, so build what runs (an engine) before entering.

    Raises:
      ValueError: ``capability`` is not a ``"major.minor"`` string.
    """
    device = cuda_device(capability)
    mesh = AbstractMesh((1,), ("cuda_target",), abstract_device=device)
    with _dispatch.targeting_cuda(device.compute_capability), jax.sharding.use_abstract_mesh(mesh):
        yield device


@functools.cache
def _topology(name: str) -> Any:
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=name, platform="tpu")


def tpu_devices(name: str) -> list[jax.Device]:
    """The abstract devices of a TPU topology, e.g. ``"v5e:2x2"`` (4 chips).

    Raises:
      ValueError: libtpu is not installed or does not know the topology.
    """
    try:
        return list(_topology(name).devices)
    except Exception as e:  # noqa: BLE001 - libtpu missing / unknown name: say which
        raise ValueError(
            f"cannot describe TPU topology {name!r} ({type(e).__name__}: {e}); it needs "
            "libtpu (pip install 'jax[tpu]') and a name like v5e:2x2, v6e:2x2, v4:2x2x1"
        ) from e


@contextlib.contextmanager
def tpu_target(name_or_devices: str | Sequence[jax.Device]) -> Iterator[list[jax.Device]]:
    """Make a TPU topology's first device the default device; yields the devices."""
    devices = (
        tpu_devices(name_or_devices) if isinstance(name_or_devices, str) else list(name_or_devices)
    )
    with jax.default_device(devices[0]):
        yield devices


def spec(
    shape: Sequence[int], dtype: Any, where: jax.Device | Sharding, memory_kind: str | None = None
) -> jax.ShapeDtypeStruct:
    """A ``ShapeDtypeStruct`` placed on a device (or with a sharding), e.g. abstract TPU."""
    sharding = make_single_device_sharding(where) if isinstance(where, jax.Device) else where
    if memory_kind is not None:
        sharding = sharding.with_memory_kind(memory_kind)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


@functools.cache
def _compiler_hbm(device: jax.Device) -> int | None:
    """Usable HBM the TPU compiler assumes for ``device``: compile a program far too big and
    read "exceeds available HBM (15.75G)" from the error (no allocation happens)."""
    import re

    import jax.numpy as jnp

    try:
        with jax.default_device(device):
            x = spec((1 << 20, 1 << 20), jnp.float32, device)  # 4 TiB
            jax.jit(lambda a: a + 1).trace(x).lower().compile()
    except Exception as e:  # noqa: BLE001 - the expected out-of-memory verdict
        m = re.search(r"available HBM \(([0-9.]+)([KMGT])\)", str(e))
        if m:
            return int(float(m.group(1)) * (1 << (10 * "KMGT".index(m.group(2)) + 10)))
    return None


def hbm_bytes(device: jax.Device) -> int | None:
    """Usable HBM of one chip: a live device's ``bytes_limit``; for an abstract device what
    the TPU compiler allows a program (e.g. 15.75 GiB on v5e, 31.25 GiB on v6e), else
    :data:`HBM_BYTES`."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - abstract devices raise; ask the compiler
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if device.platform == "tpu":
        found = _compiler_hbm(device)
        if found:
            return found
    return HBM_BYTES.get(device.device_kind)


# --------------------------------------------------------------------------------------------
# The kernel grid (tests/test_tpu_compile.py, scripts/compile_check.py without --config)
# --------------------------------------------------------------------------------------------

KERNEL_OPS = ("ragged_paged_attention", "paged_attention", "write_kv", "copy_blocks")


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One public-API kernel call, compiled for a TPU target with ``impl="auto"``.

    Attributes:
      op: one of :data:`KERNEL_OPS`.
      dtype: page / query dtype name.
      head_dim: D.
      q_per_kv: G = H / K.
      block_size: S.
      kv_heads: K.
      num_seqs: B (rows of the block table).
      max_len: tokens one sequence can hold (M = max_len / S table columns).
      num_tokens: T query tokens (ragged) / new tokens (write_kv).
      sliding_window, soft_cap: attention options.
      sinks: attention sinks (an ``f32[H]`` argument, gpt-oss).
      layers: L of an L-layer cache read with a traced ``layer=`` (0: a one-layer cache,
        called without ``layer=``).
      num_blocks: N.
    """

    op: str
    dtype: str = "bfloat16"
    head_dim: int = 128
    q_per_kv: int = 4
    block_size: int = 16
    kv_heads: int = 2
    num_seqs: int = 8
    max_len: int = 1024
    num_tokens: int = 64
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    layers: int = 2
    num_blocks: int = 512

    @property
    def name(self) -> str:
        parts = [self.op, self.dtype, f"k{self.kv_heads}", f"d{self.head_dim}"]
        parts.append(f"s{self.block_size}")
        if self.op in ("ragged_paged_attention", "paged_attention"):
            parts.append(f"g{self.q_per_kv}")
            parts.append(f"b{self.num_seqs}x{self.max_len}")
            if self.sliding_window:
                parts.append(f"win{self.sliding_window}")
            if self.soft_cap:
                parts.append(f"cap{self.soft_cap:g}")
            if self.sinks:
                parts.append("sinks")
        parts.append(f"L{self.layers}" if self.layers else "1layer")
        return "-".join(parts)


def _case_fn_and_args(case: KernelCase, device: jax.Device) -> tuple[Callable, tuple, tuple]:
    """``(fn, abstract args, donate_argnums)`` calling the public op with ``impl="auto"``."""
    import jax.numpy as jnp

    import kernels_pallas as kp

    i32 = jnp.int32
    dt = jnp.dtype(case.dtype)
    kh, d, s = case.kv_heads, case.head_dim, case.block_size
    # The cache value the public ops take; layers=0 is a one-layer cache read without layer=.
    shape = kp.kv_cache_shape(max(case.layers, 1), case.num_blocks, s, kh, d, dt)
    cache = jax.tree.map(lambda x: spec(x.shape, x.dtype, device), shape)
    m = -(-case.max_len // s)
    b = case.num_seqs
    layer = (spec((), i32, device),) if case.layers else ()  # the traced layer index
    opts = dict(sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    sinks = (spec((kh * case.q_per_kv,), jnp.float32, device),) if case.sinks else ()

    def lkw(rest: tuple) -> dict:
        """The trailing arguments, the traced layer and then the sinks, as keywords."""
        rest = list(rest)
        sink = {"sinks": rest.pop()} if sinks else {}
        return ({"layer": rest[0]} if rest else {}) | sink

    if case.op == "ragged_paged_attention":
        t = case.num_tokens
        args = (
            spec((t, kh * case.q_per_kv, d), dt, device), cache, spec((b,), i32, device),
            spec((b, m), i32, device), spec((b + 1,), i32, device), spec((), i32, device),
            *layer, *sinks,
        )  # fmt: skip

        def fn(q, c, lens, tables, cu, n, *rest):
            return kp.ragged_paged_attention(q, c, lens, tables, cu, n, **opts, **lkw(rest))

        return fn, args, ()
    if case.op == "paged_attention":
        args = (
            spec((b, kh * case.q_per_kv, d), dt, device), cache, spec((b,), i32, device),
            spec((b, m), i32, device), *layer, *sinks,
        )  # fmt: skip

        def fn(q, c, lens, tables, *rest):
            return kp.paged_attention(q, c, lens, tables, **opts, **lkw(rest))

        return fn, args, ()
    if case.op == "write_kv":
        t = case.num_tokens
        new = spec((t, kh, d), dt, device)
        args = (cache, new, new, spec((t,), i32, device), *layer)

        def fn(c, k, v, slots, *rest):
            return kp.write_kv(c, k, v, slots, **lkw(rest))

        return fn, args, (0,)
    if case.op == "copy_blocks":
        ids = spec((case.num_seqs,), i32, device)

        def fn(c, src, dst):
            return kp.copy_blocks(c, src, dst)

        return fn, (cache, ids, ids), (0,)
    raise ValueError(f"unknown kernel op {case.op!r}; expected one of {KERNEL_OPS}")


def compile_case(case: KernelCase, device: jax.Device) -> dict[str, Any]:
    """Compile one case through the public API (``impl="auto"``) for ``device``.

    Returns:
      ``{"name", "op", "compiled", "seconds", "mosaic", "impl", "error"}``: ``mosaic`` says
      whether the compiled program contains the Mosaic kernel (``tpu_custom_call``), ``impl``
      what the dispatch chose for the op.
    """
    from kernels_pallas import _dispatch

    out: dict[str, Any] = {"name": case.name, "op": case.op, "chip": device.device_kind}
    t0 = time.perf_counter()
    try:
        with tpu_target([device]):
            fn, args, donate = _case_fn_and_args(case, device)
            compiled = jax.jit(fn, donate_argnums=donate).trace(*args).lower().compile()
            out["impl"] = _dispatch.kernel_info("tpu").get(case.op)
        out.update(compiled=True, mosaic="tpu_custom_call" in compiled.as_text(), error=None)
    except Exception as e:  # noqa: BLE001 - reported per case, the grid goes on
        first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
        out.update(compiled=False, mosaic=False, error=f"{type(e).__name__}: {first}"[:400])
        out.setdefault("impl", None)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def kernel_grid(wide: bool = False) -> list[KernelCase]:
    """The compile grid: bf16 and f32; D 64/128/256; G 1..8; S 8..128; window and soft cap;
    stacked ``layer=``; block tables from 1 to 256 sequences x 32K tokens.

    ``wide=False`` is a covering subset (every value of every axis appears at least once,
    ~20 cases); ``wide=True`` crosses dtype x G x D for both attention ops (S cycling
    through 8..128, options alternating) and dtype x D x S for the KV ops.
    """
    big = dict(num_seqs=256, max_len=32768, num_blocks=4096)
    one = dict(num_seqs=1, max_len=32768, num_blocks=4096)
    if not wide:
        r, p, w, c = "ragged_paged_attention", "paged_attention", "write_kv", "copy_blocks"
        return [
            KernelCase(r, "bfloat16", 128, 1, 16, soft_cap=30.0),
            KernelCase(r, "bfloat16", 128, 3, 32, sliding_window=100),
            KernelCase(r, "bfloat16", 64, 5, 8, layers=0),
            KernelCase(r, "bfloat16", 128, 6, 16, sliding_window=64, soft_cap=50.0),
            KernelCase(r, "float32", 256, 7, 128),
            KernelCase(r, "float32", 128, 8, 64, layers=0),
            KernelCase(r, "bfloat16", 128, 4, 16, num_tokens=256, **big),
            KernelCase(r, "bfloat16", 128, 2, 16, num_tokens=16, **one),
            KernelCase(r, "bfloat16", 128, 1, 16, kv_heads=32, num_tokens=256),  # Llama-2-7B
            KernelCase(p, "bfloat16", 128, 4, 16, soft_cap=30.0),
            KernelCase(p, "float32", 64, 7, 8, sliding_window=50),
            KernelCase(p, "bfloat16", 256, 1, 128, layers=0),
            KernelCase(p, "bfloat16", 128, 8, 16, **big),
            # gpt-oss attention: 64 query heads on 8 kv heads, D 64, sinks, window 128
            KernelCase(r, "bfloat16", 64, 8, 16, kv_heads=8, sliding_window=128, sinks=True),
            KernelCase(p, "bfloat16", 64, 8, 16, kv_heads=8, sinks=True),
            KernelCase(w, "bfloat16", 128, block_size=16, num_tokens=256),
            KernelCase(w, "bfloat16", 64, block_size=8, layers=0),
            KernelCase(w, "float32", 256, block_size=128),
            KernelCase(c, "bfloat16", 128, block_size=16),
            KernelCase(c, "float32", 64, block_size=8, layers=0),
        ]
    sizes = (8, 16, 32, 64, 128)
    cases = []
    i = 0
    for op in ("ragged_paged_attention", "paged_attention"):
        for dtype in ("bfloat16", "float32"):
            for g in range(1, 9):
                for d in (64, 128, 256):
                    opts = [{}, {"sliding_window": 100}, {"soft_cap": 30.0},
                            {"sliding_window": 64, "soft_cap": 50.0}][i % 4]  # fmt: skip
                    cases.append(
                        KernelCase(
                            op, dtype, d, g, sizes[i % len(sizes)], layers=2 * (i % 2), **opts
                        )  # fmt: skip
                    )
                    i += 1
        for tables in (one, big):
            for s in (8, 16, 128):
                cases.append(KernelCase(op, "bfloat16", 128, 4, s, num_tokens=256, **tables))
        for kh, g, d in ((32, 1, 128), (16, 1, 256), (8, 8, 256)):  # wide heads: VMEM budget
            for dtype in ("bfloat16", "float32"):
                cases.append(KernelCase(op, dtype, d, g, 16, kv_heads=kh, num_tokens=256))
    for op in ("write_kv", "copy_blocks"):
        for dtype in ("bfloat16", "float32"):
            for d in (64, 128, 256):
                for s in sizes:
                    cases.append(KernelCase(op, dtype, d, block_size=s, layers=2 * (i % 2)))
                    i += 1
    return cases
