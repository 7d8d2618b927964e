"""kernels_pallas: Pallas kernels for paged KV caches (TPU Mosaic and GPU Mosaic), with oracles.

Depends on JAX only; never imports ``paxcache``. Supported JAX releases and every API
difference between them: :mod:`kernels_pallas.compat` (paxcache uses it too).

Public API (README "Kernels"; the package's place in the repository: ARCHITECTURE.md):
  the cache value ``PagedKVCache`` and ``init_kv_cache``, its sizes and 8-bit scales
  (``kernels_pallas.cache``); ``write_kv``, ``read_kv``, ``copy_blocks``, ``swap_blocks``
  on a cache (``kernels_pallas.cache``, over the array-level ``kernels_pallas.kv_ops``);
  ``paged_attention``, ``ragged_paged_attention`` on a cache (``kernels_pallas.attention``),
  the pure-jnp oracles in ``kernels_pallas.reference``, and the padding rule in
  ``kernels_pallas.buckets``.

``impl`` values shared by every op (decided in one place, :mod:`kernels_pallas._dispatch`):
``"auto"`` (for the platform the program is lowered for: Mosaic TPU kernel on TPU, live or an
ahead-of-time topology target; Mosaic GPU kernel on CUDA/Hopper, the Pallas Triton kernel on
other CUDA compute capabilities from 8.0; XLA elsewhere), ``"reference"`` (the oracle / XLA
path), ``"pallas"`` (the target's Pallas kernel; on CPU the TPU kernel, which needs
``interpret=True``), ``"pallas_tpu"``, ``"pallas_gpu"`` and ``"pallas_triton"`` (force one
kernel family, e.g. in interpret mode on CPU).

``kernel_info()`` says which implementation each traced op got (and why, if it fell back),
``recording()`` collects it for the ops traced inside a block;
``compile_probes()`` makes TPU kernels that fail to compile fall back to XLA (warm-up);
:mod:`kernels_pallas.aot` compiles for a TPU topology on a host without a TPU.
"""

from kernels_pallas import reference
from kernels_pallas._dispatch import compile_probes, kernel_info, recording
from kernels_pallas.attention import paged_attention, ragged_paged_attention
from kernels_pallas.cache import (
    KV_CACHE_DTYPES,
    PagedKVCache,
    copy_blocks,
    dequantize,
    init_kv_cache,
    kv_cache_bytes_per_block,
    kv_cache_shape,
    kv_cache_specs,
    kv_cache_vmem_bytes,
    quantize,
    read_kv,
    set_kv_scales,
    stored_head_dim,
    swap_blocks,
    swap_operands,
    swap_program,
    write_kv,
)

__all__ = [
    "KV_CACHE_DTYPES",
    "PagedKVCache",
    "compile_probes",
    "copy_blocks",
    "dequantize",
    "init_kv_cache",
    "kernel_info",
    "kv_cache_bytes_per_block",
    "kv_cache_shape",
    "kv_cache_specs",
    "kv_cache_vmem_bytes",
    "paged_attention",
    "quantize",
    "ragged_paged_attention",
    "read_kv",
    "recording",
    "reference",
    "set_kv_scales",
    "stored_head_dim",
    "swap_blocks",
    "swap_operands",
    "swap_program",
    "write_kv",
]
