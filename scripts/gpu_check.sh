#!/usr/bin/env bash
# One command for a short visit to a Hopper GPU machine (no network, nothing installed):
# check every Mosaic GPU kernel against its oracle, then time it (scripts/gpu_check.py).
#   bash scripts/gpu_check.sh --quick     # about 3 minutes
#   bash scripts/gpu_check.sh             # the full grid
# Runs the machine's own python3 and JAX (override with PYTHON=...); the repository comes in
# through PYTHONPATH. Results: JSON lines in $OUT (or --out DIR). A hang recorded by the
# watchdog (exit status 3) is resumed with the cases not yet recorded, at most twice.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
"$PY" scripts/gpu_check.py "$@"
rc=$?
for _ in 1 2; do
  [ "$rc" -eq 3 ] || break
  echo "gpu_check: a case hung (recorded); resuming with the rest" >&2
  "$PY" scripts/gpu_check.py --resume "$@"
  rc=$?
done
exit "$rc"
