#!/usr/bin/env bash
# Build the Python 3.12 environment in which MaxText 0.2.5's real training step runs
# (tests/cpu/maxtext_zoo.py, tests/cpu/test_maxtext_real.py, benchmarks/maxtext_fit.py).
#
#   .ci/maxtext_env.sh [VENV_DIR] [PYTHON3.12]     (defaults: /work/venvs/mt312, python3.12)
#
# How the pins were found: `pip install --no-deps maxtext==0.2.5`, then JAX 0.11.1 (MaxText
# 0.2.5's TPU extra asks jax>=0.11.1; flax 0.12.9 needs jax>=0.11.1, and its nnx does not
# import on JAX 0.11.2, which renamed jax.experimental.hijax.HiPrimitive), flax 0.12.9,
# optax 0.2.8, pytest, hypothesis, then each module that importing maxtext.models.models,
# maxtext.configs.pyconfig and maxtext.trainers.pre_train.train asked for (jinja2,
# pathwaysutils, qwix, aqtp, omegaconf, tokamax, huggingface_hub, transformers, grain,
# drjax, pillow, tiktoken, sentencepiece, sympy), with their dependencies.
# pytest-xdist 3.8.0 and execnet 2.1.2 joined later (CI runs the tests on two processes).
# .ci/maxtext-requirements.txt is `pip freeze` of the result: installed here with
# --no-deps, so the environment is exactly that one. Every step is checked (set -e).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-/work/venvs/mt312}
PY=${2:-python3.12}
"$PY" -c "import sys; assert sys.version_info[:2] == (3, 12), sys.version"
"$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install --quiet --upgrade pip
# --no-compile: pip writes no bytecode for the ~130 packages (transformers alone holds
# thousands of modules); Python compiles what the tests import, when they import it.
"$DIR/bin/python" -m pip install --quiet --no-compile --no-deps -r .ci/maxtext-requirements.txt
"$DIR/bin/python" -m pip install --quiet --no-compile --no-deps maxtext==0.2.5
"$DIR/bin/python" -m pip install --quiet --no-deps -e .
"$DIR/bin/python" -m pip check > /dev/null || true  # MaxText's extras pin newer JAX: not fatal
"$DIR/bin/python" - <<'EOF'
import sys
sys.path.insert(0, "tests/cpu")
import maxtext_zoo
why = maxtext_zoo.available()
if why is not None:
    raise SystemExit(f"maxtext_env: {why}")
import jax, maxtext.version
print("maxtext_env: Python", sys.version.split()[0], "JAX", jax.__version__,
      "MaxText", maxtext.version.__version__)
EOF
