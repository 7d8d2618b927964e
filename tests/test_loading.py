"""HF-format checkpoint loading (Llama, Mistral, Qwen2/3, OLMo 2, Phi-3), tokenizers and the
bundled tiny model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_reference import base_config, forward_np, random_tensors, write_checkpoint
from safetensors.numpy import save_file
from tiny_models import forward

from paxcache import errors
from paxcache.models import (
    TINY_DIR,
    ByteTokenizer,
    CheckpointError,
    HFTokenizer,
    IncrementalDecoder,
    LlamaForCausalLM,
    MissingFileError,
    MissingTensorError,
    TensorShapeError,
    UnsupportedModelError,
    greedy_generate,
    load_pretrained,
    save_pretrained,
)
from paxcache.models.loading import load_model

IDS = [5, 17, 3, 60, 9, 22, 41, 0, 13, 7, 33, 2]

VARIANTS = {
    "llama_gqa_untied": base_config("llama"),
    "llama_mha_tied_bias": base_config(
        "llama", num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True
    ),
    "llama3_rope_scaling": base_config(
        "llama",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama_head_dim_16": base_config("llama", head_dim=16),
    "mistral_window_4": base_config("mistral", sliding_window=4),
    "qwen2_bias": base_config("qwen2"),
    "qwen2_window_top_layer": base_config(
        "qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=1
    ),
    "qwen3_head_dim_16": base_config("qwen3"),
    "olmo2_bias": base_config("olmo2", attention_bias=True),
    "phi3_longrope_partial": base_config(  # 12 tokens > 8: the long factors
        "phi3",
        partial_rotary_factor=0.5,
        original_max_position_embeddings=8,
        rope_scaling={"type": "su", "short_factor": [1.0, 1.7], "long_factor": [1.5, 4.0]},
    ),
}
NEW_FAMILIES = ("qwen3", "olmo2", "phi3")


def _logits(model: LlamaForCausalLM, ids: list[int]) -> np.ndarray:
    return np.asarray(forward(model, jnp.asarray([ids], jnp.int32))[0])


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_loaded_checkpoint_logits_match_numpy_hf_reference(tmp_path: Path, name: str) -> None:
    cfg = VARIANTS[name]
    tensors = random_tensors(cfg, seed=1)
    model, tok = load_pretrained(write_checkpoint(tmp_path / name, cfg, tensors))
    assert isinstance(tok, ByteTokenizer)
    got = _logits(model, IDS)
    chex.assert_shape(got, (len(IDS), cfg["vocab_size"]))
    tol = 1e-5 if cfg["model_type"] in NEW_FAMILIES else 2e-4
    np.testing.assert_allclose(got, forward_np(cfg, tensors, IDS), atol=tol, rtol=tol)


@pytest.mark.parametrize("model_type", ["qwen2", "phi3"])
def test_sharded_checkpoint_with_index_loads_like_single_file(
    tmp_path: Path, model_type: str
) -> None:
    """Phi-3: the fused qkv_proj / gate_up_proj tensors of a layer sit in different shards."""
    cfg = base_config(model_type, num_hidden_layers=3)
    tensors = random_tensors(cfg, seed=2)
    single = load_model(write_checkpoint(tmp_path / "one", cfg, tensors))
    sharded_dir = write_checkpoint(tmp_path / "sharded", cfg, tensors, shards=3)
    assert len(list(sharded_dir.glob("*.safetensors"))) == 3
    sharded = load_model(sharded_dir)
    np.testing.assert_array_equal(_logits(single, IDS), _logits(sharded, IDS))
    np.testing.assert_allclose(_logits(sharded, IDS), forward_np(cfg, tensors, IDS), atol=2e-4)


def test_layer_weights_are_stacked_in_layer_order_and_transposed(tmp_path: Path) -> None:
    cfg = base_config("llama", num_hidden_layers=3)
    tensors = random_tensors(cfg, seed=3)
    model = load_model(write_checkpoint(tmp_path / "c", cfg, tensors))
    for i in range(3):
        np.testing.assert_array_equal(
            np.asarray(model.layers.q_proj[...][i]),
            tensors[f"model.layers.{i}.self_attn.q_proj.weight"].T,
        )
        np.testing.assert_array_equal(
            np.asarray(model.layers.down_proj[...][i]),
            tensors[f"model.layers.{i}.mlp.down_proj.weight"].T,
        )
    np.testing.assert_array_equal(np.asarray(model.lm_head[...]), tensors["lm_head.weight"].T)


def test_bf16_checkpoint_loads_as_f32_and_as_bf16(tmp_path: Path) -> None:
    cfg = base_config("llama")
    tensors = random_tensors(cfg, seed=4)
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    path = write_checkpoint(tmp_path / "bf", cfg, bf)
    m32 = load_model(path, dtype=jnp.float32)
    m16 = load_model(path, dtype=jnp.bfloat16)
    assert m32.layers.q_proj[...].dtype == jnp.float32
    assert m16.layers.q_proj[...].dtype == jnp.bfloat16
    ref = forward_np(cfg, {k: v.astype(np.float32) for k, v in bf.items()}, IDS)
    np.testing.assert_allclose(_logits(m32, IDS), ref, atol=2e-4, rtol=2e-4)
    got16 = _logits(m16, IDS)
    assert got16.dtype == np.float32
    np.testing.assert_allclose(got16, ref, atol=0.15 * np.abs(ref).max())


def test_save_pretrained_round_trips(tmp_path: Path) -> None:
    cfg = VARIANTS["qwen2_window_top_layer"]
    tensors = random_tensors(cfg, seed=5)
    model = load_model(write_checkpoint(tmp_path / "a", cfg, tensors))
    save_pretrained(model, tmp_path / "b")
    again = load_model(tmp_path / "b")
    assert again.config == model.config
    np.testing.assert_array_equal(_logits(model, IDS), _logits(again, IDS))


@pytest.mark.parametrize("model_type", NEW_FAMILIES)
def test_engine_paged_greedy_equals_dense_greedy(tmp_path: Path, model_type: str) -> None:
    """Through Engine.from_pretrained: two sequences, chunked prefill (8-token steps) then
    decode on the paged cache give the dense path's greedy tokens. Phi-3's longrope switch
    reads each sequence's own length in the step; its original length 2 is below every chunk
    this schedule makes (8, then 1 + 7 tokens), so both paths use the long factors."""
    from paxcache import Engine, SamplingParams

    extra = {
        "qwen3": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0},
        "olmo2": {},
        "phi3": {
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 2,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.7],
                "long_factor": [1.5, 4.0],
            },
        },
    }[model_type]
    cfg = base_config(model_type, **extra)
    path = write_checkpoint(tmp_path / model_type, cfg, random_tensors(cfg, seed=8, scale=0.4))
    prompts = [IDS[:9], IDS[2:9]]
    n = 6  # 9 + 6 tokens: greedy_generate compiles one bucket (16)
    dense = load_model(path)
    want = [greedy_generate(dense, p, n) for p in prompts]
    engine = Engine.from_pretrained(
        path,
        dtype=jnp.float32,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        num_blocks=16,
        block_size=4,
        warmup=False,
    )
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert len(set(want[0])) > 1  # not a degenerate constant output


@pytest.mark.parametrize("mode", ["sync", "overlap_multistep"])
def test_longrope_sequences_crossing_the_original_length_match_hf_greedy(
    tmp_path: Path, mode: str
) -> None:
    """Phi-3 longrope, original length 12 (HF's rule: a forward over more than 12 tokens uses
    the long factors for every token; ``generate`` drops its cache and recomputes at the step
    that crosses). The dense greedy reference recomputes the whole sequence per token, which
    is HF's ``generate``. The engine, with 8-token prefill chunks: a 9-token prompt crosses
    while decoding, a 12-token prompt right after its prefill, a 14-token prompt is long in
    every chunk (its first chunk alone is 8 <= 12). Then the prefix cache: a short prompt
    sharing two blocks with the long one must not read the long blocks, and the long prompt
    again must hit its own. Both engine modes (multi-step decode stops a row at the switch;
    overlap never continues past it) give the same tokens."""
    from paxcache import Engine, SamplingParams

    cfg = base_config(
        "phi3",
        partial_rotary_factor=0.5,
        original_max_position_embeddings=12,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.7],
            "long_factor": [3.0, 9.0],
        },
    )
    path = write_checkpoint(tmp_path / "phi3", cfg, random_tensors(cfg, seed=8, scale=0.4))
    ids = [5, 17, 3, 60, 9, 22, 41, 4, 13, 7, 33, 2, 50, 11, 28, 19]
    prompts = [ids[:9], ids[:12], ids[:14]]
    n = 7
    dense = load_model(path)
    want = [greedy_generate(dense, p, n) for p in prompts]
    extra = dict(async_scheduling=False) if mode == "sync" else dict(decode_steps=4)
    engine = Engine.from_pretrained(
        path,
        dtype=jnp.float32,
        max_num_seqs=3,
        max_num_batched_tokens=8,
        num_blocks=32,
        block_size=4,
        warmup=False,
        **extra,
    )
    assert engine.scheduler.rope_switch_len == 12
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert engine.stats()["num_rope_recomputes"] == 2  # the 9- and 12-token prompts
    short = ids[:10]  # shares ids[:8] (two blocks) with the long prompt
    short_out = engine.generate([short], params)[0]
    assert short_out.num_cached_tokens == 8  # the 9- and 12-token prompts' short blocks
    assert short_out.outputs[0].token_ids == greedy_generate(dense, short, n)
    again = engine.generate([prompts[2]], params)[0]
    assert again.num_cached_tokens == 12  # the long prompt's own long blocks
    assert again.outputs[0].token_ids == want[2]
    assert all(len(set(w)) > 1 for w in want)  # not a degenerate constant output


# -- errors ---------------------------------------------------------------------------------


def test_missing_tensor_error_names_the_tensor(tmp_path: Path) -> None:
    cfg = base_config("llama")
    tensors = random_tensors(cfg)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    path = write_checkpoint(tmp_path / "c", cfg, tensors)
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_missing_lm_head_when_untied_is_an_error(tmp_path: Path) -> None:
    cfg = base_config("llama")
    tensors = random_tensors(cfg)
    del tensors["lm_head.weight"]
    with pytest.raises(MissingTensorError, match="lm_head.weight"):
        load_model(write_checkpoint(tmp_path / "c", cfg, tensors))


def test_wrong_shape_error_names_tensor_and_shapes(tmp_path: Path) -> None:
    cfg = base_config("llama")
    tensors = random_tensors(cfg)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    path = write_checkpoint(tmp_path / "c", cfg, tensors)
    with pytest.raises(TensorShapeError, match=r"k_proj\.weight.*\(8, 32\).*\(16, 32\)"):
        load_model(path)


def test_unknown_model_type_is_rejected(tmp_path: Path) -> None:
    cfg = base_config("llama")
    tensors = random_tensors(cfg)
    cfg["model_type"] = "gpt2"
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(write_checkpoint(tmp_path / "c", cfg, tensors))


def test_unsupported_rope_scaling_is_rejected(tmp_path: Path) -> None:
    cfg = base_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        load_model(write_checkpoint(tmp_path / "c", cfg, random_tensors(base_config())))


@pytest.mark.parametrize("what", ["dir", "config", "weights", "shard"])
def test_missing_file_errors_name_the_path(tmp_path: Path, what: str) -> None:
    cfg = base_config("llama")
    path = write_checkpoint(tmp_path / "c", cfg, random_tensors(cfg), shards=2)
    if what == "dir":
        path, expect = tmp_path / "nope", "nope"
    elif what == "config":
        (path / "config.json").unlink()
        expect = "config.json"
    elif what == "weights":
        for f in path.glob("*.safetensors*"):
            f.unlink()
        expect = "safetensors"
    else:
        (path / "model-00002-of-00002.safetensors").unlink()
        expect = "model-00002-of-00002"
    with pytest.raises(MissingFileError, match=expect) as info:
        load_model(path)
    assert isinstance(info.value, CheckpointError)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, errors.PaxcacheError)


def test_progress_is_logged_for_big_checkpoints(tmp_path: Path, monkeypatch, caplog) -> None:
    import paxcache.models.loading as loading

    monkeypatch.setattr(loading, "_LOG_BYTES", 1000)
    cfg = base_config("llama")
    path = write_checkpoint(tmp_path / "c", cfg, random_tensors(cfg))
    with caplog.at_level(logging.INFO, logger="paxcache.models.loading"):
        load_model(path)
    assert any("loading checkpoint" in r.message for r in caplog.records)


# -- tokenizers ------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_unicode_and_drops_specials() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256
    assert tok.eos_token_id == 257 and tok.vocab_size == 259
    assert tok.decode([*ids, tok.eos_token_id]) == text


def test_incremental_decoder_never_emits_broken_utf8() -> None:
    tok = ByteTokenizer()
    text = "a✓b€"
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in tok.encode(text, add_special_tokens=False)]
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1] == "" and pieces[3] == "✓"  # the 3-byte char appears only when complete


def _write_hf_tokenizer(path: Path, chat_template: str | None) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4, "def": 5}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<s>", "</s>"])
    path.mkdir(parents=True, exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if chat_template:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_hf_tokenizer_from_tokenizer_json(tmp_path: Path) -> None:
    _write_hf_tokenizer(tmp_path, None)
    tok = HFTokenizer(tmp_path)
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and tok.vocab_size == 6
    assert tok.encode("hello world") == [3, 4]  # no post-processor in this tokenizer.json
    assert tok.decode([0, 3, 4, 1]) == "hello world"
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|user|>\nhi\n<|assistant|>\n"


def test_hf_tokenizer_renders_jinja_chat_template(tmp_path: Path) -> None:
    pytest.importorskip("jinja2")
    tpl = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    _write_hf_tokenizer(tmp_path, tpl)
    out = HFTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<s>[user]hi"


def test_load_pretrained_picks_tokenizer_json_when_present(tmp_path: Path) -> None:
    cfg = base_config("llama")
    path = write_checkpoint(tmp_path / "c", cfg, random_tensors(cfg))
    _write_hf_tokenizer(path, None)
    _, tok = load_pretrained(path)
    assert isinstance(tok, HFTokenizer)


# -- the bundled tiny model ------------------------------------------------------------------


def test_tiny_model_ships_in_package_within_size_budget() -> None:
    assert (TINY_DIR / "config.json").is_file()
    size = sum(f.stat().st_size for f in TINY_DIR.iterdir())
    assert size <= 20 * 2**20
    log = json.loads((TINY_DIR / "train_log.json").read_text())
    assert log["final_val_loss_nats_per_byte"] < 2.0


def test_tiny_model_greedy_generates_deterministic_python_text() -> None:
    model, tok = load_pretrained("tiny")
    assert isinstance(tok, ByteTokenizer)
    assert 1_000_000 <= sum(x.size for x in _params(model)) <= 5_000_000
    prompt = tok.encode("def ")
    a = greedy_generate(model, prompt, 12)
    b = greedy_generate(model, prompt, 12)
    assert a == b
    text = tok.decode(a)
    assert text.isascii() and text.strip(), text
    logits = _logits(model, prompt)
    assert np.isfinite(logits).all()


def _params(model: LlamaForCausalLM) -> list[np.ndarray]:
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(model, nnx.Param))


# -- optional: transformers ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "llama_gqa_untied",
        "mistral_window_4",
        "qwen2_bias",
        "qwen3_head_dim_16",
        "olmo2_bias",
        "phi3_longrope_partial",
    ],
)
def test_logits_match_transformers(tmp_path: Path, name: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = VARIANTS[name]
    tensors = random_tensors(cfg, seed=7)
    path = write_checkpoint(tmp_path / name, cfg, tensors)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0].numpy()
    model = load_model(path)
    np.testing.assert_allclose(_logits(model, IDS), want, atol=2e-4, rtol=2e-4)


def test_extra_unknown_tensors_and_files_are_ignored(tmp_path: Path) -> None:
    # A checkpoint with an unrelated extra tensor still loads (extra names are ignored).
    cfg = base_config("llama")
    tensors = random_tensors(cfg)
    tensors["model.rotary_emb.inv_freq"] = np.zeros(4, np.float32)
    path = write_checkpoint(tmp_path / "c", cfg, tensors)
    save_file({"x": np.zeros(1, np.float32)}, str(path / "extra.bin.safetensors"))
    load_model(path)


@pytest.mark.slow
def test_train_tiny_script_runs_end_to_end_and_writes_a_loadable_checkpoint(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny.py"
    args = ["--steps", "3", "--batch", "2", "--seq", "32", "--eval-batches", "1"]
    subprocess.run([sys.executable, str(script), *args, "--out", str(tmp_path)], check=True)
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["history"][-1]["step"] == 3 and log["params"] == 2886656
    model, tok = load_pretrained(tmp_path)
    assert isinstance(tok, ByteTokenizer) and model.config.vocab_size == 259
