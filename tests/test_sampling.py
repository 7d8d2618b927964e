"""Tests for paxcache.sampling: SamplingParams validation and the batched jitted sampler."""

from __future__ import annotations

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from paxcache.sampling import (
    SampleOutput,
    SamplingParams,
    pack_params,
    request_key,
    request_keys,
    sample,
)

V = 32
MANY = 2048  # rows for distribution tests; tests share a few batch shapes to share compilations


def _pad_vocab(row: np.ndarray) -> np.ndarray:
    """A short vocabulary padded with -inf up to V (masked entries)."""
    out = np.full((V,), -np.inf, np.float32)
    out[: len(row)] = row
    return out


def _row_args(b: int, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0):
    return (
        jnp.full((b,), temperature, jnp.float32),
        jnp.full((b,), top_k, jnp.int32),
        jnp.full((b,), top_p, jnp.float32),
        jnp.full((b,), min_p, jnp.float32),
    )


def _keys(b: int, seed: int = 0, step: int = 0) -> np.ndarray:
    return request_keys([seed + i for i in range(b)], [step] * b, [0] * b)


def _logits(b: int, v: int = V, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (b, v), jnp.float32) * 3.0


# ------------------------------------------------------------------------------------------
# SamplingParams


def test_sampling_params_defaults_match_design():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (64, 0.0, 0, 1.0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.n, p.logprobs, p.ignore_eos) == (
        None,
        (),
        (),
        1,
        None,
        False,
    )
    assert p.greedy


def test_sampling_params_normalizes_stop_to_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    hash(SamplingParams(stop=["x"]))  # frozen and hashable


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 1.0}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_sampling_params_rejects_bad_value_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# ------------------------------------------------------------------------------------------
# Keys


def test_request_key_is_deterministic_and_distinct():
    k = request_key(7, 3, 1)
    chex.assert_shape(k, (2,))
    assert k.dtype == np.uint32
    np.testing.assert_array_equal(k, request_key(7, 3, 1))
    others = {tuple(request_key(s, t, j)) for s in (7, 8) for t in (3, 4) for j in (0, 1)}
    assert len(others) == 8
    np.testing.assert_array_equal(request_keys([7, 8], [3, 4], [1, 0])[0], k)
    # Huge and negative seeds are accepted (taken modulo 2**64).
    request_key(-1, 0, 0)
    request_key(2**80, 0, 0)


# ------------------------------------------------------------------------------------------
# sample


class SampleVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_greedy_rows_take_argmax_and_report_logprobs(self):
        b = 8
        logits = _logits(b)
        f = self.variant(lambda *a: sample(*a, num_logprobs=3))
        out = f(logits, *_row_args(b), _keys(b))
        assert isinstance(out, SampleOutput)
        chex.assert_shape(out.tokens, (b,))
        chex.assert_shape(out.top_ids, (b, 3))
        np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), -1))
        logp = jax.nn.log_softmax(logits, -1)
        chex.assert_trees_all_close(out.logprob, logp[jnp.arange(b), out.tokens], atol=1e-6)
        ref_lp, ref_ids = jax.lax.top_k(logp, 3)
        np.testing.assert_array_equal(out.top_ids, ref_ids)
        chex.assert_trees_all_close(out.top_logprobs, ref_lp, atol=1e-6)
        np.testing.assert_array_equal(out.top_ids[:, 0], out.tokens)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_computed_only_when_a_row_reports_them(temperature):
    """``logprobs_wanted=False`` skips the log-softmax and the top-k search (zeros) and
    changes no token; True gives what ``None`` (always) gives: ``lax.top_k``'s."""
    b = 8
    logits = _logits(b, seed=5)
    args = (logits, *_row_args(b, temperature=temperature), _keys(b))
    f = jax.jit(sample, static_argnames=("num_logprobs",))
    skipped = f(*args, num_logprobs=4, logprobs_wanted=jnp.asarray(False))
    wanted = f(*args, num_logprobs=4, logprobs_wanted=jnp.asarray(True))
    always = f(*args, num_logprobs=4)
    np.testing.assert_array_equal(skipped.tokens, always.tokens)
    chex.assert_shape((skipped.top_ids, skipped.top_logprobs), (b, 4))
    for x in (skipped.logprob, skipped.top_ids, skipped.top_logprobs):
        assert not np.asarray(x).any()
    chex.assert_trees_all_equal(wanted, always)
    logp = jax.nn.log_softmax(logits, -1)
    ref_lp, ref_ids = jax.lax.top_k(logp, 4)
    np.testing.assert_array_equal(wanted.top_ids, ref_ids)
    chex.assert_trees_all_close(wanted.logprob, logp[jnp.arange(b), wanted.tokens], atol=1e-6)


def test_top_k_one_equals_greedy_at_any_temperature():
    b = 8
    logits = _logits(b, seed=1)
    out = sample(logits, *_row_args(b, temperature=1.5, top_k=1), _keys(b))
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), -1))


def test_tiny_top_p_equals_greedy():
    b = 8
    logits = _logits(b, seed=2)
    out = sample(logits, *_row_args(b, temperature=1.0, top_p=1e-6), _keys(b))
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), -1))


def test_min_p_one_equals_greedy_and_min_p_drops_unlikely_tokens():
    b = 8
    logits = _logits(b, seed=3)
    out = sample(logits, *_row_args(b, temperature=1.0, min_p=1.0), _keys(b))
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), -1))
    # Two likely tokens (equal), the rest far below min_p * p_max: only those two are ever drawn.
    row = np.full((V,), -5.0, np.float32)
    row[[4, 9]] = 5.0
    many = MANY
    logits = jnp.asarray(np.tile(row, (many, 1)))
    out = sample(logits, *_row_args(many, temperature=1.0, min_p=0.1), _keys(many, seed=100))
    toks = set(np.asarray(out.tokens).tolist())
    assert toks == {4, 9}
    # Without min_p the tail gets drawn sometimes (mass of tail ~ 30 * e^-10 / 2 ~ 7e-4 per draw
    # at T=1, so use a high temperature to make it likely).
    out = sample(logits, *_row_args(many, temperature=2.0 * 5), _keys(many, seed=100))
    assert set(np.asarray(out.tokens).tolist()) - {4, 9}


def test_top_k_restricts_draws_to_k_most_likely():
    many = MANY
    logits = _logits(1, seed=4)
    top3 = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    out = sample(
        jnp.tile(logits, (many, 1)), *_row_args(many, temperature=5.0, top_k=3), _keys(many, seed=5)
    )
    assert set(np.asarray(out.tokens).tolist()) == top3


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05: top_p = 0.7 keeps {0, 1}; top_p = 0.85 keeps {0, 1, 2}.
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    many = MANY
    logits = jnp.asarray(np.tile(_pad_vocab(np.log(probs)), (many, 1)))
    out = sample(logits, *_row_args(many, temperature=1.0, top_p=0.7), _keys(many, seed=6))
    assert set(np.asarray(out.tokens).tolist()) == {0, 1}
    out = sample(logits, *_row_args(many, temperature=1.0, top_p=0.85), _keys(many, seed=6))
    assert set(np.asarray(out.tokens).tolist()) == {0, 1, 2}


def test_temperature_one_matches_softmax_distribution_chi_square():
    # 8-token vocab, MANY independent rows (one draw each, distinct keys), fixed seeds.
    rng = np.random.default_rng(0)
    row = rng.normal(size=8).astype(np.float32)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    many = MANY
    logits = jnp.asarray(np.tile(_pad_vocab(row), (many, 1)))
    out = sample(logits, *_row_args(many, temperature=1.0), _keys(many, seed=1234))
    counts = np.bincount(np.asarray(out.tokens), minlength=V)
    assert counts[8:].sum() == 0
    counts = counts[:8]
    expected = probs * many
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: the 99.9% quantile is 24.3.
    assert chi2 < 24.3, (counts, expected)


def test_filtered_distribution_is_renormalized_top_k():
    rng = np.random.default_rng(1)
    row = rng.normal(size=10).astype(np.float32)
    keep = np.argsort(-row)[:4]
    probs = np.zeros(10)
    probs[keep] = np.exp(row[keep] - row.max())
    probs /= probs.sum()
    many = MANY
    logits = jnp.asarray(np.tile(_pad_vocab(row), (many, 1)))
    out = sample(logits, *_row_args(many, temperature=1.0, top_k=4), _keys(many, seed=99))
    counts = np.bincount(np.asarray(out.tokens), minlength=V)[:10]
    assert counts[probs == 0].sum() == 0
    expected = probs[keep] * many
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 dof, 99.9%


def test_same_key_same_token_regardless_of_batch_position_and_companions():
    logits = _logits(1, seed=7)[0]
    key = request_key(42, 5, 0)
    # Alone, sampled at T=1.
    alone = sample(logits[None], *_row_args(1, temperature=1.0), key[None]).tokens[0]
    # At position 3 of 8, with companions that are greedy, filtered, and sampled with other keys.
    b = 8
    batch_logits = _logits(b, seed=8).at[3].set(logits)
    temperature = jnp.array([0.0, 0.7, 1.0, 1.0, 2.0, 1.0, 0.0, 1.0], jnp.float32)
    top_k = jnp.array([0, 2, 0, 0, 5, 0, 0, 3], jnp.int32)
    top_p = jnp.array([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.9], jnp.float32)
    min_p = jnp.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0], jnp.float32)
    keys = request_keys([1, 2, 3, 42, 5, 6, 7, 8], [0, 0, 0, 5, 0, 0, 0, 0], [0] * 8)
    mixed = sample(batch_logits, temperature, top_k, top_p, min_p, keys).tokens[3]
    assert int(alone) == int(mixed)
    # And a different step gives (for at least one of several steps) a different token.
    draws = {
        int(
            sample(
                logits[None], *_row_args(1, temperature=1.0), request_key(42, s, 0)[None]
            ).tokens[0]
        )
        for s in range(20)
    }
    assert len(draws) > 1


def test_typed_keys_are_accepted_and_equal_raw_keys():
    b = 8
    logits = _logits(b, seed=9)
    raw = _keys(b, seed=3)
    typed = jax.random.wrap_key_data(jnp.asarray(raw), impl="threefry2x32")
    a = sample(logits, *_row_args(b, temperature=1.0), raw).tokens
    c = sample(logits, *_row_args(b, temperature=1.0), typed).tokens
    np.testing.assert_array_equal(a, c)


def test_mixed_greedy_and_sampled_rows():
    b = 8
    logits = _logits(b, seed=10)
    temperature = jnp.array([0.0, 1.0, 0.0, 1.0, 0.0, 1e-7, 1.0, 1.0], jnp.float32)
    out = sample(logits, temperature, *_row_args(b)[1:], _keys(b))
    greedy = np.argmax(np.asarray(logits), -1)
    for i in (0, 2, 4, 5):
        assert int(out.tokens[i]) == greedy[i]


def test_masked_vocab_entries_are_never_sampled():
    b = MANY
    logits = _logits(b, seed=11).at[:, V // 2 :].set(-jnp.inf)
    for kw in ({}, {"top_p": 0.9}, {"top_k": 40}):
        out = sample(logits, *_row_args(b, temperature=2.0, **kw), _keys(b))
        assert int(jnp.max(out.tokens)) < V // 2
        assert bool(jnp.all(jnp.isfinite(out.logprob)))


def test_pack_params_pads_with_greedy_rows():
    t, k, p, m = pack_params([SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1)], 3)
    np.testing.assert_allclose(t, [0.5, 0, 0])
    np.testing.assert_array_equal(k, [3, 0, 0])
    np.testing.assert_allclose(p, [0.9, 1, 1])
    np.testing.assert_allclose(m, [0.1, 0, 0])
    with pytest.raises(ValueError, match="batch_size"):
        pack_params([SamplingParams()] * 2, 1)


def test_bad_shapes_raise_value_error_naming_the_argument():
    with pytest.raises(ValueError, match="keys"):
        sample(_logits(2), *_row_args(2), jnp.zeros((2, 3), jnp.uint32))
    with pytest.raises(ValueError, match="logits"):
        sample(_logits(2)[0], *_row_args(2), _keys(2))


@settings(max_examples=15, deadline=None)
@given(
    temperature=st.floats(0.05, 2.0),
    top_k=st.integers(0, V + 4),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_sample_always_returns_a_kept_token(temperature, top_k, top_p, min_p, seed):
    logits = _logits(1, seed=seed % 1000)
    out = sample(
        logits, *_row_args(1, temperature, top_k, top_p, min_p), request_key(seed, 0, 0)[None]
    )
    tok = int(out.tokens[0])
    assert 0 <= tok < V
    s = np.sort(np.asarray(logits[0]))[::-1]
    rank = int(np.sum(s > np.asarray(logits[0])[tok]))
    if top_k:
        assert rank < top_k
    # min-p over temperature-scaled probabilities.
    scaled = np.asarray(logits[0], np.float64) / temperature
    assert scaled[tok] - scaled.max() >= np.log(max(min_p, 1e-30)) - 1e-4


_JITTED: dict = {}


def _jitted(fn):
    return _JITTED.setdefault(fn, jax.jit(fn))


@settings(max_examples=16, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    temperature=st.sampled_from([0.3, 1.0, 2.0]),
    batch_has=st.sampled_from(["every filter", "no top-k", "no top-p", "only min-p"]),
)
def test_threshold_filters_match_the_sorting_oracle(seed, temperature, batch_has):
    """The sort-free filters sample what a full sort does, in batches that mix the filters
    and in batches where no row has top-k or top-p (whose threshold searches are skipped)."""
    from paxcache.sampling import _filtered_sample, _filtered_sample_sorted

    b, v = 16, 50
    rng = np.random.default_rng(seed)
    scaled = jnp.asarray(rng.normal(size=(b, v)) * 3 / temperature, jnp.float32)
    scaled = scaled.at[0, 10:].set(-jnp.inf)  # a row with masked vocabulary
    gumbel = jax.random.gumbel(jax.random.key(seed), (b, v), jnp.float32)
    ks = [0, 50, 80] if batch_has in ("no top-k", "only min-p") else [0, 1, 2, 5, 49, 50, 80]
    ps = [1.0] if batch_has in ("no top-p", "only min-p") else [1.0, 0.99, 0.9, 0.5, 0.1, 1e-6]
    top_k = jnp.asarray(rng.choice(ks, size=b), jnp.int32)  # 50 and 80 >= V: no filter
    top_p = jnp.asarray(rng.choice(ps, size=b), jnp.float32)
    min_p = jnp.asarray(rng.choice([0.0, 0.0, 0.05, 0.3, 1.0], size=b), jnp.float32)
    fast = _jitted(_filtered_sample)(scaled, gumbel, top_k, top_p, min_p)
    oracle = _jitted(_filtered_sample_sorted)(scaled, gumbel, top_k, top_p, min_p)
    np.testing.assert_array_equal(fast, oracle)


def test_order_key_preserves_float_order():
    from paxcache.sampling import _order_key

    x = jnp.asarray([-jnp.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 7.5e30, jnp.inf], jnp.float32)
    k = np.asarray(_order_key(x)).astype(np.int64)
    assert np.all(np.diff(k) >= 0) and k[0] < k[1] < k[2] and k[-2] < k[-1]


def test_batched_keys_of_seeds_past_2_to_the_63_equal_each_rows_own_key():
    """A list mixing seeds past 2**63 with small ones (numpy would make it float64)."""
    from paxcache.sampling import request_key, request_keys

    seeds, steps, index = [2**64 - 1, 3, 2**63 + 1, -5], [0, 1, 2, 3], [0, 1, 0, 1]
    want = np.stack([request_key(s, t, j) for s, t, j in zip(seeds, steps, index, strict=True)])
    np.testing.assert_array_equal(request_keys(seeds, steps, index), want)
