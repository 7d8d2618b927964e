"""Property tests: random operation sequences against the plain-Python model allocator.

Each example runs a random sequence of allocate / append / fork / free / swap_out / swap_in
operations (many of which must fail) on a tiny configuration, through the jitted pure functions
(compiled once per configuration), and checks after every step that the allocator agrees with
``tests/model_allocator.py`` (same successes and failures, free counts, table lengths, copy and
swap counts; ``can_append`` predicts every append's grants) and that ``check_invariants``
holds. At the end, freeing everything must return every block. A second test runs with prefix
caching on (with and without a sliding window) and checks exactness end to end: it simulates
the KV each block would hold and proves that every token position of every live sequence holds
exactly the KV of that sequence's prefix (wrong prefix hits, bad copy-on-write or swap plans
would all break it).

Operations in total: 2 configs x 40 examples + 2 configs x 25 examples, 40 to 70 operations
each: about 7,000 (at least 5,200).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_allocator import ModelAllocator

from paxcache import allocator
from paxcache.config import CacheConfig

B, S, M = 4, 4, 5

CONFIGS = {
    "plain": CacheConfig(
        num_blocks=14,
        block_size=S,
        max_seqs=B,
        max_blocks_per_seq=M,
        num_host_blocks=6,
        watermark=0.1,
        enable_prefix_caching=False,
    ),
    "window": CacheConfig(
        num_blocks=10,
        block_size=S,
        max_seqs=B,
        max_blocks_per_seq=M,
        num_host_blocks=5,
        watermark=0.0,
        enable_prefix_caching=False,
        sliding_window=6,
    ),
}
CACHE_CONFIGS = {
    "cache": CacheConfig(
        num_blocks=12,
        block_size=S,
        max_seqs=B,
        max_blocks_per_seq=M,
        num_host_blocks=6,
        watermark=0.0,
        enable_prefix_caching=True,
    ),
    "cache_window": CacheConfig(
        num_blocks=12,
        block_size=S,
        max_seqs=B,
        max_blocks_per_seq=M,
        num_host_blocks=6,
        watermark=0.0,
        enable_prefix_caching=True,
        sliding_window=5,
    ),
}


@functools.cache
def _fns():
    return {
        "allocate": jax.jit(allocator.allocate, static_argnames=("commit",)),
        "append": jax.jit(allocator.append, static_argnames=("commit",)),
        "can_append": jax.jit(allocator.can_append),
        "fork": jax.jit(allocator.fork),
        "free": jax.jit(allocator.free),
        "swap_out": jax.jit(allocator.swap_out),
        "swap_in": jax.jit(allocator.swap_in),
        "check": jax.jit(allocator.check_invariants),
    }


slots = st.integers(0, B - 1)
masks = st.lists(st.booleans(), min_size=B, max_size=B)
OPS = st.one_of(
    st.tuples(st.just("allocate"), slots, st.integers(0, M * S + 2)),
    st.tuples(
        st.just("append"),
        st.lists(st.sampled_from([0, 0, 1, 1, 1, 2, 3, 4, 7]), min_size=B, max_size=B),
    ),
    st.tuples(st.just("fork"), slots, slots),
    st.tuples(st.just("free"), masks),
    st.tuples(st.just("swap_out"), masks),
    st.tuples(st.just("swap_in"), masks),
)
OP_LISTS = st.lists(OPS, min_size=40, max_size=70)


def _assert_invariants(state: allocator.BlockState) -> None:
    checks = jax.device_get(_fns()["check"](state))
    bad = sorted(k for k, v in checks.items() if not v)
    assert not bad, f"invariants broken: {bad}"


def _compare(state: allocator.BlockState, model: ModelAllocator, where: str) -> None:
    s = jax.device_get(state)
    assert int(allocator.num_free_blocks(s)) == model.num_free_blocks, where
    assert int(s.host_num_free) == model.num_free_host_blocks, where
    for slot in range(B):
        assert bool(s.active[slot]) == model.active(slot), where
        assert bool(s.swapped[slot]) == model.swapped[slot], where
        assert int(s.seq_lens[slot]) == model.lens[slot], where
        held = int(np.sum(s.block_tables[slot] >= 0))
        assert held == model.num_held(slot), where


def _run(cfg: CacheConfig, ops) -> None:
    f = _fns()
    state = allocator.init(cfg)
    model = ModelAllocator(cfg)
    tokens = np.arange(M * S, dtype=np.int32)
    for i, op in enumerate(ops):
        where = f"step {i}: {op}"
        kind = op[0]
        if kind == "allocate":
            _, slot, n = op
            state, res = f["allocate"](state, slot, tokens, n)
            assert bool(res.ok) == model.allocate(slot, n), where
        elif kind == "append":
            counts = np.asarray(op[1], np.int32)
            predicted = np.asarray(f["can_append"](state, counts))  # changes nothing
            state, res = f["append"](state, counts)
            ok, copies = model.append(list(op[1]))
            assert list(np.asarray(res.ok)) == ok, where
            assert list(predicted) == ok, where  # can_append tells append's grants
            assert int(res.num_copies) == copies, where
        elif kind == "fork":
            _, p, c = op
            state, res = f["fork"](state, p, c)
            assert bool(res.ok) == model.fork(p, c), where
        elif kind == "free":
            state = f["free"](state, np.asarray(op[1]))
            model.free(op[1])
        else:
            state, plan = f[kind](state, np.asarray(op[1]))
            ok, num = getattr(model, kind)(op[1])
            assert list(np.asarray(plan.ok)) == ok, where
            assert int(plan.num) == num, where
        _assert_invariants(state)
        _compare(state, model, where)
    state = f["free"](state, np.ones(B, bool))
    _assert_invariants(state)
    assert int(allocator.num_free_blocks(state)) == cfg.num_blocks
    assert int(state.host_num_free) == cfg.num_host_blocks


@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(ops=OP_LISTS)
def test_random_ops_agree_with_python_model_and_keep_invariants(name, ops):
    _run(CONFIGS[name], ops)


# ---------------------------------------------------------------------------------------------
# prefix caching: end-to-end exactness of what every sequence would read

CACHE_OPS = st.one_of(
    st.tuples(
        st.just("allocate"),
        slots,
        st.lists(st.integers(0, 1), min_size=1, max_size=M * S - 2),
        st.integers(0, 1),
        st.booleans(),
    ),
    st.tuples(
        st.just("append"), st.lists(st.sampled_from([0, 1, 1, 2, 5]), min_size=B, max_size=B)
    ),
    st.tuples(st.just("fork"), slots, slots),
    st.tuples(st.just("free"), masks),
    st.tuples(st.just("swap_out"), masks),
    st.tuples(st.just("swap_in"), masks),
    st.tuples(st.just("commit"), st.lists(st.integers(0, M * S), min_size=B, max_size=B)),
)


class _KV:
    """Simulated pages: each (block, offset) holds the token prefix whose KV was written."""

    def __init__(self) -> None:
        self.dev: dict[tuple[int, int], tuple] = {}
        self.host: dict[tuple[int, int], tuple] = {}

    def write(self, table, salt: int, toks: list[int], lo: int, hi: int) -> None:
        for p in range(lo, hi):
            self.dev[(int(table[p // S]), p % S)] = (salt, *toks[: p + 1])

    @staticmethod
    def copy(src: dict, dst: dict, a: int, b: int) -> None:
        for o in range(S):
            if (a, o) in src:
                dst[(b, o)] = src[(a, o)]
            else:
                dst.pop((b, o), None)


@pytest.mark.parametrize("name", sorted(CACHE_CONFIGS))
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(ops=st.lists(CACHE_OPS, min_size=40, max_size=70))
def test_prefix_cache_hits_are_exact_and_every_live_token_reads_its_own_prefix(name, ops):
    cfg = CACHE_CONFIGS[name]
    window = cfg.sliding_window
    f = _fns()
    commit_fn = jax.jit(allocator.commit)
    state = allocator.init(cfg)
    kv = _KV()
    seqs: dict[int, list[int]] = {}
    salts: dict[int, int] = {}
    for i, op in enumerate(ops):
        where = f"step {i}: {op}"
        kind = op[0]
        before = jax.device_get(state)
        if kind == "allocate":
            _, slot, toks, salt, commit = op
            pad = np.zeros(M * S, np.int32)
            pad[: len(toks)] = toks
            state, res = f["allocate"](state, slot, pad, len(toks), salt, commit=commit)
            if bool(res.ok):
                hit = int(res.num_cached_tokens)
                assert hit % S == 0 and hit < len(toks), where
                seqs[slot], salts[slot] = list(toks), salt
                table = np.asarray(state.block_tables[slot])
                kv.write(table, salt, seqs[slot], hit, len(toks))
        elif kind == "append":
            counts = np.asarray(op[1], np.int32)
            new_toks = np.zeros((B, 8), np.int32)
            for slot in range(B):
                new_toks[slot] = (np.arange(8) + slot + i) % 2
            state, res = f["append"](state, counts, new_toks)
            cow_dst = np.asarray(res.slot_copy_dst)
            for slot in range(B):
                if not bool(res.ok[slot]) or counts[slot] == 0:
                    continue
                length = int(before.seq_lens[slot])
                if cow_dst[slot] >= 0:
                    src = int(before.block_tables[slot, length // S])
                    kv.copy(kv.dev, kv.dev, src, int(cow_dst[slot]))
                seqs[slot] += [int(t) for t in new_toks[slot, : counts[slot]]]
                table = np.asarray(state.block_tables[slot])
                kv.write(table, salts[slot], seqs[slot], length, len(seqs[slot]))
        elif kind == "fork":
            _, p, c = op
            state, res = f["fork"](state, p, c)
            if bool(res.ok):
                seqs[c], salts[c] = list(seqs[p]), salts[p]
        elif kind == "free":
            state = f["free"](state, np.asarray(op[1]))
            for slot in range(B):
                if op[1][slot]:
                    seqs.pop(slot, None)
        elif kind == "commit":
            state = commit_fn(state, np.asarray(op[1], np.int32))
        else:
            state, plan = f[kind](state, np.asarray(op[1]))
            out = kind == "swap_out"
            for a, b in zip(
                np.asarray(plan.src[: int(plan.num)]),
                np.asarray(plan.dst[: int(plan.num)]),
                strict=True,
            ):
                if out:
                    kv.copy(kv.dev, kv.host, int(a), int(b))
                else:
                    kv.copy(kv.host, kv.dev, int(a), int(b))
        _assert_invariants(state)
        s = jax.device_get(state)
        for slot, toks in seqs.items():
            assert int(s.seq_lens[slot]) == len(toks), where
            pages = kv.host if s.swapped[slot] else kv.dev
            for p in range(len(toks)):
                blk = int(s.block_tables[slot, p // S])
                if window is not None and blk < 0:
                    # Released by the window: only keys no future query can see.
                    assert (p // S + 1) * S <= len(toks) - window, f"{where}: slot {slot} pos {p}"
                    continue
                got = pages.get((blk, p % S))
                want = (salts[slot], *toks[: p + 1])
                assert got == want, f"{where}: slot {slot} pos {p}"
    state = f["free"](state, np.ones(B, bool))
    _assert_invariants(state)
    assert int(allocator.num_free_blocks(state)) == cfg.num_blocks
    assert int(state.host_num_free) == cfg.num_host_blocks
