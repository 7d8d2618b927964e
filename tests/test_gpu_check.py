"""scripts/gpu_check.py's harness on the CPU: JSON lines, the compute-capability stop, the
watchdog (a hang becomes a recorded failure and exit status 3) and ``--resume``.

The GPU cases themselves need a Hopper; ``--dry-run`` runs them on tiny shapes in interpret
mode (the full dry run is in the slow set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
        timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "gpu_check.jsonl").read_text().splitlines()]


def test_stops_at_once_without_a_compute_capability_9_gpu(tmp_path):
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    env, stop = _records(tmp_path)
    assert env["case"] == "environment" and env["jax"] and env["compute_capability"] is None
    assert {"jaxlib", "cuda_plugins", "driver", "ptxas", "python"} <= env.keys()
    assert stop["status"] == "stopped" and "9.0" in stop["detail"]


@pytest.mark.slow  # the watchdog test below runs the same dry run (and resumes it)
def test_dry_run_writes_a_line_per_case_and_a_summary(tmp_path):
    proc = _run("--dry-run", "--out", str(tmp_path), "--only", "kv")
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = _records(tmp_path)
    assert [r["case"] for r in recs] == [
        "environment", "check: kv_ops xla f32", "copy bandwidth", "time: kv ops (XLA)", "summary"
    ]  # fmt: skip
    assert all(r["status"] == "ok" for r in recs[1:])
    assert recs[1]["write_kv_exact"] and recs[1]["copy_blocks_exact"]
    assert recs[2]["GBps"] > 0 and recs[3]["copy_blocks_frac_copy_bw"] > 0


def test_watchdog_records_a_hang_with_stacks_and_resume_runs_the_rest(tmp_path):
    proc = _run("--dry-run", "--out", str(tmp_path), "--only", "kv", "--selftest-hang", "3")
    assert proc.returncode == 3, proc.stderr[-2000:]
    recs = _records(tmp_path)
    assert recs[-1]["case"] == "selftest hang" and recs[-1]["status"] == "timeout"
    assert "watchdog" in (tmp_path / "tracebacks.txt").read_text()
    proc = _run("--dry-run", "--out", str(tmp_path), "--only", "kv", "--selftest-hang", "3",
                "--resume")  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]  # the run finished; the hang is a failure
    recs = _records(tmp_path)
    cases = [r["case"] for r in recs]
    assert cases.count("environment") == 1 and cases.count("selftest hang") == 1
    assert "time: kv ops (XLA)" in cases
    assert recs[-1]["case"] == "summary" and recs[-1]["failed"] == ["selftest hang"]


def test_a_failing_check_skips_timing_and_keeps_its_traceback(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)

    def broken():
        raise RuntimeError("mosaic says no")

    monkeypatch.setattr(gpu_check, "correctness_cases", lambda quick, dry: [("broken", broken)])
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == gpu_check.EXIT_FAILED
    recs = _records(tmp_path)
    assert recs[1]["status"] == "error" and "mosaic says no" in recs[1]["detail"]
    assert recs[2] == {**recs[2], "case": "timing", "status": "skipped"}
    assert "Traceback" in (tmp_path / "tracebacks.txt").read_text()


@pytest.mark.slow
def test_full_dry_run_checks_and_times_every_kernel_in_interpret_mode(tmp_path):
    proc = _run("--dry-run", "--out", str(tmp_path), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = _records(tmp_path)
    assert all(r.get("status", "ok") == "ok" for r in recs[1:]), recs
    timed = [r for r in recs if r["case"].startswith("time: decode")]
    assert timed and timed[0]["paxcache_mgpu"]["ok"]
