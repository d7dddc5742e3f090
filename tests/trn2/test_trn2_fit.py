"""On a trn2 instance: `fit` on the Neuron backend either compiles the step and measures
what the compiler allocates, or, where the Neuron PJRT plugin has no
``memory_analysis()``, falls back to the traced graph and says so in a note (and a log
line). A small scanned decoder (two layers, three tags) keeps the compiles short."""

import dataclasses
import importlib
import logging
import pathlib
import sys

import neuron_remat as nr

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples import fit_demo  # noqa: E402

F = importlib.import_module("neuron_remat._fit")

CONFIG = dataclasses.replace(
    fit_demo.SMALL, layers=2, tags=dataclasses.replace(
        fit_demo.SMALL.tags, k_proj=None, context=None, linear1_1=None))


def test_fit_measures_or_falls_back_with_a_note(caplog):
    make_step = fit_demo.make_step_factory(CONFIG)
    args = fit_demo.abstract_args(CONFIG, batch=1, seq=128)
    spec = nr.detect(refresh=True)
    assert spec.is_neuron and spec.hbm_bytes_per_core
    with caplog.at_level(logging.INFO, logger="neuron_remat.fit"):
        plan = nr.fit(make_step, *args, device=spec, max_compiles=3)
    rec = plan.compiled
    assert rec is not None and rec.compiles >= 1
    if rec.measured:
        assert 0 < rec.bytes <= rec.limit_bytes
        assert all(p.bytes > 0 for p in rec.probes)
    else:
        assert any("cannot report a compiled step's memory" in n for n in plan.notes)
        assert "memory_analysis" in caplog.text
        assert 0 < rec.bytes <= rec.limit_bytes  # the uncalibrated prediction
    if rec.measured:
        # The chosen set's step, compiled here on its own, allocates what fit recorded.
        m = make_step(plan.policy).lower(*args).compile().memory_analysis()
        assert rec.bytes == (m.argument_size_in_bytes + m.output_size_in_bytes
                             + m.temp_size_in_bytes - m.alias_size_in_bytes)
    # The step's three tags, read from the trace: the plan names those and no others.
    assert F.step_graph(make_step, *args).tags == ("q_proj", "o_proj", "linear1_0")
