"""Host-side work planning of the Mosaic GPU attention kernel (jit-traceable XLA).

The kernel (:mod:`kernels_pallas.gpu.attention`) runs a grid of work items x kv heads; this
module decides the items and merges their results, with no Python loop over sequences:

* **Query tiles** (:func:`decode_work`, :func:`ragged_work`): every sequence's query rows cut
  into tiles of ``R // G`` tokens (one token per decode row), each with its metadata row
  ``i32[8]`` (columns ``M_*``: sequence, first query row, rows, first position, key range
  ``[lo, hi)``, layer).
* **Work items** (:func:`split_work`, :func:`plan_items`): each live tile's key range split
  into KV splits of whole ``BLOCK_KV``-token steps, within a static item budget
  (:func:`default_item_budget`), in proportion to the tiles' key ranges (flash-decoding by
  need), or a fixed number of splits per tile. Item metadata ``i32[I, 10]``: the tile's
  columns, then the split's first KV step and step count (``M_FIRST``, ``M_STEPS``).
* **Combine** (:func:`combine`): the items' partial outputs and log-sum-exps merged per tile.

Shape letters as in :mod:`kernels_pallas.gpu.attention`: W query tiles, I work items, K kv
heads, R rows of one tile, D head dim, T query tokens, B sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import reference

__all__ = [
    "BLOCK_KV",
    "NUM_SMS",
    "combine",
    "decode_work",
    "default_item_budget",
    "num_sms",
    "plan_items",
    "ragged_work",
    "split_work",
]

NUM_SMS = 132  # H100 SXM / H200: the count when neither a target nor a GPU says otherwise
INTERPRET_SMS = 4  # the budget rule in interpret mode, at toy size
BLOCK_KV = 64  # tokens per KV pipeline step

# Query tile metadata columns (i32[W, 8]).
M_SEQ, M_ROW0, M_NQ, M_POS0, M_LO, M_HI, M_LAYER = range(7)
META = 8
# Work item metadata: the tile's columns, then the split's first KV step and step count.
M_FIRST, M_STEPS = META, META + 1

_NEG_INF = float("-inf")


@functools.lru_cache(maxsize=1)
def _live_sms() -> int | None:
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    return getattr(device, "core_count", None) or None


def num_sms() -> int:
    """Streaming multiprocessors of the GPU programs are traced for: the abstract mesh's device
    (``kernels_pallas.aot.cuda_target`` sets one of that generation), else the live GPU's
    ``core_count``, else :data:`NUM_SMS`."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if getattr(mesh, "empty", True) else getattr(mesh, "abstract_device", None)
    if device is not None and getattr(device, "platform", None) == "gpu" and device.num_cores:
        return int(device.num_cores)
    return _live_sms() or NUM_SMS


def default_item_budget(num_tiles: int, kv_heads: int, num_sms: int = NUM_SMS) -> int:
    """Static number of work items: every tile once, and at least ``2 * num_sms`` blocks.

    Args:
      num_tiles: W, query tiles (a static bound: sequences for decode).
      kv_heads: K (the grid's second axis).
      num_sms: streaming multiprocessors to fill.
    """
    return max(num_tiles, -(-2 * num_sms // max(1, kv_heads)))


def combine(
    o: jax.Array,
    lse: jax.Array,
    item_tile: jax.Array,
    num_tiles: int,
    sink_rows: jax.Array | None = None,
) -> jax.Array:
    """Merge the items' partials per tile: ``o f32[I, K, R, D]``, ``lse f32[I, K, >= R]``.

    ``item_tile i32[I]`` is each item's tile, ascending, with ``num_tiles`` for dead items
    (whose ``o`` and ``lse`` were never written and are ignored). Empty splits
    (``lse = -inf``) get weight 0; a row with no keys in any item gives zeros.
    ``sink_rows f32[K, R]`` (or None): each row's sink logit, a partial with a zero value
    vector (the Triton kernel's attention sinks).

    Returns:
      ``f32[W, K, R, D]``.
    """
    r = o.shape[2]
    live = (item_tile < num_tiles)[:, None, None]
    lse = jnp.where(live, lse[..., :r], _NEG_INF)  # [I, K, R]
    seg = dict(segment_ids=item_tile, num_segments=num_tiles + 1, indices_are_sorted=True)
    mx = jax.ops.segment_max(lse, **seg)  # [W + 1, K, R]
    if sink_rows is not None:
        mx = jnp.maximum(mx, sink_rows[None])
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    wgt = jnp.where(jnp.isfinite(lse), jnp.exp(lse - mx[item_tile]), 0.0)
    den = jax.ops.segment_sum(wgt, **seg)
    if sink_rows is not None:
        den = den + jnp.exp(sink_rows[None] - mx)
    num = jax.ops.segment_sum(jnp.where(wgt[..., None] > 0, o * wgt[..., None], 0.0), **seg)
    return (num / jnp.where(den > 0, den, 1.0)[..., None])[:num_tiles]


def _key_range(pos0: jax.Array, nq: jax.Array, window: int | None):
    """Keys any of the tile's queries may see: ``[lo, hi)``; empty when ``nq == 0``."""
    hi = jnp.where(nq > 0, jnp.maximum(pos0 + nq, 0), 0)
    lo = jnp.zeros_like(hi) if window is None else jnp.maximum(pos0 - window + 1, 0)
    lo = jnp.minimum(lo, hi)
    return lo, hi


def decode_work(lengths: jax.Array, window: int | None, layer=0) -> jax.Array:
    """Tile metadata ``i32[B, 8]`` for decode: one tile per sequence, token at ``len - 1``."""
    b = lengths.shape[0]
    lengths = lengths.astype(jnp.int32)
    nq = (lengths > 0).astype(jnp.int32)
    pos0 = lengths - 1
    lo, hi = _key_range(pos0, nq, window)
    seq = jnp.arange(b, dtype=jnp.int32)
    lay = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (b,))
    zero = jnp.zeros((b,), jnp.int32)
    return jnp.stack([seq, seq, nq, pos0, lo, hi, lay, zero], axis=1)


def ragged_work(
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    num_tokens: int,
    tokens_per_tile: int,
    window: int | None,
    layer=0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cut every real sequence's query rows into tiles of ``tokens_per_tile`` tokens.

    Returns:
      ``(meta i32[W, 8], tile_of_row i32[T], slot_of_row i32[T])`` where
      ``W = ceil(T / tokens_per_tile) + B`` (a static bound), ``tile_of_row`` the tile holding
      each query row and ``slot_of_row`` its token index inside that tile.
    """
    b = kv_lens.shape[0]
    tpt = tokens_per_tile
    w = -(-num_tokens // tpt) + b
    cu = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    nseq = jnp.asarray(num_seqs, jnp.int32)
    real = jnp.arange(b, dtype=jnp.int32) < nseq
    q_len = jnp.where(real, cu[1:] - cu[:-1], 0)
    n_tiles = (q_len + tpt - 1) // tpt  # [B]
    tile_end = jnp.cumsum(n_tiles).astype(jnp.int32)
    tile_start = tile_end - n_tiles
    widx = jnp.arange(w, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, widx, side="right"), b - 1).astype(jnp.int32)
    used = widx < tile_end[-1]
    chunk = widx - tile_start[seq]
    row0 = jnp.where(used, cu[seq] + chunk * tpt, 0)
    nq = jnp.where(used, jnp.clip(q_len[seq] - chunk * tpt, 0, tpt), 0)
    pos0 = kv_lens[seq] - q_len[seq] + chunk * tpt
    lo, hi = _key_range(pos0, nq, window)
    lay = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (w,))
    meta = jnp.stack([seq, row0, nq, pos0, lo, hi, lay, jnp.zeros_like(seq)], axis=1)

    rseq, _, _ = reference.ragged_row_info(cu, kv_lens, nseq, num_tokens)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    local = rows - cu[rseq]
    tile_of_row = jnp.clip(tile_start[rseq] + local // tpt, 0, w - 1)
    return meta, tile_of_row, local % tpt


def split_work(
    tiles: jax.Array,
    num_items: int,
    *,
    splits_per_tile: int | None = None,
    target_items: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Work items (tile x KV split) for the live tiles, within a static budget of ``num_items``.

    A tile is live when it has query rows (``nq > 0``); its key range ``[lo, hi)`` covers
    ``steps`` 64-token KV steps. Each live tile gets ``splits`` contiguous items whose step
    counts differ by at most one (every item at least one step), and items are laid out tile
    after tile from item 0; the rest are dead (no steps).

    * ``splits_per_tile=P``: ``min(P, steps)`` splits for every live tile (needs
      ``num_items >= W * P``).
    * Otherwise (flash-decoding by need): the live tiles share
      ``min(num_items, max(live, target_items))`` items in proportion to their steps, at least
      one each, so a few long sequences in a wide padded batch still fill the GPU and a full
      batch gets one item per tile (no split overhead).

    Args:
      tiles: ``i32[W, 8]`` from :func:`decode_work` or :func:`ragged_work`.
      num_items: I, static (the kernel grid), at least W.
      splits_per_tile: fixed splits per live tile, or None for the proportional rule.
      target_items: items worth having in flight (default ``2 * num_sms()``; pass it divided
        by the kv heads, which form the grid's other axis).

    Returns:
      ``(items i32[I, 10], item_tile i32[I])``: the tile's 8 columns plus the item's first KV
      step and step count; ``item_tile`` is each item's tile (ascending), W for dead items.
    """
    w = tiles.shape[0]
    if num_items < w:
        raise ValueError(f"num_items={num_items} must be at least the number of tiles W={w}")
    nq, lo, hi = tiles[:, M_NQ], tiles[:, M_LO], tiles[:, M_HI]
    step_lo = lo // BLOCK_KV
    steps = jnp.where(nq > 0, jnp.maximum(-(-hi // BLOCK_KV) - step_lo, 0), 0)
    live = steps > 0
    if splits_per_tile is not None:
        if num_items < w * splits_per_tile:
            raise ValueError(f"num_items={num_items} < W * splits_per_tile = {w * splits_per_tile}")
        splits = jnp.where(live, jnp.minimum(splits_per_tile, steps), 0)
    else:
        n_live = jnp.sum(live, dtype=jnp.int32)
        target = 2 * num_sms() if target_items is None else int(target_items)
        budget = jnp.minimum(num_items, jnp.maximum(n_live, target))
        extra = budget - n_live  # items beyond one per live tile
        total = jnp.maximum(jnp.sum(steps), 1)
        share = (extra * steps) // total  # exact: the shares sum to at most `extra`
        splits = jnp.where(live, 1 + jnp.minimum(share, steps - 1), 0)
    item_end = jnp.cumsum(splits).astype(jnp.int32)
    item_start = item_end - splits
    idx = jnp.arange(num_items, dtype=jnp.int32)
    tile = jnp.minimum(jnp.searchsorted(item_end, idx, side="right"), w - 1).astype(jnp.int32)
    alive = idx < item_end[-1]
    k = idx - item_start[tile]
    n = jnp.maximum(splits[tile], 1)
    first = step_lo[tile] + (k * steps[tile]) // n
    last = step_lo[tile] + ((k + 1) * steps[tile]) // n
    n_steps = jnp.where(alive, last - first, 0)
    items = jnp.concatenate(
        [tiles[tile], jnp.stack([first, n_steps], axis=1).astype(jnp.int32)], axis=1
    )
    return items, jnp.where(alive, tile, w)


def plan_items(tiles: jax.Array, kv_heads: int, num_splits: int | None, interpret: bool):
    """Work items for ``tiles`` (see :func:`split_work`): fixed splits, or by need.

    Interpret mode sizes the budget for a toy GPU of ``INTERPRET_SMS`` SMs: the same rule,
    without hundreds of (mostly dead) interpreted programs.
    """
    w = tiles.shape[0]
    if num_splits is not None:
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        return split_work(tiles, w * num_splits, splits_per_tile=num_splits)
    sms = INTERPRET_SMS if interpret else num_sms()
    return split_work(
        tiles, default_item_budget(w, kv_heads, sms), target_items=-(-2 * sms // kv_heads)
    )
