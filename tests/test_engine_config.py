"""EngineConfig: the engine's options in four parts, validated where they are made; the flat
keyword form and the config form build the same engine; a bad option fails before any work."""

from __future__ import annotations

import dataclasses
import gc

import chex
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import byte_llama

from paxcache import Engine, SamplingParams
from paxcache.engine_config import (
    EngineConfig,
    KernelConfig,
    KVCacheConfig,
    ParallelConfig,
    SchedulerConfig,
)
from paxcache.models import ByteTokenizer

OPTIONS = dict(
    num_blocks=48,
    block_size=8,
    max_num_seqs=3,
    max_num_batched_tokens=16,
    enable_prefix_caching=False,
    preemption_mode="recompute",
    seed=7,
    compile_cache=False,
    warmup=False,
    decode_steps=2,
    async_scheduling=False,
)


@pytest.fixture(scope="module")
def model():
    return byte_llama()


def test_keywords_and_config_build_the_same_engine_with_the_same_outputs(model):
    by_kwargs = Engine(model, ByteTokenizer(), **OPTIONS)
    config = EngineConfig(
        cache=KVCacheConfig(num_blocks=48, block_size=8, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=3, max_num_batched_tokens=16, decode_steps=2, async_scheduling=False
        ),
        seed=7,
        compile_cache=False,
        warmup=False,
    )
    by_config = Engine(model, ByteTokenizer(), config)
    assert by_kwargs.config == by_config.config
    assert by_config.config.scheduler.max_model_len == model.config.max_position_embeddings
    sized = Engine(model, ByteTokenizer(), **{**OPTIONS, "num_blocks": None})
    assert sized.config.cache.num_blocks == sized.cache_config.num_blocks  # as sized
    assert (by_config.max_num_seqs, by_config.decode_steps) == (3, 2)
    params = SamplingParams(max_tokens=5, temperature=0.8, ignore_eos=True)  # seeded by the engine
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    got = [
        [o.outputs[0].token_ids for o in e.generate(prompts, params)]
        for e in (by_kwargs, by_config)
    ]
    assert got[0] == got[1]


@pytest.mark.parametrize("freeze", [False, True])
def test_warmup_freezes_the_gc_heap_only_when_asked(model, freeze):
    """``freeze_gc`` (default on): warm-up ends by moving what is alive to the permanent GC
    generation (a full collection while serving skips it); off, nothing is moved there (the
    count may still fall: objects an earlier test's warm-up froze can die meanwhile)."""
    eng = Engine(model, ByteTokenizer(), **{**OPTIONS, "freeze_gc": freeze})
    assert EngineConfig().freeze_gc
    before = gc.get_freeze_count()
    eng.warmup()
    after = gc.get_freeze_count()
    assert after > before if freeze else after <= before
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(eng.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 3


def test_defaults_are_resolved_for_the_backend():
    resolved = EngineConfig().resolve("cpu", model_max_len=512)
    s = resolved.scheduler
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.decode_steps) == (64, 256, 1)
    assert s.max_model_len == 512
    tpu = EngineConfig().resolve("tpu", model_max_len=512).scheduler
    assert (tpu.max_num_seqs, tpu.max_num_batched_tokens, tpu.decode_steps) == (256, 2048, 8)
    with pytest.raises(ValueError, match="max_model_len 600 exceeds"):
        EngineConfig.from_kwargs(max_model_len=600).resolve("cpu", model_max_len=512)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(block_size=0), ValueError, "block_size must be a positive int"),
        (dict(tp=True), ValueError, "tp must be a positive int"),
        (dict(num_blocks=-3), ValueError, "num_blocks must be a positive int"),
        (dict(num_host_blocks=-1), ValueError, "num_host_blocks must be an int >= 0"),
        (dict(preemption_mode="drop"), ValueError, "preemption_mode must be"),
        (dict(preemption_mode="swap"), ValueError, "needs num_host_blocks > 0"),
        (dict(policy="lifo"), ValueError, "policy must be"),
        (dict(watermark=1.0), ValueError, "watermark must be"),
        (dict(kv_cache_dtype="int4"), ValueError, "kv_cache_dtype must be one of"),
        (dict(async_scheduling=1), ValueError, "async_scheduling must be a bool"),
        (dict(decode_steps=0), ValueError, "decode_steps must be a positive int"),
        (dict(compile_cache=3), ValueError, "compile_cache must be"),
        (dict(freeze_gc="yes"), ValueError, "freeze_gc must be a bool"),
        (dict(max_num_sequences=4), TypeError, "unknown engine option 'max_num_sequences'"),
    ],
)
def test_a_bad_option_is_refused_naming_it(kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_from_pretrained_refuses_a_bad_option_before_loading_anything(tmp_path):
    missing = tmp_path / "no-such-model"  # loading it would raise another error
    with pytest.raises(ValueError, match="preemption_mode must be"):
        Engine.from_pretrained(str(missing), preemption_mode="drop")
    with pytest.raises(TypeError, match="unknown engine option 'blocks'"):
        Engine.from_pretrained(str(missing), blocks=4)


def test_config_and_keywords_together_are_refused(model):
    with pytest.raises(TypeError, match="either config or keyword options"):
        Engine(model, ByteTokenizer(), EngineConfig(), num_blocks=8)
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        Engine(model, ByteTokenizer(), {"num_blocks": 8})


_option_values = st.fixed_dictionaries(
    {},
    optional={
        "num_blocks": st.integers(1, 4096),
        "block_size": st.sampled_from([8, 16, 32]),
        "num_host_blocks": st.integers(0, 64),
        "max_num_seqs": st.integers(1, 512),
        "max_num_batched_tokens": st.integers(1, 8192),
        "policy": st.sampled_from(["fifo", "prefill_first"]),
        "decode_steps": st.integers(1, 16),
        "async_scheduling": st.booleans(),
        "impl": st.sampled_from(["auto", "reference", "xla"]),
        "tp": st.integers(1, 8),
        "ep": st.integers(1, 8),
        "seed": st.integers(0, 2**62),
        "model_name": st.text(min_size=1, max_size=8),
        "freeze_gc": st.booleans(),
    },
)


@settings(max_examples=40, deadline=None)
@given(options=_option_values)
def test_flat_options_round_trip_through_the_config(options):
    config = EngineConfig.from_kwargs(**options)
    flat = config.to_kwargs()
    for key, value in options.items():
        assert flat[key] == value, key
    assert EngineConfig.from_kwargs(**flat) == config
    parts = (config.cache, config.scheduler, config.kernel, config.parallel)
    kinds = (KVCacheConfig, SchedulerConfig, KernelConfig, ParallelConfig)
    assert all(isinstance(p, k) for p, k in zip(parts, kinds, strict=True))
    chex.assert_equal(config.parallel.num_devices, config.parallel.tp * config.parallel.ep)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 1  # type: ignore[misc]
