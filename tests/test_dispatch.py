"""One dispatch for every kernel op (``kernels_pallas._dispatch``), on this CPU host.

* ``impl="auto"`` follows the platform a program is lowered for: CPU -> XLA; CUDA on Hopper
  (``aot.cuda_target("9.0")``, no GPU) -> decode on the Mosaic GPU kernel (the Triton kernel
  for a geometry Mosaic GPU does not take), the ragged op on the Triton kernel (the Mosaic GPU
  ragged kernel failed its oracle on an H200; ``impl="pallas_gpu"`` still forces it), or the
  XLA path with ONE warning when no kernel takes it (per capability:
  ``tests/test_cuda_target.py``); the registry (``kernels_pallas.kernel_info``) says what
  each op got, per platform.
* forced kernels on the wrong target are refused with a clear error.
* the engine: ``warmup()`` compiles every swap program (no compilation at the first
  preemption), ``stats()["kernel_impls"]`` and the ``paxcache_kernel_info`` gauge.
(The TPU side, with libtpu's compiler, is ``tests/test_tpu_compile.py``.)
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels_pallas as kp
from kernels_pallas import _dispatch, aot, compat

TRITON_CHECKS = compat.TRITON_EXPORT_CHECKS


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_dispatch, "_WARNED", set())


def _ragged_args(g: int, d: int = 128, s: int = 16, dtype=jnp.bfloat16):
    kh, b, m, t = 2, 4, 8, 32
    spec = jax.ShapeDtypeStruct
    return (
        spec((t, kh * g, d), dtype), kp.kv_cache_shape(3, 64, s, kh, d, dtype),
        spec((b,), jnp.int32), spec((b, m), jnp.int32),
        spec((b + 1,), jnp.int32), spec((), jnp.int32), spec((), jnp.int32),
    )  # fmt: skip


def _ragged_fn(impl: str = "auto"):
    """A new function each call, so jit traces again (dispatch decides at trace time)."""

    def ragged(q, cache, lens, tables, cu, n, layer):
        return kp.ragged_paged_attention(q, cache, lens, tables, cu, n, layer=layer, impl=impl)

    return jax.jit(ragged)


def _decode_args(g: int):
    args = _ragged_args(g)
    return (jax.ShapeDtypeStruct((4, *args[0].shape[1:]), args[0].dtype), *args[1:4], args[6])


def _decode_fn():
    def decode(q, cache, lens, tables, layer):
        return kp.paged_attention(q, cache, lens, tables, layer=layer)

    return jax.jit(decode)


def test_auto_on_cpu_is_the_xla_path_and_is_recorded():
    lowered = _ragged_fn().trace(*_ragged_args(4)).lower()
    text = lowered.as_text()
    assert "tpu_custom_call" not in text and "mosaic_gpu" not in text
    assert kp.kernel_info()["ragged_paged_attention"] == "xla"  # target platform: cpu
    assert kp.kernel_info("tpu")["ragged_paged_attention"] == "pallas_tpu"


def _export_cuda(fn, args) -> str:
    return jax.export.export(fn, platforms=["cuda"], disabled_checks=TRITON_CHECKS)(
        *args
    ).mlir_module()


MOSAIC_GPU = "custom_call @mosaic_gpu"
TRITON = compat.TRITON_CALL_TARGET


def test_hopper_auto_runs_ragged_on_triton_and_decode_on_mosaic_gpu(caplog):
    """On an H200 the Mosaic GPU ragged kernel failed its oracle (G = 1 and 4) while its
    decode kernel and the Triton kernels passed: on 9.0 ``auto`` exports the ragged op with
    the Triton call and decode with the Mosaic GPU one, recorded as such, with no warning;
    ``impl="pallas_gpu"`` still forces the Mosaic GPU ragged kernel, ``impl="pallas"`` (the
    target's kernel) gets Triton's."""
    caplog.set_level(logging.WARNING, logger="kernels_pallas")
    with aot.cuda_target("9.0"):
        ragged = _export_cuda(_ragged_fn(), _ragged_args(4))
        decode = _export_cuda(_decode_fn(), _decode_args(4))
        info = dict(kp.kernel_info("cuda"))
        forced = _export_cuda(_ragged_fn("pallas_gpu"), _ragged_args(4))
        forced_info = kp.kernel_info("cuda")["ragged_paged_attention"]
        target_kernel = _export_cuda(_ragged_fn("pallas"), _ragged_args(4))  # the trusted one
    assert TRITON in target_kernel and MOSAIC_GPU not in target_kernel
    assert TRITON in ragged and MOSAIC_GPU not in ragged
    assert MOSAIC_GPU in decode and TRITON not in decode
    assert info["ragged_paged_attention"] == "pallas_triton", info
    assert info["paged_attention"] == "pallas_gpu", info
    assert MOSAIC_GPU in forced and TRITON not in forced and forced_info == "pallas_gpu"
    assert not [r.getMessage() for r in caplog.records if r.name == "kernels_pallas"]


def test_geometry_mosaic_gpu_refuses_runs_the_triton_kernel_on_hopper(caplog):
    """G = 6 does not divide the 64-row wgmma tile: on Hopper decode's CUDA branch is the
    Triton kernel (which takes any G), recorded as such, with no warning."""
    caplog.set_level(logging.WARNING, logger="kernels_pallas")
    with aot.cuda_target("9.0"):
        text = _export_cuda(_decode_fn(), _decode_args(6))
        info = kp.kernel_info("cuda")["paged_attention"]
    assert MOSAIC_GPU not in text and TRITON in text
    assert info == "pallas_triton"
    assert not [r for r in caplog.records if "paged_attention" in r.getMessage()]


def test_geometry_no_gpu_kernel_takes_falls_back_to_xla_with_one_warning(caplog):
    """head_dim 96 is neither a multiple of 64 (Mosaic GPU) nor a power of two (Triton): the
    CUDA branch is the XLA path, warned about once, and the registry names both reasons."""
    caplog.set_level(logging.WARNING, logger="kernels_pallas")
    with aot.cuda_target("9.0"):
        for _ in range(3):
            text = _export_cuda(_ragged_fn(), _ragged_args(4, d=96))
        info = kp.kernel_info("cuda")["ragged_paged_attention"]
    assert "custom_call @mosaic_gpu" not in text and compat.TRITON_CALL_TARGET not in text
    assert info.startswith("xla (fallback: ") and "head_dim=96" in info and "Triton" in info
    msgs = [r.getMessage() for r in caplog.records if "ragged_paged_attention" in r.getMessage()]
    assert len(msgs) == 1, msgs


def test_gpu_reasons_come_from_the_gpu_kernel_modules(monkeypatch):
    """Each GPU kernel module states what it refuses (Mosaic GPU: ``gpu.attention``; Triton:
    ``gpu.triton_attention``, for the targeted capability); refused by both, the registry
    names both reasons."""
    from kernels_pallas.gpu import attention as ga
    from kernels_pallas.gpu import triton_attention as ta

    calls = []

    def reason(*, head_dim, num_q_per_kv, block_size, dtype):
        calls.append((head_dim, num_q_per_kv, block_size, jnp.dtype(dtype).name))
        return "nope"

    def triton_reason(*, head_dim, num_q_per_kv, block_size, dtype, capability):
        calls.append((head_dim, num_q_per_kv, block_size, jnp.dtype(dtype).name, capability))
        return "nope too"

    monkeypatch.setattr(ga, "unsupported_reason", reason, raising=False)
    monkeypatch.setattr(ta, "unsupported_reason", triton_reason)
    with aot.cuda_target("9.0"):
        _export_cuda(_ragged_fn(), _ragged_args(4))
        info = kp.kernel_info("cuda")["ragged_paged_attention"]
    assert sorted(calls) == [(128, 4, 16, "bfloat16"), (128, 4, 16, "bfloat16", "9.0")]
    assert info == "xla (fallback: nope; Triton kernel: nope too)"


@pytest.mark.parametrize(
    "geometry,why",
    [
        (dict(head_dim=96, num_q_per_kv=4, block_size=16, dtype=jnp.bfloat16), "head_dim=96"),
        (dict(head_dim=128, num_q_per_kv=4, block_size=24, dtype=jnp.bfloat16), "block_size=24"),
        (dict(head_dim=128, num_q_per_kv=4, block_size=128, dtype=jnp.bfloat16), None),
        (dict(head_dim=128, num_q_per_kv=4, block_size=16, dtype=jnp.float32), "float32"),
        (dict(head_dim=128, num_q_per_kv=7, block_size=16, dtype=jnp.bfloat16), "(7)"),
        (dict(head_dim=128, num_q_per_kv=8, block_size=16, dtype=jnp.bfloat16), None),
    ],
)
def test_gpu_unsupported_reason(geometry, why):
    reason = _dispatch.gpu_attention_unsupported_reason(**geometry)
    assert (reason is None) if why is None else (why in reason)


def test_forced_tpu_kernel_off_tpu_needs_interpret():
    q = jnp.zeros((2, 4, 16))
    cache = kp.init_kv_cache(1, 8, 4, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="needs a TPU target"):
        kp.paged_attention(q, cache, jnp.ones(2, jnp.int32), jnp.zeros((2, 2), jnp.int32),
                           impl="pallas_tpu")  # fmt: skip
    with pytest.raises(ValueError, match="needs a TPU target"):
        kp.write_kv(cache, q[:, :2], q[:, :2], np.array([0, 1]), impl="pallas")


def test_forced_tpu_write_kv_takes_any_block_size():
    """The TPU write kernel moves each token's ``[C, P, Dp]`` row with one DMA on untiled
    axes, so no block size is refused (the 8-row tile rule went with the head-major layout);
    interpreted, S = 4 writes exactly the two slots."""
    from kernels_pallas.tpu.kv_ops import write_kv_unsupported_reason

    assert all(write_kv_unsupported_reason(s, jnp.bfloat16) is None for s in (1, 4, 7, 16))
    assert "not positive" in write_kv_unsupported_reason(0, jnp.float32)
    cache = kp.init_kv_cache(1, 8, 4, 2, 16, jnp.float32)
    k = jnp.ones((2, 2, 16))
    out = kp.write_kv(cache, k, k, np.array([0, 5]), impl="pallas_tpu", interpret=True)
    got, _ = kp.read_kv(out, np.array([0, 5, 1]))
    np.testing.assert_array_equal(np.asarray(got), [np.ones((2, 16))] * 2 + [np.zeros((2, 16))])
    # Slots 0 and 5 (block 0 row 0, block 1 row 1): K and V of both heads, in the pages too.
    assert float(out.kv[0, 0, 0].sum()) == 64.0 and float(out.kv[0, 1, 1].sum()) == 64.0
    assert float(out.kv[0, 0, 1].sum()) == 0.0


def test_swap_is_the_memory_kinds_program_everywhere():
    dev = kp.init_kv_cache(1, 4, 2, 1, 8, jnp.float32)
    kp.swap_blocks(dev, kp.init_kv_cache(1, 4, 2, 1, 8, jnp.float32), np.array([0]), np.array([1]))
    assert kp.kernel_info("tpu")["swap_blocks"] == "xla"


# --------------------------------------------------------------------------------------------
# Engine: warm-up compiles swaps, kernel_impls, the metrics gauge
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swap_engine():
    from paxcache import Engine
    from paxcache.models import ByteTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    eng = Engine(
        model, ByteTokenizer(), num_blocks=12, block_size=8, max_num_seqs=4, watermark=0.0,
        max_num_batched_tokens=32, num_host_blocks=24, preemption_mode="swap",
    )  # fmt: skip
    eng.warmup()
    return eng


def test_warm_engine_swaps_without_compiling(swap_engine):
    """Six prompts (up to 57 tokens, 10 new each) in 12 blocks of 8: sequences are swapped
    out and back in, and none of it compiles (warm-up compiled every swap bucket)."""
    from paxcache import SamplingParams

    eng = swap_engine
    before = eng.stats()["num_compilations"]
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (3, 40, 20, 2, 57, 9)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    st = eng.stats()
    assert st["num_swaps"] > 0, st
    assert st["num_compilations"] == before
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)


def test_stats_and_metrics_show_each_ops_implementation(swap_engine):
    from paxcache.server.metrics import EngineStatsCollector

    impls = swap_engine.stats()["kernel_impls"]
    assert {impls[op] for op in ("ragged_paged_attention", "write_kv", "copy_blocks")} == {"xla"}

    shown = {"write_kv": "pallas_tpu", "copy_blocks": "xla (fallback: Mosaic compile error: X)"}

    class Runner:
        stats_snapshot = dict(swap_engine.stats(), kernel_impls=shown)
        num_inflight = 0
        num_engine_errors = 0

    families = {m.name: m for m in EngineStatsCollector(Runner()).collect()}
    samples = {
        (s.labels["op"], s.labels["impl"], s.labels["fallback"]): s.value
        for s in families["paxcache_kernel_info"].samples
    }
    assert samples == {
        ("copy_blocks", "xla", "Mosaic compile error: X"): 1.0,
        ("write_kv", "pallas_tpu", ""): 1.0,
    }
