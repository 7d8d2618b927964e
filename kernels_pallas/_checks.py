"""Argument checks shared by the public kernel entry points (raise before any tracing)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

IMPLS = ("auto", "reference", "pallas", "pallas_tpu", "pallas_gpu", "pallas_triton")


def is_int_dtype(x: Any) -> bool:
    """Whether ``x`` (array, scalar or list) has an integer dtype."""
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return bool(jnp.issubdtype(dtype, jnp.integer))


def check_pages_pair(name: str, k_pages: Any, v_pages: Any) -> None:
    """K and V pages: rank 4 ``[K, N, S, D]`` or 5 ``[L, K, N, S, D]``, same shape and dtype."""
    if k_pages.ndim not in (4, 5):
        raise ValueError(
            f"{name}: k_pages must have rank 4 [K, N, S, D] or 5 [L, K, N, S, D], "
            f"got shape {k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(
            f"{name}: k_pages and v_pages shapes differ: {k_pages.shape} vs {v_pages.shape}"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"{name}: k_pages and v_pages dtypes differ: {k_pages.dtype} vs {v_pages.dtype}"
        )


def check_layer(name: str, pages: Any, layer: Any) -> None:
    """``layer`` is required (and in range) for stacked rank-5 pages, and refused for rank 4."""
    if pages.ndim == 5:
        if layer is None:
            raise ValueError(
                f"{name}: pages of rank 5 [L, K, N, S, D] need layer= (int or i32 scalar)"
            )
        if isinstance(layer, (int, np.integer)):
            if not 0 <= int(layer) < pages.shape[0]:
                raise ValueError(
                    f"{name}: layer={int(layer)} out of range for {pages.shape[0]} layers"
                )
        elif np.ndim(layer) != 0 or not is_int_dtype(layer):
            raise ValueError(f"{name}: layer must be an integer scalar, got {layer!r}")
    elif layer is not None:
        raise ValueError(
            f"{name}: layer= given but pages have rank 4 {pages.shape}; pass stacked "
            "[L, K, N, S, D] pages to select a layer"
        )
