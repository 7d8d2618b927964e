"""scripts/bench_host.py knows this build's engine options: every mode it times is built
(a mode whose options the engine lacked would be silently listed as not built)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_every_mode_of_the_host_benchmark_is_built_by_this_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(
        "bench_host_under_test", SCRIPTS / "bench_host.py"
    )
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_host_under_test", bench)
    spec.loader.exec_module(bench)
    assert set(bench.MODES) == {"sync", "overlap", "multistep", "multistep_overlap"}
    assert all(bench.supported(mode) for mode in bench.MODES)
    monkeypatch.setitem(bench.MODES, "bogus", {"decode_step": 8})  # a misspelt option
    assert not bench.supported("bogus")
