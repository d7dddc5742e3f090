"""On a trn2 instance: `fit` on the Neuron backend either compiles the step and measures
what the compiler allocates, or, where the Neuron PJRT plugin has no
``memory_analysis()``, falls back to the traced graph and says so in a note (and a log
line). A small scanned decoder (two layers, three tags) keeps the compiles short."""

import dataclasses
import logging
import pathlib
import sys

import neuron_remat as nr

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples import fit_demo  # noqa: E402

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
    assert set(plan.saved_tags) <= {"q_proj", "o_proj", "linear1_0"}
