"""Decode-only steps on the TPU decode kernel give what the ragged path gives.

``ragged_paged_attention(..., max_q_len=1)`` (a decode-only batch: sequence ``s`` owns row
``s``) runs the TPU decode kernel instead of the ragged one; the engine's step passes that
hint for plans whose rows all feed one token, in a program of its own. Both are checked in
TPU interpret mode against the plain path: the same outputs on NaN-filled caches whatever the
table holds past a length, and the same greedy tokens from the engine.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels_pallas as kp
from paxcache import Engine, SamplingParams
from paxcache.models import ByteTokenizer, LlamaConfig, LlamaForCausalLM


def _decode_batch(rng, *, kv_lens, num_rows, h=4, kh=2, d=64, s=8, m=6, n=24):
    """A cache holding ``kv_lens`` tokens per sequence (NaN elsewhere), tables whose entries
    past each length point at unrelated blocks, and one query row per sequence."""
    b = len(kv_lens)
    cache = kp.init_kv_cache(1, n, s, kh, d, jnp.float32, fill_value=float("nan"))
    tables = np.full((b, m), -1, np.int32)
    order = rng.permutation(n)
    used = 0
    slots = []
    for i, length in enumerate(kv_lens):
        nb = -(-length // s)
        tables[i, :nb] = order[used : used + nb]
        used += nb
        tables[i, nb:] = rng.integers(0, n, m - nb)  # garbage the kernel must never read
        slots += [int(tables[i, p // s]) * s + p % s for p in range(length)]
    k = jnp.asarray(rng.standard_normal((len(slots), kh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((len(slots), kh, d)), jnp.float32)
    cache = kp.write_kv(cache, k, v, np.asarray(slots, np.int32))
    q = jnp.asarray(rng.standard_normal((num_rows, h, d)), jnp.float32)
    nseq = min(b, num_rows)
    cu = np.minimum(np.arange(b + 1), nseq).astype(np.int32)
    return q, cache, np.asarray(kv_lens, np.int32), tables, cu, nseq


@pytest.mark.parametrize(
    "kv_lens,num_rows",
    [([5, 17, 1, 48], 4), ([9, 30], 8), ([20, 3, 7, 44, 11], 3)],
    ids=["rows-equal-seqs", "more-rows-than-seqs", "fewer-rows-than-tables"],
)
def test_decode_hint_runs_the_decode_kernel_with_the_ragged_result(kv_lens, num_rows):
    rng = np.random.default_rng(len(kv_lens) + num_rows)
    q, cache, lens, tables, cu, nseq = _decode_batch(rng, kv_lens=kv_lens, num_rows=num_rows)
    args = (q, cache, lens, tables, cu, nseq)
    plain = kp.ragged_paged_attention(*args, impl="reference")
    hinted = kp.ragged_paged_attention(*args, impl="pallas_tpu", interpret=True, max_q_len=1)
    assert bool(jnp.isfinite(hinted).all())
    chex.assert_trees_all_close(hinted, plain, atol=2e-5, rtol=2e-5)
    chex.assert_trees_all_close(hinted[nseq:], jnp.zeros_like(hinted[nseq:]))


def test_decode_hint_must_be_a_positive_int():
    rng = np.random.default_rng(0)
    q, cache, lens, tables, cu, nseq = _decode_batch(rng, kv_lens=[3, 4], num_rows=2)
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="max_q_len"):
            kp.ragged_paged_attention(q, cache, lens, tables, cu, nseq, max_q_len=bad)


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(3))


def _generate(model, impl, prompts, **kw):
    eng = Engine(
        model,
        ByteTokenizer(),
        num_blocks=32,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        impl=impl,
        interpret=impl != "reference",
        warmup=False,
        **kw,
    )
    outs = eng.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    return eng, [o.outputs[0].token_ids for o in outs]


def test_engine_decode_steps_on_the_decode_kernel_keep_greedy_tokens(model, monkeypatch):
    from kernels_pallas.tpu import routing

    traced = []
    decode_rows = routing.decode_rows
    monkeypatch.setattr(
        routing, "decode_rows", lambda *a: traced.append(a[0].shape) or decode_rows(*a)
    )
    rng = np.random.default_rng(7)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (5, 11)]
    eng, tokens = _generate(model, "pallas", prompts)
    assert eng.decode_buckets, "the TPU kernels (interpret mode) get a decode variant"
    assert traced, "decode-only steps ran the decode kernel"
    ref_eng, ref = _generate(model, "reference", prompts)
    assert not ref_eng.decode_buckets, "the XLA path needs no second program"
    assert tokens == ref
