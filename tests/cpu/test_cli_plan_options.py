"""`neuron-remat plan --objective {time,flops} --per-layer --max-sets N`: the options reach
the planner and show in the table and in --json; bad values are refused in one line.

The per-layer figures are checked by arithmetic on what the JSON states (the mix covers
every layer, keeps within the layers' budget, recomputes no more than the uniform set) and
against the Python API given the same inputs; no subprocess, `main(argv)` in-process."""

from __future__ import annotations

import json

import pytest

import neuron_remat as nr
from neuron_remat import device as dev
from neuron_remat.cli import main

# llama3-8b at 8 GiB per core of a trn2.48xlarge: between full remat and every tag, where
# the per-layer mix differs from the uniform set.
BASE = ["plan", "--model", "llama3-8b", "--device", "trn2.48xlarge:hbm=8GiB"]


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(dev.OVERRIDE_ENV, raising=False)
    for var in ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES"):
        monkeypatch.delenv(var, raising=False)


def _json(argv, capsys):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_per_layer_plan_in_json_and_table(capsys):
    out = _json([*BASE, "--per-layer", "--objective", "flops"], capsys)
    assert out["objective"] == "flops" and out["per_layer"] is True and out["max_sets"] == 2
    mix = out["layer_mix"]
    layers = out["layers_per_core"]
    assert 2 <= len(mix) <= 2 and sum(m["layers"] for m in mix) == layers
    # within the budget the uniform plan had, all layers together
    kept = sum(m["kept_bytes_per_layer"] * m["layers"] for m in mix)
    assert kept == out["mixed"]["kept_bytes"] <= out["budget_bytes_per_layer"] * layers
    # recomputes less than the uniform set, by the sum of its layers' recompute
    total = sum(m["recompute_flops_per_layer"] * m["layers"] for m in mix)
    assert total == pytest.approx(out["mixed"]["recompute_flops"])
    assert total < out["recompute_flops_per_layer"] * layers
    # what the API answers for the same inputs
    model = nr.get_model("llama3-8b")
    api = nr.plan(nr.parse_device("trn2.48xlarge:hbm=8GiB"), model,
                  nr.StepShape(seq_len=model.default_seq_len, micro_batch=1),
                  nr.Parallelism(tp=4, fsdp=-1, sequence_parallel=True),
                  objective="flops", per_layer=True)
    assert [(list(m.tags), m.layers) for m in api.layer_mix] == \
        [(m["tags"], m["layers"]) for m in mix]

    assert main([*BASE, "--per-layer", "--objective", "flops"]) == 0
    text = capsys.readouterr().out
    assert "objective: flops; per layer (at most 2 sets)" in text
    assert sum(line.startswith("per-layer plan: ") for line in text.splitlines()) == 3


def test_max_sets_one_is_the_uniform_set_and_none_is_free(capsys):
    one = _json([*BASE, "--per-layer", "--objective", "flops", "--max-sets", "1"], capsys)
    assert one["max_sets"] == 1 and len(one["layer_mix"]) == 1
    assert one["layer_mix"][0]["recompute_flops_per_layer"] == one["recompute_flops_per_layer"]
    free = _json([*BASE, "--per-layer", "--objective", "flops", "--max-sets", "none"], capsys)
    assert free["max_sets"] is None
    two = _json([*BASE, "--per-layer", "--objective", "flops"], capsys)
    # more freedom never recomputes more
    assert free["mixed"]["recompute_flops"] <= two["mixed"]["recompute_flops"] \
        <= one["mixed"]["recompute_flops"]


def test_objective_reaches_the_plan(capsys):
    time = _json([*BASE, "--objective", "time"], capsys)
    flops = _json([*BASE, "--objective", "flops"], capsys)
    assert time["objective"] == "time" and flops["objective"] == "flops"
    assert "layer_mix" not in time and time["per_layer"] is False and time["max_sets"] is None
    assert main([*BASE, "--objective", "time"]) == 0
    assert "objective: time" in capsys.readouterr().out


@pytest.mark.parametrize("extra, named", [
    (["--objective", "fast"], "'fast'"),
    (["--per-layer", "--max-sets", "0"], "0"),
    (["--per-layer", "--max-sets", "two"], "'two'"),
    (["--max-sets", "3"], "--max-sets 3"),
])
def test_bad_values_one_line(extra, named, capsys):
    assert main([*BASE, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and named in err, err
    assert main([*BASE, *extra, "--json"]) == 2
    assert named in json.loads(capsys.readouterr().out)["error"]
