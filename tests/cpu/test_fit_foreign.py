"""`fit` on training steps written in other libraries' styles (tests/cpu/foreign_zoo.py:
Flax linen, Equinox, Flax nnx, pure JAX), none looked at while `fit` was tuned: at a
limit halfway from full remat to no remat, both compiled here, the plan fits and states its own
policy's compile, XLA's figures read here. Compiles several programs: marked slow. The
sweep against the brute force is `benchmarks/fit_sweep.py --steps-module
tests.cpu.foreign_zoo`."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
pytest.importorskip("flax")
pytest.importorskip("equinox")

import neuron_remat as nr  # noqa: E402
from xla_figures import compiled_bytes  # noqa: E402

import foreign_zoo  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("name", list(foreign_zoo.STEPS))
def test_fit_plans_a_foreign_step_within_the_limit(name):
    spec = foreign_zoo.STEPS[name]
    make, args = spec.make_step(), spec.abstract_args()

    def xla_bytes(policy):
        return compiled_bytes(make(policy).lower(*args).compile())

    full = xla_bytes(jax.checkpoint_policies.nothing_saveable)
    none = xla_bytes(jax.checkpoint_policies.everything_saveable)
    limit = (full + none) // 2
    device = nr.parse_device(f"trn2.48xlarge:hbm={limit}B:cores=1", source="test")
    plan = nr.fit(make, *args, device=device, reserve=0, progress=lambda line: None)
    assert plan.compiled.measured
    assert xla_bytes(plan.policy) == plan.compiled.bytes <= limit
    assert plan.saved_tags, "halfway to no remat, some tag fits"


@pytest.mark.slow
@pytest.mark.parametrize("oracle", [None, "figures", "bare"])
def test_where_no_remat_fits_the_compile_with_fewer_flops_is_chosen(oracle):
    """haiku-free-mixer keeps bfloat16 converts without remat: XLA counts more FLOPs for
    no remat than for saving every tag (compiled here). Where both fit, fit returns the
    set that compiles to fewer FLOPs, with a note, with memory figures and with the
    compile as the oracle (simulated: `zoo.OomOracleSimulation`), its out-of-memory
    errors with the program's bytes or bare."""
    import re

    import zoo

    spec = foreign_zoo.STEPS["haiku-free-mixer"]
    make, args = spec.make_step(), spec.abstract_args()

    def figures(policy):
        compiled = make(policy).lower(*args).compile()
        return compiled_bytes(compiled), compiled.cost_analysis()["flops"]

    tags = ("token_mixing.fc1", "token_mixing.fc2", "channel_mixing.fc1",
            "channel_mixing.fc2")  # the step's matmul tags (its GELU tags save nothing)
    every = nr.RegexPolicy([re.escape(t) for t in tags])
    none_bytes, none_flops = figures(jax.checkpoint_policies.everything_saveable)
    every_bytes, every_flops = figures(every)
    assert every_flops < none_flops and every_bytes < none_bytes
    limit = none_bytes + (1 << 20)
    device = nr.parse_device(f"trn2.48xlarge:hbm={limit}B:cores=1", source="test")
    chosen = zoo.oracle_make_step(make, limit, figures=oracle == "figures") if oracle else make
    plan = nr.fit(chosen, *args, device=device, reserve=0, progress=lambda line: None)
    assert set(plan.saved_tags) == set(tags) and not plan.compiled.no_remat
    assert plan.compiled.flops == every_flops
    assert any("compiles to fewer FLOPs" in n for n in plan.notes)
