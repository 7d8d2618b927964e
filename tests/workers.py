"""Worker subprocesses on simulated CPU devices, for the sharding tests (tensor, expert and
multi-host parallelism need several devices, which a process fixes when JAX starts)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["cpu_devices_env", "run_processes", "run_worker"]


def cpu_devices_env(devices: int) -> dict[str, str]:
    """This process's environment with JAX on ``devices`` simulated CPU devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    return env


def run_worker(worker: Path, out: Path, *args: str, devices: int = 4, timeout: int = 850) -> dict:
    """Runs ``worker out *args`` on ``devices`` CPU devices; returns the JSON it wrote to
    ``out`` (fails with the worker's output if it exits non-zero)."""
    proc = subprocess.run(
        [sys.executable, str(worker), str(out), *args],
        env=cpu_devices_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{worker.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(Path(out).read_text())


def run_processes(
    worker: Path, tmp_path: Path, *args: str, processes: int = 2, devices: int = 2
) -> list[dict]:
    """One multi-host job: ``processes`` copies of ``worker tmp_path/mh{i}.json *args i port``
    (``devices`` CPU devices each, one coordinator port); returns each process's JSON."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    outs = [tmp_path / f"mh{i}.json" for i in range(processes)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(outs[i]), *args, str(i), str(port)],
            env=cpu_devices_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, f"multihost {worker.name} failed:\n{log[-6000:]}"
    return [json.loads(out.read_text()) for out in outs]
