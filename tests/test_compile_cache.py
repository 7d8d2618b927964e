"""The persistent compilation cache: where it lives, and that a second engine (or a second
start of ``scripts/serve.py``) loads its compiled steps from it instead of compiling, with the
same results (donated state included)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from paxcache import Engine, SamplingParams, compile_cache
from paxcache import step as step_lib
from paxcache.models import ByteTokenizer, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_cache_dir():
    """Tests here switch JAX's process-wide cache directory; put the session's back after."""
    before = compile_cache.current_dir()
    yield
    if before:
        compile_cache.enable(before)
    else:
        compile_cache.disable()


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))


def _engine(model, cache, **kw):
    args = dict(num_blocks=32, block_size=8, max_num_seqs=4, max_num_batched_tokens=16)
    args.update(kw)
    return Engine(model, ByteTokenizer(), compile_cache=cache, **args)


def test_default_dir_follows_env_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("PAXCACHE_COMPILE_CACHE", str(tmp_path / "explicit"))
    assert compile_cache.default_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PAXCACHE_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == tmp_path / "xdg" / "paxcache" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == tmp_path / "home" / ".cache" / "paxcache" / "jax"


def test_enabled_cache_is_locked_across_processes(tmp_path, restore_cache_dir):
    """JAX writes cache entries in place; only a size-limited cache takes its file lock, so a
    process never reads an entry another is still writing. enable() sets the limit."""
    import jax.numpy as jnp
    from jax._src import compilation_cache as jax_cc

    compile_cache.enable(tmp_path / "locked")
    assert jax.config.jax_compilation_cache_max_size == compile_cache.DEFAULT_MAX_BYTES
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(5))  # a new program: written through the cache
    assert jax_cc._cache is not None and jax_cc._cache.eviction_enabled
    assert (tmp_path / "locked" / ".lockfile").exists()


def test_processes_joined_on_cpu_run_without_the_cache(tmp_path, restore_cache_dir, monkeypatch):
    """jax.distributed on CPU devices: the cache is turned off, even a directory already set
    (mixed loaded and compiled programs hang gloo collectives on JAX 0.12.1)."""
    compile_cache.enable(tmp_path / "on")
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert compile_cache.enable(tmp_path / "asked") is None
    assert compile_cache.current_dir() is None
    assert not (tmp_path / "asked").exists()


def test_resolve_arguments(tmp_path, restore_cache_dir):
    assert compile_cache.resolve(False) is None
    assert compile_cache.resolve(tmp_path) == tmp_path
    compile_cache.disable()
    assert compile_cache.resolve(None) == compile_cache.default_dir()
    compile_cache.enable(tmp_path / "mine")  # a directory already set in JAX is kept
    assert compile_cache.resolve(None) == (tmp_path / "mine").resolve()
    for bad in (3, "", 1.5):
        with pytest.raises(ValueError, match="compile_cache"):
            compile_cache.resolve(bad)


def test_bad_compile_cache_argument_fails_before_any_work(model):
    with pytest.raises(ValueError, match="compile_cache"):
        _engine(model, 7)


def test_unwritable_cache_dir_leaves_cache_off_and_engine_works(model, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    before = compile_cache.current_dir()
    assert compile_cache.enable(blocker / "cache") is None
    assert compile_cache.current_dir() == before  # unchanged
    assert "compile cache off" in caplog.text


def test_compile_cache_false_leaves_jax_config_alone(model, restore_cache_dir):
    compile_cache.disable()
    eng = _engine(model, False, warmup=False)
    assert eng.compile_cache_dir is None
    assert compile_cache.current_dir() is None


def test_second_engine_loads_every_step_from_the_cache(model, tmp_path, restore_cache_dir):
    cache = tmp_path / "jax"
    prompts = [[1, 2, 3], list(range(40, 70)), [7] * 11]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    first = _engine(model, cache)
    assert first.compile_cache_dir == cache.resolve()
    out1 = first.generate(prompts, params)  # warms up on first use, writing the cache
    st1 = first.stats()
    assert st1["num_compilations"] >= len(first.buckets)
    assert any(cache.iterdir())

    # The same model: the second engine would share the first's jitted step
    # (step.jitted_step); a new jit object lowers again and looks each program up on disk.
    step_lib._shared_jit.cache_clear()
    second = _engine(model, cache)
    second.warmup()
    st2 = second.stats()
    assert st2["num_compile_cache_hits"] >= len(second.buckets)
    assert st2["num_compilations"] == 0
    # Loaded executables donate and update the state like compiled ones: same tokens, twice.
    for _ in range(2):
        out2 = second.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in out2] == [o.outputs[0].token_ids for o in out1]
    st2 = second.stats()
    assert st2["num_compilations"] == 0
    assert st2["num_free_blocks"] == st2["num_total_blocks"]


def test_engine_warms_up_on_first_use_and_never_compiles_after(model, caplog):
    eng = _engine(model, None)
    with caplog.at_level("INFO", logger="paxcache.engine"):
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    lines = [r.getMessage() for r in caplog.records if r.name == "paxcache.engine"]
    assert sum("warm-up" in m and "tokens ready" in m for m in lines) == len(eng.buckets)
    assert any(m.startswith("warm-up done") for m in lines)
    before = eng.stats()["num_compilations"]
    rng = np.random.default_rng(0)
    eng.generate(
        [list(map(int, rng.integers(0, 256, n))) for n in (1, 9, 17, 30)],
        SamplingParams(max_tokens=5, ignore_eos=True),
    )
    assert eng.stats()["num_compilations"] == before


def test_warmup_false_compiles_only_what_runs(model):
    eng = _engine(model, None, warmup=False)
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert not eng._warmed_up


# ------------------------------------------------------------------------------ serve.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_until_healthy(cache: Path, timeout: float = 600.0) -> tuple[float, str]:
    port = _free_port()
    cmd = [
        sys.executable, str(ROOT / "scripts/serve.py"), "--model", "tiny", "--port", str(port),
        "--compile-cache", str(cache), "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise AssertionError(f"serve.py exited: {proc.stderr.read().decode()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError("serve.py never became healthy")
        elapsed = time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    return elapsed, err.decode()


def _warmup_counts(log: str) -> tuple[int, int]:
    m = re.search(r"warm-up done in [\d.]+s: (\d+) compiled, (\d+) loaded from the compile", log)
    assert m, log
    return int(m.group(1)), int(m.group(2))


@pytest.mark.slow
def test_second_serve_start_loads_its_steps_from_the_compile_cache(tmp_path):
    cache = tmp_path / "jax"
    _, log1 = _start_until_healthy(cache)
    compiled1, _ = _warmup_counts(log1)
    assert compiled1 > 0
    _, log2 = _start_until_healthy(cache)
    compiled2, loaded2 = _warmup_counts(log2)
    assert compiled2 == 0
    assert loaded2 >= compiled1
    assert "warm-up 1/" in log2  # one progress line per bucket


def test_check_memory_maps_warns_only_near_the_limit(caplog):
    with caplog.at_level("WARNING", logger="paxcache.compile_cache"):
        assert not compile_cache.check_memory_maps((1000, 65530))
        assert not caplog.records
        assert compile_cache.check_memory_maps((60000, 65530))
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert "60000" in msg and "vm.max_map_count=65530" in msg and "jax.clear_caches()" in msg
    assert not compile_cache.check_memory_maps((5, 0))  # unreadable / nonsense limit


def test_warmup_checks_the_memory_maps(model, monkeypatch, caplog):
    monkeypatch.setattr(compile_cache, "memory_maps", lambda: (65000, 65530))
    eng = _engine(model, False, warmup=False)
    with caplog.at_level("WARNING", logger="paxcache.compile_cache"):
        eng.warmup()
    assert any("vm.max_map_count=65530" in r.getMessage() for r in caplog.records)


def test_memory_maps_reads_this_process_and_the_kernel_limit(restore_cache_dir):
    # Last in the module: it drops JAX's in-memory caches, which the engines above share. The
    # persistent cache is off while it compiles its 40 programs (writing each to disk is most
    # of their cost; maps are held by the loaded code either way).
    compile_cache.disable()
    maps = compile_cache.memory_maps()
    if not Path("/proc/sys/vm/max_map_count").exists():
        assert maps is None
        return
    held, limit = maps
    assert 0 < held < limit
    # Compiled programs hold maps until JAX's caches drop them (what the warning is about).
    jax.clear_caches()
    before = compile_cache.memory_maps()[0]
    f = jax.jit(lambda x: x * 3 + 1)
    for n in range(1, 41):
        f(np.arange(float(n))).block_until_ready()
    grown = compile_cache.memory_maps()[0]
    assert grown >= before + 40, (before, grown)
    jax.clear_caches()
    assert compile_cache.memory_maps()[0] <= grown - 40
