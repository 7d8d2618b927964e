#!/usr/bin/env bash
# One command on a GPU machine (H100/H200): compile the Mosaic GPU paged attention kernels,
# check them against the oracles, and time them against the XLA reference and JAX's bundled
# GPU paged attention. Extra arguments go to scripts/gpu_check.py (--quick, --out DIR, ...).
#   bash scripts/gpu_check.sh            # ~3-5 min on an H200
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$PY" scripts/gpu_check.py "$@"
