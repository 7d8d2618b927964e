"""kernels_pallas: Pallas kernels for paged KV caches (TPU Mosaic and GPU Mosaic), with oracles.

Depends on JAX only; never imports ``paxcache``. Supported JAX releases and every API
difference between them: :mod:`kernels_pallas.compat` (paxcache uses it too).

Public API (README "Kernels"; the package's place in the repository: ARCHITECTURE.md):
  ``paged_attention``, ``ragged_paged_attention`` (``kernels_pallas.attention``),
  ``write_kv``, ``copy_blocks``, ``swap_blocks`` (``kernels_pallas.kv_ops``),
  the pure-jnp oracles in ``kernels_pallas.reference``, and the padding rule in
  ``kernels_pallas.buckets``.

``impl`` values shared by every op (decided in one place, :mod:`kernels_pallas._dispatch`):
``"auto"`` (for the platform the program is lowered for: Mosaic TPU kernel on TPU, live or an
ahead-of-time topology target; Mosaic GPU kernel on CUDA/Hopper; XLA elsewhere),
``"reference"`` (the oracle / XLA path), ``"pallas"`` (the target's Pallas kernel; on CPU the
TPU kernel, which needs ``interpret=True``), ``"pallas_tpu"`` and ``"pallas_gpu"`` (force one
kernel family, e.g. in interpret mode on CPU).

``kernel_info()`` says which implementation each traced op got (and why, if it fell back),
``recording()`` collects it for the ops traced inside a block;
``compile_probes()`` makes TPU kernels that fail to compile fall back to XLA (warm-up);
:mod:`kernels_pallas.aot` compiles for a TPU topology on a host without a TPU.
"""

from kernels_pallas import reference
from kernels_pallas._dispatch import compile_probes, kernel_info, recording
from kernels_pallas.attention import paged_attention, ragged_paged_attention
from kernels_pallas.kv_ops import copy_blocks, swap_blocks, write_kv

__all__ = [
    "compile_probes",
    "copy_blocks",
    "kernel_info",
    "paged_attention",
    "ragged_paged_attention",
    "recording",
    "reference",
    "swap_blocks",
    "write_kv",
]
