"""kernels_pallas: Pallas kernels for paged KV caches (TPU Mosaic and GPU Mosaic), with oracles.

Depends on JAX only; never imports ``paxcache``. Supported JAX releases and every API
difference between them: :mod:`kernels_pallas.compat` (paxcache uses it too).

Public API (see DESIGN.md):
  ``paged_attention``, ``ragged_paged_attention`` (``kernels_pallas.attention``),
  ``write_kv``, ``copy_blocks``, ``swap_blocks`` (``kernels_pallas.kv_ops``),
  and the pure-jnp oracles in ``kernels_pallas.reference``.

``impl`` values shared by every op: ``"auto"`` (Pallas TPU kernel on TPU, Pallas Mosaic GPU kernel
on GPU, XLA reference elsewhere), ``"reference"`` (the oracle / XLA path), ``"pallas"`` (the
backend's Pallas kernel; on CPU the TPU kernel, which needs ``interpret=True``),
``"pallas_tpu"`` and ``"pallas_gpu"`` (force one kernel family, e.g. in interpret mode on CPU).
"""

from kernels_pallas import reference
from kernels_pallas.attention import paged_attention, ragged_paged_attention
from kernels_pallas.kv_ops import copy_blocks, swap_blocks, write_kv

__all__ = [
    "copy_blocks",
    "paged_attention",
    "ragged_paged_attention",
    "reference",
    "swap_blocks",
    "write_kv",
]
