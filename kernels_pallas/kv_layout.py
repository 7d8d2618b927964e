"""The KV page layout: token-major pages, K and V of every kv head of a token side by side.

One array holds the K and V pages of every layer::

    kv_pages [L, N, S, C, P, Dp]

L layers, N blocks, S tokens per block (a slot is ``block * S + offset``), ``C * P`` combined
heads packed ``P`` to a 32-bit word, ``Dp`` stored head dim (:func:`kernels_pallas.cache.
stored_head_dim`). Combined head ``2 * h`` is kv head ``h``'s K and ``2 * h + 1`` its V;
combined head ``c`` sits at ``[..., c // P, c % P, :]``. ``P`` is the dtype's packing (32 bits
over its width: float32 1, bfloat16/float16 2, int8/float8 4), so for bfloat16 one ``[.., h, :,
:]`` row is a word per lane holding K (low half) and V (high half) of head ``h``. When
``2 * K`` is not a multiple of ``P`` (8-bit, odd ``K``) one dummy head (zeros, never read)
pads the last row: ``C = ceil(2 * K / P)``.

Why: a page of one layer (``kv_pages[l, n]``, ``S * C * P * Dp`` elements) is contiguous, so
the attention kernels move it with one DMA, and a token's K/V (``kv_pages[l, n, s]``) is one
contiguous, aligned row group, so a write moves exactly its bytes (tpu-inference's RPA v3
keeps the same per-layer page layout). Layers are stacked in front so a model can scan them
with the cache in the carry and a block moves in every layer with one gather/scatter or DMA.

This module is the layout's only definition: shapes, where a head sits, and the pure-jnp
merge / split every XLA path and test uses. Nothing outside :mod:`kernels_pallas` indexes
pages (they are opaque behind :class:`kernels_pallas.cache.PagedKVCache`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "combined_rows",
    "kv_head_pad",
    "kv_packing",
    "kv_row",
    "merge_kv",
    "num_kv_heads_of",
    "page_shape",
    "split_kv",
]


def kv_packing(dtype: Any) -> int:
    """P, combined heads per 32-bit word: 1 (4-byte dtypes), 2 (2-byte), 4 (1-byte)."""
    return max(1, 4 // jnp.dtype(dtype).itemsize)


def combined_rows(num_kv_heads: int, dtype: Any) -> int:
    """C, the packed rows a token's K and V take: ``ceil(2 * K / P)``."""
    p = kv_packing(dtype)
    return -(-2 * num_kv_heads // p)


def kv_head_pad(num_kv_heads: int, dtype: Any) -> int:
    """Dummy kv heads padding the last row (0, or 1 for an odd ``K`` in an 8-bit cache)."""
    return (combined_rows(num_kv_heads, dtype) * kv_packing(dtype) - 2 * num_kv_heads) // 2


def page_shape(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    stored_head_dim: int,
    dtype: Any,
) -> tuple[int, int, int, int, int, int]:
    """``(L, N, S, C, P, Dp)``, the shape of ``kv_pages``."""
    return (
        num_layers,
        num_blocks,
        block_size,
        combined_rows(num_kv_heads, dtype),
        kv_packing(dtype),
        stored_head_dim,
    )


def num_kv_heads_of(kv_pages: jax.Array | jax.ShapeDtypeStruct, kv_head_pad: int = 0) -> int:
    """K of ``kv_pages [..., C, P, Dp]``: ``C * P / 2`` less the dummy heads."""
    c, p = kv_pages.shape[-3], kv_pages.shape[-2]
    return c * p // 2 - kv_head_pad


def kv_row(head: int | jax.Array, value: bool, packing: int) -> tuple[Any, Any]:
    """``(c, j)``: kv head ``head``'s K (``value=False``) or V sits at ``[..., c, j, :]``."""
    combined = 2 * head + int(value)
    return combined // packing, combined % packing


def merge_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """``k, v [..., K, Dp]`` (one dtype) -> ``[..., C, P, Dp]`` in the page layout: K and V
    of each head side by side (combined head ``2h`` / ``2h + 1``), a dummy zero head where
    ``2 * K`` does not fill the last word."""
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(
            f"merge_kv: k and v must match, got {k.shape} {k.dtype} and {v.shape} {v.dtype}"
        )
    *lead, kh, dp = k.shape
    p = kv_packing(k.dtype)
    c = combined_rows(kh, k.dtype)
    kv = jnp.stack([k, v], axis=-2).reshape(*lead, 2 * kh, dp)
    if c * p != 2 * kh:
        pad = [(0, 0)] * len(lead) + [(0, c * p - 2 * kh), (0, 0)]
        kv = jnp.pad(kv, pad)
    return kv.reshape(*lead, c, p, dp)


def split_kv(kv: jax.Array, num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """``[..., C, P, Dp]`` -> ``(k, v)``, each ``[..., K, Dp]`` (the inverse of
    :func:`merge_kv`; dummy heads dropped).

    Written as slices of the packed axes (no reshape merging ``C`` with a size-1 ``P``):
    XLA:CPU otherwise gives the whole stacked cache another layout and copies it every step.
    """
    *lead, c, p, dp = kv.shape
    kh = num_kv_heads
    if p == 1:  # combined head 2h at row 2h
        heads = kv[..., 0, :]
        return heads[..., 0 : 2 * kh : 2, :], heads[..., 1 : 2 * kh : 2, :]
    if p == 2:  # row h holds (K, V) of head h
        return kv[..., :kh, 0, :], kv[..., :kh, 1, :]
    # p == 4: row r holds K, V of head 2r, then K, V of head 2r + 1
    k = kv[..., 0::2, :].reshape(*lead, c * p // 2, dp)
    v = kv[..., 1::2, :].reshape(*lead, c * p // 2, dp)
    return k[..., :kh, :], v[..., :kh, :]
