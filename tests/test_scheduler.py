"""The scheduler on its own: a plan flows down, results come back once.

No engine and no model here: the scheduler drives a real ``BlockManager``, and a stand-in for
the device step (the allocator's ``append`` and ``commit``, as the fused step runs them, plus
made-up sampled tokens) produces the ``StepResult`` that ``postprocess`` takes. This proves the
scheduler needs nothing from the engine, that its plans carry every KV movement the engine has
to make (swap pairs), and that ``postprocess`` does the per-sequence accounting.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxcache import BlockManager, CacheConfig, SamplingParams, allocator, errors, manager
from paxcache.outputs import INTERNAL_ERROR, OutputProcessor
from paxcache.scheduler import Scheduler, SeqState, StepPlan, StepResult
from paxcache.sequence import new_request

S = 4  # block size
_append = jax.jit(allocator.append, static_argnames="commit")
_commit = jax.jit(allocator.commit)
_num_free = jax.jit(allocator.num_free_blocks)


def _scheduler(
    num_blocks=16,
    host_blocks=0,
    budget=32,
    max_seqs=4,
    mode="recompute",
    rope_switch_len=None,
    cls=Scheduler,
):
    cfg = CacheConfig(
        num_blocks=num_blocks,
        block_size=S,
        max_seqs=2 * max_seqs,
        max_blocks_per_seq=16,
        num_host_blocks=host_blocks,
        watermark=0.0,
    )
    return cls(
        BlockManager(cfg),
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        preemption_mode=mode,
        max_model_len=cfg.max_model_len,
        eos_token_ids=(0,),
        rope_switch_len=rope_switch_len,
    )


class _Decoder:
    def push(self, tok):
        return chr(ord("a") + tok % 26)

    def flush(self):
        return ""


def _add(sched, rid, n_prompt, max_tokens=4, n=1, start=1):
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    seqs = new_request(
        rid, list(range(start, start + n_prompt)), params, seed=0, make_decoder=_Decoder
    )
    sched.add(seqs)
    return seqs


def _fake_step(sched: Scheduler, plan: StepPlan, token: int = 7) -> StepResult:
    """What the fused step does to the block state (append one token per growing row, then
    commit what the rows computed), with every sample drawing ``token``."""
    bm = sched.block_manager
    b = bm.cfg.max_seqs
    counts, toks, computed = np.zeros(b, np.int32), np.zeros((b, 1), np.int32), np.zeros(b)
    for (seq, q), slot in zip(plan.rows, plan.slots, strict=True):
        end = seq.num_computed + q
        if end > seq.num_allocated:
            counts[slot], toks[slot, 0] = 1, seq.token_ids[end - 1]
        computed[slot] = end
    state, res = _append(bm.state, counts, toks, commit=False)
    state = _commit(state, computed.astype(np.int32))
    row_ok = np.zeros(8, bool)
    row_ok[: len(plan.rows)] = np.asarray(res.ok)[plan.slots]
    return StepResult(
        state=state,
        num_free_blocks=int(_num_free(state)),
        row_ok=row_ok,
        tokens=np.full(8, token, np.int32),
    )


def _run(sched, steps=100):
    for _ in range(steps):
        if not sched.has_work():
            return
        plan = sched.schedule()
        if plan.rows:
            sched.postprocess(plan, _fake_step(sched, plan))
    raise AssertionError("work left")


def test_plan_rows_then_postprocess_advances_and_samples():
    sched = _scheduler()
    (a,) = _add(sched, "a", 10)
    (b,) = _add(sched, "b", 3, start=50)
    plan = sched.schedule()
    assert [(s.request_id, q) for s, q in plan.rows] == [("a", 10), ("b", 3)]
    assert plan.admitted == [a, b] and plan.slots == [0, 1]
    assert [(s.request_id, row) for s, row in plan.samples] == [("a", 0), ("b", 1)]
    assert not (plan.swap_out or plan.swap_in or plan.preempted or plan.failed)
    touched = sched.postprocess(plan, _fake_step(sched, plan))
    assert touched == [a, b]
    assert a.num_computed == a.num_allocated == 10 and a.token_ids[-1] == 7
    # The text is the output processor's (paxcache.outputs): the scheduler only appends.
    assert a.new_ids == [7] and a.text == "" and sched.num_generated_tokens == 2
    assert sched.num_prefill_tokens_computed == 13
    # Next: two decodes, each a row of one token that grows its allocation.
    plan = sched.schedule()
    assert [(s.request_id, q) for s, q in plan.rows] == [("a", 1), ("b", 1)]
    assert all(sched.check_invariants().values())


def test_finished_sequences_are_freed_by_postprocess():
    sched = _scheduler()
    _add(sched, "a", 5, max_tokens=3)
    _run(sched)
    bm = sched.block_manager
    assert len(bm) == 0 and bm.num_free_blocks == bm.cfg.num_blocks
    assert sched.num_departures == 1 and all(sched.check_invariants().values())


def test_followers_sample_from_the_leaders_row_then_run_alone():
    sched = _scheduler()
    lead, f1, f2 = _add(sched, "n3", 6, n=3)
    plan = sched.schedule()
    assert [s for s, _ in plan.rows] == [lead]  # followers wait: no rows of their own
    assert plan.admitted == [lead, f1, f2] and plan.samples == [(lead, 0), (f1, 0), (f2, 0)]
    sched.postprocess(plan, _fake_step(sched, plan))
    assert f1.leader is None and f1.token_ids == lead.token_ids and f1.shared_last
    plan = sched.schedule()
    assert {s.index for s, _ in plan.rows} == {0, 1, 2}


def test_swap_preemption_puts_the_block_pairs_in_the_plan_and_resumes_later():
    # 6 blocks of 4: two sequences of 9 + 3 tokens each need 3 blocks, then a 4th when they
    # grow past 12: the newest is swapped out, its pairs in the plan, and nothing resumes in
    # that step (rule R3).
    sched = _scheduler(num_blocks=6, host_blocks=8, mode="swap")
    (a,) = _add(sched, "a", 9, max_tokens=8)
    (b,) = _add(sched, "b", 9, max_tokens=8, start=30)
    bm = sched.block_manager
    for _ in range(20):
        plan = sched.schedule()
        if plan.swap_out:
            break
        table_b = bm.block_table(b) if b in bm else None
        sched.postprocess(plan, _fake_step(sched, plan))
    else:
        raise AssertionError("no swap")
    assert plan.swapped_out == [b] and plan.preempted == [b] and b.state == SeqState.SWAPPED
    devices = [d for d, _ in plan.swap_out]
    assert devices == [x for x in table_b if x >= 0]  # its blocks before this step
    assert [h for _, h in plan.swap_out] == bm.block_table(b)[: len(devices)]
    assert not plan.swap_in and not plan.admitted  # R3
    assert [s for s, _ in plan.rows] == [a]
    sched.postprocess(plan, _fake_step(sched, plan))
    _run(sched)
    assert sched.num_swapped_in_seqs == 1 and sched.num_swapped_in_blocks == len(devices)
    assert len(bm) == 0 and bm.num_free_host_blocks == 8


def test_a_request_whose_detokenizer_raises_is_reported_failed_alone():
    """Detokenizing is the output processor's: the scheduler appends the token whatever the
    decoder does; the processor names the failing request and takes the other's text; the
    engine then ends the failed one (``Engine._report``)."""

    class Exploding(_Decoder):
        def push(self, tok):
            raise RuntimeError("tokenizer bug")

    sched = _scheduler()
    (a,) = _add(sched, "a", 5)
    (b,) = _add(sched, "b", 5, start=40)
    a.decoder = Exploding()
    plan = sched.schedule()
    touched = sched.postprocess(plan, _fake_step(sched, plan))
    assert touched == [a, b] and a.num_generated == b.num_generated == 1
    stops, failed = OutputProcessor().detokenize(touched)
    assert stops == [] and failed == ["a"] and b.text == "h"
    sched.finish(a.group, "error", INTERNAL_ERROR)
    assert a.finish_reason == "error" and a.error == INTERNAL_ERROR
    assert b.state == SeqState.RUNNING
    assert a not in sched.block_manager and all(sched.check_invariants().values())


def test_failed_requests_from_input_preparation_are_not_advanced():
    sched = _scheduler()
    (a,) = _add(sched, "a", 5)
    plan = sched.schedule()
    result = _fake_step(sched, plan)
    result.failed_requests = {"a"}
    assert sched.postprocess(plan, result) == [a]
    assert a.finish_reason == "error" and a.num_generated == 0


def test_scheduler_refuses_unknown_policies():
    bm = BlockManager(CacheConfig(num_blocks=4, block_size=S, max_seqs=2, max_blocks_per_seq=4))
    with pytest.raises(ValueError, match="policy"):
        Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8, policy="lifo")
    with pytest.raises(ValueError, match="preemption_mode"):
        Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8, preemption_mode="drop")


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    lens=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(1, 2)), min_size=1, max_size=6
    ),
    switch=st.integers(2, 24),
    mode=st.sampled_from(["recompute", "swap"]),
    budget=st.sampled_from([4, 8, 32]),
)
def test_random_workloads_recompute_sequences_that_outgrow_the_rope_switch(
    lens, switch, mode, budget
):
    """Longrope's rule under tight memory (10 blocks of 4), with preemption in either mode:
    no row is ever fed on K/V computed for a sequence no longer than ``rope_switch_len`` once
    the sequence is longer (it is recomputed first, exactly once per crossing), every request
    finishes with all its tokens, and the accounting holds after every step."""
    sched = _scheduler(
        num_blocks=10, host_blocks=16, budget=budget, mode=mode, rope_switch_len=switch
    )
    seqs = []
    for i, (n_prompt, max_tokens, n) in enumerate(lens):
        seqs += _add(sched, f"r{i}", n_prompt, max_tokens=max_tokens, n=n, start=1 + 20 * i)
    crossings = sum(
        1 for s in seqs if len(s.token_ids) <= switch < len(s.token_ids) - 1 + s.params.max_tokens
    )
    for _ in range(400):
        if not sched.has_work():
            break
        plan = sched.schedule()
        for seq, _ in plan.rows:
            assert seq.rope_long == (len(seq.token_ids) > switch), "fed on the wrong factors"
        if plan.rows:
            sched.postprocess(plan, _fake_step(sched, plan))
        assert all(sched.check_invariants().values())
    else:
        raise AssertionError("work left")
    fine = [s for s in seqs if s.finish_reason != "error"]
    assert all(s.num_generated == s.params.max_tokens for s in fine)
    assert sched.num_rope_recomputes <= crossings


class _OneByOne(Scheduler):
    """The oracle: ``Scheduler._resume`` as it was before admissions were batched (one
    allocator call per unit, its reserve computed just before it), kept here only to prove
    the batched one decides the same."""

    def _resume(self, rows, budget, plan):
        bm = self.block_manager
        while budget > 0:
            unit = self._queue_head()
            if unit is None:
                return
            if len(self.running) + len(unit) > self.max_num_seqs:
                return
            if self.running and any(s.preempted_at >= self.num_departures for s in unit):
                return
            lead = unit[0]
            reserve = self.blocks_needed(rows)
            if lead.state == SeqState.SWAPPED:
                own = self.blocks_needed([(lead, 1)])
                try:
                    pairs = bm.swap_in(lead, reserve=reserve + own)
                except errors.OutOfBlocksError:
                    return
                self.queued.popleft()
                plan.swap_in += pairs
                plan.swapped_in.append(lead)
                self.num_swapped_in_seqs += 1
                self.num_swapped_in_blocks += len(pairs)
            else:
                if bm.num_free_slots < len(unit) or not self._admit([unit], reserve):
                    return
                self.queued.popleft()
                plan.admitted += unit
            for s in unit:
                s.state = SeqState.RUNNING
                self.running.append(s)
            q = min(lead.remaining, budget)
            rows.append((lead, q))
            budget -= q


def _summary(plan: StepPlan) -> tuple:
    def names(seqs):
        return [(s.request_id, s.index) for s in seqs]

    return (
        [(s.request_id, s.index, q) for s, q in plan.rows],
        plan.slots,
        [(s.request_id, s.index, row) for s, row in plan.samples],
        names(plan.admitted),
        names(plan.preempted),
        names(plan.swapped_out),
        names(plan.swapped_in),
        names(plan.failed),
        plan.swap_out,
        plan.swap_in,
    )


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    requests=st.lists(
        st.tuples(
            st.sampled_from([0, 0, 2, 5]),  # the step it arrives at
            st.integers(1, 18),  # prompt tokens, cut from one of two texts (prefix hits)
            st.integers(0, 1),
            st.integers(1, 6),  # max_tokens
            st.sampled_from([1, 1, 2, 3]),  # n
            st.sampled_from([None, None, "tenant"]),
        ),
        min_size=2,
        max_size=12,
    ),
    budget=st.sampled_from([6, 16, 48]),
    mode=st.sampled_from(["recompute", "swap"]),
    rope_switch_len=st.sampled_from([None, 10]),
)
def test_batched_admission_plans_exactly_what_one_by_one_admission_plans(
    requests, budget, mode, rope_switch_len
):
    """Random workloads under tight memory (10 blocks of 4, the configuration of the longrope
    test above: its compiled programs serve; prefix hits, n > 1, both preemption modes,
    longrope's salt): the scheduler that admits a run of queued units in one allocator call
    and the one-by-one oracle make the same plan every step (rows, slots, samples,
    admissions, preemptions, swaps, failures) and leave the same block state, bit for bit."""
    texts = [list(range(1, 40)), list(range(1, 9)) + list(range(100, 131))]
    scheds = [
        _scheduler(10, 16, budget, mode=mode, rope_switch_len=rope_switch_len, cls=cls)
        for cls in (Scheduler, _OneByOne)
    ]
    for step in range(300):
        for i, (at, n_prompt, text, max_tokens, n, salt) in enumerate(requests):
            if at == step:
                params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
                for sched in scheds:
                    sched.add(
                        new_request(
                            f"r{i}",
                            texts[text][:n_prompt],
                            params,
                            seed=0,
                            cache_salt=salt,
                            make_decoder=_Decoder,
                        )
                    )
        if step > max(at for at, *_ in requests) and not scheds[0].has_work():
            break
        plans = [sched.schedule() for sched in scheds]
        assert _summary(plans[0]) == _summary(plans[1]), f"step {step}"
        jax.tree.map(
            np.testing.assert_array_equal, *(sched.block_manager.state for sched in scheds)
        )
        for sched, plan in zip(scheds, plans, strict=True):
            if plan.rows:
                sched.postprocess(plan, _fake_step(sched, plan))
        assert all(scheds[0].check_invariants().values())
    else:
        raise AssertionError("work left")
    assert not scheds[1].has_work()


@pytest.mark.parametrize("num_blocks,admitted", [(32, 5), (7, 3)])
def test_a_steps_admissions_make_one_allocator_call(monkeypatch, num_blocks, admitted):
    """Five queued requests of two blocks each, in one step: one allocator dispatch (and one
    read) admits all of them, or, when only three fit, the three oldest, and the refused
    fourth is not tried again; the one-by-one oracle makes a call per admission and one for
    the refusal."""
    calls = []
    real = manager._allocate_many

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(manager, "_allocate_many", counted)
    oracle = [1] * min(5, admitted + 1)
    for cls, expected in ((Scheduler, [8]), (_OneByOne, oracle)):
        sched = _scheduler(num_blocks=num_blocks, budget=64, max_seqs=6, cls=cls)
        for i in range(5):
            _add(sched, f"r{i}", 6, start=10 * i)
        calls.clear()
        plan = sched.schedule()
        assert len(plan.admitted) == len(plan.rows) == admitted
        assert calls == expected
