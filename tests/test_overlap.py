"""Overlapped scheduling (``Engine(async_scheduling=True)``, the default; :mod:`paxcache.overlap`):
the same tokens, log-probabilities, texts and finish reasons as the synchronous engine on random
workloads under tight memory (greedy and seeded sampling, n > 1, EOS, stop ids and strings,
preemption, aborts), with a step really in flight most of the time, the invariants holding while
it is, at most one wasted row per finished request, and no program compiled after warm-up."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_decode_loop import REQUEST, _requests, _run, _summary
from tiny_models import byte_llama

from paxcache import Engine, SamplingParams, overlap
from paxcache.models import ByteTokenizer


@pytest.fixture(scope="module")
def model():
    return byte_llama()


def _engine(model, async_scheduling, **kw):
    args = dict(num_blocks=24, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    args.update(kw)
    return Engine(
        model, ByteTokenizer(), async_scheduling=async_scheduling, compile_cache=False, **args
    )


@settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    specs=st.lists(REQUEST, min_size=2, max_size=7),
    seed=st.integers(0, 2**16),
    abort=st.one_of(st.none(), st.tuples(st.integers(0, 6), st.integers(1, 6))),
)
def test_overlapped_engine_gives_the_synchronous_tokens_under_tight_memory(
    model, specs, seed, abort
):
    requests = _requests(specs, seed)
    abort_at = None if abort is None else (f"r{abort[0] % len(specs)}", abort[1])
    sync, sync_steps = _run(_engine(model, False), requests, abort_at)
    eng = _engine(model, True)
    over, steps = _run(eng, requests, abort_at, check=True)
    keep = sorted(set(requests) - ({abort_at[0]} if abort_at else set()))
    assert _summary([over[r] for r in keep]) == _summary([sync[r] for r in keep])
    # One step read per call. The next step goes out before the host finds the stop strings
    # of the one it reads (or learns of an abort): each such completion may hold a wasted row
    # and its blocks one step longer, which can delay the others by a step.
    late = sum(sp.n for _, sp in requests.values() if sp.stop) + (2 if abort_at else 0)
    assert set(over) == set(requests) and steps <= sync_steps + late
    st_ = eng.stats()
    assert st_["num_free_blocks"] == st_["num_total_blocks"]
    # A row is wasted only for a request that finished (or was aborted) while it was out.
    assert st_["num_wasted_rows"] <= sum(sp.n for _, sp in requests.values())


def test_decode_steps_overlap_and_compile_nothing_after_warmup(model):
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    sync = _engine(model, False).generate(prompts, sp)
    overlap.gather_tokens.clear_cache()  # what an earlier engine compiled must not hide a gap
    eng = _engine(model, True)
    eng.warmup()
    compiled = eng.stats()["num_compilations"]
    outs = eng.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in sync]
    st_ = eng.stats()
    # 19 decode steps after the prefill: all but the first were dispatched while the one
    # before was in flight; the last one's rows were wasted (every request had finished).
    assert st_["num_overlapped_steps"] >= 18, st_["num_overlapped_steps"]
    assert st_["num_wasted_rows"] <= len(prompts)
    # Warm-up compiled the token gather of every continuation bucket: nothing compiles now.
    assert st_["num_compilations"] == compiled
    assert all(eng.check_invariants().values())


def test_a_waiting_request_is_planned_by_the_scheduler_not_continued(model):
    eng = _engine(model, True, max_num_seqs=2)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    eng.add_request("a", [1, 2, 3], sp)
    eng.add_request("b", [4, 5, 6], sp)
    eng.add_request("c", [7, 8, 9], sp)  # waits for a slot
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    sync = _engine(model, False, max_num_seqs=2).generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], sp)
    assert [done[r] for r in "abc"] == [o.outputs[0].token_ids for o in sync]
    assert eng.stats()["num_overlapped_steps"] > 0


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_async_scheduling_must_be_a_bool(model, bad):
    with pytest.raises(ValueError, match="async_scheduling"):
        _engine(model, bad)


@pytest.mark.parametrize(
    ("argv", "want"),
    [([], (True, None)), (["--no-async-scheduling", "--decode-steps", "4"], (False, 4))],
)
def test_serve_flags_reach_the_engine(argv, want):
    from test_security_server import _serve_script

    serve = _serve_script()
    seen = {}

    class Recorder:
        @classmethod
        def from_pretrained(cls, model, **kwargs):
            seen.update(kwargs)

    serve._load_engine(Recorder, serve.parse_args(argv), None, "recompute")
    assert (seen["async_scheduling"], seen["decode_steps"]) == want
