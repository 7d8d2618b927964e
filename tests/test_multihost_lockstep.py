"""Multi-host lockstep without processes: the server's engine thread (``EngineRunner``, its
rounds driven one at a time) and ``run_follower`` apply every round with the same
``multihost.EngineLoop``, so a follower fed the leader's broadcast rounds (through their JSON
wire form) makes exactly the leader's engine calls, in the same order, whatever the rounds
hold: adds the engine refuses (three ways), aborts of live, pending, finished and unknown
requests, stats or not, steps that raise, and a shutdown with requests in flight.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxcache import multihost
from paxcache.errors import SequenceTooLongError
from paxcache.multihost import EngineLoop, EngineRound, RoundAdd
from paxcache.outputs import CompletionOutput, RequestOutput
from paxcache.sampling import SamplingParams
from paxcache.server import runner as runner_mod
from paxcache.server.runner import ACCEPTED, EngineRunner, Failed, Sink, Submission

# What each refusal kind's prompt makes the engine raise, and what the server answers.
REFUSALS = {
    "too-long": (SequenceTooLongError("prompt too long"), Failed(400, "prompt too long")),
    "invalid": (ValueError("bad"), Failed(400, "the engine refused this request")),
    "broken": (RuntimeError("boom"), Failed(503, "engine error", "engine_error")),
}


class RecordingEngine:
    """The ``Engine`` interface over a deterministic toy: every request produces one token per
    completion per step until ``max_tokens``; a prompt named in :data:`REFUSALS` is refused;
    the steps numbered in ``failing_steps`` raise. Records every call (queries included)."""

    def __init__(self, failing_steps: frozenset[int] = frozenset()) -> None:
        self.failing_steps = failing_steps
        self.calls: list[tuple] = []
        self.reqs: dict[str, list] = {}  # id -> [params, tokens generated]
        self.num_steps = 0

    def warmup(self) -> None:
        self.calls.append(("warmup",))

    def add_request(self, request_id, prompt, params, cache_salt=None) -> None:
        self.calls.append(("add_request", request_id, prompt, params, cache_salt))
        if prompt in REFUSALS:
            raise REFUSALS[prompt][0]
        self.reqs[request_id] = [params, 0]

    def abort(self, request_id) -> None:
        self.calls.append(("abort", request_id))
        self.reqs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        self.calls.append(("has_unfinished_requests",))
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        self.calls.append(("step",))
        self.num_steps += 1
        if self.num_steps in self.failing_steps:
            raise RuntimeError("injected step failure")
        outs = []
        for rid, req in list(self.reqs.items()):
            params, done = req
            req[1] = done = done + 1
            finished = done >= params.max_tokens
            completions = [
                CompletionOutput(
                    index=j,
                    token_ids=[done],
                    text="x",
                    finish_reason="length" if finished else None,
                    new_token_ids=[done],
                    new_text="x",
                )
                for j in range(params.n)
            ]
            outs.append(RequestOutput(rid, None, [1, 2], completions, finished=finished))
            if finished:
                del self.reqs[rid]
        return outs

    def stats(self) -> dict:
        self.calls.append(("stats",))
        return {"num_running": len(self.reqs)}


class _Events:
    """Stands in for an ``Exchange`` and its event loop: records each sink's events."""

    def __init__(self) -> None:
        self.loop = self
        self.got: dict[int, list] = {}

    def call_soon_threadsafe(self, fn, *args) -> None:
        fn(*args)

    def deliver(self, tag: int, event) -> None:
        self.got.setdefault(tag, []).append(event)


@dataclass(frozen=True)
class Submit:
    prompt: str  # "ok" or a key of REFUSALS
    n: int
    max_tokens: int
    seed: int | None
    salt: str | None


@dataclass(frozen=True)
class Abort:
    target: int  # index of a submission so far (one of this round's too), or -1: unknown id


@dataclass(frozen=True)
class Round:
    ops: tuple
    stats: bool


def _rounds(seeded: bool):
    submit = st.builds(
        Submit,
        prompt=st.sampled_from(("ok", "ok", "ok", *REFUSALS)),
        n=st.integers(1, 2),
        max_tokens=st.integers(1, 4),
        seed=st.integers(0, 99) if seeded else st.one_of(st.none(), st.integers(0, 99)),
        salt=st.sampled_from((None, "tenant-a")),
    )
    op = st.one_of(submit, submit, st.builds(Abort, target=st.integers(-1, 30)))
    rnd = st.builds(Round, ops=st.lists(op, max_size=4).map(tuple), stats=st.booleans())
    return st.lists(rnd, max_size=12)


def _lead(script: list[Round], failing_steps: frozenset[int], multihost_: bool):
    """The script through the server's engine thread, one round per ``_iterate``; returns the
    engine, the runner, the rounds it broadcast (wire form), each submission's events and the
    ids the clients aborted."""
    engine = RecordingEngine(failing_steps)
    events = _Events()
    sent: list[dict] = []
    ids: list[str] = []
    gone: set[str] = set()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_mod, "broadcast_round", lambda rnd: sent.append(rnd.to_wire()))
        runner = EngineRunner(engine, max_queue=10_000, multihost=multihost_)
        runner._start_engine()
        for rnd in [*script, Round((), False)]:
            for op in rnd.ops:
                if isinstance(op, Submit):
                    tag = len(ids)
                    ids.append(f"r{tag}")
                    params = SamplingParams(max_tokens=op.max_tokens, n=op.n, seed=op.seed)
                    sub = Submission(ids[-1], op.prompt, params, Sink(events, tag), op.salt)
                    runner.submit([sub])
                else:
                    rid = ids[op.target] if 0 <= op.target < len(ids) else "nobody"
                    gone.add(rid)
                    runner.abort([rid])
            runner._stats_interval_s = 0.0 if rnd.stats else math.inf
            assert not runner._iterate().stopped
        runner.stop()  # the thread never started: it only marks the runner stopping
        assert runner._iterate().stopped
    return engine, runner, sent, events.got, gone


def _follow(sent: list[dict], failing_steps: frozenset[int]) -> RecordingEngine:
    engine = RecordingEngine(failing_steps)
    wire = iter(sent)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            multihost,
            "receive_round",
            lambda: EngineRound.from_wire(json.loads(json.dumps(next(wire)))),
        )
        multihost.run_follower(engine)
    assert next(wire, None) is None  # it returned at the stop round, the last one
    return engine


FAILING_STEPS = st.frozensets(st.integers(1, 12), max_size=3)


@settings(max_examples=60, deadline=None)
@given(script=_rounds(seeded=False), failing_steps=FAILING_STEPS)
def test_a_follower_fed_the_leaders_rounds_makes_the_leaders_engine_calls(script, failing_steps):
    leader, runner, sent, got, gone = _lead(script, failing_steps, multihost_=True)
    follower = _follow(sent, failing_steps)
    assert follower.calls == leader.calls
    assert sent[-1]["stop"] and [r["stop"] for r in sent[:-1]] == [False] * (len(sent) - 1)
    # Unseeded requests were seeded on the leader: the follower samples them alike.
    assert all(c[3].seed is not None for c in leader.calls if c[0] == "add_request")
    # The server side: every request answered once, nothing left in flight.
    assert runner.num_inflight == 0 and not runner._sinks and not runner._loop.live
    assert runner.num_engine_errors == len(failing_steps & set(range(1, leader.num_steps + 1)))
    added = {c[1]: c[2] for c in leader.calls if c[0] == "add_request"}
    for tag, events in got.items():
        rid = f"r{tag}"
        assert rid in added  # a request aborted before it was added gets no event
        if added[rid] in REFUSALS:
            assert events == [REFUSALS[added[rid]][1]]
            continue
        assert events[0] is ACCEPTED
        if rid in gone:  # the client went away: its events just stop
            continue
        last = events[-1]
        assert isinstance(last, Failed) or (isinstance(last, RequestOutput) and last.finished)
        assert all(isinstance(e, RequestOutput) and not e.finished for e in events[1:-1])


@settings(max_examples=30, deadline=None)
@given(script=_rounds(seeded=True), failing_steps=FAILING_STEPS)
def test_a_single_host_server_makes_the_calls_a_multi_host_leader_makes(script, failing_steps):
    # Seeded requests: the leader draws no seed, so the two servers see the same parameters.
    alone, _, sent, alone_got, _ = _lead(script, failing_steps, multihost_=False)
    leader, _, _, leader_got, _ = _lead(script, failing_steps, multihost_=True)
    assert not sent
    assert alone.calls == leader.calls
    assert alone_got == leader_got


def test_run_round_reports_refusals_the_failed_step_and_what_it_aborted():
    engine = RecordingEngine(failing_steps=frozenset({2}))
    loop = EngineLoop(engine)
    p = SamplingParams(max_tokens=3, seed=1)
    seen = []
    first = loop.run_round(
        EngineRound(
            False,
            ("nobody",),
            (RoundAdd("a", "ok", p), RoundAdd("b", "invalid", p), RoundAdd("c", "ok", p)),
            stats=False,
        ),
        admitted=lambda r: seen.append((list(r.added), dict(r.refused), r.stepped)),
    )
    assert seen == [(["a", "c"], first.refused, False)]  # answered before the step
    assert isinstance(first.refused["b"], ValueError)
    assert first.stepped and first.step_error is None and first.stats is None
    assert [o.request_id for o in first.outputs] == ["a", "c"] and list(loop.live) == ["a", "c"]
    second = loop.run_round(EngineRound(False, (), (), stats=True))
    assert second.stepped and isinstance(second.step_error, RuntimeError) and not second.outputs
    assert second.aborted_on_error == ["a", "c"] and not loop.live
    assert second.stats == {"num_running": 0}
    idle = loop.run_round(EngineRound(False, (), (), stats=False))
    assert not idle.stepped and idle.stats == {"num_running": 0}  # idle: stats anyway
    assert engine.calls[-2:] == [("has_unfinished_requests",), ("stats",)]
    stop = loop.run_round(EngineRound(True, ("x",), (RoundAdd("d", "ok", p),), stats=False))
    assert stop.stopped and not stop.added and stop.stats is not None
    assert engine.calls[-2:] == [("abort", "x"), ("stats",)]  # the adds of a stop round: none


def test_engine_errors_outside_the_step_are_logged_never_raised(caplog):
    class Broken(RecordingEngine):
        def warmup(self):
            raise RuntimeError("no warm-up")

        def abort(self, request_id):
            raise RuntimeError("no abort")

        def stats(self):
            raise RuntimeError("no stats")

    loop = EngineLoop(Broken())
    assert loop.warmup() == "warm-up failed (see the server log)"
    assert loop.sample_stats() is None
    result = loop.run_round(EngineRound(False, ("a",), (), stats=True))
    assert not result.stepped and result.stats is None
    messages = [r.getMessage() for r in caplog.records]
    assert "engine warm-up failed" in messages and "engine.abort('a') failed" in messages
    assert messages.count("engine.stats() failed") == 2


def test_a_round_that_raises_outside_the_engine_answers_its_submissions_and_keeps_serving():
    """A broadcast that fails (the round's submissions already left the queue) ends those
    submissions and the requests in flight with a 503; nothing stays counted in flight and
    the next round serves."""
    engine, events = RecordingEngine(), _Events()
    failures = iter([False, True, False])

    def broadcast(rnd):
        if next(failures):
            raise OSError("the other hosts are gone")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_mod, "broadcast_round", broadcast)
        runner = EngineRunner(engine, max_queue=100, multihost=True)
        runner._start_engine()
        params = SamplingParams(max_tokens=8, seed=1)
        runner.submit([Submission("live", "ok", params, Sink(events, 0), None)])
        assert runner._round() is not None  # added, stepped once
        runner.submit([Submission("new", "ok", params, Sink(events, 1), None)])
        assert runner._round() is None  # the broadcast raised
        assert runner.num_inflight == 0 and runner.num_engine_errors == 1
        assert events.got[0][-1] == Failed(503, "engine error", "engine_error")
        assert events.got[1] == [Failed(503, "engine error", "engine_error")]
        assert ("abort", "live") in engine.calls and not engine.reqs
        runner.submit([Submission("later", "ok", params, Sink(events, 2), None)])
        assert runner._round() is not None and events.got[2][0] == ACCEPTED
        assert runner.num_inflight == 1
