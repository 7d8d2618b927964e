"""The XLA ragged attention path that ``impl="auto"`` runs on CPU: column chunks (several per
call, a partial last one) and stacked ``[L, N, S, C, P, D]`` pages read in place.

The semantics are checked against the plain oracle on NaN-filled pages with shuffled tables
(helpers of tests/test_attention_kernels.py); here the chunk size is forced small so one call
walks several chunks, and the compiled program is checked for copies of a layer's pages."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_kernels import _check, _ragged_oracle, ragged_case

import kernels_pallas as kp
from kernels_pallas import reference
from kernels_pallas.kv_layout import merge_kv, split_kv

# decode, whole prefill, chunked prefill, prefix hit, empty query, then padded sequences
Q_LENS = [1, 21, 6, 3, 0, 1, 2]
KV_LENS = [37, 21, 30, 11, 7, 1, 3]
NUM_SEQS = 6


def _run(case, **kw):
    return reference.ragged_paged_attention_xla(
        case.q, case.kv_pages[None], case.kv_lens, case.block_tables,
        case.cu_q_lens, case.num_seqs, num_kv_heads=case.k_heads, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("chunk_blocks", [1, 2, 3, 100])
@pytest.mark.parametrize(
    "opts", [{}, dict(sliding_window=9, soft_cap=3.0), dict(sliding_window=1)], ids=str
)
def test_chunked_columns_match_oracle(monkeypatch, chunk_blocks, opts):
    rng = np.random.default_rng(7)
    s, m, d, k_heads = 4, 10, 16, 2
    t = sum(Q_LENS[:NUM_SEQS]) + 3
    case = ragged_case(rng, Q_LENS, KV_LENS, NUM_SEQS, t, 4, k_heads, d, s, m, np.float32)
    per_block = t * k_heads * s * d * 4
    monkeypatch.setattr(reference, "XLA_CHUNK_BYTES", chunk_blocks * per_block)
    assert reference._chunk_blocks(t, k_heads, s, d, m, 4) == min(chunk_blocks, m)
    out = _run(case, **opts)
    _check(out, _ragged_oracle(case, **opts), np.float32)
    total = case.cu_q_lens[NUM_SEQS]
    np.testing.assert_array_equal(np.asarray(out[total:]), 0.0)  # padding rows


def test_stacked_pages_with_traced_layer_match_per_layer_calls(monkeypatch):
    rng = np.random.default_rng(8)
    s, m = 4, 10
    t = sum(Q_LENS[:NUM_SEQS])
    base = ragged_case(rng, Q_LENS, KV_LENS, NUM_SEQS, t, 4, 2, 16, s, m, np.float32)
    # Same tables and lengths, different contents per layer (unwritten slots stay NaN).
    scales = [1.0, -0.5, 2.0]
    k, v = split_kv(jnp.asarray(base.kv_pages), base.k_heads)
    kv_layers = [merge_kv(k * c, v + c) for c in scales]
    kv_stack = jnp.stack(kv_layers)
    monkeypatch.setattr(reference, "XLA_CHUNK_BYTES", 2 * t * 2 * s * 16 * 4)

    @jax.jit
    def per_layer(layer):
        return reference.ragged_paged_attention_xla(
            base.q, kv_stack, base.kv_lens, base.block_tables, base.cu_q_lens,
            base.num_seqs, num_kv_heads=base.k_heads, layer=layer,
        )  # fmt: skip

    for i in range(len(scales)):
        want = _ragged_oracle(dataclasses.replace(base, kv_pages=kv_layers[i]))
        _check(per_layer(jnp.int32(i)), want, np.float32)


def test_stacked_layer_pages_are_never_copied():
    """The public op on an L-layer cache + traced layer compiles without any
    ``[N, S, C, P, D]``-sized (one layer) or ``[L, ...]``-sized intermediate: gathers read the
    stacked pages in place (slicing a layer first copied it on every call)."""
    layers, k_heads, n, s, d, t, b, m = 3, 2, 96, 8, 32, 24, 4, 8
    cache = kp.init_kv_cache(layers, n, s, k_heads, d, jnp.float32)
    q = jnp.zeros((t, 4, d), jnp.float32)
    lens = jnp.array([9, 30, 1, 17], jnp.int32)
    tables = jnp.arange(b * m, dtype=jnp.int32).reshape(b, m)
    cu = jnp.array([0, 1, 8, 9, 12], jnp.int32)

    def f(q, cache, layer):
        return kp.ragged_paged_attention(q, cache, lens, tables, cu, 4, layer=layer)

    hlo = jax.jit(f).lower(q, cache, jnp.int32(1)).compile().as_text()
    # One layer's pages in any shape: [N, S, C, P, D] (f32: C = 2K, P = 1, maybe squeezed),
    # [1, N, S, C, P, D], blocks and offsets flattened, or K and V apart ([N, S, K, D]).
    c = 2 * k_heads
    layer_shapes = re.compile(rf"f32\[(1,)?({n},{s}|{n * s}),({c}(,1)?|{k_heads}),{d}\]")
    results = [ln.split("=", 1)[1].split("(")[0] for ln in hlo.splitlines() if " = " in ln]
    offending = [r for r in results if layer_shapes.search(r) and "parameter" not in r]
    assert not offending, offending[:5]
