"""Shared test set-up: every test starts with no neuron_remat override in the environment
and with empty caches."""

import pytest

from neuron_remat import device, plugin

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
