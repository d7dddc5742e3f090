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
   and calibrates ``bytes(S) = fixed + scale x kept(S) + slope x read(S)``: kept(S) the
   residuals of every layer (exact, from the graphs), read(S) the bytes one layer's
   backward reads that S recomputes, `scale` what the backend stores per kept byte (1, or
   2 where XLA:CPU keeps bfloat16 as float32), `fixed` the state and the
   policy-independent temporaries. The model's misses are read as one unknown effect per
   saved tag (a Gaussian process over which tags a set saves, `TAG_SD`, `SET_SD`, with
   correlated effects for tags the trace cannot tell apart, `ALIKE`): XLA's buffer
   packing moves with particular tags, and saving one may compile smaller than saving
   none. A set sharing most tags with compiled ones is predicted from them, with little
   uncertainty; one made of tags never compiled, nor alike to one compiled, keeps their
   whole uncertainty;
3. searches by expected gain: each set that recomputes less than the best compiled fit gets
   a chance to fit (normal errors: the search's uncertainty and the set's own), and the next
   compile goes to the largest chance x recompute saved, among sets whose chance is at least
   `PLAUSIBLE`. The uncertainty starts at `band` of full remat's bytes, widens after a miss
   (a compile off its prediction by more than it) and narrows after a hit. When two compiles
   in a row come out over, the walk has stalled: the next compile bisects the predicted
   frontier (the Pareto sets by predicted bytes and recompute) between the best fit and the
   nearest set known over. Picked by expected gain, the last compile of the budget goes to a
   likely fit (chance at least `LIKELY`) where one recomputes less than the best compiled
   set, and never to a long shot while nothing better than full remat fits. It stops when
   the least-recompute set fits, nothing better is plausible, or the budget (`max_compiles`,
   6 up to 8 tags, said up front) is spent, and logs why; the plan is the least-recompute
   set whose compile fit, never one that did not. No remat is a candidate like the others
   (its policy: ``everything_saveable``), compiled once the least-recompute save set fits.
   When full remat does not fit, or fits with less than `TIGHT` x the uncertainty to spare
   (there the model cannot rank the sets: one tag's packing moves the figure by more than
   the room), every tag saved, then each tag alone, then any set, most likely to fit first,
   are compiled (one per tag more) before `NoFitError` or full remat, and the walk goes on
   from the first that fits with what is left of that budget.

A backend without ``memory_analysis()`` (it raises, returns None, or reports nothing; the
Neuron PJRT plugin may not implement it) makes the compile the oracle: an error carrying
XLA's ``RESOURCE_EXHAUSTED`` or neuronx-cc's NCC_EOOM001/NCC_EOOM002 ("exceeds the
high-bandwidth memory") means over (`out_of_memory`, byte figures kept), a compile that
succeeds means it fits. `fit` then compiles the top of the frontier predicted from the
graphs (arguments + outputs - donated state + kept + recomputed reads; when it fits,
nothing is better) and bisects the rest: at most 2 + ceil(log2(frontier - 1)) compiles
(`_oracle_cap`), within log2(frontier) + 3, unless the caller gave ``max_compiles``. The
figures of out-of-memory errors (above the limit) calibrate the model as memory figures do
(compiles left once the bisection converges go to the walk on that model; when that model
puts full remat within `TIGHT` x the uncertainty of the limit, one compile more per tag
goes to it, to each tag alone first while nothing better than full remat fits, as the
rescue has with memory figures); a set that compiled is at most the
limit, which bounds its tags' effects where the figures put it over; and two out-of-memory
figures that differ by less than `FOLLOW` of their sets' kept bytes say memory does not
follow the kept bytes (then every tag saved, as likely to fit as any set, is compiled if
it was not and a compile is left, before the search stops).

Two steps are reported rather than planned: one whose policy changes nothing (full remat
and every tag saved compile to the same program: `PolicyIgnoredError`), and one whose
compiled memory does not follow the kept bytes (an unrolled Python loop on XLA:CPU: no
remat compiles less than `FOLLOW` of its extra kept bytes above full remat). The latter
gets the least-recompute compiled set that fits and a note saying why it was not
searched.

When the step has no ``remat2`` equation (no ``jax.checkpoint`` in it, or a transform that
hides it) the per-layer graph cannot be read; `fit` then raises a ValueError naming what
it looked for. `fit_preview` (``neuron-remat fit --dry-run``) compiles full remat only and
lists the frontier with predicted bytes.
"""

from __future__ import annotations

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
from jax.extend import core as jcore

from . import _trace
from ._jax_compat import is_name_primitive, remat3_off, save_only_these_names
from ._format import fmt_bytes, grid, tag_list
from .device import DeviceSpec
from .graph import LayerGraph
from .memory_model import reserve_bytes as _reserve_bytes
from .planner import Choice, NoFitError, Plan, TagDecision
from .policies import RegexPolicy

__all__ = ["CompiledFit", "FitPreview", "LayerBackward", "PolicyIgnoredError", "Probe",
           "StepGraph", "fit", "fit_preview", "fit_table", "out_of_memory", "step_graph"]

logger = logging.getLogger("neuron_remat.fit")  # the public name, not the private module's

NO_REMAT = "no remat"


# --------------------------------------------------------------------------------------
# What fit reports: its compiles, and what it learned from them.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """One compile of the training step (`fit`): what XLA allocated and computed.

    `bytes` is ``argument + output + temp - alias`` from ``memory_analysis()`` (-1 when the
    backend reports none: then the compile is the oracle, `out_of_memory` its answer);
    `saved` is None for no remat. `predicted_bytes` is what the fitted model said before
    this compile (None for the probes it was fitted on)."""

    label: str
    saved: tuple[str, ...] | None
    bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    flops: float
    seconds: float
    predicted_bytes: int | None = None
    out_of_memory: bool = False  # the compile failed for want of device memory
    reported_bytes: int | None = None  # the byte figure that failure gave, if any


@dataclass(frozen=True)
class CompiledFit:
    """What `fit` learned from compiling the step, and the confirmed choice.

    The model: ``bytes(S) = fixed_bytes + kept(S) + workspace_slope x read(S)``, kept(S)
    the residuals of every layer, read(S) the bytes one layer's backward reads that S
    recomputes (`workspace_bytes` for the choice); `fixed_bytes` is the fitted intercept:
    the state and the step's policy-independent temporaries, less what the slope's line
    over-counts at read(S) = 0 (it can be negative). `workspace_error_bytes` is the model's largest
    miss on the compiles made (before the per-tag corrections). `measured` is False when
    the backend had no ``memory_analysis()`` and `bytes` is the uncalibrated model's.
    `stop` says why the search ended: the budget was spent, no set that recomputes less
    was plausibly within the limit, the bisection converged, and so on (the plan's
    ``"search: ..."`` note says the same)."""

    hbm_bytes: int
    reserve_bytes: int
    limit_bytes: int
    bytes: int
    flops: float
    no_remat: bool
    compiles: int
    probes: tuple[Probe, ...]
    fixed_bytes: int
    workspace_slope: float
    workspace_bytes: int
    workspace_error_bytes: int
    layers: int
    step_flops: float
    recompute_flops: float
    measured: bool = True
    stop: str = ""

    @property
    def overhead(self) -> float:
        """Recompute as a fraction of the step without remat (every layer counted)."""
        return self.recompute_flops / self.step_flops if self.step_flops else float("nan")


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
        if any(m and is_name_primitive(e.primitive) for m, e in zip(marks, body.eqns)):
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
    with remat3_off():
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


def _jitted(step: Any) -> Any:
    return step if hasattr(step, "lower") else jax.jit(step)


# --------------------------------------------------------------------------------------
# A compile: what the backend says about one save set.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Compiled:
    """One compile. `bytes` is None when the backend cannot report memory (then the
    compile itself is the oracle: `oom` says whether it ran out)."""

    bytes: int | None
    argument: int
    output: int
    temp: int
    alias: int
    flops: float
    seconds: float
    oom: bool = False
    reported: int | None = None  # the largest byte figure an out-of-memory error gave
    fixed: int | None = None  # arguments + outputs - donated (from the lowering)

    def over(self, limit: int) -> bool:
        return self.oom or (self.bytes is not None and self.bytes > limit)


OOM_SIGNALS = ("RESOURCE_EXHAUSTED", "NCC_EOOM001", "NCC_EOOM002",
               "exceeds the high-bandwidth memory")
"""What a compile failure says when the program does not fit the device: XLA's status
code, and neuronx-cc's out-of-memory errors."""

_UNITS = {"b": 1, "bytes": 1, "byte": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def out_of_memory(err: BaseException) -> tuple[bool, int | None]:
    """Whether a compile error says the program does not fit device memory, and the
    largest byte figure the message gives (None when it gives none)."""
    import re  # noqa: PLC0415

    text = f"{type(err).__name__}: {err}"
    if not any(s.lower() in text.lower() for s in OOM_SIGNALS):
        return False, None
    figures = [float(n.replace(",", "")) * _UNITS[u.lower()] for n, u in re.findall(
        r"(\d[\d,]*(?:\.\d+)?)\s*(bytes|byte|[KMGT]i?B|B)\b", text, flags=re.I)]
    return True, (int(max(figures)) if figures else None)


def _fixed_bytes(lowered: Any, args: Sequence[Any]) -> int | None:
    """Arguments + outputs - donated arguments: what the step holds whatever the policy,
    donated state counted once."""
    try:
        infos = jax.tree.leaves(lowered.args_info)
        outs = jax.tree.leaves(lowered.out_info)
        arg = sum(_aval_bytes(i._aval) for i in infos)  # noqa: SLF001
        donated = sum(_aval_bytes(i._aval) for i in infos if i.donated)  # noqa: SLF001
        out = sum(_aval_bytes(o) for o in outs)
    except Exception:  # noqa: BLE001 - a wrapper without the lowering's metadata
        return None
    return arg + out - min(donated, out)


def _compile(step: Any, args: Sequence[Any]) -> _Compiled:
    start = time.perf_counter()
    lowered = _jitted(step).lower(*args)
    fixed = _fixed_bytes(lowered, args)
    try:
        compiled = lowered.compile()
    except Exception as err:
        oom, figure = out_of_memory(err)
        if not oom:
            raise
        return _Compiled(None, 0, 0, 0, 0, float("nan"), time.perf_counter() - start,
                         oom=True, reported=figure, fixed=fixed)
    seconds = time.perf_counter() - start
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes")
    try:
        mem = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - any backend's way of saying "not here"
        mem = None
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float(cost.get("flops", float("nan"))) if cost else float("nan")
    except Exception:  # noqa: BLE001
        flops = float("nan")
    if mem is None or not all(hasattr(mem, f) for f in fields):
        return _Compiled(None, 0, 0, 0, 0, flops, seconds, fixed=fixed)
    arg, out, temp, alias = (int(getattr(mem, f)) for f in fields)
    if arg + out + temp <= 0:
        return _Compiled(None, 0, 0, 0, 0, flops, seconds, fixed=fixed)
    return _Compiled(arg + out + temp - alias, arg, out, temp, alias, flops, seconds,
                     fixed=fixed)


# --------------------------------------------------------------------------------------
# The model and the search.
# --------------------------------------------------------------------------------------


@dataclass
class _Model:
    """``bytes(S) = intercept + scale x kept(S) + slope x read(S)``: least squares over the
    compiled sets, `scale` and `slope` pulled towards 1 (`PRIOR_WEIGHT`) so that two or
    three compiles make a model. `scale` learns what the backend stores per kept byte
    (XLA:CPU keeps bfloat16 as float32); `error` is the largest miss on the compiles."""

    intercept: float
    scale: float
    slope: float
    error: float = 0.0

    @classmethod
    def calibrate(cls, points: Sequence[tuple[int, int, int]]) -> _Model:
        """`points`: (compiled bytes, kept bytes, read bytes)."""
        y = np.array([b for b, _, _ in points], float)
        k = np.array([p[1] for p in points], float)
        r = np.array([p[2] for p in points], float)
        if len(points) == 1:
            return cls(float(y[0] - k[0] - r[0]), 1.0, 1.0, 0.0)
        wk = PRIOR_WEIGHT * max(float(np.ptp(k)), 1.0)
        wr = PRIOR_WEIGHT * max(float(np.ptp(r)), 1.0)
        a = np.vstack([np.column_stack([np.ones_like(k), k, r]),
                       [[0.0, wk, 0.0], [0.0, 0.0, wr]]])
        t = np.concatenate([y, [wk, wr]])
        (c0, scale, slope), *_ = np.linalg.lstsq(a, t, rcond=None)
        scale, slope = float(np.clip(scale, 0.0, 4.0)), float(np.clip(slope, 0.0, 4.0))
        intercept = float(np.mean(y - scale * k - slope * r))
        error = float(np.max(np.abs(y - intercept - scale * k - slope * r)))
        return cls(intercept, scale, slope, error)

    def predict(self, kept: int, read: int) -> int:
        return int(round(self.intercept + self.scale * kept + self.slope * read))


# The search's constants, tuned on the zoo's "train" steps only (tests/cpu/zoo.py:
# gqa4-adamw, wide-ffn-sgd-bf16, long-seq, and since TIGHT's last choice rope-gqa2-bf16 and
# moe8-rope-sgd); benchmarks/fit_sweep.py reports the held-out steps apart.
DEFAULT_BAND = 0.02
"""The uncertainty of a prediction before any miss is seen, as a share of full remat's
compiled bytes (``band=``)."""
PRIOR_WEIGHT = 0.5
"""How hard the model's per-byte scale and workspace slope are pulled towards 1."""
WIDEN = 1.5
"""After a miss (a compile off its prediction by more than the uncertainty) the
uncertainty becomes the larger of that miss and this multiple of itself."""
NARROW = 0.7
"""After a hit the uncertainty shrinks by this factor (down to `FLOOR`)."""
FLOOR = 0.02
"""The least uncertainty, as a share of full remat's compiled bytes."""
PLAUSIBLE = 0.08
"""A set is worth a compile only when its chance to fit (normal errors of the
uncertainty's size) is at least this."""
LIKELY = 0.5
"""When the walk picks the last compile of the budget by expected gain, it picks among the
sets at least this likely to fit, if there is one: no compile follows to mend a miss. While
nothing better than full remat fits, a set less likely than this gets no last compile at
all. (A stalled walk's bisection of the frontier picks as before.)

Chosen on the zoo's train steps (before, the last compile went by chance x recompute saved
alone, as the others do): on gqa4-adamw's sweep (memory_analysis) the sizes within 0.5
points of the best went from 95% to 96%; with the compile as the oracle, and on
wide-ffn-sgd-bf16 and long-seq, nothing moved. At 0.7, 95%. Holding the bisection's pick
to it too cost gqa4-adamw's oracle sweep a miss of 2.27 points."""
TAG_SD = 0.02
"""The spread of one tag's effect on the compiled bytes beyond the model, as a share of
full remat's compiled bytes."""
ALIKE = 0.5
"""The correlation of two tags' effects when the trace cannot tell them apart: saving
either alone keeps the same bytes, leaves the same reads to recompute and saves the same
FLOPs (a K and V projection under GQA, the two halves of a gated FFN, a Q and an output
projection without rotary embedding). The compiler tends to lay out alike buffers alike,
so a miss seen on one moves the other's prediction (`_Search._alike`); a set that saves
both is less sure than two unrelated tags (prior variance (2 + 2 x ALIKE) x TAG_SD^2, not
2 x TAG_SD^2). Valid in [0, 1).

Chosen on the zoo's train steps (0 is one independent effect per tag): on gqa4-adamw's
sweep, memory_analysis, the largest gap went from 1.45 to 0.73 points and the sizes within
0.5 points stayed at 95%; with the compile as the oracle, 96% to 98% within 0.5 points.
At 0.8 the memory sweep fell to 94%; wide-ffn-sgd-bf16 and long-seq did not move."""
TIGHT = 4.0
"""Full remat fits "tightly" when the limit is less than this multiple of the starting
uncertainty above it: there the model cannot rank the sets (one tag's packing moves the
figure by more than the room), and the search explores as when full remat does not fit
(`_Search._rescue`), with that budget.

Chosen on the zoo's train steps. First on gqa4-adamw's sweep (memory_analysis): the sizes
within 0.5 points of the best go from 90% (no tight path) to 93% at 2 and 95% at 3, the
largest gap from 3.63 to 1.45 points; the sizes within 6 compiles from 93% to 91% at 3.
Then, with rope-gqa2-bf16 and moe8-rope-sgd added to the train steps, 3 became 4: on
rope-gqa2-bf16 (memory_analysis) the largest gap fell from 6.88 to 1.18 points (full remat
returned at 8.88 MiB, 0.56 MiB above it, where saving one tag alone compiles smaller);
with the oracle gqa4-adamw's from 1.45 to 0.73 and its share within 0.5 points rose from 98%
to 99%. The price is compiles: gqa4-adamw's sizes within the cap went from 91% to 90%
(memory_analysis) and from 97% to 94% (oracle), the other train steps' by a point at most.
At 5 gqa4-adamw's memory_analysis share fell to 88%, under the issue's 90%."""
SET_SD = 0.004
"""The spread of one save set's compiled bytes beyond its tags' effects (same unit)."""
NO_REMAT_SPREAD = 1.5
"""No remat keeps untagged values too: its uncertainty is this multiple..."""
UNTAGGED = 0.25
"""... plus this share of what it keeps beyond the least-recompute save set."""
FOLLOW = 0.35
"""Memory follows the kept bytes when no remat compiles at least this share of its extra
kept bytes above full remat (an unrolled Python loop on XLA:CPU: about 0.13)."""
FLAT_SPAN = 0.1
"""With the compile as the oracle, two out-of-memory figures test `FOLLOW` only when their
sets' kept bytes differ by at least this share of the limit."""


def _oracle_cap(n_front: int) -> int:
    """Compiles of the oracle's bisection of a frontier of `n_front` sets: full remat, the
    frontier's top, then halving the sets between (at most log2(n_front) + 3)."""
    return 1 + (n_front > 1) + math.ceil(math.log2(max(n_front - 1, 1)))


def _max_compiles(n_tags: int) -> int:
    return 6 if n_tags <= 8 else 6 + (n_tags - 8) // 2


def _stretch(n_tags: int) -> int:
    """The compiles beyond the budget where full remat does not fit or is close to the
    limit (`TIGHT`): one per tag, for each tag alone (`_Search._rescue`)."""
    return n_tags


@dataclass(frozen=True)
class _Candidate:
    saved: tuple[str, ...] | None  # None: no remat
    kept: int
    read: int
    recompute: int


def _candidates(graph: StepGraph, tags: Sequence[str], no_remat: bool = True
                ) -> list[_Candidate]:
    """Every subset of `tags` and no remat, least recompute first. Sets with equal kept
    bytes and recompute stay apart: XLA may lay them out differently."""
    found = []
    for r in range(len(tags) + 1):
        for subset in itertools.combinations(tags, r):
            found.append(_Candidate(subset, graph.kept_bytes(subset), graph.read_bytes(subset),
                                    graph.recompute_flops(subset)))
    if no_remat:
        found.append(_Candidate(None, graph.no_remat_kept_bytes(), 0, 0))
    return sorted(found, key=lambda c: (c.recompute, c.kept, len(c.saved or ()) - (
        c.saved is None) * 1000, c.saved or ()))


def _frontier(cands: Sequence[_Candidate], predict: Callable[[_Candidate], float] | None = None
              ) -> list[_Candidate]:
    """The Pareto sets by predicted bytes and recompute (none predicted smaller with no
    more recompute), least recompute first, so most bytes first; full remat always last
    (the set known to fit when a search starts)."""
    pred = predict or (lambda c: c.kept + c.read)
    out: list[_Candidate] = []
    least = math.inf
    for c in sorted(cands, key=lambda c: (c.recompute, pred(c))):
        if pred(c) < least:
            out.append(c)
            least = pred(c)
    full = next(c for c in cands if c.saved == ())
    if full in out:
        out.remove(full)
    return [*out, full]


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


class _PolicyIgnored(Exception):
    pass


@dataclass
class _Search:
    """The compile-checked search (pure: `measure` compiles)."""

    candidates: list[_Candidate]
    measure: Callable[[_Candidate, int | None], _Compiled]
    limit: int
    max_compiles: int
    band: float = DEFAULT_BAND
    stretch: int = 0
    log: Callable[[str], None] = lambda line: None
    compiled: dict[Any, _Compiled] = dataclasses.field(default_factory=dict)
    order: list[Any] = dataclasses.field(default_factory=list)
    model: _Model | None = None
    sigma: float = 0.0
    oracle: bool = False
    budget_given: bool = False  # max_compiles is the user's: the oracle's cap gives way to it
    stop: str = ""
    noticed: str = ""

    def __post_init__(self) -> None:
        self._by = {c.saved: c for c in self.candidates}
        self._floor = 1.0
        self._scale = 1.0  # full remat's compiled bytes, once known
        self._corr: tuple[list[str], np.ndarray] | None = None  # `_alike`, once built

    # ---- bookkeeping -----------------------------------------------------------------

    @property
    def used(self) -> int:
        return len(self.order)

    @property
    def _every(self) -> _Candidate | None:
        """The least-recompute save set (every useful tag saved)."""
        return next((c for c in self.candidates if c.saved is not None), None)

    def _measure(self, c: _Candidate) -> _Compiled:
        predicted = self.predict(c) if self.model is not None and not self.oracle else None
        got = self.measure(c, predicted)
        self.compiled[c.saved] = got
        self.order.append(c.saved)
        if got.bytes is not None and predicted is not None:
            miss = abs(got.bytes - predicted)
            if miss > self.sigma:
                self.sigma = max(miss, WIDEN * self.sigma)
            else:
                self.sigma = max(NARROW * self.sigma, self._floor)
        if self._figure(got) is not None and self.points():
            self.model = _Model.calibrate(self.points())
        return got

    def _figure(self, r: _Compiled) -> int | None:
        """A compile's bytes: memory_analysis()'s, or the figure an out-of-memory error
        gave when it is over the limit (a smaller one is some allocation, not the
        program's total)."""
        if r.bytes is not None:
            return r.bytes
        if r.oom and r.reported is not None and r.reported > self.limit:
            return r.reported
        return None

    def points(self) -> list[tuple[int, int, int]]:
        return [(b, self._by[s].kept, self._by[s].read) for s, r in self.compiled.items()
                if s is not None and (b := self._figure(r)) is not None]

    def fits(self, saved: Any) -> bool:
        r = self.compiled.get(saved)
        return r is not None and not r.over(self.limit)

    def best(self) -> _Candidate | None:
        return next((c for c in self.candidates if self.fits(c.saved)), None)

    def predict(self, c: _Candidate) -> int:
        """The model's figure plus the saved tags' share of the misses seen (`_tag_effect`).
        No remat is corrected by its own compile only."""
        assert self.model is not None
        base = self.model.predict(c.kept, c.read)
        if c.saved is None:
            got = self.compiled.get(None)
            if got is not None and got.bytes is not None:
                return got.bytes
            return base
        return base + int(round(self._tag_effect(c.saved)[0]))

    def _tag_effect(self, saved: tuple[str, ...]) -> tuple[float, float]:
        """What the saved tags add beyond the model, and its variance: the model's misses
        on the compiled save sets, read as a sum of one unknown effect per saved tag (each
        normal, sd `TAG_SD` of full remat's bytes, `ALIKE`-correlated between tags the
        trace cannot tell apart) plus noise (sd `SET_SD`). XLA's buffer packing moves
        with particular tags (saving one may compile smaller than saving none); a set
        that shares most of its tags with compiled sets is predicted from them, and one
        made of tags never compiled, nor alike to one compiled, keeps the tags' whole
        uncertainty.

        With the compile as the oracle, a set that compiled gives no figure, only that it
        is within the limit: where the effects read from the figures put such a set over
        the limit, the limit joins them as its figure (its tags must add at most that)."""
        assert self.model is not None
        key = (len(self.compiled), id(self.model))
        if getattr(self, "_gp_key", None) != key:
            rows = [(s, b - self.model.predict(self._by[s].kept, self._by[s].read))
                    for s, got in self.compiled.items()
                    if s is not None and (b := self._figure(got)) is not None]
            self._gp = self._effects(rows)
            bounds = [(s, room) for s, got in self.compiled.items()
                      if s and self._figure(got) is None and not got.over(self.limit)
                      and self._effect(s)[0] > (room := self.limit - self.model.predict(
                          self._by[s].kept, self._by[s].read))]
            if bounds:
                self._gp = self._effects(rows + bounds)
            self._gp_key = key
        return self._effect(saved)

    def _effects(self, rows: Sequence[tuple[tuple[str, ...], float]]) -> tuple[Any, ...]:
        """The per-tag effects' posterior from (save set, miss) rows, as `_effect` reads it."""
        tags, corr = self._alike()
        x = np.array([[float(t in s) for t in tags] for s, _ in rows]).reshape(
            len(rows), len(tags))
        y = np.array([r for _, r in rows], float)
        tau2, eps2 = (TAG_SD * self._scale) ** 2, (SET_SD * self._scale) ** 2
        k = tau2 * x @ corr @ x.T + eps2 * np.eye(len(rows))
        kinv = np.linalg.inv(k) if len(rows) else np.zeros((0, 0))
        return (tags, corr, x, kinv @ y if len(rows) else y, kinv, tau2, eps2)

    def _effect(self, saved: tuple[str, ...]) -> tuple[float, float]:
        """The summed effect of `saved`'s tags under the posterior `_effects` built, and
        its variance (noise included)."""
        tags, corr, x, alpha, kinv, tau2, eps2 = self._gp
        v = np.array([float(t in saved) for t in tags])
        kv = tau2 * x @ corr @ v
        mean = float(kv @ alpha) if len(alpha) else 0.0
        var = tau2 * float(v @ corr @ v) - (float(kv @ kinv @ kv) if len(alpha) else 0.0)
        return mean, max(var, 0.0) + eps2

    def _alike(self) -> tuple[list[str], np.ndarray]:
        """The tags (sorted) and the prior correlation of their effects: `ALIKE` between
        two tags whose sets of one (each saved alone) keep, read and recompute exactly the
        same as each other, 0 between others. A tag whose saving alone changes none of
        these (it pays off only beside others) is alike to none: the sets of one cannot
        tell such tags apart, larger sets may. Being alike is an equivalence, so the
        matrix is a block of equal correlations per class: positive definite for
        0 <= `ALIKE` < 1."""
        if self._corr is None:
            tags = sorted({t for c in self.candidates if c.saved for t in c.saved})
            full = self._by[()]
            trace = {}
            for t in tags:
                c = self._by.get((t,))
                f = None if c is None else (c.kept - full.kept, c.read - full.read,
                                            full.recompute - c.recompute)
                if f is not None and any(f):
                    trace[t] = f
            corr = np.eye(len(tags))
            for i, a in enumerate(tags):
                for j, b in enumerate(tags):
                    if i != j and a in trace and trace.get(b) == trace[a]:
                        corr[i, j] = ALIKE
            self._corr = (tags, corr)
        return self._corr

    def chance(self, c: _Candidate) -> float:
        """The chance `c` compiles within the limit: errors normal, with the search's
        uncertainty (widened after a miss, narrowed after a hit) and the set's own (its
        tags' effects, `_tag_effect`)."""
        spread = self.sigma
        if c.saved is None and None not in self.compiled:
            # what no remat keeps beyond the tags (norms, softmaxes, activations) the
            # compiler often fuses away: uncertain in proportion
            assert self.model is not None
            spread = NO_REMAT_SPREAD * self.sigma + UNTAGGED * self.model.scale * max(
                c.kept - self.candidates[0 if self.candidates[0].saved is not None
                                        else 1].kept, 0)
        elif c.saved is not None:
            spread = math.sqrt(spread ** 2 + self._tag_effect(c.saved)[1])
        return _phi((self.limit - self.predict(c)) / max(spread, 1.0))

    # ---- the search ------------------------------------------------------------------

    def run(self) -> _Candidate | None:
        """The least-recompute candidate whose compile fit (None when none did); `stop`
        says why the search ended."""
        full = self._by[()]
        first = self._measure(full)
        self._floor = FLOOR * (first.bytes or first.reported or self.limit)
        self._scale = float(first.bytes or first.reported or self.limit)
        self.sigma = max(self.band * (first.bytes or self.limit), self._floor)
        if first.bytes is None and not first.oom:
            self.oracle = True
            return self._bisect_oracle()
        if first.over(self.limit):
            return self._rescue()
        if first.bytes is not None and self.limit - first.bytes < TIGHT * self.sigma:
            self.log(f"fit: full remat fits with {fmt_bytes(self.limit - first.bytes)} to "
                     f"spare, less than {TIGHT:g} x the uncertainty "
                     f"({fmt_bytes(int(self.sigma))}): exploring each tag as when it does "
                     f"not fit (at most {self.max_compiles + self.stretch} compiles)")
            return self._rescue()
        # the least-recompute save set (every useful tag): the model's second point
        every = self._every
        if every is not None and every.saved and self.used < self.max_compiles:
            got = self._measure(every)
            if got.bytes is None:  # the backend stopped reporting: the compile decides
                self.oracle = True
                return self._bisect_oracle()
            self._check_used(every)
            if not self._follows(full, every):
                return self.best()
        return self._walk()

    def _check_used(self, every: _Candidate) -> None:
        """Raise `_PolicyIgnored` when full remat and saving every tag compiled to the same
        program (the same bytes and FLOPs though they keep different bytes)."""
        a, b = self.compiled[()], self.compiled[every.saved]
        if (a.bytes is not None and a.bytes == b.bytes and a.flops == b.flops
                and every.kept != self._by[()].kept):
            raise _PolicyIgnored(
                f"full remat and saving {', '.join(every.saved or ())} compile to the same "
                f"program ({fmt_bytes(b.bytes or 0)}, {b.flops / 1e9:.4g} GFLOP)")

    def _follows(self, full: _Candidate, every: _Candidate) -> bool:
        """Whether the compiled bytes follow the kept bytes (`noticed` says why not)."""
        grew = self.compiled[every.saved].bytes - self.compiled[()].bytes  # type: ignore[operator]
        if grew >= 0.5 * (every.kept - full.kept):
            return True
        nr = self._by.get(None)
        if nr is None or self.used >= self.max_compiles:
            return True
        got = self._measure(nr)
        if got.bytes is None:
            return True
        extra = nr.kept - full.kept
        if extra > 0 and got.bytes - self.compiled[()].bytes < FOLLOW * extra:
            self._not_following(
                f"no remat keeps {fmt_bytes(extra)} more than full remat but compiles "
                f"{fmt_bytes(got.bytes - self.compiled[()].bytes)} larger, and saving every "
                f"tag {fmt_bytes(grew)}")
            return False
        return True

    def _not_following(self, evidence: str) -> None:
        """Stop: the compiled memory does not follow the kept bytes (`evidence` says how)."""
        self.noticed = (
            f"the compiled step's memory does not follow the kept residuals: {evidence} (the "
            "compiler schedules the layers its own way, as XLA:CPU does an unrolled Python "
            "loop); the search was not run on: the plan is the least-recompute of the "
            "compiled sets that fit")
        self.stop = "memory does not follow the kept bytes"
        self.log(f"fit: {self.noticed}")

    def _walk(self) -> _Candidate | None:
        walk_overs = 0
        while True:
            best = self.best()
            if best is None:
                self.stop = "nothing compiled fits"
                return None
            if best is self.candidates[0]:
                self.stop = "the best compiled set fits and nothing recomputes less"
                return best
            if self.used >= self.max_compiles:
                self.stop = f"the budget of {self.max_compiles} compiles is spent"
                return best
            better = [c for c in self.candidates
                      if c.saved not in self.compiled and c.recompute < best.recompute]
            if not better:
                self.stop = "every set that recomputes less was compiled"
                return best
            if better == [self.candidates[0]] and better[0].saved is None:
                # the least-recompute save set fits: only no remat is better, and one
                # compile says whether it fits (its own prediction is the least sure)
                got = self._measure(better[0])
                continue
            last = self.used == self.max_compiles - 1
            cautious = last and best.saved == ()
            choice = None
            if walk_overs >= 2:  # the walk stalls: bisect the predicted frontier
                choice = self._frontier_midpoint(better)
                if choice is not None and cautious and self.chance(choice) < LIKELY:
                    choice = None
            if choice is None:
                scored = []
                for c in better:
                    if c.saved is None:  # no remat: only once the least-recompute set fits
                        continue
                    p = self.chance(c)
                    if p < PLAUSIBLE or (cautious and p < LIKELY):
                        continue
                    scored.append((p * (best.recompute - c.recompute), p, -c.recompute, c))
                if not scored:
                    self.stop = (f"no set that recomputes less than the best compiled one "
                                 f"is plausibly within the limit (uncertainty "
                                 f"{fmt_bytes(int(self.sigma))}"
                                 + (", the last compile kept for a likely fit" if cautious
                                    else "") + ")")
                    return best
                if last:  # no compile follows to mend a miss: a likely fit, if any
                    scored = [s for s in scored if s[1] >= LIKELY] or scored
                choice = max(scored, key=lambda s: s[:3])[3]
            got = self._measure(choice)
            walk_overs = walk_overs + 1 if got.over(self.limit) else 0

    def _frontier_midpoint(self, better: Sequence[_Candidate]) -> _Candidate | None:
        front = _frontier(self.candidates, self.predict)
        idx = {c.saved: i for i, c in enumerate(front)}
        lo = min((idx[s] for s in self.compiled if s in idx and self.fits(s)),
                 default=len(front) - 1)
        hi = max((idx[s] for s in self.compiled if s in idx and not self.fits(s)
                  and idx[s] < lo), default=-1)
        todo = {c.saved for c in better}
        between = [i for i in range(hi + 1, lo) if front[i].saved in todo]
        if not between:
            return None
        mid = (hi + lo) / 2
        return front[min(between, key=lambda i: (abs(i - mid), i))]

    def _bisect_oracle(self) -> _Candidate | None:
        """No memory figures: bisect the predicted frontier with the compile as the
        oracle (fits or runs out of memory), starting at its top (the least recompute:
        when that fits, nothing is better). An out-of-memory error's byte figure is kept:
        two sets over the limit whose figures differ by less than `FOLLOW` of their kept
        bytes say the compiled memory does not follow the kept residuals, and the search
        stops there (`_flat_best`), as with memory figures. When the bisection converges
        with compiles left and such figures calibrated the model, the rest go to `_walk`:
        sets beside the predicted frontier that the figures say may fit. Where that model
        puts full remat within `TIGHT` x the uncertainty of the limit (`_tight_by_figures`),
        at convergence or once the budget is spent (fit's own, not the caller's), there are
        `stretch` compiles more, each tag alone first while nothing better than full remat
        fits (`_stretch_by_figures`), as `_rescue` has with memory figures there."""
        front = _frontier(self.candidates)
        if not self.budget_given:  # a budget the user gave is theirs, larger or smaller
            self.max_compiles = _oracle_cap(len(front))
        self.log(f"fit: the backend reports no memory figures; the compile is the oracle. "
                 f"Bisecting a predicted frontier of {len(front)} save sets: at most "
                 f"{self.max_compiles} compiles in all")
        lo, hi = len(front) - 1, -1  # front[lo] fits (full remat); front[hi] does not
        overs: list[tuple[_Candidate, int]] = []
        while lo - hi > 1 and self.used < self.max_compiles:
            mid = 0 if hi < 0 else self._oracle_next(front, lo, hi)
            c = front[mid]
            if c.saved in self.compiled:  # full remat is the whole frontier's only set
                break
            got = self._measure(c)
            if len(self.compiled) == 2 and not got.oom and got.flops == self.compiled[()].flops \
                    and c.kept != self._by[()].kept:
                raise _PolicyIgnored(f"full remat and {_what(c.saved)} compile to the same "
                                     f"FLOPs ({got.flops / 1e9:.4g} GFLOP)")
            if not got.over(self.limit):
                lo = mid
                continue
            hi = mid
            if got.reported is not None:
                overs.append((c, got.reported))
                if self._flat(overs):
                    return self._flat_best()
        self.stop = ("bisection converged" if lo - hi <= 1
                     else f"the budget of {self.max_compiles} compiles is spent")
        best = front[lo]
        stretched = False
        if lo - hi <= 1 and self.model is not None and self.used < self.max_compiles:
            # converged with compiles to spare, and out-of-memory figures calibrated the
            # model: the sets beside the frontier that the figures say may fit get the
            # rest, by expected gain as with memory figures (with the stretch from the
            # start where those figures put full remat close to the limit, so that the
            # walk does not hold back a last compile that is not its last)
            stretched = self._stretch_by_figures()
            self.log("fit: bisection converged; walking beside the frontier with "
                     f"{self.max_compiles - self.used} compiles left")
            best = self._walk() or best
        if not stretched and self.used >= self.max_compiles and self._stretch_by_figures():
            best = self._walk() or best
        return best

    def _stretch_by_figures(self) -> bool:
        """With the compile as the oracle and fit's own budget: when the model the
        out-of-memory figures calibrated puts full remat within `TIGHT` x the uncertainty
        of the limit (`_tight_by_figures`), `stretch` compiles more, as `_rescue` has with
        memory figures there, and while nothing better than full remat fits, each tag
        alone first (`_each_tag_alone`), as `_rescue` does. Whether it gave them."""
        if self.model is None or self.budget_given or not self._tight_by_figures():
            return False
        self.max_compiles += self.stretch
        self.log(f"fit: the out-of-memory figures put full remat within {TIGHT:g} x the "
                 f"uncertainty of the limit, where the model cannot rank the sets: "
                 f"{self.stretch} compiles more, as with memory figures (at most "
                 f"{self.max_compiles})")
        best = self.best()
        if best is not None and best.saved == ():
            self._each_tag_alone()
        return True

    def _each_tag_alone(self) -> None:
        """Compile each tag alone not compiled yet, most likely to fit first, until one
        fits or the budget is spent: saving one tag can compile smaller than saving none
        (`_rescue`'s second stage, for the oracle when nothing better than full remat
        fit)."""
        while self.used < self.max_compiles:
            singles = self._untried_singles()
            if not singles:
                return
            if not self._measure(self._most_likely(singles)).over(self.limit):
                return

    def _untried_singles(self) -> list[_Candidate]:
        """The sets of one tag not compiled yet."""
        return [c for c in self.candidates if c.saved and len(c.saved) == 1
                and c.saved not in self.compiled]

    def _most_likely(self, cands: Sequence[_Candidate]) -> _Candidate:
        """The candidate most likely to fit, the one that recomputes less on a tie."""
        return max(cands, key=lambda c: (self.chance(c), -c.recompute))

    def _tight_by_figures(self) -> bool:
        """With the compile as the oracle: whether the model the out-of-memory figures
        calibrated predicts full remat within `TIGHT` x the uncertainty of the limit (with
        memory figures, the compile says so and `_rescue` explores with `stretch` more)."""
        return self.limit - self.predict(self._by[()]) < TIGHT * self.sigma

    def _oracle_next(self, front: Sequence[_Candidate], lo: int, hi: int) -> int:
        """The next frontier index to compile between a set that fits (`lo`) and one over
        (`hi`): once out-of-memory figures have calibrated the model, the least-recompute
        set between them predicted within the limit (the interval's midpoint when none
        is, or no figure came); otherwise the midpoint."""
        mid = (lo + hi) // 2
        if self.model is None:
            return mid
        inside = [i for i in range(hi + 1, lo) if self.predict(front[i]) <= self.limit]
        return inside[0] if inside else mid

    def _flat(self, overs: Sequence[tuple[_Candidate, int]]) -> bool:
        """Whether the out-of-memory figures seen say the compiled memory does not follow
        the kept bytes (`noticed` says why): the two sets over the limit furthest apart in
        kept bytes, at least `FLAT_SPAN` of the limit apart, differ in their figures by
        less than `FOLLOW` of that."""
        if len(overs) < 2:
            return False
        (a, ra), (b, rb) = max(overs, key=lambda o: o[0].kept), min(overs, key=lambda o: o[0].kept)
        span = a.kept - b.kept
        if span < FLAT_SPAN * self.limit or ra - rb >= FOLLOW * span:
            return False
        self._not_following(f"{_what(a.saved)} keeps {fmt_bytes(span)} more than "
                            f"{_what(b.saved)}, but the compiler's out-of-memory figures "
                            f"differ by {fmt_bytes(ra - rb)}")
        return True

    def _flat_best(self) -> _Candidate | None:
        """The compiled memory does not follow the kept bytes (`_flat`): every save set
        compiles to about the same bytes, so the least-recompute one (every tag) is as
        likely to fit as any; compile it when it was not and the budget allows (as the
        search with memory figures compiles it first), then the best that fit."""
        every = self._every
        if every is not None and every.saved not in self.compiled \
                and self.used < self.max_compiles:
            self._measure(every)
        return self.best()

    def _rescue(self) -> _Candidate | None:
        """Full remat does not fit, or fits tightly (`TIGHT`): look for sets that compile
        smaller than the model says. XLA's workspace can drop by more than a tag keeps,
        and the drop comes with particular tags (saving one that cuts a layer's recompute
        in two), not with the smallest. First every tag (the model's second point; on a
        step whose memory does not follow the kept bytes, as likely to fit as any set,
        and the search stops there when it shows that); then each tag alone, most likely
        to fit first, until each has been compiled alone; then any set, most likely
        first. The first that fits hands over to the walk, with what is left of the
        rescue's budget (`max_compiles` + `stretch`; with the compile as the oracle,
        `_oracle_cap`, on the model its out-of-memory figures calibrated)."""
        if self.points():  # memory figures, or the out-of-memory error's
            self.model = _Model.calibrate(self.points())
        else:
            self.model = _Model(float(self.compiled[()].fixed or 0), 1.0, 1.0)
        total = self.max_compiles + self.stretch
        full = self._by[()]
        every = self._every
        if every is not None and every.saved and self.used < total:
            got = self._measure(every)
            if got.bytes is None and not got.oom:  # no figures: the compile is the oracle
                self.oracle = True
                return self.best()
            self._check_used(every)
            if not got.over(self.limit):
                if self.fits(()) and not self._follows(full, every):
                    return self.best()  # full remat fits tightly, and memory is flat
                self.max_compiles = total
                return self._walk()
            figure, first = self._figure(got), self._figure(self.compiled[()])
            extra = every.kept - full.kept
            if figure is not None and first is not None and extra > 0 \
                    and figure - first < FOLLOW * extra:
                self._not_following(f"saving every tag keeps {fmt_bytes(extra)} more than "
                                    f"full remat but compiles {fmt_bytes(figure - first)} "
                                    "larger")
                return self.best()
        while self.used < total:
            left = [c for c in self.candidates if c.saved not in self.compiled
                    and c.saved is not None]  # no remat keeps the most: never smaller
            if not left:
                break
            c = self._most_likely(self._untried_singles() or left)
            got = self._measure(c)
            if got.over(self.limit):
                continue
            if got.bytes is None:  # the compile is the oracle: walk on the error's figures
                self.oracle = True
                cap = total if self.budget_given else _oracle_cap(len(_frontier(
                    self.candidates)))
                if self.model is None or self.used >= cap:
                    break
                self.max_compiles = cap
                return self._walk() or self.best()
            # one fits: recompute less with what is left of the rescue's budget
            self.max_compiles = total
            return self._walk()
        best = self.best()
        if self.fits(()):
            self.stop = (f"full remat fits tightly; each tag alone and the sets most likely "
                         f"to fit came out over ({self.used} compiles)")
        else:
            self.stop = ("full remat does not fit; a set predicted smaller does" if best
                         else "full remat does not fit, nor the sets most likely to fit")
        return best


def _what(saved: tuple[str, ...] | None) -> str:
    return NO_REMAT if saved is None else ("save " + ", ".join(saved) if saved else
                                           "full remat")


# --------------------------------------------------------------------------------------
# fit
# --------------------------------------------------------------------------------------

_OPTIONS = ("candidates", "max_compiles", "progress", "band", "runner_ups", "per_layer",
            "max_sets")


def _check_options(plan_options: dict[str, Any]) -> tuple[int | None, float]:
    """fit's options: unknown ones refused; (max_compiles or None, band), each checked."""
    unknown = sorted(set(plan_options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"fit() got unknown options {unknown}; valid: {', '.join(_OPTIONS)}")
    mc = plan_options.get("max_compiles")
    if mc is not None:
        if isinstance(mc, bool) or not isinstance(mc, (int, np.integer)) or mc < 3:
            raise ValueError(f"max_compiles={mc!r}: give an int of at least 3 (full remat, "
                             "every tag saved, one more)")
        mc = int(mc)
    band = plan_options.get("band", DEFAULT_BAND)
    if isinstance(band, bool) or not isinstance(band, (int, float)) or not math.isfinite(
            band) or band < 0 or band > 1:
        raise ValueError(f"band={band!r}: give the prediction uncertainty as a share of "
                         "full remat's bytes, a finite number in [0, 1]")
    ru = plan_options.get("runner_ups", 3)
    if isinstance(ru, bool) or not isinstance(ru, int) or ru < 0:
        raise ValueError(f"runner_ups={ru!r}: give an int >= 0")
    return mc, float(band)


def _setup(make_step: Callable[[Any], Any], args: Sequence[Any], device: DeviceSpec | None,
           reserve: float | int | None, plan_options: dict[str, Any]) -> tuple[Any, ...]:
    max_compiles, band = _check_options(plan_options)
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
    return device, hbm, held, limit, graph, tags, max_compiles, band


def _policy(saved: tuple[str, ...] | None) -> Any:
    """The JAX policy of a save set: what `fit` compiles and what the plan carries."""
    import re  # noqa: PLC0415

    if saved is None:
        return jax.checkpoint_policies.everything_saveable
    return RegexPolicy([re.escape(t) for t in saved])


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
        **plan_options: ``candidates`` (tags to consider), ``max_compiles`` (at least 3;
            default 6 up to 8 tags, and with the compile as the oracle 2 +
            ceil(log2(frontier - 1)); with memory figures one more per tag where full
            remat does not fit or fits within `TIGHT` (4) x the uncertainty of the
            limit, a budget given too; with the compile as the oracle one more per tag
            where its out-of-memory figures put full remat that close, unless a budget
            was given),
            ``progress`` (called with one line per compile and the search's plan and
            end), ``band`` (the uncertainty of a prediction before any compile has
            missed, a share of full remat's bytes; 0.02), ``runner_ups`` (how many to
            list; 3), ``per_layer`` (True: then a mix of save sets over the layers, no
            remat among them, compiled to confirm it: `fit_per_layer`) and ``max_sets``
            (distinct sets in that mix; 2).

    Returns a `Plan` whose `Plan.policy` is exactly what was compiled (no remat:
    ``jax.checkpoint_policies.everything_saveable``) and whose `Plan.compiled` holds that
    compile's bytes and FLOPs, the number of compiles and each probe. The compiled bytes
    are at most ``HBM per core - reserve``. On a backend without ``memory_analysis()``
    the compile is the oracle (an out-of-memory error: over), `Plan.compiled.measured` is
    False and its bytes are the model's.

    Raises `NoFitError` (with the numbers) when no compiled save set fits, and ValueError
    when the step has no checkpointed layer, ignores its policy, or an option is wrong.
    """
    if plan_options.get("per_layer"):  # the uniform fit, then a compiled mix (fit_per_layer)
        options = {k: v for k, v in plan_options.items() if k not in ("per_layer", "max_sets")}
        uniform = fit(make_step, *args, device=device, reserve=reserve, **options)
        return fit_per_layer(uniform, make_step, *args,
                             max_sets=plan_options.get("max_sets", 2),
                             progress=plan_options.get("progress"))
    plan_options.pop("per_layer", None)
    plan_options.pop("max_sets", None)
    progress = plan_options.get("progress") or (lambda line: logger.info("%s", line))
    device, hbm, held, limit, graph, tags, max_compiles, band = _setup(
        make_step, args, device, reserve, plan_options)
    cands = _candidates(graph, tags)
    budget = max_compiles or _max_compiles(len(tags))
    stretch = _stretch(len(tags))
    probes: list[Probe] = []
    results: dict[Any, _Compiled] = {}
    progress(f"fit: {len(tags)} candidate tags, {len(cands)} save sets (no remat "
             f"included); at most {budget} compiles ({budget + stretch} if full remat does "
             f"not fit, or fits with less than {TIGHT:g} x the uncertainty to spare; a "
             f"backend without memory_analysis() bisects instead: at most "
             + (f"{budget})" if max_compiles else
                f"{_oracle_cap(len(_frontier(cands)))}, {stretch} more if its out-of-memory "
                f"figures put full remat that close to the limit)"))

    def measure(c: _Candidate, predicted: int | None) -> _Compiled:
        label = ("full remat" if c.saved == () else NO_REMAT if c.saved is None
                 else "every tag saved" if not probes[1:] and len(c.saved) == len(tags)
                 else "search")
        progress(f"compile {len(probes) + 1}: {label} ({_what(c.saved)}) ...")
        r = _compile(make_step(_policy(c.saved)), args)
        results[c.saved] = r
        probes.append(Probe(label, c.saved, r.bytes if r.bytes is not None else -1,
                            r.argument, r.output, r.temp, r.alias, r.flops, r.seconds,
                            predicted, out_of_memory=r.oom, reported_bytes=r.reported))
        if r.bytes is not None:
            said = f"{fmt_bytes(r.bytes)} ({'fits' if r.bytes <= limit else 'over'} " \
                   f"{fmt_bytes(limit)})"
        else:
            said = ("out of memory" + (f" ({fmt_bytes(r.reported)} reported)"
                                       if r.reported else "")) if r.oom else "compiled"
        progress(f"compile {len(probes)}: {said}, {r.flops / 1e9:.4g} GFLOP, "
                 f"{r.seconds:.1f} s")
        return r

    search = _Search(cands, measure, limit, budget, band, stretch, progress,
                     budget_given=max_compiles is not None)
    try:
        best = search.run()
    except _PolicyIgnored as err:
        raise PolicyIgnoredError(
            f"make_step ignores its policy: {err}. Pass the policy fit gives to "
            "jax.checkpoint(layer, policy=policy) in each layer; fit cannot plan a step "
            "that does not use it") from None
    progress(f"fit: stopped after {search.used} compiles: {search.stop}")
    logger.info("neuron_remat.fit: stopped after %d compiles: %s", search.used, search.stop)
    if best is None:
        raise NoFitError(_no_fit(probes, limit, hbm, held, search.oracle)
                         + (f" Also: {search.noticed}." if search.noticed else ""))
    r = results[best.saved]
    notes = [f"search: {search.stop}"]
    if search.noticed:
        notes.append(search.noticed)
    measured = r.bytes is not None
    if search.oracle:
        fixed = results[()].fixed
        model = _Model(float(fixed if fixed is not None else 0), 1.0, 1.0)
        notes.append("this backend reports no memory figures (memory_analysis()); the "
                     "compile was the oracle (an out-of-memory error: over). The plan's "
                     "bytes are the uncalibrated prediction (arguments + outputs - donated "
                     "+ kept residuals + one layer's recomputed reads); the compiler "
                     "checks the device's whole HBM, not the reserve")
        logger.warning("neuron_remat.fit: %s", notes[-1])
        r = dataclasses.replace(r, bytes=model.predict(best.kept, best.read))
    else:
        model = search.model or _Model(0.0, 1.0, 1.0)
    return _make_plan(graph, best, cands, device, hbm, held, limit, probes, model, tags, r,
                      plan_options, measured=measured, extra_notes=notes,
                      over={s for s, c in results.items() if c.over(limit)}, stop=search.stop)


class PolicyIgnoredError(ValueError):
    """`make_step` does not pass its policy to ``jax.checkpoint``: every compile is the
    same program, so there is nothing to plan."""


def _fit_reserve(device: DeviceSpec, reserve: float | int | None) -> int:
    if reserve is None:  # the runtime's share only: no fraction for temporaries
        from .memory_model import DEFAULT_RESERVE_FRACTION  # noqa: PLC0415

        full = _reserve_bytes(device, None)
        return full - int(DEFAULT_RESERVE_FRACTION * device.hbm_bytes_per_core)
    if isinstance(reserve, float) and not math.isfinite(reserve):
        raise ValueError(f"reserve={reserve!r}: give a fraction of HBM in [0, 1) as a float, "
                         "or bytes as an int")
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


def _no_fit(probes: Sequence[Probe], limit: int, hbm: int, held: int,
            oracle: bool = False) -> str:
    tried = "; ".join(f"{p.label} " + ("out of memory" if p.out_of_memory else
                                       fmt_bytes(p.bytes)) for p in probes)
    if oracle or all(p.bytes < 0 for p in probes):
        return (f"no compiled save set fits {fmt_bytes(limit)} (HBM {fmt_bytes(hbm)} per "
                f"core - reserve {fmt_bytes(held)}): the compiler ran out of memory on "
                f"each. Compiled: {tried}. To fit: shard the state further, lower the "
                "micro-batch or the sequence length, or give the step more memory.")
    least = min((p for p in probes if p.bytes >= 0), key=lambda p: p.bytes)
    return (f"no compiled save set fits {fmt_bytes(limit)} (HBM {fmt_bytes(hbm)} per core - "
            f"reserve {fmt_bytes(held)}): the smallest compiled step, {least.label}, takes "
            f"{fmt_bytes(least.bytes)}, {fmt_bytes(least.bytes - limit)} over. Compiled: "
            f"{tried}. To fit: shard the state further, lower the micro-batch or the "
            "sequence length, or give the step more memory.")


def _make_plan(graph: StepGraph, best: _Candidate, cands: Sequence[_Candidate],
               device: DeviceSpec, hbm: int, held: int, limit: int,
               probes: Sequence[Probe], model: _Model, tags: Sequence[str],
               compiled: _Compiled, options: dict[str, Any], measured: bool = True,
               extra_notes: Sequence[str] = (), over: set[Any] | None = None,
               stop: str = "") -> Plan:
    layers = graph.count
    notes = list(extra_notes)
    no_remat = best.saved is None
    if no_remat:
        saved = tuple(graph.tags)
        kept, recompute, read = best.kept, 0, 0
        notes.append(f"no remat fits: the step without remat compiles to "
                     f"{fmt_bytes(compiled.bytes or 0)} <= {fmt_bytes(limit)}; the policy is "
                     "jax.checkpoint_policies.everything_saveable")
        workspace = 0
    else:
        saved, kept, recompute, read = best.saved, best.kept, best.recompute, best.read
        workspace = int(round(model.slope * read))
    base = (graph.kept_bytes(()), graph.recompute_flops(()))
    decisions = []
    for t in graph.tags:
        k1, f1 = graph.kept_bytes((t,)), graph.recompute_flops((t,))
        extra, gain = (k1 - base[0]) // layers, (base[1] - f1) / layers
        if t not in tags and not no_remat:
            reason = ("saving it saves no recompute" if f1 >= base[1]
                      else "not a candidate")
        elif t in saved:
            reason = "no remat" if no_remat else "saved: least recompute that fits"
        else:
            reason = "a save set without it fits with less recompute, or with it none fits"
        decisions.append(TagDecision(t, t in saved, max(extra, 0), max(float(gain), 0.0),
                                     reason))
    over = over or set()
    fits = {p.saved for p in probes if p.saved not in over}
    runner = [Choice(c.saved, c.kept // layers, c.recompute / layers) for c in cands
              if c.saved is not None and c is not best and c.recompute >= best.recompute
              and c.saved not in over
              and (c.saved in fits or model.predict(c.kept, c.read) <= limit)]
    runner = runner[:int(options.get("runner_ups", 3))]
    by = {c.saved: c for c in cands}
    error = max((abs(p.bytes - model.predict(by[p.saved].kept, by[p.saved].read))
                 for p in probes if p.saved in by and p.bytes >= 0), default=0) \
        if measured else 0
    record = CompiledFit(
        hbm_bytes=hbm, reserve_bytes=held, limit_bytes=limit, bytes=int(compiled.bytes or 0),
        flops=compiled.flops, no_remat=no_remat, compiles=len(probes),
        probes=tuple(probes), fixed_bytes=int(round(model.intercept)),
        workspace_slope=model.slope, workspace_bytes=workspace,
        workspace_error_bytes=int(error), layers=layers,
        step_flops=float(graph.no_remat_flops), recompute_flops=float(recompute),
        measured=measured, stop=stop)
    fwd = graph.no_remat_flops / 3 / layers
    return Plan(
        policy=_policy(best.saved), saved_tags=tuple(saved),
        kept_bytes_per_layer=kept // layers,
        budget_bytes_per_layer=(kept + max(limit - int(compiled.bytes or 0), 0)) // layers,
        recompute_flops_per_layer=recompute / layers, decisions=tuple(decisions),
        runner_ups=tuple(runner), layers_per_core=layers, inflight=1, device=device,
        forward_flops_per_layer=fwd, notes=tuple(notes), compiled=record)


# --------------------------------------------------------------------------------------
# The dry run: what fit would compile.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitPreview:
    """What `fit` would do, having compiled full remat only: the predicted frontier (the
    Pareto save sets by predicted bytes and recompute, least recompute first), each with
    its predicted bytes, and the compile budget: `max_compiles`, and `stretch` more where
    full remat does not fit, or fits (or, with the compile as the oracle, is predicted)
    within `TIGHT` x the uncertainty of the limit."""

    limit_bytes: int
    full_remat: Probe
    tags: tuple[str, ...]
    candidates: tuple[tuple[tuple[str, ...] | None, int, float], ...]  # saved, bytes, FLOPs
    max_compiles: int
    measured: bool
    step_flops: float
    stretch: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"limit_bytes": self.limit_bytes, "tags": list(self.tags),
                "max_compiles": self.max_compiles, "stretch": self.stretch,
                "measured": self.measured,
                "full_remat": dataclasses.asdict(self.full_remat),
                "candidates": [{"saved": None if s is None else list(s),
                                "no_remat": s is None, "predicted_bytes": b,
                                "recompute_flops": f} for s, b, f in self.candidates]}

    def table(self) -> str:
        rows = [("save", "predicted", "fits?", "recompute")]
        for s, b, f in self.candidates:
            rows.append((_what(s), fmt_bytes(b), "yes" if b <= self.limit_bytes else "no",
                         f"{100 * f / self.step_flops:.2f}%" if self.step_flops else "-"))
        lines = grid(rows)
        fr = self.full_remat
        lines.append("")
        lines.append(
            f"dry run: full remat compiled to "
            + (fmt_bytes(fr.bytes) if self.measured else "(no memory figures)")
            + f" of {fmt_bytes(self.limit_bytes)}; fit would make at most "
            f"{self.max_compiles} compiles among these {len(self.candidates)} sets "
            f"({self.max_compiles + self.stretch} where full remat does not fit or is "
            f"within {TIGHT:g} x the uncertainty of the limit; predictions calibrated on "
            "full remat alone)")
        return "\n".join(lines)


def fit_preview(make_step: Callable[[Any], Any], *args: Any,
                device: DeviceSpec | None = None, reserve: float | int | None = None,
                **plan_options: Any) -> FitPreview:
    """`fit`'s dry run: compile full remat only, and list the save sets fit would choose
    its compiles among (the predicted frontier), with their predicted bytes."""
    device, hbm, held, limit, graph, tags, max_compiles, _ = _setup(
        make_step, args, device, reserve, plan_options)
    cands = _candidates(graph, tags)
    full = next(c for c in cands if c.saved == ())
    r = _compile(make_step(_policy(())), args)
    measured = r.bytes is not None
    base = r.bytes if measured else (r.fixed or 0) + full.kept + full.read
    model = _Model(float(base - full.kept - full.read), 1.0, 1.0)
    front = _frontier(cands, lambda c: model.predict(c.kept, c.read))
    probe = Probe("full remat", (), r.bytes if measured else -1, r.argument, r.output,
                  r.temp, r.alias, r.flops, r.seconds, None, out_of_memory=r.oom,
                  reported_bytes=r.reported)
    budget = max_compiles or (_max_compiles(len(tags)) if measured else
                              _oracle_cap(len(front)))
    return FitPreview(limit, probe, tuple(tags),
                      tuple((c.saved, model.predict(c.kept, c.read), float(c.recompute))
                            for c in front), budget, measured, float(graph.no_remat_flops),
                      _stretch(len(tags)))


def fit_table(plan: Plan) -> str:
    """Each compile of `fit`, then the plan, as text."""
    rec = plan.compiled
    if rec is None:
        return plan.table()
    rows = [("#", "compiled", "save", "bytes", "predicted", "fits", "GFLOP", "seconds")]
    for i, p in enumerate(rec.probes, 1):
        what = ("per layer" if p.label == "per-layer mix" else NO_REMAT if p.saved is None
                else tag_list(p.saved, width=48))
        shown = ("out of memory" if p.out_of_memory else fmt_bytes(p.bytes) if p.bytes >= 0
                 else "-")
        fits = ("no" if p.out_of_memory else "yes" if p.bytes < 0 else
                "yes" if p.bytes <= rec.limit_bytes else "no")
        rows.append((str(i), p.label, what, shown,
                     fmt_bytes(p.predicted_bytes) if p.predicted_bytes is not None else "-",
                     fits, f"{p.flops / 1e9:.4g}", f"{p.seconds:.1f}"))
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


MIX_ATTEMPTS = 3
"""Compiles `fit_per_layer` spends on mixes: after a compiled mix misses its prediction,
the miss is reserved and the mix chosen again."""


@dataclass(frozen=True)
class _MixSet:
    """One save set as a per-layer plan prices it: `per_layer` is what one layer adds to the
    compiled step (calibrated on the compiles), `workspace` what the backward of the set
    holds once (the model's slope x recomputed reads), `cost` its recompute per layer."""

    saved: tuple[str, ...] | None  # None: no remat
    per_layer: int
    workspace: int
    cost: float


def _mix_sets(graph: StepGraph, tags: Sequence[str], probes: Sequence[Probe]
              ) -> tuple[list[_MixSet], _Model]:
    """Every subset of `tags` and no remat, priced from the compiles: a compiled set's own
    figure, otherwise the model fitted on the compiles (as `fit`'s search does)."""
    def shape(saved: tuple[str, ...] | None) -> tuple[int, int]:
        if saved is None:
            return graph.no_remat_kept_bytes(), 0
        return graph.kept_bytes(saved), graph.read_bytes(saved)

    own = [p for p in probes
           if p.bytes >= 0 and not p.out_of_memory and p.label != "per-layer mix"
           and (p.saved is None or all(t in graph.tags for t in p.saved))]
    compiled = {p.saved: p.bytes for p in own}
    model = _Model.calibrate([(b, *shape(s)) for s, b in compiled.items()])
    n = graph.count
    # Recompute as XLA counts it: a rolled scan's FLOPs count its body once, so a compiled
    # set's FLOPs less no remat's are one layer's recompute. Sets not compiled: the layer
    # graph's count, scaled by what XLA counted over the graph on the compiled sets.
    flops = {p.saved: p.flops for p in own if math.isfinite(p.flops)}
    xla: dict[tuple[str, ...], float] = {}
    if None in flops:
        xla = {s: max(f - flops[None], 0.0) for s, f in flops.items() if s is not None}
    counted = sum(graph.recompute_flops(s) / n for s in xla)
    ratio = sum(xla.values()) / counted if xla and counted > 0 else 1.0
    found = []
    for saved in [*(c for r in range(len(tags) + 1) for c in itertools.combinations(tags, r)),
                  None]:
        kept, read = shape(saved)
        ws = 0 if saved is None else int(round(model.slope * read))
        total = compiled.get(saved)
        if total is None:
            total = model.predict(kept, read)
        cost = 0.0 if saved is None else xla.get(
            saved, ratio * float(graph.recompute_flops(saved)) / n)
        found.append(_MixSet(saved, int(math.ceil((total - model.intercept - ws) / n)), ws,
                             cost))
    return found, model


def _choose_mix(sets: Sequence[_MixSet], layers: int, room: int, max_sets: int | None
                ) -> tuple[float, list[tuple[_MixSet, int]]] | None:
    """The least-recompute counts of `sets` over `layers` layers whose per-layer bytes plus
    the largest workspace of the sets used stay within `room` (bytes above the model's
    intercept); None when nothing fits."""
    from . import planner  # noqa: PLC0415

    low = min(s.per_layer for s in sets)
    found: tuple[float, int, list[tuple[_MixSet, int]]] | None = None
    for ws in sorted({s.workspace for s in sets}):
        allowed = [s for s in sets if s.workspace <= ws]
        # Pareto sets only (least cost first, each smaller than any cheaper one).
        front: list[_MixSet] = []
        for s in sorted(allowed, key=lambda s: (s.cost, s.per_layer)):
            if not front or s.per_layer < front[-1].per_layer:
                front.append(s)
        cap = room - ws - layers * low
        answer = planner._knapsack([(s.per_layer - low, s.cost) for s in front],  # noqa: SLF001
                                   layers, cap, max_sets)
        if answer is None:
            continue
        cost, nbytes, counts, _ = answer
        if found is None or (cost, nbytes) < found[:2]:
            found = (cost, nbytes, [(s, k) for s, k in zip(front, counts) if k])
    return None if found is None else (found[0], found[2])


def fit_per_layer(uniform: Plan, make_step: Callable[[Any], Any], *args: Any,
                  max_sets: int | None = 2,
                  progress: Callable[[str], None] | None = None) -> Plan:
    """A per-layer mix of save sets (no remat among them) for the step `uniform` was fitted
    on, confirmed by compiling it.

    Relies only on what `fit` returns and on the step: the compiles of `uniform.compiled`
    (the limit, and each compiled set's bytes) and the step's layer graph (`step_graph`).
    Each set is priced per layer from the compiles: a compiled set's figure, less the
    fitted intercept and its workspace, over the layers (so "every tag" and no remat, when
    `fit` compiled them, are exact end points); a set not compiled gets the fitted model's
    figure. The mix is the exact knapsack over the layers (at most `max_sets` sets, each
    set's workspace counted once), and ``make_step`` is then called with a tuple of one
    policy per layer (`scan_layers` runs such a tuple as one scan per run of equal
    policies). Running the stack as several scans costs memory of its own; a compiled mix
    over the limit has its miss (compiled - predicted) reserved and the mix is chosen
    again, up to `MIX_ATTEMPTS` compiles. When none fits (or the step has layers of
    several kinds, or no memory analysis), the uniform plan is returned with a note.
    """
    from .planner import LayerMix  # noqa: PLC0415

    say = progress or (lambda line: logger.info("%s", line))
    rec = uniform.compiled
    graph = step_graph(make_step, *args)

    def keep(note: str) -> Plan:
        return dataclasses.replace(uniform, notes=(*uniform.notes, note))

    if rec is None or not rec.measured:
        return keep("per-layer plan: not tried (no compiled calibration)")
    if rec.no_remat:
        return uniform  # nothing recomputes less
    if len(graph.layers) != 1:
        return keep(f"per-layer plan: not tried ({len(graph.layers)} kinds of checkpointed "
                    "layer; one scanned stack is supported)")
    n = graph.count
    tags = _pool(graph, None)
    best_tags = tuple(t for t in tags if t in uniform.saved_tags)  # as `_mix_sets` orders
    probes = list(rec.probes)
    if not any(p.saved is None and p.label != "per-layer mix" for p in probes):
        # The other end point of the mixes, measured: no remat's untagged values make it
        # the model's least certain figure.
        say(f"compile {len(probes) + 1}: no remat (the per-layer plan's end point) ...")
        c = _compile(make_step(_policy(None)), args)
        if c.bytes is None:
            return keep("per-layer plan: the backend has no memory_analysis(); not tried")
        probes.append(Probe(NO_REMAT, None, c.bytes, c.argument, c.output, c.temp, c.alias,
                            c.flops, c.seconds))
        say(f"compile {len(probes)}: {fmt_bytes(c.bytes)}")
        rec = dataclasses.replace(rec, probes=tuple(probes), compiles=len(probes))
        uniform = dataclasses.replace(uniform, compiled=rec)
    sets, model = _mix_sets(graph, tags, probes)
    by_saved = {s.saved: s for s in sets}
    if best_tags not in by_saved:
        return keep("per-layer plan: not tried (the uniform set is not among the tags "
                    "worth deciding)")
    uniform_cost = by_saved[best_tags].cost
    # The per-layer plan states recompute as XLA counted it (see `_mix_sets`), the uniform
    # set's too, so that the two compare.
    uniform = dataclasses.replace(uniform, recompute_flops_per_layer=uniform_cost)

    def mix_of(chosen: list[tuple[_MixSet, int]]) -> tuple[LayerMix, ...]:
        mix = []
        for s, k in sorted(chosen, key=lambda c: (c[0].cost, c[0].saved or ())):
            saved = tuple(graph.tags) if s.saved is None else s.saved
            kept = graph.no_remat_kept_bytes() if s.saved is None else graph.kept_bytes(s.saved)
            mix.append(LayerMix(saved, k, kept // n, s.cost, None, _policy(s.saved)))
        return tuple(mix)

    reserve = 0
    c = None
    for attempt in range(MIX_ATTEMPTS):
        room = int(rec.limit_bytes - model.intercept - reserve)
        answer = _choose_mix(sets, n, room, max_sets)
        if answer is None or len(answer[1]) == 1 or answer[0] >= uniform_cost * n:
            if attempt == 0:  # the best mix is the uniform set
                one = by_saved.get(best_tags)
                return dataclasses.replace(
                    uniform, layer_policies=None,
                    layer_mix=mix_of([(one, n)]) if one is not None else (),
                    notes=(*uniform.notes, "per-layer plan: no mix that recomputes less is "
                           f"predicted to fit {fmt_bytes(rec.limit_bytes)}"))
            break
        cost, chosen = answer
        predicted = int(round(model.intercept + sum(s.per_layer * k for s, k in chosen)
                              + max(s.workspace for s, _ in chosen)))
        mix = mix_of(chosen)
        per = tuple(m.policy for m in mix for _ in range(m.layers))
        say(f"compile {len(probes) + 1}: per-layer mix " + "; ".join(
            f"{m.layers} x {NO_REMAT if s.saved is None else list(m.tags)}"
            for m, (s, _) in zip(mix, sorted(chosen, key=lambda c: (c[0].cost,
                                                                     c[0].saved or ()))))
            + f", predicted {fmt_bytes(predicted + reserve)} ...")
        c = _compile(make_step(per), args)
        if c.bytes is None and not c.oom:
            return keep("per-layer plan: the backend has no memory_analysis(); not confirmed")
        probes.append(Probe("per-layer mix", None, c.bytes if c.bytes is not None else -1,
                            c.argument, c.output, c.temp, c.alias, c.flops, c.seconds,
                            predicted + reserve, out_of_memory=c.oom,
                            reported_bytes=c.reported))
        say(f"compile {len(probes)}: " + ("out of memory" if c.oom else
            f"{fmt_bytes(c.bytes)} ({'fits' if not c.over(rec.limit_bytes) else 'over'} "
            f"{fmt_bytes(rec.limit_bytes)})"))
        record = dataclasses.replace(rec, probes=tuple(probes), compiles=len(probes))
        if not c.over(rec.limit_bytes):
            # The plan's compiled figures are the mixed step's, the one it hands out; its
            # recompute is the layer graph's (a rolled scan's FLOPs count one body per scan).
            record = dataclasses.replace(record, bytes=int(c.bytes), flops=c.flops,
                                         recompute_flops=cost)
            return dataclasses.replace(
                uniform, layer_mix=mix, layer_policies=per, compiled=record,
                notes=(*uniform.notes, f"per-layer mix compiled to {fmt_bytes(c.bytes)} "
                       f"<= {fmt_bytes(rec.limit_bytes)} limit (predicted "
                       f"{fmt_bytes(predicted)} + {fmt_bytes(reserve)} reserved for running "
                       "the stack as several scans)"))
        uniform = dataclasses.replace(uniform, compiled=record)
        rec = record
        if c.bytes is None:  # out of memory, no figure: nothing to reserve by
            break
        reserve = max(reserve + 1, c.bytes - predicted)
    if c is None or not c.over(rec.limit_bytes):
        over = "no mix recomputes less and fits once the compiled misses are reserved"
    else:
        got = "out of memory" if c.bytes is None else f"{fmt_bytes(c.bytes)} >"
        over = f"the compiled mix did not fit ({got} {fmt_bytes(rec.limit_bytes)})"
    return keep(f"per-layer plan: {over}; the uniform plan stands")
