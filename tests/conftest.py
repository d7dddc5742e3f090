"""Shared test set-up: every test starts with no neuron_remat override in the environment
and with empty caches.

XLA:CPU compiles here with LLVM's optimisation off (``--xla_backend_optimization_level=0
--xla_llvm_disable_expensive_passes=true``, the flags benchmarks/fit_sweep.py compiles its
brute force with), unless `XLA_FLAGS` already sets the level or the machine has Neuron
devices. The tests compile hundreds of programs and read `memory_analysis()` and
`cost_analysis()`, which XLA computes from the optimised HLO before LLVM runs: the level
changes neither (the fit demo's figures are the same at both levels) and takes about 40%
off each compile's CPU time. With the brute force's flags, the benchmark smoke run's
`fit_sweep.py --small` reads the committed compile tables instead of compiling them again
(46 s -> 4 s). Subprocesses inherit them.
"""

import glob
import os

import pytest

_LEVEL = "--xla_backend_optimization_level"
if _LEVEL not in os.environ.get("XLA_FLAGS", "") and not glob.glob("/dev/neuron[0-9]*"):
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} {_LEVEL}=0 "
                               "--xla_llvm_disable_expensive_passes=true").strip()

from neuron_remat import device, plugin  # noqa: E402  (after XLA_FLAGS)

_ENV = ("NEURON_REMAT_DEVICE", "NEURON_REMAT_DISABLE", "NEURON_REMAT_STRICT",
        "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    device._CACHE.clear()
    plugin.clear_cache()
    yield
    device._CACHE.clear()
    plugin.clear_cache()


def pytest_collection_modifyitems(config, items):
    """Tests that use test_fit.py's brute force (every save set of the fit demo compiled,
    the longest set-up in the suite) are slow, wherever they are."""
    for item in items:
        if "brute" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
