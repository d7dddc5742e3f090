"""Fit what the compiler allocates: plan against the compiled training step.

`fit(make_step, *args)` plans the remat policy of a real training step. ``make_step(policy)``
returns the user's step for a JAX remat policy; `args` are arrays or
``jax.ShapeDtypeStruct``s (nothing is allocated or run). `fit`

1. traces the step once with a save-nothing policy and finds each checkpointed layer's
   backward: a ``remat2`` equation with ``differentiated=True`` (inside the backward
   ``scan`` of a scanned stack, once per unrolled layer). Its jaxpr is the transposed
   layer: residual inputs (with nothing saved: the layer's inputs), then the output
   cotangents. The equations that do not depend on the cotangents are the recomputation,
   the others the backward proper, and the recomputed values the backward reads are what
   any policy must either keep or recompute. That makes one exact `graph.LayerGraph` per
   layer: for every save set, the bytes kept and the FLOPs recomputed, jointly;
2. AOT-compiles full remat and every useful tag saved (``jit(step).lower(*args).compile()``),
   reads ``memory_analysis()`` (argument + output + temp - alias) and ``cost_analysis()``,
   and calibrates ``bytes(S) = fixed + kept(S) + slope x read(S)``: kept(S) the residuals
   of every layer (exact, from the graphs), read(S) the bytes one layer's backward reads
   that S recomputes (its working set beyond the residuals: more when little is saved),
   `fixed` the state and the policy-independent temporaries. No remat is compiled when
   its optimistic prediction (every value a backward reads kept, no working set) is within
   `WIDE_BAND` of the limit, and returned when it fits: nothing recomputes less;
3. walks the save sets by least recompute: compiles the first one predicted within
   `DEFAULT_BAND` of the limit (each prediction corrected by the model's miss on the
   nearest compiled set: XLA's buffer packing moves by a few MiB when one tag changes),
   recalibrates, and stops when a set fits with no better set left to try or the budget
   (`max_compiles`, 6 up to 8 tags) is spent. The plan is the least-recompute set whose
   compile fit: never one that does not. While nothing has fit, the budget stretches by
   one compile per tag and the smallest predicted sets go first, so `NoFitError` (with
   the numbers) comes only when none of those fit either.

On XLA:CPU the model misses by up to about 2.5 MiB on a 40-60 MiB step (tests/cpu and
benchmarks/fit_sweep.py measure it); the compiles, not the model, decide what fits.

A backend without ``memory_analysis()`` (it raises, returns None, or reports nothing; the
Neuron PJRT plugin may not implement it) is detected at the first compile: `fit` then plans
from the traced graphs with an uncalibrated model (fixed = the arguments and outputs, no
aliasing assumed; slope 1) and logs a note saying so, which the plan carries too.

When the step has no ``remat2`` equation (no ``jax.checkpoint`` in it, or a transform that
hides it) the per-layer graph cannot be read; `fit` then raises a ValueError naming what
it looked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax._src.ad_checkpoint import name_p, save_only_these_names
from jax.extend import core as jcore

from . import _trace
from ._format import fmt_bytes, grid, tag_list
from .device import DeviceSpec
from .graph import LayerGraph
from .memory_model import reserve_bytes as _reserve_bytes
from .planner import Choice, CompiledFit, NoFitError, Plan, Probe, TagDecision
from .policies import RegexPolicy

__all__ = ["CompiledFit", "LayerBackward", "Probe", "StepGraph", "fit", "fit_table", "step_graph"]

logger = logging.getLogger(__name__)

NO_REMAT = "no remat"


# --------------------------------------------------------------------------------------
# The per-layer graphs of a training step.
# --------------------------------------------------------------------------------------


def _aval_bytes(aval: Any) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _depends(jaxpr: Any, seeds: set[Any]) -> tuple[set[Any], list[bool]]:
    """Variables depending on `seeds`, and for each equation whether it does."""
    tainted = set(seeds)
    marks = []
    for eqn in jaxpr.eqns:
        hit = any(isinstance(v, jcore.Var) and v in tainted for v in eqn.invars)
        marks.append(hit)
        if hit:
            tainted.update(eqn.outvars)
    return tainted, marks


def _cotangent_count(body: Any) -> int:
    """How many trailing inputs of a transposed remat body are output cotangents.

    JAX's remat transpose binds the residuals (the layer's non-linear primal inputs, and
    saved values) first, then the nonzero output cotangents. The cotangents are the
    largest trailing run of inputs that no tag (``checkpoint_name``) depends on, and every
    gradient the body returns depends on them. (The smallest run that every gradient
    depends on is not enough: with a carry and a per-layer output, the output's cotangent
    alone reaches every gradient.) A trailing parameter that feeds no tag would be taken
    for a cotangent too; it only moves work the backward does anyway between the two
    sides, and keeps nothing."""
    n = len(body.invars)
    outs = [v for v in body.outvars if isinstance(v, jcore.Var)]
    found = 0
    for k in range(1, n):
        _, marks = _depends(body, set(body.invars[n - k:]))
        if any(m and e.primitive is name_p for m, e in zip(marks, body.eqns)):
            break
        found = k
    if found:
        tainted, _ = _depends(body, set(body.invars[n - found:]))
        if all(v in tainted for v in outs):
            return found
    raise ValueError("cannot tell the output cotangents from the residuals in a layer's "
                     "backward: no trailing inputs that the gradients depend on and no tag "
                     "does")


@dataclass(frozen=True)
class LayerBackward:
    """One checkpointed layer's backward, as the traced step holds it.

    `graph` is exact for any save set (`LayerGraph.evaluate_roles` with tag names as the
    roles); `count` is how many times the step runs it (a scan's length, or 1 per
    unrolled copy); `needed` are the forward values its backward reads."""

    graph: LayerGraph
    count: int
    tags: tuple[str, ...]
    needed: tuple[str, ...]

    def recomputed_read_bytes(self, saved: Iterable[str]) -> int:
        """Bytes of the values this layer's backward reads that a save set recomputes:
        what its working set holds beyond the kept residuals."""
        ev = self.graph.evaluate_roles(saved)
        skip = set(ev.kept) | set(self.graph.inputs) | set(self.graph.params)
        return sum(self.graph.values[v].bytes for v in self.needed if v not in skip)


def _layer_backward(body: Any, count: int) -> LayerBackward:
    """The graph of one transposed remat body (`_trace.jaxpr_graph`): the cotangents are
    unknown; of the residuals, those shaped like a cotangent are the layer's activations
    (the carry), the others its parameters."""
    n_ct = _cotangent_count(body)
    n_res = len(body.invars) - n_ct
    ct_avals = {(tuple(v.aval.shape), str(v.aval.dtype)) for v in body.invars[n_res:]}
    activation = [(tuple(v.aval.shape), str(v.aval.dtype)) in ct_avals
                  for v in body.invars[:n_res]] + [False] * n_ct
    graph = _trace.jaxpr_graph(body, unknown=[False] * n_res + [True] * n_ct,
                               activation=activation)
    tags = tuple(dict.fromkeys(v.role for v in graph.values.values() if v.role is not None))
    return LayerBackward(graph, count, tags, graph.needed())


def _remat_bodies(jaxpr: Any, mult: int = 1) -> Iterable[tuple[Any, int]]:
    for eqn in jaxpr.eqns:
        if str(eqn.primitive) == "remat2" and eqn.params.get("differentiated"):
            yield eqn.params["jaxpr"], mult
            continue
        for sub, m in _trace._sub_jaxprs(eqn):
            yield from _remat_bodies(sub, mult * m)


@dataclass(frozen=True)
class StepGraph:
    """Every checkpointed layer's backward in one training step."""

    layers: tuple[LayerBackward, ...]
    tags: tuple[str, ...]
    no_remat_flops: int  # the step's FLOPs without remat (jaxpr count, scans multiplied)

    @property
    def count(self) -> int:
        return sum(layer.count for layer in self.layers)

    def kept_bytes(self, saved: Iterable[str]) -> int:
        """Bytes every layer's residuals take, all layers together."""
        s = tuple(saved)
        return sum(layer.count * layer.graph.evaluate_roles(s).kept_bytes for layer in self.layers)

    def recompute_flops(self, saved: Iterable[str]) -> int:
        s = tuple(saved)
        return sum(layer.count * layer.graph.evaluate_roles(s).recompute_flops
                   for layer in self.layers)

    def no_remat_kept_bytes(self) -> int:
        """What every layer keeps without remat: every value its backward reads."""
        return sum(layer.count * layer.graph.evaluate(lambda v: True).kept_bytes
                   for layer in self.layers)

    def read_bytes(self, saved: Iterable[str]) -> int:
        s = tuple(saved)
        return max(layer.recomputed_read_bytes(s) for layer in self.layers)


def step_graph(make_step: Callable[[Any], Any], *args: Any) -> StepGraph:
    """Trace ``make_step(save nothing)`` on `args` (no compile) and read its layers.

    The trace uses JAX's original remat implementation even when ``jax_remat3`` is on: its
    backward keeps each layer in a ``remat2`` equation whose recomputation carries the
    tags, while remat3 inlines the layer and drops them. A `RegexPolicy` makes the same
    decisions under both, so the graph is the same; the probes compile under the
    implementation the host really runs."""
    with _original_remat():
        closed = jax.make_jaxpr(_jitted(make_step(save_only_these_names())))(*args)
    layers = [_layer_backward(body, m) for body, m in _remat_bodies(closed.jaxpr)]
    if not layers:
        raise ValueError(
            "make_step(policy) built a step with no checkpointed layer: its jaxpr holds no "
            "remat2 equation with differentiated=True. Wrap each layer in "
            "jax.checkpoint(layer, policy=policy) (inside its scan) and differentiate it")
    tags: dict[str, None] = {}
    for layer in layers:
        tags.update((t, None) for t in layer.tags)
    # Tags no backward reads are DCE'd from the remat bodies; list them too (saving one
    # keeps nothing and saves nothing, and the plan says so).
    tags.update((e.params["name"], None) for e, _ in _trace._walk(closed.jaxpr)
                if _trace.is_name_primitive(e.primitive))
    no_remat = jax.make_jaxpr(_jitted(make_step(
        jax.checkpoint_policies.everything_saveable)))(*args)
    return StepGraph(tuple(layers), tuple(tags), _trace.jaxpr_cost(no_remat.jaxpr).flops)


def _original_remat() -> Any:
    """A context with ``jax_remat3`` off (a no-op on JAX versions without the flag)."""
    from jax._src import config as jax_config  # noqa: PLC0415

    state = getattr(jax_config, "remat3", None)
    return state(False) if state is not None else contextlib.nullcontext()


def _jitted(step: Any) -> Any:
    return step if hasattr(step, "lower") else jax.jit(step)


# --------------------------------------------------------------------------------------
# The compiled footprint: probes, the fitted model, the search.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Compiled:
    bytes: int
    argument: int
    output: int
    temp: int
    alias: int
    flops: float
    seconds: float


class _NoMemoryAnalysis(Exception):
    """The backend compiled the step but cannot say what it allocates."""


def _compile(step: Any, args: Sequence[Any]) -> _Compiled:
    start = time.perf_counter()
    compiled = _jitted(step).lower(*args).compile()
    seconds = time.perf_counter() - start
    try:
        mem = compiled.memory_analysis()
    except Exception as err:  # noqa: BLE001 - any backend's way of saying "not here"
        raise _NoMemoryAnalysis(f"{type(err).__name__}: {err}") from err
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes")
    if mem is None or not all(hasattr(mem, f) for f in fields):
        raise _NoMemoryAnalysis(f"memory_analysis() returned {mem!r}")
    arg, out, temp, alias = (int(getattr(mem, f)) for f in fields)
    if arg + out + temp <= 0:
        raise _NoMemoryAnalysis(f"memory_analysis() reports no bytes: {mem!r}")
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float(cost.get("flops", float("nan"))) if cost else float("nan")
    except Exception:  # noqa: BLE001
        flops = float("nan")
    return _Compiled(arg + out + temp - alias, arg, out, temp, alias, flops, seconds)


@dataclass
class _Model:
    """``bytes(S) = intercept + kept(S) + slope x read(S)``, least squares over the
    compiled tag subsets; `error` the largest miss on them."""

    intercept: float
    slope: float
    error: float

    @classmethod
    def calibrate(cls, points: Sequence[tuple[int, int, int]], prior_slope: float = 1.0
                  ) -> _Model:
        """`points`: (compiled bytes, kept bytes, read bytes)."""
        y = np.array([b - k for b, k, _ in points], float)
        x = np.array([r for _, _, r in points], float)
        if len(points) >= 2 and np.ptp(x) > 0:
            slope, intercept = np.polyfit(x, y, 1)
            slope = max(float(slope), 0.0)
            intercept = float(np.mean(y - slope * x))
        else:
            slope, intercept = prior_slope, float(np.mean(y - prior_slope * x))
        error = float(np.max(np.abs(y - intercept - slope * x))) if len(points) else 0.0
        return cls(intercept, slope, error)

    def predict(self, kept: int, read: int) -> int:
        return int(round(self.intercept + kept + self.slope * read))


DEFAULT_BAND = 0.02
"""A set predicted up to this share of the limit over it is still compiled to check, least
recompute first: XLA's workspace is not a smooth function of the save set (its buffer
packing moves by a few MiB when one tag changes)."""
WIDE_BAND = 0.10
"""When no set is within `DEFAULT_BAND`, the one predicted closest to fitting, up to this
share over, gets the next compile (while the budget lasts)."""


def _max_compiles(n_tags: int) -> int:
    return 6 if n_tags <= 8 else 6 + (n_tags - 8) // 2


@dataclass(frozen=True)
class _Candidate:
    saved: tuple[str, ...]
    kept: int
    read: int
    recompute: int


def _candidates(graph: StepGraph, tags: Sequence[str]) -> list[_Candidate]:
    """Every subset of `tags`, least recompute first. Sets with equal kept bytes and
    recompute stay apart: XLA may lay them out differently (saving ``o_proj`` or ``q_proj``
    keeps as much and recomputes as much, yet compiles a few MiB apart)."""
    found = []
    for r in range(len(tags) + 1):
        for subset in itertools.combinations(tags, r):
            found.append(_Candidate(subset, graph.kept_bytes(subset), graph.read_bytes(subset),
                                    graph.recompute_flops(subset)))
    return sorted(found, key=lambda c: (c.recompute, c.kept, len(c.saved), c.saved))


@dataclass
class _Search:
    """The compile-checked walk down the candidates (pure: `measure` compiles)."""

    candidates: list[_Candidate]
    measure: Callable[[_Candidate, int | None], int]  # (candidate, predicted) -> bytes
    limit: int
    max_compiles: int
    band: float = DEFAULT_BAND
    no_remat_kept: int | None = None  # what no remat keeps (None: not a candidate)
    measure_no_remat: Callable[[int], int] | None = None  # (predicted) -> bytes
    compiled: dict[tuple[str, ...], int] = dataclasses.field(default_factory=dict)
    model: _Model | None = None

    def points(self) -> list[tuple[int, int, int]]:
        by = {c.saved: c for c in self.candidates}
        return [(b, by[s].kept, by[s].read) for s, b in self.compiled.items()]

    def predict(self, c: _Candidate) -> int:
        """The model's figure, corrected by the miss on the nearest compiled sets (fewest
        tags different): XLA's workspace moves by more than the model says when one
        particular tag is saved, and sets sharing tags share that."""
        assert self.model is not None
        base = self.model.predict(c.kept, c.read)
        misses = []
        for saved, got in self.compiled.items():
            d = self._by[saved]
            misses.append((len(set(saved) ^ set(c.saved)),
                           got - self.model.predict(d.kept, d.read)))
        if not misses:
            return base
        nearest = min(m[0] for m in misses)
        near = [m[1] for m in misses if m[0] == nearest]
        return base + int(round(sum(near) / len(near)))

    def run(self, used: int) -> tuple[Any, int]:
        """The least-recompute candidate that compiled within the limit (`NO_REMAT` when no
        remat did, None when nothing did), and the compiles made in all (`used` before).

        After full remat and every tag saved (the calibration), each compile goes to the
        least-recompute set predicted within `band` of the limit that could beat the best
        fit so far; when none is, to the one predicted closest to fitting, within
        `WIDE_BAND`. Each compile recalibrates the model and the corrections."""
        used = self.start(used)
        assert self.model is not None
        if self.no_remat_kept is not None and self.measure_no_remat is not None:
            # No remat keeps every value a backward reads, untagged ones too; its
            # workspace is at least the intercept's: an optimistic floor. Compile it when
            # it might fit; when it does, nothing recomputes less.
            floor = self.model.predict(self.no_remat_kept, 0)
            if floor <= self.limit * (1 + WIDE_BAND) and used < self.max_compiles:
                used += 1
                if self.measure_no_remat(floor) <= self.limit:
                    return NO_REMAT, used
        return self.walk(used)

    def start(self, used: int) -> int:
        """Compile full remat and every useful tag saved; calibrate on them."""
        self._by = {c.saved: c for c in self.candidates}
        for c in (self._by[()], self.candidates[0]):
            if c.saved not in self.compiled and used < self.max_compiles:
                self.compiled[c.saved] = self.measure(c, None)
                used += 1
        self.model = _Model.calibrate(self.points())
        return used

    def walk(self, used: int) -> tuple[_Candidate | None, int]:
        by_flops, last = self.candidates, self.candidates[0]
        # Refuse only when nothing fits: while nothing has, the budget stretches by one
        # compile per tag (XLA's workspace can drop by more than one tag keeps).
        stretch = max(len(c.saved) for c in by_flops)
        while used < self.max_compiles or (self.best() is None
                                           and used < self.max_compiles + stretch):
            best = self.best()
            if best is not None and best is last:
                break
            better = [c for c in by_flops if c.saved not in self.compiled
                      and (best is None or c.recompute < best.recompute)]
            if best is None:  # nothing fits yet: the smallest predicted, to refuse only
                nxt = min(better, key=lambda c: (self.predict(c), c.recompute), default=None)
                if nxt is None:  # when nothing does
                    break
            else:
                nxt = next((c for c in better
                            if self.predict(c) <= self.limit * (1 + self.band)), None)
            if nxt is None:
                near = [c for c in better if self.predict(c) <= self.limit * (1 + WIDE_BAND)]
                if not near:
                    break
                nxt = min(near, key=lambda c: (self.predict(c), c.recompute))
            self.compiled[nxt.saved] = self.measure(nxt, self.predict(nxt))
            used += 1
            self.model = _Model.calibrate(self.points())
        return self.best(), used

    def best(self) -> _Candidate | None:
        fits = [c for c in self.candidates
                if c.saved in self.compiled and self.compiled[c.saved] <= self.limit]
        return fits[0] if fits else None


# --------------------------------------------------------------------------------------
# fit
# --------------------------------------------------------------------------------------

_OPTIONS = ("candidates", "max_compiles", "progress", "band", "runner_ups", "per_layer",
            "max_sets")


def fit(make_step: Callable[[Any], Any], *args: Any, device: DeviceSpec | None = None,
        reserve: float | int | None = None, **plan_options: Any) -> Plan:
    """Plan the remat policy of a training step against what the compiler allocates.

    Args:
        make_step: ``make_step(policy)`` returns the training step whose checkpointed
            layers use the JAX remat `policy`. A ``jax.jit``-wrapped step keeps its own
            options (donation, shardings); a plain function is jitted.
        *args: the step's arguments, arrays or ``jax.ShapeDtypeStruct``s (nothing is
            allocated or run).
        device: what to fit (HBM per core); detected when None (``NEURON_REMAT_DEVICE``
            overrides).
        reserve: HBM held back per core: a fraction (float) or bytes (int). By default
            only the Neuron runtime's share on a full-size device: the compiled figure
            already holds the step's temporaries.
        **plan_options: ``candidates`` (tags to consider), ``max_compiles`` (default 6 up
            to 8 tags), ``progress`` (called with one line per compile), ``band`` (share
            of the limit a prediction may exceed and still be compiled to check; 0.05),
            ``runner_ups`` (how many to list; 3).

    Returns a `Plan` whose `Plan.compiled` holds the confirmed step's compiled bytes and
    FLOPs, the number of compiles and each probe. The compiled bytes of the returned
    plan are at most ``HBM per core - reserve`` (measured, unless the backend has no
    ``memory_analysis()``: then the note says the figure is a prediction).

    Raises `NoFitError` (with the numbers) when no compiled save set fits, and ValueError
    when the step has no checkpointed layer or an option is wrong.
    """
    if plan_options.get("per_layer"):  # the uniform fit, then a compiled mix (fit_per_layer)
        options = {k: v for k, v in plan_options.items() if k not in ("per_layer", "max_sets")}
        uniform = fit(make_step, *args, device=device, reserve=reserve, **options)
        return fit_per_layer(uniform, make_step, *args,
                             max_sets=plan_options.get("max_sets", 2),
                             progress=plan_options.get("progress"))
    plan_options.pop("per_layer", None)
    plan_options.pop("max_sets", None)
    unknown = sorted(set(plan_options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"fit() got unknown options {unknown}; valid: {', '.join(_OPTIONS)}")
    progress = plan_options.get("progress") or (lambda line: logger.info("%s", line))
    if device is None:
        from .device import detect  # noqa: PLC0415

        device = detect()
    hbm = device.hbm_bytes_per_core
    if not hbm:
        raise ValueError(f"device {device.family!r} has no HBM figure; pass device= (e.g. "
                         "parse_device('trn2.48xlarge:hbm=64MiB:cores=1')) or set "
                         "NEURON_REMAT_DEVICE")
    held = _fit_reserve(device, reserve)
    limit = hbm - held
    if limit <= 0:
        raise ValueError(f"reserve={reserve!r} holds back {fmt_bytes(held)}, all of the "
                         f"{fmt_bytes(hbm)} per core")

    graph = step_graph(make_step, *args)
    tags = _pool(graph, plan_options.get("candidates"))
    max_compiles = int(plan_options.get("max_compiles") or _max_compiles(len(tags)))
    if max_compiles < 3:
        raise ValueError(f"max_compiles={max_compiles}: fit needs at least 3 (no remat, "
                         "full remat, every tag saved)")
    band = float(plan_options.get("band", DEFAULT_BAND))
    cands = _candidates(graph, tags)
    probes: list[Probe] = []
    jax_policies: dict[tuple[str, ...] | None, Any] = {}

    def compile_one(label: str, saved: tuple[str, ...] | None,
                    predicted: int | None) -> _Compiled:
        policy = (jax.checkpoint_policies.everything_saveable if saved is None
                  else save_only_these_names(*saved))
        jax_policies[saved] = policy
        what = NO_REMAT if saved is None else (", ".join(saved) or "nothing")
        progress(f"compile {len(probes) + 1}: {label} (save {what}) ...")
        c = _compile(make_step(policy), args)
        probes.append(Probe(label, saved, c.bytes, c.argument, c.output, c.temp, c.alias,
                            c.flops, c.seconds, predicted))
        progress(f"compile {len(probes)}: {fmt_bytes(c.bytes)} "
                 f"({'fits' if c.bytes <= limit else 'over'} {fmt_bytes(limit)}), "
                 f"{c.flops / 1e9:.4g} GFLOP, {c.seconds:.1f} s")
        return c

    def measure(c: _Candidate, predicted: int | None) -> int:
        label = ("full remat" if not c.saved else "every tag saved" if c is cands[0]
                 else "confirm")
        return compile_one(label, c.saved, predicted).bytes

    def measure_no_remat(predicted: int) -> int:
        return compile_one("no remat", None, predicted).bytes

    search = _Search(cands, measure, limit, max_compiles, band,
                     no_remat_kept=graph.no_remat_kept_bytes(), measure_no_remat=measure_no_remat)
    try:
        best, _ = search.run(0)
    except _NoMemoryAnalysis as err:
        probes.append(Probe("full remat (no memory_analysis)", (), 0, 0, 0, 0, 0,
                            float("nan"), 0.0))
        return _analytic_fallback(graph, cands, device, hbm, held, limit, str(err), tags,
                                  probes, make_step(save_only_these_names()), args,
                                  plan_options)
    model = search.model
    assert model is not None
    if best is NO_REMAT:
        p = probes[-1]
        return _make_plan(graph, None, cands, device, hbm, held, limit, probes, model, tags,
                          _Compiled(p.bytes, p.argument_bytes, p.output_bytes, p.temp_bytes,
                                    p.alias_bytes, p.flops, p.seconds), plan_options)
    if best is None:
        raise NoFitError(_no_fit(probes, limit, hbm, held))
    chosen = next(p for p in reversed(probes) if p.saved == best.saved)
    compiled = _Compiled(chosen.bytes, chosen.argument_bytes, chosen.output_bytes,
                         chosen.temp_bytes, chosen.alias_bytes, chosen.flops, chosen.seconds)
    return _make_plan(graph, best, cands, device, hbm, held, limit, probes, model, tags,
                      compiled, plan_options)


def _fit_reserve(device: DeviceSpec, reserve: float | int | None) -> int:
    if reserve is None:  # the runtime's share only: no fraction for temporaries
        from .memory_model import DEFAULT_RESERVE_FRACTION  # noqa: PLC0415

        full = _reserve_bytes(device, None)
        return full - int(DEFAULT_RESERVE_FRACTION * device.hbm_bytes_per_core)
    return _reserve_bytes(device, reserve)


def _pool(graph: StepGraph, candidates: Iterable[str] | None) -> tuple[str, ...]:
    """The tags worth deciding: those whose saving changes what is kept or recomputed."""
    if candidates is not None:
        if isinstance(candidates, str):
            candidates = candidates.split(",")
        chosen = [c.strip() for c in candidates]
        bad = [c for c in chosen if c not in graph.tags]
        if bad:
            raise ValueError(f"candidates {bad} are not tags of this step; its tags: "
                             f"{list(graph.tags)}")
    else:
        chosen = list(graph.tags)
    # Useful: saving it recomputes less, alone or beside every other tag (a tag may pay
    # only with others).
    base = graph.recompute_flops(())
    everything = tuple(chosen)
    most = graph.recompute_flops(everything)
    return tuple(t for t in dict.fromkeys(chosen)
                 if graph.recompute_flops((t,)) < base
                 or most < graph.recompute_flops(tuple(o for o in everything if o != t)))


def _no_fit(probes: Sequence[Probe], limit: int, hbm: int, held: int) -> str:
    tried = "; ".join(f"{p.label} {fmt_bytes(p.bytes)}" for p in probes)
    least = min(probes, key=lambda p: p.bytes)
    return (f"no compiled save set fits {fmt_bytes(limit)} (HBM {fmt_bytes(hbm)} per core - "
            f"reserve {fmt_bytes(held)}): the smallest compiled step, {least.label}, takes "
            f"{fmt_bytes(least.bytes)}, {fmt_bytes(least.bytes - limit)} over. Compiled: "
            f"{tried}. To fit: shard the state further, lower the micro-batch or the "
            "sequence length, or give the step more memory.")


def _make_plan(graph: StepGraph, best: _Candidate | None, cands: Sequence[_Candidate],
               device: DeviceSpec, hbm: int, held: int, limit: int,
               probes: Sequence[Probe], model: _Model, tags: Sequence[str],
               compiled: _Compiled, options: dict[str, Any], measured: bool = True,
               extra_notes: Sequence[str] = ()) -> Plan:
    import re  # noqa: PLC0415

    layers = graph.count
    notes = list(extra_notes)
    if best is None:  # no remat
        saved = tuple(tags)
        kept = recompute = read = 0
        notes.append(f"no remat fits: the step without remat compiles to "
                     f"{fmt_bytes(compiled.bytes)} <= {fmt_bytes(limit)}; use "
                     "jax.checkpoint_policies.everything_saveable or drop jax.checkpoint "
                     "(the policy below, every tag, still recomputes untagged values)")
        workspace = 0
    else:
        saved, kept, recompute, read = best.saved, best.kept, best.recompute, best.read
        workspace = int(round(model.slope * read))
    base = (graph.kept_bytes(()), graph.recompute_flops(()))
    decisions = []
    for t in graph.tags:
        k1, f1 = graph.kept_bytes((t,)), graph.recompute_flops((t,))
        extra, gain = (k1 - base[0]) // layers, (base[1] - f1) / layers
        if t not in tags:
            reason = ("saving it saves no recompute" if f1 >= base[1]
                      else "not a candidate")
        elif t in saved:
            reason = "no remat" if best is None else "saved: least recompute that fits"
        else:
            reason = "a save set without it fits with less recompute, or with it none fits"
        decisions.append(TagDecision(t, t in saved, max(extra, 0), max(float(gain), 0.0),
                                     reason))
    fits = {p.saved for p in probes if p.bytes <= limit}
    over = {p.saved for p in probes if p.bytes > limit}
    runner = [Choice(c.saved, c.kept // layers, c.recompute / layers) for c in cands
              if best is not None and c is not best and c.recompute >= best.recompute
              and c.saved not in over
              and (c.saved in fits or model.predict(c.kept, c.read) <= limit)]
    runner = runner[:int(options.get("runner_ups", 3))]
    measured_probes = [p for p in probes if p.saved is not None]
    error = max((abs(p.bytes - model.predict(*_kr(cands, p.saved))) for p in measured_probes
                 if _kr(cands, p.saved) is not None), default=0)
    record = CompiledFit(
        hbm_bytes=hbm, reserve_bytes=held, limit_bytes=limit, bytes=compiled.bytes,
        flops=compiled.flops, no_remat=best is None, compiles=len(probes),
        probes=tuple(probes), fixed_bytes=int(round(model.intercept)),
        workspace_slope=model.slope, workspace_bytes=workspace,
        workspace_error_bytes=int(error), layers=layers,
        step_flops=float(graph.no_remat_flops), recompute_flops=float(recompute),
        measured=measured)
    fwd = graph.no_remat_flops / 3 / layers
    return Plan(
        policy=RegexPolicy([re.escape(t) for t in saved]), saved_tags=tuple(saved),
        kept_bytes_per_layer=kept // layers,
        budget_bytes_per_layer=(kept + max(limit - compiled.bytes, 0)) // layers,
        recompute_flops_per_layer=recompute / layers, decisions=tuple(decisions),
        runner_ups=tuple(runner), layers_per_core=layers, inflight=1, device=device,
        forward_flops_per_layer=fwd, notes=tuple(notes), compiled=record)


def _kr(cands: Sequence[_Candidate], saved: tuple[str, ...] | None) -> tuple[int, int] | None:
    for c in cands:
        if c.saved == saved:
            return c.kept, c.read
    return None


def _analytic_fallback(graph: StepGraph, cands: Sequence[_Candidate], device: DeviceSpec,
                       hbm: int, held: int, limit: int, why: str, tags: Sequence[str],
                       probes: Sequence[Probe], step: Any, args: Sequence[Any],
                       options: dict[str, Any]) -> Plan:
    """No ``memory_analysis()``: plan from the traced graph with an uncalibrated model
    (fixed = the arguments and outputs, no aliasing assumed; workspace = one layer's
    recomputed reads, slope 1)."""
    note = (f"this backend cannot report a compiled step's memory (memory_analysis(): "
            f"{why}); planned from the traced graph instead: arguments + outputs + kept "
            "residuals + one layer's recomputed reads, uncalibrated")
    logger.warning("neuron_remat.fit: %s", note)
    outs = jax.eval_shape(_jitted(step), *args)
    fixed = sum(_aval_bytes(a) for a in jax.tree.leaves((tuple(args), outs)))
    model = _Model(float(fixed), 1.0, 0.0)
    best = next((c for c in cands if model.predict(c.kept, c.read) <= limit), None)
    if best is None:
        nothing = next(c for c in cands if not c.saved)
        raise NoFitError(
            f"{note}. Even full remat is predicted at "
            f"{fmt_bytes(model.predict(nothing.kept, nothing.read))}, over the "
            f"{fmt_bytes(limit)} limit (HBM {fmt_bytes(hbm)} - reserve {fmt_bytes(held)})")
    predicted = model.predict(best.kept, best.read)
    flops = float(graph.no_remat_flops + best.recompute)
    return _make_plan(graph, best, cands, device, hbm, held, limit, probes, model, tags,
                      _Compiled(predicted, 0, 0, 0, 0, flops, 0.0), options,
                      measured=False, extra_notes=(note,))


def fit_table(plan: Plan) -> str:
    """Each compile of `fit`, then the plan, as text."""
    rec = plan.compiled
    if rec is None:
        return plan.table()
    rows = [("#", "compiled", "save", "bytes", "predicted", "fits", "GFLOP", "seconds")]
    for i, p in enumerate(rec.probes, 1):
        what = NO_REMAT if p.saved is None else tag_list(p.saved, width=48)
        rows.append((str(i), p.label, what, fmt_bytes(p.bytes) if rec.measured else "-",
                     fmt_bytes(p.predicted_bytes) if p.predicted_bytes is not None else "-",
                     ("yes" if p.bytes <= rec.limit_bytes else "no") if rec.measured else "-",
                     f"{p.flops / 1e9:.4g}", f"{p.seconds:.1f}"))
    lines = grid(rows)
    lines.append("")
    chosen = NO_REMAT if rec.no_remat else f"save {tag_list(plan.saved_tags)}"
    lines.append(
        f"fit: {chosen}: {'compiled' if rec.measured else 'predicted'} "
        f"{fmt_bytes(rec.bytes)} of {fmt_bytes(rec.limit_bytes)} (HBM "
        f"{fmt_bytes(rec.hbm_bytes)} - reserve {fmt_bytes(rec.reserve_bytes)}), recompute "
        f"{100 * rec.overhead:.2f}% of the step, {rec.compiles} compiles")
    lines.append(
        f"model: {rec.fixed_bytes / 2**20:.3f} MiB intercept + kept residuals of "
        f"{rec.layers} layers "
        f"+ {rec.workspace_slope:.3g} x one layer's recomputed reads "
        f"(here {fmt_bytes(rec.workspace_bytes)}); largest miss "
        f"{fmt_bytes(rec.workspace_error_bytes)}")
    lines.append("")
    lines.append(plan.table())
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Per-layer plans against the compiled step (``fit(..., per_layer=True)``).
# --------------------------------------------------------------------------------------


def fit_per_layer(uniform: Plan, make_step: Callable[[Any], Any], *args: Any,
                  max_sets: int | None = 2,
                  progress: Callable[[str], None] | None = None) -> Plan:
    """A per-layer mix of save sets for the step `uniform` was fitted on, confirmed by
    compiling it.

    Relies only on what `fit` returns and on the step: `uniform.compiled` (the limit, the
    fitted intercept `fixed_bytes` and `workspace_slope`), `uniform.saved_tags` and the
    step's layer graph (`step_graph`). The mix is `planner`'s exact knapsack over the
    layers with each set's own capacity ``limit - fixed - slope x read(set)``, and
    ``make_step`` is then called with a tuple of one policy per layer (`scan_layers` runs
    such a tuple as one scan per run of equal policies). When the compiled mix does not
    fit, the capacity is lowered by the overshoot and tried once more; when it still does
    not fit (or the step has layers of several kinds, or no memory analysis), the uniform
    plan is returned with a note.
    """
    from . import planner  # noqa: PLC0415
    from .memory_model import Footprint, TagCost  # noqa: PLC0415

    say = progress or (lambda line: logger.info("%s", line))
    rec = uniform.compiled
    graph = step_graph(make_step, *args)

    def keep(note: str) -> Plan:
        return dataclasses.replace(uniform, notes=(*uniform.notes, note))

    if rec is None or not rec.measured:
        return keep("per-layer plan: not tried (no compiled calibration)")
    if len(graph.layers) != 1:
        return keep(f"per-layer plan: not tried ({len(graph.layers)} kinds of checkpointed "
                    "layer; one scanned stack is supported)")
    layer = graph.layers[0]
    g, n = layer.graph, layer.count
    roles = {t for t in graph.tags if t in g.role_values()}
    tags = tuple(t for t in graph.tags if t in roles)
    fp = Footprint({t: TagCost(0, 0.0) for t in tags}, always_kept_bytes=0, graph=g,
                   roles={t: t for t in tags})
    usable = [t for t in tags if g.cost_of_roles((t,))[1] < g.cost_of_roles(())[1]]
    best_tags = tuple(t for t in uniform.saved_tags if t in usable)
    kept, flops = g.cost_of_roles(best_tags)
    best = planner.Choice(best_tags, kept, float(flops))
    probes = list(rec.probes)
    margin = 0
    for attempt in range(2):
        def cap_for(s: tuple[str, ...], margin: int = margin) -> int:
            return int(rec.limit_bytes - rec.fixed_bytes - margin
                       - rec.workspace_slope * layer.recomputed_read_bytes(s))

        mix, per, _ = planner._layer_mix(fp, fp, "flops", usable, n, cap_for, best,
                                         list(tags), {t: t for t in tags}, max_sets)
        if per is None:
            return dataclasses.replace(uniform, layer_mix=mix, layer_policies=None)
        say(f"compile {len(probes) + 1}: per-layer mix " + "; ".join(
            f"{m.layers} x {list(m.tags)}" for m in mix) + " ...")
        try:
            c = _compile(make_step(per), args)
        except _NoMemoryAnalysis:
            return keep("per-layer plan: the backend has no memory_analysis(); not confirmed")
        probes.append(Probe("per-layer mix", None, c.bytes, c.argument, c.output, c.temp,
                            c.alias, c.flops, c.seconds))
        say(f"compile {len(probes)}: {fmt_bytes(c.bytes)} "
            f"({'fits' if c.bytes <= rec.limit_bytes else 'over'} "
            f"{fmt_bytes(rec.limit_bytes)}), {c.flops / 1e9:.4g} GFLOP")
        record = dataclasses.replace(rec, probes=tuple(probes), compiles=len(probes))
        if c.bytes <= rec.limit_bytes:
            return dataclasses.replace(
                uniform, layer_mix=mix, layer_policies=per, compiled=record,
                notes=(*uniform.notes, f"per-layer mix compiled to {fmt_bytes(c.bytes)} "
                       f"<= {fmt_bytes(rec.limit_bytes)} limit"))
        margin += c.bytes - rec.limit_bytes
        uniform = dataclasses.replace(uniform, compiled=record)
        rec = record
    return keep(f"per-layer plan: the compiled mix did not fit ({fmt_bytes(c.bytes)} > "
                f"{fmt_bytes(rec.limit_bytes)}); the uniform plan stands")
