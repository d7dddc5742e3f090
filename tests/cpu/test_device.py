"""Device detection on fake sysfs, DMI and /dev trees and real environment variables."""

import json
import os
import subprocess
import sys
import threading

import pytest

from neuron_remat import device as dev
from neuron_remat.cli import main

from fake_hosts import dev_nodes, dmi, neuron_ls, neuron_sysfs

GiB = dev.GiB


def env(**values):
    """An environment with a PATH that finds no real neuron-ls."""
    base = {"PATH": "/nonexistent"}
    base.update(values)
    return base


# --- the override ----------------------------------------------------------------------


def test_override_instance_type_is_a_whole_trn2():
    spec = dev.detect(environ=env(NEURON_REMAT_DEVICE="trn2.48xlarge"))
    assert (spec.family, spec.instance_type, spec.lnc) == ("trn2", "trn2.48xlarge", 2)
    assert spec.cores == 64 and spec.cores_per_chip == 4
    assert spec.hbm_bytes_per_core == 24 * GiB
    assert spec.source == "override" and spec.is_neuron
    assert spec.evidence[0].decided


@pytest.mark.parametrize("text, cores, per_core, lnc", [
    ("trn2.48xlarge:lnc=1", 128, 12 * GiB, 1),
    ("trn2", 4, 24 * GiB, 2),
    ("trn2:lnc=1", 8, 12 * GiB, 1),
    ("trn2:hbm=64MiB", 4, 64 << 20, 2),
    ("trn2.48xlarge:hbm=1.5GiB:cores=8", 8, 3 << 29, 2),
    ("trn1.32xlarge", 32, 16 * GiB, None),
    ("inf2.xlarge", 2, 16 * GiB, None),
    ("trn3", 4, 36 * GiB, 2),
])
def test_override_forms(text, cores, per_core, lnc):
    spec = dev.detect(environ=env(NEURON_REMAT_DEVICE=text))
    assert (spec.cores, spec.hbm_bytes_per_core, spec.lnc) == (cores, per_core, lnc)


def test_override_lnc_follows_neuron_logical_nc_config():
    spec = dev.detect(environ=env(NEURON_REMAT_DEVICE="trn2.48xlarge",
                                  NEURON_LOGICAL_NC_CONFIG="1"))
    assert (spec.lnc, spec.cores, spec.hbm_bytes_per_core) == (1, 128, 12 * GiB)


def test_trn3_figures_are_marked_unverified_unless_hbm_given():
    assert not dev.parse_device("trn3").verified
    assert dev.parse_device("trn3:hbm=40GiB").verified
    assert dev.parse_device("trn2").verified
    assert not dev.parse_device("trn2.3xlarge").verified


def test_override_cpu_is_not_neuron():
    spec = dev.detect(environ=env(NEURON_REMAT_DEVICE="cpu"))
    assert spec.family == "cpu" and not spec.is_neuron and spec.source == "override"


@pytest.mark.parametrize("text, names", [
    ("trn9", ["'trn9'", "trn2", "trn2.48xlarge"]),
    ("trn2:lnc=3", ["lnc='3'", "1, 2"]),
    ("trn1:lnc=2", ["lnc=2", "trn1", "trn2"]),
    ("trn2:hbm=lots", ["'lots'", "GiB"]),
    ("trn2:hbm=0", ["positive"]),
    ("trn2:speed=fast", ["'speed=fast'", "lnc=1|2"]),
    ("trn2:lnc=1:lnc=2", ["twice"]),
    ("trn2:cores=-1", ["cores='-1'"]),
    ("cpu:lnc=1", ["cpu"]),
])
def test_malformed_override_names_the_value_and_the_valid_ones(text, names):
    with pytest.raises(ValueError) as err:
        dev.detect(environ=env(NEURON_REMAT_DEVICE=text))
    message = str(err.value)
    assert "NEURON_REMAT_DEVICE" in message
    for name in names:
        assert name in message


def test_from_instance_type():
    for name, facts in dev.INSTANCES.items():
        spec = dev.from_instance_type(name)
        chip = dev.CHIPS[facts.family]
        assert spec.cores == facts.chips * chip.cores_per_chip(spec.lnc)
        assert spec.hbm_bytes_per_core * spec.cores_per_chip == chip.hbm_bytes
    assert dev.from_instance_type("TRN2.48xlarge", lnc=1).cores == 128
    with pytest.raises(ValueError, match="unknown instance type 'p5.48xlarge'.*trn2.48xlarge"):
        dev.from_instance_type("p5.48xlarge")
    with pytest.raises(ValueError, match="lnc=3 is not valid for trn2; valid: 1, 2"):
        dev.from_instance_type("trn2.48xlarge", lnc=3)


def test_parse_bytes():
    assert dev.parse_bytes("64MiB") == 64 << 20
    assert dev.parse_bytes("24 GiB") == 24 * GiB
    assert dev.parse_bytes("2GB") == 2 * 10**9
    assert dev.parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="'12 parsecs' is not a size"):
        dev.parse_bytes("12 parsecs")


# --- JAX and the CPU fallback ----------------------------------------------------------


def test_cpu_laptop_detects_cpu_through_jax(tmp_path):
    spec = dev.detect(root=str(tmp_path), environ=env())
    assert spec.family == "cpu" and spec.source == "jax" and not spec.is_neuron
    steps = [e.step for e in spec.evidence]
    assert steps[:5] == ["override", "jax", "sysfs", "neuron-ls", "dmi"]
    assert "backend 'cpu'" in spec.evidence[1].found


def test_without_jax_nothing_found_is_cpu_by_default(tmp_path):
    spec = dev.detect(root=str(tmp_path), environ=env(), use_jax=False)
    assert (spec.family, spec.source) == ("cpu", "default")


# --- sysfs -----------------------------------------------------------------------------


def test_sysfs_trn2_instance(tmp_path):
    neuron_sysfs(tmp_path, chips=16)
    spec = dev.detect(root=str(tmp_path), environ=env())
    assert (spec.family, spec.source, spec.lnc) == ("trn2", "sysfs", 2)
    assert spec.cores == 64 and spec.hbm_bytes_per_core == 24 * GiB
    assert spec.instance_type is None
    assert any(e.step == "sysfs" and e.decided for e in spec.evidence)


def test_sysfs_lnc1_and_dmi_instance_type(tmp_path):
    neuron_sysfs(tmp_path, chips=16)
    dmi(tmp_path, "trn2.48xlarge")
    spec = dev.detect(root=str(tmp_path), environ=env(NEURON_LOGICAL_NC_CONFIG="1"))
    assert spec.lnc == 1 and spec.cores == 128 and spec.hbm_bytes_per_core == 12 * GiB
    assert spec.instance_type == "trn2.48xlarge" and spec.source == "sysfs"


def test_sysfs_trn1(tmp_path):
    neuron_sysfs(tmp_path, chips=16, arch_type="Trn1", device_name="Trainium", core_count=2)
    spec = dev.detect(root=str(tmp_path), environ=env(NEURON_LOGICAL_NC_CONFIG="2"))
    assert (spec.family, spec.lnc, spec.cores) == ("trn1", None, 32)
    assert spec.hbm_bytes_per_core == 16 * GiB


def test_unreadable_sysfs_files_fall_back_to_the_next_evidence(tmp_path):
    neuron_sysfs(tmp_path, chips=1)
    arch = tmp_path / "sys/devices/virtual/neuron_device/neuron0/info/architecture"
    for name in ("arch_type", "device_name"):
        (arch / name).unlink()
        (arch / name).mkdir()  # reading a directory fails with an OSError, even as root
    dmi(tmp_path, "trn2.3xlarge")
    spec = dev.detect(root=str(tmp_path), environ=env())
    assert spec.family == "trn2" and spec.source == "dmi" and spec.cores == 4
    assert "family not recognised" in next(e.found for e in spec.evidence if e.step == "sysfs")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads mode-0400 files regardless")
def test_mode_0400_sysfs_files_are_skipped_as_non_root(tmp_path):
    neuron_sysfs(tmp_path, chips=2)
    arch = tmp_path / "sys/devices/virtual/neuron_device/neuron0/info/architecture"
    for name in ("arch_type", "device_name"):
        os.chmod(arch / name, 0o000)
    dmi(tmp_path, "trn2.48xlarge")
    spec = dev.detect(root=str(tmp_path), environ=env())
    assert spec.source == "dmi" and spec.family == "trn2"


# --- neuron-ls -------------------------------------------------------------------------


def test_neuron_ls_answers_when_sysfs_cannot(tmp_path):
    dev_nodes(tmp_path, 16)
    bindir = neuron_ls(tmp_path / "bin")
    spec = dev.detect(root=str(tmp_path), environ=env(PATH=str(bindir)))
    assert (spec.family, spec.source, spec.lnc, spec.cores) == ("trn2", "neuron-ls", 2, 64)
    assert spec.hbm_bytes_per_core == 24 * GiB  # 103079215104 B / 4 cores, measured


def test_neuron_ls_in_opt_aws_neuron_bin(tmp_path):
    dev_nodes(tmp_path, 1)
    neuron_ls(tmp_path / "opt/aws/neuron/bin", chips=1, nc=8, lnc=1)
    spec = dev.detect(root=str(tmp_path), environ=env())
    assert (spec.source, spec.lnc, spec.cores, spec.hbm_bytes_per_core) == (
        "neuron-ls", 1, 8, 12 * GiB)


@pytest.mark.parametrize(("memory", "nc", "lnc", "family"), [
    (32 * GiB, 2, 1, "trn1"),   # Trn1 has no logical-core configuration
    (96 * GiB, 4, 0, "trn2"),   # Trn2's are 1 and 2
])
def test_neuron_ls_lnc_the_chip_cannot_have_is_noted_not_raised(tmp_path, memory, nc, lnc,
                                                                family):
    dev_nodes(tmp_path, 16)
    bindir = neuron_ls(tmp_path / "bin", nc=nc, memory=memory, lnc=lnc)
    spec = dev.detect(root=str(tmp_path), environ=env(PATH=str(bindir)), use_jax=False)
    # trn1: 2 physical cores of 16 GiB per chip; trn2: its default LNC=2, 4 x 24 GiB
    assert (spec.family, spec.lnc, spec.cores, spec.hbm_bytes_per_core) == (
        family, None if family == "trn1" else 2, 16 * nc, 16 * GiB if family == "trn1"
        else 24 * GiB)
    assert any(e.step == "neuron-ls" and f"LNC {lnc} ignored" in e.found for e in spec.evidence)


def test_neuron_ls_hbm_per_core_follows_its_lnc_not_its_core_count(tmp_path):
    # A report whose core count disagrees with its LNC: 96 GiB over LNC=2's 4 cores is 24 GiB
    # (96 / 8 = 12 GiB would leave half the chip unplanned); the disagreement is noted.
    dev_nodes(tmp_path, 16)
    bindir = neuron_ls(tmp_path / "bin", nc=8, lnc=2)
    spec = dev.detect(root=str(tmp_path), environ=env(PATH=str(bindir)), use_jax=False)
    assert (spec.lnc, spec.cores, spec.hbm_bytes_per_core) == (2, 64, 24 * GiB)
    assert any("128 cores counted on 16 chips" in e.found for e in spec.evidence)


def test_neuron_ls_not_run_without_device_nodes(tmp_path):
    bindir = neuron_ls(tmp_path / "bin")
    spec = dev.detect(root=str(tmp_path), environ=env(PATH=str(bindir)))
    assert spec.family == "cpu"
    assert "no /dev/neuron*" in next(e.found for e in spec.evidence if e.step == "neuron-ls")


_GARBLED = {  # what a broken neuron-ls might print; each is unusable, none may crash
    "garbage": "neuron-ls: this is not JSON",
    "wrong-shape": '{"nc_count": 4}',
    "not-utf8": b"\xff\xfe\x00garbage\n",
    "huge-float": '[{"nc_count": 1e400, "memory_size": 103079215104}]',
    "booleans": '[{"nc_count": 4, "memory_size": true, "logical_neuroncore_config": true}]',
    "deep": "[" * 100000 + "]" * 100000,
}


@pytest.mark.parametrize("case", ["missing", "hangs", *_GARBLED])
def test_bad_neuron_ls_falls_back_to_dmi(tmp_path, case):
    dev_nodes(tmp_path, 16)
    dmi(tmp_path, "trn2.48xlarge")
    bindir = tmp_path / "bin"
    if case == "hangs":
        neuron_ls(bindir, sleep=30)
    elif case in _GARBLED:
        neuron_ls(bindir, output=_GARBLED[case])
    else:
        bindir.mkdir()
    spec = dev.detect(root=str(tmp_path), environ=env(PATH=str(bindir)),
                      neuron_ls_timeout=0.5)
    assert (spec.family, spec.source, spec.cores) == ("trn2", "dmi", 64)
    note = next(e.found for e in spec.evidence if e.step == "neuron-ls")
    expected = {"missing": "not found", "hangs": "timed out"}.get(case, "unusable")
    assert expected in note


# --- DMI -------------------------------------------------------------------------------


def test_dmi_trn1(tmp_path):
    dmi(tmp_path, "trn1.32xlarge")
    spec = dev.detect(root=str(tmp_path), environ=env(), use_jax=False)
    assert (spec.family, spec.instance_type, spec.source, spec.cores) == (
        "trn1", "trn1.32xlarge", "dmi", 32)
    assert spec.hbm_bytes_per_core == 16 * GiB


def test_dmi_of_a_non_neuron_instance_is_cpu(tmp_path):
    dmi(tmp_path, "m7i.large")
    spec = dev.detect(root=str(tmp_path), environ=env())
    assert spec.family == "cpu"
    assert "not a Neuron instance" in next(e.found for e in spec.evidence if e.step == "dmi")


# --- visible cores ---------------------------------------------------------------------


@pytest.mark.parametrize("variables, cores", [
    ({"NEURON_RT_VISIBLE_CORES": "0-3"}, 4),
    ({"NEURON_RT_VISIBLE_CORES": "7"}, 1),
    ({"NEURON_RT_VISIBLE_CORES": "0,2,4-7"}, 6),
    ({"NEURON_RT_NUM_CORES": "16"}, 16),
    ({"NEURON_RT_VISIBLE_CORES": "0-1", "NEURON_RT_NUM_CORES": "32"}, 2),
])
def test_visible_cores(tmp_path, variables, cores):
    dmi(tmp_path, "trn2.48xlarge")
    spec = dev.detect(root=str(tmp_path), environ=env(**variables))
    assert spec.cores == cores
    assert spec.cores_per_chip == 4 and spec.hbm_bytes_per_core == 24 * GiB


@pytest.mark.parametrize("variables, words", [
    ({"NEURON_RT_VISIBLE_CORES": "all"}, ["'all'", "'0-3'"]),
    ({"NEURON_RT_VISIBLE_CORES": "5-2"}, ["'5-2'", "backwards"]),
    ({"NEURON_RT_VISIBLE_CORES": "0-100"}, ["core 100", "0-63"]),
    ({"NEURON_RT_VISIBLE_CORES": "1,1"}, ["twice"]),
    ({"NEURON_RT_NUM_CORES": "many"}, ["'many'", "positive integer"]),
    ({"NEURON_RT_NUM_CORES": "65"}, ["65", "1-64"]),
    ({"NEURON_LOGICAL_NC_CONFIG": "4"}, ["NEURON_LOGICAL_NC_CONFIG='4'", "1, 2"]),
])
def test_garbage_runtime_variables_are_value_errors(tmp_path, variables, words):
    dmi(tmp_path, "trn2.48xlarge")
    with pytest.raises(ValueError) as err:
        dev.detect(root=str(tmp_path), environ=env(**variables))
    for word in words:
        assert word in str(err.value)


# --- caching ---------------------------------------------------------------------------


def test_detect_is_cached_until_refresh(tmp_path):
    first = dev.detect(root=str(tmp_path), environ=env())
    assert first.family == "cpu"
    dmi(tmp_path, "trn2.48xlarge")  # the machine changes under the cache
    assert dev.detect(root=str(tmp_path), environ=env()) is first
    fresh = dev.detect(root=str(tmp_path), environ=env(), refresh=True)
    assert fresh.family == "trn2" and fresh is not first
    assert dev.detect(root=str(tmp_path), environ=env()) is fresh


def test_a_changed_variable_is_a_new_answer(tmp_path):
    a = dev.detect(root=str(tmp_path), environ=env())
    b = dev.detect(root=str(tmp_path), environ=env(NEURON_REMAT_DEVICE="trn2"))
    assert a.family == "cpu" and b.family == "trn2"


def test_detect_is_thread_safe(tmp_path):
    dmi(tmp_path, "trn2.48xlarge")
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        dev.detect(root=str(tmp_path), environ=env()))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(r is results[0] for r in results)


def test_spec_is_frozen_and_json_ready():
    spec = dev.parse_device("trn2.48xlarge")
    with pytest.raises(AttributeError):
        spec.cores = 1  # type: ignore[misc]
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["hbm_gib_per_core"] == 24.0 and data["is_neuron"]


# --- the CLI ---------------------------------------------------------------------------


def test_cli_detect_json_with_override(monkeypatch, capsys):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    assert main(["detect", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["family"], data["cores"], data["hbm_bytes_per_core"], data["source"]) == (
        "trn2", 64, 24 * GiB, "override")


def test_cli_detect_text_on_this_machine(capsys):
    assert main(["detect"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu:") and "evidence" in out and "* jax:" in out


def test_python_dash_m_detect_says_cpu():
    run = subprocess.run([sys.executable, "-m", "neuron_remat", "detect", "--json"],
                         capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items()
                              if not k.startswith("NEURON_")})
    assert json.loads(run.stdout)["family"] == "cpu"


def test_cli_bad_override_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn9")
    assert main(["detect"]) == 2
    assert "unknown device 'trn9'" in capsys.readouterr().err


# --- Trn1 or Inf2 ----------------------------------------------------------------------


def test_a_32_gib_neuron_ls_device_is_inf2_when_sysfs_or_dmi_says_so(tmp_path):
    dev_nodes(tmp_path, 1)
    bindir = neuron_ls(tmp_path / "bin", chips=1, nc=2, memory=32 * GiB, lnc=None)
    alone = dev.detect(root=str(tmp_path), environ=env(PATH=str(bindir)), use_jax=False)
    assert (alone.family, alone.source) == ("trn1", "neuron-ls")  # nothing else to go on
    dmi(tmp_path, "inf2.xlarge")
    spec = dev.detect(root=str(tmp_path), environ=env(PATH=str(bindir)), use_jax=False,
                      refresh=True)
    assert (spec.family, spec.instance_type, spec.source, spec.cores) == (
        "inf2", "inf2.xlarge", "dmi", 2)
    assert spec.hbm_bytes_per_core == 16 * GiB


def test_dmi_from_another_vendor_is_ignored(tmp_path):
    dmi(tmp_path, "trn2.48xlarge", vendor="QEMU")
    spec = dev.detect(root=str(tmp_path), environ=env(), use_jax=False)
    assert spec.family == "cpu"
    assert "not Amazon EC2" in next(e.found for e in spec.evidence if e.step == "dmi")
