"""Mosaic TPU Pallas kernel: paged decode attention (one query token per sequence).

Design:

* Grid ``(C, B / C)`` with ``C = 2`` (``"parallel"``: the two TensorCores of a v4/v5p
  megacore chip each take half the sequences; one-core chips run the halves in turn) and the
  sequences of a half in order (``"arbitrary"``). Program ``(c, i)`` handles sequence
  ``b = c * B / C + i`` and walks its kv range in steps of ``P`` pages
  (``pages_per_compute_block``), all ``K`` kv heads at once. The ``G = H // K`` query heads
  of a kv head are processed together (GQA/MQA), so each KV page is read once per group.
* Scalar prefetch (SMEM): ``layer i32[1]``, ``lengths i32[B]``. Block tables stay in HBM;
  program ``i`` DMAs the *next* sequence's table row into SMEM while it computes
  (:class:`~kernels_pallas.tpu._attention_common.TableRows`), so tables of any size work and
  only the first row of each half is waited for.
* KV pages stay in HBM (``memory_space=ANY``); each step DMAs ``P`` pages, one descriptor per
  page covering every kv head (``pages.at[layer, :, block]``), into a two-slot VMEM scratch:
  step ``j + 1`` is started before step ``j`` is computed (double buffering).
* Only pages holding keys the query may see are copied: ``[first_page, cdiv(length, S))``,
  where ``first_page`` skips pages wholly outside the sliding window. Slots past the length
  are masked with ``where`` (never by multiplication), so NaN garbage cannot leak; a length-0
  row copies nothing and returns zeros. Negative block ids are clamped to 0 for addressing.
* Matmuls take the pages' dtype (bf16 on the MXU) with float32 accumulation; the online
  softmax state is float32 (``_attention_common.attend_step``).
* Stacked caches: pages are addressed as ``[L, K, N, S, D]`` and the layer is a prefetched
  scalar, so a ``lax.scan`` over layers reads ``pages.at[layer]`` without copying a layer.

Compiled for v5e and v6e in the tests (``tests/test_tpu_compile.py``) for bf16 and f32,
``D`` in {64, 128, 256}, ``G`` 1..8, ``S`` 8..128, sliding window, soft cap and tables of 256
sequences x 32K tokens; correctness is checked in TPU interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.tpu._attention_common import (
    KVStream,
    TableRows,
    attend_step,
    default_pages_per_compute_block,
    finish,
    pipeline_scratch,
    reset_state,
)

__all__ = ["paged_attention_tpu"]

_CORES = 2  # TensorCores of a megacore chip (v4, v5p)


def _decode_kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1]
    lengths_ref,  # i32[B_pad]
    # inputs
    q_ref,  # [K, G, D] block of q [B_pad, K, G, D]
    tables_hbm,  # i32[B, M] in HBM
    k_hbm,  # [L, K, N, S, D] in HBM
    v_hbm,
    # output
    o_ref,  # [K, G, D]
    # scratch
    table,  # SMEM i32[2, M]: table rows of this and the next sequence
    k_buf,  # VMEM [2, K, P, S, D]
    v_buf,
    m_ref,  # VMEM f32[K, G, 1]
    l_ref,  # VMEM f32[K, G, 1]
    acc_ref,  # VMEM f32[K, G, D]
    table_sem,  # DMA[2]
    k_sem,  # DMA[2]
    v_sem,  # DMA[2]
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    num_seqs: int,
    per_core: int,
):
    i = pl.program_id(1)
    b = pl.program_id(0) * per_core + i
    _, g, _ = q_ref.shape
    _, _, n_pages, s, _ = k_buf.shape
    keys = n_pages * s
    rows = TableRows(tables_hbm, table, table_sem)
    tslot = i % 2

    # The first sequence of this core's half fetches its own row; every program prefetches
    # the next one's, which the next program (same core, "arbitrary" order) waits for.
    @pl.when((i == 0) & (b < num_seqs))
    def _first_row():
        rows.start(b, tslot)

    @pl.when(b < num_seqs)
    def _wait_row():
        rows.wait(b, tslot)

    @pl.when((i + 1 < per_core) & (b + 1 < num_seqs))
    def _prefetch_next_row():
        rows.start(b + 1, 1 - tslot)

    length = lengths_ref[b]
    end_page = (length + s - 1) // s
    if sliding_window is not None:
        first_page = jnp.maximum(length - sliding_window, 0) // s
    else:
        first_page = jnp.int32(0)
    n_steps = (jnp.maximum(end_page - first_page, 0) + n_pages - 1) // n_pages
    stream = KVStream(k_hbm, v_hbm, k_buf, v_buf, k_sem, v_sem, table, layer_ref[0])
    state = (m_ref, l_ref, acc_ref)
    reset_state(state)
    kpos_row = lax.broadcasted_iota(jnp.int32, (g, keys), 1)
    kpos_col = lax.broadcasted_iota(jnp.int32, (keys, 1), 0)

    @pl.when(n_steps > 0)
    def _first_pages():
        stream.start(tslot, first_page, end_page, 0)

    def step(j, carry):
        slot = j % 2
        page = first_page + j * n_pages

        @pl.when(j + 1 < n_steps)
        def _next_pages():
            stream.start(tslot, page + n_pages, end_page, 1 - slot)

        stream.wait(tslot, page, end_page, slot)
        base = page * s
        mask = base + kpos_row < length
        key_ok = base + kpos_col < length
        if sliding_window is not None:
            lo = length - sliding_window  # first visible key position
            mask &= base + kpos_row >= lo
            key_ok &= base + kpos_col >= lo
        attend_step(
            q_ref, k_buf, v_buf, slot, state, mask, key_ok, sm_scale=sm_scale, soft_cap=soft_cap
        )
        return carry

    lax.fori_loop(0, n_steps, step, 0)
    o_ref[...] = finish(l_ref[...], acc_ref[...]).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "pages_per_compute_block",
    ),
)
def paged_attention_tpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: int | jax.Array | None = None,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
) -> jax.Array:
    """Paged decode attention on TPU (arguments already validated by the public wrapper).

    Args:
      q: ``[B, H, D]``.
      k_pages, v_pages: ``[K, N, S, D]``, or ``[L, K, N, S, D]`` with ``layer``.
      lengths: ``i32[B]``; 0 = padding row (zeros out).
      block_tables: ``i32[B, M]``; negative = no block.
      sm_scale: logit scale (a float; the wrapper resolves the default).
      soft_cap: optional logit soft cap.
      sliding_window: optional window (the query sees keys ``> length - 1 - window``).
      layer: layer of stacked pages (int or traced i32 scalar); ignored for rank-4 pages.
      interpret: run in TPU interpret mode (``pltpu.InterpretParams()``), e.g. on CPU.
      pages_per_compute_block: pages per DMA/compute step ``P`` (default: about 128 keys,
        capped so the KV buffers fit ``KV_VMEM_BUDGET``).

    Returns:
      ``[B, H, D]`` in ``q.dtype``.
    """
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    b, h, d = q.shape
    _, kh, _, s, _ = k_pages.shape
    g = h // kh
    m = block_tables.shape[1]
    p = pages_per_compute_block or default_pages_per_compute_block(
        s, m, 128, kv_heads=kh, head_dim=d, itemsize=k_pages.dtype.itemsize
    )
    cores = _CORES if b >= _CORES else 1
    per_core = -(-b // cores)
    b_pad = cores * per_core
    qg = q.reshape(b, kh, g, d)
    lengths = lengths.astype(jnp.int32)
    if b_pad != b:
        qg = jnp.pad(qg, ((0, b_pad - b), (0, 0), (0, 0), (0, 0)))
        lengths = jnp.pad(lengths, (0, b_pad - b))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    q_spec = pl.BlockSpec((None, kh, g, d), lambda c, i, *_: (c * per_core + i, 0, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        _decode_kernel,
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        num_seqs=b,
        per_core=per_core,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(cores, per_core),
            in_specs=[q_spec, any_spec, any_spec, any_spec],
            out_specs=q_spec,
            scratch_shapes=pipeline_scratch(
                kv_heads=kh,
                rows=g,
                pages=p,
                block_size=s,
                head_dim=d,
                max_blocks=m,
                k_dtype=k_pages.dtype,
                v_dtype=v_pages.dtype,
            ),
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paxcache_paged_decode_attention",
    )(layer_arr, lengths, qg, block_tables.astype(jnp.int32), k_pages, v_pages)
    return out[:b].reshape(b, h, d)
