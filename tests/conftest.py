"""Session-wide test setup: one persistent XLA compilation cache per test session.

Compiling an engine step takes seconds on CPU, and tests build many engines that differ only in
host-side settings (scheduling policy, preemption mode, token budget) or repeat a shape another
test already compiled. With a compilation cache in a temporary directory (removed when the
session ends), such an engine loads the executables instead of compiling them again; results
are identical (the cache is keyed by the compiled program). A ``JAX_COMPILATION_CACHE_DIR`` set
in the environment is used instead (and kept).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import jax
import pytest

_session_cache: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = tempfile.mkdtemp(prefix="paxcache-test-jax-cache-")
    _session_cache.append(path)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _session_cache:
        shutil.rmtree(path, ignore_errors=True)
