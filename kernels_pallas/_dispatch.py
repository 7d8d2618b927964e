"""Which implementation runs each kernel op: one place for attention and KV movement.

``impl`` (every public op takes it):

* ``"auto"``: decided for the platform the program is **lowered for**, not the process's
  default backend. The op is staged out with :func:`jax.lax.platform_dependent`, whose
  branches are pruned per lowering platform: the ``tpu`` branch is the Mosaic TPU kernel, the
  ``cuda`` branch a Pallas GPU kernel (Mosaic GPU or Triton, by compute capability, below),
  every other platform the XLA path. So a program compiled ahead of time for a TPU topology
  from a CPU host (``jax.default_device(topology.devices[0])``, see :mod:`kernels_pallas.aot`)
  gets the same kernels as one traced on a live TPU, and ``jax.export(...,
  platforms=["cuda"])`` gets the GPU kernel.
* ``"reference"``: the XLA path everywhere.
* ``"pallas"``: the Pallas kernel of the target platform (on a CUDA target the Mosaic GPU
  kernel on 9.x, but the Triton one for the ragged op, :data:`MOSAIC_GPU_RAGGED_REASON`, and
  the Triton kernel on other capabilities; else TPU); ``"pallas_tpu"`` /
  ``"pallas_gpu"`` (Mosaic GPU) / ``"pallas_triton"``: force one family. Off its platform a
  forced kernel needs ``interpret=True`` (the CPU tests).

GPU rules (``auto``), per attention op, for the targeted compute capability:

* **9.x (Hopper)**: ``paged_attention`` (decode) runs the Mosaic GPU kernel
  (``"pallas_gpu"``); a geometry it refuses (``kernels_pallas.gpu.attention.unsupported_reason``:
  head_dim not a multiple of 64, G not dividing 64, f32 or 8-bit pages, sinks, ...) runs the
  Triton kernel instead where that one takes it. ``ragged_paged_attention`` runs the Triton
  kernel for every geometry it takes (:data:`MOSAIC_GPU_RAGGED_REASON`: the Mosaic GPU ragged
  kernel failed its oracle on an H200; ``impl="pallas_gpu"`` still forces it).
* **every other capability >= 8.0** (8.0 A100, 8.6, 8.9 L4, 10.0 B200, 12.x): the Triton
  kernel (``"pallas_triton"``, :mod:`kernels_pallas.gpu.triton_attention`) for every G from 1
  to 64, head_dim a power of two from 16 to 256, float and 8-bit pages (float8 from 8.9),
  sinks, soft cap, sliding window.
* **below 8.0**, or a geometry neither kernel takes, or a JAX whose Triton lowering cannot
  run here (:func:`kernels_pallas.compat.triton_lowering_available`): the XLA path, recorded as
  ``"xla (fallback: <why>)"`` with ONE warning per op and reason.

The capability is, in order: the one :func:`kernels_pallas.aot.cuda_target` sets
(``cuda_target("8.0")``: lowering or exporting for CUDA from any host assumes it, several
targets in one process, nothing cached across them), the live GPU's, else Hopper (a CUDA
export with neither). The XLA path on CUDA is the op's GPU form where it has one
(``run(gpu_xla=)``: attention in 64 MiB chunks with 16-bit operands,
``reference.XLA_GPU_CHUNK_BYTES``), not the CPU-sized one. Inside :func:`compile_probes` each
GPU kernel call (either family) is first built on its own (compiled on a live GPU, exported
for CUDA otherwise); a kernel that fails runs the XLA path, with ONE warning naming the op
and the error. A program holding the Triton kernel exports only with
``disabled_checks=kernels_pallas.compat.TRITON_EXPORT_CHECKS`` (Triton IR has no
serialization guarantee).

TPU rules (``auto``): a geometry the TPU kernel does not take runs the XLA path (one warning).
Inside :func:`compile_probes` (``Engine.warmup`` and ``scripts/compile_check.py`` use it)
each TPU kernel call is first compiled on its own for the TPU target with the same shapes;
if Mosaic rejects it, that op runs the XLA path instead and ONE warning names the op and the
compiler error, so a kernel that cannot compile never takes the server down.

What was chosen is recorded per platform and op: :func:`kernel_info` (``Engine.stats()
["kernel_impls"]``, the ``paxcache_kernel_info`` gauge of the server).

Target platform at trace time: the abstract mesh's device kind when one is set
(``jax.sharding.use_mesh``), else the default device (``jax_default_device``, which may be an
abstract TPU device from :func:`jax.experimental.topologies.get_topology_desc`), else the
default backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import make_single_device_sharding

__all__ = [
    "FAMILIES",
    "HOPPER",
    "MOSAIC_GPU_RAGGED_REASON",
    "compile_probes",
    "cuda_capability",
    "cuda_capability_reason",
    "forced_family",
    "gpu_attention_unsupported_reason",
    "kernel_info",
    "record",
    "recording",
    "run",
    "run_forced_check",
    "target_device",
    "triton_attention_unsupported_reason",
    "target_platform",
    "targeting_cuda",
]

logger = logging.getLogger("kernels_pallas")

FAMILIES = ("xla", "pallas_tpu", "pallas_gpu", "pallas_triton")

MOSAIC_GPU_RAGGED_REASON = (
    "the Mosaic GPU ragged kernel gave wrong outputs on an H200 (G = 1 and 4, relative error "
    "0.6-1.5 against the oracle; scripts/gpu_check.py, 2026-12-04): impl='auto' does not pick "
    "it until that is fixed (impl='pallas_gpu' still runs it)"
)
"""Why ``ragged_paged_attention``'s ``auto`` skips the Mosaic GPU kernel on Hopper (the
Triton kernel, checked on the same H200, runs instead). Its decode kernel passed there."""
_PLATFORMS = ("tpu", "cuda", "cpu")

_lock = threading.Lock()
_INFO: dict[tuple[str, str], str] = {}  # (platform, op) -> "pallas_tpu" | "xla (fallback: ..)"
_WARNED: set[tuple[str, str]] = set()
_PROBED: dict[tuple, str | None] = {}  # kernel signature -> compile error (None: compiled)
_PROBE_DEPTH = [0]


# --------------------------------------------------------------------------------------------
# Target platform
# --------------------------------------------------------------------------------------------


def _normalize(platform: str) -> str:
    if platform == "gpu":
        try:
            version = jax.devices("gpu")[0].client.platform_version.lower()
        except RuntimeError:
            return "cuda"
        return "rocm" if "rocm" in version else "cuda"
    return platform


def target_device() -> jax.Device | None:
    """The device programs traced now are meant for (None when only a platform is known)."""
    dev = jax.config.jax_default_device
    if isinstance(dev, jax.Device):
        return dev
    if dev is None:
        return jax.devices()[0]
    return None


def target_platform() -> str:
    """``"tpu"``, ``"cuda"``, ``"rocm"`` or ``"cpu"``: what traced programs are meant for."""
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None) if not getattr(mesh, "empty", True) else None
    if device is not None and getattr(device, "platform", None):
        return _normalize(device.platform)
    dev = jax.config.jax_default_device
    if isinstance(dev, str):
        return _normalize(dev)
    if isinstance(dev, jax.Device):
        return _normalize(dev.platform)
    return _normalize(jax.default_backend())


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


_RECORDERS: list[dict[str, dict[str, str]]] = []


def _record(op: str, per_platform: dict[str, str]) -> None:
    with _lock:
        for platform, impl in per_platform.items():
            _INFO[(platform, op)] = impl
            if platform == "cuda":  # also per capability: a cached trace re-records nothing
                _INFO[(_cuda_key(cuda_capability()), op)] = impl
            for rec in _RECORDERS:
                rec.setdefault(platform, {})[op] = impl


def _cuda_key(capability: str) -> str:
    return f"cuda@{capability}"


@contextlib.contextmanager
def recording() -> Iterator[dict[str, dict[str, str]]]:
    """Collects ``{platform: {op: impl}}`` for the ops traced inside the block."""
    rec: dict[str, dict[str, str]] = {}
    with _lock:
        _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        with _lock:
            _RECORDERS.remove(rec)


def kernel_info(platform: str | None = None) -> dict[str, str]:
    """The implementation each traced op got for ``platform`` (default: the target platform).

    Values are ``"pallas_tpu"``, ``"pallas_gpu"``, ``"pallas_triton"``, ``"xla"`` or
    ``"xla (fallback: <why the kernel was not used>)"``; ops not traced yet are absent. The
    record is process-wide: the last trace of an op decides its entry (for ``"cuda"``, the
    last trace for the compute capability targeted now, :func:`cuda_capability`).
    """
    platform = _normalize(platform) if platform else target_platform()
    key = platform if platform in _PLATFORMS else "cpu"
    with _lock:
        out = {op: impl for (p, op), impl in sorted(_INFO.items()) if p == key}
        if key == "cuda":  # the choices for the capability targeted now (aot.cuda_target)
            here = _cuda_key(cuda_capability())
            out.update({op: impl for (p, op), impl in sorted(_INFO.items()) if p == here})
        return out


def _warn_once(op: str, reason: str) -> None:
    with _lock:
        if (op, reason) in _WARNED:
            return
        _WARNED.add((op, reason))
    logger.warning("%s: using the XLA path: %s", op, reason)


def _fallback(reason: str) -> str:
    return f"xla (fallback: {reason})"


# --------------------------------------------------------------------------------------------
# TPU compile probes
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def compile_probes() -> Iterator[None]:
    """While active, every ``impl="auto"`` TPU or GPU kernel call is compiled on its own first.

    TPU: when the target is a TPU device (live, or abstract from a topology). GPU (Mosaic GPU
    or Triton): when the target platform is CUDA (a live GPU: compiled;
    :func:`kernels_pallas.aot.cuda_target` with no GPU: exported, which runs the kernel's
    lowering). A kernel that fails is
    replaced by the XLA path (one warning naming the op and the error). Results are cached
    per kernel signature, so each distinct call is built once per process.
    """
    _PROBE_DEPTH[0] += 1
    try:
        yield
    finally:
        _PROBE_DEPTH[0] -= 1


def _abstract(x: Any, device: jax.Device) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        jnp.shape(x), jnp.result_type(x), sharding=make_single_device_sharding(device)
    )


# HBM exhaustion of the probe program (operands alone); VMEM/SMEM exhaustion is the kernel's.
_MEMORY_ERRORS = ("Ran out of memory on HBM", "exceeds available HBM")


def _probe_tpu(
    op: str, fn: Callable, args: Sequence[Any], static_key: Any, donate: tuple[int, ...]
) -> str | None:
    """Compile ``fn(*args)`` alone for the target TPU device; the error text, or None.

    ``donate``: the arguments the op updates in place (donated, as in the real program, so
    the probe needs no second copy of a page array). An HBM out-of-memory verdict says
    nothing about the kernel (the probe holds its operands alone, the real program shares
    them), so it does not count as a failure; running out of VMEM or SMEM does.
    """
    device = target_device()
    if device is None or device.platform != "tpu":
        return None
    sig = tuple((tuple(jnp.shape(a)), str(jnp.result_type(a))) for a in args)
    key = (op, device.device_kind, sig, static_key)
    with _lock:
        if key in _PROBED:
            return _PROBED[key]
    try:
        specs = [_abstract(a, device) for a in args]
        with jax.default_device(device):
            jax.jit(fn, donate_argnums=donate).trace(*specs).lower().compile()
        error = None
    except Exception as e:  # noqa: BLE001 - any compiler rejection means "do not use it"
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        error = f"{type(e).__name__}: {first}"[:500]
        if any(m in str(e) for m in _MEMORY_ERRORS):
            logger.info("%s: compile probe out of memory alone (%s); kernel kept", op, first)
            error = None
    with _lock:
        _PROBED[key] = error
    return error


def _first_line(e: BaseException) -> str:
    first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    return f"{type(e).__name__}: {first}"[:500]


def _probe_gpu(
    op: str, fn: Callable, args: Sequence[Any], static_key: Any, family: str = "pallas_gpu"
) -> str | None:
    """Build ``fn(*args)`` alone for the CUDA target; the error text, or None.

    On a live GPU the kernel is compiled for it (Mosaic GPU or Triton, and ptxas); with no GPU
    it is exported for CUDA (the kernel's lowering, for :func:`cuda_capability`). Cached per
    kernel family, signature and capability.
    """
    from kernels_pallas import compat

    capability = cuda_capability()
    sig = tuple((tuple(jnp.shape(a)), str(jnp.result_type(a))) for a in args)
    key = ("cuda", family, op, capability, sig, static_key)
    with _lock:
        if key in _PROBED:
            return _PROBED[key]
    device = target_device()
    try:
        if device is not None and device.platform == "gpu":
            specs = [_abstract(a, device) for a in args]
            jax.jit(fn).trace(*specs).lower().compile()
        else:
            specs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args]
            jax.export.export(
                jax.jit(fn), platforms=["cuda"], disabled_checks=compat.TRITON_EXPORT_CHECKS
            )(*specs)
        error = None
    except Exception as e:  # noqa: BLE001 - any compiler rejection means "do not use it"
        error = _first_line(e)
    with _lock:
        _PROBED[key] = error
    return error


# --------------------------------------------------------------------------------------------
# GPU kernel availability
# --------------------------------------------------------------------------------------------


def _gpu_attention_module() -> Any:
    return importlib.import_module("kernels_pallas.gpu.attention")


def gpu_attention_unsupported_reason(
    *, head_dim: int, num_q_per_kv: int, block_size: int, dtype: Any
) -> str | None:
    """Why the compiled Mosaic GPU attention kernel cannot take a geometry (None if it can):
    ``kernels_pallas.gpu.attention.unsupported_reason``, the kernel's own statement."""
    try:
        mod = _gpu_attention_module()
    except ImportError as e:
        return f"kernels_pallas.gpu.attention is not importable ({e})"
    return mod.unsupported_reason(
        head_dim=head_dim, num_q_per_kv=num_q_per_kv, block_size=block_size, dtype=dtype
    )


def triton_attention_unsupported_reason(
    *, head_dim: int, num_q_per_kv: int, block_size: int, dtype: Any, capability: str
) -> str | None:
    """Why the Triton attention kernel cannot take a geometry on ``capability`` (None if it
    can): ``kernels_pallas.gpu.triton_attention.unsupported_reason``, the kernel's own
    statement."""
    try:
        mod = importlib.import_module("kernels_pallas.gpu.triton_attention")
    except ImportError as e:
        return f"kernels_pallas.gpu.triton_attention is not importable ({e})"
    return mod.unsupported_reason(
        head_dim=head_dim, num_q_per_kv=num_q_per_kv, block_size=block_size, dtype=dtype,
        capability=capability,
    )  # fmt: skip


HOPPER = "9.0"
"""The compute capability a CUDA lowering assumes with no target set and no GPU present."""

# Set by kernels_pallas.aot.cuda_target (per thread / task, like JAX's mesh contexts).
_CUDA_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kernels_pallas_cuda_target", default=None
)


@contextlib.contextmanager
def targeting_cuda(capability: str) -> Iterator[None]:
    """While active, CUDA lowerings assume compute capability ``capability`` ("8.0", ...);
    :func:`kernels_pallas.aot.cuda_target` is the public way in (it also sets the abstract
    mesh Mosaic GPU reads its architecture from)."""
    token = _CUDA_TARGET.set(str(capability))
    try:
        yield
    finally:
        _CUDA_TARGET.reset(token)


@functools.lru_cache(maxsize=1)
def _live_capability() -> str | None:
    """The first live GPU's compute capability (None: no GPU in this process)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    return str(getattr(devices[0], "compute_capability", "")) or "unknown"


def cuda_capability() -> str:
    """The compute capability CUDA programs traced now are for: :func:`targeting_cuda`'s, the
    live GPU's, else :data:`HOPPER`."""
    return _CUDA_TARGET.get() or _live_capability() or HOPPER


def cuda_capability_reason(capability: str) -> str | None:
    """Why the Mosaic GPU kernels do not run on ``capability`` (None: they do, 9.x; other
    generations from 8.0 run the Triton kernel, see the module docstring)."""
    if capability.startswith("9."):
        return None
    return f"compute capability {capability}: the Mosaic GPU kernels need Hopper (9.x)"


def _is_hopper(capability: str) -> bool:
    return capability.startswith("9.")


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def run_forced_check(op: str, family: str, interpret: bool) -> None:
    """A forced TPU kernel needs a TPU target, a forced Triton kernel a CUDA target, or either
    ``interpret=True``.

    Raises:
      ValueError: otherwise.
    """
    platform = target_platform()
    if family == "pallas_tpu" and platform != "tpu" and not interpret:
        raise ValueError(
            f"{op}: the Mosaic TPU kernel needs a TPU target (a TPU backend or TPU default "
            f"device) or interpret=True (target is {platform!r})"
        )
    if family == "pallas_triton" and platform != "cuda" and not interpret:
        raise ValueError(
            f"{op}: the Triton GPU kernel needs a CUDA target (a GPU, or "
            f"kernels_pallas.aot.cuda_target) or interpret=True (target is {platform!r})"
        )


def record_each(op: str, per_platform: dict[str, str]) -> None:
    """Record ``op``'s implementation per platform (an op run inside another's kernels)."""
    _record(op, per_platform)


def record(op: str, impl: str) -> None:
    """Record ``impl`` for ``op`` on every platform (forced or platform-independent ops)."""
    _record(op, dict.fromkeys(_PLATFORMS, impl))


def forced_family(impl: str, has_gpu: bool, has_triton: bool = False) -> str:
    """The family a forced ``impl`` (not ``"auto"`` / ``"reference"``) selects for the target.

    ``"pallas"`` is the target's kernel: on CUDA the Mosaic GPU kernel for 9.x and the Triton
    kernel for other capabilities, on ROCm the Mosaic GPU one, else TPU. An op without that
    GPU kernel (``has_gpu`` / ``has_triton`` False: the KV ops, where XLA's in-place scatter
    is what a GPU wants, see :mod:`kernels_pallas.kv_ops`) runs ``"xla"`` instead, so a
    model forced onto the GPU kernels still runs. A ``"pallas_tpu"`` or ``"pallas_triton"``
    result still needs :func:`run_forced_check`.
    """
    platform = target_platform()
    if impl == "pallas" and platform == "cuda" and not _is_hopper(cuda_capability()):
        family = "pallas_triton"
    elif impl == "pallas":
        family = "pallas_gpu" if platform in ("cuda", "rocm") else "pallas_tpu"
    else:
        family = impl
    if (family == "pallas_gpu" and not has_gpu) or (family == "pallas_triton" and not has_triton):
        return "xla"
    return family


def run(
    op: str,
    impl: str,
    interpret: bool,
    args: Sequence[Any],
    *,
    xla: Callable[..., Any],
    tpu: Callable[..., Any] | None,
    gpu: Callable[..., Any] | None,
    gpu_xla: Callable[..., Any] | None = None,
    tpu_reason: str | None = None,
    gpu_reason: str | None = None,
    triton: Callable[..., Any] | None = None,
    triton_reason: str | None = None,
    gpu_default: bool = True,
    gpu_auto_reason: str | None = None,
    static_key: Any = None,
    donate: tuple[int, ...] = (),
) -> Any:
    """Run ``op`` on ``args`` (arrays only) with the implementation ``impl`` selects.

    Args:
      op: the op's public name (registry key, warning text).
      impl: ``"auto" | "reference" | "pallas" | "pallas_tpu" | "pallas_gpu" |
        "pallas_triton"`` (checked by the caller).
      interpret: forced kernels run in interpret mode (the callables already carry it).
      args: the array arguments every implementation takes.
      xla, tpu, gpu, triton: the implementations (``None``: no such kernel); ``gpu`` is the
        Mosaic GPU kernel, ``triton`` the Pallas Triton one (compute capability 8.0+).
      gpu_xla: the XLA path ``auto`` runs on CUDA when the GPU kernel does not (default
        ``xla``): tuned for a GPU rather than a CPU.
      tpu_reason, gpu_reason, triton_reason: why the TPU / Mosaic GPU / Triton kernel cannot
        take these arguments (``triton_reason`` for the targeted capability).
      gpu_default: whether ``auto`` uses a GPU kernel (when one exists and takes them).
      gpu_auto_reason: why ``auto`` does not pick the Mosaic GPU kernel even where it takes
        the arguments (Triton, else XLA, runs instead; ``"pallas"`` takes Triton's too);
        forcing ``"pallas_gpu"`` still runs it.
      static_key: hashable summary of the static options baked into ``tpu`` (probe cache).
      donate: indices of ``args`` the op updates in place (donated in the compile probe).

    Raises:
      ValueError: a forced TPU kernel on a non-TPU target without ``interpret``, or a forced
        kernel that cannot take the arguments.
    """
    if impl == "reference":
        record(op, "xla")
        return xla(*args)
    if impl != "auto":
        family = forced_family(impl, gpu is not None, triton is not None)
        if impl == "pallas" and family == "pallas_gpu" and gpu_auto_reason and triton is not None:
            family = "pallas_triton"  # "the target's kernel": the one auto trusts here
        run_forced_check(op, family, interpret)
        if family == "xla":
            record(op, "xla")
            return xla(*args)
        fn, reason = {
            "pallas_tpu": (tpu, tpu_reason),
            "pallas_gpu": (gpu, gpu_reason),
            "pallas_triton": (triton, triton_reason),
        }[family]
        if reason is not None and not interpret:
            raise ValueError(f"{op}: impl={impl!r} cannot run these arguments: {reason}")
        record(op, family)
        return fn(*args)

    # auto: one branch per platform, pruned at lowering. Fallback warnings are logged for the
    # target platform only (a CPU run need not hear why the GPU kernel would not be used).
    platform = target_platform()
    if tpu is None:
        tpu_fn, tpu_impl = xla, "xla"
    elif tpu_reason is not None:
        if platform == "tpu":
            _warn_once(op, f"the Mosaic TPU kernel cannot take these arguments: {tpu_reason}")
        tpu_fn, tpu_impl = xla, _fallback(tpu_reason)
    else:
        tpu_fn, tpu_impl = tpu, "pallas_tpu"
        if _PROBE_DEPTH[0]:
            error = _probe_tpu(op, tpu, args, static_key, donate)
            if error is not None:
                _warn_once(op, f"the Mosaic TPU kernel failed to compile: {error}")
                tpu_fn, tpu_impl = xla, _fallback(f"Mosaic compile error: {error}")
    gpu_fn, gpu_impl = _cuda_choice(
        op, platform, args, static_key, gpu_xla or xla, gpu if gpu_default else None,
        gpu_reason, triton if gpu_default else None, triton_reason, gpu_auto_reason,
    )  # fmt: skip
    _record(op, {"tpu": tpu_impl, "cuda": gpu_impl, "cpu": "xla"})
    if tpu_fn is xla and gpu_fn is xla:
        return xla(*args)
    return jax.lax.platform_dependent(*args, tpu=tpu_fn, cuda=gpu_fn, default=xla)


def _cuda_choice(
    op: str,
    platform: str,
    args: Sequence[Any],
    static_key: Any,
    cuda_xla: Callable[..., Any],
    gpu: Callable[..., Any] | None,
    gpu_reason: str | None,
    triton: Callable[..., Any] | None,
    triton_reason: str | None,
    gpu_auto_reason: str | None = None,
) -> tuple[Callable[..., Any], str]:
    """The ``cuda`` branch of ``auto`` and its registry entry (module docstring's GPU rules).

    ``gpu_auto_reason`` (:func:`run`) keeps ``gpu`` out where neither ``gpu_reason`` nor the
    capability does (a fallback names those first).

    Warnings (one per op and reason) only when CUDA is the target platform.
    """
    from kernels_pallas import compat

    if gpu is None and triton is None:
        return cuda_xla, "xla"
    capability = cuda_capability()
    reasons = []
    candidates = []
    if gpu is not None:
        mosaic = gpu_reason or cuda_capability_reason(capability) or gpu_auto_reason
        if mosaic is None:
            candidates.append(("pallas_gpu", gpu, "Mosaic GPU"))
        elif _is_hopper(capability) or triton is None:  # else Triton's reason says it all
            reasons.append(mosaic)
    if triton is not None:
        why = triton_reason or compat.triton_lowering_available()
        if why is None:
            candidates.append(("pallas_triton", triton, "Triton"))
        else:
            reasons.append(f"Triton kernel: {why}" if reasons else why)
    if not candidates:
        reason = "; ".join(reasons) or f"compute capability {capability}: no GPU kernel"
        if platform == "cuda":
            _warn_once(op, f"no Pallas GPU kernel can run here: {reason}")
        return cuda_xla, _fallback(reason)
    family, fn, name = candidates[0]
    if _PROBE_DEPTH[0] and platform == "cuda":
        error = _probe_gpu(op, fn, args, static_key, family)
        if error is not None:
            _warn_once(op, f"the {name} kernel failed to compile: {error}")
            return cuda_xla, _fallback(f"{name} compile error: {error}")
    return fn, family
