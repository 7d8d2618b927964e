"""The engine's 8-bit KV cache: ``kv_cache_dtype`` and per-layer scales calibrated from data.

``kv_cache_dtype`` is ``"auto"`` (the model's compute dtype), ``"int8"`` or ``"fp8"``
(``float8_e4m3fn``). An 8-bit cache stores ``x / scale`` per layer, separately for K and V
(``kernels_pallas.cache``), so the scales decide what the cache can hold: a fixed 1.0 would
round a small-magnitude K or V to a handful of int8 levels. :func:`calibrate_scales` measures
them instead: the model runs once, through its public paged forward
(``forward_paged``, no hooks or quantization branches in the model), over a fixed English text
(:data:`CALIBRATION_TEXT`, through the engine's tokenizer, at most
:data:`MAX_CALIBRATION_TOKENS` and ``max_model_len`` tokens) into a temporary float cache just
large enough for it. Each layer's scale is ``absmax * margin / qmax`` of what that cache holds
(K after RoPE, as the cache stores it; ``qmax`` 127 for int8, 448 for e4m3; ``margin``
:data:`DEFAULT_MARGIN` leaves headroom for larger values in unseen text, which saturate).

Shape letters: L layers, T tokens, K kv heads, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels_pallas as kp
from kernels_pallas.buckets import next_power_of_two
from paxcache.attention import build_metadata

__all__ = [
    "CALIBRATION_TEXT",
    "DEFAULT_MARGIN",
    "KV_CACHE_DTYPE_CHOICES",
    "MAX_CALIBRATION_TOKENS",
    "calibrate_engine",
    "calibrate_scales",
    "calibration_ids",
    "check_kv_cache_dtype",
    "is_eight_bit",
    "resolve_kv_dtype",
    "scale_stats",
    "scales_from_absmax",
    "scales_source",
]

KV_CACHE_DTYPE_CHOICES = ("auto", "int8", "fp8")
_EIGHT_BIT = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
DEFAULT_MARGIN = 1.25
MAX_CALIBRATION_TOKENS = 512

# Plain English prose written for calibration (no code, no markup): a few hundred tokens of
# ordinary text, so the scales reflect what a served prompt's K and V look like.
CALIBRATION_TEXT = (
    "The river town woke slowly on market days. Before the sun had cleared the hills, the "
    "bakers were already at their ovens, and the smell of bread drifted down the narrow "
    "streets toward the water. Farmers came in from the valley with carts of apples, onions "
    "and late summer pears, and they argued cheerfully about prices while their horses drank "
    "from the stone trough by the bridge. Children ran between the stalls, and an old man "
    "with a violin played the same three tunes he had played for forty years.\n\n"
    "Nobody in the town could remember when the market had started. The oldest records in "
    "the library mentioned it only in passing, as if everyone already knew about it, which "
    "of course they did. A historian who visited one spring spent a week reading letters and "
    "tax ledgers, and she concluded that the market was at least four hundred years old, "
    "perhaps much older. When she asked the mayor what he thought of her discovery, he "
    "shrugged and said that the apples were good this year, and that was what mattered.\n\n"
    "In the afternoon the square grew quiet. Merchants counted their coins, packed what they "
    "had not sold, and shared a meal of soup and cheese at the long tables outside the inn. "
    "Clouds gathered over the western ridge, and a light rain began to fall, soft enough "
    "that few people bothered to go inside. By evening the lamps were lit along the river, "
    "the boats were tied up for the night, and the town settled back into its ordinary "
    "rhythm: a dog barking somewhere, a door closing, the water moving steadily under the "
    "bridge as it had always done. Tomorrow there would be work in the fields and letters to "
    "answer, questions about the weather, the harvest and the price of grain, and the long "
    "patient business of living in a small place where everyone knows your name."
)


def check_kv_cache_dtype(kv_cache_dtype: Any) -> str:
    """``kv_cache_dtype`` itself when it is one of :data:`KV_CACHE_DTYPE_CHOICES`.

    Raises:
      ValueError: any other value (the message names it and the choices).
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_CHOICES)}, got {kv_cache_dtype!r}"
        )
    return kv_cache_dtype


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: Any, impl: str = "auto") -> jnp.dtype:
    """The cache dtype ``kv_cache_dtype`` names: the model's for ``"auto"``, else 8-bit.

    Args:
      kv_cache_dtype: ``"auto"``, ``"int8"`` or ``"fp8"``.
      model_dtype: the model's compute dtype.
      impl: the engine's kernel choice; the Mosaic GPU kernels cannot read 8-bit pages (the
        TPU kernels dequantize them in VMEM, the Pallas Triton GPU kernel in registers).

    Raises:
      ValueError: an unknown ``kv_cache_dtype``, or an 8-bit one with ``impl`` forcing the
        Mosaic GPU kernels (``"pallas_gpu"``, or ``"pallas"`` on a GPU; ``"auto"`` runs the
        Triton kernel on an 8-bit cache there, from compute capability 8.0, float8 from 8.9,
        else the XLA path).
    """
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    if impl == "pallas_gpu" or (impl == "pallas" and gpu):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} with impl={impl!r}: the Mosaic GPU attention "
            "kernels read float pages only; use impl='auto' (the Triton kernel or XLA attention "
            "on 8-bit pages) or 'reference'"
        )
    return _EIGHT_BIT[kv_cache_dtype]


def is_eight_bit(dtype: Any) -> bool:
    """Whether a cache of ``dtype`` needs scales."""
    return jnp.dtype(dtype) in _QMAX


def scales_from_absmax(absmax: Any, dtype: Any, margin: float = DEFAULT_MARGIN) -> np.ndarray:
    """Per-layer scales ``absmax * margin / qmax`` (``f32[L]``) for an 8-bit ``dtype``.

    A layer whose values are all zero gets the scale of ``absmax = 1e-6`` (any positive scale
    represents zeros exactly; the cache refuses a zero scale).

    Raises:
      ValueError: a dtype that is not 8-bit, a margin that is not a finite number >= 1, or a
        non-finite absmax (the calibration pass overflowed).
    """
    dt = jnp.dtype(dtype)
    if dt not in _QMAX:
        raise ValueError(f"scales_from_absmax: {dt} is not an 8-bit cache dtype")
    if not np.isfinite(margin) or margin < 1.0:
        raise ValueError(f"scales_from_absmax: margin must be a finite number >= 1, got {margin}")
    a = np.asarray(absmax, np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"KV calibration: non-finite K/V abs-max per layer {a.tolist()}")
    return (np.maximum(a, 1e-6) * margin / _QMAX[dt]).astype(np.float32)


def calibration_ids(tokenizer: Any, max_len: int, text: str = CALIBRATION_TEXT) -> list[int]:
    """``text`` through ``tokenizer.encode``, cut to ``min(max_len, MAX_CALIBRATION_TOKENS)``.

    Raises:
      ValueError: no tokenizer, or it gives no tokens.
    """
    if tokenizer is None:
        raise ValueError(
            "KV calibration: an 8-bit kv_cache_dtype calibrates its scales on text, and this "
            "engine has no tokenizer"
        )
    ids = [int(i) for i in tokenizer.encode(text)][: min(int(max_len), MAX_CALIBRATION_TOKENS)]
    if not ids:
        raise ValueError("KV calibration: the tokenizer encodes the calibration text as nothing")
    return ids


@functools.partial(
    jax.jit, static_argnames=("num_tokens", "graphdef", "block_size", "impl", "interpret", "mesh")
)
def _prefill_absmax(
    params: Any,
    cache: kp.PagedKVCache,
    tokens: jax.Array,
    block_tables: jax.Array,
    num_tokens: int,
    *,
    graphdef: Any,
    block_size: int,
    impl: str,
    interpret: bool,
    mesh: jax.sharding.Mesh | None,
) -> tuple[jax.Array, jax.Array]:
    """One sequence's prefill of ``tokens`` (``i32[T]``, the first ``num_tokens`` real) into
    ``cache`` (its blocks ``block_tables``, ``i32[1, M]``), then each layer's abs-max of the K
    and V it wrote: ``(f32[L], f32[L])``."""
    n = jnp.asarray([num_tokens], jnp.int32)
    md = build_metadata(
        block_tables,
        n,
        n,
        1,
        tokens.shape[0],
        block_size,
        impl=impl,
        interpret=interpret,
        mesh=mesh,
    )
    last = jnp.asarray([num_tokens - 1], jnp.int32)  # logits of one row: the pass wants K/V
    _, cache = nnx.merge(graphdef, params).forward_paged(tokens, cache, md, logits_indices=last)
    slots = jnp.arange(num_tokens, dtype=jnp.int32)
    k_max, v_max = [], []
    for layer in range(cache.num_layers):
        k, v = kp.read_kv(cache, slots, layer=layer, dtype=jnp.float32)  # [T, K, D] each
        k_max.append(jnp.max(jnp.abs(k)))
        v_max.append(jnp.max(jnp.abs(v)))
    return jnp.stack(k_max), jnp.stack(v_max)


def calibrate_scales(
    graphdef: Any,
    params: Any,
    token_ids: Sequence[int],
    make_cache: Callable[[int, int], kp.PagedKVCache],
    kv_dtype: Any,
    *,
    block_size: int = 16,
    impl: str = "auto",
    interpret: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    margin: float = DEFAULT_MARGIN,
) -> dict[str, np.ndarray]:
    """Per-layer ``k_scale`` / ``v_scale`` for an 8-bit cache, from one prefill of ``token_ids``.

    Args:
      graphdef, params: the model, split (``nnx.split``; params placed as the engine runs
        them); it must have ``forward_paged(token_ids, kv_cache, metadata)``.
      token_ids: the calibration prompt (T tokens; :func:`calibration_ids`).
      make_cache: ``(num_blocks, block_size) -> PagedKVCache``, a float cache placed as the
        engine's (split over kv heads on its mesh).
      kv_dtype: the 8-bit cache dtype the scales are for.
      block_size, impl, interpret, mesh: how the pass runs (the engine's).
      margin: headroom factor over the measured abs-max.

    Returns:
      ``{"k_scale": f32[L], "v_scale": f32[L]}`` (host arrays, finite and > 0).
    """
    n = len(token_ids)
    t = next_power_of_two(n)
    num_blocks = -(-n // block_size)
    cache = make_cache(num_blocks, block_size)
    tokens = np.zeros(t, np.int32)
    tokens[:n] = np.asarray(token_ids, np.int32)
    tables = np.arange(num_blocks, dtype=np.int32)[None]
    static = dict(
        graphdef=graphdef, block_size=block_size, impl=impl, interpret=interpret, mesh=mesh
    )
    k_max, v_max = jax.device_get(
        _prefill_absmax(params, cache, jnp.asarray(tokens), jnp.asarray(tables), n, **static)
    )
    return {
        "k_scale": scales_from_absmax(k_max, kv_dtype, margin),
        "v_scale": scales_from_absmax(v_max, kv_dtype, margin),
    }


def calibrate_engine(engine: Any, kv_heads: int, block_size: int) -> dict[str, np.ndarray]:
    """An engine's 8-bit KV scales: ``{}`` for a float cache; the checkpoint's when its
    ``kv_cache_scheme`` gives them (``config.kv_cache_absmax``: an fp8 checkpoint's scales
    are taken as they are by an fp8 cache, and rescaled to the int8 range by an int8 one);
    else calibrated.

    Otherwise runs :func:`calibrate_scales` with the engine's model, placed parameters, tokenizer,
    kernels and mesh, into a float cache made by its placement (so it is placed and
    split over kv heads as the engine's cache is). Called during construction, after the
    parameters are placed and before the KV cache is sized or built.
    """
    if not is_eight_bit(engine.kv_dtype):
        return {}
    cfg, conf = engine.model.config, engine._step_config
    if getattr(cfg, "kv_cache_absmax", None) is not None:  # the checkpoint fixes them
        k_absmax, v_absmax = cfg.kv_cache_absmax
        return {
            "k_scale": scales_from_absmax(k_absmax, engine.kv_dtype, margin=1.0),
            "v_scale": scales_from_absmax(v_absmax, engine.kv_dtype, margin=1.0),
        }

    def make_cache(num_blocks: int, block_size: int) -> kp.PagedKVCache:
        kv = engine.placement.create_kv(
            engine.mesh,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=kv_heads,
            head_dim=cfg.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=engine.model.dtype,
        )
        return kv.device

    return calibrate_scales(
        conf.graphdef,
        engine._params,
        calibration_ids(engine.tokenizer, engine.max_model_len),
        make_cache,
        engine.kv_dtype,
        block_size=block_size,
        impl=conf.impl,
        interpret=conf.interpret,
        mesh=engine.mesh,
    )


def scales_source(engine: Any) -> str | None:
    """Where an engine's KV scales come from, for ``stats()``: ``"checkpoint"``,
    ``"calibrated"``, or None for a float cache."""
    if not is_eight_bit(engine.kv_dtype):
        return None
    absmax = getattr(engine.model.config, "kv_cache_absmax", None)
    return "calibrated" if absmax is None else "checkpoint"


def scale_stats(scales: Mapping[str, Any]) -> dict[str, list[float]] | None:
    """``{"k": [...], "v": [...]}`` per layer for ``stats()``; None for a float cache."""
    if not scales:
        return None
    return {kv: [float(x) for x in np.asarray(scales[f"{kv}_scale"])] for kv in ("k", "v")}
