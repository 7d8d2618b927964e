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


def check_pages(name: str, kv_pages: Any) -> None:
    """Pages in the layout of :mod:`kernels_pallas.kv_layout`: rank 6 ``[L, N, S, C, P, Dp]``
    with ``P`` the dtype's packing."""
    from kernels_pallas.kv_layout import kv_packing

    if kv_pages.ndim != 6:
        raise ValueError(
            f"{name}: kv_pages must have rank 6 [L, N, S, C, P, Dp], got shape {kv_pages.shape}"
        )
    if kv_pages.shape[4] != kv_packing(kv_pages.dtype):
        raise ValueError(
            f"{name}: kv_pages {kv_pages.shape} of {jnp.dtype(kv_pages.dtype).name} must pack "
            f"P={kv_packing(kv_pages.dtype)} heads per 32-bit word (axis 4)"
        )


def check_layer(name: str, pages: Any, layer: Any) -> None:
    """``layer`` is in range for stacked ``[L, ...]`` pages (required when ``L > 1``)."""
    if layer is None:
        if pages.shape[0] == 1:
            return
        raise ValueError(f"{name}: stacked pages [L, ...] need layer= (int or i32 scalar)")
    if isinstance(layer, (bool, np.bool_)):
        raise ValueError(f"{name}: layer must be an integer, got {layer!r}")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= int(layer) < pages.shape[0]:
            raise ValueError(f"{name}: layer={int(layer)} out of range for {pages.shape[0]} layers")
    elif np.ndim(layer) != 0 or not is_int_dtype(layer):
        raise ValueError(f"{name}: layer must be an integer scalar, got {layer!r}")
