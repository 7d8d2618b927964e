"""The server's output coalescing (``runner.Progress``, ``CompletionProgress``, ``fold``): a
request's delta outputs added into one ``Progress`` give what adding them in any number of
takes and folding the takes gives, and both are the outputs' plain concatenation per
completion (text pieces, token ids, logprob entries, the last finish reason). Streaming
totals (``keep_text=False``) keep only the counts and the finish state.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paxcache.outputs import CompletionOutput, RequestOutput
from paxcache.server.runner import CompletionProgress, Progress, fold


@st.composite
def _outputs(draw) -> list[RequestOutput]:
    n = draw(st.integers(1, 3))
    with_logprobs = draw(st.booleans())
    outs = []
    for _ in range(draw(st.integers(0, 8))):
        completions = []
        for index in draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)):
            ids = draw(st.lists(st.integers(0, 50), max_size=3))
            completions.append(
                CompletionOutput(
                    index=index,
                    token_ids=ids,
                    text=draw(st.sampled_from(("", "a", "bc"))),
                    finish_reason=draw(st.sampled_from((None, None, "stop", "length"))),
                    logprobs=[{"token_id": t} for t in ids] if with_logprobs else None,
                )
            )
        outs.append(
            RequestOutput(
                "r",
                None,
                draw(st.sampled_from(([], [1, 2, 3]))),
                completions,
                finished=draw(st.booleans()),
                error=draw(st.sampled_from((None, None, "failed"))),
                num_cached_tokens=draw(st.sampled_from((None, 0, 16))),
                prompt_logprobs=draw(st.sampled_from((None, [None, {"1": -0.5}]))),
            )
        )
    return outs


def _state(p: Progress) -> tuple:
    return (p.completions, p.finished, p.error, p.prompt_tokens, p.cached, p.prompt_logprobs)


def _expected(outs: list[RequestOutput], keep_text: bool) -> tuple:
    comps: dict[int, CompletionProgress] = {}
    for out in outs:
        for c in out.outputs:
            acc = comps.setdefault(c.index, CompletionProgress())
            if keep_text and c.text:
                acc.texts.append(c.text)
            if keep_text and c.logprobs is not None:
                acc.logprobs = [*(acc.logprobs or []), *c.logprobs]
            acc.token_ids += c.token_ids
            acc.finish_reason = c.finish_reason or acc.finish_reason
    last = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    return (
        comps,
        any(o.finished for o in outs),
        next((o.error for o in outs if o.error), None),
        next((len(o.prompt_token_ids) for o in reversed(outs) if o.prompt_token_ids), None),
        next(
            (o.num_cached_tokens for o in reversed(outs) if o.num_cached_tokens is not None), None
        ),
        last[-1] if last and keep_text else None,
    )


@settings(max_examples=200, deadline=None)
@given(outs=_outputs(), data=st.data())
def test_adding_outputs_in_takes_then_folding_equals_adding_them_at_once(outs, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(outs)), max_size=4)))
    takes = [outs[a:b] for a, b in zip([0, *cuts], [*cuts, len(outs)], strict=True)]
    whole = Progress()
    for out in outs:
        whole.add(out)
    folded, streamed = Progress(), Progress()
    for take in takes:
        p = Progress()
        for out in take:
            p.add(out)
        fold(folded, p)
        fold(streamed, p, keep_text=False)
    assert _state(whole) == _state(folded) == _expected(outs, keep_text=True)
    assert _state(streamed) == _expected(outs, keep_text=False)


def test_a_progress_never_aliases_the_outputs_it_was_given():
    c = CompletionOutput(index=0, token_ids=[1], text="a", logprobs=[{"token_id": 1}])
    p = Progress()
    p.add(RequestOutput("r", None, [], [c]))
    c.token_ids.append(2)
    c.logprobs.append({"token_id": 2})
    assert p.completions[0] == CompletionProgress(["a"], [1], [{"token_id": 1}], None)
    total = Progress()
    fold(total, p)
    p.completions[0].token_ids.append(3)
    assert total.completions[0].token_ids == [1]
