"""KV sizing on a CUDA GPU from the device's real memory (``paxcache.sizing``), XLA's allocator
pool setting, and the accelerator dtype default of ``Engine.from_pretrained``.

XLA's GPU pool (``bytes_limit``) is ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the GPU, 0.75 by
default: sized from it, a quarter of the GPU stays unused. On a GPU the cache gets 0.9 of the
device's memory less what is in use and the step's reserve, within what the pool has free.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from paxcache import Engine, sizing
from paxcache import step as step_lib

GIB = 1 << 30
DIMS = dict(num_layers=32, num_kv_heads_per_device=8, head_dim=128, block_size=16)
PER_BLOCK = 2 * 32 * 8 * 16 * 128 * 2  # K and V, bf16: 2 MiB


def _blocks(stats, reserve=GIB):
    return sizing.device_num_blocks(stats, reserve, dtype=jnp.bfloat16, **DIMS)


def test_a_gpu_cache_is_sized_from_the_devices_memory_not_the_pool(caplog):
    caplog.set_level(logging.WARNING, logger="paxcache.sizing")
    wide_pool = {"bytes_limit": 95 * GIB, "bytes_in_use": 10 * GIB, "device_total_bytes": 100 * GIB}
    assert _blocks(wide_pool) == (int(0.9 * 100 * GIB) - 10 * GIB - GIB) // PER_BLOCK
    assert not caplog.records
    # The same numbers without the device's total: 0.9 of the pool's free memory, fewer blocks.
    pool_only = {k: v for k, v in wide_pool.items() if k != "device_total_bytes"}
    assert _blocks(pool_only) < _blocks(wide_pool)


def test_xla_default_pool_limits_the_cache_with_a_warning_naming_the_setting(caplog):
    caplog.set_level(logging.WARNING, logger="paxcache.sizing")
    default_pool = {"bytes_limit": 75 * GIB, "bytes_in_use": 10 * GIB}
    default_pool["device_total_bytes"] = 100 * GIB
    # The pool's free 65 GiB less the 5% of the device the cache leaves as headroom (a cache
    # that took the whole pool left an H200's Llama-3-8B step no room) less the reserve.
    assert _blocks(default_pool) == (65 * GIB - 5 * GIB - GIB) // PER_BLOCK
    (record,) = caplog.records
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in record.getMessage()


def test_a_gpu_with_no_room_left_is_refused_with_the_numbers():
    full = {"bytes_limit": 20 * GIB, "bytes_in_use": 19 * GIB, "device_total_bytes": 21 * GIB}
    with pytest.raises(ValueError, match="no KV block fits on the GPU"):
        _blocks(full, reserve=2 * GIB)


class _FakeGpu:
    platform = "gpu"
    local_hardware_id = 0

    def memory_stats(self):
        return {"bytes_limit": 90 * GIB, "bytes_in_use": GIB}


def test_device_stats_carry_the_drivers_total_memory(monkeypatch):
    monkeypatch.setattr(sizing, "cuda_total_memory", lambda ordinal: 141 * GIB)
    stats = sizing.device_memory_stats(_FakeGpu())
    assert stats["device_total_bytes"] == 141 * GIB and stats["bytes_limit"] == 90 * GIB


def test_without_the_driver_the_total_is_the_pool_over_its_fraction(monkeypatch):
    monkeypatch.setattr(sizing, "cuda_total_memory", lambda ordinal: None)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    assert sizing.device_memory_stats(_FakeGpu())["device_total_bytes"] == 100 * GIB


def test_configure_gpu_allocator_sets_the_pool_unless_the_user_did(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    assert sizing.configure_gpu_allocator() is True
    assert float(sizing.os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == sizing.GPU_POOL_FRACTION
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert sizing.configure_gpu_allocator() is False
    assert sizing.os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    with pytest.raises(ValueError, match="GPU pool fraction"):
        sizing.configure_gpu_allocator(1.5)


def test_from_pretrained_loads_bf16_on_accelerators_and_f32_on_cpu(monkeypatch):
    assert step_lib.default_dtype("cpu") == jnp.float32
    assert step_lib.default_dtype("gpu") == step_lib.default_dtype("tpu") == jnp.bfloat16
    import paxcache.models

    seen = []

    def fake_load(model, dtype, **kwargs):  # tp, ep, quantization: not this test's
        seen.append(dtype)
        raise RuntimeError("stop after the dtype")

    monkeypatch.setattr(paxcache.models, "load_pretrained", fake_load)
    monkeypatch.setattr(step_lib, "default_dtype", lambda backend=None: jnp.bfloat16)
    with pytest.raises(RuntimeError, match="stop after the dtype"):
        Engine.from_pretrained("tiny")
    with pytest.raises(RuntimeError, match="stop after the dtype"):
        Engine.from_pretrained("tiny", dtype=jnp.float16)  # an explicit dtype is kept
    assert seen == [jnp.bfloat16, jnp.float16]
