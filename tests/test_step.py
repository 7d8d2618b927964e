"""The step's inputs: one pytree built from a plan by ``prepare_inputs`` (shapes, dtypes,
padding, and the rows and samples it encodes)."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

from paxcache import SamplingParams
from paxcache.sampling import request_keys, sample, sequence_keys
from paxcache.scheduler import StepPlan
from paxcache.sequence import new_request
from paxcache.step import (
    StepInputs,
    StepShapes,
    StepVariant,
    empty_inputs,
    prepare_inputs,
    token_buckets,
    warmup_variants,
)

SHAPES = StepShapes(buckets=(16, 32), max_rows=4, vocab_size=50)


def _seq(rid, n_prompt, computed, allocated, **params):
    seqs = new_request(rid, list(range(1, n_prompt + 1)), SamplingParams(**params), seed=3)
    for s in seqs:
        s.num_computed, s.num_allocated = computed, allocated
    return seqs


def test_token_buckets_are_powers_of_two_then_the_budget():
    assert token_buckets(256) == (16, 32, 64, 128, 256)
    assert token_buckets(100) == (16, 32, 64, 100)
    assert token_buckets(8) == (8,)


def test_a_plan_becomes_one_padded_pytree():
    # "p": a 20-token prompt chunk (none computed), "d": a decode at position 9 (grows), and
    # "n": a request with n=2 whose follower samples from its leader's last row.
    (p,) = _seq("p", 20, 0, 20, temperature=0.7, top_k=999, top_p=0.9)
    (d,) = _seq("d", 9, 9, 9)
    d.token_ids.append(33)
    lead, follower = _seq("n", 3, 0, 3, n=2, min_p=0.1)
    plan = StepPlan(
        rows=[(p, 20), (d, 1), (lead, 3)],
        slots=[5, 0, 2],
        samples=[(p, 0), (d, 1), (lead, 2), (follower, 2)],
    )
    inputs, failed = prepare_inputs(plan, SHAPES)
    assert isinstance(inputs, StepInputs) and not failed
    t = 32  # the smallest bucket holding 24 tokens
    chex.assert_shape(inputs.token_ids, (t,))
    for x in (inputs.slot_ids, inputs.q_lens, inputs.kv_lens, inputs.grows):
        chex.assert_shape(x, (4,))
    chex.assert_shape(inputs.sampling.keys, (4, 2))
    assert inputs.token_ids.dtype == np.int32 and inputs.grows.dtype == bool
    assert inputs.sampling.keys.dtype == np.uint32
    np.testing.assert_array_equal(inputs.token_ids[:24], list(range(1, 21)) + [33, 1, 2, 3])
    assert not inputs.token_ids[24:].any()
    np.testing.assert_array_equal(inputs.slot_ids, [5, 0, 2, 0])
    np.testing.assert_array_equal(inputs.q_lens, [20, 1, 3, 0])
    np.testing.assert_array_equal(inputs.kv_lens, [20, 10, 3, 0])
    np.testing.assert_array_equal(inputs.grows, [False, True, False, False])
    assert int(inputs.num_rows) == 3
    s = inputs.sampling
    np.testing.assert_array_equal(s.logits_rows, [19, 20, 23, 23])  # follower: leader's row
    np.testing.assert_allclose(s.temperature, [0.7, 0, 0, 0])
    np.testing.assert_array_equal(s.top_k, [50, 0, 0, 0])  # clamped to the vocabulary
    np.testing.assert_allclose(s.top_p, [0.9, 1, 1, 1])
    np.testing.assert_allclose(s.min_p, [0, 0, 0.1, 0.1], rtol=1e-6)
    # Keys: a pure function of (seed, tokens generated, completion index).
    want = request_keys([3, 3, 3, 3], [0, 1, 0, 0], [0, 0, 0, 1])
    np.testing.assert_array_equal(s.keys, want)
    assert not s.logprobs_wanted  # no sample reports logprobs: the step computes none
    assert len(jax.tree.leaves(inputs)) == 13  # every leaf costs host packing time


def test_empty_inputs_have_the_buckets_shape_and_run_nothing():
    inputs = empty_inputs(SHAPES, 16)
    chex.assert_shape(inputs.token_ids, (16,))
    assert int(inputs.num_rows) == 0 and not inputs.grows.any()
    assert jax.tree.structure(inputs) == jax.tree.structure(prepare_inputs(StepPlan(), SHAPES)[0])


def test_warmup_variants_cover_every_bucket_times_every_optional_input():
    """Warm-up's programs: each bucket, times constrained, times prompt logprobs (a batch can
    mix them), each with the inputs structure the step sees when serving such a plan."""
    assert warmup_variants(SHAPES) == [StepVariant(16), StepVariant(32)]
    both = warmup_variants(SHAPES, masked=True, prompt_logprobs=True)
    assert len(set(both)) == len(both) == 2 * 2 * 2
    assert {(v.masked, v.prompt_logprobs) for v in both} == {(m, p) for m in (0, 1) for p in (0, 1)}
    pl = empty_inputs(SHAPES, 32, prompt_logprobs=True)
    chex.assert_shape((pl.prompt_logprobs.rows, pl.prompt_logprobs.targets), (32,))
    assert empty_inputs(SHAPES, 32).prompt_logprobs is None
    assert StepVariant(16, True, False, True).describe() == (
        "step for 16 tokens (constrained) (prompt logprobs)"
    )


def test_a_sample_whose_values_cannot_be_represented_fails_its_request_only():
    (bad,) = _seq("bad", 4, 0, 4, temperature=1.0)
    (good,) = _seq("good", 4, 0, 4, temperature=0.5)
    object.__setattr__(bad.params, "temperature", 10**400)  # bypasses validation
    plan = StepPlan(rows=[(bad, 4), (good, 4)], slots=[0, 1], samples=[(bad, 0), (good, 1)])
    inputs, failed = prepare_inputs(plan, SHAPES)
    assert failed == {"bad"}
    np.testing.assert_allclose(inputs.sampling.temperature[:2], [0.0, 0.5])


def test_the_step_computes_logprobs_only_when_a_sample_reports_them():
    """``SamplingInputs.logprobs_wanted``: True when any sample has ``logprobs`` set (``0``
    too: it reports the sampled token's logprob)."""

    def wanted(*params):
        rows = [_seq(f"r{i}", 4, 3, 4, **p)[0] for i, p in enumerate(params)]
        plan = StepPlan(
            rows=[(s, 1) for s in rows],
            slots=list(range(len(rows))),
            samples=[(s, i) for i, s in enumerate(rows)],
        )
        return bool(prepare_inputs(plan, SHAPES)[0].sampling.logprobs_wanted)

    assert not wanted({}, {"temperature": 0.5})
    assert wanted({"logprobs": 0}, {})
    assert wanted({}, {"logprobs": 2})
    assert wanted({"logprobs": 1})


def test_a_plan_over_the_largest_bucket_is_refused():
    (p,) = _seq("p", 40, 0, 40)
    with pytest.raises(ValueError, match="largest bucket"):
        prepare_inputs(StepPlan(rows=[(p, 40)], slots=[0]), SHAPES)


def test_multi_step_decodes_get_one_program_per_row_bucket_and_k_keys_per_sample():
    """decode_steps K > 1 adds the multi-step decode of every bucket up to the first holding
    max_rows (decode plans only), with [K, R] inputs; K = 1 adds none."""
    import dataclasses

    from paxcache.decode_loop import MAX_STOP_IDS, prepare

    wide = StepShapes(buckets=(16, 32, 64), max_rows=20, vocab_size=50, decode_steps=4)
    loops = [v for v in warmup_variants(wide) if v.loop]
    assert loops == [StepVariant(16, loop=True), StepVariant(32, loop=True)]
    assert not any(v.loop for v in warmup_variants(dataclasses.replace(wide, decode_steps=1)))
    assert loops[0].describe() == "step for 16 tokens (multi-step decode)"
    loop = empty_inputs(wide, 32, loop=True).decode_loop
    chex.assert_shape(loop.keys, (4, 20, 2))
    chex.assert_shape(loop.stop_ids, (20, MAX_STOP_IDS))
    # Sample j's key in iteration k is the single step's key after k more tokens.
    (a,) = _seq("a", 5, 5, 5, max_tokens=9, temperature=1.0, stop_token_ids=[7])
    a.token_ids += [11, 12]  # two generated
    a.num_computed = 6
    plan = StepPlan(rows=[(a, 1)], samples=[(a, 0)])
    loop = prepare(plan, 20, 4, eos_ids={3}, max_model_len=100, exit_on_finish=False)
    for k in range(4):
        np.testing.assert_array_equal(loop.keys[k, 0], request_keys([a.seed], [2 + k], [0])[0])
    assert list(loop.stop_ids[0, :3]) == [3, 7, -1]
    assert int(loop.max_new[0]) == 9 - 2


@pytest.mark.parametrize("seed", [2**64 - 1, 2**63, -5])
def test_sample_keys_take_any_seed_modulo_two_to_the_64(seed):
    (a,) = _seq("a", 4, 0, 4, temperature=0.7)
    (b,) = _seq("b", 4, 0, 4)  # greedy: a batch with one sampled row hashes every row's key
    a.seed = seed
    plan = StepPlan(rows=[(a, 4), (b, 4)], slots=[0, 1], samples=[(a, 0), (b, 1)])
    inputs, failed = prepare_inputs(plan, SHAPES)
    assert not failed
    want = request_keys([seed % 2**64, 3], [0, 0], [0, 0])
    np.testing.assert_array_equal(inputs.sampling.keys[:2], want)


def test_an_all_greedy_batch_skips_its_keys_and_samples_the_same_tokens():
    (a,) = _seq("a", 4, 0, 4)
    (b,) = _seq("b", 4, 0, 4, temperature=1e-6)  # below GREEDY_EPS: greedy too
    plan = StepPlan(rows=[(a, 4), (b, 4)], slots=[0, 1], samples=[(a, 0), (b, 1)])
    inputs, _ = prepare_inputs(plan, SHAPES)
    np.testing.assert_array_equal(inputs.sampling.keys, 0)
    hashed = sequence_keys([a, b], SHAPES.max_rows)[0]
    assert np.any(hashed != 0)
    logits = jax.random.normal(jax.random.key(0), (SHAPES.max_rows, 32))
    s = inputs.sampling
    args = (logits, s.temperature, s.top_k, s.top_p, s.min_p)
    chex.assert_trees_all_equal(sample(*args, s.keys).tokens, sample(*args, hashed).tokens)
