"""OutputProcessor: the engine's one owner of live requests and of the outputs they report."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# -- detokenization and stop strings (the processor's, after the scheduler appended) -------


class _Letters:
    """Decoder stand-in: every token is one letter (``push`` / ``push_chunk`` / ``flush``)."""

    def push(self, tok: int) -> str:
        return chr(ord("a") + tok % 26)

    def push_chunk(self, ids) -> str:
        return "".join(self.push(t) for t in ids)

    def flush(self) -> str:
        return "!"


def _texted(stop=None, max_tokens=8, logprobs=None) -> RequestState:
    params = SamplingParams(max_tokens=max_tokens, stop=stop, logprobs=logprobs)
    seqs = new_request("r", [1, 2], params, seed=0, make_decoder=_Letters)
    return RequestState("r", None, [1, 2], params, seqs)


def _append(seq, tokens) -> None:  # what the scheduler's postprocess does
    seq.token_ids.extend(tokens)
    seq.new_ids.extend(tokens)
    if seq.logprobs is not None:
        seq.logprobs.extend((t, -1.0, [t, 0], [-1.0, float("-inf")]) for t in tokens)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=12),
    chunk=st.integers(1, 5),
    stop=st.text(alphabet="abcde", min_size=1, max_size=3),
)
def test_a_stop_string_ends_a_chunk_where_one_token_at_a_time_would(tokens, chunk, stop):
    """A multi-step decode's row hands over several tokens at once: the processor finds the
    stop string at the token that completed it, as token-at-a-time detokenization would,
    and names how many generated tokens the sequence keeps."""

    def run(size):
        proc = OutputProcessor()
        req = _texted(stop=[stop], max_tokens=len(tokens) + 1)
        proc.add(req)
        (seq,) = req.seqs
        for i in range(0, len(tokens), size):
            _append(seq, tokens[i : i + size])
            stops, failed = proc.detokenize([seq])
            assert failed == []
            if stops:
                ((hit, keep),) = stops
                assert hit is seq
                return keep, seq.text
            proc.process([seq])  # reports what cannot be a stop string's start
        return None, seq.text

    letters = "".join(chr(ord("a") + t) for t in tokens)
    keep, text = run(chunk)
    assert (keep, text) == run(1)
    if stop in letters:
        assert keep == letters.index(stop) + len(stop) and text == letters[: letters.index(stop)]
    else:
        assert keep is None and text == letters


def test_stop_at_drops_a_chunks_tokens_after_the_stop_string_and_outranks_length():
    from paxcache import BlockManager, CacheConfig
    from paxcache.scheduler import Scheduler

    cfg = CacheConfig(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=4)
    sched = Scheduler(BlockManager(cfg), max_num_seqs=2, max_num_batched_tokens=8)
    req = _texted(stop=["cd"], max_tokens=6, logprobs=1)
    (seq,) = req.seqs
    _append(seq, [0, 1, 2, 3, 4, 0])  # "abcdea": the last token also reached max_tokens
    seq.finish("length")
    sched.num_generated_tokens = 6
    proc = OutputProcessor()
    proc.add(req)
    stops, _ = proc.detokenize([seq])
    assert stops == [(seq, 4)]
    sched.stop_at(stops)
    assert seq.token_ids == [1, 2, 0, 1, 2, 3] and seq.new_ids == [0, 1, 2, 3]
    assert seq.finish_reason == "stop" and sched.num_generated_tokens == 4
    (out,) = proc.process([seq])
    comp = out.outputs[0]
    assert comp.text == "ab" and comp.finish_reason == "stop" and out.finished
    assert comp.stop_reason == "cd"  # vLLM's field: the string that ended it
    assert [e["token_id"] for e in comp.logprobs] == [0, 1, 2, 3]
    assert comp.logprobs[0] == {"token_id": 0, "logprob": -1.0, "top": [(0, -1.0)]}


def test_a_stop_token_is_not_detokenized_and_a_length_finish_flushes():
    proc = OutputProcessor()
    eos = _texted()
    (seq,) = eos.seqs
    _append(seq, [2, 3])
    seq.ends_on_stop_token = True
    seq.finish("stop")
    assert proc.detokenize([seq]) == ([], []) and seq.text == "c"  # no flush either
    length = _texted(max_tokens=2)
    (seq,) = length.seqs
    _append(seq, [2, 3])
    seq.finish("length")
    assert proc.detokenize([seq]) == ([], []) and seq.text == "cd!"


def test_stop_reason_names_a_stop_token_id_but_not_eos():
    from paxcache.sequence import check_stop

    for tok, want in ((7, 7), (0, None)):  # 7: a stop token id; 0: EOS
        params = SamplingParams(max_tokens=8, stop_token_ids=[7])
        (seq,) = new_request("r", [1, 2], params, seed=0, make_decoder=_Letters)
        req = RequestState("r", None, [1, 2], params, [seq])
        _append(seq, [3, tok])
        check_stop(seq, tok, eos_ids=(0,), max_model_len=64)
        assert seq.finish_reason == "stop" and seq.ends_on_stop_token
        proc = OutputProcessor()
        proc.add(req)
        assert proc.detokenize([seq]) == ([], [])
        (out,) = proc.process([seq])
        assert out.outputs[0].stop_reason == want and out.outputs[0].text == "d"  # 3 only


class _Exploding(_Letters):
    def push(self, tok: int) -> str:
        raise RuntimeError("a tokenizer bug")

    push_chunk = push


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 2),  # n
            st.sampled_from([None, ["bc"], ["d", "ea"]]),  # stop strings
            st.booleans(),  # its decoder raises
            st.lists(st.integers(0, 4), min_size=1, max_size=4),  # tokens per sequence
        ),
        min_size=1,
        max_size=5,
    ),
    order=st.randoms(use_true_random=False),
)
def test_one_pass_report_gives_the_two_pass_outputs(requests, order):
    """``report`` (detokenize and build outputs in one pass, the engine's) reports what
    ``detokenize``, the scheduler's ending of stops and failures, then ``process`` report:
    the same outputs in the same order, the same requests forgotten."""
    touched_order: list[tuple[int, int]] = []
    for r, (n, _, _, _) in enumerate(requests):
        touched_order += [(r, i) for i in range(n)]
    order.shuffle(touched_order)
    touched_order += touched_order[:1]  # a sequence touched twice (a plan's failed ones)

    def build():
        proc, reqs = OutputProcessor(), []
        for r, (n, stop, explodes, tokens) in enumerate(requests):
            params = SamplingParams(max_tokens=8, n=n, stop=stop)
            make = _Exploding if explodes else _Letters
            seqs = new_request(f"r{r}", [1, 2], params, seed=0, make_decoder=make)
            req = RequestState(f"r{r}", None, [1, 2], params, seqs)
            proc.add(req)
            for s in seqs:
                _append(s, tokens)
            reqs.append(req)
        return proc, reqs, [reqs[r].seqs[i] for r, i in touched_order]

    def end(proc, stops, failed):
        for seq, _ in stops:
            seq.finish("stop")
        for rid in failed:
            for seq in proc.get(rid).seqs:
                seq.finish("error")

    proc, _, touched = build()
    stops, failed = proc.detokenize(touched)
    end(proc, stops, failed)
    want = proc.process(touched)
    proc_one, _, touched_one = build()
    calls = []
    got = proc_one.report(touched_one, lambda s, f: calls.append(end(proc_one, s, f)))
    assert got == want
    assert len(calls) == (1 if stops or failed else 0)
    assert [r.request_id for r in proc_one.requests()] == [r.request_id for r in proc.requests()]
