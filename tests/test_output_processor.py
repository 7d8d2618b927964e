"""OutputProcessor: the engine's one owner of live requests and of the outputs they report."""

from __future__ import annotations

import pytest

from paxcache.outputs import OutputProcessor, RequestState
from paxcache.sampling import SamplingParams
from paxcache.sequence import new_request


def _request(rid: str, n: int = 1, kind: str = "cumulative") -> RequestState:
    params = SamplingParams(max_tokens=4, n=n, output_kind=kind)
    seqs = new_request(rid, [1, 2], params, seed=0)
    return RequestState(rid, None, [1, 2], params, seqs)


def _generate(req: RequestState, index: int, token: int, finish: str | None = None) -> None:
    s = req.seqs[index]
    s.token_ids.append(token)
    s.new_ids.append(token)
    s.text += chr(ord("a") + token)
    if finish is not None:
        s.finish(finish)


def test_outputs_come_once_per_touched_request_and_finished_ones_are_forgotten():
    proc = OutputProcessor()
    a, b = _request("a", n=2), _request("b")
    proc.add(a)
    proc.add(b)
    _generate(a, 0, 3)
    _generate(a, 1, 4)
    _generate(b, 0, 5, finish="length")
    outs = proc.process([a.seqs[0], b.seqs[0], a.seqs[1]])
    assert [(o.request_id, o.finished) for o in outs] == [("a", False), ("b", True)]
    assert [c.new_token_ids for c in outs[0].outputs] == [[3], [4]]
    assert "b" not in proc and "a" in proc and len(proc) == 1
    assert all(s.new_ids == [] for s in a.seqs)  # reported once
    assert proc.process([a.seqs[0]])[0].outputs[0].new_token_ids == []


def test_an_abort_is_reported_finished_with_the_next_outputs():
    proc = OutputProcessor()
    a, b = _request("a"), _request("b", kind="delta")
    proc.add(a)
    proc.add(b)
    a.seqs[0].finish("abort")
    assert proc.abort("a") is a and proc.abort("a") is None and proc.abort("nope") is None
    _generate(b, 0, 2)
    outs = proc.process([b.seqs[0]])
    assert [(o.request_id, o.finished) for o in outs] == [("a", True), ("b", False)]
    assert outs[0].outputs[0].finish_reason == "abort"
    assert outs[1].outputs[0].token_ids == [2]
    assert proc.process([]) == []


def test_a_live_id_cannot_be_added_twice():
    proc = OutputProcessor()
    proc.add(_request("a"))
    with pytest.raises(ValueError, match="already live"):
        proc.add(_request("a"))
    assert [r.request_id for r in proc.requests()] == ["a"]
