"""The Mosaic GPU (Hopper) kernels lower for CUDA on any host, on every supported JAX.

``jax.export(jax.jit(f), platforms=["cuda"])`` runs the whole Mosaic GPU lowering (register
layouts, TMA descriptors, wgmma shapes, SMEM budget) without a GPU, short of ptxas; the module
text then holds the ``mosaic_gpu`` custom call. The fast subset covers every head_dim, several
G and block sizes, bf16 and f16, stacked ``layer=``, decode and ragged; ``-m slow`` runs the
whole grid (head_dim 64/128/256 x G 1..8 x block_size 8..128); those tests call the kernels
directly, as ``impl="pallas_gpu"`` does. With ``impl="auto"`` on Hopper decode exports with the
Mosaic GPU call and the ragged op with the Triton one (the Mosaic GPU ragged kernel failed its
oracle on an H200, ``kernels_pallas._dispatch.MOSAIC_GPU_RAGGED_REASON``); geometries the
Hopper decode kernel refuses export with the Triton kernel where it takes them (the Triton
kernel on other capabilities: ``tests/test_gpu_triton.py``).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas import aot, compat, kv_layout
from kernels_pallas.gpu import attention as ga
from kernels_pallas.gpu import triton_attention as ta

# The kernel's custom call in the exported module (the target is mosaic_gpu or mosaic_gpu_v2);
# a bare "mosaic_gpu" would also match debug locations named after functions.
MOSAIC_GPU = "custom_call @mosaic_gpu"


def _inputs(kind, *, g, d, s, dtype, kv_heads=2, layers=0, m=4):
    """Abstract inputs (export needs shapes only): decode ``[B, H, D]`` or ragged ``[T, H, D]``."""
    sds = jax.ShapeDtypeStruct
    pages = sds(kv_layout.page_shape(max(layers, 1), 16, s, kv_heads, d, dtype), dtype)
    b = 3
    tables = sds((b, m), jnp.int32)
    if kind == "decode":
        return (sds((b, kv_heads * g, d), dtype), pages, sds((b,), jnp.int32), tables)
    t = 24
    return (sds((t, kv_heads * g, d), dtype), pages, sds((b,), jnp.int32), tables,
            sds((b + 1,), jnp.int32), sds((), jnp.int32))  # fmt: skip


def _export_kernel(kind, *, g, d, s, dtype, stacked, extras):
    kw = dict(sm_scale=0.1, num_kv_heads=2)
    if extras:
        kw.update(soft_cap=20.0, sliding_window=30)
    args = _inputs(kind, g=g, d=d, s=s, dtype=dtype, layers=2 if stacked else 0)
    fn = ga.paged_attention_gpu if kind == "decode" else ga.ragged_paged_attention_gpu
    fn = functools.partial(fn, **kw)
    if stacked:
        fn = functools.partial(fn, layer=jnp.int32(1))
    return jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


# (kind, G, D, S, dtype, stacked, soft cap + sliding window)
FAST = [
    pytest.param("decode", 1, 64, 8, jnp.bfloat16, False, False, id="decode-g1-d64-s8"),
    pytest.param("decode", 4, 128, 16, jnp.bfloat16, True, False, id="decode-g4-d128-s16-layer"),
    pytest.param("decode", 8, 256, 128, jnp.bfloat16, True, True, id="decode-g8-d256-s128-layer"),
    pytest.param("ragged", 2, 128, 32, jnp.bfloat16, True, True, id="ragged-g2-d128-s32-layer"),
    pytest.param("ragged", 8, 256, 64, jnp.float16, False, True, id="ragged-g8-d256-s64-f16"),
]


@pytest.mark.parametrize("kind,g,d,s,dtype,stacked,extras", FAST)
def test_kernel_exports_for_cuda_with_the_mosaic_gpu_call(kind, g, d, s, dtype, stacked, extras):
    text = _export_kernel(kind, g=g, d=d, s=s, dtype=dtype, stacked=stacked, extras=extras)
    assert MOSAIC_GPU in text


WIDE = [
    pytest.param(kind, g, d, s, id=f"{kind}-g{g}-d{d}-s{s}")
    for kind, g, d, s in itertools.product(
        ("decode", "ragged"), (1, 2, 4, 8), (64, 128, 256), (8, 16, 32, 64, 128)
    )
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,g,d,s", WIDE)
def test_kernel_exports_for_cuda_wide_grid(kind, g, d, s):
    stacked = (g + s // 8) % 2 == 0
    text = _export_kernel(kind, g=g, d=d, s=s, dtype=jnp.bfloat16, stacked=stacked,
                          extras=not stacked)  # fmt: skip
    assert MOSAIC_GPU in text


# --------------------------------------------------------------------------------------------
# impl="auto" lowered for CUDA (the public API)
# --------------------------------------------------------------------------------------------

# (H, K, D, sliding window): mainstream Hopper models, bf16 pages, block_size 16.
TRITON = compat.TRITON_CALL_TARGET
MAINSTREAM = [
    pytest.param(32, 32, 128, None, id="llama2-7b"),
    pytest.param(64, 8, 128, None, id="llama2-70b"),
    pytest.param(32, 8, 128, None, id="llama3-8b"),
    pytest.param(32, 8, 128, 4096, id="mistral-7b-window"),
]
# (H, K, D, S, dtype): geometry the Hopper kernel does not take -> the Triton kernel where it
# takes it (g3, block24, float32), else the XLA path (head_dim 96 / 80).
OTHER = [
    pytest.param(32, 32, 96, 16, jnp.bfloat16, id="head_dim96"),
    pytest.param(40, 40, 80, 16, jnp.bfloat16, id="head_dim80"),
    pytest.param(24, 8, 128, 16, jnp.bfloat16, id="g3"),
    pytest.param(32, 8, 128, 24, jnp.bfloat16, id="block24"),
    pytest.param(32, 8, 128, 16, jnp.float32, id="float32"),
]


def _export_auto(kind, h, kv, d, s, dtype, window):
    """The public op on an abstract 2-layer cache (the value the engine passes), exported for
    Hopper."""
    q, _, *rest = _inputs(kind, g=h // kv, d=d, s=s, dtype=dtype, kv_heads=kv, layers=2)
    args = (q, kp.kv_cache_shape(2, 16, s, kv, d, dtype), *rest)
    op = kp.paged_attention if kind == "decode" else kp.ragged_paged_attention
    fn = functools.partial(op, impl="auto", sliding_window=window, layer=np.int32(1))
    with aot.cuda_target("9.0"):
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"], disabled_checks=compat.TRITON_EXPORT_CHECKS
        )
        return exported(*args).mlir_module()


@pytest.mark.parametrize("kind", ["decode", "ragged"])
@pytest.mark.parametrize("h,kv,d,window", MAINSTREAM)
def test_auto_exported_for_hopper_runs_mosaic_gpu_decode_and_triton_ragged_on_mainstream_shapes(
    kind, h, kv, d, window
):
    text = _export_auto(kind, h, kv, d, 16, jnp.bfloat16, window)
    mosaic = kind == "decode"
    assert (MOSAIC_GPU in text) == mosaic and (TRITON in text) != mosaic, kind


@pytest.mark.parametrize("kind", ["decode", "ragged"])
@pytest.mark.parametrize("h,kv,d,s,dtype", OTHER)
def test_auto_exported_for_hopper_runs_triton_or_xla_where_mosaic_gpu_refuses(
    kind, h, kv, d, s, dtype
):
    geometry = dict(head_dim=d, num_q_per_kv=h // kv, block_size=s, dtype=dtype)
    assert ga.unsupported_reason(**geometry)
    triton = ta.unsupported_reason(**geometry, capability="9.0") is None
    text = _export_auto(kind, h, kv, d, s, dtype, None)
    assert MOSAIC_GPU not in text
    assert (TRITON in text) == triton
