"""The TPU gate's static-schedule floor: paxcache's attention kernels may not get slower.

For two shapes per kernel on v5e and v6e (Llama-3-8B attention at page 16, Qwen2-7B's G = 7
at page 64; decode and prefill), ``scripts/kernel_cycles.py`` compiles the kernels with the
real TPU compiler and counts the final bundles. Each kernel's ceilings (fraction of HBM
bandwidth, of MXU throughput) may not fall, and its static cycles per KiB / bundles per useful
flop may not rise, by more than 5% from the figures recorded in
``bench/results/kernel_ceilings_ci.json``.

Needs libtpu (``-m slow``; one test per shape, chip and kernel: a decode ~5 s, a prefill
~60 s, most of it libtpu writing the bundle dump). The TPU gate runs the Qwen2 shape's decode
on both chips and its prefill on v6e (``-k "qwen2_7b and (decode or v6e)"``): one shape per
kernel. After a deliberate kernel change, re-record with ``python scripts/kernel_cycles.py
--target v5e,v6e --case decode,prefill <the shape's args> --json OUT`` for each shape and copy
the rows over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "kernel_cycles.py"
RECORDED = json.loads((REPO / "bench" / "results" / "kernel_ceilings_ci.json").read_text())
TOLERANCE = 0.05


@pytest.mark.slow
@pytest.mark.parametrize("case", RECORDED["cases"])
@pytest.mark.parametrize("target", RECORDED["targets"])
@pytest.mark.parametrize("shape", sorted(RECORDED["shapes"]))
def test_kernel_ceilings_hold_their_recorded_values(tmp_path, shape, target, case):
    pytest.importorskip("libtpu")
    spec = RECORDED["shapes"][shape]
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable, str(SCRIPT), "--target", target, "--case", case, *spec["args"],
        "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    now = {
        (row["name"], row["target"], row["case"]): row
        for row in json.loads(out.read_text())
        if row["kernel"] == "paxcache"
    }
    worse = []
    mine = [w for w in spec["rows"] if (w["target"], w["case"]) == (target, case)]
    assert mine, f"nothing recorded for {shape} on {target}, {case}"
    for want in mine:
        key = (want["name"], want["target"], want["case"])
        assert key in now, f"{key} no longer compiled (have {sorted(now)})"
        got = now[key]
        for field in ("hbm_ceiling", "mxu_ceiling"):
            if got[field] < (1 - TOLERANCE) * want[field]:
                worse.append(f"{key} {field}: {got[field]:.4g} < recorded {want[field]:.4g}")
        for field in ("cycles_per_kib", "bundles_per_useful_flop"):
            if got[field] > (1 + TOLERANCE) * want[field]:
                worse.append(f"{key} {field}: {got[field]:.4g} > recorded {want[field]:.4g}")
    assert not worse, "\n".join(worse)
