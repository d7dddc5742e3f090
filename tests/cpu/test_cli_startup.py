"""The CLI's cheap commands do not import JAX (it takes seconds to load): each is run in a
fresh interpreter and its loaded modules are read afterwards."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

RUN = """
import json, runpy, sys
sys.argv = ["neuron_remat", *json.loads(sys.argv[1])]
try:
    runpy.run_module("neuron_remat", run_name="__main__", alter_sys=True)
except SystemExit as stop:
    code = stop.code
print(json.dumps({"exit": code,
                  "jax": sorted(m for m in sys.modules if m == "jax" or m.startswith("jax."))}))
"""


def _run(args):
    run = subprocess.run([sys.executable, "-c", RUN, json.dumps(args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stdout


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["fit", "--help"],
                                  ["audit", "--help"], ["models"]])
def test_cheap_commands_do_not_import_jax(args):
    result, out = _run(args)
    assert result["exit"] in (0, None), out
    assert result["jax"] == [], f"{args} imported {result['jax'][:5]}"


def test_planning_does_import_jax():
    # The probe above can see JAX: a command that builds a policy loads it.
    result, out = _run(["plan", "--model", "llama3-8b", "--json"])
    assert result["exit"] in (0, None), out
    assert "jax" in result["jax"]


def test_package_names_load_on_first_use():
    code = ("import sys, types, neuron_remat as nr\n"
            "assert 'jax' not in sys.modules\n"
            "import neuron_remat._audit, neuron_remat._fit\n"
            "assert isinstance(nr.audit, types.FunctionType), nr.audit\n"
            "assert isinstance(nr.fit, types.FunctionType), nr.fit\n"
            "assert nr.get_model('fuji-70b').layers == 80\n"
            "assert set(nr.__all__) <= set(dir(nr))\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
