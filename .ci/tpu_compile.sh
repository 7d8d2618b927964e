#!/usr/bin/env bash
# CI step: the real TPU compiler, no TPU. Installs jax[tpu] (libtpu) at the jax version already
# installed and runs tests/test_tpu_compile.py: the fast kernel grid on v5e and v6e, the
# dispatch / swap / compile_check tests, the whole engine step of a Llama-3-8B-shaped
# config at tp=1 on v5e:2x2, and scripts/kernel_cycles.py end to end. Called from
# .ci/run inside its virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
JAX_VERSION="$(python -c 'import jax; print(jax.__version__)')"
python -m pip install -q "jax[tpu]==${JAX_VERSION}"
export JAX_PLATFORMS=cpu  # compile for abstract TPU devices; never bring up a TPU backend
# Fast grid + everything not marked slow in the file, then the Llama-3-8B engine check at tp=1
# (the weights fill most of one v5e chip, so the KV sizing and HBM fit are tested at their
# tightest; the sharded placement is compile_check's small model at tp=2 above, and the 8B at
# tp=4, ~280 s more, runs with `-m slow`).
pytest tests/test_tpu_compile.py -q -m "not slow"
pytest "tests/test_tpu_compile.py::test_llama3_8b_whole_step_compiles_on_v5e[1]" -q -m slow
# The static kernel report (scripts/kernel_cycles.py) end to end on one small v5e shape.
pytest tests/test_kernel_cycles.py -q -m slow -k "kernel_cycles_end_to_end"
# The kernels' static-schedule floor: ceilings and cycles within 5% of the recorded figures
# (bench/results/kernel_ceilings_ci.json), one shape per kernel in CI: Qwen2-7B's G = 7 at
# page 64, decode on v5e and v6e, prefill on v6e (its v5e prefill, ~60 s more, and the
# Llama-3-8B shape, ~130 s more, run with `-m slow`).
pytest tests/test_kernel_ceilings.py -q -m slow -k "qwen2_7b and (decode or v6e)"
