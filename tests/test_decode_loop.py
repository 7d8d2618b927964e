"""Multi-step decode (``Engine(decode_steps=K)``, :mod:`paxcache.decode_loop`): the same
tokens, log-probabilities, texts and finish reasons as the single-step engine for random
workloads under tight memory (greedy and seeded sampling, n > 1, EOS, stop token ids, stop
strings, preemption, aborts); several tokens per stream chunk; the loop leaves early when the
next iteration's blocks are not free and at the first finish while a request waits; which
plans may run it; bad values refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import byte_llama

from paxcache import Engine, SamplingParams
from paxcache.decode_loop import MAX_STOP_IDS, eligible
from paxcache.models import ByteTokenizer
from paxcache.scheduler import StepPlan
from paxcache.sequence import new_request

BS = 8
EOS = 257


@pytest.fixture(scope="module")
def model():
    return byte_llama()


def _engine(model, decode_steps, tokenizer=None, **kw):
    args = dict(
        num_blocks=24, block_size=BS, max_num_seqs=4, max_num_batched_tokens=32, warmup=False
    )
    args.update(kw)
    tokenizer = tokenizer or ByteTokenizer()
    return Engine(model, tokenizer, decode_steps=decode_steps, compile_cache=False, **args)


def _summary(outs):
    """Everything a client sees of each completion."""
    return [
        [
            (
                c.token_ids,
                c.text,
                c.finish_reason,
                [(d["token_id"], round(d["logprob"], 4)) for d in c.logprobs or []],
            )
            for c in o.outputs
        ]
        for o in outs
    ]


def _run(eng, requests, abort_at=None, check=False):
    """Adds ``requests`` (id -> (prompt, params)), steps to the end (aborting ``abort_at``'s
    request after that many steps; ``check``: the invariants after every step), and returns
    the finished outputs by id and the number of steps."""
    for rid, (prompt, sp) in requests.items():
        eng.add_request(rid, prompt, sp)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if abort_at is not None and steps == abort_at[1]:
            eng.abort(abort_at[0])
        if check:
            bad = [k for k, v in eng.check_invariants().items() if not v]
            assert not bad, bad
    for out in eng.step():  # an abort of the last live request reports at the next step
        done[out.request_id] = out
    return done, steps


REQUEST = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 40),
        "max_tokens": st.integers(1, 30),
        "temperature": st.sampled_from([0.0, 0.0, 0.8]),
        "n": st.sampled_from([1, 1, 2]),
        "logprobs": st.sampled_from([None, 2]),
        "stop_token": st.booleans(),
        "stop_string": st.booleans(),
        "ignore_eos": st.booleans(),
    }
)


def _requests(specs, seed):
    rng = np.random.default_rng(seed)
    requests = {}
    for i, spec in enumerate(specs):
        prompt = list(map(int, rng.integers(0, 256, spec["prompt_len"])))
        sp = SamplingParams(
            max_tokens=spec["max_tokens"],
            temperature=spec["temperature"],
            seed=seed + i,
            n=spec["n"],
            logprobs=spec["logprobs"],
            stop_token_ids=[int(rng.integers(0, 256))] if spec["stop_token"] else None,
            stop=[chr(int(rng.integers(32, 127)))] if spec["stop_string"] else None,
            ignore_eos=spec["ignore_eos"],
        )
        requests[f"r{i}"] = (prompt, sp)
    return requests


@settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    specs=st.lists(REQUEST, min_size=2, max_size=7),
    seed=st.integers(0, 2**16),
    abort=st.one_of(st.none(), st.tuples(st.integers(0, 6), st.integers(1, 6))),
)
def test_multi_step_decode_gives_the_single_step_tokens_under_tight_memory(
    model, specs, seed, abort
):
    # 24 blocks of 8 tokens for 4 rows of up to 2 x 70 tokens: preemption (recompute) and
    # loops that stop early for want of blocks both happen.
    requests = _requests(specs, seed)
    abort_at = None if abort is None else (f"r{abort[0] % len(specs)}", abort[1])
    single, _ = _run(_engine(model, 1), requests, abort_at)
    multi_eng = _engine(model, 4)
    multi, _ = _run(multi_eng, requests, abort_at, check=True)
    aborted = set() if abort_at is None else {abort_at[0]}
    keep = sorted(set(requests) - aborted)
    assert _summary([multi[r] for r in keep]) == _summary([single[r] for r in keep])
    assert set(multi) == set(single) == set(requests)
    st_ = multi_eng.stats()
    assert st_["num_free_blocks"] == st_["num_total_blocks"]  # nothing leaked


def test_multi_step_decode_streams_up_to_k_tokens_per_step(model):
    eng = _engine(model, 4)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    eng.add_request("a", [5, 6, 7], sp)
    chunks = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            chunks.append(len(out.outputs[0].new_token_ids))
    # The prefill step samples one token; then decodes of 4, 4 and the last 3.
    assert chunks == [1, 4, 4, 3]
    st_ = eng.stats()
    assert st_["num_multi_step_decodes"] == 3 and st_["num_multi_step_iterations"] == 11
    single = _engine(model, 1).generate([[5, 6, 7]], sp)[0].outputs[0].token_ids
    assert out.outputs[0].token_ids == single


class _LetterTokenizer(ByteTokenizer):
    """The byte tokenizer, but every id below 256 decodes to one ASCII letter: a random model
    then writes valid text (the byte tokenizer's random bytes are mostly invalid UTF-8, which
    the chunk path refuses)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i) % 26) for i in ids if 0 <= int(i) < 256)


def test_a_plain_rows_tokens_are_detokenized_once_per_step(model, monkeypatch):
    """Rows without stop strings, logprobs or a grammar take a loop's tokens at once (one
    ``push_chunk`` per step, no per-token push), with the single-step engine's text; a row
    with a stop string takes them at once too, and the output processor finds the string
    token by token and drops the tokens the loop sampled after it."""
    from paxcache.models.tokenizer import IncrementalDecoder

    calls = {"push": 0, "push_chunk": 0}
    for name in calls:
        orig = getattr(IncrementalDecoder, name)

        def counted(self, *a, _orig=orig, _name=name):
            calls[_name] += 1
            return _orig(self, *a)

        monkeypatch.setattr(IncrementalDecoder, name, counted)

    def letters(decode_steps):
        return _engine(model, decode_steps, tokenizer=_LetterTokenizer())

    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    requests = {"plain": ([5, 6, 7], plain)}
    multi, _ = _run(letters(4), requests)
    assert calls == {"push": 1, "push_chunk": 3}  # the prefill's token, then 4 + 4 + 3
    assert len(multi["plain"].outputs[0].text) == 12
    stop_at = multi["plain"].outputs[0].text[7]  # a letter the greedy row writes
    stop = SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop_at])
    requests["stops"] = ([5, 6, 7], stop)
    both_eng, single_eng = letters(4), letters(1)
    both, _ = _run(both_eng, requests)
    single, _ = _run(single_eng, requests)
    assert _summary([both[r] for r in requests]) == _summary([single[r] for r in requests])
    kept = multi["plain"].outputs[0].text.index(stop_at) + 1  # through the stop's letter
    assert len(both["stops"].outputs[0].token_ids) == kept
    generated = [e.stats()["num_generated_tokens"] for e in (both_eng, single_eng)]
    assert generated == [12 + kept, 12 + kept]  # the dropped tokens are not counted
    assert _summary([multi["plain"]]) == _summary([single["plain"]])
    assert both["stops"].outputs[0].finish_reason == "stop"


def test_multi_step_decode_stops_when_the_next_blocks_are_not_free(model):
    # Two sequences of 8 prompt tokens in 4 blocks: each new block boundary (every 8 tokens)
    # needs a block; with 4 blocks in all, the loop must leave before the pool runs dry and
    # the scheduler preempts as it would for single steps.
    sp = SamplingParams(max_tokens=14, ignore_eos=True)
    prompts = [list(range(10, 18)), list(range(40, 48))]
    multi_eng = _engine(model, 8, num_blocks=5, watermark=0.0)
    outs, _ = _run(multi_eng, {"a": (prompts[0], sp), "b": (prompts[1], sp)}, check=True)
    single = _engine(model, 1, num_blocks=5, watermark=0.0).generate(prompts, sp)
    assert [outs[r].outputs[0].token_ids for r in "ab"] == [o.outputs[0].token_ids for o in single]
    st_ = multi_eng.stats()
    assert st_["num_preemptions"] > 0
    # A loop of 8 never ran whole: every one stopped at a block it could not get.
    assert st_["num_multi_step_iterations"] < 8 * st_["num_multi_step_decodes"]


def test_multi_step_decode_ends_at_the_first_finish_while_a_request_waits(model):
    eng = _engine(model, 8, max_num_seqs=2)
    eng.add_request("short", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.add_request("long", [4, 5, 6], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request("queued", [7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()  # both prefills: one token each; "queued" waits for a slot
    outs = {o.request_id: o for o in eng.step()}  # a multi-step decode
    assert outs["short"].finished
    # "short" finished in iteration 0, so the loop ended there: "long" got one token too.
    assert len(outs["long"].outputs[0].token_ids) == 2
    assert eng.stats()["num_multi_step_iterations"] == 1
    outs = {o.request_id: o for o in eng.step()}  # "queued" is admitted at once
    assert "queued" in outs


def test_only_plain_decode_plans_run_as_multi_step_decodes():
    def seq(rid, **params):
        return new_request(rid, [1, 2, 3], SamplingParams(max_tokens=5, **params), seed=0)[0]

    a, b = seq("a"), seq("b")
    plan = StepPlan(rows=[(a, 1), (b, 1)], samples=[(a, 0), (b, 1)])
    assert eligible(plan, {EOS})
    assert not eligible(StepPlan(), {EOS})
    assert not eligible(StepPlan(rows=[(a, 2)], samples=[(a, 0)]), {EOS})  # a prefill chunk
    assert not eligible(StepPlan(rows=[(a, 1)], samples=[]), {EOS})  # a row that samples nothing
    f = seq("f")
    assert not eligible(StepPlan(rows=[(a, 1)], samples=[(a, 0), (f, 0)]), {EOS})  # a follower
    c = seq("c")
    c.matcher = object()  # a grammar: the host must mask every token
    assert not eligible(StepPlan(rows=[(c, 1)], samples=[(c, 0)]), {EOS})
    d = seq("d", stop_token_ids=list(range(MAX_STOP_IDS)))  # + EOS: one id too many
    assert not eligible(StepPlan(rows=[(d, 1)], samples=[(d, 0)]), {EOS})
    e = seq("e", stop_token_ids=list(range(MAX_STOP_IDS)), ignore_eos=True)
    assert eligible(StepPlan(rows=[(e, 1)], samples=[(e, 0)]), {EOS})
    p = StepPlan(rows=[(a, 1)], samples=[(a, 0)], prompt_positions=[(0, 2)])
    assert not eligible(p, {EOS})


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4"])
def test_decode_steps_must_be_a_positive_int(model, bad):
    with pytest.raises(ValueError, match="decode_steps"):
        _engine(model, bad)


def test_server_streams_multi_step_chunks_as_the_single_step_engine_completes(model):
    import openai
    from server_harness import serve_in_thread

    from paxcache.server import create_app

    prompt = "The quick brown fox"
    single = _engine(model, 1).generate(
        [ByteTokenizer().encode(prompt)], SamplingParams(max_tokens=24, ignore_eos=True)
    )[0]
    text = single.outputs[0].text
    stop = text[9:11]  # a stop string the device cannot see, inside the 3rd chunk
    engine = _engine(model, 4, model_name="tiny")
    with serve_in_thread(create_app(engine)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        chunks = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, stream=True, temperature=0, stop=[stop]
        )
        pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks if c.choices]
    assert "".join(t for t, _ in pieces) == text[: text.index(stop)]
    assert pieces[-1][1] == "stop"
    assert engine.stats()["num_multi_step_decodes"] > 0


def test_an_overlapped_multi_step_decode_is_continued_on_the_device_with_the_same_tokens(model):
    """Overlapped scheduling dispatches the next loop before reading the one in flight (its
    inputs built on the device: decode_loop.next_inputs); a row that stopped there (a stop
    id, its limit) runs nothing, one the host ends (a stop string) is dropped when read; the
    tokens are the synchronous multi-step engine's, and of single steps."""
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, 256, 6))) for _ in range(5)]
    free = {
        f"r{i}": (p, SamplingParams(max_tokens=22, ignore_eos=True)) for i, p in enumerate(prompts)
    }
    plain, _ = _run(_engine(model, 1, num_blocks=64, async_scheduling=False), free)
    text = [c for c in plain["r0"].outputs[0].text[6:] if c != "\ufffd"]
    stop_id = plain["r1"].outputs[0].token_ids[9]  # sampled greedily at the 10th token
    extras = [dict(stop=[text[0]]), dict(stop_token_ids=[stop_id]), dict(max_tokens=5), {}, {}]
    requests = {}
    for i, (prompt, extra) in enumerate(zip(prompts, extras, strict=True)):
        sp = dict(max_tokens=22, temperature=0.8 if i == 4 else 0.0, seed=i, ignore_eos=True)
        requests[f"r{i}"] = (prompt, SamplingParams(**{**sp, **extra, "n": 2 if i == 4 else 1}))
    overlapped = _engine(model, 4, num_blocks=64, warmup=True)
    overlapped.warmup()
    compiled = overlapped.stats()["num_compilations"]
    got, _ = _run(overlapped, requests)  # (check_invariants would compile its own checks)
    assert overlapped.stats()["num_compilations"] == compiled  # next_inputs was warmed up
    synchronous, _ = _run(_engine(model, 4, num_blocks=64, async_scheduling=False), requests)
    single, _ = _run(_engine(model, 1, num_blocks=64, async_scheduling=False), requests)
    want = _summary([synchronous[r] for r in sorted(requests)])
    assert _summary([got[r] for r in sorted(requests)]) == want
    assert _summary([single[r] for r in sorted(requests)]) == want
    ends = [(got[r].outputs[0].finish_reason, got[r].outputs[0].stop_reason) for r in ("r0", "r1")]
    assert ends == [("stop", text[0]), ("stop", stop_id)]
    st_ = overlapped.stats()
    assert st_["num_overlapped_steps"] > 0 and st_["num_wasted_rows"] > 0
    assert st_["num_free_blocks"] == st_["num_total_blocks"]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    prompt_len=st.integers(1, 6),
    done=st.integers(0, 6),
    max_tokens=st.integers(1, 12),
    max_model_len=st.integers(8, 20),
    ignore_eos=st.booleans(),
    stop_ids=st.sampled_from([None, [5], [EOS], [5, 6]]),
    toks=st.lists(st.sampled_from([1, 2, 5, 6, EOS]), min_size=1, max_size=8),
)
def test_a_rows_chunk_is_taken_exactly_as_token_by_token_stop_checks(
    prompt_len, done, max_tokens, max_model_len, ignore_eos, stop_ids, toks
):
    """The multi-step fast path (``Scheduler._take_chunk``: stop ids as a set, the length
    rule in arithmetic) takes a row's K tokens exactly when one ``check_stop`` per token would
    take them all (no EOS or stop id, no ``max_tokens`` / ``max_model_len`` before the last
    token, a stop id or EOS at the K-th position taken), with the same finish; otherwise it
    changes nothing (the iteration-by-iteration path then applies the rule)."""
    from paxcache import BlockManager, CacheConfig
    from paxcache.plan import StepResult
    from paxcache.scheduler import Scheduler
    from paxcache.sequence import check_stop

    cfg = CacheConfig(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=8)
    sched = Scheduler(
        BlockManager(cfg),
        max_num_seqs=2,
        max_num_batched_tokens=8,
        max_model_len=max_model_len,
        eos_token_ids=[EOS],
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_ids)

    def fresh():
        (seq,) = new_request("r", [3] * prompt_len, params, seed=0)
        seq.token_ids += [1] * done
        seq.num_computed = seq.num_allocated = len(seq.token_ids) - 1
        return seq

    if done >= max_tokens or prompt_len + done >= max_model_len:
        return  # that sequence would have finished before this step
    # The rule, one token at a time.
    ref = fresh()
    taken = 0
    for t in toks:
        ref.token_ids.append(t)
        taken += 1
        check_stop(ref, t, sched.eos_token_ids, max_model_len)
        if ref.finish_reason is not None:
            break
    seq = fresh()
    before = (list(seq.token_ids), seq.num_computed, seq.finish_reason)
    result = StepResult(state=None, num_free_blocks=0, row_ok=np.ones(1, bool), tokens=None)
    took = sched._take_chunk(seq, list(toks), result, 0)
    assert took == (taken == len(toks))
    if took:
        assert seq.token_ids == ref.token_ids and seq.new_ids == toks
        assert seq.num_computed == before[1] + len(toks)
        assert (seq.finish_reason, seq.stop_reason, seq.ends_on_stop_token) == (
            ref.finish_reason,
            ref.stop_reason,
            ref.ends_on_stop_token,
        )
    else:
        assert (seq.token_ids, seq.num_computed, seq.finish_reason) == before
        assert seq.new_ids == [] and seq.stop_reason is None and not seq.ends_on_stop_token


@pytest.mark.parametrize("decode_steps, overlap", [(1, False), (1, True), (4, True)])
def test_sampled_token_logprobs_equal_the_dense_forward_whatever_the_batch_asks(
    model, decode_steps, overlap
):
    """A request's generated-token logprobs and top logprobs are the dense forward's, in a
    batch where other requests ask for none: the step computes them only for batches that
    ask (``SamplingInputs.logprobs_wanted``), through single steps, overlapped continuations
    and multi-step loops, and a batch that asks nothing reports nothing."""
    import jax
    import jax.numpy as jnp
    from tiny_models import forward

    eng = _engine(model, decode_steps, async_scheduling=overlap)
    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (9, 5, 14)]
    asks = SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.0, logprobs=2)
    plain = SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0)
    outs = eng.generate(prompts, [plain, asks, plain])
    assert all(o.outputs[0].logprobs is None for o in (outs[0], outs[2]))
    got = outs[1].outputs[0]
    ids = prompts[1] + got.token_ids
    logits = forward(model, jnp.asarray(ids, jnp.int32)[None])[0].astype(jnp.float32)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))[len(prompts[1]) - 1 : -1]
    assert [e["token_id"] for e in got.logprobs] == got.token_ids
    want = logp[np.arange(len(got.token_ids)), got.token_ids]
    np.testing.assert_allclose([e["logprob"] for e in got.logprobs], want, atol=1e-4, rtol=0)
    tops = np.sort(logp, axis=-1)[:, ::-1][:, :2]
    np.testing.assert_allclose([[lp for _, lp in e["top"]] for e in got.logprobs], tops, atol=1e-4)
