"""`fit` on training steps written in other libraries' styles (tests/cpu/foreign_zoo.py:
Flax linen, Equinox, Flax nnx, pure JAX), none looked at while `fit` was tuned: at a
limit halfway from full remat to no remat, the plan fits and states its own policy's
compile, XLA's figures read here. The sweep against the brute force is
`benchmarks/fit_sweep.py --steps-module tests.cpu.foreign_zoo`.

Each step is traced and lowered for real, and XLA's compile of a save set is served from
the step's committed compile table (benchmarks/brute_force/<step>.json, then
<step>+spare.json for a set with a spare tag: `_Served`) where this compiler made the table
(JAX, jaxlib, the backend, XLA's flags, the libraries) and the set is one of its rows;
otherwise (another compiler, a set or a policy the tables do not hold) it is compiled here.
Served so: full remat and no remat (the limit) and `fit`'s compiles. Compiled here: each
plan's own policy, which must give the plan's bytes and, where the table served its set,
the table's row; and haiku-free-mixer's no remat and every matmul tag saved, whose figures
its plans are held to. Marked slow all the same: each test still compiles."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
pytest.importorskip("flax")
pytest.importorskip("equinox")

import neuron_remat as nr  # noqa: E402
import readme_tables as R  # noqa: E402  (the committed compile tables)
from xla_figures import compiled_bytes  # noqa: E402

import foreign_zoo  # noqa: E402

FS = R.FS  # benchmarks/fit_sweep.py: what a table's figures depend on, its served compile
F = importlib.import_module("neuron_remat._fit")
_ONLY = type(jax.checkpoint_policies.save_only_these_names())


def _tables(name):
    """The committed compile tables of step `name` this compiler made: its brute force
    over `fit`'s pool, then the one over its spare tags too; none where neither is
    committed or another JAX, jaxlib, backend, XLA flags or library made them."""
    found = (FS.written_here(R.TABLES / f"{stem}.json") for stem in (name, f"{name}+spare"))
    return [t for t in found if t is not None]


def _saved(policy, tags):
    """The tags of `tags` `policy` saves (None: no remat), or False where the test cannot
    read the policy: one that may do more than save some tags (offload them, save
    matmuls) is compiled for real."""
    if policy is jax.checkpoint_policies.everything_saveable:
        return None
    if policy is jax.checkpoint_policies.nothing_saveable:
        return ()
    if type(policy) is nr.RegexPolicy and not policy.offload:
        return tuple(t for t in tags if policy.saves(t))
    names = getattr(policy, "saveable_names", None)  # JAX's save_only_these_names
    if isinstance(policy, _ONLY) and isinstance(names, frozenset):
        return tuple(t for t in tags if t in names)
    return False


class _Served:
    """`make_step` whose steps trace and lower for real and whose ``lower(*args)
    .compile()`` gives the committed table's figures for the policy's save set (fit_sweep's
    `_CachedCompiled`) where `_tables` has a row for it: the set, read over every tag of
    the step's graph, is among a table's tags. Otherwise the step compiles for real.
    `log` records each compile: ("served" or "real", the save set)."""

    def __init__(self, name, make_step, args):
        self.make_step, self.tables, self.log = make_step, _tables(name), []
        self.tags = F.step_graph(make_step, *args).tags

    def row(self, policy):
        """The table's row of `policy`'s save set; None where no table has it."""
        saved = _saved(policy, self.tags)
        if saved is False:
            return None
        for table in self.tables:
            if saved is None or set(saved) <= set(table["tags"]):
                key = FS._key(None if saved is None else
                              [t for t in table["tags"] if t in saved])
                if key in table["sets"]:
                    return table["sets"][key]
        return None

    def __call__(self, policy):
        step = self.make_step(policy)
        return _ServedStep(step if hasattr(step, "lower") else jax.jit(step), self.row(policy),
                           _saved(policy, self.tags), self.log)


class _ServedStep:
    """A jitted step, called and traced as itself, whose lowering's compile is `row`'s
    figures (a real compile where `row` is None)."""

    def __init__(self, step, row, saved, log):
        self._step, self._row, self._saved, self._log = step, row, saved, log

    def __getattr__(self, name):
        return getattr(self._step, name)

    def __call__(self, *args, **kwargs):
        return self._step(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return _ServedLowered(self._step.lower(*args, **kwargs), self._row, self._saved,
                              self._log)


class _ServedLowered:
    """A real lowering whose `compile()` is the table's compile of the same save set."""

    def __init__(self, lowered, row, saved, log):
        self._lowered, self._row, self._saved, self._log = lowered, row, saved, log

    def __getattr__(self, name):
        return getattr(self._lowered, name)

    def compile(self, *args, **kwargs):
        if self._row is None or args or kwargs:
            self._log.append(("real", self._saved))
            return self._lowered.compile(*args, **kwargs)
        self._log.append(("served", self._saved))
        return FS._CachedCompiled(self._row)


def _row_of(compiled):
    """A compile's figures as a table's row holds them (`FS.Brute.fill`'s)."""
    return {**FS.C.memory_row(compiled), "flops": FS.C.compiled_flops(compiled),
            "transcendentals": FS.C.compiled_transcendentals(compiled)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(foreign_zoo.STEPS))
def test_fit_plans_a_foreign_step_within_the_limit(name):
    spec = foreign_zoo.STEPS[name]
    make, args = spec.make_step(), spec.abstract_args()
    served = _Served(name, make, args)

    def xla_bytes(policy):
        return compiled_bytes(served(policy).lower(*args).compile())

    full = xla_bytes(jax.checkpoint_policies.nothing_saveable)
    none = xla_bytes(jax.checkpoint_policies.everything_saveable)
    limit = (full + none) // 2
    device = nr.parse_device(f"trn2.48xlarge:hbm={limit}B:cores=1", source="test")
    plan = nr.fit(served, *args, device=device, reserve=0, progress=lambda line: None)
    assert plan.compiled.measured
    real = make(plan.policy).lower(*args).compile()  # the plan's policy, compiled here
    assert compiled_bytes(real) == plan.compiled.bytes <= limit
    row = served.row(plan.policy)
    if row is not None:  # the table served fit's compile of the plan's set: it is XLA's
        assert _row_of(real) == row, (plan.saved_tags, _row_of(real), row)
    assert plan.saved_tags, "halfway to no remat, some tag fits"


MIXER_TAGS = ("token_mixing.fc1", "token_mixing.fc2", "channel_mixing.fc1",
              "channel_mixing.fc2")
"""haiku-free-mixer's matmul tags (its GELU tags save nothing)."""


@pytest.fixture(scope="module")
def mixer():
    """haiku-free-mixer's step and arguments, and XLA's bytes and FLOPs of no remat and of
    every `MIXER_TAGS` saved, compiled here (once for the module's three tests)."""
    spec = foreign_zoo.STEPS["haiku-free-mixer"]
    make, args = spec.make_step(), spec.abstract_args()

    def figures(policy):
        compiled = make(policy).lower(*args).compile()
        return compiled_bytes(compiled), compiled.cost_analysis()["flops"]

    every = nr.RegexPolicy([re.escape(t) for t in MIXER_TAGS])
    return (spec, make, args, figures(jax.checkpoint_policies.everything_saveable),
            figures(every))


@pytest.mark.slow
@pytest.mark.parametrize("oracle", [None, "figures", "bare"])
def test_where_no_remat_fits_the_compile_with_fewer_flops_is_chosen(mixer, oracle):
    """haiku-free-mixer keeps bfloat16 converts without remat: XLA counts more FLOPs for
    no remat than for saving every tag (compiled here: `mixer`). Where both fit, fit
    returns the set that compiles to fewer FLOPs, with a note, with memory figures and
    with the compile as the oracle (simulated: `zoo.OomOracleSimulation`), its
    out-of-memory errors with the program's bytes or bare. fit's compiles are served
    (`_Served`): the plan's FLOPs must be those compiled here."""
    import zoo

    spec, make, args, (none_bytes, none_flops), (every_bytes, every_flops) = mixer
    assert every_flops < none_flops and every_bytes < none_bytes
    limit = none_bytes + (1 << 20)
    device = nr.parse_device(f"trn2.48xlarge:hbm={limit}B:cores=1", source="test")
    served = _Served(spec.name, make, args)
    chosen = zoo.oracle_make_step(served, limit, figures=oracle == "figures") if oracle \
        else served
    plan = nr.fit(chosen, *args, device=device, reserve=0, progress=lambda line: None)
    assert set(plan.saved_tags) == set(MIXER_TAGS) and not plan.compiled.no_remat
    assert plan.compiled.flops == every_flops
    if oracle is None:  # memory figures read: the plan's are those compiled here too
        assert plan.compiled.bytes == every_bytes
    assert any("compiles to fewer FLOPs" in n for n in plan.notes)
