"""Pieces shared by the Mosaic TPU paged-attention kernels (decode and ragged).

* :class:`TableRows`: block-table rows fetched on demand. Tables stay in HBM
  (``memory_space=ANY``) and one sequence's row ``i32[M]`` at a time is DMA'd into a two-slot
  SMEM scratch, so a batch's tables (256 sequences x 32K tokens = 2 MiB at ``S = 16``) never
  have to fit in SMEM (1 MiB on v5e/v6e, shared with the other scalars).
* :class:`KVStream`: the DMAs that bring ``P`` KV pages of one layer, all ``K`` kv heads at
  once (one descriptor per page: ``pages.at[layer, :, block]`` is ``[K, S, D]``), into one
  slot of a double-buffered VMEM scratch ``[2, K, P, S, D]``. Pages outside
  ``[first, end)`` are neither copied nor waited on (their VMEM rows keep stale data, which
  the caller masks with ``where``); negative block ids are clamped to 0 for addressing.
* :func:`attend_step`: one flash-attention update of the ``(m, l, acc)`` VMEM state of every
  kv head, with bf16/f16 operands fed to the MXU as they are (float32 accumulation), a
  ``where``-mask so NaN garbage in masked keys/values cannot reach the result.

A DMA semaphore counts bytes, not copies: waiting for one copy on a semaphore shared by
several only says that *some* copy of that size landed. Both helpers therefore wait for every
copy of a slot before anything in that slot is read.

``MASK_VALUE`` is finite, so fully masked rows keep ``m = MASK_VALUE`` and ``l = 0`` (their
output becomes zeros, never NaN).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

#: VMEM the KV double buffers may take (K and V, two slots): well inside the 16 MiB scoped
#: VMEM default of v4/v5e, so the query/output blocks and the softmax state fit next to them.
KV_VMEM_BUDGET = 4 * 1024 * 1024


def default_pages_per_compute_block(
    block_size: int, max_blocks: int, target_tokens: int, *, kv_heads: int, head_dim: int,
    itemsize: int,
) -> int:  # fmt: skip
    """Pages per compute step: about ``target_tokens`` keys, at most ``max_blocks`` pages,
    and small enough that the four ``[K, P, S, D]`` KV buffers fit :data:`KV_VMEM_BUDGET`."""
    per_page = 4 * kv_heads * block_size * head_dim * itemsize
    p = min(max_blocks, target_tokens // block_size, KV_VMEM_BUDGET // per_page)
    return int(max(1, p))


@dataclasses.dataclass(frozen=True)
class TableRows:
    """One sequence's block-table row at a time, HBM -> SMEM (two slots).

    Attributes:
      tables_hbm: ``i32[B, M]`` block tables left in HBM.
      rows: ``i32[2, M]`` SMEM scratch.
      sems: DMA semaphores ``[2]``, one per slot.
    """

    tables_hbm: Any
    rows: Any
    sems: Any

    def _copy(self, seq: jax.Array, tslot: jax.Array):
        return pltpu.make_async_copy(
            self.tables_hbm.at[seq], self.rows.at[tslot], self.sems.at[tslot]
        )

    def start(self, seq: jax.Array, tslot: jax.Array) -> None:
        self._copy(seq, tslot).start()

    def wait(self, seq: jax.Array, tslot: jax.Array) -> None:
        self._copy(seq, tslot).wait()


@dataclasses.dataclass(frozen=True)
class KVStream:
    """DMAs of up to ``P`` pages (all kv heads) of one layer from HBM into a VMEM slot.

    Attributes:
      k_hbm, v_hbm: ``[L, K, N, S, D]`` refs left in HBM (``memory_space=ANY``).
      k_buf, v_buf: ``[2, K, P, S, D]`` VMEM scratch (two slots for double buffering).
      k_sem, v_sem: DMA semaphores ``[2]``, one per slot.
      table: ``i32[2, M]`` SMEM rows (see :class:`TableRows`).
      layer: scalar selecting ``k_hbm.at[layer]``.
    """

    k_hbm: Any
    v_hbm: Any
    k_buf: Any
    v_buf: Any
    k_sem: Any
    v_sem: Any
    table: Any
    layer: jax.Array

    def _copies(self, tslot: jax.Array, first_page: jax.Array, slot: jax.Array):
        n_pages = self.k_buf.shape[2]
        max_blocks = self.table.shape[1]
        out = []
        for j in range(n_pages):
            page = first_page + j
            block = jnp.maximum(self.table[tslot, jnp.clip(page, 0, max_blocks - 1)], 0)
            kc = pltpu.make_async_copy(
                self.k_hbm.at[self.layer, :, block],  # [K, S, D]
                self.k_buf.at[slot, :, j],
                self.k_sem.at[slot],
            )
            vc = pltpu.make_async_copy(
                self.v_hbm.at[self.layer, :, block],
                self.v_buf.at[slot, :, j],
                self.v_sem.at[slot],
            )
            out.append((page, kc, vc))
        return out

    def start(self, tslot, first_page, end_page, slot) -> None:
        """Start copying pages ``first_page + j`` (``j < P``) that are ``< end_page``."""
        for page, kc, vc in self._copies(tslot, first_page, slot):

            @pl.when(page < end_page)
            def _start(kc=kc, vc=vc):
                kc.start()
                vc.start()

    def wait(self, tslot, first_page, end_page, slot) -> None:
        """Wait for every copy :meth:`start` issued with the same arguments."""
        for page, kc, vc in self._copies(tslot, first_page, slot):

            @pl.when(page < end_page)
            def _wait(kc=kc, vc=vc):
                kc.wait()
                vc.wait()


def attend_step(
    q_ref: Any,
    k_buf: Any,
    v_buf: Any,
    slot: jax.Array,
    state: tuple[Any, Any, Any],
    mask: jax.Array,
    key_ok: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None,
) -> None:
    """One flash-attention step of R query rows against ``C = P * S`` keys, every kv head.

    Args:
      q_ref: ``[K, R, D]`` queries (VMEM, input dtype: bf16 stays bf16 on the MXU).
      k_buf, v_buf: ``[2, K, P, S, D]`` VMEM; slot ``slot`` holds this step's pages. Keys not
        in ``mask`` may hold anything (NaN included).
      slot: which buffer slot.
      state: ``(m f32[K, R, 1], l f32[K, R, 1], acc f32[K, R, D])`` VMEM refs, updated.
      mask: ``bool[R, C]``, which (row, key) pairs count.
      key_ok: ``bool[C, 1]``, keys that count for at least one row (others are zeroed so NaN
        garbage cannot pass through ``p @ v``).
      sm_scale: logit scale (applied to the float32 logits).
      soft_cap: optional logit soft cap.
    """
    m_ref, l_ref, acc_ref = state
    _, kh, n_pages, s, d = k_buf.shape  # [2, K, P, S, D]
    keys = n_pages * s

    @pl.loop(0, kh)
    def _head(h):
        k = k_buf[slot, h].reshape(keys, d)  # [C, D]
        v = v_buf[slot, h].reshape(keys, d)
        k = jnp.where(key_ok, k, jnp.zeros_like(k))
        v = jnp.where(key_ok, v, jnp.zeros_like(v))
        q = q_ref[h]  # [R, D]
        logits = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [R, C]
        logits = logits * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(mask, logits, MASK_VALUE)
        m_prev = m_ref[h]  # [R, 1]
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)
        l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, D]
        acc_ref[h] = alpha * acc_ref[h] + pv
        m_ref[h] = m_new


def reset_state(state: tuple[Any, Any, Any]) -> None:
    """``m = MASK_VALUE``, ``l = 0``, ``acc = 0`` for every head."""
    m_ref, l_ref, acc_ref = state
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def finish(l_i: jax.Array, acc: jax.Array) -> jax.Array:
    """``acc / l`` with rows that saw no key returning zeros."""
    return acc / jnp.where(l_i > 0.0, l_i, 1.0)


def state_scratch(kv_heads: int, rows: int, head_dim: int) -> list:
    """VMEM scratch shapes of ``(m, l, acc)``."""
    return [
        pltpu.VMEM((kv_heads, rows, 1), jnp.float32),
        pltpu.VMEM((kv_heads, rows, 1), jnp.float32),
        pltpu.VMEM((kv_heads, rows, head_dim), jnp.float32),
    ]


def pipeline_scratch(
    *, kv_heads: int, rows: int, pages: int, block_size: int, head_dim: int, max_blocks: int,
    k_dtype: Any, v_dtype: Any,
) -> list:  # fmt: skip
    """Every scratch buffer of an attention kernel, in the order its body receives them.

    ``i32[2, M]`` SMEM table rows (:class:`TableRows`), the ``[2, K, P, S, D]`` K and V VMEM
    double buffers (:class:`KVStream`), the ``(m, l, acc)`` softmax state of ``rows`` query
    rows per kv head (:func:`state_scratch`), then the DMA semaphores ``[2]`` of the table
    rows, K and V.
    """
    kv_shape = (2, kv_heads, pages, block_size, head_dim)
    return [
        pltpu.SMEM((2, max_blocks), jnp.int32),
        pltpu.VMEM(kv_shape, k_dtype),
        pltpu.VMEM(kv_shape, v_dtype),
        *state_scratch(kv_heads, rows, head_dim),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
    ]
