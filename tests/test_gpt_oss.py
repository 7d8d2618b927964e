"""gpt-oss: logits equal transformers' (saved in tests/fixtures/gpt_oss_tiny_hf.npz) and a
float64 numpy port of its code in the float and the MXFP4 expert layouts; the engine's paged
greedy tokens equal transformers' ``generate`` with a window shorter than the prompt, through
chunked prefill and a prefix hit; attention sinks in the attention op equal a dense oracle,
and the Pallas kernels are never run with them; MXFP4 dequantization equals transformers';
the gpt-oss-20b config builds a model of the published size.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hf_gpt_oss_reference import (
    GENERATE,
    IDS,
    checksum,
    dequant_np,
    gpt_oss_config,
    gpt_oss_forward_np,
    random_gpt_oss_tensors,
    write_checkpoint,
)
from tiny_models import forward
from workers import run_worker

import kernels_pallas as kp
from kernels_pallas.reference import ragged_paged_attention_xla
from paxcache import Engine, SamplingParams
from paxcache.errors import CheckpointError
from paxcache.models import LlamaConfig, load_model, save_pretrained
from paxcache.models.gpt_oss import GptOssConfig, GptOssForCausalLM, dequantize_mxfp4

FIXTURES = Path(__file__).with_name("fixtures")
HF = np.load(FIXTURES / "gpt_oss_tiny_hf.npz")
SEEDS = {"float": 1, "mxfp4": 2}  # the seeds the saved transformers outputs were made from


def _checkpoint(tmp_path: Path, layout: str) -> tuple[Path, dict[str, np.ndarray]]:
    cfg = gpt_oss_config()
    tensors = random_gpt_oss_tensors(cfg, SEEDS[layout], layout)
    assert checksum(tensors) == pytest.approx(float(HF[f"{layout}_checksum"]), rel=1e-12), (
        "the seeded tensors no longer match the ones transformers' outputs were saved for"
    )
    return write_checkpoint(tmp_path / layout, cfg, tensors), tensors


@pytest.mark.parametrize("layout", ["float", "mxfp4"])
def test_logits_match_transformers_and_the_numpy_port(tmp_path: Path, layout: str) -> None:
    path, tensors = _checkpoint(tmp_path, layout)
    model = load_model(path)
    assert isinstance(model, GptOssForCausalLM)
    got = np.asarray(forward(model, jnp.asarray([IDS])))[0]
    np.testing.assert_allclose(got, HF[f"{layout}_logits"], atol=2e-3)
    np.testing.assert_allclose(got, gpt_oss_forward_np(gpt_oss_config(), tensors, IDS), atol=2e-3)


def test_engine_greedy_equals_transformers_generate_through_chunks_window_and_prefix_hit(
    tmp_path: Path,
) -> None:
    """Window 4 < the 12-token prompt, 8-token prefill chunks, 4-token blocks; the second
    prompt repeats the first after it finished (a prefix hit of its first 8 tokens)."""
    path, _ = _checkpoint(tmp_path, "float")
    want = [int(t) for t in HF["float_generate"]]
    engine = Engine.from_pretrained(
        path, max_num_seqs=1, max_num_batched_tokens=8, num_blocks=16, block_size=4, warmup=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=GENERATE, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in engine.generate([IDS, IDS], params)]
    assert outs == [want, want]
    assert engine.stats()["prefix_cache_hit_rate"] > 0
    assert len(set(want)) > 3  # not a degenerate constant output


@pytest.mark.slow
def test_engine_greedy_of_the_mxfp4_checkpoint_equals_transformers_generate(
    tmp_path: Path,
) -> None:
    path, _ = _checkpoint(tmp_path, "mxfp4")
    engine = Engine.from_pretrained(
        path, max_num_seqs=1, max_num_batched_tokens=8, num_blocks=16, block_size=4, warmup=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=GENERATE, ignore_eos=True)
    out = engine.generate([IDS], params)[0].outputs[0].token_ids
    assert out == [int(t) for t in HF["mxfp4_generate"]]


# -- attention sinks in the attention op ----------------------------------------------------


def _sink_oracle(q, k, v, kv_lens, q_lens, sinks, window) -> np.ndarray:
    """Per query row: softmax over [visible keys, sink] (the sink's value is zero)."""
    out = np.zeros(q.shape, np.float64)
    row, start = 0, 0
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    for n, ql in zip(kv_lens, q_lens, strict=True):
        ks, vs = k[start : start + n], v[start : start + n]
        for i in range(ql):
            p = n - ql + i
            seen = (np.arange(n) <= p) & (np.arange(n) > p - window)
            for h in range(heads):
                kv = h // (heads // kv_heads)
                logits = np.where(seen, ks[:, kv] @ q[row, h] / np.sqrt(d), -np.inf)
                w = np.exp(np.append(logits, sinks[h]) - max(logits.max(), sinks[h]))
                out[row, h] = (w[:-1] / w.sum()) @ vs[:, kv]
            row += 1
        start += n
    return out


@pytest.mark.parametrize("impl", ["reference", "auto", "pallas_tpu"])
def test_sinks_in_the_ragged_op_equal_a_dense_oracle(impl: str) -> None:
    """A 3-row prefill chunk and a decode (window 3), two padding rows (zeros); one head's
    sink is -inf (no sink). ``pallas_tpu``: the TPU ragged and decode kernels, interpreted."""
    interpret = impl == "pallas_tpu"
    rng = np.random.default_rng(0)
    heads, kv_heads, d, s = 4, 2, 8, 4
    kv_lens, q_lens = [7, 5], [3, 1]
    k, v = (rng.standard_normal((12, kv_heads, d)).astype(np.float32) for _ in range(2))
    cache = kp.init_kv_cache(1, 16, s, kv_heads, d, jnp.float32, fill_value=float("nan"))
    slots = np.concatenate([np.arange(7), 3 * s + np.arange(5)]).astype(np.int32)
    cache = kp.write_kv(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots), layer=0)
    tables = np.asarray([[0, 1, -1, -1], [3, 4, -1, -1]], np.int32)
    q = rng.standard_normal((6, heads, d)).astype(np.float32)
    sinks = (rng.standard_normal(heads) * 2).astype(np.float32)
    sinks[1] = -np.inf
    out = kp.ragged_paged_attention(
        jnp.asarray(q), cache, jnp.asarray(kv_lens), jnp.asarray(tables),
        jnp.asarray([0, 3, 4]), 2, layer=0, sliding_window=3, sinks=jnp.asarray(sinks), impl=impl,
        interpret=interpret,
    )  # fmt: skip
    want = _sink_oracle(q, k, v, kv_lens, q_lens, sinks, 3)
    np.testing.assert_allclose(np.asarray(out)[:4], want[:4], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[4:], 0.0)
    # One block column per loop step: the sink rescales with the online softmax's max.
    chunked = ragged_paged_attention_xla(
        jnp.asarray(q), cache.kv, jnp.asarray(kv_lens), jnp.asarray(tables),
        jnp.asarray([0, 3, 4]), 2, num_kv_heads=kv_heads, layer=0, sliding_window=3,
        sinks=jnp.asarray(sinks), chunk_bytes=1,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(chunked)[:4], want[:4], atol=1e-5)
    # The decode op and its oracle agree with the ragged one on the decode row.
    dec = kp.paged_attention(
        jnp.asarray(q[3:4]), cache, jnp.asarray([5]), jnp.asarray(tables[1:]), layer=0,
        sliding_window=3, sinks=jnp.asarray(sinks), impl=impl, interpret=interpret,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(dec)[0], want[3], atol=1e-5)
    # A decode-only ragged batch (the decode kernel's ragged entry) and a batch whose decode
    # leads (decode kernel + ragged kernel split), against the same oracle.
    lead = kp.ragged_paged_attention(
        jnp.asarray(q[[3, 0, 1, 2]]), cache, jnp.asarray(kv_lens[::-1]),
        jnp.asarray(tables[::-1]), jnp.asarray([0, 1, 4]), 2, layer=0, sliding_window=3,
        sinks=jnp.asarray(sinks), impl=impl, interpret=interpret,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(lead), want[[3, 0, 1, 2]], atol=1e-5)


@pytest.mark.parametrize("impl", ["pallas_gpu"])
def test_a_forced_gpu_kernel_refuses_sinks_and_leaves_the_cache_as_it_was(impl: str) -> None:
    cache = kp.init_kv_cache(1, 4, 4, 1, 8, jnp.float32)
    k = jnp.ones((2, 1, 8))
    with pytest.raises(ValueError, match="attention sinks"):
        kp.ragged_paged_attention(
            jnp.ones((2, 2, 8)), cache, jnp.asarray([2]), jnp.asarray([[0]]),
            jnp.asarray([0, 2]), 1, layer=0, new_kv=(k, k, jnp.asarray([0, 1])),
            sinks=jnp.zeros(2), impl=impl, interpret=True,
        )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(kp.read_kv(cache, jnp.arange(4), layer=0)[0]), 0)


def test_auto_dispatch_runs_sinks_on_the_tpu_kernels_and_names_the_gpu_fallback(caplog) -> None:
    cache = kp.init_kv_cache(1, 4, 4, 1, 8, jnp.float32)
    with caplog.at_level(logging.WARNING):
        kp.ragged_paged_attention(
            jnp.ones((2, 2, 8)), cache, jnp.asarray([2]), jnp.asarray([[0]]),
            jnp.asarray([0, 2]), 1, layer=0, sinks=jnp.zeros(2),
        )  # fmt: skip
    assert kp.kernel_info("tpu")["ragged_paged_attention"] == "pallas_tpu"
    info = kp.kernel_info("cuda")["ragged_paged_attention"]
    assert info.startswith("xla (fallback: attention sinks"), info
    with pytest.raises(ValueError, match=r"sinks must have shape \(2,\)"):
        kp.ragged_paged_attention(
            jnp.ones((2, 2, 8)), cache, jnp.asarray([2]), jnp.asarray([[0]]),
            jnp.asarray([0, 2]), 1, layer=0, sinks=jnp.zeros(3),
        )  # fmt: skip


# -- MXFP4 -----------------------------------------------------------------------------------


def test_mxfp4_dequant_equals_transformers_and_the_spec_on_every_code() -> None:
    blocks, scales = HF["mxfp4_blocks"], HF["mxfp4_scales"]
    got = dequantize_mxfp4(blocks, scales)
    # transformers' convert_moe_packed_tensors returns [X, in, out]: transposed after dequant
    np.testing.assert_array_equal(np.swapaxes(got, 1, 2), HF["mxfp4_hf_dequant"])
    every = np.arange(256, dtype=np.uint8).reshape(1, 16, 16)  # each byte, scales 2^-3..2^12
    sc = np.arange(124, 140, dtype=np.uint8).reshape(1, 16)
    np.testing.assert_array_equal(dequantize_mxfp4(every, sc), dequant_np(every, sc))
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :1])


def test_mxfp4_declared_without_packed_experts_and_other_methods_are_refused(
    tmp_path: Path,
) -> None:
    cfg = gpt_oss_config()
    tensors = random_gpt_oss_tensors(cfg, 3, "float")
    path = write_checkpoint(
        tmp_path / "a", dict(cfg, quantization_config={"quant_method": "mxfp4"}), tensors
    )
    with pytest.raises(CheckpointError, match="declares mxfp4"):
        load_model(path)
    path = write_checkpoint(
        tmp_path / "b", dict(cfg, quantization_config={"quant_method": "awq"}), tensors
    )
    with pytest.raises(CheckpointError, match="awq"):
        load_model(path)


# -- config ------------------------------------------------------------------------------------


def test_the_gpt_oss_20b_config_builds_a_model_of_the_published_size() -> None:
    from paxcache.compile_check import abstract_model, load_hf_config

    cfg = load_hf_config(FIXTURES / "gpt_oss_20b_config.json")  # hub keys: rope_scaling
    assert isinstance(cfg, GptOssConfig)
    assert cfg.layer_windows()[:3] == (128, None, 128) and cfg.rope_theta == 150000.0
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.num_experts == 32
    model = abstract_model(cfg, jnp.bfloat16)
    assert abs(cfg.num_params() / 1e9 - 20.9) < 0.05
    assert model.layers.sinks.shape == (24, 64)
    assert LlamaConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_save_pretrained_round_trips_a_gpt_oss_model(tmp_path: Path) -> None:
    path, _ = _checkpoint(tmp_path, "float")
    model = load_model(path)
    save_pretrained(model, tmp_path / "again")
    again = load_model(tmp_path / "again")
    assert again.config == model.config
    ids = jnp.asarray([IDS])
    # jitted: one compile for both (same structure), not one per eager op
    np.testing.assert_array_equal(np.asarray(forward(model, ids)), np.asarray(forward(again, ids)))


@pytest.mark.slow
def test_tp2_ep2_loads_mxfp4_into_shards_and_gives_transformers_tokens(tmp_path: Path) -> None:
    report = run_worker(Path(__file__).with_name("_gpt_oss_worker.py"), tmp_path / "r.json")
    assert report["max_logit_diff"] < 1e-4
    assert report["expert_down_shard"] == [3, 2, 16, 32]  # [L, X / ep, Fm / tp, E]
    assert report["tokens"] == [int(t) for t in HF["mxfp4_generate"]]


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_and_attention_factor_follow_hf(truncate: bool) -> None:
    from hf_gpt_oss_reference import yarn_np

    from paxcache.models.llama_config import rope_attention_scaling, rope_inv_freq

    rope = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
    hf = gpt_oss_config(head_dim=64, rope_parameters=None, rope_theta=150000.0)
    hf["rope_scaling"] = dict(rope, truncate=truncate, beta_fast=32.0, beta_slow=1.0)
    cfg = LlamaConfig.from_hf_dict(hf)
    inv, att = yarn_np(hf)
    np.testing.assert_allclose(np.asarray(rope_inv_freq(cfg)), inv, rtol=1e-6)
    assert rope_attention_scaling(cfg) == pytest.approx(att) == pytest.approx(1 + 0.1 * np.log(32))


def test_compile_check_reports_the_sinks_fallback_as_a_note_and_other_fallbacks_as_failures() -> (
    None
):
    from paxcache.compile_check import _sinks_fallback_as_note

    sinks = "step[T=16]: ragged_paged_attention runs xla (fallback: attention sinks: no kernel)"
    other = "step[T=16]: write_kv runs xla (fallback: Mosaic compile error)"
    report = {"failures": [sinks, other], "notes": []}
    _sinks_fallback_as_note(report)
    assert report["failures"] == [other]
    assert len(report["notes"]) == 1 and "attention sinks" in report["notes"][0]
