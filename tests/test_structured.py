"""Constrained decoding: the llguidance glue (:mod:`paxcache.grammar`), the allowed-token
bitmask inside the step (:mod:`paxcache.step`), and the engine under constraints (n > 1,
preemption, prefix caching, chunked prefill, a missing library)."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import byte_llama

from paxcache import Engine, SamplingParams, grammar, step
from paxcache.models import ByteTokenizer
from paxcache.models.tokenizer import HFTokenizer
from paxcache.multihost import EngineRound, RoundAdd
from paxcache.sampling import StructuredOutputsParams

pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
PERSON_DOC = '{"name":"Bo","age":42,"tags":["a","c"],"ok":true}'


def _bpe_tokenizer(path, chat_template: str | None = None) -> HFTokenizer:
    """A small byte-level BPE ``tokenizer.json`` (trained here, as Llama-3's is byte-level BPE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [PERSON_DOC, '{"name": "Alice", "age": 7, "ok": false}', "the quick fox"] * 20
    tk.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return HFTokenizer(path)


def _bit(mask_row: np.ndarray, t: int) -> bool:
    return bool((int(mask_row[t // 32]) >> (t % 32)) & 1)


# ----------------------------------------------------------------------------------------------
# The glue


@pytest.mark.parametrize("pool", [False, True], ids=["loop", "thread_pool"])
@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_bitmask_matches_the_library_mask_along_a_document(
    kind: str, pool: bool, tmp_path, monkeypatch
):
    """Our rows (filled in a loop, or several at once in llguidance's thread pool) equal
    llguidance's own mask at every position of a valid document, for both tokenizer kinds;
    EOS is allowed exactly where the grammar accepts."""
    import llguidance

    monkeypatch.setattr(grammar, "PARALLEL_FILL_MIN_VOCAB", 0 if pool else 1 << 30)

    if kind == "byte":
        tok, vocab = ByteTokenizer(), 259
    else:
        tok = _bpe_tokenizer(tmp_path / "bpe")
        vocab = tok.vocab_size + 5  # a model vocabulary wider than the tokenizer's
    eos = tok.eos_token_id
    comp = grammar.GrammarCompiler(tok, vocab, [eos])
    spec = StructuredOutputsParams(json=PERSON)
    ids = tok.encode(PERSON_DOC, add_special_tokens=False)
    ours = [comp.matcher(spec) for _ in range(2)]  # rows 1 and 3 of a 4-row mask
    for m in ours:
        assert m.error is None
    for pos, t in enumerate([*ids, eos]):
        mask = np.full((4, grammar.bitmask_words(vocab)), -1, np.int32)
        grammar.fill_bitmask([(ours[0], 1), (ours[1], 3)], mask)
        ref = np.frombuffer(ours[0]._m.compute_bitmask(), np.int32)
        np.testing.assert_array_equal(mask[1], ref)
        np.testing.assert_array_equal(mask[3], ref)
        assert (mask[[0, 2]] == -1).all()  # other rows untouched
        assert _bit(mask[1], t), f"position {pos}: the document's token {t} is masked"
        assert _bit(mask[1], eos) == ours[0].is_accepting()
        assert not any(_bit(mask[1], x) for x in range(tok.vocab_size, vocab))
        for m in ours:
            assert m.consume(t), m.error
    assert all(m.is_stopped() for m in ours)
    assert isinstance(ours[0]._m, llguidance.LLMatcher)


def test_a_token_outside_the_grammar_puts_the_matcher_in_error():
    comp = grammar.GrammarCompiler(ByteTokenizer(), 259, [257])
    m = comp.matcher(StructuredOutputsParams(regex="[ab]+"))
    assert m.consume(ord("a"))
    assert not m.consume(ord("z"))
    assert m.error


@pytest.mark.parametrize(
    "spec,match",
    [
        (StructuredOutputsParams(json={"type": "frobnicate"}), "invalid JSON schema"),
        (StructuredOutputsParams(json="[1, 2"), "not valid JSON"),
        (StructuredOutputsParams(json="[1, 2]"), "must be an object"),
        (StructuredOutputsParams(regex="(ab"), "invalid regex"),
        (StructuredOutputsParams(grammar="start: foo"), "invalid grammar"),
    ],
)
def test_a_bad_constraint_is_a_grammar_error_naming_it(spec, match):
    with pytest.raises(grammar.GrammarError, match=match):
        grammar.validate(spec)


def test_structured_outputs_params_validation_and_wire_round_trip():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", grammar="start: 'a'")
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="json")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})
    p = SamplingParams(structured_outputs={"json": PERSON})
    assert p.structured_outputs == StructuredOutputsParams(json=PERSON)
    # The multi-host wire carries it as JSON and rebuilds the same params.
    rnd = EngineRound(False, (), (RoundAdd("r", [1, 2], p),), False)
    back = EngineRound.from_wire(json.loads(json.dumps(rnd.to_wire())))
    assert back.adds[0].params == p


# ----------------------------------------------------------------------------------------------
# The step


def test_apply_allowed_masks_exactly_the_cleared_bits():
    rng = np.random.default_rng(0)
    r, v = 5, 77
    logits = rng.normal(size=(r, v)).astype(np.float32)
    allowed = rng.random((r, v)) < 0.3
    allowed[:, 0] = True
    words = np.zeros((r, grammar.bitmask_words(v)), np.uint32)
    for i, t in zip(*np.nonzero(allowed), strict=True):
        words[i, t // 32] |= np.uint32(1 << (t % 32))
    out = np.asarray(step.apply_allowed(jnp.asarray(logits), jnp.asarray(words.view(np.int32))))
    np.testing.assert_array_equal(out, np.where(allowed, logits, -np.inf))


@pytest.fixture(scope="module")
def model():
    return byte_llama()


def _engine(model, **kw) -> Engine:
    args = dict(num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=16)
    args.update(kw)
    return Engine(model, ByteTokenizer(), warmup=False, **args)


@pytest.fixture(scope="module")
def engine(model):
    """One engine (one token bucket) shared by the fast tests: each program compiles once."""
    return _engine(model)


AB5 = StructuredOutputsParams(regex="[ab]{5}")


def test_constrained_rows_sample_only_allowed_tokens_and_others_are_untouched(engine):
    """At temperature 1 a constrained row only ever samples 'a' or 'b' and stops (reason
    "stop") when the grammar is complete; an unconstrained request in the same batch gets the
    very tokens it gets in a batch without any constrained row."""
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)
    eng = engine
    alone = eng.generate(["hello world"], free)[0].outputs[0]
    reqs = ["hello world"] + ["xyz"] * 3
    params = [free] + [
        SamplingParams(max_tokens=12, temperature=1.0, seed=s, structured_outputs=AB5, logprobs=2)
        for s in range(3)
    ]
    outs = eng.generate(reqs, params)
    mixed = outs[0].outputs[0]
    assert mixed.token_ids == alone.token_ids
    np.testing.assert_allclose(
        [e["logprob"] for e in mixed.logprobs], [e["logprob"] for e in alone.logprobs], rtol=1e-5
    )
    for o in outs[1:]:
        c = o.outputs[0]
        assert set(c.text) <= {"a", "b"} and len(c.text) == 5, c.text
        assert c.finish_reason == "stop"
        for e in c.logprobs:  # the constrained distribution: only allowed tokens reported
            assert all(t in (ord("a"), ord("b")) for t, _ in e["top"])
            assert np.isfinite(e["logprob"])
    assert all(eng.check_invariants().values())


def test_an_unconstrained_batch_runs_without_a_mask(model):
    eng = _engine(model, enable_prefix_caching=False)
    eng.add_request("free", "abc", SamplingParams(max_tokens=2))
    plan = eng.scheduler.schedule()
    inputs, failed = step.prepare_inputs(plan, eng._shapes)
    assert inputs.allowed is None and not failed
    eng.add_request("json", "abc", SamplingParams(max_tokens=2, structured_outputs=AB5))
    eng.scheduler.postprocess  # noqa: B018 - (the plan above is not run)
    plan2 = eng.scheduler.schedule()
    inputs2, _ = step.prepare_inputs(plan2, eng._shapes)
    assert inputs2.allowed is not None
    assert inputs2.allowed.shape == (eng.max_num_seqs, grammar.bitmask_words(259))
    # Same pytree structure but for the mask: the unconstrained program is a different one.
    assert jax.tree.structure(inputs) != jax.tree.structure(inputs2)


def test_eos_only_when_the_grammar_accepts(engine):
    """A grammar whose output may end after 'a' or go on: EOS is sampled only once the text
    is complete, and a stopped grammar ends the sequence without EOS."""
    spec = StructuredOutputsParams(regex="a(bc)?")
    eng = engine
    outs = eng.generate(
        ["q"] * 8,
        [
            SamplingParams(max_tokens=10, temperature=1.0, seed=s, structured_outputs=spec)
            for s in range(8)
        ],
    )
    for o in outs:
        c = o.outputs[0]
        assert c.text in ("a", "abc"), c.text
        assert c.finish_reason == "stop"


# ----------------------------------------------------------------------------------------------
# The engine


def person_ok(text: str) -> bool:
    """A structural check of :data:`PERSON`, independent of the grammar library."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(d, dict)
        and set(d) == {"name", "age", "tags", "ok"}
        and isinstance(d["name"], str)
        and len(d["name"]) <= 8
        and type(d["age"]) is int
        and 0 <= d["age"] <= 150
        and isinstance(d["tags"], list)
        and len(d["tags"]) <= 3
        and all(t in ("a", "b", "c") for t in d["tags"])
        and type(d["ok"]) is bool
    )


def test_person_ok_can_fail():
    assert person_ok(PERSON_DOC)
    for bad in ('{"name":"Bo"}', PERSON_DOC.replace("42", "151"), PERSON_DOC.replace('"c"', '"d"')):
        assert not person_ok(bad)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # plenty of room
        pytest.param(dict(num_blocks=14, preemption_mode="recompute"), marks=pytest.mark.slow),
        pytest.param(
            dict(num_blocks=14, num_host_blocks=32, preemption_mode="swap"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["roomy", "recompute", "swap"],
)
def test_schema_valid_json_under_sampling_n_preemption_and_prefix_caching(model, kw):
    """Many seeds at temperature 1, n = 2, a shared prompt prefix (prefix-cache hits), a token
    budget that chunks the prompts, and (two cases) a cache so small that sequences are
    preempted and resumed: every completion that stops is schema-valid JSON, and the random
    model's completions do stop."""
    eng = _engine(model, **kw)
    prefix = "A person record in JSON, please: "
    params = [
        SamplingParams(
            max_tokens=120,
            temperature=1.0,
            seed=s,
            n=2,
            structured_outputs=StructuredOutputsParams(json=PERSON),
        )
        for s in range(6)
    ]
    outs = eng.generate([prefix + str(s) for s in range(6)], params)
    stopped = 0
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason in ("stop", "length"), c.finish_reason
            if c.finish_reason == "stop":
                stopped += 1
                assert person_ok(c.text), c.text
    assert stopped >= 6
    if "num_blocks" in kw:
        assert eng.stats()["num_preemptions"] > 0
    assert all(eng.check_invariants().values())


def test_a_bad_constraint_is_refused_at_add_and_nothing_is_queued(engine):
    eng = engine
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nope"}))
    with pytest.raises(grammar.GrammarError, match="invalid JSON schema"):
        eng.add_request("bad", "x", bad)
    assert not eng.has_unfinished_requests()
    assert eng.generate(["ok"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_without_llguidance_a_constrained_request_fails_clearly(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance -> ImportError
    monkeypatch.setitem(sys.modules, "llguidance.numpy", None)
    assert not grammar.available()
    eng = _engine(model)  # a fresh engine: its grammar compiler never loaded the library
    with pytest.raises(grammar.GrammarUnavailableError, match="llguidance"):
        eng.add_request("c", "x", SamplingParams(structured_outputs=AB5))
    out = eng.generate(["free"], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_warmup_compiles_the_masked_variant_so_constrained_serving_never_compiles(model):
    eng = _engine(model)
    eng.warmup_structured = True
    eng.warmup()
    before = eng.stats()["num_compilations"]
    eng.generate(["q"], SamplingParams(max_tokens=6, structured_outputs=AB5))
    eng.generate(["q"], SamplingParams(max_tokens=3))
    assert eng.stats()["num_compilations"] == before


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}:"
    "{{ t.function.parameters | tojson }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% endfor %}<assistant>"
)


def test_tools_and_earlier_calls_reach_the_chat_template(tmp_path):
    """``tools`` is the template's ``tools`` variable (as transformers passes it) and an
    earlier call's arguments reach it as an object; the fallback template lists them too."""
    from paxcache.server.convert import _render_chat
    from paxcache.server.protocol import ChatMessage

    tok = _bpe_tokenizer(tmp_path / "t", HERMES_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [
        ChatMessage(role="user", content="2+2?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", content="4", tool_call_id="c1"),
    ]
    text = _render_chat(tok, msgs, tools=tools)
    assert text.startswith('<tools>add:{"type": "object"};</tools><user>2+2?')
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>' in text
    assert "<tools>" not in _render_chat(tok, msgs)
    simple = _render_chat(ByteTokenizer(), msgs, tools=tools)
    assert simple.startswith("<|tools|>\n[{") and '"arguments": {"a": 2, "b": 2}' in simple


def test_a_failed_matcher_fails_its_request_alone(engine):
    """A matcher that has gone into error (here: fed a token outside its grammar behind the
    engine's back) fails its own request with an error; the batch and the other request go
    on."""
    eng = engine
    eng.add_request("bad", "q", SamplingParams(max_tokens=5, structured_outputs=AB5))
    eng.add_request("good", "q", SamplingParams(max_tokens=5, structured_outputs=AB5, seed=1))
    (bad,) = eng.outputs.get("bad").seqs
    assert not bad.matcher.consume(ord("z")) and bad.matcher.error
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["bad"].outputs[0].finish_reason == "error"
    good = outs["good"].outputs[0]
    assert good.finish_reason == "stop" and len(good.text) == 5 and set(good.text) <= set("ab")
    assert all(eng.check_invariants().values())
