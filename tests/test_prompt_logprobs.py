"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``), computed in the prefill the
request runs anyway: equal to the log-softmax of a plain dense forward of the same model
(``model(token_ids)``, no cache) within 1e-4 (f32 weights and activations; the paged and the
dense path sum in different orders), across chunked prefill (a 16-token step budget), in mixed
batches, with a warm prefix cache (such a request recomputes every prompt token), for ``n > 1``
and after a recompute preemption."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import byte_llama, forward

from paxcache import Engine, SamplingParams
from paxcache.models import ByteTokenizer
from paxcache.sampling import StructuredOutputsParams

TOL = 1e-4
K = 3


@pytest.fixture(scope="module")
def model():
    return byte_llama()


@pytest.fixture(scope="module")
def engine(model):
    eng = Engine(
        model, ByteTokenizer(), num_blocks=64, block_size=8, max_num_seqs=4,
        max_num_batched_tokens=16,
    )  # fmt: skip
    eng.warmup()
    return eng


def _prompts(seed: int = 0, lens=(1, 2, 40, 20, 57, 9)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, 256, n))) for n in lens]


def dense_prompt_logprobs(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(logprob [P-1], top_ids [P-1, K], top_logprobs [P-1, K])`` of tokens 1.. of ``ids``
    from one dense forward."""
    logits = forward(model, jnp.asarray(ids, jnp.int32)[None])[0].astype(jnp.float32)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))[:-1]
    target = np.asarray(ids[1:])
    order = np.argsort(-logp, axis=-1)[:, :K]
    return (
        logp[np.arange(len(target)), target],
        order,
        np.take_along_axis(logp, order, axis=-1),
    )


def _dense_ranks(model, ids: list[int]) -> list[tuple[int, int]]:
    """The rank of each next prompt token (1 = most likely), as a range over near ties."""
    logits = forward(model, jnp.asarray(ids, jnp.int32)[None])[0].astype(jnp.float32)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))[:-1]
    out = []
    for row, t in zip(logp, ids[1:], strict=True):
        out.append((1 + int(np.sum(row > row[t] + TOL)), 1 + int(np.sum(row > row[t] - TOL))))
    return out


def assert_matches_dense(model, ids: list[int], got: list) -> None:
    assert got is not None and len(got) == len(ids) and got[0] is None
    if len(ids) == 1:
        return
    lp, top_ids, top_lps = dense_prompt_logprobs(model, ids)
    assert [e["token_id"] for e in got[1:]] == ids[1:]
    np.testing.assert_allclose([e["logprob"] for e in got[1:]], lp, atol=TOL, rtol=0)
    for e, row in zip(got[1:], _dense_ranks(model, ids), strict=True):
        lo, hi = row
        assert lo <= e["rank"] <= hi  # a near tie may order either way
    for e, want_ids, want_lps in zip(got[1:], top_ids, top_lps, strict=True):
        assert len(e["top"]) == K
        np.testing.assert_allclose([lp for _, lp in e["top"]], want_lps, atol=TOL, rtol=0)
        # ids agree where the dense top-K is not a near tie
        for (tid, _), want, wlp in zip(e["top"], want_ids, want_lps, strict=True):
            if np.sum(np.abs(want_lps - wlp) < 2 * TOL) == 1:
                assert tid == want


def test_prompt_logprobs_equal_the_dense_forward_in_a_mixed_chunked_batch(model, engine):
    prompts = _prompts()
    # Every other request asks; the 40- and 57-token prompts span 3-4 chunks of 16.
    params = [
        SamplingParams(max_tokens=2, prompt_logprobs=K if i % 2 == 0 else None, ignore_eos=True)
        for i in range(len(prompts))
    ]
    params[3] = SamplingParams(max_tokens=2, prompt_logprobs=K, ignore_eos=True)  # 20 tokens
    outs = engine.generate(prompts, params)
    for ids, p, out in zip(prompts, params, outs, strict=True):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_matches_dense(model, ids, out.prompt_logprobs)
    st = engine.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_a_warm_prefix_cache_still_gives_every_prompt_logprob(model, engine):
    ids = _prompts(seed=1, lens=(48,))[0]
    plain = SamplingParams(max_tokens=1)
    engine.generate([ids], plain)
    warm = engine.generate([ids], plain)[0]
    assert warm.num_cached_tokens >= 40  # the cache holds this prompt
    out = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=K))[0]
    assert out.num_cached_tokens == 0  # recomputed, not read from the cache
    assert_matches_dense(model, ids, out.prompt_logprobs)
    # and the cache is still there for requests without prompt logprobs
    assert engine.generate([ids], plain)[0].num_cached_tokens >= 40


def test_zero_top_logprobs_n_greater_than_one_and_delta_outputs(model, engine):
    ids = _prompts(seed=2, lens=(21,))[0]
    p = SamplingParams(max_tokens=3, n=2, prompt_logprobs=0, output_kind="delta")
    engine.add_request("d", ids, p)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step() if o.request_id == "d"]
    got = [x for x in seen if x is not None]
    assert len(got) == 1 and len(seen) >= 3  # reported once, in the first output
    assert all(e["top"] == [] for e in got[0][1:])
    lp, _, _ = dense_prompt_logprobs(model, ids)
    np.testing.assert_allclose([e["logprob"] for e in got[0][1:]], lp, atol=TOL, rtol=0)


@pytest.mark.slow  # a second engine: ~30 s of compilation on 2 CPU cores
def test_prompt_logprobs_survive_a_recompute_preemption(model):
    eng = Engine(
        model, ByteTokenizer(), num_blocks=12, block_size=8, max_num_seqs=4,
        max_num_batched_tokens=16, preemption_mode="recompute",
    )  # fmt: skip
    prompts = _prompts(seed=3, lens=(30, 30, 30))
    params = SamplingParams(max_tokens=12, prompt_logprobs=1, ignore_eos=True)
    outs = eng.generate(prompts, params)
    assert eng.stats()["num_preemptions_recompute"] > 0
    for ids, out in zip(prompts, outs, strict=True):
        got = out.prompt_logprobs
        lp, _, _ = dense_prompt_logprobs(model, ids)
        np.testing.assert_allclose([e["logprob"] for e in got[1:]], lp, atol=TOL, rtol=0)


@pytest.mark.parametrize("bad", [-1, 21, True, 1.0, "2"])
def test_sampling_params_refuse_bad_prompt_logprobs(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def _mixed(engine: Engine) -> None:
    """Echo-like (prompt logprobs), plain, sampled n=2 and logprob requests in one batch."""
    params = [
        SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=K),
        SamplingParams(max_tokens=5, temperature=0),
        SamplingParams(max_tokens=4, temperature=1.0, n=2, seed=1, logprobs=2),
    ]
    engine.generate(_prompts(3, lens=(30, 5, 12)), params)


def test_warmup_with_prompt_logprobs_compiles_every_program_a_mixed_load_runs(model, caplog):
    """With ``warmup_prompt_logprobs`` (the server's default) a mixed load compiles nothing
    after warm-up; a program warm-up skipped (here the constrained one: no
    ``warmup_structured``) logs one warning naming it when it first compiles, once."""
    eng = Engine(
        model, ByteTokenizer(), num_blocks=64, block_size=8, max_num_seqs=4,
        max_num_batched_tokens=16, warmup=False,
    )  # fmt: skip
    eng.warmup_prompt_logprobs = True
    eng.warmup()
    compiled = eng.stats()["num_compilations"]
    with caplog.at_level("WARNING", logger="paxcache.step"):
        _mixed(eng)
    assert eng.stats()["num_compilations"] == compiled
    assert "on first use" not in caplog.text
    pytest.importorskip("llguidance")
    regex = SamplingParams(
        max_tokens=3, temperature=0, structured_outputs=StructuredOutputsParams(regex="[ab]+")
    )
    with caplog.at_level("WARNING", logger="paxcache.step"):
        eng.generate(_prompts(5, lens=(4, 4)), regex)
        eng.generate(_prompts(6, lens=(4,)), regex)
    lines = [r.getMessage() for r in caplog.records if "on first use" in r.getMessage()]
    assert lines == ["compiling the step for 16 tokens (constrained) on first use (warm-up did "
                     "not compile it)"]  # fmt: skip
