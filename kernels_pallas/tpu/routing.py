"""How a ragged batch is split between the two TPU attention kernels, and the fused KV write.

:func:`mixed_rows` gives a batch's leading one-row sequences (a served step's decodes) to the
decode kernel (:mod:`kernels_pallas.tpu.paged_attention`) and the rest to the ragged kernel
(:mod:`kernels_pallas.tpu.ragged_paged_attention`); :func:`decode_rows` runs a decode-only
batch (the ``max_q_len=1`` hint) on the decode kernel alone.

With ``new_kv=(kv_new [T, C, W, Dp], slots i32[T])`` the step's KV write is fused into
those kernels: every token with a live slot is written by exactly one of them (the decode
kernel the leading decode rows', the ragged kernel every other row's, padding rows
included), one DMA per token while it attends, and each reads the step's new tokens from
``kv_new`` rather than from the pages. Both return ``(out, kv_pages)``, the pages flowing
from one kernel to the next (aliased input -> output). Slots out of range are dropped and
duplicates resolved (the last token wins) once per call here, by one XLA sort of ``T``
int32s that ``unique_slots=True`` (a served step's promise) skips; the kernels are then told
their slots are unique.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["decode_rows", "kv_pages_per_step", "leading_decode_seqs", "mixed_rows"]


def kv_pages_per_step(
    block_size: int, max_blocks: int, *, kv_heads: int, head_dim: int, q_itemsize: int,
    kv_itemsize: int, device_kind: str | None = None,
) -> int:  # fmt: skip
    """The most pages either kernel's KV double buffer holds per slot on the chip of
    ``device_kind``: the decode kernel's (:func:`~kernels_pallas.tpu.paged_attention.
    decode_pages_per_step`) or the ragged kernel's (:func:`~kernels_pallas.tpu.
    ragged_paged_attention.step_pages`); ``head_dim`` the stored ``Dp``."""
    from kernels_pallas.tpu.paged_attention import decode_pages_per_step
    from kernels_pallas.tpu.ragged_paged_attention import ragged_blocks, step_pages

    size = dict(kv_heads=kv_heads, head_dim=head_dim)
    return max(
        decode_pages_per_step(
            block_size, max_blocks, itemsize=kv_itemsize, device_kind=device_kind, **size
        ),
        step_pages(
            ragged_blocks(device_kind), block_size, max_blocks, q_itemsize=q_itemsize,
            kv_itemsize=kv_itemsize, **size,
        ),
    )  # fmt: skip


def leading_decode_seqs(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """How many sequences from the start of a ragged batch own exactly one query row.

    Args:
      cu_q_lens: ``i32[B + 1]`` cumulative query lengths.
      num_seqs: i32 scalar, the sequences that count.

    Returns:
      i32 scalar ``d``: sequences ``0 .. d - 1`` (``d <= num_seqs``) own rows ``0 .. d - 1``.
    """
    counted = jnp.arange(cu_q_lens.shape[0] - 1) < num_seqs
    one_row = (cu_q_lens[1:] - cu_q_lens[:-1] == 1) & counted
    return jnp.sum(jnp.cumprod(one_row.astype(jnp.int32)), dtype=jnp.int32)


def decode_rows(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    tables: jax.Array,
    num_seqs: jax.Array,
    layer: Any,
    interpret: bool,
    kw: dict,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    unique_slots: bool = False,
    device_kind: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """A decode-only ragged batch on the TPU decode kernel: row ``s`` is sequence ``s``.

    Rows past ``num_seqs`` (and past the table's B rows) are padding and return zeros.
    ``new_kv``: the fused write (module doc); tokens of rows past the table's B rows, which
    no decode program runs, are written by the ``write_kv`` kernel first (a shape that a
    served step does not have).
    """
    from kernels_pallas.tpu.kv_ops import live_slots, write_kv_tpu
    from kernels_pallas.tpu.paged_attention import paged_attention_tpu

    t, b = q.shape[0], tables.shape[0]
    rows = min(t, b)
    lengths = jnp.where(jnp.arange(rows) < num_seqs, kv_lens[:rows], 0)
    fused = None
    if new_kv is not None:
        kv_new, slots = new_kv
        _, n, s, *_ = kv_pages.shape  # duplicates resolved once, over all T rows
        slots = live_slots(slots.astype(jnp.int32), n * s, not unique_slots)
        if rows < t:
            tail = (kv_new[rows:], slots[rows:])
            kv_pages = write_kv_tpu(kv_pages, *tail, layer, dedupe=False, interpret=interpret)
        fused = (kv_new[:rows], slots[:rows])
    result = paged_attention_tpu(
        q[:rows], kv_pages, lengths, tables[:rows], layer=layer, interpret=interpret,
        new_kv=fused, unique_slots=True, device_kind=device_kind, **kw,
    )  # fmt: skip
    out, kv_pages = result if fused is not None else (result, kv_pages)
    if rows < t:
        out = jnp.pad(out, ((0, t - rows), (0, 0), (0, 0)))
    return out if new_kv is None else (out, kv_pages)


def mixed_rows(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    tables: jax.Array,
    cu: jax.Array,
    num_seqs: jax.Array,
    layer: Any,
    interpret: bool,
    kw: dict,
    device_kind: str | None,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    unique_slots: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Any ragged batch on TPU: its leading one-row sequences on the decode kernel, the rest on
    the ragged kernel.

    A served step puts its decodes first (the scheduler's default policy), so a mixed step's
    decode rows run with one query row group per sequence and big KV steps, as a decode-only
    step's do, instead of sharing the ragged kernel's query blocks with other sequences (where
    every row of a block is computed against each sequence's keys). The split is found from
    ``cu_q_lens`` at run time, so it is exact for any order: one-row sequences that do not lead
    simply stay in the ragged kernel. Each kernel runs under a ``lax.cond`` on having rows
    (fused: the ragged kernel also when a row past the sequences has a live slot to write).
    """
    from kernels_pallas.tpu.kv_ops import live_slots
    from kernels_pallas.tpu.ragged_paged_attention import ragged_paged_attention_tpu

    t = q.shape[0]
    n_dec = leading_decode_seqs(cu, num_seqs)
    is_dec = jnp.arange(t) < n_dec
    fused = new_kv is not None
    dec_new = rag_new = None
    rag_needed = n_dec < num_seqs
    if fused:
        kv_new, slots = new_kv
        _, n, s, *_ = kv_pages.shape
        slots = live_slots(slots.astype(jnp.int32), n * s, not unique_slots)  # once, for both
        dec_new = (kv_new, jnp.where(is_dec, slots, -1))
        rag_new = (kv_new, jnp.where(is_dec, -1, slots))
        rag_needed |= jnp.any(rag_new[1] >= 0)

    def decode_part(kv):
        return decode_rows(
            q, kv, kv_lens, tables, n_dec, layer, interpret, kw, dec_new, True, device_kind
        )

    def ragged_part(kv):
        return ragged_paged_attention_tpu(
            q, kv, kv_lens, tables, cu, num_seqs, n_dec, layer=layer, interpret=interpret,
            device_kind=device_kind, new_kv=rag_new, unique_slots=True, **kw,
        )  # fmt: skip

    def zeros(kv):
        out = jnp.zeros(q.shape, q.dtype)
        return (out, kv) if fused else out

    if fused:  # the pages flow through both kernels (each aliases them input -> output)
        dec, kv_pages = lax.cond(n_dec > 0, decode_part, zeros, kv_pages)
        rag, kv_pages = lax.cond(rag_needed, ragged_part, zeros, kv_pages)
    else:  # the pages are only read: not an operand of the conds' results
        dec = lax.cond(n_dec > 0, lambda: decode_part(kv_pages), lambda: zeros(None))
        rag = lax.cond(rag_needed, lambda: ragged_part(kv_pages), lambda: zeros(None))
    out = jnp.where(is_dec[:, None, None], dec, rag)
    return (out, kv_pages) if fused else out
