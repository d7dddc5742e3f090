#!/usr/bin/env bash
# CI step: the version-sensitive tests on the JAX that Python 3.12 installs today (pip picks
# the newest JAX setup.cfg allows; 0.12.x at the time of writing), in its own virtual
# environment. Skips, with a message, where no python3.12 exists (PYTHON312 names one).
# Fails when a test fails, or when nothing is collected (pytest's exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=
candidates=("${PYTHON312:-}" "$(command -v python3.12 || true)")
if command -v pyenv > /dev/null; then
    candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12)
fi
for c in "${candidates[@]}"; do  # the first that runs (a pyenv shim may not)
    if [ -n "$c" ] && "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null
    then
        PY=$c
        break
    fi
done
if [ -z "$PY" ]; then
    echo "CI py312: skipped: no working python3.12 found (set PYTHON312 to one)"
    exit 0
fi
DIR=.ci-venv-jax-py312
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --upgrade pip
"$DIR/bin/python" -m pip install --quiet ".[test]"
"$DIR/bin/python" -c "import sys, jax; print('py312: Python', sys.version.split()[0], 'JAX', jax.__version__)"
TESTS=(tests/cpu/test_policies.py tests/cpu/test_trace.py tests/cpu/test_plugin.py
       tests/cpu/test_jax_versions.py tests/cpu/test_regex_safety.py)
rc=0
"$DIR/bin/python" -m pytest -q "${TESTS[@]}" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "CI py312: collected no tests: ${TESTS[*]}" >&2
    exit 1
fi
exit "$rc"
