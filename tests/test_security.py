"""Hostile checkpoints, hostile requests and other tenants (SECURITY.md).

Every test here reproduces an attack first (it failed before the fix) and checks the defense:

- checkpoints: a chat template that tries to run code, shard paths that leave the checkpoint
  directory, absurd config values, malformed safetensors headers;
- the multi-host round channel: a follower never unpickles what reaches it;
- the engine: one request's failure (host work or its device step) fails only that request;
- the tokenizer: incremental detokenization is linear in the output length;
- the server: in tests/test_security_server.py (and tests/test_server.py holds the
  protocol tests).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hf_reference import base_config, random_tensors, write_checkpoint

from paxcache import errors
from paxcache.models import HFTokenizer, load_pretrained
from paxcache.models.loading import CONFIG_LIMITS, load_config, load_model
from paxcache.models.tokenizer import ChatTemplateError

# ----------------------------------------------------------------------------------------------
# Hostile checkpoints


def _bpe_tokenizer(path: Path, chat_template: str | None) -> None:
    """A small byte-level BPE tokenizer.json (trained here) and a tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["def add(a, b):\n    return a + b\n", "héllo wörld ✓ €uro", "the quick fox"] * 20
    tk.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    cfg: dict = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


ESCAPES = [
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ namespace.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c('touch MARKER', shell=True) }}{% endif %}{% endfor %}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
    "{{ raise_exception.__globals__['os'].system('touch MARKER') }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set x = messages.append({'role': 'x'}) %}{{ x }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_a_chat_template_cannot_run_code(tmp_path: Path, template: str) -> None:
    marker = tmp_path / "pwned"
    _bpe_tokenizer(tmp_path / "ckpt", template.replace("MARKER", str(marker)))
    tok = HFTokenizer(tmp_path / "ckpt")
    with pytest.raises(ChatTemplateError) as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert not marker.exists()
    err = info.value
    assert isinstance(err, errors.PaxcacheError) and not err.client_error
    assert "chat_template" in str(err) and "chat_template" in err.public_message
    assert str(tmp_path) not in err.public_message


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 1000000000 }}",
        "{{ [1] * 1000000000 }}",
        "{{ 7 ** 100000000 }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% for %}",
    ],
)
def test_a_chat_template_cannot_exhaust_memory_or_cpu(tmp_path: Path, template: str) -> None:
    _bpe_tokenizer(tmp_path, template)
    with pytest.raises(ChatTemplateError, match="chat_template"):
        HFTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_templates_get_transformers_helpers(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}"
        "{% endfor %}{{ strftime_now('%Y')[:2] }}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    _bpe_tokenizer(tmp_path, template)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "<é>"}]
    out = HFTokenizer(tmp_path).apply_chat_template(msgs)
    assert out == '<s>{"role": "user", "content": "<é>"}20<a>'  # tojson: no HTML escaping


def test_raise_exception_in_a_template_is_a_client_error(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'user' and loop.index0 % 2 %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{% endfor %}"
    )
    _bpe_tokenizer(tmp_path, template)
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError) as info:
        HFTokenizer(tmp_path).apply_chat_template(msgs)
    assert info.value.client_error
    assert "roles must alternate" in info.value.public_message


def _ckpt(tmp_path: Path, **overrides) -> tuple[Path, dict, dict]:
    cfg = base_config("llama", **overrides)
    tensors = random_tensors(base_config("llama"))
    return write_checkpoint(tmp_path / "ckpt", cfg, tensors, shards=2), cfg, tensors


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "nested_dotdot", "symlink", "dir_link"])
def test_shards_cannot_leave_the_checkpoint_directory(tmp_path: Path, kind: str) -> None:
    path, _, tensors = _ckpt(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = "model-00002-of-00002.safetensors"
    # A loadable copy of the shard outside the checkpoint: the attack would succeed silently.
    (outside / "x.safetensors").write_bytes((path / shard).read_bytes())
    if kind == "dotdot":
        target = "../outside/x.safetensors"
    elif kind == "absolute":
        target = str(outside / "x.safetensors")
    elif kind == "nested_dotdot":
        (path / "sub").mkdir()
        target = "sub/../../outside/x.safetensors"
    elif kind == "symlink":
        (path / shard).unlink()
        (path / shard).symlink_to(outside / "x.safetensors")
        target = shard
    else:
        (path / "linked").symlink_to(outside, target_is_directory=True)
        target = "linked/x.safetensors"
    index["weight_map"] = {k: (target if v == shard else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(errors.CheckpointError, match="checkpoint directory") as info:
        load_model(path)
    assert "model.safetensors.index.json" in str(info.value) or shard in str(info.value)


def test_a_symlinked_single_file_checkpoint_outside_is_refused(tmp_path: Path) -> None:
    cfg = base_config("llama")
    src = write_checkpoint(tmp_path / "real", cfg, random_tensors(cfg))
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").symlink_to(src / "model.safetensors")
    with pytest.raises(errors.CheckpointError, match="outside the checkpoint directory"):
        load_model(path)
    (path / "tokenizer.json").symlink_to("/etc/hostname")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    with pytest.raises(errors.CheckpointError, match="tokenizer.json"):
        load_pretrained(path)


def test_hugging_face_cache_snapshot_symlinks_into_blobs_still_load(tmp_path: Path) -> None:
    cfg = base_config("llama")
    src = write_checkpoint(tmp_path / "src", cfg, random_tensors(cfg))
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        blob = repo / "blobs" / f"sha-{name}"
        blob.write_bytes((src / name).read_bytes())
        (snap / name).symlink_to(Path("../../blobs") / blob.name)
    model, _ = load_pretrained(snap)
    assert model.config.vocab_size == cfg["vocab_size"]


ABSURD = [
    ("max_position_embeddings", 1e13),
    ("max_position_embeddings", 10**13),
    ("vocab_size", 2**40),
    ("hidden_size", -32),
    ("num_hidden_layers", 10**6),
    ("num_attention_heads", 0),
    ("num_key_value_heads", 10**9),
    ("head_dim", 2**20),
    ("intermediate_size", "48"),
    ("vocab_size", True),
    ("rope_theta", float("nan")),
    ("rms_norm_eps", -1.0),
    ("tie_word_embeddings", "yes"),
    ("eos_token_id", 10**12),
    ("eos_token_id", [2, "x"]),
    ("rope_scaling", "linear"),
    ("rope_scaling", {"rope_type": "linear", "factor": float("inf")}),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
    ("sliding_window", 2**40),
    ("layer_types", "sliding_attention"),
]


@pytest.mark.parametrize(("field", "value"), ABSURD)
def test_absurd_config_values_are_refused_naming_the_field(
    tmp_path: Path, field: str, value
) -> None:
    path, cfg, _ = _ckpt(tmp_path)
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.CheckpointError) as info:
        load_model(path)
    msg = str(info.value)
    assert "config.json" in msg and field.split(".")[0] in msg, msg


@pytest.mark.parametrize(
    "config_text",
    ["[1, 2]", '"llama"', "{", '{"model_type": "llama"}', "\udcff", "[" * 100_000 + "]" * 100_000],
)
def test_malformed_configs_are_checkpoint_errors(tmp_path: Path, config_text: str) -> None:
    path, _, _ = _ckpt(tmp_path)
    (path / "config.json").write_bytes(config_text.encode("utf-8", "surrogateescape"))
    with pytest.raises(errors.CheckpointError, match="config.json"):
        load_config(path)


def _header_file(path: Path, header: bytes, data: bytes = b"", declared: int | None = None) -> None:
    n = len(header) if declared is None else declared
    path.write_bytes(struct.pack("<Q", n) + header + data)


MALFORMED_SAFETENSORS = {
    "garbage": lambda p: p.write_bytes(os.urandom(64)),
    "empty": lambda p: p.write_bytes(b""),
    "huge_header_length": lambda p: _header_file(p, b"{}", declared=2**62),
    "header_not_json": lambda p: _header_file(p, b"{not json"),
    "header_a_list": lambda p: _header_file(p, b"[1, 2, 3]"),
    "offsets_past_the_end": lambda p: _header_file(
        p,
        json.dumps(
            {"model.norm.weight": {"dtype": "F32", "shape": [32], "data_offsets": [0, 10**12]}}
        ).encode(),
    ),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED_SAFETENSORS))
def test_malformed_safetensors_are_checkpoint_errors_naming_the_file(
    tmp_path: Path, kind: str
) -> None:
    path, _, _ = _ckpt(tmp_path)
    shard = path / "model-00001-of-00002.safetensors"
    MALFORMED_SAFETENSORS[kind](shard)
    with pytest.raises(errors.CheckpointError, match="model-00001-of-00002") as info:
        load_model(path)
    assert isinstance(info.value, ValueError)


def test_wrong_dtype_or_shape_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    cfg = base_config("llama", num_hidden_layers=2)
    tensors = random_tensors(cfg)
    tensors["model.layers.1.mlp.down_proj.weight"] = np.zeros((2, 2), np.float32)
    path = write_checkpoint(tmp_path / "a", cfg, tensors)
    with pytest.raises(errors.CheckpointError, match="down_proj"):
        load_model(path)
    tensors = random_tensors(cfg)
    tensors["model.norm.weight"] = np.zeros(32, np.int64)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(errors.CheckpointError, match="dtype I64"):
        load_model(path)


def test_config_limits_cover_every_sized_field() -> None:
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
        lo, hi = CONFIG_LIMITS[field]
        assert 1 <= lo < hi


# ----------------------------------------------------------------------------------------------
# Incremental detokenization: exact and linear


class _CountingTokenizer:
    """Wraps a tokenizer and counts the ids every ``decode`` call is given."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_incremental_decoder_matches_a_full_decode_with_a_bpe_tokenizer(tmp_path: Path) -> None:
    from paxcache.models import IncrementalDecoder

    _bpe_tokenizer(tmp_path, None)
    tok = HFTokenizer(tmp_path)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 60))).tolist()
        dec = IncrementalDecoder(tok)
        text = "".join(dec.push(i) for i in ids) + dec.flush()
        assert text == tok.decode(ids), ids
    text = "héllo wörld ✓ €uro def add(a, b):"
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in tok.encode(text, add_special_tokens=False)]
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_decoder_is_linear_in_the_output_length(tmp_path: Path) -> None:
    from paxcache.models import ByteTokenizer, IncrementalDecoder

    _bpe_tokenizer(tmp_path, None)
    rng = np.random.default_rng(1)
    for base in (HFTokenizer(tmp_path), ByteTokenizer()):
        for n in (1000, 8000):
            tok = _CountingTokenizer(base)
            ids = rng.integers(0, 256, size=n).tolist()  # includes invalid UTF-8 runs
            dec = IncrementalDecoder(tok)
            text = "".join(dec.push(i) for i in ids) + dec.flush()
            assert text == base.decode(ids)
            # Each push decodes a window of a few tokens; a whole-list decode would be ~n^2/2.
            assert tok.decoded <= 40 * n, (type(base).__name__, n, tok.decoded)


def test_incremental_decoder_holds_at_most_a_few_tokens_of_invalid_utf8() -> None:
    from paxcache.models import ByteTokenizer, IncrementalDecoder
    from paxcache.models.tokenizer import MAX_HELD_TOKENS

    dec = IncrementalDecoder(ByteTokenizer())
    out = [dec.push(0x80) for _ in range(3 * MAX_HELD_TOKENS)]
    assert sum(1 for p in out if p) >= 2  # emitted as U+FFFD instead of held forever
    assert "".join(out) + dec.flush() == b"\x80".decode("utf-8", "replace") * 3 * MAX_HELD_TOKENS


# ----------------------------------------------------------------------------------------------
# SamplingParams bounds


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**40),
        ("top_k", -1),
        ("max_tokens", 2**31),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("stop_token_ids", [2**31]),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_p", float("nan")),
        ("min_p", float("nan")),
        ("n", 10**6),
        ("logprobs", 10**6),
        ("output_kind", "final"),
    ],
)
def test_sampling_params_refuse_values_the_engine_cannot_represent(field: str, value) -> None:
    from paxcache import SamplingParams

    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_accept_the_edges() -> None:
    from paxcache import SamplingParams

    SamplingParams(top_k=2**31 - 1, seed=2**64 - 1, max_tokens=2**31 - 1, stop_token_ids=[0])
    SamplingParams(seed=-(2**63), output_kind="delta")


# ----------------------------------------------------------------------------------------------
# The engine: one request's failure is that request's alone


@pytest.fixture(scope="module")
def engine():
    from paxcache import Engine

    return Engine.from_pretrained(
        "tiny", max_num_seqs=4, max_num_batched_tokens=16, num_blocks=96, block_size=16
    )


PROMPT_A = "def fibonacci(n):\n    " * 2  # 46 tokens: 3 prefill steps of 16
PROMPT_B = "import numpy as np\n"


def _drain(engine, ids) -> dict:
    final = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if set(ids) <= final.keys():
            return final
    raise AssertionError(f"requests did not finish: {set(ids) - final.keys()}")


def _idle(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.free_slots() == engine.cache_config.max_seqs
    assert not engine.scheduler.running and not engine.scheduler.waiting


def _reference(engine, prompt: str, **kw):
    from paxcache import SamplingParams

    return engine.generate([prompt], SamplingParams(max_tokens=12, **kw))[0].outputs[0]


def test_a_request_failing_in_host_work_fails_alone(engine) -> None:
    from paxcache import SamplingParams

    want = _reference(engine, PROMPT_B)
    params = SamplingParams(max_tokens=12)
    engine.add_request("a", PROMPT_A, params)
    engine.add_request("b", PROMPT_B, params)

    class Exploding:
        def push(self, *ids):
            raise RuntimeError("tokenizer bug at /secret/path")

        def flush(self):
            return ""

    engine.outputs.get("a").seqs[0].decoder = Exploding()
    final = _drain(engine, ["a", "b"])
    a, b = final["a"], final["b"]
    assert a.outputs[0].finish_reason == "error" and "/secret" not in (a.error or "")
    assert a.error == "internal error while processing this request"
    assert b.outputs[0].text == want.text and b.outputs[0].finish_reason == want.finish_reason
    _idle(engine)


def test_a_request_with_unrepresentable_params_fails_alone(engine) -> None:
    """The issue's repro: a value that overflows the step's int32/float32 inputs. Validation
    now refuses it at the door; if one ever slips through, only its request fails."""
    from paxcache import SamplingParams

    want = _reference(engine, PROMPT_B, temperature=0.0)
    bad = SamplingParams(max_tokens=12, temperature=1.0)
    object.__setattr__(bad, "temperature", 10**400)  # bypasses __post_init__
    engine.add_request("bad", PROMPT_B, bad)
    engine.add_request("good", PROMPT_B, SamplingParams(max_tokens=12))
    final = _drain(engine, ["bad", "good"])
    assert final["bad"].outputs[0].finish_reason == "error"
    assert final["good"].outputs[0].text == want.text
    _idle(engine)


@pytest.mark.parametrize("after_donation", [False, True])
def test_a_failed_device_step_fails_only_the_requests_in_it(engine, after_donation) -> None:
    from paxcache import SamplingParams

    want = _reference(engine, PROMPT_B)
    params = SamplingParams(max_tokens=12)
    # Its prefill (46 tokens, none cached) fills the whole first step (16 tokens).
    engine.add_request("in-step", f"# fresh {after_donation}\n" + PROMPT_A, params)
    engine.add_request("queued", PROMPT_B, params)
    real = engine._jit_step
    calls = []

    def faulty(*args):
        calls.append(1)
        if len(calls) == 1:
            if after_donation:
                real(*args)  # consumes (donates) the block state and the KV cache
            raise RuntimeError("injected device failure")
        return real(*args)

    engine._jit_step = faulty
    try:
        final = _drain(engine, ["in-step", "queued"])
    finally:
        engine._jit_step = real
    assert final["in-step"].outputs[0].finish_reason == "error"
    assert final["queued"].outputs[0].text == want.text
    _idle(engine)
    # The engine keeps serving afterwards.
    assert _reference(engine, PROMPT_B).text == want.text


def test_cached_tokens_are_reported_and_never_cross_salts(engine) -> None:
    from paxcache import SamplingParams

    prompt = "class Tenant:\n    secret = 'x'\n" * 3  # > 3 blocks
    p = SamplingParams(max_tokens=2)

    def run(rid: str, salt) -> int:
        engine.add_request(rid, prompt, p, cache_salt=salt)
        return _drain(engine, [rid])[rid].num_cached_tokens

    assert run("t1", "tenant-1") == 0
    hit = run("t1-again", "tenant-1")
    assert hit >= 3 * engine.block_size
    assert run("t2", "tenant-2") == 0
    assert run("none", None) == 0
    assert run("t2-again", "tenant-2") == hit


def test_delta_outputs_concatenate_to_the_cumulative_output(engine) -> None:
    from paxcache import SamplingParams

    kw = dict(max_tokens=20, temperature=0.8, seed=3, n=2, logprobs=1)
    full = engine.generate([PROMPT_B], SamplingParams(**kw))[0]
    engine.add_request("d", PROMPT_B, SamplingParams(**kw, output_kind="delta"))
    text, ids, lps = ["", ""], [[], []], [[], []]
    for out in iter(lambda: engine.step(), None):
        for o in out:
            for c in o.outputs:
                text[c.index] += c.text
                ids[c.index] += c.token_ids
                lps[c.index] += c.logprobs
        if any(o.finished for o in out):
            break
    for c in full.outputs:
        assert text[c.index] == c.text and ids[c.index] == c.token_ids
        assert [e["token_id"] for e in lps[c.index]] == c.token_ids


def test_the_cache_salt_map_stays_bounded_and_never_reuses_an_id(engine, monkeypatch) -> None:
    import paxcache.manager
    from paxcache import SamplingParams

    bm = engine.block_manager  # the salt map moved from the engine to its block manager
    monkeypatch.setattr(paxcache.manager, "_SALT_GC_THRESHOLD", 8)
    monkeypatch.setattr(bm, "_salt_gc_at", 8)

    def salt_id(salt: str) -> int:  # the id admission gives a new salt, registered
        sid = bm._peek_salt(salt, {})
        bm._register_salt(salt, sid)
        return sid

    seen: dict = {}
    for i in range(40):
        salt = f"tenant-{i}"
        sid = salt_id(salt)
        assert sid not in seen.values()
        seen[salt] = sid
    assert len(bm._salts) <= 16
    # A salt whose blocks are still cached keeps its id (and its hits) across a collection.
    prompt = "def cached_for_keeper(): pass\n" * 2
    engine.generate([prompt], SamplingParams(max_tokens=1))  # warms nothing for the salt
    engine.add_request("k1", prompt, SamplingParams(max_tokens=1), cache_salt="keeper")
    _drain(engine, ["k1"])
    for i in range(40):
        salt_id(f"filler-{i}")
    engine.add_request("k2", prompt, SamplingParams(max_tokens=1), cache_salt="keeper")
    assert _drain(engine, ["k2"])["k2"].num_cached_tokens > 0


# ----------------------------------------------------------------------------------------------
# The multi-host round channel: JSON of known fields, never pickle


def test_rounds_round_trip_through_the_json_channel() -> None:
    from paxcache import SamplingParams, sharding
    from paxcache.server import EngineRound, RoundAdd

    rnd = EngineRound(
        stop=False,
        aborts=("cmpl-1",),
        adds=(
            RoundAdd("cmpl-2", "héllo", SamplingParams(stop=["\n"], seed=2**64 - 1, n=2), "k/s"),
            RoundAdd("cmpl-3", [1, 2, 3], SamplingParams(output_kind="delta", logprobs=3)),
        ),
        stats=True,
    )
    wire = sharding.decode_message(sharding.encode_message(rnd.to_wire()))
    assert EngineRound.from_wire(wire) == rnd


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_on_the_channel_is_refused_without_running_it(tmp_path: Path) -> None:
    import pickle

    from paxcache import sharding

    marker = tmp_path / "pwned"
    with pytest.raises(sharding.BroadcastError):
        sharding.decode_message(pickle.dumps(_Evil(marker)))
    assert not marker.exists()
    with pytest.raises(sharding.BroadcastError):
        sharding.encode_message({"x": _Evil(marker)})  # the leader cannot send objects either


@pytest.mark.parametrize(
    "mutate",
    [
        lambda w: w.update(extra=1),
        lambda w: w.update(stop="yes"),
        lambda w: w.update(aborts=[1]),
        lambda w: w["adds"][0].update(prompt={"a": 1}),
        lambda w: w["adds"][0].update(prompt=[1, True]),
        lambda w: w["adds"][0].update(request_id="x" * 1000),
        lambda w: w["adds"][0]["params"].update(top_k=2**40),
        lambda w: w["adds"][0]["params"].update(evil="__import__('os')"),
        lambda w: w["adds"][0]["params"].pop("n"),
        lambda w: w["adds"][0].update(cache_salt=5),
    ],
)
def test_a_malformed_round_is_refused(mutate) -> None:
    from paxcache import SamplingParams
    from paxcache.server import EngineRound, RoundAdd, RoundError

    wire = EngineRound(False, (), (RoundAdd("r", "p", SamplingParams()),), False).to_wire()
    mutate(wire)
    with pytest.raises(RoundError, match="invalid multi-host round"):
        EngineRound.from_wire(wire)
