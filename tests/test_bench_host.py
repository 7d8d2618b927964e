"""scripts/bench_host.py knows this build's engine options: every mode it times is built
(a mode whose options the engine lacked would be silently listed as not built)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load_script(monkeypatch, name: str):
    """``scripts/<name>.py`` as a module (the scripts directory importable, as when run)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, f"{name}_under_test", module)
    spec.loader.exec_module(module)
    return module


def test_every_mode_of_the_host_benchmark_is_built_by_this_engine(monkeypatch):
    bench = _load_script(monkeypatch, "bench_host")
    assert set(bench.MODES) == {"sync", "overlap", "multistep", "multistep_overlap"}
    assert all(bench.supported(mode) for mode in bench.MODES)
    monkeypatch.setitem(bench.MODES, "bogus", {"decode_step": 8})  # a misspelt option
    assert not bench.supported("bogus")


@pytest.mark.slow  # two engines built and warmed up in subprocesses: 85 s beside CI's suites
def test_the_lockstep_host_benchmark_steps_both_builds_alike(monkeypatch):
    """scripts/bench_host_ab.py steps one engine per build alternately and reports each
    build's host time: the same tree twice gives both the same tokens and a host time."""
    ab = _load_script(monkeypatch, "bench_host_ab")
    root = str(SCRIPTS.parent)
    acc = ab.lockstep([root, root + "/"], "sync", rows=2, rounds=1, steps=3)
    a, b = acc[root], acc[root + "/"]
    assert len(a["per_step"]) == len(b["per_step"]) == 3
    assert a["tokens"] == b["tokens"] == 2 * 3  # one token per row per step
    assert a["host_cpu_s"] > 0 and b["host_cpu_s"] > 0
