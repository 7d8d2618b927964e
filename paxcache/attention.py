"""Attention metadata and the paged attention op that model code calls.

One engine step runs a *ragged batch*: up to B sequences, each contributing ``q_len`` new
tokens (1 for a decode, a whole prompt, or a chunk of one), packed into T rows. The
:class:`AttentionMetadata` pytree says, for that step, where each row's key/value goes in the
paged cache and which pages each sequence reads. It is built inside ``jit`` from the block
tables of a ``BlockState`` and the step's token counts, so allocation and attention compile
into one program. It also carries, as static fields, how the op runs (kernel ``impl``,
``interpret``, the tensor-parallel ``mesh``): whoever builds the step's metadata (the engine)
decides that once, and every :class:`~paxcache.nn.PagedAttention` layer of the model follows
it, whether the model is the bundled Llama or a user's own.

Shape letters: B sequences in the step, T token rows, H query heads, K kv heads, D head dim,
L layers, N blocks, S block size, M max blocks per sequence.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import kernels_pallas as kp
from kernels_pallas.reference import ragged_row_info

__all__ = ["AttentionMetadata", "build_metadata", "metadata_from_state", "paged_attention_op"]


@flax.struct.dataclass
class AttentionMetadata:
    """What one forward step needs to read and write the paged KV cache.

    Attributes:
      block_tables: ``i32[B, M]`` block ids of each sequence in the step (-1 = no block).
      kv_lens: ``i32[B]`` tokens of each sequence after this step (its new tokens included).
      cu_q_lens: ``i32[B + 1]`` cumulative new-token counts; sequence ``s`` owns rows
        ``cu_q_lens[s]:cu_q_lens[s + 1]``.
      num_seqs: ``i32[]`` sequences that count; the rest are padding.
      slot_mapping: ``i32[T]`` cache slot (``block * S + offset``) of each row's K/V, -1 for
        padding rows (their writes are skipped).
      positions: ``i32[T]`` position of each row's token in its sequence (0 for padding rows),
        for rotary embeddings.
      row_valid: ``bool[T]`` which rows are real tokens.
      row_seq: ``i32[T]`` the sequence (index into the step's B) each row belongs to.
      impl: static kernel implementation (``"auto"``, ``"reference"``, ``"pallas"``, ...; see
        :func:`kernels_pallas.ragged_paged_attention`).
      interpret: static; run Pallas kernels in interpret mode (CPU tests).
      mesh: static mesh with a ``"tp"`` axis, or None: the op then runs per device, split
        over heads (see :func:`paged_attention_op`).
      max_q_len: static hint that no sequence feeds more than this many rows this step
        (``1``: a decode-only step, which runs the TPU decode kernel); None: any batch.
      rope_lens: ``i32[B]`` or None: each sequence's whole known length (a prompt's chunks
        still to come included; never less than ``kv_lens``), which decides length-dependent
        RoPE (longrope); None: ``kv_lens``. The attention itself never reads it.
    """

    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    slot_mapping: jax.Array
    positions: jax.Array
    row_valid: jax.Array
    row_seq: jax.Array
    impl: str = flax.struct.field(pytree_node=False, default="auto")
    interpret: bool = flax.struct.field(pytree_node=False, default=False)
    mesh: jax.sharding.Mesh | None = flax.struct.field(pytree_node=False, default=None)
    max_q_len: int | None = flax.struct.field(pytree_node=False, default=None)
    rope_lens: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        """T, the static number of token rows."""
        return self.slot_mapping.shape[0]


def build_metadata(
    block_tables: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array,
    num_seqs: jax.Array | int,
    num_tokens: int,
    block_size: int,
    *,
    impl: str = "auto",
    interpret: bool = False,
    mesh: jax.sharding.Mesh | None = None,
) -> AttentionMetadata:
    """Build the metadata of a ragged step from per-sequence tables and counts (jit-friendly).

    Args:
      block_tables: ``i32[B, M]`` tables of the step's sequences, in row order.
      kv_lens: ``i32[B]`` each sequence's length after the step.
      q_lens: ``i32[B]`` each sequence's new tokens this step (``<= kv_lens``).
      num_seqs: how many of the B sequences are real (the rest must have ``q_lens == 0``
        or are ignored).
      num_tokens: static T (rows in the step; ``sum(q_lens) <= T``).
      block_size: static S.
      impl, interpret, mesh: how the step's attention runs (static fields of the result).

    Returns:
      The step's :class:`AttentionMetadata`.
    """
    b = block_tables.shape[0]
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    live = jnp.arange(b) < num_seqs
    q_lens = jnp.where(live, q_lens.astype(jnp.int32), 0)
    kv_lens = jnp.where(live, kv_lens.astype(jnp.int32), 0)
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    seq, pos, valid = ragged_row_info(cu_q_lens, kv_lens, num_seqs, num_tokens)
    pos = jnp.where(valid, pos, 0)
    blk = jnp.take_along_axis(block_tables[seq], (pos // block_size)[:, None], axis=1)[:, 0]
    valid &= blk >= 0
    slot = jnp.where(valid, blk * block_size + pos % block_size, -1)
    return AttentionMetadata(
        block_tables=block_tables.astype(jnp.int32),
        kv_lens=kv_lens,
        cu_q_lens=cu_q_lens,
        num_seqs=num_seqs,
        slot_mapping=slot.astype(jnp.int32),
        positions=pos.astype(jnp.int32),
        row_valid=valid,
        row_seq=seq,
        impl=impl,
        interpret=interpret,
        mesh=mesh,
    )


def metadata_from_state(
    state: Any,
    slot_ids: jax.Array,
    q_lens: jax.Array,
    num_seqs: jax.Array | int,
    num_tokens: int,
    kv_lens: jax.Array | None = None,
    *,
    impl: str = "auto",
    interpret: bool = False,
    mesh: jax.sharding.Mesh | None = None,
) -> AttentionMetadata:
    """Metadata for a step over allocator slots ``slot_ids``, read from a ``BlockState``.

    Args:
      state: an ``allocator.BlockState`` whose tables already hold this step's tokens
        (i.e. after ``allocator.allocate`` / ``allocator.append``).
      slot_ids: ``i32[B]`` allocator slot of each sequence in the step (padding: any id).
      q_lens: ``i32[B]`` new tokens per sequence this step.
      num_seqs: real sequences among the B.
      num_tokens: static T.
      kv_lens: ``i32[B]`` lengths after the step; default ``state.seq_lens[slot_ids]`` (right
        for decodes and whole prompts; a chunked prefill passes its computed length + chunk).
      impl, interpret, mesh: as in :func:`build_metadata`.
    """
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    tables = state.block_tables[slot_ids]
    if kv_lens is None:
        kv_lens = state.seq_lens[slot_ids]
    return build_metadata(
        tables,
        kv_lens,
        q_lens,
        num_seqs,
        num_tokens,
        state.cfg.block_size,
        impl=impl,
        interpret=interpret,
        mesh=mesh,
    )


def paged_attention_op(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: kp.PagedKVCache,
    metadata: AttentionMetadata,
    *,
    layer: int | jax.Array | None = None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl: str | None = None,
    interpret: bool | None = None,
    mesh: jax.sharding.Mesh | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, kp.PagedKVCache]:
    """Write this step's K/V into the paged cache and attend over it (causal, ragged).

    One call of :func:`kernels_pallas.ragged_paged_attention` in its fused form
    (``new_kv=(k, v, metadata.slot_mapping)``).

    Args:
      q: ``[T, H, D]`` queries of the step's rows.
      k, v: ``[T, K, D]`` keys and values of the step's rows.
      kv_cache: the whole model's :class:`kernels_pallas.PagedKVCache`.
      metadata: the step's :class:`AttentionMetadata`.
      layer: the layer (int or traced scalar, e.g. inside ``lax.scan``).
      sm_scale, soft_cap, sliding_window: as in :func:`kernels_pallas.ragged_paged_attention`.
      impl, interpret: as in :func:`kernels_pallas.ragged_paged_attention`; None (default)
        takes the metadata's.
      mesh: default the metadata's. A mesh with a ``"tp"`` axis (see
        :mod:`paxcache.sharding`): the write and the attention run per device under
        ``jax.shard_map``, on ``H / tp`` query heads and ``Kc / tp`` kv heads of the cache,
        which must be split over heads (:func:`kernels_pallas.kv_cache_specs`); metadata is
        replicated. With ``Kc > K`` (kv heads replicated for ``tp > K``), ``k``/``v`` are
        repeated to ``Kc`` heads first (``Kc % K == 0``).
      sinks: optional ``f32[H]`` attention sinks (:func:`kernels_pallas.ragged_paged_attention`;
        split over heads with ``q`` under a mesh).

    Returns:
      ``(out [T, H, D], kv_cache)`` with the new K/V written. Padding rows of ``out`` are
      zeros.

    Raises:
      ValueError: with ``mesh``, head counts that do not split over its ``tp`` axis.
    """
    impl = metadata.impl if impl is None else impl
    interpret = metadata.interpret if interpret is None else interpret
    mesh = metadata.mesh if mesh is None else mesh
    static_layer = layer is None or isinstance(layer, int)

    def local(q, k, v, kv_cache, metadata, layer_arr, sinks=None):
        lyr = layer if static_layer else layer_arr
        return kp.ragged_paged_attention(
            q,
            kv_cache,
            metadata.kv_lens,
            metadata.block_tables,
            metadata.cu_q_lens,
            metadata.num_seqs,
            layer=lyr,
            new_kv=(k, v, metadata.slot_mapping),
            unique_slots=True,  # each position of a step has its own slot; padding is -1
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            impl=impl,
            interpret=interpret,
            max_q_len=metadata.max_q_len,
            sinks=sinks,
        )

    layer_arr = None if static_layer else jnp.asarray(layer, jnp.int32)
    if mesh is None:
        return local(q, k, v, kv_cache, metadata, layer_arr, sinks)
    return _shard_over_heads(local, mesh, q, k, v, kv_cache, metadata, layer_arr, sinks)


def _shard_over_heads(local, mesh, q, k, v, kv_cache, metadata, layer_arr, sinks=None):
    """Runs ``local`` per device of ``mesh``'s ``tp`` axis, split over query and kv heads."""
    from paxcache.sharding import TP_AXIS

    if TP_AXIS not in mesh.shape:
        raise ValueError(f"paged_attention_op: mesh has no {TP_AXIS!r} axis: {mesh}")
    tp = mesh.shape[TP_AXIS]
    h, kh, kc = q.shape[-2], k.shape[-2], kv_cache.num_kv_heads
    if h % tp or kc % tp:
        raise ValueError(
            f"paged_attention_op: tp={tp} must divide the query heads ({h}) and the cache's kv "
            f"heads ({kc})"
        )
    if kc != kh:
        if kc % kh:
            raise ValueError(
                f"paged_attention_op: the cache's {kc} kv heads are not a replication of the "
                f"{kh} kv heads of k/v"
            )
        # Replicated kv heads: cache head c holds kv head c // (kc // kh); k/v are replicated
        # here (their projections are), so each device just takes its own slice.
        k = jnp.repeat(k, kc // kh, axis=-2)
        v = jnp.repeat(v, kc // kh, axis=-2)
    heads = P(None, TP_AXIS, None)
    cache_specs = kp.kv_cache_specs(TP_AXIS, like=kv_cache)
    md_specs = jax.tree.map(lambda _: P(), metadata)
    sink_args, sink_specs = ((), ()) if sinks is None else ((sinks,), (P(TP_AXIS),))
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(heads, heads, heads, cache_specs, md_specs, P(), *sink_specs),
        out_specs=(heads, cache_specs),
        check_vma=False,
    )
    return fn(q, k, v, kv_cache, metadata, layer_arr, *sink_args)
