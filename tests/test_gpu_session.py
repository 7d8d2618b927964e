"""scripts/gpu_session.sh's driver on the CPU (--dry-run, toy sizes): each stage runs in its own
process under a watchdog and lands as JSON lines in the output directory, at most six files; a
stage that fails or hangs is recorded and the next one still runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_session  # noqa: E402


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_dry_run_records_the_environment_and_the_engine_stage(tmp_path):
    assert (
        gpu_session.main(["--dry-run", "--out", str(tmp_path), "--only", "environment,engine"]) == 0
    )
    stages = {r["stage"]: r for r in _lines(tmp_path / "session.jsonl")}
    assert stages["environment"]["status"] == "ok"
    assert stages["environment"]["result"]["backend"] == "cpu"
    engine = {r["case"]: r for r in _lines(tmp_path / "engine.jsonl")}
    assert set(engine) == {"model", "warmup", "generate", "decode_step_vs_dense"}
    assert engine["generate"]["generated_tokens"] == 2 * 4  # every sequence ran to max_tokens
    assert engine["warmup"]["compile_s_per_shape"] > 0
    assert len(list(tmp_path.iterdir())) <= 6


def test_a_hung_or_failing_stage_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_session, "DRY_TIMEOUT", 0.001)  # every child "hangs" at once
    only = ["--only", "environment,kernels"]
    assert gpu_session.main(["--dry-run", "--out", str(tmp_path), *only]) == 1
    rows = _lines(tmp_path / "session.jsonl")
    assert [(r["stage"], r["status"]) for r in rows] == [
        ("environment", "hung"),
        ("kernels", "hung"),
    ]
