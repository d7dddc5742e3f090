"""tests/trn2/test_trn2_memory.py's check on XLA:CPU: the analytic plan for a step sized to
~70% of a simulated 12 GiB TRN2 core (LNC=1) against the compiled step's memory_analysis().
Compile only: nothing is allocated."""

import dataclasses
import importlib.util
import pathlib

import neuron_remat as nr

_PATH = pathlib.Path(__file__).resolve().parents[1] / "trn2" / "test_trn2_memory.py"
_spec = importlib.util.spec_from_file_location("trn2_memory", _PATH)
trn2_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trn2_memory)


def test_predicted_step_memory_matches_the_cpu_compile():
    spec = dataclasses.replace(nr.parse_device("trn2.48xlarge:lnc=1", source="test"),
                               cores=1)
    hbm, predicted, got = trn2_memory.predicted_and_measured(spec, run=False)
    assert hbm == 12 << 30 and "compiled" in got, got
    trn2_memory.check(hbm, predicted, got)
