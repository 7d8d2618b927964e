"""The sequence operations: admit a prompt, grow sequences, fork, free, and the slot mapping.

:func:`allocate` admits one prompt into an empty slot (prefix-cache hits first, then fresh
blocks, within the watermark); :func:`append` grows every slot by its own count in one call
(the decode hot path: O(B) work, no sort; copy-on-write, sliding-window release and
multi-block chunks add work under ``lax.cond`` only when they occur); :func:`fork` shares a
parent's blocks; :func:`free` returns a slot's blocks; :func:`slot_mapping` turns (slot,
position) pairs into KV slot indices for ``write_kv``. The serving order and copy-on-write
rules are in the package docstring (:mod:`paxcache.allocator`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from paxcache.allocator.pool import ensure_free, pop_at, release, release_host
from paxcache.allocator.prefix_cache import lookup, register, register_batch
from paxcache.allocator.state import (
    I32,
    AllocateResult,
    AppendResult,
    BlockState,
    ForkResult,
    cumsum,
    i32,
    num_free_blocks,
    take,
    take2,
    tick,
)

__all__ = ["allocate", "append", "fork", "free", "slot_mapping"]


def _rank_among_equal(keys: jax.Array) -> jax.Array:
    """i32[B]: how many earlier entries (lower index) of ``keys`` i32[B] hold the same value."""
    k = keys.shape[0]
    order = jnp.argsort(keys, stable=True)
    sorted_keys = take(keys, order)
    pos = jnp.arange(k, dtype=I32)
    start = jnp.concatenate([jnp.ones((1,), bool), sorted_keys[1:] != sorted_keys[:-1]])
    group_start = lax.associative_scan(jnp.maximum, jnp.where(start, pos, 0))
    return jnp.zeros((k,), I32).at[order].set(pos - group_start)


def allocate(
    state: BlockState,
    slot: jax.Array | int,
    token_ids: jax.Array,
    num_tokens: jax.Array | int,
    salt: jax.Array | int = 0,
    *,
    commit: bool = True,
    reserve: jax.Array | int = 0,
) -> tuple[BlockState, AllocateResult]:
    """Admits a prompt of ``num_tokens`` tokens into the empty ``slot``.

    Args:
        state: the state.
        slot: i32[] target slot (may be traced); must be empty.
        token_ids: i32[T] prompt token ids padded to any fixed length T (T is static; pad to
            ``M * S`` to compile once). Only the first ``num_tokens`` are read.
        num_tokens: i32[] prompt length, ``1 <= num_tokens <= min(T, M * S)`` (may be traced).
        salt: i32[] cache salt (tenant id): prompts with different salts never share blocks.
        commit: static. True: the prompt's full blocks are visible to later lookups at once.
            False: only once :func:`commit` says they are computed.
        reserve: i32[] blocks that must stay free on top of the watermark (may be traced;
            negative counts as 0): the blocks the scheduler promised to this step's rows.

    Returns:
        ``(state, AllocateResult)``. Refused (``ok=False``, state bitwise unchanged) when the
        slot is out of range or taken, ``num_tokens`` is out of range, or the free blocks
        minus the blocks needed (fresh blocks plus revived evictable hits) would fall below
        ``cfg.watermark_blocks + reserve``.
    """
    cfg = state.cfg
    n, s, b, m = cfg.num_blocks, cfg.block_size, cfg.max_seqs, cfg.max_blocks_per_seq
    slot = i32(slot)
    num_tokens = i32(num_tokens)
    salt = i32(salt)
    token_ids = jnp.asarray(token_ids, I32).reshape(-1)
    t = token_ids.shape[0]
    token_ids = jnp.pad(token_ids, (0, m * s - t)) if t < m * s else token_ids[: m * s]
    blocks = token_ids.reshape(m, s)
    safe_slot = jnp.clip(slot, 0, b - 1)

    valid = (
        (slot >= 0)
        & (slot < b)
        & ~state.active[safe_slot]
        & (num_tokens >= 1)
        & (num_tokens <= min(t, m * s))
    )
    nblk = (num_tokens + s - 1) // s
    cols = jnp.arange(m, dtype=I32)
    if cfg.enable_prefix_caching:
        max_hit = jnp.where(valid, (num_tokens - 1) // s, 0)
        num_hit, hit_ids = lookup(state, blocks, max_hit, salt)
    else:
        num_hit, hit_ids = i32(0), jnp.full((m,), -1, I32)
    hit_valid = hit_ids >= 0
    safe_hit = jnp.clip(hit_ids, 0, n - 1)
    revived = hit_valid & (state.ref_counts[safe_hit] == 0)
    num_revived = jnp.sum(revived.astype(I32))
    needed = nblk - num_hit
    avail_after = num_free_blocks(state) - num_revived - needed
    floor = cfg.watermark_blocks + jnp.maximum(i32(reserve), 0)
    ok = valid & (avail_after >= floor) & (avail_after >= 0)

    # Every update below is masked by `ok` (scatters go out of bounds and are dropped), so a
    # refused call returns the old state bitwise without an O(state) select.
    oki = ok.astype(I32)
    new = state
    # Revive / reference the hit blocks first so that eviction cannot pick them.
    hit_tgt = jnp.where(hit_valid & ok, hit_ids, n)
    new = new.replace(
        ref_counts=new.ref_counts.at[hit_tgt].add(1, mode="drop"),
        last_access=new.last_access.at[hit_tgt].set(new.clock, mode="drop"),
        num_evictable=new.num_evictable - num_revived * oki,
    )
    new = ensure_free(new, needed * oki)
    fresh_mask = ok & (cols >= num_hit) & (cols < nblk)
    fresh_ids = jnp.where(fresh_mask, pop_at(new, cols - num_hit), -1)
    row = jnp.where(hit_valid, hit_ids, fresh_ids)
    fresh_tgt = jnp.where(fresh_mask, fresh_ids, n)
    tslot = jnp.where(ok, safe_slot, b)

    def put(arr: jax.Array, val: Any) -> jax.Array:
        return arr.at[tslot].set(val, mode="drop")

    new = new.replace(
        ref_counts=new.ref_counts.at[fresh_tgt].set(1, mode="drop"),
        num_free=new.num_free - needed * oki,
        block_tables=put(new.block_tables, row),
        seq_lens=put(new.seq_lens, num_tokens),
        active=put(new.active, True),
        swapped=put(new.swapped, False),
        slot_salt=put(new.slot_salt, salt),
        num_registered=put(new.num_registered, num_hit),
        num_known_tokens=put(new.num_known_tokens, num_tokens),
    )
    if cfg.enable_prefix_caching:
        new = new.replace(
            block_tokens=new.block_tokens.at[fresh_tgt].set(blocks, mode="drop"),
            prefix_queries=new.prefix_queries + num_tokens * oki,
            prefix_hits=new.prefix_hits + num_hit * s * oki,
        )
        if commit:
            new = register(new, safe_slot[None], ok[None], (num_tokens // s)[None], m)
    out = new.replace(clock=new.clock + oki)
    return out, AllocateResult(ok=ok, num_cached_tokens=jnp.where(ok, num_hit * s, 0))


class _Grant(NamedTuple):
    """What :func:`append` would give every slot (``[B]`` arrays; see :func:`_grant`)."""

    nt: jax.Array  # tokens asked for
    new_len: jax.Array  # length after the append
    nb_old: jax.Array  # blocks held before
    nb_new: jax.Array  # blocks held after
    new_blocks: jax.Array  # fresh blocks at block boundaries
    last_col: jax.Array  # block-table column of the last (partial) block
    last_blk: jax.Array  # its block id
    cow: jax.Array  # the slot copies its shared last block on write
    need: jax.Array  # fresh blocks in all (boundaries + copy)
    granted: jax.Array  # the slot gets them


def append_need(
    length: Any, num_new: Any, block_size: int, writes_shared: Any, last_ref: Any, rank: Any
) -> tuple[Any, Any, Any]:
    """The block arithmetic of an append, written once: the device allocator (:func:`append`,
    on ``i32[B]`` arrays) and the scheduler's plan (``Scheduler.blocks_needed``, on Python
    ints per row) both call it, so they cannot disagree.

    Args:
      length: tokens the slot holds now.
      num_new: tokens appended.
      block_size: S.
      writes_shared: the append writes into a partial last block that others hold too.
      last_ref: holders of that last block (its ref count).
      rank: writers of that same block before this one (slot order).

    Returns:
      ``(blocks before, blocks after, copy-on-write)``: the append takes ``after - before``
      fresh blocks plus one for a copy-on-write; a writer copies while someone else still
      holds the block, and the last one (when every holder writes) keeps it.
    """
    before = (length + block_size - 1) // block_size
    after = (length + num_new + block_size - 1) // block_size
    return before, after, writes_shared & (last_ref - rank > 1)


def _grant(state: BlockState, num_new_tokens: jax.Array) -> _Grant:
    """The one rule of which slots an append of ``num_new_tokens`` (``i32[B]``) grants:
    live, within ``M * S`` tokens, and every block it needs free, in slot order."""
    cfg = state.cfg
    n, s, b, m = cfg.num_blocks, cfg.block_size, cfg.max_seqs, cfg.max_blocks_per_seq
    nt = jnp.asarray(num_new_tokens, I32).reshape(b)
    rows = jnp.arange(b, dtype=I32)
    length = state.seq_lens
    new_len = length + nt
    live = state.active & ~state.swapped
    want = live & (nt > 0) & (new_len <= m * s)
    last_col = jnp.clip(length // s, 0, m - 1)
    last_blk = take2(state.block_tables, rows, last_col)
    last_ref = take(state.ref_counts, last_blk)
    writes_shared = want & (length % s != 0) & (last_blk >= 0) & (last_ref > 1)
    rank = lax.cond(  # the writers of one shared block are served in slot order
        jnp.any(writes_shared),
        lambda: _rank_among_equal(jnp.where(writes_shared, last_blk, n)),
        lambda: jnp.zeros((b,), I32),
    )
    nb_old, nb_new, cow = append_need(length, nt, s, writes_shared, last_ref, rank)
    new_blocks = jnp.where(want, nb_new - nb_old, 0)
    need = new_blocks + cow.astype(I32)
    csum = cumsum(need)
    granted = want & ((need == 0) | (csum <= num_free_blocks(state)))
    return _Grant(nt, new_len, nb_old, nb_new, new_blocks, last_col, last_blk, cow, need, granted)


def can_append(state: BlockState, num_new_tokens: jax.Array) -> jax.Array:
    """``bool[B]``: whether :func:`append` of ``num_new_tokens`` (``i32[B]``) would grant each
    slot (its ``AppendResult.ok``), without changing anything: a multi-step decode checks
    that the next iteration's blocks are there before it runs it."""
    g = _grant(state, num_new_tokens)
    return (g.nt == 0) | g.granted


def append(
    state: BlockState,
    num_new_tokens: jax.Array,
    token_ids: jax.Array | None = None,
    *,
    commit: bool = True,
) -> tuple[BlockState, AppendResult]:
    """Grows every slot by its own token count in one call (decode or a prompt chunk).

    Args:
        state: the state.
        num_new_tokens: i32[B] tokens to add per slot (>= 0; 0 = untouched, always ok).
        token_ids: optional i32[B, T] ids of the new tokens (first ``num_new_tokens[b]`` of row
            b are read; T static). With prefix caching, recorded so that blocks filled here
            become cacheable. Without them those blocks are not cached.
        commit: static; with ``token_ids``, register newly full blocks at once (True) or
            leave it to :func:`commit` (False).

    Returns:
        ``(state, AppendResult)``. A slot is refused (``ok=False``, left unchanged) if it is
        empty or swapped, would exceed ``M * S`` tokens, or does not get all the blocks it
        needs under the prefix rule (module docstring). New blocks are taken at block
        boundaries; a shared partial last block is copied on write (see ``copy_*``).
    """
    cfg = state.cfg
    n, s, b, m = cfg.num_blocks, cfg.block_size, cfg.max_seqs, cfg.max_blocks_per_seq
    g = _grant(state, num_new_tokens)
    nt, length, new_len, granted, need = g.nt, state.seq_lens, g.new_len, g.granted, g.need
    nb_old, nb_new, new_blocks, cow = g.nb_old, g.nb_new, g.new_blocks, g.cow
    last_col, last_blk = g.last_col, g.last_blk
    rows = jnp.arange(b, dtype=I32)
    ok = (nt == 0) | granted
    need_g = jnp.where(granted, need, 0)
    total = jnp.sum(need_g)
    rank0 = cumsum(need_g) - need_g

    new = ensure_free(state, total)
    cow_g = cow & granted
    first_rank = rank0 + cow_g.astype(I32)

    # First new block of every slot: a [B] scatter outside any cond (the decode hot path;
    # XLA copies operands that a cond branch updates in place).
    ids = jnp.where(granted & (new_blocks >= 1), pop_at(new, first_rank), -1)
    col = jnp.where(ids >= 0, jnp.clip(nb_old, 0, m - 1), m)
    ref = new.ref_counts.at[jnp.where(ids >= 0, ids, n)].set(1, mode="drop")
    tables = new.block_tables.at[rows, col].set(ids, mode="drop")

    def more_blocks(args):  # appends that cross several block boundaries (prompt chunks)
        tables, ref = args
        cols = jnp.arange(m, dtype=I32)[None, :]
        sel = granted[:, None] & (cols > nb_old[:, None]) & (cols < nb_new[:, None])
        ids = pop_at(new, first_rank[:, None] + cols - nb_old[:, None])
        ref = ref.at[jnp.where(sel, ids, n).reshape(-1)].set(1, mode="drop")
        return jnp.where(sel, ids, tables), ref

    if m > 1:
        tables, ref = lax.cond(jnp.max(new_blocks) > 1, more_blocks, lambda a: a, (tables, ref))
    new = new.replace(
        ref_counts=ref,
        block_tables=tables,
        seq_lens=jnp.where(granted, new_len, length),
    )

    def copy_on_write(new: BlockState):
        cow_dst = jnp.where(cow_g, pop_at(new, rank0), -1)
        cow_src = jnp.where(cow_g, last_blk, -1)
        dst_tgt = jnp.where(cow_g, cow_dst, n)
        new = new.replace(
            block_tables=new.block_tables.at[rows, jnp.where(cow_g, last_col, m)].set(
                cow_dst, mode="drop"
            ),
            ref_counts=new.ref_counts.at[dst_tgt].set(1, mode="drop"),
        )
        if cfg.enable_prefix_caching:
            src_tokens = take(new.block_tokens, last_blk)
            tokens = new.block_tokens.at[dst_tgt].set(src_tokens, mode="drop")
            new = new.replace(block_tokens=tokens)
        # The source loses one reference per copier; num_free must already be final here.
        new = release(new.replace(num_free=new.num_free - total), cow_src)
        cm = cow_g.astype(I32)
        cpos = jnp.where(cow_g, cumsum(cm) - cm, b)
        copy_src = jnp.full((b,), -1, I32).at[cpos].set(cow_src, mode="drop")
        copy_dst = jnp.full((b,), -1, I32).at[cpos].set(cow_dst, mode="drop")
        return new, copy_src, copy_dst, cow_dst

    def no_copy(new: BlockState):
        none = jnp.full((b,), -1, I32)
        return new.replace(num_free=new.num_free - total), none, none, none

    new, copy_src, copy_dst, cow_dst = lax.cond(jnp.any(cow_g), copy_on_write, no_copy, new)

    if cfg.sliding_window is not None:
        start = jnp.maximum(length - cfg.sliding_window + 1, 0) // s  # first kept column
        cols = jnp.arange(m, dtype=I32)[None, :]
        drop = granted[:, None] & (cols < start[:, None]) & (new.block_tables >= 0)
        released = jnp.where(drop, new.block_tables, -1)
        new = new.replace(block_tables=jnp.where(drop, -1, new.block_tables))
        new = release(new, released.reshape(-1))

    if cfg.enable_prefix_caching:
        known = new.num_known_tokens
        if token_ids is not None:
            tok = jnp.asarray(token_ids, I32).reshape(b, -1)
            tw = tok.shape[1]
            steps = jnp.arange(tw, dtype=I32)[None, :]
            pos = length[:, None] + steps
            blk = take2(new.block_tables, rows[:, None], pos // s)
            wr = granted[:, None] & (steps < nt[:, None]) & (blk >= 0)
            new = new.replace(
                block_tokens=new.block_tokens.at[jnp.where(wr, blk, n), pos % s].set(
                    tok, mode="drop"
                )
            )
            extend = granted & (known == length) & (nt <= tw)
            known = jnp.where(extend, new_len, known)
            new = new.replace(num_known_tokens=known)
            if commit:
                new = register_batch(new, granted, known // s)
    new = tick(new)
    return new, AppendResult(
        ok=ok,
        copy_src=copy_src,
        copy_dst=copy_dst,
        num_copies=jnp.sum(cow_g.astype(I32)),
        slot_copy_dst=cow_dst,
    )


def fork(
    state: BlockState, parent_slot: jax.Array | int, child_slot: jax.Array | int
) -> tuple[BlockState, ForkResult]:
    """Makes ``child_slot`` share every block of ``parent_slot`` (ref counts +1, no copy).

    Refused (state unchanged) unless the parent is active and on the device and the child
    slot is a different, empty slot.
    """
    cfg = state.cfg
    b, n = cfg.max_seqs, cfg.num_blocks
    p = i32(parent_slot)
    c = i32(child_slot)
    sp = jnp.clip(p, 0, b - 1)
    sc = jnp.clip(c, 0, b - 1)
    ok = (
        (p >= 0)
        & (p < b)
        & (c >= 0)
        & (c < b)
        & (p != c)
        & state.active[sp]
        & ~state.swapped[sp]
        & ~state.active[sc]
    )
    row = state.block_tables[sp]
    tc = jnp.where(ok, sc, b)

    def put(arr: jax.Array, val: Any) -> jax.Array:
        return arr.at[tc].set(val, mode="drop")

    new = state.replace(
        ref_counts=state.ref_counts.at[jnp.where(ok & (row >= 0), row, n)].add(1, mode="drop"),
        block_tables=put(state.block_tables, row),
        seq_lens=put(state.seq_lens, state.seq_lens[sp]),
        active=put(state.active, True),
        swapped=put(state.swapped, False),
        slot_salt=put(state.slot_salt, state.slot_salt[sp]),
        num_registered=put(state.num_registered, state.num_registered[sp]),
        num_known_tokens=put(state.num_known_tokens, state.num_known_tokens[sp]),
        clock=state.clock + ok.astype(I32),
    )
    return new, ForkResult(ok=ok)


def free(state: BlockState, slot_mask: jax.Array) -> BlockState:
    """Frees every active slot in ``slot_mask`` (bool[B]); other slots are untouched.

    Device blocks whose ref count reaches 0 return to the pool, or stay in the prefix cache
    as evictable; host blocks of swapped slots return to the host pool.
    """
    cfg = state.cfg
    mask = jnp.asarray(slot_mask, bool).reshape(cfg.max_seqs) & state.active
    dev = mask & ~state.swapped
    host = mask & state.swapped
    tables = state.block_tables
    new = release(state, jnp.where(dev[:, None], tables, -1).reshape(-1))
    if cfg.num_host_blocks > 0:
        new = release_host(new, jnp.where(host[:, None], tables, -1).reshape(-1))
    z = jnp.zeros_like(state.seq_lens)
    new = new.replace(
        block_tables=jnp.where(mask[:, None], -1, tables),
        seq_lens=jnp.where(mask, z, state.seq_lens),
        active=state.active & ~mask,
        swapped=state.swapped & ~mask,
        slot_salt=jnp.where(mask, z, state.slot_salt),
        num_registered=jnp.where(mask, z, state.num_registered),
        num_known_tokens=jnp.where(mask, z, state.num_known_tokens),
    )
    return tick(new)


def slot_mapping(state: BlockState, positions: jax.Array, slots: jax.Array) -> jax.Array:
    """i32[T] KV slot index ``block_id * S + offset`` of token ``positions[t]`` of ``slots[t]``.

    Tokens whose slot is negative, whose position is negative or whose block is missing map
    to -1 (skipped by ``write_kv``).
    """
    cfg = state.cfg
    s, m = cfg.block_size, cfg.max_blocks_per_seq
    positions = jnp.asarray(positions, I32)
    slots = jnp.asarray(slots, I32)
    safe_slot = jnp.clip(slots, 0, cfg.max_seqs - 1)
    col = jnp.clip(positions // s, 0, m - 1)
    blk = state.block_tables[safe_slot, col]
    good = (slots >= 0) & (positions >= 0) & (positions < m * s) & (blk >= 0)
    return jnp.where(good, blk * s + positions % s, -1)
