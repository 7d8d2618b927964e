"""Paged attention for NVIDIA GPUs of compute capability 8.0 and newer, in Pallas' Triton backend.

The Mosaic GPU kernels (:mod:`kernels_pallas.gpu.attention`) need Hopper (``wgmma``, TMA);
this kernel serves every other NVIDIA generation the runtime targets: Ampere (8.0, 8.6),
Ada (8.9), Blackwell (10.x, 12.x), and Hopper geometries the Mosaic GPU kernel refuses. One
kernel serves both entry points: :func:`ragged_paged_attention_triton` (any mix of decode rows,
whole prefills, chunked prefills and prefix-cache hits, in any order) and
:func:`paged_attention_triton` (decode: the same kernel fed one tile per sequence). Semantics
are exactly those of the oracles in :mod:`kernels_pallas.reference`.

Why Triton, and for how long
----------------------------
Mosaic GPU has no matmul for pre-Hopper GPUs on the oldest JAX this package supports (0.10:
``wgmma`` and ``tcgen05`` only; JAX 0.12 adds a warp-level ``plgpu.mma`` and ``cp.async``
copies, still experimental). Pallas' Triton backend lowers the same Pallas kernel for every
capability from 8.0 on every supported JAX. It is **deprecated from JAX 0.11** (the Pallas
changelog: "The Triton backend is deprecated and will be removed in a future version of JAX.
To keep using Pallas on GPU, please migrate to the Mosaic GPU backend. To keep using Triton,
switch to the official Triton bindings and jax_triton"; JAX 0.12's lowering emits a
``DeprecationWarning``, id ``jax-pallas-triton``); no removal release is announced. The
replacement is a Mosaic GPU kernel built on ``plgpu.mma`` for 8.x once the oldest supported
JAX has it, or this kernel through ``jax_triton``. Until then the dispatch falls back to the
XLA path with one warning if the backend disappears or fails to build (compile probe).

Shape letters: B sequences, T query tokens, H query heads, K kv heads, G = H // K, D head dim,
L layers, N blocks, S block size, M max blocks per sequence, W query tiles, I work items
(tile x KV split), R rows of one query tile, C packed rows and P heads per 32-bit word of the
page layout.

Pages are the stacked token-major ``kv_pages [L, N, S, C, P, D]`` of
:mod:`kernels_pallas.kv_layout` (``layer`` picks one; ``num_kv_heads`` says K, which the shape
does not when an 8-bit cache pads a dummy head): kv head ``h``'s K is combined head ``2h``, its
V ``2h + 1``, and combined head ``c`` of a token sits at ``[..., c // P, c % P, :]``, so in the
row-major pages a token's ``C * P`` combined heads are consecutive ``D``-element rows.

Design (one Triton program)
---------------------------
* **Query tiles and work items** come from :mod:`kernels_pallas.gpu.work`, shared with the
  Mosaic GPU kernel: each sequence's query rows are cut into tiles of ``R // G`` tokens
  (decode: one token, ``R = max(16, G)`` rounded up to a power of two, Triton's smallest
  ``dot``), so a tile holds ``R // G`` tokens x the ``G`` heads of one kv head and every KV
  page is read once per GQA group; each live tile's key range is split into KV splits of
  whole 64-token steps by need (flash-decoding), within a static item budget.
* **Grid** ``(I, K)``. A dead item (no steps) returns at once; the combine ignores it.
* **KV steps.** A step is 64 keys, gathered token by token straight from the token-major
  pages (no relayout copy): key ``t`` lives at slot ``slot = block_tables[seq, t // S] * S +
  t % S``, and its K / V are rows ``slot * C * P + 2h`` / ``+ 1`` of the layer's
  ``[N * S * C * P, D]`` view of the pages (a free reshape), so a step is two strided
  ``[64, D]`` row loads (row stride ``C * P * D`` within a page) and any block size works.
  Block ids are clamped into ``[0, N)``, so a junk table entry never addresses memory outside
  the cache.
* **Math.** ``Q K^T`` (f32 accumulation; IEEE products for f32 queries, not Triton's
  default TF32), soft cap, causal / sliding-window / range mask with ``where`` (NaN cannot
  pass a select), online softmax in f32, ``O = alpha O + P V`` with ``P`` in the pages'
  compute dtype. V rows outside the key range are zeroed before the matmul (``0 * NaN``
  would leak through it).
* **8-bit pages** (int8, float8_e4m3fn): converted to the queries' dtype in registers (exact:
  int8 and e4m3 values are representable in bf16/f16/f32); the layer's K scale joins the
  softmax scale and its V scale multiplies the combined output. float8 needs compute
  capability 8.9 (Triton's fp8 conversions).
* **Combine** (XLA): per tile, the items' normalised partials weighted by their log-sum-exp;
  attention sinks join here as one more partial with a zero value vector and the sink logit
  as its log-sum-exp, which is exactly the sink's place in the softmax denominator.

Limits (:func:`unsupported_reason`): head_dim a power of two from 16 to 256 (Triton block
shapes), 1 <= G <= 64, compute capability >= 8.0 (float8 pages: >= 8.9).

Interpret mode (``interpret=True``) runs the same kernel body with Pallas' generic
interpreter on the CPU (the tests); the compiled path is checked on any host by exporting for
CUDA under :func:`kernels_pallas.aot.cuda_target`, which runs the Pallas-to-Triton lowering.
JAX API differences go through :mod:`kernels_pallas.compat`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import compat, reference
from kernels_pallas.gpu.work import (
    BLOCK_KV,
    M_FIRST,
    M_HI,
    M_LAYER,
    M_LO,
    M_NQ,
    M_POS0,
    M_ROW0,
    M_SEQ,
    M_STEPS,
    combine,
    decode_work,
    plan_items,
    ragged_work,
)

__all__ = [
    "MIN_CAPABILITY",
    "paged_attention_triton",
    "ragged_paged_attention_triton",
    "unsupported_reason",
]

MIN_CAPABILITY = (8, 0)  # Ampere: mma.sync with bf16, cp.async
FP8_CAPABILITY = (8, 9)  # Triton converts float8_e4m3fn from Ada on
_MIN_ROWS = 16  # Triton's dot needs M >= 16
_RAGGED_ROWS = 64  # rows of a ragged query tile (32 at D = 256: the f32 accumulator's registers)
_MAX_HEAD_DIM = 256
_MAX_G = 64
_NEG_INF = float("-inf")
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_EIGHT_BIT = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _capability_key(capability: str) -> tuple[int, int]:
    major, _, minor = str(capability).partition(".")
    return int(major), int(minor or 0)


# ---------------------------------------------------------------------------------------------
# Support checks
# ---------------------------------------------------------------------------------------------


def unsupported_reason(
    *, head_dim: int, num_q_per_kv: int, block_size: int, dtype, capability: str | None = None
) -> str | None:
    """Why the compiled Triton kernel cannot take this geometry, or ``None`` if it can.

    Args:
      head_dim: D.
      num_q_per_kv: G = H // K.
      block_size: S (any positive size: keys are gathered token by token).
      dtype: the pages' dtype (float, or 8-bit with scales).
      capability: the targeted compute capability ("8.0", ...), or None not to check it.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in _FLOAT_DTYPES + _EIGHT_BIT:
        return f"the Triton kernel does not read {dtype.name} pages"
    if head_dim != _pow2(head_dim) or not 16 <= head_dim <= _MAX_HEAD_DIM:
        return (
            f"head_dim={head_dim} is not a power of two from 16 to {_MAX_HEAD_DIM} (Triton "
            "block shapes are powers of two)"
        )
    if not 1 <= num_q_per_kv <= _MAX_G:
        return f"query heads per kv head ({num_q_per_kv}) must be 1 to {_MAX_G}"
    if block_size < 1:
        return f"block_size={block_size} must be positive"
    if capability is not None:
        cap = _capability_key(capability)
        if cap < MIN_CAPABILITY:
            return (
                f"compute capability {capability}: the Triton kernel needs 8.0 or newer "
                "(bf16 mma.sync)"
            )
        if dtype == jnp.dtype(jnp.float8_e4m3fn) and cap < FP8_CAPABILITY:
            return (
                f"float8_e4m3fn pages on compute capability {capability}: Triton converts "
                "float8 from 8.9"
            )
    return None


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration of one kernel instance."""

    g: int  # query heads per kv head
    d: int  # head dim
    s: int  # block size
    m: int  # max blocks per sequence
    n: int  # blocks per layer
    kv_heads: int
    heads_per_slot: int  # C * P: combined (K, V and dummy) heads of one token
    rows: int  # R: rows of a query tile (tokens_per_tile * G, rounded up to a power of two)
    dtype: jnp.dtype  # compute dtype: the queries'
    quantized: bool  # 8-bit pages (k_scale joins the softmax scale)
    sm_scale: float
    soft_cap: float | None
    window: int | None
    interpret: bool

    @property
    def tokens_per_tile(self) -> int:
        return self.rows // self.g


def _kernel(
    items_ref,  # i32[I, 10]: tile metadata + the split's first step and step count
    tables_ref,  # i32[B, M]: block ids
    scales_ref,  # f32[2]: the layer's (k_scale, v_scale); read for 8-bit pages only
    q_ref,  # [K, Rq, D]: each kv head's query rows, token-major (row = token * G + head)
    kv_ref,  # [L, N * S * C * P, D]: the pages' head rows (row = slot * C * P + combined head)
    o_ref,  # f32[I, K, R, D]: each item's normalised partial output
    lse_ref,  # f32[I, K, R]: each item's log-sum-exp per row (-inf: no key)
    *,
    cfg: _Cfg,
):
    """One (work item, kv head): online softmax over the item's KV steps of one query tile."""
    item = pl.program_id(0)
    kh = pl.program_id(1)
    n_steps = items_ref[item, M_STEPS]

    @pl.when(n_steps > 0)
    def _live():
        seq = items_ref[item, M_SEQ]
        row0 = items_ref[item, M_ROW0]
        nq = items_ref[item, M_NQ]
        pos0 = items_ref[item, M_POS0]
        lo = items_ref[item, M_LO]
        hi = items_ref[item, M_HI]
        layer = items_ref[item, M_LAYER]
        first = items_ref[item, M_FIRST]
        r, bkv = cfg.rows, BLOCK_KV

        q = q_ref[kh, pl.ds(row0 * cfg.g, r), :]  # [R, D]
        scale = cfg.sm_scale * scales_ref[0] if cfg.quantized else cfg.sm_scale
        # Row i of the tile is token i // G of the tile, head i % G of the group.
        tok = lax.div(lax.broadcasted_iota(jnp.int32, (r, bkv), 0), cfg.g)
        qpos = pos0 + tok
        row_ok = tok < nq
        col = lax.broadcasted_iota(jnp.int32, (r, bkv), 1)
        key = lax.broadcasted_iota(jnp.int32, (bkv,), 0)
        # f32 pages: IEEE products (Triton's default f32 dot is TF32, ~1e-3 off the oracle).
        precision = lax.Precision.HIGHEST if cfg.dtype == jnp.float32 else None

        def step(i, carry):
            acc, m_i, l_i = carry  # f32[R, D], f32[R], f32[R]
            start = (first + i) * bkv
            kpos = start + key  # [64] absolute key positions
            page = lax.div(kpos, cfg.s)
            keep = (kpos >= lo) & (kpos < hi) & (page < cfg.m)  # [64]
            blk = tables_ref[seq, jnp.clip(page, 0, cfg.m - 1)]  # [64]
            slot = jnp.clip(blk, 0, cfg.n - 1) * cfg.s + lax.rem(kpos, cfg.s)
            row = slot * cfg.heads_per_slot + 2 * kh  # combined head 2h: K; 2h + 1: V
            k = kv_ref[layer, row, :].astype(cfg.dtype)  # [64, D], row stride C * P * D
            v = kv_ref[layer, row + 1, :].astype(cfg.dtype)  # [64, D]
            v = jnp.where(keep[:, None], v, jnp.zeros_like(v))  # unwritten slots may be NaN

            logits = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=precision,
                preferred_element_type=jnp.float32,
            )  # fmt: skip  # [R, 64]
            logits = logits * scale
            if cfg.soft_cap is not None:
                logits = cfg.soft_cap * jnp.tanh(logits / cfg.soft_cap)
            kcol = start + col
            mask = row_ok & (kcol <= qpos) & keep[None, :]
            if cfg.window is not None:
                mask &= kcol > qpos - cfg.window
            logits = jnp.where(mask, logits, _NEG_INF)
            m_new = jnp.maximum(m_i, logits.max(axis=1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            alpha = jnp.exp(m_i - m_safe)
            p = jnp.where(mask, jnp.exp(logits - m_safe[:, None]), 0.0)
            l_i = l_i * alpha + p.sum(axis=1)
            pv = lax.dot_general(
                p.astype(cfg.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            return acc * alpha[:, None] + pv, m_new, l_i

        init = (
            jnp.zeros((r, cfg.d), jnp.float32),
            jnp.full((r,), _NEG_INF, jnp.float32),
            jnp.zeros((r,), jnp.float32),
        )
        acc, m_i, l_i = lax.fori_loop(0, n_steps, step, init)
        has = l_i > 0.0
        l_safe = jnp.where(has, l_i, 1.0)
        o_ref[item, kh, :, :] = acc * jnp.where(has, 1.0 / l_safe, 0.0)[:, None]
        lse_ref[item, kh, :] = jnp.where(has, m_i + jnp.log(l_safe), _NEG_INF)


def _run_kernel(items, tables, scales, q_rows, kv_rows, cfg: _Cfg):
    """Launch the kernel. Returns partial ``o f32[I, K, R, D]`` and ``lse f32[I, K, R]``."""
    num_items = items.shape[0]
    out_shape = (
        jax.ShapeDtypeStruct((num_items, cfg.kv_heads, cfg.rows, cfg.d), jnp.float32),
        jax.ShapeDtypeStruct((num_items, cfg.kv_heads, cfg.rows), jnp.float32),
    )
    return pl.pallas_call(
        functools.partial(_kernel, cfg=cfg),
        out_shape=out_shape,
        grid=(num_items, cfg.kv_heads),
        compiler_params=compat.triton_compiler_params(
            num_warps=8 if cfg.d * cfg.rows > 64 * 128 else 4, num_stages=2
        ),
        interpret=cfg.interpret,
        name="paxcache_paged_attention_triton",
    )(items, tables, scales, q_rows, kv_rows)


def _q_rows(q: jax.Array, kv_heads: int, rows: int) -> jax.Array:
    """``[T, H, D] -> [K, T * G + R, D]``: each kv head's rows, token-major, padded so that an
    R-row tile starting at any real token stays in bounds."""
    t, h, d = q.shape
    g = h // kv_heads
    qg = q.reshape(t, kv_heads, g, d).transpose(1, 0, 2, 3).reshape(kv_heads, t * g, d)
    return jnp.pad(qg, ((0, 0), (0, rows), (0, 0)))


def _head_rows(kv_pages: jax.Array) -> jax.Array:
    """``[L, N, S, C, P, D] -> [L, N * S * C * P, D]``: every token's combined heads as rows
    (a free reshape of the row-major pages: no copy)."""
    layers, n, s, c, p, d = kv_pages.shape
    return kv_pages.reshape(layers, n * s * c * p, d)


def _make_cfg(q, kv_pages, num_kv_heads, block_tables, rows, *, sm_scale, soft_cap,
              sliding_window, interpret) -> _Cfg:  # fmt: skip
    if kv_pages.ndim != 6:
        raise ValueError(
            f"Triton paged attention: kv_pages must be [L, N, S, C, P, D], got {kv_pages.shape}"
        )
    _, n, s, c, p, d = kv_pages.shape
    kv_heads = int(num_kv_heads)
    if not 0 < 2 * kv_heads <= c * p or q.shape[1] % kv_heads:
        raise ValueError(
            f"Triton paged attention: num_kv_heads={kv_heads} does not fit pages "
            f"{kv_pages.shape} and {q.shape[1]} query heads"
        )
    g = q.shape[1] // kv_heads
    problem = unsupported_reason(head_dim=d, num_q_per_kv=g, block_size=s, dtype=kv_pages.dtype)
    if problem is not None:
        raise ValueError(f"Triton paged attention: {problem}")
    return _Cfg(
        g=g, d=d, s=s, m=block_tables.shape[1], n=n, kv_heads=kv_heads, heads_per_slot=c * p,
        rows=rows, dtype=jnp.dtype(q.dtype), quantized=jnp.dtype(kv_pages.dtype) in _EIGHT_BIT,
        sm_scale=float(sm_scale), soft_cap=None if soft_cap is None else float(soft_cap),
        window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret),
    )  # fmt: skip


def _scales(k_scale, v_scale) -> jax.Array:
    """``f32[2]``: the layer's K and V scales (1.0 when not given)."""
    return jnp.stack(
        [jnp.asarray(1.0 if x is None else x, jnp.float32).reshape(()) for x in (k_scale, v_scale)]
    )


def _sink_rows(sinks, kv_heads: int, g: int, rows: int):
    """``f32[H]`` sinks -> ``f32[K, R]``: row ``i`` of a kv head's tile is head ``i % G``."""
    if sinks is None:
        return None
    return jnp.asarray(sinks, jnp.float32).reshape(kv_heads, g)[:, jnp.arange(rows) % g]


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

_STATIC = ("num_kv_heads", "sm_scale", "soft_cap", "sliding_window", "interpret", "num_splits")


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention_triton(
    q: jax.Array,
    kv_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    num_kv_heads: int,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    num_splits: int | None = None,
    layer: jax.Array | int | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decode attention over paged KV (one query token per sequence, at ``lengths[b] - 1``).

    Arguments are validated by :func:`kernels_pallas.attention.paged_attention`.

    Args:
      q: ``[B, H, D]`` queries.
      kv_pages: ``[L, N, S, C, P, D]`` stacked token-major pages
        (:mod:`kernels_pallas.kv_layout`; ``layer`` picks one): the queries' dtype, or int8 /
        float8_e4m3fn with ``k_scale`` / ``v_scale``.
      lengths: ``i32[B]``; 0 marks a padding row (output zeros).
      block_tables: ``i32[B, M]``; entries past a sequence's length are never used.
      num_kv_heads: K (static; ``C * P / 2`` less a dummy head of an 8-bit cache).
      sm_scale: logit scale.
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)`` if set.
      sliding_window: keys in ``(pos - window, pos]`` only, if set.
      interpret: run with Pallas' interpreter (CPU tests).
      num_splits: exactly this many KV splits per live sequence (at most its 64-key steps);
        default: splits by need (:func:`kernels_pallas.gpu.work.split_work`).
      layer: layer index into the stacked pages (read in the kernel, no copy; default 0).
      k_scale, v_scale: the layer's dequantization scales (8-bit pages).
      sinks: optional ``f32[H]`` sink logits (softmax denominator only).

    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    b, h, d = q.shape
    kv_heads = num_kv_heads
    g = h // kv_heads
    rows = max(_MIN_ROWS, _pow2(g))
    cfg = _make_cfg(
        q, kv_pages, num_kv_heads, block_tables, rows, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret,
    )  # fmt: skip
    tiles = decode_work(lengths, sliding_window, 0 if layer is None else layer)
    items, item_tile = plan_items(tiles, kv_heads, num_splits, cfg.interpret)
    scales = _scales(k_scale, v_scale)
    o, lse = _run_kernel(
        items, block_tables.astype(jnp.int32), scales, _q_rows(q, kv_heads, rows),
        _head_rows(kv_pages), cfg,
    )  # fmt: skip
    out = combine(o, lse, item_tile, b, _sink_rows(sinks, kv_heads, g, rows))[:, :, :g]
    if cfg.quantized:
        out = out * scales[1]
    return out.reshape(b, h, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_paged_attention_triton(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    num_kv_heads: int,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    num_splits: int | None = None,
    layer: jax.Array | int | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged causal attention over paged KV (decode, prefill, chunks, prefix hits, any order).

    Arguments are validated by :func:`kernels_pallas.attention.ragged_paged_attention`.

    Args:
      q: ``[T, H, D]``; sequence ``s < num_seqs`` owns rows ``cu_q_lens[s]:cu_q_lens[s+1]``,
        the last ``q_len`` of its ``kv_lens[s]`` tokens. Rows past ``cu_q_lens[num_seqs]``
        are padding (output zeros).
      kv_pages, num_kv_heads: as in :func:`paged_attention_triton`.
      kv_lens: ``i32[B]``.
      block_tables: ``i32[B, M]``.
      cu_q_lens: ``i32[B + 1]``.
      num_seqs: scalar.
      sm_scale, soft_cap, sliding_window, interpret, num_splits, layer, k_scale, v_scale,
        sinks: as in :func:`paged_attention_triton` (``num_splits`` per live query tile).

    Returns:
      ``[T, H, D]`` in ``q.dtype``.
    """
    t, h, d = q.shape
    kv_heads = num_kv_heads
    g = h // kv_heads
    rows = max(_RAGGED_ROWS if d <= 128 else _RAGGED_ROWS // 2, _pow2(g))
    cfg = _make_cfg(
        q, kv_pages, num_kv_heads, block_tables, rows, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret,
    )  # fmt: skip
    tpt = cfg.tokens_per_tile
    tiles, tile_of_row, slot_of_row = ragged_work(
        kv_lens, cu_q_lens, num_seqs, t, tpt, sliding_window, 0 if layer is None else layer
    )
    items, item_tile = plan_items(tiles, kv_heads, num_splits, cfg.interpret)
    scales = _scales(k_scale, v_scale)
    o, lse = _run_kernel(
        items, block_tables.astype(jnp.int32), scales, _q_rows(q, kv_heads, rows),
        _head_rows(kv_pages), cfg,
    )  # fmt: skip
    out = combine(o, lse, item_tile, tiles.shape[0], _sink_rows(sinks, kv_heads, g, rows))
    out = out[:, :, : tpt * g].reshape(out.shape[0], kv_heads, tpt, g, d)
    out = out[tile_of_row, :, slot_of_row]  # [T, K, G, D]
    _, _, valid = reference.ragged_row_info(cu_q_lens, kv_lens, num_seqs, t)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    if cfg.quantized:
        out = out * scales[1]
    return out.reshape(t, h, d).astype(q.dtype)
