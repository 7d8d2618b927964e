#!/usr/bin/env bash
# CI, second run: the whole default test suite on the NEWEST JAX release, in a fresh venv.
#
# Python 3.12 resolves the newest jax/jaxlib that pyproject.toml allows (the first run in
# .ci/run uses python3.11, which resolves the oldest supported release, JAX 0.10.2).
# Override the interpreter with NEWEST_PYTHON (default: pyenv's 3.12.1 through python3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYENV_VERSION="${PYENV_VERSION:-3.12.1}"
py="${NEWEST_PYTHON:-python3.12}"
venv=/tmp/paxcache-ci-venv-newest
rm -rf "$venv"
"$py" -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install -q --upgrade pip
pip install -q -e '.[test]'
python -c "import jax, jaxlib, sys; print('newest JAX run: python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
start=$SECONDS
pytest
echo "newest JAX suite: $((SECONDS - start)) s"
