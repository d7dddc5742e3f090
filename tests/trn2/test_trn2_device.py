"""On a trn2 instance: detection agrees with what the Neuron runtime reports."""

import os

import jax

from neuron_remat import device as dev


def test_detect_says_trn2():
    spec = dev.detect(refresh=True)
    assert spec.family == "trn2", spec.describe()
    assert spec.source == "jax" and spec.device_kind in ("NC_v3", "NC_v3d")


def test_core_count_matches_jax():
    spec = dev.detect(refresh=True)
    assert spec.cores == jax.local_device_count()
    if jax.process_count() == 1:
        assert spec.cores == jax.device_count()


def test_hbm_per_core_matches_lnc():
    spec = dev.detect(refresh=True)
    lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
    assert spec.lnc == lnc
    assert spec.hbm_bytes_per_core == {1: 12, 2: 24}[lnc] * dev.GiB
    assert spec.device_kind == {1: "NC_v3", 2: "NC_v3d"}[lnc]
