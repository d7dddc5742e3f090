"""`neuron_remat.fit` against the compiled training step, on XLA:CPU.

The step is examples/fit_demo.py's: a scanned decoder (grouped-KV causal attention, SwiGLU),
AdamW inside the jitted step, the state donated. The tests' variant (`fit_demo.SMALL`) has
eight layers and six tags: the brute force is every one of the 64 save sets and no remat
compiled, read from its committed table where this environment compiled it (`TABLE`, three
of its rows compiled again here), else compiled once per module (a few minutes on a shared
CPU). At HBM sizes spread over the whole range, from where nothing fits to where no remat
does, each plan must fit its compiled bytes, be within 0.5 points of step FLOPs of the best
compiled save set that fits, and `fit` must refuse only when nothing fits.

In the sweep, `fit`'s compiles of a save set the brute force has already compiled are
served from it (`_served`: the step is traced and lowered for real, only XLA's compile of
the identical program is skipped); each plan's own policy is then compiled for real and
must give the brute force's figures for its save set.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from jax._src.ad_checkpoint import save_only_these_names, saved_residuals

import neuron_remat as nr

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples import fit_demo  # noqa: E402
from xla_figures import compiled_bytes, compiled_flops  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import fit_sweep as FS  # noqa: E402  (compiled_with: what a table's figures depend on)

F = importlib.import_module("neuron_remat._fit")
S = importlib.import_module("neuron_remat._search")  # the search and its constants

CONFIG = fit_demo.SMALL
MiB = 1 << 20
GAP_POINTS = 0.5
MAX_GAP_POINTS = 2.0


FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
          "alias_size_in_bytes")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What XLA said about one compiled step: `memory_analysis()`'s fields, FLOPs."""

    memory: tuple[int, int, int, int]  # FIELDS, in order
    flops: float

    @property
    def bytes(self) -> int:
        return compiled_bytes(self)  # XLA's sum, over the fields kept

    # The compiled executable's interface, for `fit` when the brute force serves it.
    def memory_analysis(self):
        return types.SimpleNamespace(**dict(zip(FIELDS, self.memory)))

    def cost_analysis(self):
        return {"flops": self.flops}


def _measure(step, args) -> Compiled:
    c = step.lower(*args).compile()
    m = c.memory_analysis()
    return Compiled(tuple(int(getattr(m, f)) for f in FIELDS), compiled_flops(c))


@pytest.fixture(scope="module")
def step():
    return fit_demo.make_step_factory(CONFIG), fit_demo.abstract_args(CONFIG)


@pytest.fixture(scope="module")
def graph(step):
    make_step, args = step
    return F.step_graph(make_step, *args)


TABLE = Path(__file__).resolve().parent / "data" / "fit-demo-small-compiles.json"
"""The brute force below, committed with the JAX and XLA flags that compiled it
(`FS.compiled_with`): XLA:CPU compiles deterministically, so where this environment is the
one that compiled it the table stands in for 65 compiles (minutes on 2 shared cores).
Written by ``python tests/cpu/test_fit.py --write-table``."""


def _compile_all(make_step, args, tags) -> dict:
    """Every tag subset compiled, and no remat (key None)."""
    table = {None: _measure(make_step(jax.checkpoint_policies.everything_saveable), args)}
    for r in range(len(tags) + 1):
        for subset in itertools.combinations(tags, r):
            table[subset] = _measure(make_step(save_only_these_names(*subset)), args)
    return table


def _committed(tags) -> dict | None:
    """`TABLE`'s compiles where this JAX, jaxlib, backend and XLA flags made them and it
    covers `tags` in this order; None otherwise."""
    data = FS.written_here(TABLE)
    if data is None or data["tags"] != list(tags):
        return None
    return {None if k == FS.NO_REMAT else tuple(k.split(",")) if k else ():
            Compiled(tuple(v["memory"]), v["flops"]) for k, v in data["sets"].items()}


@pytest.fixture(scope="module")
def brute(step, graph):
    """Every tag subset compiled, and no remat: the committed table where this environment
    compiled it, with full remat, every tag saved and no remat compiled again here and held
    to their rows (and every plan the sweep returns is compiled again, `_confirm`); else
    all 65 compiled here."""
    make_step, args = step
    table = _committed(graph.tags)
    if table is None:
        return _compile_all(make_step, args, graph.tags)
    assert len(table) == 2 ** len(graph.tags) + 1
    for key in ((), tuple(graph.tags), None):
        policy = (jax.checkpoint_policies.everything_saveable if key is None
                  else save_only_these_names(*key))
        assert _measure(make_step(policy), args) == table[key], key
    return table


def _saved_set(policy, tags):
    """The brute-force key of a policy `fit` compiles: None for no remat, else the tags it
    saves, in the graph's order."""
    if policy is jax.checkpoint_policies.everything_saveable:
        return None
    if hasattr(policy, "saves"):
        return tuple(t for t in tags if policy.saves(t))
    names = getattr(policy, "saveable_names", None)  # JAX's save_only_these_names
    assert names is not None, f"fit compiled a policy the test cannot read: {policy!r}"
    return tuple(t for t in tags if t in names)


class _ServedLowered:
    """A real lowering whose compile is the brute force's compile of the same save set."""

    def __init__(self, lowered, policy, brute, tags, log):
        self._lowered, self._policy, self._brute = lowered, policy, brute
        self._tags, self._log = tags, log

    def __getattr__(self, name):
        return getattr(self._lowered, name)

    def compile(self):
        key = _saved_set(self._policy, self._tags)
        self._log.append(key)
        return self._brute[key]


def _served(make_step, brute, tags, log):
    """`make_step` whose steps trace and lower for real and whose `compile()` returns the
    brute force's figures for the policy's save set (recorded in `log`)."""

    def make(policy):
        step = make_step(policy)
        step = step if hasattr(step, "lower") else jax.jit(step)
        return _Step(step, lambda *a: _ServedLowered(step.lower(*a), policy, brute, tags, log))

    return make


class _Step:
    """A jitted step (called and traced as itself) with a served `lower`."""

    def __init__(self, step, lower):
        self._step, self.lower = step, lower

    def __call__(self, *args):
        return self._step(*args)


def _confirm(make_step, args, plan, brute, key):
    """The plan's own policy, compiled for real, is the brute force's program for `key`."""
    real = _measure(make_step(plan.policy), args)
    assert real == brute[key], (key, real, brute[key])


def _device(hbm: int) -> nr.DeviceSpec:
    return nr.parse_device(f"trn2.48xlarge:hbm={hbm}B:cores=1", source="test")


# --------------------------------------------------------------------------------------
# The per-layer graph read from the step.
# --------------------------------------------------------------------------------------


def _residual_bytes(fn, *args) -> int:
    """Bytes of what JAX saves for `fn`'s backward (``saved_residuals``: the ground truth,
    arguments included, so only differences between policies mean anything)."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
               for a, _ in saved_residuals(fn, *args))


def _layer_args():
    import reference

    stacked = reference.init_stack(jax.random.PRNGKey(0), CONFIG)
    one = jax.tree.map(lambda a: a[0], stacked)
    x = jax.numpy.zeros((fit_demo.BATCH, fit_demo.SEQ, CONFIG.hidden), jax.numpy.float32)
    return x, one


def _jax_layer_kept(saved) -> int:
    """What JAX keeps for one demo layer under `saved` (residuals incl. its arguments)."""
    import reference

    x, p = _layer_args()
    fn = jax.checkpoint(lambda x, p: reference.layer(x, p, CONFIG),
                        policy=save_only_these_names(*saved))
    return _residual_bytes(fn, x, p)


def test_step_graph_finds_the_scanned_layers_and_their_tags(graph):
    assert graph.count == CONFIG.layers
    assert len(graph.layers) == 1 and graph.layers[0].count == CONFIG.layers
    assert set(graph.tags) == {"q_proj", "k_proj", "context", "o_proj", "linear1_0",
                               "linear1_1"}


@pytest.mark.parametrize("saved", [(), ("q_proj",), ("o_proj", "linear1_0"),
                                   ("q_proj", "k_proj", "context", "linear1_1")])
def test_graph_keeps_what_jax_keeps(graph, saved):
    """The graph read from the save-nothing step predicts, for another save set, exactly
    what JAX's ``saved_residuals`` says one layer keeps beyond saving nothing."""
    base, got = _jax_layer_kept(()), _jax_layer_kept(saved)
    assert graph.layers[0].count == CONFIG.layers
    per_layer = graph.layers[0].graph.evaluate_roles(saved).kept_bytes
    per_layer0 = graph.layers[0].graph.evaluate_roles(()).kept_bytes
    assert got - base == per_layer - per_layer0
    assert (graph.kept_bytes(saved) - graph.kept_bytes(())) == CONFIG.layers * (got - base)
    if saved:
        assert got > base  # the test can fail: saving a tag keeps something


def test_cotangents_of_a_layer_with_two_outputs():
    """A scanned layer returning a carry and a per-layer output: both cotangents are
    told from the residuals, and the graph still matches JAX's saved residuals."""
    from jax.ad_checkpoint import checkpoint_name

    def layer(h, w):
        a = checkpoint_name(jax.numpy.tanh(h @ w), "a")
        b = checkpoint_name(jax.numpy.sin(a @ w), "b")
        return h + b, a.sum(-1)

    def make_step(policy):
        def loss(ws, x):
            body = jax.checkpoint(layer, policy=policy)
            h, ys = jax.lax.scan(body, x, ws)
            return (h ** 2).sum() + (ys ** 2).sum()
        return jax.jit(jax.grad(loss))

    args = (jax.ShapeDtypeStruct((3, 16, 16), np.float32),
            jax.ShapeDtypeStruct((8, 16), np.float32))
    h, w = np.zeros((8, 16), np.float32), np.zeros((16, 16), np.float32)
    g = F.step_graph(make_step, *args)
    assert set(g.tags) == {"a", "b"} and g.count == 3

    def kept(saved):
        return _residual_bytes(jax.checkpoint(layer, policy=save_only_these_names(*saved)),
                               h, w)

    for saved in [("a",), ("b",), ("a", "b")]:
        assert g.kept_bytes(saved) - g.kept_bytes(()) == 3 * (kept(saved) - kept(())), saved


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_stored_bytes_are_what_the_compile_holds(dtype):
    """The bytes fit's model reads are those the backend stores: XLA:CPU keeps a bfloat16
    residual as float32, float16 at 2 bytes. Expected: XLA's growth of the compiled step
    when the one tag of 16 scanned layers is saved (8 MiB of float32 residuals)."""
    from jax.ad_checkpoint import checkpoint_name

    def layer(x, w):
        h = checkpoint_name(jax.numpy.tanh(x @ w), "h")
        return jax.numpy.tanh(h @ w.T), None

    def make_step(policy):
        body = jax.checkpoint(layer, policy=policy)

        def loss(w, x):
            y, _ = jax.lax.scan(lambda c, _: body(c, w), x, None, length=16)
            return y.astype(np.float32).sum()
        return jax.jit(jax.grad(loss))

    args = (jax.ShapeDtypeStruct((512, 512), dtype), jax.ShapeDtypeStruct((256, 512), dtype))
    g = F.step_graph(make_step, *args)
    save = jax.checkpoint_policies.save_only_these_names
    grew = (compiled_bytes(make_step(save("h")).lower(*args).compile())
            - compiled_bytes(make_step(save()).lower(*args).compile()))
    stored = g.stored_bytes(("h",)) - g.stored_bytes(())
    kept = g.kept_bytes(("h",)) - g.kept_bytes(())
    assert kept == 16 * 256 * 512 * jax.numpy.dtype(dtype).itemsize  # JAX's count
    assert abs(grew - stored) <= 0.1 * stored, (grew, stored)
    if dtype == "bfloat16":  # the test can fail: JAX's count is half what XLA:CPU holds
        assert abs(grew - kept) > 0.5 * kept, (grew, kept)


def test_step_without_checkpoint_is_refused():
    def make_step(policy):  # ignores the policy: no jax.checkpoint at all
        return jax.jit(jax.grad(lambda w, x: jax.numpy.tanh(x @ w).sum()))

    with pytest.raises(ValueError, match="no checkpointed layer"):
        nr.fit(make_step, jax.ShapeDtypeStruct((4, 4), np.float32),
               jax.ShapeDtypeStruct((2, 4), np.float32), device=_device(64 * MiB))


def test_options_are_checked(step):
    make_step, args = step
    with pytest.raises(TypeError, match="unknown options.*'budget'"):
        nr.fit(make_step, *args, device=_device(64 * MiB), budget=3)
    with pytest.raises(ValueError, match=r"candidates \['nope'\]"):
        nr.fit(make_step, *args, device=_device(64 * MiB), candidates=["nope"])
    with pytest.raises(ValueError, match="no HBM figure"):
        nr.fit(make_step, *args, device=nr.parse_device("cpu", source="test"))


# --------------------------------------------------------------------------------------
# The sweep against brute force.
# --------------------------------------------------------------------------------------


def _sizes(brute) -> list[int]:
    """Where nothing fits, six sizes spread between the smallest compiled save set and
    saving every tag, one between that and no remat, and one where no remat fits."""
    subsets = sorted(c.bytes for k, c in brute.items() if k is not None)
    lo, hi = subsets[0], brute[max((k for k in brute if k is not None), key=len)].bytes
    spread = [int(lo + (hi - lo) * f) for f in (0.02, 0.2, 0.4, 0.6, 0.8, 0.98)]
    return [lo - MiB] + spread + [(hi + brute[None].bytes) // 2, brute[None].bytes + MiB]


def _best(brute, limit):
    """(FLOPs, key) of the least-FLOP compiled program that fits (no remat: key None)."""
    fits = [(c.flops, -1 if k is None else len(k), k) for k, c in brute.items()
            if c.bytes <= limit]
    return min(fits, key=lambda f: f[:2]) if fits else None


def test_sweep_against_brute_force(step, graph, brute):
    make_step, args = step
    rows, confirmed = [], set()
    for hbm in _sizes(brute):
        best = _best(brute, hbm)
        log = []
        served = _served(make_step, brute, graph.tags, log)
        if best is None:
            with pytest.raises(nr.NoFitError, match="no compiled save set fits"):
                nr.fit(served, *args, device=_device(hbm), reserve=0)
            assert log  # it compiled before refusing
            rows.append((hbm, "NoFitError", None))
            continue
        plan = nr.fit(served, *args, device=_device(hbm), reserve=0)
        rec = plan.compiled
        assert rec is not None and rec.measured
        assert rec.compiles == len(log)  # every compile it counts went through make_step
        # The aim: 6 compiles for up to 8 tags; while full remat does not fit, or fits
        # with less than TIGHT x the starting uncertainty (a share `band` of its bytes)
        # to spare, one more per tag.
        roomy = hbm - brute[()].bytes >= S.TIGHT * S.DEFAULT_BAND * brute[()].bytes
        assert rec.compiles <= (6 if roomy else 6 + len(graph.tags))
        key = None if rec.no_remat else tuple(sorted(plan.saved_tags,
                                                     key=graph.tags.index))
        # the policy the plan carries is the set whose figures it states
        if rec.no_remat:
            assert plan.policy is jax.checkpoint_policies.everything_saveable
        else:
            assert tuple(t for t in graph.tags if plan.policy.saves(t)) == key
        truth = brute[key]
        assert key in log  # the plan's set was compiled
        assert rec.bytes == truth.bytes <= hbm
        assert rec.flops == truth.flops
        if key not in confirmed:  # the policy the plan carries compiles to that program
            _confirm(make_step, args, plan, brute, key)
            confirmed.add(key)
        # XLA counts a scan body once: a FLOP difference is one layer's.
        gap = graph.count * (truth.flops - best[0]) / graph.no_remat_flops
        assert gap <= MAX_GAP_POINTS / 100, (hbm, plan.saved_tags, best, gap)
        if brute[None].bytes <= hbm:
            assert rec.no_remat and any("no remat fits" in n for n in plan.notes)
        rows.append((hbm, key, gap))
    print(json.dumps([(h / MiB, k, g) for h, k, g in rows], default=str))
    # Issue 17's bar: within GAP_POINTS at 95% of sizes, never over MAX_GAP_POINTS. This
    # decoder is held out from the search's tuning (tests/cpu/zoo.py's train steps), and
    # nine sizes are too few for a 95% share: at most one may miss by more.
    misses = [r for r in rows if r[2] is not None and r[2] > GAP_POINTS / 100]
    assert len(misses) <= 1, misses


def test_no_remat_fits_when_the_device_is_large(step, graph, brute):
    make_step, args = step
    log = []
    plan = nr.fit(_served(make_step, brute, graph.tags, log), *args,
                  device=_device(brute[None].bytes * 2), reserve=0.1)
    assert plan.compiled.no_remat and plan.compiled.bytes == brute[None].bytes
    assert None in log and plan.compiled.compiles == len(log)
    assert plan.policy is jax.checkpoint_policies.everything_saveable
    assert plan.compiled.flops == brute[None].flops
    # full remat, the frontier's middle, its top (the set the figures now put within the
    # limit), no remat: 4 compiles here (5 while the bisection halved its way up to the
    # top; 3 when every tag saved was the second compile)
    assert plan.compiled.compiles <= 4
    assert plan.saved_tags == graph.tags
    d = plan.to_dict()
    assert d["compiled"]["no_remat"] is True and len(d["compiled"]["probes"]) == \
        plan.compiled.compiles
    assert math.isclose(d["compiled"]["limit_bytes"], brute[None].bytes * 2 * 0.9, rel_tol=1e-6)


# --------------------------------------------------------------------------------------
# CLI.
# --------------------------------------------------------------------------------------


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuron_remat", *argv], capture_output=True,
                          text=True, cwd=ROOT, timeout=600,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_cli_fit_prints_probes_and_json(brute, tmp_path):
    hbm = brute[max((k for k in brute if k is not None), key=len)].bytes + MiB
    fit_args = ("fit", "examples.fit_demo:small_factory", "--device",
                f"trn2.48xlarge:hbm={hbm}B:cores=1", "--reserve", "0", "--json")
    out = _cli(*fit_args)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["compiled"]["bytes"] <= hbm and d["compiled"]["compiles"] >= 2
    # the plan's peak is its compile's, as plan's is its prediction (before: the kept
    # activations alone); no remat keeps more per layer than the plan
    assert d["predicted_bytes_per_core"] == d["compiled"]["bytes"]
    assert d["no_remat_bytes_per_layer"] > d["kept_bytes_per_layer"] > 0
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("compile ")]
    assert len(lines) == 2 * d["compiled"]["compiles"]  # start, result
    assert "at most 6 compiles" in out.stderr  # said up front
    # why the search stopped: in the JSON as in the last progress line
    assert d["compiled"]["stop"] and (f"fit: stopped after {d['compiled']['compiles']} "
                                      f"compiles: {d['compiled']['stop']}") in out.stderr
    # --resume with that JSON: the same search, every compile read back, none made
    (tmp_path / "plan.json").write_text(out.stdout)
    again = _cli(*fit_args, "--resume", str(tmp_path / "plan.json"))
    assert again.returncode == 0, again.stderr
    e = json.loads(again.stdout)
    assert e["compiled"]["reused"] == e["compiled"]["compiles"] == d["compiled"]["compiles"]
    assert (e["compiled"]["advised_max_compiles"] is None) == (e["compiled"]["unexplored"] == 0)
    assert e["saved_tags"] == d["saved_tags"] and e["compiled"]["bytes"] == d["compiled"]["bytes"]
    said = [ln for ln in again.stderr.splitlines() if ln.startswith("compile ")]
    assert len(said) == 2 * d["compiled"]["compiles"]
    assert all(ln.endswith("(read back from resume)") for ln in said[::2]), said


def test_cli_fit_dry_run_compiles_full_remat_only(brute):
    hbm = brute[()].bytes + 2 * MiB
    out = _cli("fit", "examples.fit_demo:small_factory", "--device",
               f"trn2.48xlarge:hbm={hbm}B:cores=1", "--reserve", "0", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["full_remat"]["bytes"] == brute[()].bytes  # the one compile, as XLA says
    assert d["candidates"][-1]["saved"] == [] and len(d["candidates"]) >= 3
    assert all(c["predicted_bytes"] > 0 for c in d["candidates"])
    assert d["candidates"][0]["recompute_flops"] < d["candidates"][-1]["recompute_flops"]
    # the budget said up front: 6 up to 8 tags, one more per tag close to the limit
    assert d["max_compiles"] == 6 and d["stretch"] == len(d["tags"]) <= 8
    # --band sets how close that is: 10% of full remat to spare is not within 4 x 2% of
    # it, and is within 4 x 50%
    roomy = int(brute[()].bytes * 1.10)
    for band, tight in ((None, False), ("0.5", True)):
        out = _cli("fit", "examples.fit_demo:small_factory", "--device",
                   f"trn2.48xlarge:hbm={roomy}B:cores=1", "--reserve", "0", "--dry-run",
                   "--json", *(("--band", band) if band else ()))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["tight"] is tight


@pytest.mark.parametrize("flag, value", [("--band", "nan"), ("--band", "-1"),
                                         ("--max-compiles", "0"), ("--reserve", "nan"),
                                         ("--resume", "no_such_plan.json"),
                                         ("--resume", "setup.cfg")])
def test_cli_fit_bad_options_are_one_line(flag, value):
    out = _cli("fit", "examples.fit_demo:small_factory", flag, value)
    assert out.returncode == 2 and flag in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("target, message", [
    ("no_such_module_xyz:factory", "No module named"),
    ("examples.fit_demo", "is not MODULE:FUNCTION"),
    ("examples.fit_demo:abstract_args", "must return"),
])
def test_cli_fit_bad_input_is_one_line(target, message):
    out = _cli("fit", target, "--device", "trn2.48xlarge:hbm=64MiB:cores=1")
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------
# The analytic path: each policy's own workspace.
# --------------------------------------------------------------------------------------

SHAPE = nr.StepShape(seq_len=fit_demo.SEQ, micro_batch=fit_demo.BATCH,
                     activation_dtype="float32", param_dtype="float32")


def test_backward_working_set_shrinks_as_more_is_saved():
    from neuron_remat import memory_model as mm

    graph = mm.layer_graph(CONFIG, SHAPE)
    roles = [r for r in CONFIG.roles if r != "input"]
    full = mm.backward_working_set(graph, ())
    for r in range(len(roles)):
        for subset in itertools.combinations(roles, r):
            ws = mm.backward_working_set(graph, subset)
            for extra in set(roles) - set(subset):
                assert mm.backward_working_set(graph, subset + (extra,)) <= ws
            assert ws <= full
    # a tag the backward reads leaves the working set when saved: linear1_0 is a float32
    # [batch, seq, ffn] = 2 x 256 x 384 x 4 B = 768 KiB
    assert (fit_demo.BATCH, fit_demo.SEQ, CONFIG.ffn) == (2, 256, 384)
    assert mm.backward_working_set(graph, ("linear1_0",)) == full - 2 * 256 * 384 * 4


def test_analytic_plan_checks_each_set_with_its_own_workspace():
    from neuron_remat import memory_model as mm

    par = nr.Parallelism()
    graph = mm.layer_graph(CONFIG, SHAPE, par)
    head = mm.head_bytes(CONFIG, SHAPE, par)
    state = mm.model_state_bytes(CONFIG, SHAPE, par).total_bytes

    def predicted(roles):
        return (state + graph.evaluate_roles(roles).kept_bytes * CONFIG.layers
                + max(mm.backward_working_set(graph, roles), head))

    full = predicted(())
    # it never refuses where full remat's own prediction fits ...
    plan = nr.plan(_device(full), CONFIG, SHAPE, par, reserve=0)
    assert plan.saved_tags == () and plan.predicted_bytes_per_core == full
    # ... and where more fits, each set is checked with its own workspace
    roles = [r for r in CONFIG.roles if r != "input"]
    for extra in (MiB, 4 * MiB, 8 * MiB):
        plan = nr.plan(_device(full + extra), CONFIG, SHAPE, par, reserve=0,
                       objective="flops")  # the brute force below counts FLOPs
        mine = [r for r in roles if CONFIG.tag(r) in plan.saved_tags]
        assert plan.workspace_bytes == max(mm.backward_working_set(graph, mine), head)
        assert plan.predicted_bytes_per_core == predicted(mine) <= full + extra
        fitting = [sub for r in range(len(roles) + 1)
                   for sub in itertools.combinations(roles, r)
                   if predicted(sub) <= full + extra]
        least = min(graph.evaluate_roles(sub).recompute_flops for sub in fitting)
        assert plan.recompute_flops_per_layer == least
    with pytest.raises(nr.NoFitError):
        nr.plan(_device(full - 1), CONFIG, SHAPE, par, reserve=0)


def _write_table() -> None:
    """Compile the brute force and write `TABLE` (run with conftest's XLA flags)."""
    make_step, args = fit_demo.make_step_factory(CONFIG), fit_demo.abstract_args(CONFIG)
    tags = F.step_graph(make_step, *args).tags
    table = _compile_all(make_step, args, tags)
    sets = {FS.NO_REMAT if k is None else ",".join(k): {"memory": list(c.memory),
                                                        "flops": c.flops}
            for k, c in table.items()}
    TABLE.write_text(json.dumps({"step": "examples/fit_demo.py SMALL", "tags": list(tags),
                                 "compiled_with": FS.compiled_with(), "sets": sets},
                                indent=1) + "\n")
    print(f"wrote {TABLE}: {len(sets)} compiles")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-table"]:
        sys.exit("usage: python tests/cpu/test_fit.py --write-table")
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest  # noqa: F401  (sets the tests' XLA flags before the first compile)

    _write_table()
