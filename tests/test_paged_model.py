"""The paged path (allocator + metadata + write_kv + ragged paged attention) equals the dense
path of the same model: whole prefill, decode, chunked prefill, prefix-cache hits, mixed
batches with random block tables, on pages filled with NaN before use."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels_pallas as kp
from paxcache import allocator
from paxcache.attention import build_metadata
from paxcache.attention import metadata_from_state as _eager_metadata_from_state
from paxcache.config import CacheConfig
from paxcache.models import LlamaConfig, LlamaForCausalLM
from paxcache.nn import PagedAttention

S = 8  # block size
N = 96  # blocks
M = 12  # max blocks per sequence
ATOL = 1e-4


def _model(window=None, seed=0):
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_windows=(window, window) if window else (),
    )
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))


def _nan_pages(model):
    return model.init_kv_cache(N, S, fill_value=float("nan"))


_JITTED: dict = {}


def _forward(model, pages, md, tokens, window=None, impl="auto", interpret=False):
    """Paged forward through the model's own attention layer, jitted once per (model, impl) so
    repeated steps do not retrace. ``window`` is the model's (its config gives it to the
    layer); the kernel choice travels in the metadata."""
    assert window == model.config.sliding_window
    key = (id(model), impl, interpret)
    if key not in _JITTED:
        graphdef, params = nnx.split(model)

        @jax.jit
        def fwd(params, pages, md, tokens):
            return nnx.merge(graphdef, params).forward_paged(tokens, pages, md)

        _JITTED[key] = (fwd, params, model)
    fwd, params, _ = _JITTED[key]
    return fwd(params, pages, md.replace(impl=impl, interpret=interpret), tokens)


@pytest.fixture(scope="module")
def model():
    return _model()


# The helpers below run jitted: eagerly, each of their dozens of small ops is an XLA:CPU
# program of its own (compiled on first use): the module's first test took ~16 s idle.
metadata_from_state = jax.jit(
    _eager_metadata_from_state,
    static_argnums=(3, 4),
    static_argnames=("impl", "interpret", "mesh"),
)
_allocate = jax.jit(allocator.allocate, static_argnames=("commit",))
_DENSE: dict = {}


def _dense_logits(model, ids):
    if id(model) not in _DENSE:
        graphdef, params = nnx.split(model)
        fn = jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids))
        _DENSE[id(model)] = (fn, params, model)
    fn, params, _ = _DENSE[id(model)]
    return np.asarray(fn(params, jnp.asarray([ids], jnp.int32))[0])


def _step(model, state, pages, rows, num_tokens=None):
    """rows: list of (slot, fed token ids, kv_len after). Returns logits per row chunk."""
    toks = [t for _, ids, _ in rows for t in ids]
    t = num_tokens or max(32, 1 << (len(toks) - 1).bit_length())
    tokens = jnp.asarray(toks + [0] * (t - len(toks)), jnp.int32)
    b = len(rows)
    md = metadata_from_state(
        state,
        jnp.asarray([r[0] for r in rows], jnp.int32),
        jnp.asarray([len(r[1]) for r in rows], jnp.int32),
        b,
        t,
        kv_lens=jnp.asarray([r[2] for r in rows], jnp.int32),
    )
    logits, pages = _forward(model, pages, md, tokens)
    logits = np.asarray(logits)
    out, off = [], 0
    for _, ids, _ in rows:
        out.append(logits[off : off + len(ids)])
        off += len(ids)
    return out, pages


_append = jax.jit(allocator.append)


def _cfg(**kw):
    return CacheConfig(num_blocks=N, block_size=S, max_seqs=6, max_blocks_per_seq=M, **kw)


def _alloc(state, slot, ids, commit=True):
    padded = jnp.asarray(list(ids) + [0] * (M * S - len(ids)), jnp.int32)
    state, res = _allocate(state, slot, padded, len(ids), commit=commit)
    assert bool(res.ok)
    return state, int(res.num_cached_tokens)


def test_whole_prefill_equals_dense(model):
    ids = list(np.random.default_rng(0).integers(0, 97, 21))
    state, _ = _alloc(allocator.init(_cfg()), 0, ids)
    (logits,), _ = _step(model, state, _nan_pages(model), [(0, ids, 21)])
    chex.assert_trees_all_close(logits, _dense_logits(model, ids), atol=ATOL)


def test_prefill_then_20_decode_steps_equals_dense(model):
    ids = list(np.random.default_rng(1).integers(0, 97, 13))
    state, _ = _alloc(allocator.init(_cfg()), 2, ids)
    pages = _nan_pages(model)
    (logits,), pages = _step(model, state, pages, [(2, ids, len(ids))])
    paged_last = []
    counts = np.zeros(6, np.int32)
    counts[2] = 1
    for _ in range(20):
        nxt = int(np.argmax(logits[-1]))
        ids.append(nxt)
        state, res = _append(state, jnp.asarray(counts))
        assert bool(res.ok[2])
        (logits,), pages = _step(model, state, pages, [(2, [nxt], len(ids))])
        paged_last.append(logits[-1])
    # Causal: the dense logits of the final sequence hold every step's logits.
    dense = _dense_logits(model, ids)
    chex.assert_trees_all_close(np.stack(paged_last), dense[13:], atol=ATOL)


def test_prompt_in_three_chunks_equals_dense(model):
    ids = list(np.random.default_rng(2).integers(0, 97, 30))
    state, _ = _alloc(allocator.init(_cfg()), 1, ids, commit=False)
    pages = _nan_pages(model)
    dense = _dense_logits(model, ids)
    for lo, hi in ((0, 10), (10, 21), (21, 30)):
        (logits,), pages = _step(model, state, pages, [(1, ids[lo:hi], hi)])
        chex.assert_trees_all_close(logits, dense[lo:hi], atol=ATOL)


def test_prefix_cache_hit_skips_cached_blocks_and_equals_dense(model):
    rng = np.random.default_rng(3)
    shared = list(rng.integers(0, 97, 24))
    a = shared + list(rng.integers(0, 97, 5))
    b = shared + list(rng.integers(0, 97, 7))
    state = allocator.init(_cfg())
    state, _ = _alloc(state, 0, a, commit=False)
    pages = _nan_pages(model)
    _, pages = _step(model, state, pages, [(0, a, len(a))])
    state = allocator.commit(state, jnp.asarray([len(a), 0, 0, 0, 0, 0], jnp.int32))
    state, cached = _alloc(state, 1, b)
    assert cached == 24
    (logits,), pages = _step(model, state, pages, [(1, b[cached:], len(b))])
    chex.assert_trees_all_close(logits, _dense_logits(model, b)[cached:], atol=ATOL)


def test_mixed_batch_with_random_block_tables_equals_dense(model):
    """Decode, whole prefill, a middle chunk and a prefix hit in one ragged step, over random
    (non-identity) block tables built by hand; unwritten slots hold NaN."""
    rng = np.random.default_rng(4)
    lens = [17, 9, 26, 20]  # full context of each sequence after the step
    q_lens = [1, 9, 8, 4]  # decode, whole prefill, chunk [10, 18) of 26, prefix hit of 16
    starts = [16, 0, 10, 16]  # tokens already in the cache before the step
    seqs = [list(rng.integers(0, 97, n)) for n in lens]
    perm = rng.permutation(N)
    tables = np.full((4, M), -1, np.int32)
    k = 0
    for i, n in enumerate(lens):
        nb = -(-n // S)
        tables[i, :nb] = perm[k : k + nb]
        k += nb
    pages = _nan_pages(model)
    # Write each sequence's already-cached tokens (the dense prefix) with a prefill step.
    for i in range(4):
        if starts[i]:
            md = build_metadata(
                jnp.asarray(tables[i : i + 1]),
                jnp.asarray([starts[i]]),
                jnp.asarray([starts[i]]),
                1,
                32,
                S,
            )
            toks = jnp.asarray(seqs[i][: starts[i]] + [0] * (32 - starts[i]), jnp.int32)
            _, pages = _forward(model, pages, md, toks)
    # The chunk row's sequence: positions >= 18 are never written (NaN) and must not be read.
    t = 32
    fed = [seqs[i][starts[i] : starts[i] + q_lens[i]] for i in range(4)]
    toks = [x for f in fed for x in f]
    md = build_metadata(
        jnp.asarray(np.concatenate([tables, np.zeros((2, M), np.int32)])),
        jnp.asarray([s + q for s, q in zip(starts, q_lens, strict=True)] + [0, 0]),
        jnp.asarray(q_lens + [0, 0]),
        4,
        t,
        S,
    )
    logits, _ = _forward(model, pages, md, jnp.asarray(toks + [0] * (t - len(toks)), jnp.int32))
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()
    off = 0
    for i in range(4):
        end = starts[i] + q_lens[i]
        dense = _dense_logits(model, seqs[i][:end])[starts[i] : end]
        chex.assert_trees_all_close(logits[off : off + q_lens[i]], dense, atol=ATOL)
        off += q_lens[i]


def test_sliding_window_model_paged_equals_dense():
    model = _model(window=12, seed=5)
    ids = list(np.random.default_rng(5).integers(0, 97, 30))
    state, _ = _alloc(allocator.init(_cfg(sliding_window=12)), 0, ids[:20], commit=False)
    pages = _nan_pages(model)
    md = metadata_from_state(state, jnp.asarray([0]), jnp.asarray([20]), 1, 32)
    toks = jnp.asarray(ids[:20] + [0] * 12, jnp.int32)
    logits, pages = _forward(model, pages, md, toks, window=12)
    dense = _dense_logits(model, ids[:20])
    chex.assert_trees_all_close(np.asarray(logits)[:20], dense, atol=ATOL)
    # Decode 10 more tokens; the allocator releases blocks that left the window.
    counts = np.zeros(6, np.int32)
    counts[0] = 1
    paged_last = []
    for n in range(20, 30):
        state, res = _append(state, jnp.asarray(counts))
        assert bool(res.ok[0])
        md = metadata_from_state(state, jnp.asarray([0]), jnp.asarray([1]), 1, 8)
        toks = jnp.asarray([ids[n]] + [0] * 7, jnp.int32)
        logits, pages = _forward(model, pages, md, toks, window=12)
        held = int((np.asarray(state.block_tables[0]) >= 0).sum())
        assert held <= -(-12 // S) + 1
        paged_last.append(np.asarray(logits)[0])
    chex.assert_trees_all_close(np.stack(paged_last), _dense_logits(model, ids)[20:], atol=ATOL)


def test_paged_attention_layer_in_a_custom_model_matches_dense_attention():
    """A user's own NNX model swaps one call for ``PagedAttention`` and keeps its output."""

    class TinyAttn(nnx.Module):
        def __init__(self, rngs):
            self.qkv = nnx.Linear(32, 3 * 32, rngs=rngs)
            self.attn = PagedAttention(num_heads=4, num_kv_heads=4, head_dim=8)

        def __call__(self, x, pages, md):
            q, k, v = jnp.split(self.qkv(x).reshape(-1, 12, 8), 3, axis=1)
            out, pages = self.attn(q, k, v, pages, md)
            return out.reshape(-1, 32), pages

    m = TinyAttn(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (11, 32))
    pages = kp.init_kv_cache(1, 8, S, 4, 8, jnp.float32, fill_value=float("nan"))  # one layer
    md = build_metadata(jnp.asarray([[3, 5, -1]]), jnp.asarray([11]), jnp.asarray([11]), 1, 16, S)
    xp = jnp.concatenate([x, jnp.zeros((5, 32))])
    out, _ = m(xp, pages, md)
    q, k, v = jnp.split(m.qkv(x).reshape(-1, 12, 8), 3, axis=1)
    logits = jnp.einsum("thd,shd->hts", q, k) * 8**-0.5
    mask = jnp.tril(jnp.ones((11, 11), bool))
    ref = jnp.einsum("hts,shd->thd", jax.nn.softmax(jnp.where(mask, logits, -jnp.inf)), v)
    chex.assert_trees_all_close(out[:11], ref.reshape(11, 32), atol=1e-5)
    chex.assert_trees_all_close(out[11:], jnp.zeros((5, 32)))


@pytest.mark.slow
def test_mixed_batch_through_pallas_tpu_kernel_interpret(model):
    ids = list(np.random.default_rng(6).integers(0, 97, 19))
    state, _ = _alloc(allocator.init(_cfg()), 0, ids)
    md = metadata_from_state(state, jnp.asarray([0]), jnp.asarray([19]), 1, 24)
    toks = jnp.asarray(ids + [0] * 5, jnp.int32)
    logits, _ = _forward(model, _nan_pages(model), md, toks, impl="pallas", interpret=True)
    chex.assert_trees_all_close(np.asarray(logits)[:19], _dense_logits(model, ids), atol=ATOL)
