"""JAX version compatibility: the one module that knows how JAX's APIs differ across releases.

paxcache and kernels_pallas support **JAX 0.10.2 (oldest) to 0.12.1 (newest release tested)**,
with the matching jaxlib; ``pyproject.toml`` states the same range. Everywhere else the code
calls the helpers below and never compares versions itself, so supporting a new JAX release
means changing this file (and its tests, ``tests/test_compat.py``) only.

Differences covered, by the release that changed them:

* ``jax.sharding.SingleDeviceSharding`` is deprecated in 0.12.1 (build one with
  ``jax.sharding.make_single_device_sharding``, present on every supported version); its
  replacement for ``isinstance`` checks, ``jax.sharding.is_single_device_sharding``, is in
  0.12.1 but not 0.10.2: :func:`is_single_device_sharding`.
* Pallas TPU: ``pl.reciprocal`` is deprecated in 0.12.1 in favour of ``pltpu.reciprocal``
  (same keywords), which 0.10.2 does not have: :func:`tpu_reciprocal`.
* ``compute_on`` (host offload, used by the GPU swap path): up to 0.10 it is a context manager
  ``compute_on("device_host")``, and the function form is ``compute_on2``; from 0.11 the
  function form is ``compute_on(f, *, compute_type=..., out_memory_spaces=...)`` and the
  context manager is gone. :func:`compute_on_host` is the function form on every version.
* Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``):

  - 0.11 made ``LoweringSemantics.Warpgroup`` the default (0.10: ``Lane``); our Hopper kernel
    is written for lane semantics (explicit WGMMA register layouts), so
    :func:`mosaic_gpu_compiler_params` pins ``Lane``.
  - ``plgpu.load(ref, idx, *, layout)``: ``idx`` was required in 0.10, optional in 0.11 and
    removed in 0.12: :func:`mosaic_gpu_load`.
  - ``plgpu.transpose_ref(ref, perm)`` is deprecated from 0.11 in favour of
    ``ref.transpose(perm)``, which 0.10's Mosaic GPU lowering does not take:
    :func:`mosaic_gpu_transpose`.
  - ``InterpretGPUParams`` became public in 0.11 (private module in 0.10):
    :func:`mosaic_gpu_interpret_params`; the interpreter's race detector state:
    :func:`mosaic_gpu_races_found`.
  - ``pl.pallas_call`` with ``plgpu.CompilerParams`` has no lowering rule from 0.11; only
    ``plgpu.kernel`` launches Mosaic GPU kernels on every supported version (a fact, nothing
    to wrap: the GPU kernels here all use ``plgpu.kernel``).

* Pallas' Triton backend (``jax.experimental.pallas.triton``, the kernel for compute
  capability 8.0+ in :mod:`kernels_pallas.gpu.triton_attention`):

  - deprecated from 0.11 (Pallas changelog: "will be removed in a future version of JAX ...
    migrate to the Mosaic GPU backend ... or the official Triton bindings and jax_triton");
    0.12's lowering emits a ``DeprecationWarning`` (``jax-pallas-triton``) every time. No
    removal release is announced; :func:`triton_compiler_params` is the one place that
    builds its parameters, so a release without it makes the dispatch fall back to XLA.
  - 0.10 lowers with no GPU and no abstract device as compute capability 9.0; 0.12 reads
    the capability from the abstract mesh's device (``kernels_pallas.aot.cuda_target``) or
    the live GPU and refuses to lower with neither: :func:`triton_lowering_available`.
  - the Triton custom call (``__gpu$xla.gpu.triton``) has no compatibility guarantee, so
    ``jax.export`` refuses it unless told: :data:`TRITON_EXPORT_CHECKS`.

This module imports only ``jax``; the Mosaic GPU and Pallas TPU helpers import ``plgpu`` /
``pltpu`` when called, so importing it never fails on a JAX build without Mosaic GPU support.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax

__all__ = [
    "JAX_VERSION",
    "MIN_JAX",
    "NEWEST_TESTED_JAX",
    "compute_on_host",
    "is_single_device_sharding",
    "jax_version",
    "mosaic_gpu_compiler_params",
    "mosaic_gpu_interpret_params",
    "mosaic_gpu_load",
    "mosaic_gpu_races_found",
    "mosaic_gpu_reset_interpreter",
    "mosaic_gpu_transpose",
    "tpu_reciprocal",
    "TRITON_CALL_TARGET",
    "TRITON_EXPORT_CHECKS",
    "triton_compiler_params",
    "triton_lowering_available",
]


def jax_version(text: str | None = None) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``text`` (default: the installed ``jax.__version__``).

    Suffixes are ignored: ``"0.12.0.1"`` and ``"0.11.2.dev20260101"`` give ``(0, 12, 0)`` and
    ``(0, 11, 2)``.
    """
    nums = [int(x) for x in re.findall(r"\d+", text or jax.__version__)[:3]]
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


#: The installed JAX as ``(major, minor, patch)``.
JAX_VERSION = jax_version()
#: Oldest supported JAX release (pyproject.toml's lower bound).
MIN_JAX = (0, 10, 2)
#: Newest JAX release the whole test suite has passed on (CI's ``.ci/newest_jax.sh``).
NEWEST_TESTED_JAX = (0, 12, 1)


# --------------------------------------------------------------------------------------------
# Shardings
# --------------------------------------------------------------------------------------------


def is_single_device_sharding(sharding: Any) -> bool:
    """Whether ``sharding`` is the single-device kind that
    ``jax.sharding.make_single_device_sharding`` builds.

    ``jax.sharding.is_single_device_sharding`` where JAX has it (0.12.1; JAX says it will
    answer False once ``make_single_device_sharding`` returns a ``NamedSharding``), otherwise
    an ``isinstance`` check on 0.10's ``SingleDeviceSharding`` (deprecated in 0.12.1).
    """
    check = getattr(jax.sharding, "is_single_device_sharding", None)
    if check is not None:
        return bool(check(sharding))
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)


# --------------------------------------------------------------------------------------------
# Pallas TPU
# --------------------------------------------------------------------------------------------


def tpu_reciprocal(x: jax.Array, *, approx: bool = False, full_range: bool = True) -> jax.Array:
    """``1 / x`` inside a Pallas TPU kernel: ``pltpu.reciprocal`` (0.12.1), else ``pl.reciprocal``.

    Both take the same keywords: ``approx`` (the TPU's reciprocal estimate, unrefined) and
    ``full_range`` (False lets the compiler skip IEEE edge cases: wrong for inf, NaN, 0 and
    the reciprocal of the smallest normal).
    """
    from jax.experimental.pallas import tpu as pltpu

    fn = getattr(pltpu, "reciprocal", None)
    if fn is None:  # 0.10: only in jax.experimental.pallas
        from jax.experimental import pallas as pl

        fn = pl.reciprocal
    return fn(x, approx=approx, full_range=full_range)


# --------------------------------------------------------------------------------------------
# Host offload
# --------------------------------------------------------------------------------------------


def compute_on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run on the device's host CPU (``compute_type="device_host"``), outputs in host memory.

    The function form of ``jax.experimental.compute_on`` on every supported JAX: outputs are
    placed in ``jax.memory.Space.Host`` (``pinned_host``). Call the result inside a jitted
    program whose inputs to ``fn`` already live in host memory.
    """
    from jax.experimental import compute_on as mod

    host = jax.memory.Space.Host
    new_style = getattr(mod, "compute_on2", None) or mod.compute_on  # 0.10: compute_on2
    return new_style(jax.jit(fn), compute_type="device_host", out_memory_spaces=host)


# --------------------------------------------------------------------------------------------
# Mosaic GPU
# --------------------------------------------------------------------------------------------


def mosaic_gpu_compiler_params(**kwargs: Any) -> Any:
    """``plgpu.CompilerParams(**kwargs)`` with lane lowering semantics pinned.

    Lane semantics (each op's register layout given by the kernel) is what the kernels in
    :mod:`kernels_pallas.gpu` are written for; from JAX 0.11 the default is warpgroup
    semantics, whose layout inference rejects them.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    kwargs.setdefault("lowering_semantics", plgpu.LoweringSemantics.Lane)
    return plgpu.CompilerParams(**kwargs)


def mosaic_gpu_load(ref: Any, layout: Any) -> jax.Array:
    """The whole of ``ref`` (SMEM or GMEM) loaded into registers with ``layout``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if JAX_VERSION < (0, 11, 0):
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def mosaic_gpu_transpose(ref: Any, permutation: tuple[int, ...]) -> Any:
    """A transposed view of an SMEM ref (e.g. the K stage as the B operand of ``wgmma``)."""
    if JAX_VERSION < (0, 11, 0):
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return plgpu.transpose_ref(ref, permutation)
    return ref.transpose(permutation)


def mosaic_gpu_interpret_params(**kwargs: Any) -> Any:
    """``InterpretGPUParams(**kwargs)``: Mosaic GPU interpret mode (runs kernels on the CPU).

    ``detect_races=True`` turns on the interpreter's shared-memory race detector (read the
    verdict with :func:`mosaic_gpu_races_found`).
    """
    try:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
    except ImportError:  # JAX 0.10: private module only
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(**kwargs)


def mosaic_gpu_races_found() -> bool:
    """Whether the Mosaic GPU interpreter's race detector flagged a race since the last reset.

    From JAX 0.11 a detected race also raises inside the kernel (``RuntimeError: RACE
    DETECTED``); after that, call :func:`mosaic_gpu_reset_interpreter`.
    """
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp

    try:
        return bool(interp.get_races().races_found)
    except AssertionError:  # no kernel interpreted with the detector yet
        return False


def mosaic_gpu_reset_interpreter() -> None:
    """Reset the Mosaic GPU interpreter's global state (needed after a kernel raised)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp

    reset = getattr(interp, "reset_gpu_interpret_mode_state", None)
    if reset is not None:
        reset()


# --------------------------------------------------------------------------------------------
# Pallas Triton
# --------------------------------------------------------------------------------------------

#: The custom call a Pallas Triton kernel lowers to (XLA compiles its Triton IR for the GPU).
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"
#: ``jax.export``'s ``disabled_checks`` for a program holding Pallas Triton kernels (Triton IR
#: has no serialization compatibility guarantee, so export refuses the call by default).
TRITON_EXPORT_CHECKS = (jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL_TARGET),)


def triton_compiler_params(*, num_warps: int, num_stages: int) -> Any:
    """``jax.experimental.pallas.triton.CompilerParams``: selects the Triton lowering of a
    ``pl.pallas_call`` on CUDA.

    Raises:
      ImportError: a JAX without Pallas' Triton backend.
    """
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def triton_lowering_available() -> str | None:
    """Why a Pallas Triton kernel cannot be lowered for CUDA now (None: it can).

    0.10 lowers without a GPU (assuming compute capability 9.0, which only matters for its
    float8 conversions). From 0.12 the lowering takes the capability from the abstract mesh's
    device or the live GPU and raises with neither, or for a device kind it does not know.
    """
    try:
        from jax.experimental.pallas import triton as _  # noqa: F401
    except ImportError as e:
        return f"this JAX has no Pallas Triton backend ({e})"
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:  # 0.10: no device needed
        return None
    try:
        gpu_info.get_gpu_info()
    except Exception as e:  # noqa: BLE001 - ValueError / RuntimeError: no known GPU
        return (
            f"the Pallas Triton lowering of JAX {jax.__version__} needs a GPU or a known "
            f"abstract one (kernels_pallas.aot.cuda_target): {e}"
        )
    return None
