"""Pure-jnp oracles for every kernel in :mod:`kernels_pallas`.

These functions define the semantics the Pallas kernels must meet; tests compare every kernel
against them. They are written to be obviously correct first (plain gathers and a masked
softmax in float32). ``ragged_paged_attention_xla`` is a fast, memory-light formulation of the
same math (an online softmax over chunks of block columns, gathering straight from stacked
``[L, N, S, C, P, Dp]`` pages) that ``impl="auto"`` runs on CPU.

Shape letters: B batch, T tokens, H query heads, K kv heads (G = H // K query heads per kv
head), D head dim, N blocks, S block size, M max blocks per sequence, C packed rows and P
heads per 32-bit word of the page layout (:mod:`kernels_pallas.kv_layout`).

Conventions shared by all kernels:

* KV pages are one layer's ``[N, S, C, P, D]`` (attention oracles) or the stacked
  ``[L, N, S, C, P, D]`` (the rest), K and V of each head side by side
  (:mod:`kernels_pallas.kv_layout`); the token at position ``p`` of a sequence lives in block
  ``block_tables[seq, p // S]`` at offset ``p % S``; a slot index is ``block * S + offset``.
* A negative block id means "no block"; it is never dereferenced (clamped to 0 for addressing
  and masked by length).
* Keys at or past a sequence's length are never read into the result: masking uses ``where``
  on both logits and values, so NaN garbage in unwritten slots cannot leak into the output.
* A query at position ``p`` sees keys at positions ``(p - sliding_window, p]``.
* Rows with nothing to attend to (a decode row of length 0, padding rows) return zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.kv_layout import split_kv

__all__ = [
    "paged_attention_reference",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
    "write_kv_reference",
    "copy_blocks_reference",
    "swap_blocks_reference",
    "ragged_row_info",
]

_NEG_INF = float("-inf")


def _as_arrays(*xs):
    """Accept NumPy (or list) inputs too: gathers with traced indices need JAX arrays."""
    return tuple(jnp.asarray(x) for x in xs)


def _head_major(kv_pages: jax.Array, num_kv_heads: int | None) -> tuple[jax.Array, jax.Array]:
    """One layer's ``[N, S, C, P, D]`` pages as head-major ``(k, v)``, each ``[K, N, S, D]``
    (``num_kv_heads`` default: every packed head is real, ``C * P / 2``)."""
    kh = kv_pages.shape[-3] * kv_pages.shape[-2] // 2 if num_kv_heads is None else num_kv_heads
    k, v = split_kv(kv_pages, kh)  # [N, S, K, D]
    return jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0)


def _real(pages: jax.Array, scale: jax.Array | float | None) -> jax.Array:
    """Gathered pages in float32 real units: ``x * scale`` for 8-bit caches (scale given)."""
    x = pages.astype(jnp.float32)
    return x if scale is None else x * jnp.asarray(scale, jnp.float32)


def _scale_and_cap(logits: jax.Array, sm_scale: float, soft_cap: float | None) -> jax.Array:
    logits = logits * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    return logits


def _masked_softmax_pv(
    logits: jax.Array, mask: jax.Array, v: jax.Array, spec: str, sinks: jax.Array | None = None
) -> jax.Array:
    """softmax(logits) @ v over the masked keys; all-masked rows give zeros, never NaN.

    ``sinks`` (broadcastable to ``logits[..., :1]``): one more logit per row that joins the
    softmax denominator only (its value vector is zero).
    """
    logits = jnp.where(mask, logits, _NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks - m)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum(spec, p, v)


def _sinks_kgd(sinks: jax.Array | None, k_heads: int, g: int) -> jax.Array | None:
    """f32[H] per-head sink logits as ``[K, G, 1]`` (query head ``k * G + j``), or None."""
    if sinks is None:
        return None
    return jnp.asarray(sinks, jnp.float32).reshape(k_heads, g, 1)


def paged_attention_reference(
    q: jax.Array,
    kv_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    num_kv_heads: int | None = None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decode attention: one query token per sequence, at position ``lengths[b] - 1``.

    Args:
      q: ``[B, H, D]`` queries.
      kv_pages: ``[N, S, C, P, D]``, one layer's pages.
      lengths: ``i32[B]`` tokens in each sequence (0 = padding row, output zeros).
      block_tables: ``i32[B, M]`` block ids per sequence.
      num_kv_heads: K (default ``C * P / 2``; pass it for a cache with a dummy head).
      sm_scale: logit scale, default ``D ** -0.5``.
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      sliding_window: if set, only the last ``sliding_window`` keys are seen.
      k_scale, v_scale: dequantization scales of 8-bit pages (real value = stored * scale);
        None for float pages.
      sinks: optional ``f32[H]`` attention sinks (gpt-oss): a learned logit per query head
        that joins the softmax denominator only, ``softmax([logits, sink])[:-1] @ v``. Not
        scaled, not soft-capped.

    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    q, kv_pages, lengths, block_tables = _as_arrays(q, kv_pages, lengths, block_tables)
    k_pages, v_pages = _head_major(kv_pages, num_kv_heads)
    b, h, d = q.shape
    k_heads, _, s, _ = k_pages.shape
    g = h // k_heads
    m = block_tables.shape[1]
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    tables = jnp.maximum(block_tables, 0)
    k = _real(k_pages[:, tables].reshape(k_heads, b, m * s, d), k_scale)  # [K, B, MS, D]
    v = _real(v_pages[:, tables].reshape(k_heads, b, m * s, d), v_scale)
    qg = q.reshape(b, k_heads, g, d).astype(jnp.float32)
    pos = jnp.arange(m * s)[None, :]  # [1, MS]
    lengths = lengths.astype(jnp.int32)[:, None]
    mask = pos < lengths  # [B, MS]
    if sliding_window is not None:
        mask &= pos > (lengths - 1 - sliding_window)
    mask4 = mask[:, None, None, :]  # [B, 1, 1, MS]
    v = jnp.where(mask[None, :, :, None], v, 0.0)
    logits = jnp.einsum("bkgd,kbtd->bkgt", qg, k)
    logits = _scale_and_cap(logits, sm_scale, soft_cap)
    out = _masked_softmax_pv(logits, mask4, v, "bkgt,kbtd->bkgd", _sinks_kgd(sinks, k_heads, g))
    return out.reshape(b, h, d).astype(q.dtype)


def ragged_row_info(
    cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query row: its sequence, its position in that sequence, and whether it is real.

    Args:
      cu_q_lens: ``i32[B + 1]`` cumulative query lengths; sequence ``s`` owns rows
        ``cu_q_lens[s]:cu_q_lens[s + 1]``.
      kv_lens: ``i32[B]`` total tokens of each sequence (the queries are its last ones).
      num_seqs: scalar, number of sequences that count.
      num_tokens: static T.

    Returns:
      ``(seq i32[T], pos i32[T], valid bool[T])``.
    """
    cu_q_lens, kv_lens = _as_arrays(cu_q_lens, kv_lens)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    nseq = jnp.asarray(num_seqs, jnp.int32)
    # Sequence of each row: number of sequence ends (among the real ones) at or before the row.
    ends = cu_q_lens[1:].astype(jnp.int32)
    bidx = jnp.arange(ends.shape[0], dtype=jnp.int32)
    seq = jnp.sum((ends[None, :] <= rows[:, None]) & (bidx[None, :] < nseq), axis=1)
    seq = jnp.minimum(seq, ends.shape[0] - 1).astype(jnp.int32)
    valid = rows < cu_q_lens[nseq]
    q_start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - q_start
    pos = kv_lens[seq] - q_len + (rows - q_start)
    valid &= pos >= 0
    return seq, pos.astype(jnp.int32), valid


def ragged_paged_attention_reference(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    num_kv_heads: int | None = None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged causal attention over paged KV: decode, prefill, chunked prefill, prefix hits.

    Sequence ``s < num_seqs`` owns query rows ``cu_q_lens[s]:cu_q_lens[s + 1]``; they are the
    last ``q_len`` of its ``kv_lens[s]`` tokens (their K/V are already in the pages). Row ``i``
    of the sequence is at position ``kv_lens[s] - q_len + i`` and attends causally. Rows at or
    past ``cu_q_lens[num_seqs]`` are padding and return zeros.

    This oracle gathers every row's whole sequence (``[K, T, M*S, D]``): clear, not frugal.

    Args:
      q: ``[T, H, D]``.
      kv_pages: ``[N, S, C, P, D]``, one layer's pages.
      kv_lens: ``i32[B]``.
      block_tables: ``i32[B, M]``.
      cu_q_lens: ``i32[B + 1]``.
      num_seqs: scalar ``i32``.
      num_kv_heads, sm_scale, soft_cap, sliding_window, k_scale, v_scale, sinks: as in
        :func:`paged_attention_reference`.

    Returns:
      ``[T, H, D]`` in ``q.dtype``.
    """
    q, kv_pages, kv_lens, block_tables, cu_q_lens = _as_arrays(
        q, kv_pages, kv_lens, block_tables, cu_q_lens
    )
    k_pages, v_pages = _head_major(kv_pages, num_kv_heads)
    t, h, d = q.shape
    k_heads, _, s, _ = k_pages.shape
    g = h // k_heads
    m = block_tables.shape[1]
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    seq, pos, valid = ragged_row_info(cu_q_lens, kv_lens, num_seqs, t)
    tables = jnp.maximum(block_tables[seq], 0)  # [T, M]
    k = _real(k_pages[:, tables].reshape(k_heads, t, m * s, d), k_scale)
    v = _real(v_pages[:, tables].reshape(k_heads, t, m * s, d), v_scale)
    kpos = jnp.arange(m * s)[None, :]
    mask = (kpos <= pos[:, None]) & valid[:, None]  # [T, MS]
    if sliding_window is not None:
        mask &= kpos > (pos[:, None] - sliding_window)
    v = jnp.where(mask[None, :, :, None], v, 0.0)
    qg = q.reshape(t, k_heads, g, d).astype(jnp.float32)
    logits = jnp.einsum("tkgd,ktsd->tkgs", qg, k)
    logits = _scale_and_cap(logits, sm_scale, soft_cap)
    sink = _sinks_kgd(sinks, k_heads, g)
    out = _masked_softmax_pv(logits, mask[:, None, None, :], v, "tkgs,ktsd->tkgd", sink)
    return out.reshape(t, h, d).astype(q.dtype)


#: Target bytes of one loop iteration's gathered K (and again V) in
#: :func:`ragged_paged_attention_xla`: big enough that the loop runs a few iterations (each
#: one has a fixed cost on CPU), small enough to stay in cache.
XLA_CHUNK_BYTES = 2 << 20

#: The same on a GPU with no kernel for it (``impl="auto"``'s CUDA fallback): each loop
#: iteration is a kernel launch and a GPU's caches do not hold the chunk anyway, so the chunk
#: is as large as memory allows and the gathered pages stay in their 16-bit dtype.
XLA_GPU_CHUNK_BYTES = 64 << 20


def _chunk_blocks(
    t: int, k_heads: int, s: int, d: int, m: int, itemsize: int, chunk_bytes: int | None = None
) -> int:
    """Block columns per loop iteration of the XLA path (static): ~``chunk_bytes`` (default
    :data:`XLA_CHUNK_BYTES`) of gathered K in operands of ``itemsize`` bytes."""
    per_block = t * k_heads * s * d * itemsize
    return int(max(1, min(m, (chunk_bytes or XLA_CHUNK_BYTES) // per_block)))


def ragged_paged_attention_xla(
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
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    layer: jax.Array | int | None = None,
    chunk_bytes: int | None = None,
    native_operands: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Same math as :func:`ragged_paged_attention_reference`, fast and memory-light on XLA.

    A loop over chunks of ``C`` block columns (``C`` static, so that one chunk's gathered K
    is about ``XLA_CHUNK_BYTES``) keeps an online softmax per query row: the working set is
    ``[T, C, K, S, D]``, never a row's whole sequence. The loop runs only over the chunks
    some real row can see (dynamic bounds, so not reverse-differentiable); within them, slots
    past each row's position are masked, never read into the result. A column that a row
    does not see gathers block 0 instead of the row's own block (any block: it is masked), so
    rows with short contexts in a long batch (prefill rows next to long decodes) cost cache
    hits, not memory traffic.

    Args:
      q, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale, soft_cap, sliding_window,
        k_scale, v_scale, sinks: as in :func:`ragged_paged_attention_reference` (a sink
        starts each row's online softmax as its running max with weight 1).
      kv_pages: stacked ``[L, N, S, C, P, D]`` pages: the gathers index them directly (no
        copy of the layer's pages is made); one gather brings a block's K and V.
      num_kv_heads: K.
      layer: layer index (int or traced ``i32`` scalar; default 0).
      chunk_bytes: the gathered K of one chunk (default :data:`XLA_CHUNK_BYTES`, sized for
        a CPU's caches; :data:`XLA_GPU_CHUNK_BYTES` on a GPU).
      native_operands: bf16 / f16 pages (not 8-bit) stay in their dtype: the query is
        rounded to it and both matmuls take 16-bit operands with f32 accumulation (the
        softmax stays f32). False: every operand is upcast to f32 (exact).

    Returns:
      ``[T, H, D]`` in ``q.dtype``.
    """
    q, kv_pages, kv_lens, block_tables, cu_q_lens = _as_arrays(
        q, kv_pages, kv_lens, block_tables, cu_q_lens
    )
    if kv_pages.ndim != 6:
        raise ValueError("ragged_paged_attention_xla: pages must be [L, N, S, C, P, D]")
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    t, h, d = q.shape
    s = kv_pages.shape[2]
    k_heads = num_kv_heads
    g = h // k_heads
    m = block_tables.shape[1]
    native = (
        native_operands
        and k_scale is None
        and jnp.dtype(kv_pages.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    )
    itemsize = jnp.dtype(kv_pages.dtype).itemsize if native else 4
    c = _chunk_blocks(t, k_heads, s, d, m, itemsize, chunk_bytes)
    num_chunks = -(-m // c)
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    seq, pos, valid = ragged_row_info(cu_q_lens, kv_lens, num_seqs, t)
    tables = jnp.maximum(block_tables[seq], 0)  # [T, M]
    if num_chunks * c > m:  # pad to whole chunks; padded columns are never visible
        tables = jnp.pad(tables, ((0, 0), (0, num_chunks * c - m)))
    qg = q.reshape(t, k_heads, g, d).astype(jnp.float32) * sm_scale
    if native:
        qg = qg.astype(kv_pages.dtype)
    lo = pos - (sliding_window if sliding_window is not None else (m * s + 1))  # exclusive
    first_col = jnp.maximum(lo + 1, 0) // s  # [T] first block column a row sees
    last_col = pos // s  # [T] last one
    offs = jnp.arange(c * s, dtype=jnp.int32)  # key offsets within a chunk

    def body(i, carry):
        m_i, l_i, acc = carry  # [T,K,G], [T,K,G], [T,K,G,D]
        cols = i * c + jnp.arange(c, dtype=jnp.int32)  # [C]
        seen = (cols[None, :] >= first_col[:, None]) & (cols[None, :] <= last_col[:, None])
        blk = jnp.where(seen & valid[:, None], jax.lax.dynamic_slice_in_dim(tables, i * c, c, 1), 0)
        # [T, C, S, rows, P, D] -> K and V [T, C, S, K, D] -> [T, K, C*S, D]
        kb, vb = split_kv(kv_pages[layer, blk], k_heads)
        if not native:
            kb, vb = _real(kb, k_scale), _real(vb, v_scale)
        kb = jnp.moveaxis(kb, 3, 1).reshape(t, k_heads, c * s, d)
        vb = jnp.moveaxis(vb, 3, 1).reshape(t, k_heads, c * s, d)
        kpos = i * c * s + offs[None, :]  # [1, C*S]
        mask = (kpos <= pos[:, None]) & (kpos > lo[:, None]) & valid[:, None]  # [T, C*S]
        vb = jnp.where(mask[:, None, :, None], vb, jnp.zeros((), vb.dtype))
        logits = jnp.einsum("tkgd,tksd->tkgs", qg, kb, preferred_element_type=jnp.float32)
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        mask4 = mask[:, None, None, :]
        logits = jnp.where(mask4, logits, _NEG_INF)
        m_new = jnp.maximum(m_i, jnp.max(logits, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.where(jnp.isfinite(m_i), jnp.exp(m_i - m_safe), 0.0)
        p = jnp.where(mask4, jnp.exp(logits - m_safe[..., None]), 0.0)
        l_new = alpha * l_i + jnp.sum(p, axis=-1)
        pv = jnp.einsum(
            "tkgs,tksd->tkgd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32
        )
        acc = alpha[..., None] * acc + pv
        return m_new, l_new, acc

    if sinks is None:
        m0, l0 = jnp.full((t, k_heads, g), _NEG_INF, jnp.float32), jnp.zeros((t, k_heads, g))
    else:  # the sink is one more key of logit `sink` and value 0: exp(sink - m) in l
        m0 = jnp.broadcast_to(_sinks_kgd(sinks, k_heads, g)[..., 0], (t, k_heads, g))
        l0 = jnp.ones((t, k_heads, g), jnp.float32)
    init = (m0, l0.astype(jnp.float32), jnp.zeros((t, k_heads, g, d), jnp.float32))
    # Walk only the chunks some real row can see (a column no row sees changes nothing), so
    # short sequences in a wide table cost what they need.
    col_end = jnp.minimum(jnp.max(jnp.where(valid, last_col + 1, 0)), m)
    col_start = jnp.min(jnp.where(valid, first_col, m))
    chunk_end = (col_end + c - 1) // c
    chunk_start = jnp.minimum(col_start, col_end) // c
    _, l_i, acc = jax.lax.fori_loop(chunk_start, chunk_end, body, init)
    out = acc / jnp.where(l_i > 0, l_i, 1.0)[..., None]
    return out.reshape(t, h, d).astype(q.dtype)


def write_kv_reference(
    kv_pages: jax.Array, kv_new: jax.Array, slot_mapping: jax.Array, layer: jax.Array | int = 0
) -> jax.Array:
    """Scatter T tokens' merged K/V rows into their slots of one layer; slots < 0 skipped.

    Args:
      kv_pages: ``[L, N, S, C, P, D]``.
      kv_new: ``[T, C, P, D]`` (:func:`kernels_pallas.kv_layout.merge_kv` of ``[T, K, D]``
        K and V).
      slot_mapping: ``i32[T]``, ``block * S + offset`` or negative for padding.
      layer: the layer written.

    Returns:
      The updated ``kv_pages``.
    """
    num_layers, n, s, *row = kv_pages.shape
    slots = jnp.where(slot_mapping < 0, n * s, slot_mapping)  # out of range -> dropped
    flat = kv_pages.reshape(num_layers, n * s, *row)
    flat = flat.at[layer, slots].set(kv_new.astype(kv_pages.dtype), mode="drop")
    return flat.reshape(kv_pages.shape)


def copy_blocks_reference(kv_pages: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copy whole blocks ``src[i] -> dst[i]`` in every layer; ``src[i] < 0`` skipped.

    All reads see the pages as they were before the call. Destinations must be distinct.

    Args:
      kv_pages: ``[L, N, S, C, P, D]`` (block axis 1).
      src, dst: ``i32[P]``.
    """
    n = kv_pages.shape[1]
    skip = (src < 0) | (dst < 0)
    d_idx = jnp.where(skip, n, dst)
    s_idx = jnp.maximum(src, 0)
    return kv_pages.at[:, d_idx].set(jnp.take(kv_pages, s_idx, axis=1), mode="drop")


def swap_blocks_reference(
    src_pages: jax.Array, dst_pages: jax.Array, src_ids: jax.Array, dst_ids: jax.Array
) -> jax.Array:
    """Copy blocks ``src_pages[:, src_ids[i]] -> dst_pages[:, dst_ids[i]]``.

    The math of a swap, with no regard to memory kinds; pairs with a negative id are skipped.

    Args:
      src_pages: ``[L, N_src, S, C, P, D]`` (block axis 1).
      dst_pages: ``[L, N_dst, S, C, P, D]``.
      src_ids, dst_ids: ``i32[P]``.
    """
    n_dst = dst_pages.shape[1]
    skip = (src_ids < 0) | (dst_ids < 0)
    d_idx = jnp.where(skip, n_dst, dst_ids)
    blocks = jnp.take(src_pages, jnp.maximum(src_ids, 0), axis=1)
    return dst_pages.at[:, d_idx].set(blocks.astype(dst_pages.dtype), mode="drop")
