"""Argument checks shared by the public kernel entry points (raise before any tracing)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.cache import is_quantized_dtype

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


def check_attention_common(
    name: str,
    q: jax.Array,
    kv_pages: jax.Array,
    num_kv_heads: Any,
    block_tables: jax.Array,
    *,
    sm_scale: float | None,
    soft_cap: float | None,
    sliding_window: int | None,
    impl: str,
    layer: Any,
) -> dict[str, Any]:
    """Checks shared by the attention ops (q is ``[B|T, H, D]``).

    Returns:
      The static options as the implementations take them: ``sm_scale`` (default
      ``D ** -0.5``), ``soft_cap`` and ``sliding_window`` as Python numbers or None.
    """
    if impl not in IMPLS:
        raise ValueError(f"{name}: impl must be one of {IMPLS}, got {impl!r}")
    if q.ndim != 3:
        raise ValueError(f"{name}: q must have rank 3 [tokens, H, D], got shape {q.shape}")
    check_pages(name, kv_pages)
    check_layer(name, kv_pages, layer)
    _, h, d = q.shape
    kh, dk = num_kv_heads, kv_pages.shape[-1]
    rows = kv_pages.shape[3] * kv_pages.shape[4]
    if isinstance(kh, bool) or not isinstance(kh, (int, np.integer)) or not 0 < 2 * kh <= rows:
        raise ValueError(
            f"{name}: num_kv_heads={kh!r} does not fit pages of {rows} packed heads "
            f"({kv_pages.shape})"
        )
    if h % kh != 0:
        raise ValueError(
            f"{name}: number of query heads H={h} is not divisible by number of kv heads K={kh}"
        )
    if d != dk:
        raise ValueError(f"{name}: head_dim mismatch: q has D={d}, pages have D={dk}")
    if is_quantized_dtype(kv_pages.dtype):
        if not jnp.issubdtype(q.dtype, jnp.floating):
            raise ValueError(f"{name}: q must be floating point, got {q.dtype}")
    elif q.dtype != kv_pages.dtype:
        raise ValueError(f"{name}: dtype mismatch: q is {q.dtype}, pages are {kv_pages.dtype}")
    if block_tables.ndim != 2:
        raise ValueError(
            f"{name}: block_tables must have rank 2 [B, M], got shape {block_tables.shape}"
        )
    if not is_int_dtype(block_tables):
        raise ValueError(f"{name}: block_tables must be integer, got {block_tables.dtype}")
    if sm_scale is not None and not isinstance(sm_scale, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name}: sm_scale must be a Python float or None, got {sm_scale!r}")
    if soft_cap is not None and (
        not isinstance(soft_cap, (int, float, np.floating, np.integer)) or not soft_cap > 0
    ):
        raise ValueError(f"{name}: soft_cap must be a positive float or None, got {soft_cap!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, (int, np.integer)) or sliding_window <= 0
    ):
        raise ValueError(
            f"{name}: sliding_window must be a positive int or None, got {sliding_window!r}"
        )
    return dict(
        sm_scale=float(d**-0.5 if sm_scale is None else sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
    )


def check_sinks(name: str, sinks: Any, num_heads: int) -> jax.Array | None:
    """``sinks`` as ``f32[H]`` (or None), checked: a float vector of one logit per query head."""
    if sinks is None:
        return None
    shape = jnp.shape(sinks)
    if shape != (num_heads,):
        raise ValueError(
            f"{name}: sinks must have shape ({num_heads},) (one logit per query head H), "
            f"got {shape}"
        )
    if not jnp.issubdtype(jnp.asarray(sinks).dtype, jnp.floating):
        raise ValueError(f"{name}: sinks must be floating point, got {jnp.asarray(sinks).dtype}")
    return jnp.asarray(sinks, jnp.float32)


def check_vector(name: str, what: str, x: Any, n: int, n_desc: str) -> None:
    """``x`` an integer vector of shape ``(n,)``."""
    shape = jnp.shape(x)
    if len(shape) != 1 or shape[0] != n:
        raise ValueError(f"{name}: {what} must have shape ({n},) ({n_desc}), got {shape}")
    if not is_int_dtype(x):
        raise ValueError(f"{name}: {what} must be integer, got {jnp.asarray(x).dtype}")
