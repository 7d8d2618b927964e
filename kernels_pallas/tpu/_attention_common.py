"""Pieces shared by the Mosaic TPU paged-attention kernels (decode and ragged).

* :class:`PageCopier`: the DMA descriptors that bring ``P`` KV pages of one kv head from HBM
  into one slot of a double-buffered VMEM scratch. Pages outside ``[first, end)`` are neither
  copied nor waited on (their VMEM rows keep stale data, which the caller masks with
  ``where``); negative block ids are clamped to 0 for addressing.
* :func:`online_softmax_step`: one flash-attention update of ``(m, l, acc)`` with a
  ``where``-mask, so NaN garbage in masked keys/values cannot reach the result.

Everything works on float32 values; ``_MASK`` is finite, so fully masked rows keep
``m = _MASK`` and ``l = 0`` (their output becomes zeros, never NaN).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


def default_pages_per_compute_block(block_size: int, max_blocks: int, target_tokens: int) -> int:
    """Pages per compute step: about ``target_tokens`` keys per step, at most ``max_blocks``."""
    return int(max(1, min(max_blocks, target_tokens // block_size)))


@dataclasses.dataclass(frozen=True)
class PageCopier:
    """DMAs of up to ``P`` pages of one (layer, kv head) from HBM into a VMEM slot.

    Attributes:
      k_hbm, v_hbm: ``[L, K, N, S, D]`` refs left in HBM (``memory_space=ANY``).
      k_buf, v_buf: ``[2, P, S, D]`` VMEM scratch (two slots for double buffering).
      k_sem, v_sem: DMA semaphores ``[2]``, one per slot.
      tables_ref: flattened ``i32[B * M]`` block tables in SMEM (scalar prefetch).
      max_blocks: ``M``.
      layer, head: scalars selecting ``k_hbm.at[layer, head]``.
    """

    k_hbm: object
    v_hbm: object
    k_buf: object
    v_buf: object
    k_sem: object
    v_sem: object
    tables_ref: object
    max_blocks: int
    layer: jax.Array
    head: jax.Array

    def _copies(self, seq: jax.Array, first_page: jax.Array, slot: jax.Array):
        n_pages = self.k_buf.shape[1]
        out = []
        for j in range(n_pages):
            page = first_page + j
            idx = seq * self.max_blocks + jnp.clip(page, 0, self.max_blocks - 1)
            block = jnp.maximum(self.tables_ref[idx], 0)
            kc = pltpu.make_async_copy(
                self.k_hbm.at[self.layer, self.head, block],
                self.k_buf.at[slot, j],
                self.k_sem.at[slot],
            )
            vc = pltpu.make_async_copy(
                self.v_hbm.at[self.layer, self.head, block],
                self.v_buf.at[slot, j],
                self.v_sem.at[slot],
            )
            out.append((page, kc, vc))
        return out

    def start(self, seq: jax.Array, first_page: jax.Array, end_page: jax.Array, slot) -> None:
        """Start copying pages ``first_page + j`` (``j < P``) that are ``< end_page``."""
        for page, kc, vc in self._copies(seq, first_page, slot):

            @pl.when(page < end_page)
            def _(kc=kc, vc=vc):
                kc.start()
                vc.start()

    def wait(self, seq: jax.Array, first_page: jax.Array, end_page: jax.Array, slot) -> None:
        """Wait for the copies :meth:`start` issued with the same arguments."""
        for page, kc, vc in self._copies(seq, first_page, slot):

            @pl.when(page < end_page)
            def _(kc=kc, vc=vc):
                kc.wait()
                vc.wait()


def online_softmax_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    key_ok: jax.Array,
    carry: tuple[jax.Array, jax.Array, jax.Array],
    *,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention step for R query rows against C keys.

    Args:
      q: ``f32[R, D]``, already multiplied by ``sm_scale``.
      k, v: ``f32[C, D]``; rows not in ``mask`` may hold anything (NaN included).
      mask: ``bool[R, C]``, which (row, key) pairs count.
      key_ok: ``bool[C, 1]``, keys that count for at least one row (others are zeroed so
        NaN garbage cannot pass through ``p @ v``).
      carry: ``(m f32[R, 1], l f32[R, 1], acc f32[R, D])``.
      soft_cap: optional logit soft cap.

    Returns:
      The updated carry.
    """
    m_prev, l_prev, acc_prev = carry
    k = jnp.where(key_ok, k, 0.0)
    v = jnp.where(key_ok, v, 0.0)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, _MASK)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc_new = alpha * acc_prev + jnp.dot(p, v, preferred_element_type=jnp.float32)
    return m_new, l_new, acc_new


def init_carry(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return (
        jnp.full((rows, 1), _MASK, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )


def finish(carry: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """``acc / l`` with rows that saw no key returning zeros."""
    _, l_i, acc = carry
    return acc / jnp.where(l_i > 0.0, l_i, 1.0)
