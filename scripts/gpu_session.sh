#!/usr/bin/env bash
# One command for a lent GPU (no network, nothing installed): environment, kernel checks and
# timings (scripts/gpu_check.py), then the engine on a Llama-3-8B-shaped model
# (scripts/gpu_session.py). JSON lines in $OUT (or --out DIR), at most six files.
#   bash scripts/gpu_session.sh            # about ten minutes on an H200
#   bash scripts/gpu_session.sh --dry-run  # CPU, toy sizes
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" scripts/gpu_session.py "$@"
