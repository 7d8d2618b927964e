"""Public paged-attention entry points: argument checks and dispatch to a kernel family.

Two ops, one contract (see ``kernels_pallas.reference`` for the exact semantics):

* :func:`paged_attention`: decode, one query token per sequence.
* :func:`ragged_paged_attention`: a token-packed batch mixing decode rows, whole prefills,
  chunked prefills and prefix-cache hits (queries are the last ``q_len`` of ``kv_len`` tokens).

``impl`` chooses the implementation (decided in :mod:`kernels_pallas._dispatch`, shared with
the KV ops):

* ``"auto"``: for the platform the program is lowered for (``jax.lax.platform_dependent``):
  the Mosaic TPU kernel on TPU (live or an AOT topology target); on CUDA the Mosaic GPU kernel
  on Hopper (9.x) and the Triton kernel on every other compute capability from 8.0 (and for
  Hopper geometries the Mosaic GPU kernel refuses); geometries no kernel takes use XLA with
  one warning; the XLA oracle elsewhere (``paged_attention_reference`` for decode,
  ``ragged_paged_attention_xla`` for ragged).
* ``"reference"``: the oracle path, on any backend.
* ``"pallas"``: the target platform's Pallas kernel; on CPU the TPU kernel, which needs
  ``interpret=True``.
* ``"pallas_tpu"`` / ``"pallas_gpu"`` (Mosaic GPU) / ``"pallas_triton"``: force one kernel
  family (e.g. in interpret mode on CPU).

Pages are one stacked array ``kv_pages [L, N, S, C, P, Dp]`` (:mod:`kernels_pallas.kv_layout`:
all layers, token-major, K and V of each head side by side) with ``layer=`` (a Python int or a
traced ``i32`` scalar) and ``num_kv_heads=``. The kernels read ``kv_pages.at[layer]`` straight
from HBM, so no per-layer copy of the cache is made; the XLA path gathers (layer, block) rows.

Every argument problem raises ``ValueError`` naming it, before anything is traced.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import _dispatch, kv_ops, reference
from kernels_pallas._checks import (
    IMPLS,
    check_attention_common,
    check_sinks,
    check_vector,
    is_int_dtype,
)
from kernels_pallas.cache import (
    PagedKVCache,
    check_cache,
    check_new_kv,
    is_quantized_dtype,
    merged_rows,
    pad_lanes,
    resolve_layer,
)
from kernels_pallas.tpu.routing import leading_decode_seqs

__all__ = [
    "IMPLS",
    "paged_attention",
    "paged_attention_pages",
    "ragged_paged_attention",
    "leading_decode_seqs",
    "ragged_paged_attention_pages",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Dispatch (kernels_pallas._dispatch decides; these build the three implementations)
# --------------------------------------------------------------------------------------------


def _gpu_module() -> Any:
    try:
        return importlib.import_module("kernels_pallas.gpu.attention")
    except ImportError as e:
        raise NotImplementedError(
            "the Mosaic GPU attention kernels (kernels_pallas.gpu.attention) are not "
            f"available: {e}"
        ) from e


def _has_gpu_module() -> bool:
    try:
        _gpu_module()
    except NotImplementedError as e:
        logger.warning("%s; GPU targets use the XLA path", e)
        return False
    return True


def _layer_array(layer: Any) -> jax.Array:
    return jnp.asarray(0 if layer is None else layer, jnp.int32)


_QUANTIZED_REASON = (
    "8-bit KV pages: the Mosaic GPU attention kernels read float pages only (the TPU and "
    "Triton kernels dequantize them)"
)


_SINKS_REASON = (
    "attention sinks: the Mosaic GPU attention kernels have no sink logit in their softmax (a "
    "kernel that ignored it would be silently wrong; the TPU and Triton kernels take sinks)"
)


def _check_forced_kernel(name: str, impl: str, kv_pages: jax.Array, sinks: Any = None) -> None:
    """A forced GPU kernel on 8-bit pages or with sinks is refused, interpret mode included.

    (The dispatch lets ``interpret=True`` through its geometry reasons, which only concern
    compiled kernels; the GPU kernels would read the raw 8-bit values without their scales,
    or leave the sinks out of the softmax.)
    """
    if impl not in ("pallas", "pallas_tpu", "pallas_gpu"):
        return
    gpu = _dispatch.forced_family(impl, True, True) == "pallas_gpu"
    for refused, reason in (
        (is_quantized_dtype(kv_pages.dtype) and gpu, _QUANTIZED_REASON),
        (sinks is not None and gpu, _SINKS_REASON),
    ):
        if refused:
            raise ValueError(
                f"{name}: impl={impl!r} cannot run these arguments: {reason}; use "
                "impl='auto' or 'reference'"
            )


def _reasons(
    q: jax.Array, kv_pages: jax.Array, kh: int, sinks: Any = None
) -> tuple[str | None, ...]:
    """Why the TPU / Mosaic GPU / Triton kernels cannot take these operands (None: they can);
    the Triton kernel's for the targeted compute capability."""
    s, d = kv_pages.shape[2], kv_pages.shape[-1]
    geometry = dict(head_dim=d, num_q_per_kv=q.shape[1] // kh, block_size=s)
    triton = _dispatch.triton_attention_unsupported_reason(
        **geometry, dtype=kv_pages.dtype, capability=_dispatch.cuda_capability()
    )
    if is_quantized_dtype(kv_pages.dtype):
        return None, _QUANTIZED_REASON, triton
    if sinks is not None:
        return None, _SINKS_REASON, triton
    gpu = _dispatch.gpu_attention_unsupported_reason(**geometry, dtype=q.dtype)
    return None, gpu, triton


_STATIC = ("num_kv_heads", "sm_scale", "soft_cap", "sliding_window")


def _tpu_scales(kv_pages: jax.Array, k_scale: jax.Array, v_scale: jax.Array) -> jax.Array | None:
    """The TPU kernels' ``kv_scales`` (``f32[2]``): only for 8-bit pages."""
    if not is_quantized_dtype(kv_pages.dtype):
        return None
    return jnp.stack([k_scale, v_scale]).astype(jnp.float32)


def _scale_kw(kv_pages: jax.Array, k_scale: jax.Array, v_scale: jax.Array) -> dict:
    """The oracles' dequantization scales: only for 8-bit pages."""
    if not is_quantized_dtype(kv_pages.dtype):
        return {}
    return dict(k_scale=k_scale, v_scale=v_scale)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _paged_reference(q, kv_pages, lengths, block_tables, layer, k_scale, v_scale, sinks=None, **kw):
    scales = _scale_kw(kv_pages, k_scale, v_scale)
    return reference.paged_attention_reference(
        q, kv_pages[layer], lengths, block_tables, **scales, sinks=sinks, **kw
    )


@functools.partial(jax.jit, static_argnames=(*_STATIC, "gpu_tuned"))
def _ragged_reference(
    q, kv_pages, kv_lens, block_tables, cu_q_lens, num_seqs, layer, k_scale, v_scale,
    gpu_tuned=False, sinks=None, **kw,
):  # fmt: skip
    # gpu_tuned: the CUDA fallback (large chunks, 16-bit operands; reference.XLA_GPU_CHUNK_BYTES).
    if gpu_tuned:
        kw = dict(kw, chunk_bytes=reference.XLA_GPU_CHUNK_BYTES, native_operands=True)
    # Stacked pages go in whole: the XLA path gathers (layer, block) rows directly, where
    # slicing pages[layer] first would copy the layer's whole cache every call.
    return reference.ragged_paged_attention_xla(
        q,
        kv_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        layer=layer,
        sinks=sinks,
        **_scale_kw(kv_pages, k_scale, v_scale),
        **kw,
    )


def _scale_args(k_scale: Any, v_scale: Any) -> tuple[jax.Array, jax.Array]:
    """The layer's scales as f32 scalars (1.0 for float pages, where they are unused)."""
    return tuple(
        jnp.asarray(1.0 if x is None else x, jnp.float32).reshape(()) for x in (k_scale, v_scale)
    )


def _one(optional: tuple) -> Any:
    """The optional trailing argument (``sinks``) of an implementation, or None."""
    return optional[0] if optional else None


def _has_triton_module() -> bool:
    try:
        return bool(importlib.import_module("kernels_pallas.gpu.triton_attention"))
    except ImportError as e:
        logger.warning("the Triton GPU kernels are not importable (%s); they are not used", e)
        return False


def _triton_kw(kv_pages, layer, ks, vs, sink: tuple, kw: dict, interpret: bool) -> dict:
    """Keyword arguments of the Triton kernels (``kernels_pallas.gpu.triton_attention``)."""
    scales = dict(k_scale=ks, v_scale=vs) if is_quantized_dtype(kv_pages.dtype) else {}
    return dict(kw, layer=layer, sinks=_one(sink), interpret=interpret, **scales)


def _call_gpu(fn_name: str, args: tuple, kv_pages, layer, kwargs: dict) -> jax.Array:
    fn = getattr(_gpu_module(), fn_name)
    q, *rest = args  # the GPU kernels read kv_pages.at[layer] themselves (no copy)
    return fn(q, kv_pages, *rest, **dict(kwargs, layer=layer))


def paged_attention_pages(
    q: jax.Array,
    kv_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    num_kv_heads: int,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl: str = "auto",
    interpret: bool = False,
    layer: int | jax.Array | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decode attention over paged KV: one query token per sequence, at ``lengths[b] - 1``.

    Args:
      q: ``[B, H, D]`` queries; H must be a multiple of K (MHA, GQA, MQA).
      kv_pages: ``[L, N, S, C, P, D]`` pages (:mod:`kernels_pallas.kv_layout`), the same
        dtype as ``q`` (or 8-bit).
      lengths: ``i32[B]`` tokens in each sequence; 0 marks a padding row (output zeros).
      block_tables: ``i32[B, M]`` block ids; negative ids mean "no block".
      num_kv_heads: K (an 8-bit cache with an odd K pads a dummy head, so C * P / 2 may not
        be K).
      sm_scale: logit scale, default ``D ** -0.5``.
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      sliding_window: if set, the query sees only the last ``sliding_window`` keys.
      impl: ``"auto" | "reference" | "pallas" | "pallas_tpu" | "pallas_gpu" |
        "pallas_triton"``.
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      layer: layer index (int or traced i32 scalar; optional when L = 1).
      k_scale, v_scale: the layer's dequantization scales (8-bit pages; ignored otherwise).
      sinks: optional ``f32[H]`` attention sinks, one logit per query head in the softmax
        denominator only (:func:`kernels_pallas.reference.paged_attention_reference`). The
        TPU kernels take them (each row's online softmax starts from its sink), so does the
        Triton kernel (in its combine); the Mosaic GPU kernels do not: there ``impl="auto"``
        runs the Triton kernel or the XLA path, a forced ``"pallas_gpu"`` raises.

    Returns:
      ``[B, H, D]`` in ``q.dtype``.

    Raises:
      ValueError: on bad shapes, dtypes or options (before tracing).
      NotImplementedError: ``impl="pallas_gpu"`` when the GPU kernels are not installed.
    """
    name = "paged_attention"
    kw = check_attention_common(
        name,
        q,
        kv_pages,
        num_kv_heads,
        block_tables,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        impl=impl,
        layer=layer,
    )
    sinks = check_sinks(name, sinks, q.shape[1])
    _check_forced_kernel(name, impl, kv_pages, sinks)
    kw["num_kv_heads"] = int(num_kv_heads)
    b = q.shape[0]
    check_vector(name, "lengths", lengths, b, "B = q.shape[0]")
    if block_tables.shape[0] != b:
        raise ValueError(
            f"{name}: block_tables batch {block_tables.shape[0]} != q batch {b} "
            f"(block_tables {block_tables.shape}, q {q.shape})"
        )
    args = (
        q,
        kv_pages,
        jnp.asarray(lengths, jnp.int32),
        jnp.asarray(block_tables, jnp.int32),
        _layer_array(layer),
        *_scale_args(k_scale, v_scale),
        *(() if sinks is None else (sinks,)),
    )

    def xla(q, kv, lengths, tables, layer, ks, vs, *sink):
        return _paged_reference(q, kv, lengths, tables, layer, ks, vs, *sink, **kw)

    def tpu(q, kv, lengths, tables, layer, ks, vs, *sink):
        from kernels_pallas.tpu.paged_attention import paged_attention_tpu

        return paged_attention_tpu(
            q, kv, lengths, tables, layer=layer, interpret=interpret, sinks=_one(sink),
            kv_scales=_tpu_scales(kv, ks, vs),
            device_kind=getattr(_dispatch.target_device(), "device_kind", None), **kw,
        )  # fmt: skip

    def gpu(q, kv, lengths, tables, layer, ks, vs):
        return _call_gpu(
            "paged_attention_gpu", (q, lengths, tables), kv, layer, dict(kw, interpret=interpret)
        )

    def gpu_xla(q, kv, lengths, tables, layer, ks, vs, *sink):
        # Row b is sequence b's one token: the chunked ragged path, not a dense gather of
        # every sequence's whole table (the CPU reference's form).
        cu, n = jnp.arange(q.shape[0] + 1, dtype=jnp.int32), jnp.int32(q.shape[0])
        return _ragged_reference(q, kv, lengths, tables, cu, n, layer, ks, vs, True, *sink, **kw)

    def triton(q, kv, lengths, tables, layer, ks, vs, *sink):
        from kernels_pallas.gpu.triton_attention import paged_attention_triton

        return paged_attention_triton(
            q, kv, lengths, tables, **_triton_kw(kv, layer, ks, vs, sink, kw, interpret)
        )

    tpu_reason, gpu_reason, triton_reason = _reasons(q, kv_pages, num_kv_heads, sinks)
    return _dispatch.run(
        name,
        impl,
        interpret,
        args,
        xla=xla,
        tpu=tpu,
        gpu=gpu if _has_gpu_module() else None,
        gpu_xla=gpu_xla,
        tpu_reason=tpu_reason,
        gpu_reason=gpu_reason,
        triton=triton if _has_triton_module() else None,
        triton_reason=triton_reason,
        static_key=tuple(sorted(kw.items())),
    )


def ragged_paged_attention_pages(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    num_kv_heads: int,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl: str = "auto",
    interpret: bool = False,
    layer: int | jax.Array | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    max_q_len: int | None = None,
    sinks: jax.Array | None = None,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    unique_slots: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Ragged causal attention over paged KV (decode, prefill, chunked prefill, prefix hits).

    Sequence ``s < num_seqs`` owns query rows ``cu_q_lens[s]:cu_q_lens[s + 1]``: the last
    ``q_len`` of its ``kv_lens[s]`` tokens (whose K/V are already written to the pages). Row
    ``i`` of the sequence sits at position ``kv_lens[s] - q_len + i`` and attends causally
    (and within ``sliding_window``). Rows at or past ``cu_q_lens[num_seqs]`` are padding and
    return zeros.

    Args:
      q: ``[T, H, D]`` token-packed queries.
      kv_pages: ``[L, N, S, C, P, D]`` pages (:mod:`kernels_pallas.kv_layout`).
      kv_lens: ``i32[B]`` total tokens of each sequence (``kv_lens[s] >= q_len``).
      block_tables: ``i32[B, M]`` block ids; negative ids mean "no block".
      cu_q_lens: ``i32[B + 1]`` cumulative query lengths, ``cu_q_lens[0] == 0``.
      num_seqs: scalar (or shape ``(1,)``) number of sequences that count.
      num_kv_heads, sm_scale, soft_cap, sliding_window, impl, interpret, layer, k_scale,
        v_scale, sinks: as in :func:`paged_attention_pages`.
      max_q_len: optional static hint, a promise about the batch: no sequence has more than
        this many query rows. ``1`` (a decode-only batch: every sequence ``s < num_seqs``
        owns exactly row ``s``) runs the TPU decode kernel, which takes one query row group
        per sequence and big KV steps instead of the ragged kernel's query blocks. The other
        implementations are exact for any batch and ignore it. Without it, the TPU path
        still gives a batch's leading one-row sequences (a served step's decodes) to the
        decode kernel and the rest to the ragged kernel, split at run time (exact for any
        order of decode and prefill sequences).
      new_kv: ``(kv_new [T, C, P, D], slot_mapping i32[T])``: the step's new tokens' rows
        (merged, in the pages' dtype: :func:`kernels_pallas.kv_layout.merge_kv`), written to
        ``layer`` (slots < 0 skipped) before anything attends, as :func:`~kernels_pallas.
        kv_ops.write_pages` would; the pages with them written are returned too. On TPU the
        write is fused into the attention kernels (:mod:`kernels_pallas.tpu.routing`: one
        DMA per token while attending, the new rows read from ``kv_new``), which needs
        ``slot_mapping[t]`` to be the slot of row ``t``'s position for every row that
        counts; elsewhere it is XLA's in-place scatter, then the attention.
      unique_slots: a promise that no two rows' live slots in ``new_kv`` are equal (each
        position of a served step has its own): the TPU path then skips the sort that makes
        the last of equal slots win. Broken, equal slots get an arbitrary one of the rows.

    Returns:
      ``[T, H, D]`` in ``q.dtype``; ``(out, kv_pages)`` when ``new_kv`` is given.
    """
    name = "ragged_paged_attention"
    kw = check_attention_common(
        name,
        q,
        kv_pages,
        num_kv_heads,
        block_tables,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        impl=impl,
        layer=layer,
    )
    sinks = check_sinks(name, sinks, q.shape[1])
    _check_forced_kernel(name, impl, kv_pages, sinks)
    kw["num_kv_heads"] = int(num_kv_heads)
    b = block_tables.shape[0]
    check_vector(name, "kv_lens", kv_lens, b, "B = block_tables.shape[0]")
    check_vector(name, "cu_q_lens", cu_q_lens, b + 1, "B + 1")
    if jnp.ndim(num_seqs) > 1 or jnp.size(num_seqs) != 1 or not is_int_dtype(num_seqs):
        raise ValueError(
            f"{name}: num_seqs must be an integer scalar, got shape {jnp.shape(num_seqs)}"
        )
    if isinstance(num_seqs, (int, np.integer)) and not 0 <= int(num_seqs) <= b:
        raise ValueError(f"{name}: num_seqs={int(num_seqs)} out of range [0, {b}]")
    if max_q_len is not None and (
        isinstance(max_q_len, bool) or not isinstance(max_q_len, (int, np.integer)) or max_q_len < 1
    ):
        raise ValueError(f"{name}: max_q_len must be a positive int or None, got {max_q_len!r}")
    fused = new_kv is not None
    if fused:
        if not isinstance(new_kv, (tuple, list)) or len(new_kv) != 2:
            raise ValueError(f"{name}: new_kv must be a tuple (kv_new, slot_mapping)")
        kv_ops.check_new_rows(name, kv_pages, *new_kv)
        new_kv = (new_kv[0], jnp.asarray(new_kv[1], jnp.int32))
    args = (
        q,
        kv_pages,
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(block_tables, jnp.int32),
        jnp.asarray(cu_q_lens, jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(()),
        _layer_array(layer),
        *_scale_args(k_scale, v_scale),
        *(() if sinks is None else (sinks,)),
        *(new_kv if fused else ()),
    )

    def written(fn):
        """``fn`` on pages with the new rows written first (XLA's in-place scatter): the
        unfused form, for every implementation but the TPU kernels. Args end ``(*sink,
        kv_new, slots)`` when fused."""
        if not fused:
            return fn

        def run(q, kv, kv_lens, tables, cu, n, layer, *rest):
            *rest, kv_new, slots = rest
            kv = kv_ops.write_xla(kv, kv_new, slots, layer)
            return fn(q, kv, kv_lens, tables, cu, n, layer, *rest), kv

        return run

    @written
    def xla(q, kv, kv_lens, tables, cu, n, layer, ks, vs, *sink):
        return _ragged_reference(q, kv, kv_lens, tables, cu, n, layer, ks, vs, False, *sink, **kw)

    @written
    def gpu_xla(q, kv, kv_lens, tables, cu, n, layer, ks, vs, *sink):
        return _ragged_reference(q, kv, kv_lens, tables, cu, n, layer, ks, vs, True, *sink, **kw)

    def tpu(q, kv, kv_lens, tables, cu, n, layer, ks, vs, *rest):
        from kernels_pallas.tpu import routing

        sink, new = (rest[:-2], tuple(rest[-2:])) if fused else (rest, None)
        kw_tpu = dict(kw, sinks=_one(sink), kv_scales=_tpu_scales(kv, ks, vs))
        device_kind = getattr(_dispatch.target_device(), "device_kind", None)
        if max_q_len == 1:
            return routing.decode_rows(
                q, kv, kv_lens, tables, n, layer, interpret, kw_tpu, new, unique_slots,
                device_kind,
            )  # fmt: skip
        return routing.mixed_rows(
            q, kv, kv_lens, tables, cu, n, layer, interpret, kw_tpu, device_kind, new, unique_slots
        )

    @written
    def gpu(q, kv, kv_lens, tables, cu, n, layer, ks, vs):
        args = (q, kv_lens, tables, cu, n)
        kw_gpu = dict(kw, interpret=interpret)
        return _call_gpu("ragged_paged_attention_gpu", args, kv, layer, kw_gpu)

    @written
    def triton(q, kv, kv_lens, tables, cu, n, layer, ks, vs, *sink):
        from kernels_pallas.gpu.triton_attention import ragged_paged_attention_triton

        return ragged_paged_attention_triton(
            q, kv, kv_lens, tables, cu, n, **_triton_kw(kv, layer, ks, vs, sink, kw, interpret)
        )

    tpu_reason, gpu_reason, triton_reason = _reasons(q, kv_pages, num_kv_heads, sinks)
    with _dispatch.recording() as chosen:
        result = _run_ragged(name, impl, interpret, args, xla, tpu, gpu, gpu_xla, tpu_reason,
                             gpu_reason, triton, triton_reason, kw, max_q_len, fused)  # fmt: skip
    if fused:  # the write ran inside the TPU kernels, or as XLA's scatter before the others
        _dispatch.record_each(
            "write_kv",
            {p: "pallas_tpu" if ops.get(name) == "pallas_tpu" else "xla"
             for p, ops in chosen.items()},
        )  # fmt: skip
    return result


def _run_ragged(name, impl, interpret, args, xla, tpu, gpu, gpu_xla, tpu_reason, gpu_reason,
                triton, triton_reason, kw, max_q_len, fused):  # fmt: skip
    return _dispatch.run(
        name,
        impl,
        interpret,
        args,
        xla=xla,
        tpu=tpu,
        gpu=gpu if _has_gpu_module() else None,
        gpu_xla=gpu_xla,
        tpu_reason=tpu_reason,
        gpu_reason=gpu_reason,
        triton=triton if _has_triton_module() else None,
        triton_reason=triton_reason,
        gpu_auto_reason=_dispatch.MOSAIC_GPU_RAGGED_REASON,
        static_key=(*sorted(kw.items()), ("max_q_len", max_q_len), ("fused", fused)),
        donate=(1,) if fused else (),
    )


# --------------------------------------------------------------------------------------------
# The public ops: on a PagedKVCache
# --------------------------------------------------------------------------------------------


def paged_attention(
    q: jax.Array,
    cache: PagedKVCache,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl: str = "auto",
    interpret: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decode attention over a paged cache: one query token per sequence, at ``lengths - 1``.

    Args:
      q: ``[B, H, D]`` queries (the cache dtype for float caches; any float dtype for 8-bit
        caches, which are dequantized with the layer's scales).
      cache: the :class:`~kernels_pallas.cache.PagedKVCache`.
      lengths: ``i32[B]`` tokens of each sequence; 0 marks a padding row (zeros out).
      block_tables: ``i32[B, M]`` block ids; negative = no block. Entries past a sequence's
        length are never read.
      layer: the layer (int or traced i32 scalar; optional for a one-layer cache).
      sm_scale, soft_cap, sliding_window, impl, interpret, sinks: as in
        :func:`paged_attention_pages`.

    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    name = "paged_attention"
    check_cache(name, cache)
    layer = resolve_layer(name, cache, layer)
    q, sm_scale = _lane_padded_query(name, q, cache, sm_scale)
    out = paged_attention_pages(
        q,
        cache.kv,
        lengths,
        block_tables,
        num_kv_heads=cache.num_kv_heads,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        impl=impl,
        interpret=interpret,
        layer=layer,
        k_scale=cache.k_scale[layer],
        v_scale=cache.v_scale[layer],
        sinks=sinks,
    )
    return out[..., : cache.head_dim]


def _lane_padded_query(
    name: str, q: Any, cache: PagedKVCache, sm_scale: float | None
) -> tuple[Any, float | None]:
    """``q`` padded to the cache's stored lanes (zeros add nothing to a logit) and the logit
    scale of its own ``D`` (``D ** -0.5`` by default, not ``Dp``'s): what the page-level ops
    take for a lane-padded cache (:func:`kernels_pallas.cache.stored_head_dim`)."""
    if cache.lane_padded_from is None:
        return q, sm_scale
    d = cache.head_dim
    if np.ndim(q) != 3 or np.shape(q)[-1] != d:
        raise ValueError(
            f"{name}: q must be [tokens, H, D] with the cache's D={d}, got {np.shape(q)}"
        )
    return pad_lanes(q, cache.stored_head_dim), (d**-0.5 if sm_scale is None else sm_scale)


def ragged_paged_attention(
    q: jax.Array,
    cache: PagedKVCache,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    layer: int | jax.Array | None = None,
    new_kv: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl: str = "auto",
    interpret: bool = False,
    max_q_len: int | None = None,
    sinks: jax.Array | None = None,
    unique_slots: bool = False,
) -> jax.Array | tuple[jax.Array, PagedKVCache]:
    """Ragged causal attention over a paged cache (decode, prefill, chunks, prefix hits).

    Sequence ``s < num_seqs`` owns query rows ``cu_q_lens[s]:cu_q_lens[s + 1]``, the LAST
    ``q_len`` of its ``kv_lens[s]`` tokens, in any order of decode and prefill sequences.

    Args:
      q: ``[T, H, D]`` token-packed queries.
      cache: the :class:`~kernels_pallas.cache.PagedKVCache`.
      kv_lens, block_tables, cu_q_lens, num_seqs: as in :func:`ragged_paged_attention_pages`.
      layer: the layer (int or traced i32 scalar; optional for a one-layer cache).
      new_kv: ``(k [T, K, D], v [T, K, D], slot_mapping i32[T])``: the step's new tokens
        (row ``t``'s K/V), already counted in ``kv_lens``; they are written to ``layer``
        (slots < 0 skipped) before anything attends, and the updated cache is returned
        too. On TPU the write is fused into the attention kernels (one DMA per token, the
        new rows attended from ``k``/``v``; ``slot_mapping[t]`` must be the slot of row
        ``t``'s position, as a step's is); elsewhere it is ``write_kv``'s scatter, in the
        same program. See :func:`ragged_paged_attention_pages`.
      sm_scale, soft_cap, sliding_window, impl, interpret, sinks: as in
        :func:`paged_attention_pages` (sinks: ``f32[H]``; the TPU and Triton kernels and the
        XLA path).
      max_q_len: optional hint (``1``: a decode-only batch, each sequence owning the row of
        its index), see :func:`ragged_paged_attention_pages`; never needed for correctness.
      unique_slots: ``new_kv``'s slots are all different (a step's): see
        :func:`ragged_paged_attention_pages`.

    Returns:
      ``out [T, H, D]`` in ``q.dtype``; ``(out, cache)`` when ``new_kv`` is given.
    """
    name = "ragged_paged_attention"
    check_cache(name, cache)
    layer = resolve_layer(name, cache, layer)
    sinks = check_sinks(name, sinks, q.shape[1] if q.ndim == 3 else -1)
    _check_forced_kernel(name, impl, cache.kv, sinks)  # before the write: state unchanged
    q, sm_scale = _lane_padded_query(name, q, cache, sm_scale)
    rows = None
    if new_kv is not None:
        if not isinstance(new_kv, (tuple, list)) or len(new_kv) != 3:
            raise ValueError(f"{name}: new_kv must be a tuple (k, v, slot_mapping)")
        k, v, slots = new_kv
        check_new_kv(name, cache, k, v)
        rows = (merged_rows(cache, k, v, layer), slots)
    result = ragged_paged_attention_pages(
        q,
        cache.kv,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        num_kv_heads=cache.num_kv_heads,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        impl=impl,
        interpret=interpret,
        layer=layer,
        k_scale=cache.k_scale[layer],
        v_scale=cache.v_scale[layer],
        max_q_len=max_q_len,
        sinks=sinks,
        new_kv=rows,
        unique_slots=unique_slots,
    )
    if rows is None:
        return result[..., : cache.head_dim]
    out, kv = result
    return out[..., : cache.head_dim], cache.replace(kv=kv)
