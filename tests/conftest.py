"""Test-session set-up.

* ``JAX_PLATFORMS=cpu`` (unless set): the suite runs on the CPU (kernels in interpret mode).
  With ``jax[tpu]`` installed (CI's TPU compile step) JAX would otherwise first try to bring
  up a TPU backend; the TPU compile tests need no TPU backend, only libtpu's compiler on
  abstract topology devices (``kernels_pallas.aot``). Set ``JAX_PLATFORMS=tpu`` on a TPU VM.
* ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``: compile-only use of libtpu by several processes at once
  (subprocess tests, a concurrent ``scripts/compile_check.py``) instead of failing on
  libtpu's lockfile.
* One persistent XLA compilation cache per test session. The engine turns on JAX's persistent
  compilation cache by default (``paxcache.compile_cache``) in a per-user directory. Tests point
  it at a fresh temporary directory instead (removed when the session ends), so they run the
  default code path (cache on) without reading or writing the user's cache. It also saves time:
  tests build many engines that differ only in host-side settings (scheduling policy,
  preemption mode, token budget) or repeat a shape another test already compiled; such an
  engine loads the executables instead of compiling them again, with identical results (the
  cache is keyed by the compiled program). A ``PAXCACHE_COMPILE_CACHE`` set in the environment
  is used instead (and kept).
* JAX's in-memory caches are cleared (``jax.clear_caches()``) after a test module that leaves
  the process holding more than a third of Linux's ``vm.max_map_count`` memory maps (65530 by
  default). Each compiled XLA:CPU program keeps its code in memory maps while JAX caches it,
  and the suite compiles or loads thousands (one engine's programs hold ~550 maps); never
  cleared, they pass the limit about a third of the way through the suite, and the next
  program load aborts the process inside LLVM's JIT linker (``report_fatal_error`` in
  ``RuntimeDyld::emitSection``). Clearing only past the threshold keeps what modules share in
  memory (clearing after every module measured about the same: 37:28 against 38:00 per suite
  in CI). A module's own fixtures are torn down before the check; later modules reload what
  they need from the session's persistent cache.
* ``--xla_backend_optimization_level=0`` in ``XLA_FLAGS`` (unless ``XLA_FLAGS`` names a level,
  and not in the TPU compile gate, where libtpu is installed): XLA:CPU then compiles with
  LLVM's optimizations off. The suite's programs are small and most run a few times, so it is
  mostly bound by compiling them: each CI suite ran ~16% faster with it (2922 -> 2441 s on JAX
  0.10.2), compile-bound tests 2-3x faster, run-bound ones (``tests/test_stress.py``) ~1.7x
  slower. HLO passes (fusion, layout,
  sharding) are unaffected, so tests that read compiled HLO see the same programs; tests that
  compare two paths compile both the same way. Subprocess workers inherit it; a real
  ``scripts/serve.py`` started by a test does not (``server_harness.real_server_env``: the
  ``XLA_FLAGS`` the suite started with, kept in ``PAXCACHE_TEST_USER_XLA_FLAGS``): it runs as
  a user's server does, and the tests that time its answers (SIGTERM drains a 64-token stream
  within 3 s) measured it so.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
_xla_flags = os.environ.setdefault("PAXCACHE_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
if importlib.util.find_spec("libtpu") is None and "optimization_level" not in _xla_flags:
    os.environ["XLA_FLAGS"] = f"{_xla_flags} --xla_backend_optimization_level=0".strip()

_session_cache: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    from paxcache import compile_cache

    if not os.environ.get("PAXCACHE_COMPILE_CACHE"):
        path = tempfile.mkdtemp(prefix="paxcache-test-jax-cache-")
        _session_cache.append(path)
        os.environ["PAXCACHE_COMPILE_CACHE"] = path
    # On for every test from the start (not only once an engine is built).
    compile_cache.enable(os.environ["PAXCACHE_COMPILE_CACHE"])


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _session_cache:
        shutil.rmtree(path, ignore_errors=True)


MAPS_CLEAR_FRACTION = 1 / 3


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After a module, past a third of ``vm.max_map_count``: drop JAX's in-memory executables
    (and their memory maps)."""
    yield
    import jax

    from paxcache import compile_cache

    maps = compile_cache.memory_maps()
    if maps is None or maps[0] <= MAPS_CLEAR_FRACTION * maps[1]:
        return
    gc.unfreeze()  # engines' warm-ups froze the heap (EngineConfig.freeze_gc): collect it all
    gc.collect()
    jax.clear_caches()
    gc.collect()
