"""The wording of the reports: device lines, model listing, tag columns."""

import json

import pytest

import neuron_remat as nr
from neuron_remat._format import describe_device, tag_list
from neuron_remat.cli import main


def test_device_line_counts_and_sizes_in_words():
    one = nr.parse_device("trn2.48xlarge:hbm=64MiB:cores=1", source="test")
    assert "1 core visible" in describe_device(one) and "64 MiB HBM per core" in describe_device(one)
    full = nr.from_instance_type("trn2.48xlarge")
    assert "64 cores visible" in describe_device(full) and "24 GiB HBM" in describe_device(full)
    cpu = nr.parse_device("cpu")
    line = describe_device(cpu)
    assert "no HBM figure" in line and "0 GiB" not in line and "cores" not in line


def test_cli_detect_wording(monkeypatch, capsys):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge:hbm=64MiB:cores=1")
    assert main(["detect"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "1 core visible" in first and "64 MiB HBM per core" in first, first


def test_models_lists_the_readme_default_and_every_alias(capsys):
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert "fuji-70b-v3 (also fuji-70b)" in text
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["fuji-70b-v3"]["aliases"] == ["fuji-70b"]
    for alias in ("fuji-70b", "fuji-7b", "mixtral", "llama-4-scout"):  # each resolves
        assert nr.get_model(alias).name in rows


@pytest.mark.parametrize("tags, width, expected", [
    ((), None, "nothing"),
    (("MultiheadAttention.q_proj", "TransformerFeedForwardLayer.linear1_0"), None,
     "q_proj, linear1_0"),
    (("A.x", "B.x"), None, "A.x, B.x"),  # shortening would merge them: kept whole
    (tuple(f"MultiheadAttention.t{i}" for i in range(20)), 30, "t0, t1, t2, t3, t4 +15 more"),
    (("a" * 40, "b"), 10, "a" * 40 + " +1 more"),
])
def test_tag_list(tags, width, expected):
    assert tag_list(tags, width) == expected
    if width is not None and len(expected.split(" +")[0].split(", ")) > 1:
        assert len(expected) <= width


def test_fmt_seconds_picks_the_unit():
    from neuron_remat._format import fmt_seconds

    assert [fmt_seconds(s) for s in (0.0000926, 0.00174, 2.5)] == ["92.6 us", "1.74 ms",
                                                                  "2.5 s"]
