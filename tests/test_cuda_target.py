"""CUDA targets without a GPU (``kernels_pallas.aot.cuda_target``): the kernel choice per GPU
generation, the engine's whole step exported for each, the SM count the GPU work planning
fills, and the warm-up compile probe's fallback when a GPU kernel fails to build.

Hopper (9.x) runs decode (``paged_attention``) on the Mosaic GPU kernel and the ragged op on the
Pallas Triton kernel (``_dispatch.MOSAIC_GPU_RAGGED_REASON``), every other capability from 8.0
(8.0, 8.9, 10.0) the Triton kernel for both, and below 8.0 the XLA path, said by
``kernel_info("cuda")`` and one warning per op. The engine's step holds the ragged op only, so
it exports with the Triton call on every capability from 8.0 (``compile_check.export_step``).
Several targets follow each other in one process, in both orders, with nothing cached across
them. Exports that may hold the Triton kernel pass ``compat.TRITON_EXPORT_CHECKS`` (Triton IR
has no serialization guarantee).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels_pallas as kp
from kernels_pallas import _dispatch, aot, compat
from kernels_pallas.gpu import attention as ga
from kernels_pallas.gpu import triton_attention as ta
from kernels_pallas.gpu import work
from paxcache import Engine, compile_check
from paxcache.models import ByteTokenizer, LlamaConfig, LlamaForCausalLM

MOSAIC_GPU = "custom_call @mosaic_gpu"
TRITON = compat.TRITON_CALL_TARGET
CAPABILITIES = ("9.0", "8.0", "8.9", "10.0", "7.5", "9.0")  # Hopper again after the others
# The kernel family each capability gets per op for a mainstream geometry (bf16, G = 4,
# D = 128): on Hopper decode runs Mosaic GPU and the ragged op Triton (the Mosaic GPU ragged
# kernel failed its oracle on an H200).
RAGGED = {"9.0": "pallas_triton", "8.0": "pallas_triton", "8.9": "pallas_triton",
          "10.0": "pallas_triton", "7.5": "xla"}  # fmt: skip
FAMILY = {"ragged_paged_attention": RAGGED, "paged_attention": {**RAGGED, "9.0": "pallas_gpu"}}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_dispatch, "_WARNED", set())


def _ragged(m: int = 4, t: int = 24):
    sds = jax.ShapeDtypeStruct
    args = (
        sds((t, 8, 128), jnp.bfloat16), kp.kv_cache_shape(2, 16, 16, 2, 128, jnp.bfloat16),
        sds((3,), jnp.int32), sds((3, m), jnp.int32), sds((4,), jnp.int32), sds((), jnp.int32),
    )  # fmt: skip
    fn = functools.partial(kp.ragged_paged_attention, impl="auto", layer=np.int32(1))
    return jax.jit(fn), args


def _decode(b: int = 3):
    sds = jax.ShapeDtypeStruct
    args = (
        sds((b, 8, 128), jnp.bfloat16), kp.kv_cache_shape(2, 16, 16, 2, 128, jnp.bfloat16),
        sds((b,), jnp.int32), sds((b, 4), jnp.int32),
    )  # fmt: skip
    return jax.jit(functools.partial(kp.paged_attention, impl="auto", layer=np.int32(1))), args


def _export(fn, args) -> str:
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=TRITON_CHECKS)
    return exported(*args).mlir_module()


TRITON_CHECKS = compat.TRITON_EXPORT_CHECKS


def test_each_capability_gets_its_kernel_several_targets_in_one_process():
    for capability in CAPABILITIES:
        with aot.cuda_target(capability) as device:
            assert device.compute_capability == capability
            ops = {"ragged_paged_attention": _ragged(), "paged_attention": _decode()}
            for op, (fn, args) in ops.items():
                family = FAMILY[op][capability]
                text = _export(fn, args)
                assert (MOSAIC_GPU in text) == (family == "pallas_gpu"), (capability, op)
                assert (TRITON in text) == (family == "pallas_triton"), (capability, op)
                impl = kp.kernel_info("cuda")[op]
                if family == "xla":
                    assert impl.startswith("xla (fallback: ") and f"capability {capability}" in impl
                else:
                    assert impl == family, (capability, op, impl)


def test_a_capability_without_a_kernel_says_so_in_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="kernels_pallas")
    fn, args = _ragged()
    with aot.cuda_target("7.5"):
        for _ in range(3):
            _export(fn, args)
    msgs = [r.getMessage() for r in caplog.records if "ragged_paged_attention" in r.getMessage()]
    assert len(msgs) == 1 and "compute capability 7.5" in msgs[0], msgs


@pytest.mark.parametrize("bad", ["9", "sm_90", "9.0a", ""])
def test_a_malformed_capability_is_refused(bad):
    with pytest.raises(ValueError, match="compute capability must look like"), aot.cuda_target(bad):
        pass
    assert _dispatch.cuda_capability() == _dispatch.HOPPER  # no target left behind


def test_the_work_planning_fills_the_target_generations_sms():
    assert work.num_sms() == work.NUM_SMS  # no GPU here, no target: the Hopper count
    with aot.cuda_target("8.0"):
        assert work.num_sms() == 108
        with aot.cuda_target("10.0"):
            assert work.num_sms() == 148
        assert work.num_sms() == 108
    with aot.cuda_target("12.1"):  # not in the table: the closest lower generation's count
        assert work.num_sms() == aot.CUDA_GENERATIONS["12.0"][1]


# --------------------------------------------------------------------------------------------
# The engine's whole step for a CUDA target
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_model():
    cfg = LlamaConfig(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        eos_token_id=257,
    )
    return LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def _engine(model, num_blocks: int = 32) -> Engine:
    return Engine(
        model, ByteTokenizer(), num_blocks=num_blocks, block_size=16, max_num_seqs=4,
        max_num_batched_tokens=16, warmup=False,
    )  # fmt: skip


def test_the_engine_step_exports_for_every_generation_with_its_kernel(bf16_model):
    """``compile_check.export_step`` (the public export, the Triton call allowed): the step's
    ragged attention is the Triton kernel on every generation from 8.0, Hopper included."""
    engine = _engine(bf16_model)
    for capability in ("8.0", "8.9", "9.0", "10.0"):
        with aot.cuda_target(capability):
            text = compile_check.export_step(engine).mlir_module()
            info = kp.kernel_info("cuda")
        assert MOSAIC_GPU not in text and TRITON in text, capability
        assert info["ragged_paged_attention"] == RAGGED[capability] == "pallas_triton", info
        assert info["write_kv"] == info["copy_blocks"] == "xla"  # XLA's scatter on every GPU


def test_export_step_refuses_a_token_count_that_is_not_a_bucket(bf16_model):
    with pytest.raises(ValueError, match="not one of the engine's buckets"):
        compile_check.export_step(_engine(bf16_model), 24)


def test_a_gpu_kernel_that_fails_to_build_falls_back_to_xla_in_the_probe(monkeypatch, caplog):
    """The compile probe (``compile_probes``, as ``Engine.warmup`` runs the step) on the CUDA
    path: the Mosaic GPU kernel (decode on Hopper) raising in its lowering makes that op run
    the XLA path with one warning; the program still builds."""

    def broken(*args, **kwargs):
        raise RuntimeError("Mosaic GPU lowering failed: injected by the test")

    monkeypatch.setattr(ga, "_run_kernel", broken)
    monkeypatch.setattr(_dispatch, "_PROBED", {})
    caplog.set_level(logging.WARNING, logger="kernels_pallas")
    fn, args = _decode(b=5)  # shapes no other test traced (jit caches the kernel)
    with aot.cuda_target("9.0"), kp.compile_probes():
        text = _export(fn, args)
        info = kp.kernel_info("cuda")["paged_attention"]
    assert MOSAIC_GPU not in text
    assert info.startswith("xla (fallback: Mosaic GPU compile error: RuntimeError: Mosaic GPU")
    msgs = [r.getMessage() for r in caplog.records if "failed to compile" in r.getMessage()]
    assert len(msgs) == 1 and "paged_attention" in msgs[0], msgs


def test_a_triton_kernel_that_fails_to_build_falls_back_to_xla_at_warmup(
    bf16_model, monkeypatch, caplog
):
    """The probe covers the Triton kernel too: its lowering raising on Hopper makes the ragged
    op run the XLA path, in the op and in the engine's exported step, with one warning
    however often it is traced."""

    def broken(*args, **kwargs):
        raise RuntimeError("Triton lowering failed: injected by the test")

    monkeypatch.setattr(ta, "_run_kernel", broken)
    monkeypatch.setattr(_dispatch, "_PROBED", {})
    caplog.set_level(logging.WARNING, logger="kernels_pallas")
    fn, args = _ragged(m=7, t=48)  # shapes no other test traced (jit caches the kernel)
    engine = _engine(bf16_model, num_blocks=48)  # built outside the target: it runs on CPU
    with aot.cuda_target("9.0"), kp.compile_probes():
        for _ in range(2):
            text = _export(fn, args)
        info = kp.kernel_info("cuda")["ragged_paged_attention"]
        step = compile_check.export_step(engine).mlir_module()
    assert TRITON not in text and TRITON not in step and MOSAIC_GPU not in step
    assert info.startswith("xla (fallback: Triton compile error: RuntimeError: Triton lowering")
    msgs = [r.getMessage() for r in caplog.records if "failed to compile" in r.getMessage()]
    assert len(msgs) == 1 and "ragged_paged_attention" in msgs[0], msgs


def test_an_abstract_llama3_8b_engine_exports_its_step_per_generation():
    """No weights, no GPU: the engine sized for an 80 GiB GPU (GPU defaults), its step exported
    with the Triton kernel on Hopper (the ragged op: no Mosaic GPU call), the multi-step
    decode loop too."""
    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    )  # fmt: skip
    engine = compile_check.AbstractEngine(
        compile_check.abstract_model(cfg, jnp.bfloat16), jax.devices("cpu"),
        hbm_bytes=80 << 30, target_backend="gpu", num_blocks=256, max_num_seqs=8,
        max_num_batched_tokens=64,
    )  # fmt: skip
    assert engine.decode_buckets == ()  # one program per bucket off the TPU kernels
    with aot.cuda_target("9.0"):  # Ampere: the small engine above
        text = engine.export_step(64).mlir_module()
    assert MOSAIC_GPU not in text and TRITON in text
    # The GPU default runs decode-only steps as 8-iteration multi-step decodes: the while
    # loop exports with the Hopper kernel inside it.
    assert engine.decode_steps == 8
    with aot.cuda_target("9.0"):
        loop = engine.export_step(16, loop=True).mlir_module()
    assert TRITON in loop and MOSAIC_GPU not in loop and "stablehlo.while" in loop


# --------------------------------------------------------------------------------------------
# The XLA path a GPU runs when no kernel does: large chunks, 16-bit operands
# --------------------------------------------------------------------------------------------


def test_the_gpu_tuned_xla_path_meets_the_oracle_with_bf16_operands():
    from test_attention_kernels import _check, _ragged_oracle, ragged_case

    from kernels_pallas import reference

    rng = np.random.default_rng(27)
    q_lens, kv_lens, num_seqs = [1, 13, 5, 2, 0], [29, 13, 22, 9, 4], 4
    t = sum(q_lens[:num_seqs]) + 2
    case = ragged_case(rng, q_lens, kv_lens, num_seqs, t, 4, 2, 32, 8, 4, jnp.bfloat16)
    for opts in ({}, dict(sliding_window=7, soft_cap=5.0)):
        out = reference.ragged_paged_attention_xla(
            case.q, case.kv_pages[None], case.kv_lens, case.block_tables, case.cu_q_lens,
            case.num_seqs, num_kv_heads=case.k_heads, chunk_bytes=reference.XLA_GPU_CHUNK_BYTES,
            native_operands=True, **opts,
        )  # fmt: skip
        _check(out, _ragged_oracle(case, **opts), jnp.bfloat16)


def test_decode_rows_on_the_chunked_path_match_the_decode_oracle():
    """The GPU fallback of ``paged_attention`` runs each sequence's token as a ragged row."""
    from test_attention_kernels import _check, decode_case

    from kernels_pallas import reference

    rng = np.random.default_rng(28)
    case = decode_case(rng, [13, 1, 0, 30], 4, 2, 32, 8, 4, jnp.bfloat16)
    b = case.q.shape[0]
    for opts in ({}, dict(sliding_window=5)):
        out = reference.ragged_paged_attention_xla(
            case.q, case.kv_pages[None], case.kv_lens, case.block_tables,
            jnp.arange(b + 1, dtype=jnp.int32), b, num_kv_heads=case.k_heads,
            chunk_bytes=reference.XLA_GPU_CHUNK_BYTES, native_operands=True, **opts,
        )  # fmt: skip
        want = reference.paged_attention_reference(
            case.q, case.kv_pages, case.kv_lens, case.block_tables, num_kv_heads=case.k_heads,
            **opts,
        )  # fmt: skip
        _check(out, want, jnp.bfloat16)


@pytest.mark.parametrize("op", ["ragged", "decode"])
def test_cuda_without_a_kernel_runs_the_xla_path_on_bf16_operands(op):
    """On 7.5 (no kernel) the exported attention's matmuls take the pages' bf16 (f32
    accumulation); the CPU lowering of the same function keeps the exact f32 path."""
    fn, args = _ragged(m=6) if op == "ragged" else _decode()
    with aot.cuda_target("7.5"):
        cuda = _export(fn, args)
    cpu = jax.jit(fn).trace(*args).lower().as_text()

    def dots(text):
        return [ln for ln in text.splitlines() if "dot_general" in ln]

    assert any("bf16" in ln.split("->")[0] for ln in dots(cuda)), dots(cuda)[:4]
    assert dots(cpu) and not any("bf16" in ln.split("->")[0] for ln in dots(cpu))
