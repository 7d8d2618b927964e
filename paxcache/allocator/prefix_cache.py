"""The prefix cache: exact, salted, chained block keys; lookup, registration and :func:`commit`.

A full block is cached under the key ``(parent block id, parent generation, salt, its S token
ids)``. ``gen[b]`` is bumped each time block ``b`` is evicted (:func:`paxcache.allocator.pool.
ensure_free`), so children of an evicted parent can never be matched again. A 32-bit hash of
the key (``key_hash``) finds the candidate; the hit is then verified on the exact stored
tokens, parent, parent generation and salt (never a hash alone). Registration continues a
slot's chain from ``num_registered``; blocks become visible to lookups only when registered
(at once, or through :func:`commit` once their KV is computed).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from paxcache.allocator.state import I32, KEY, U32, BlockState, i32, take, tick

__all__ = ["commit", "hash_key", "lookup", "register", "register_batch"]


def hash_key(tokens: jax.Array, salt: jax.Array, parent: jax.Array, pgen: jax.Array) -> jax.Array:
    """u32[...] hash of a cache key; ``tokens`` i32[..., S], the others broadcast to [...]."""
    h = jnp.full(tokens.shape[:-1], 2166136261, U32)
    mult = jnp.uint32(0x01000193)
    for v in (salt, parent, pgen):
        h = (h ^ jnp.asarray(v).astype(U32)) * mult
        h = h ^ (h >> 13)
    for i in range(tokens.shape[-1]):
        h = (h ^ tokens[..., i].astype(U32)) * mult
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    return h ^ (h >> 13)


def lookup(state: BlockState, blocks: jax.Array, max_hit: jax.Array, salt: jax.Array):
    """Longest verified cached chain for the prompt blocks ``blocks`` i32[M, S].

    Returns (number of hit blocks, i32[M] hit ids with -1 beyond).
    """
    cfg = state.cfg
    n, m = cfg.num_blocks, cfg.max_blocks_per_seq

    def cond(c):
        j, _, good, _ = c
        return good & (j < max_hit)

    def body(c):
        j, prev, _, ids = c
        toks = lax.dynamic_index_in_dim(blocks, j, keepdims=False)
        pgen = jnp.where(prev >= 0, state.gen[jnp.clip(prev, 0, n - 1)], 0)
        h = hash_key(toks[None], salt, prev, pgen)[0]
        cand_mask = state.cached & (state.key_hash == h)
        cand = jnp.argmax(cand_mask).astype(I32)
        good = (
            cand_mask[cand]
            & (state.parent_block[cand] == prev)
            & (state.parent_gen[cand] == pgen)
            & (state.block_salt[cand] == salt)
            & jnp.all(state.block_tokens[cand] == toks)
        )
        ids = ids.at[j].set(jnp.where(good, cand, -1))
        return j + good.astype(I32), jnp.where(good, cand, prev), good, ids

    init_c = (i32(0), i32(-1), jnp.bool_(True), jnp.full((m,), -1, I32))
    h, _, _, ids = lax.while_loop(cond, body, init_c)
    return h, ids


def register(
    state: BlockState, slots: jax.Array, mask: jax.Array, hi: jax.Array, width: int
) -> BlockState:
    """Registers blocks ``[num_registered, hi)`` of each masked slot in the prefix cache.

    Args:
        state: the state.
        slots: i32[R] slot indices.
        mask: bool[R] which rows to process.
        hi: i32[R] registration end (exclusive, in blocks); tokens must be recorded.
        width: static; at most ``width`` blocks per slot are registered in this call
            (callers pass ``M`` or, on a fast path, 1 after checking ``hi - lo <= 1``).

    Registration continues a slot's chain only if its previous block is cached; blocks that
    are already cached (hits, or shared with a fork sibling) are skipped but extend the chain.
    """
    cfg = state.cfg
    n, m = cfg.num_blocks, cfg.max_blocks_per_seq
    lo = state.num_registered[slots]
    rows = state.block_tables[slots]  # [R, M]
    r = slots.shape[0]
    ridx = jnp.arange(r, dtype=I32)
    par_blk = jnp.where(lo > 0, rows[ridx, jnp.clip(lo - 1, 0, m - 1)], -1)
    par_ok = (lo == 0) | ((par_blk >= 0) & take(state.cached, par_blk))
    hi = jnp.minimum(hi, lo + width)
    go = mask & par_ok & (hi > lo)
    cols = lo[:, None] + jnp.arange(width, dtype=I32)[None, :]  # [R, W]
    in_range = go[:, None] & (cols < hi[:, None])
    blk = jnp.where(in_range, rows[ridx[:, None], jnp.clip(cols, 0, m - 1)], -1)
    # A released (-1) column breaks the chain: stop before the first one.
    bad = in_range & (blk < 0)
    first_bad = jnp.min(jnp.where(bad, cols, m), axis=1)
    hi = jnp.minimum(hi, first_bad)
    in_range = in_range & (cols < hi[:, None])
    prev = jnp.concatenate([par_blk[:, None], blk[:, :-1]], axis=1)
    safe_blk = jnp.clip(blk, 0, n - 1)
    safe_prev = jnp.clip(prev, 0, n - 1)
    already = take(state.cached, safe_blk)
    write = in_range & ~already
    pgen = jnp.where(prev >= 0, take(state.gen, safe_prev), 0)
    salt = jnp.broadcast_to(state.slot_salt[slots][:, None], blk.shape)
    h = hash_key(take(state.block_tokens, safe_blk), salt, prev, pgen)
    tgt = jnp.where(write, blk, n).reshape(-1)

    def put(arr: jax.Array, val: Any) -> jax.Array:
        val = jnp.broadcast_to(jnp.asarray(val, arr.dtype), blk.shape).reshape(-1)
        return arr.at[tgt].set(val, mode="drop")

    key_cols = ("key_hash", "parent_block", "parent_gen", "block_salt", "block_pos")
    key_vals = jnp.stack(
        [lax.bitcast_convert_type(h, I32), prev, pgen, salt, jnp.broadcast_to(cols, blk.shape)],
        axis=-1,
    ).reshape(-1, len(key_cols))
    key_idx = jnp.array([KEY[k] for k in key_cols], I32)
    return state.replace(
        cached=put(state.cached, True),
        cache_keys=state.cache_keys.at[tgt[:, None], key_idx[None, :]].set(key_vals, mode="drop"),
        last_access=put(state.last_access, state.clock),
        num_registered=state.num_registered.at[jnp.where(go, slots, cfg.max_seqs)].set(
            jnp.maximum(lo, hi), mode="drop"
        ),
    )


def register_batch(state: BlockState, mask: jax.Array, hi: jax.Array) -> BlockState:
    """:func:`register` over all slots, with a one-block fast path (decode)."""
    cfg = state.cfg
    slots = jnp.arange(cfg.max_seqs, dtype=I32)
    span = jnp.where(mask, hi - state.num_registered, 0)
    if cfg.max_blocks_per_seq == 1:
        return register(state, slots, mask, hi, 1)
    return lax.cond(
        jnp.max(span) <= 1,
        lambda s: register(s, slots, mask, hi, 1),
        lambda s: register(s, slots, mask, hi, cfg.max_blocks_per_seq),
        state,
    )


def commit(state: BlockState, num_computed: jax.Array) -> BlockState:
    """Makes computed full blocks visible to prefix-cache lookups.

    Args:
        state: the state.
        num_computed: i32[B] tokens of each slot whose KV is written. Every full block lying
            wholly below it (and whose token ids are known) is registered, continuing the
            slot's chain. Empty and swapped slots are ignored.

    Returns:
        The new state (unchanged when prefix caching is disabled).
    """
    cfg = state.cfg
    if not cfg.enable_prefix_caching:
        return state
    nc = jnp.asarray(num_computed, I32).reshape(cfg.max_seqs)
    mask = state.active & ~state.swapped
    hi = jnp.minimum(jnp.minimum(nc, state.num_known_tokens), state.seq_lens) // cfg.block_size
    return tick(register_batch(state, mask, hi))
