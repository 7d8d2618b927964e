"""The continuous-batching engine: same tokens as the dense model, under memory pressure
(swap and recompute), with and without prefix caching; n > 1 by fork; seeds; stops; no leaks
and no recompilation after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import byte_llama

from paxcache import Engine, SamplingParams
from paxcache.models import ByteTokenizer, greedy_generate
from paxcache.placement import Placement

BS = 8


@pytest.fixture(scope="module")
def model():
    return byte_llama()


def _engine(model, tokenizer=None, **kw):
    # No implicit warm-up: a test compiles only the programs it runs (warm-up's own contract
    # is the ``engine`` fixture's, which warms up, and test_dispatch's).
    args = dict(
        num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=32, warmup=False
    )
    args.update(kw)
    return Engine(model, tokenizer or ByteTokenizer(), **args)


class _RecordingTokenizer(ByteTokenizer):
    """A ByteTokenizer that records when its byte decoder is built (an HF tokenizer builds
    its id -> bytes table there)."""

    def __init__(self) -> None:
        super().__init__()
        self.byte_decoders_built: list[bool] = []

    def byte_decoder(self, skip_special_tokens: bool = True):
        self.byte_decoders_built.append(skip_special_tokens)
        return super().byte_decoder(skip_special_tokens)


def _prompts(seed=0, lens=(3, 40, 20, 2, 57, 9)):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, 256, n))) for n in lens]


@pytest.fixture(scope="module")
def dense_ref(model):
    """Dense greedy generations (no cache) of the default prompts: the ground truth."""
    return [greedy_generate(model, p, 10) for p in _prompts()]


GREEDY10 = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model):
    eng = _engine(model, _RecordingTokenizer())
    eng.warmup()
    eng.tokenizer.built_by_warmup = list(eng.tokenizer.byte_decoders_built)
    return eng


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_mixed_batch_equals_dense_model(engine, dense_ref):
    # Prompts of 40 and 57 tokens exceed the 32-token step budget: chunked prefill.
    outs = engine.generate(_prompts(), GREEDY10)
    assert _tokens(outs) == dense_ref
    assert [o.prompt_token_ids for o in outs] == _prompts()
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_warm_engine_never_recompiles_and_frees_everything(engine, dense_ref):
    # Warm-up also built the detokenizer's byte table (default skip_special_tokens=True).
    assert engine.tokenizer.built_by_warmup == [True]
    before = engine.stats()["num_compilations"]
    outs = engine.generate(_prompts(), GREEDY10)
    assert _tokens(outs) == dense_ref
    st = engine.stats()
    assert st["num_compilations"] == before
    assert st["num_free_blocks"] == st["num_total_blocks"]
    assert st["num_running"] == st["num_waiting"] == 0


def test_engines_of_one_model_structure_share_step_programs(engine, dense_ref):
    """A second engine of the same model structure and cache shape (another instance, other
    weights, another scheduling policy) traces no step program the first traced, and its
    tokens are its own weights'; a different structure gets a step of its own."""
    twin = byte_llama(seed=1)  # same structure (equal graphdef), other weights
    prompts = _prompts()[:3]
    twin_ref = [greedy_generate(twin, p, 10) for p in prompts]
    assert twin_ref != dense_ref[:3]
    second = _engine(twin, policy="prefill_first")
    second.warmup()
    assert second._jit_step is engine._jit_step
    assert second.stats()["num_traces"] == 0
    assert _tokens(second.generate(prompts, GREEDY10)) == twin_ref
    assert _tokens(engine.generate(prompts, GREEDY10)) == dense_ref[:3]
    assert second.stats()["num_traces"] == 0
    wider = _engine(byte_llama(hidden_size=96, intermediate_size=96), warmup=False)
    assert wider._jit_step is not engine._jit_step


# Swap preemption's outputs under pressure are also checked against an unconstrained run by
# tests/test_stress.py's swap profiles: the swap case here is in the slow set.
@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_preemption_under_memory_pressure_keeps_outputs(model, dense_ref, mode):
    # 12 blocks of 8 tokens for up to 4 sequences of up to 67 tokens: must preempt.
    eng = _engine(
        model,
        num_blocks=12,
        watermark=0.0,
        preemption_mode=mode,
        num_host_blocks=24 if mode == "swap" else 0,
    )
    outs = eng.generate(_prompts(), GREEDY10)
    assert _tokens(outs) == dense_ref
    st = eng.stats()
    assert st["num_preemptions"] > 0
    if mode == "swap":
        assert st["num_swaps"] > 0
        assert st["num_free_host_blocks"] == st["num_total_host_blocks"]
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_prefix_caching_same_outputs_and_high_hit_rate(model, engine):
    # Six prompts sharing 48 tokens (3 blocks) on the warm module engine (prefix caching on):
    # the tokens equal the dense model's, and most of the prompts' full blocks are hits.
    rng = np.random.default_rng(7)
    shared = list(map(int, rng.integers(0, 256, 48)))
    prompts = [shared + list(map(int, rng.integers(0, 256, 5))) for _ in range(6)]
    before = engine.stats()
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert _tokens(outs) == [greedy_generate(model, p, 4) for p in prompts]
    after = engine.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert queries > 0 and hits / queries > 0.5, (hits, queries)


def test_n4_forks_the_prompt_and_uses_fewer_blocks(engine):
    prompt = list(range(30, 70))  # 5 blocks of prompt
    sp = SamplingParams(max_tokens=6, n=4, temperature=1.0, seed=3, ignore_eos=True)
    peak = []
    engine.add_request("n4", prompt, sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                res = out
        peak.append(engine.stats()["num_total_blocks"] - engine.stats()["num_free_blocks"])
    assert len(res.outputs) == 4
    assert all(len(c.token_ids) == 6 for c in res.outputs)
    # Four separate requests would hold 4 * 6 blocks at the end; forks share the prompt's
    # 5 blocks (the partial last one is copied on write by each child).
    assert max(peak) < 4 * 6
    # Same seed, same completions; the four completions differ from each other.
    again = engine.generate([prompt], sp)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in res.outputs]
    assert len({tuple(c.token_ids) for c in res.outputs}) > 1


def test_seeded_sampling_is_independent_of_the_batch(engine):
    sp = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    alone = engine.generate([[1, 2, 3, 4]], sp)[0].outputs[0].token_ids
    crowd = engine.generate(
        [[9, 9], [1, 2, 3, 4], list(range(50))],
        [SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True), sp, GREEDY10],
    )
    assert crowd[1].outputs[0].token_ids == alone


def test_stop_token_and_stop_string_end_generation(engine, dense_ref):
    prompt = _prompts()[1]
    ref = dense_ref[1]
    stop_tok = ref[4]
    out = engine.generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=[stop_tok]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop"
    assert c.token_ids == ref[: ref.index(stop_tok) + 1]
    text = ByteTokenizer().decode(ref)
    stop_str = text[3:5]
    out = engine.generate([prompt], SamplingParams(max_tokens=10, stop=[stop_str]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop"
    assert c.text == text[: text.index(stop_str)]
    assert stop_str not in c.text


def test_abort_frees_blocks_at_once(engine):
    engine.add_request("a", list(range(60)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats()["num_free_blocks"] < engine.stats()["num_total_blocks"]
    engine.abort("a")
    st = engine.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]
    assert not engine.has_unfinished_requests()
    outs = engine.step()
    assert outs and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"


def test_streaming_step_outputs_are_incremental(engine, dense_ref):
    prompt = _prompts()[0]
    pieces, last = [], None
    for out in engine.stream(prompt, GREEDY10):
        pieces.extend(out.outputs[0].new_token_ids)
        last = out
    assert pieces == dense_ref[0] == last.outputs[0].token_ids


def test_request_that_can_never_fit_gets_a_clear_error(model, caplog):
    from paxcache.errors import SequenceTooLongError

    with caplog.at_level("WARNING", logger="paxcache.engine"):
        eng = _engine(model, num_blocks=4, watermark=0.0)
    assert "holds 32 tokens, less than max_model_len 256" in caplog.text
    with pytest.raises(SequenceTooLongError, match="blocks"):
        eng.add_request("big", list(range(40)), GREEDY10)
    with pytest.raises(SequenceTooLongError, match="max_model_len"):
        eng.add_request("huge", [1] * 300, GREEDY10)
    # Fits at admission but grows past the whole cache: finishes with an error, no hang.
    out = eng.generate([list(range(30))], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "error"
    assert "KV cache" in out.error
    assert eng.stats()["num_free_blocks"] == 4


def test_preempted_sequence_that_outgrew_admission_fails_instead_of_hanging(model):
    # 8 blocks of 8, watermark 2 blocks: a prompt may take at most 6 blocks at admission. B
    # (40-token prompt) grows to 7 blocks while A runs, is preempted by recompute, and could
    # then only come back with 7 blocks: it must end with an error, A must finish normally.
    eng = _engine(model, num_blocks=8, watermark=0.25, max_num_batched_tokens=64)
    a, b = eng.generate(
        [[1, 2], list(range(40))],
        [
            SamplingParams(max_tokens=20, ignore_eos=True),
            SamplingParams(max_tokens=30, ignore_eos=True),
        ],
    )
    assert a.outputs[0].finish_reason == "length" and len(a.outputs[0].token_ids) == 20
    assert b.outputs[0].finish_reason == "error"
    assert "can never be admitted" in b.error
    st = eng.stats()
    assert st["num_preemptions"] >= 1
    assert st["num_free_blocks"] == st["num_total_blocks"]


def test_engine_impl_reaches_every_kernel_of_the_step(model):
    """``impl`` is the engine's decision for every op of its step: the model's own attention
    layer (through the metadata), its KV writes, and the copy-on-write block copies. With
    ``impl="pallas"`` (interpret mode on CPU) none of them may run its own default."""
    from kernels_pallas import _dispatch

    eng = _engine(model, block_size=16, impl="pallas", interpret=True, warmup=False)
    with _dispatch.recording() as seen:
        eng._jit_step.lower(*eng._empty_step_args(eng.buckets[0]))
    ops = ("ragged_paged_attention", "write_kv", "copy_blocks")
    assert {op: seen["cpu"].get(op) for op in ops} == dict.fromkeys(ops, "pallas_tpu")


class _FakeAccelerator(Placement):
    """The live (CPU) devices as an accelerator with fake memory figures: the engine sizes
    its cache as it does on one."""

    STATS = {"bytes_limit": 64 << 20, "bytes_in_use": 16 << 20}

    def on_accelerator(self) -> bool:
        return True

    def memory_stats(self) -> dict[str, int]:
        return dict(self.STATS)


def _sized_on(model, placement):
    """An engine whose KV cache is sized by ``placement`` (no ``num_blocks``)."""
    limits = dict(block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, warmup=False)
    return Engine(model, ByteTokenizer(), placement=placement, **limits)


def test_accelerator_sizing_reserves_the_largest_steps_buffers(model, dense_ref):
    """On an accelerator the cache gets 0.9 of the free memory less what the largest step
    needs besides its arguments (measured by compiling it over a small cache), so the step
    and the cache fit together; the engine then serves normally."""
    from paxcache import kv_cache

    eng = _sized_on(model, _FakeAccelerator())
    reserve = eng.step_reserve_bytes
    assert reserve > 0
    free = _FakeAccelerator.STATS["bytes_limit"] - _FakeAccelerator.STATS["bytes_in_use"]
    per_block = eng.bytes_per_block
    assert eng.cache_config.num_blocks == (int(0.9 * free) - reserve) // per_block
    assert eng._kv.num_blocks == eng.cache_config.num_blocks
    # Without the reserve it would have been more blocks: the reserve is really taken off.
    plain, _ = kv_cache.num_blocks_for_budget(
        0.9, 2, 2, 16, BS, model.dtype, memory_stats=_FakeAccelerator.STATS
    )
    assert eng.cache_config.num_blocks < plain
    outs = eng.generate(_prompts()[:2], GREEDY10)
    assert _tokens(outs) == dense_ref[:2]


def test_accelerator_sizing_counts_step_temporaries_that_grow_with_the_cache(model, monkeypatch):
    """A step whose temporaries grow with the cache (XLA:TPU copies a head_dim-64 cache into
    the kernels' layout, 2x its size, a copy a small probe hardly shows) is probed again over
    the cache the first probe sized: the growth per block is counted with each block, so the
    cache and the step fit together."""
    from paxcache import sizing
    from paxcache.engine import PROBE_BLOCKS

    fixed, growth = 1 << 20, 3000
    probed = []

    def reserve_of(jitted, args):  # fixed + growth per block of the program's cache
        probed.append(args[1].num_blocks)
        return fixed + growth * probed[-1]

    monkeypatch.setattr(sizing, "probe_reserve", reserve_of)
    eng = _sized_on(model, _FakeAccelerator())
    free = _FakeAccelerator.STATS["bytes_limit"] - _FakeAccelerator.STATS["bytes_in_use"]
    reserve = fixed + growth * PROBE_BLOCKS
    first = (int(0.9 * free) - reserve) // eng.bytes_per_block
    assert probed == [PROBE_BLOCKS, first]
    assert (eng.step_reserve_bytes, eng.step_reserve_bytes_per_block) == (reserve, growth)
    n = eng.cache_config.num_blocks
    assert n == (int(0.9 * free) - reserve) // (eng.bytes_per_block + growth) < first
    assert n * eng.bytes_per_block + fixed + growth * n <= int(0.9 * free)  # both fit


def test_accelerator_sizing_probes_a_smaller_cache_when_the_grown_step_does_not_fit(
    model, monkeypatch
):
    """When the step over the first size is refused for memory (its temporaries, 2x the
    cache, do not fit beside the cache: gpt-oss-20b on v6e:2x2), the second probe halves its
    cache until the step compiles, measures the growth there, and the engine sizes with it:
    start-up does not fail, and the cache and the step fit together."""
    import jax

    from paxcache import kv_cache, sizing
    from paxcache.engine import PROBE_BLOCKS

    per_block = kv_cache.bytes_per_block(2, 2, 16, BS, model.dtype)
    fixed, growth = 1 << 20, 2 * per_block
    stats = _FakeAccelerator.STATS
    limit = int(0.9 * (stats["bytes_limit"] - stats["bytes_in_use"]))
    probed = []

    def reserve_of(jitted, args):  # the compiler refuses a program that does not fit
        blocks = args[1].num_blocks
        probed.append(blocks)
        if blocks * per_block + fixed + growth * blocks > limit:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
        return fixed + growth * blocks

    monkeypatch.setattr(sizing, "probe_reserve", reserve_of)
    eng = _sized_on(model, _FakeAccelerator())
    reserve = fixed + growth * PROBE_BLOCKS
    first = (limit - reserve) // per_block
    n = eng.cache_config.num_blocks
    # the final size is past the largest one probed that compiled, so it is compiled too
    assert probed == [PROBE_BLOCKS, first, first // 2, first // 4, n]
    assert eng.step_reserve_bytes_per_block == growth
    assert n == (limit - reserve) // (per_block + growth)
    assert n * per_block + fixed + growth * n <= limit  # the engine's own step fits


def test_accelerator_sizing_settles_on_a_cache_the_step_compiles_over(model, monkeypatch):
    """Temporaries that jump with the cache size (XLA:TPU lays Qwen3-30B-A3B's multi-step
    loop out otherwise over 2769 blocks than over 1391: 17.19G against 6.0 GiB) defeat the
    linear figures: the sized cache is compiled over, bisected down a few times, and at
    worst the engine keeps the largest cache the step compiled over. Start-up never fails
    on it."""
    import jax

    from paxcache import kv_cache, sizing
    from paxcache.engine import PROBE_BLOCKS, SIZING_CHECKS

    stats = _FakeAccelerator.STATS
    limit = int(0.9 * (stats["bytes_limit"] - stats["bytes_in_use"]))
    first = (limit - (1 << 20)) // kv_cache.bytes_per_block(2, 2, 16, BS, model.dtype)
    jump = int(0.45 * first)  # the compiler refuses any cache over this many blocks
    probed = []

    def reserve_of(jitted, args):
        blocks = args[1].num_blocks
        probed.append(blocks)
        if blocks > jump:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
        return 1 << 20

    monkeypatch.setattr(sizing, "probe_reserve", reserve_of)
    eng = _sized_on(model, _FakeAccelerator())
    n = eng.cache_config.num_blocks
    quarter = first // 4
    # 64; the halving down to a size that compiles; the sized cache (first again, as nothing
    # grows) refused, then bisected towards the quarter until a size compiles
    assert probed[:4] == [PROBE_BLOCKS, first, first // 2, quarter]
    checks = probed[4:]
    assert checks[0] == first and 1 <= len(checks) <= SIZING_CHECKS
    assert all(b == (quarter + a) // 2 for a, b in zip(checks, checks[1:], strict=False))
    assert n == checks[-1] <= jump and n > quarter  # a bisected size that compiles
    assert eng._kv.num_blocks == n


def test_accelerator_sizing_reserves_for_the_multi_step_loop_when_it_needs_more(model, monkeypatch):
    """With ``decode_steps > 1`` the multi-step decode loop is probed beside the largest step
    (on TPU its temporaries can be far larger: XLA:TPU copies Qwen3-30B-A3B's expert weights
    into the loop, 23.18G on v5e:2x4): the cache is sized for whichever program needs more."""
    from paxcache import kv_cache, sizing
    from paxcache.engine import PROBE_BLOCKS

    per_block = kv_cache.bytes_per_block(2, 2, 16, BS, model.dtype)
    reserves = [1 << 20, 4 << 20]  # the step's, the loop's
    probed = []

    def reserve_of(jitted, args):
        probed.append(int(args[3].structure().decode_loop is not None))  # 1: the multi-step loop
        return reserves[probed[-1]]

    monkeypatch.setattr(sizing, "probe_reserve", reserve_of)
    limits = dict(block_size=BS, max_num_seqs=4, max_num_batched_tokens=16, warmup=False)
    eng = Engine(model, ByteTokenizer(), placement=_FakeAccelerator(), decode_steps=4, **limits)
    stats = _FakeAccelerator.STATS
    limit = int(0.9 * (stats["bytes_limit"] - stats["bytes_in_use"]))
    assert probed == [0, 1, 0, 1]  # both over PROBE_BLOCKS, then both over the first size
    assert eng.step_reserve_program == "step+loop4[T=16]" and PROBE_BLOCKS == 64
    assert eng.step_reserve_bytes == reserves[1] and eng.step_reserve_bytes_per_block == 0
    assert eng.cache_config.num_blocks == (limit - reserves[1]) // per_block


def test_accelerator_sizing_names_the_reserve_when_nothing_fits(model):
    class Tight(_FakeAccelerator):
        STATS = {"bytes_limit": 16 << 20, "bytes_in_use": (16 << 20) - 4096}

    with pytest.raises(ValueError, match="for the model step"):
        _sized_on(model, Tight())
