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
   layer: for every save set, the bytes kept and the FLOPs recomputed, jointly. Per core:
   a step the compiler partitions over several devices (a jit over a mesh) has global
   shapes in its jaxpr, and a value outside a ``shard_map`` counts 1/n of them, n the
   product of the mesh axes the step's inputs and sharding constraints split anything
   over (`_step._shards`);
2. AOT-compiles full remat (``jit(step).lower(*args).compile()``), reads
   ``memory_analysis()`` (argument + output + temp - alias) and ``cost_analysis()``, and
   where it fits with room (`TIGHT`) bisects the predicted frontier (the Pareto sets by
   predicted bytes and recompute) from its middle: each compile says whether its set fits
   and calibrates ``bytes(S) = fixed + scale x kept(S) + slope x read(S)``; once it has,
   the next set is the least-recompute one between the nearest fit and the nearest over
   (the frontier's top, before any came out over) that the model puts within the limit
   (`_Search._bisect`). kept(S) is the residuals of every layer (exact, from the graphs),
   read(S) the bytes one layer's backward reads that S recomputes, both as the backend
   stores them (XLA:CPU keeps bfloat16 as float32: `_step.STORED_ITEMSIZE`), `scale` what
   is left per kept byte (near 1), `fixed` the state and the policy-independent
   temporaries. The model's misses are read as one unknown effect per saved tag (a Gaussian
   process over which tags a set saves, `TAG_SD`, `SET_SD`, with correlated effects for
   tags the trace cannot tell apart, `ALIKE`): XLA's buffer packing moves with particular
   tags, and saving one may compile smaller than saving none. A set sharing most tags with
   compiled ones is predicted from them, with little uncertainty; one made of tags never
   compiled, nor alike to one compiled, keeps their whole uncertainty;
3. once the bisection converges, walks the compiles left beside the frontier by expected
   gain (the rescue below walks so from its first fit): each set that recomputes less than
   the best compiled fit gets a chance to fit (normal errors: the search's uncertainty and
   the set's own), and the next compile goes to the largest chance x recompute saved, among
   sets whose chance is at least `PLAUSIBLE` (where none is and compiles are left, at least
   `LONG_SHOT`, or any chance while no compile has given a figure). The uncertainty
   starts at `band` of full remat's bytes, widens after a miss (a compile off its
   prediction by more than it) and narrows after a hit. When two
   compiles in a row come out over, the walk has stalled: the next compile bisects the
   predicted frontier again, between the best fit and the nearest set known over.
   Picked by expected gain, the last compile of the budget goes to a likely fit (chance at
   least `LIKELY`) where one recomputes less than the best compiled set, and never to a long
   shot while nothing better than full remat fits. It stops when the least-recompute set
   fits, nothing better is even a long shot, or the budget (`max_compiles`, 6 up to 8
   tags, said up front) is spent, and logs why (where it left sets that recompute less
   at `PLAUSIBLE` or more, the plan counts them, `CompiledFit.unexplored`, and a note names
   the likeliest gain and a larger budget); the plan is the least-recompute set whose
   compile fit, never one that did not, unless another compiled set that fits
   counts fewer operations in its compile (``cost_analysis()``'s flops + transcendentals:
   no remat can count more than saving every tag), which then is the plan, with a note.
   No remat is a candidate like the others (its policy: ``everything_saveable``): the
   frontier's top, and in the walk compiled once the least-recompute save set fits (where
   no remat fits, every tag saved gets a compile to compare it with).
   When full remat does not fit, or fits with less than `TIGHT` x the uncertainty to spare
   (there the model cannot rank the sets: one tag's packing moves the figure by more than
   the room), every tag saved, then each tag alone, then any set, most likely to fit first,
   are compiled (one per tag more) before `NoFitError` or full remat, and the walk goes on
   from the first that fits with what is left of that budget. A ``max_compiles`` the
   caller gives is a hard cap: no compile beyond it, in this case or any other.
   Where the caller named no ``candidates``, each tag outside the pool (it keeps or
   recomputes something, but too little to be worth deciding) is compiled alone there,
   after every tag (one compile more each; with the compile as the oracle, where its
   figures put full remat that close), and any not compiled by then before `NoFitError`
   (`_Search._last_resort`): such a saving can spare the backward a workspace the trace
   does not see. Where one fits, it and the sets that hold it beside the pool's tags join
   the candidates (`_Search._adopt`), and the walk goes on among them.

A backend without ``memory_analysis()`` (it raises, returns None, or reports nothing; the
Neuron PJRT plugin may not implement it) makes the compile the oracle: an error carrying
XLA's ``RESOURCE_EXHAUSTED`` or neuronx-cc's NCC_EOOM001/NCC_EOOM002 ("exceeds the
high-bandwidth memory") means over (`out_of_memory`, byte figures kept), a compile that
succeeds means it fits. `fit` then bisects the frontier predicted from the graphs
(arguments, outputs, less donated state, kept and recomputed reads), from its middle, as
with memory figures where full remat fits with room (here whatever the room: no figure tells
it), within a budget of its own: at most 2 + ceil(log2(frontier - 1)) compiles
(`_oracle_cap`), within log2(frontier) + 3, unless the caller gave ``max_compiles``. The
figures of out-of-memory errors (above the limit) calibrate the model as memory figures do
(compiles left once the bisection converges go to the walk on that model; when that model
puts full remat within `TIGHT` x the uncertainty of the limit, one compile more per tag goes
to it, to each tag alone first while nothing better than full remat fits, as the rescue has
with memory figures); a set that compiled is within the limit, and one whose error gave no
figure over it, and the belief about its tags' effects read from the figures is conditioned
on both (`_belief._condition_on_outcomes`); and two out-of-memory figures that differ by
less than `FOLLOW` of their sets' kept bytes, and the frontier's top (compiled then if it
was not: it keeps the most) with them, say memory does not follow the kept bytes, as two
memory figures do (then every tag saved, as likely to fit as any set, is compiled if it was
not and a compile is left, before the search stops). Errors without figures say only which
sets fit: where the bisection converges with compiles left, the model's intercept is placed
between what the sets that fit and those that did not allow (per-byte scale and workspace
slope at 1), and the rest go to the walk on that model (`_Search._model_by_outcomes`), which
compiles no set holding every tag of one that ran out of memory with no figure (it keeps
more, by an amount no figure bounds: `_Search._scored`).

Two steps are reported rather than planned: one whose policy changes nothing (full remat
and the search's second set compile to the same program: `PolicyIgnoredError`), and one
whose compiled memory does not follow the kept bytes (an unrolled Python loop on XLA:CPU:
two compiled save sets whose figures differ by less than `FOLLOW` of what one keeps more,
and then the frontier's top, usually no remat, grows by less than `FOLLOW` of what it
keeps more; where full remat fits tightly or not at all, every tag saved against full
remat, then no remat). The latter gets the least-recompute compiled set that fits and a
note saying why it was not searched.

When the step has no ``remat2`` equation (no ``jax.checkpoint`` in it, or a transform that
hides it) the per-layer graph cannot be read; `fit` then raises a ValueError naming what
it looked for. `fit_preview` (``neuron-remat fit --dry-run``) compiles full remat only and
lists the frontier with predicted bytes.

Where it lives: `_step` reads the per-layer graphs, `_compile` makes one compile and reads
its figures, `_search` holds the model and the search (and its constants), `_mix` the
per-layer mix; this module holds `fit`, what it reports (`CompiledFit`) and its dry run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._compile import (OOM_SIGNALS, CompileFailedError, Probe, _Compiled, _policy,
                       compile_named, out_of_memory, probe_of)
from ._format import fmt_bytes, grid, tag_list
from ._mix import MIX_COMPILES, MIX_LABEL, fit_per_layer
from ._search import (DEFAULT_BAND, FLOOR, NO_REMAT, PLAUSIBLE, TIGHT, _Candidate,
                      _candidate, _candidates, _frontier, _max_compiles, _Model, _oracle_cap,
                      _PolicyIgnored, _Search, _stretch, _what)
from ._step import (LayerBackward, StepGraph, StepTraceError, _named, _pool, aliases,
                    step_graph)
from .device import DeviceSpec, as_device
from .memory_model import reserve_bytes as _reserve_bytes
from ._plan import Choice, NoFitError, Plan, TagDecision
from .planner import DEFAULT_MIN_FLOPS_PER_BYTE

__all__ = ["OOM_SIGNALS", "CompileFailedError", "CompiledFit", "FitPreview", "LayerBackward",
           "PolicyIgnoredError", "Probe", "StepGraph", "StepTraceError", "fit",
           "fit_per_layer", "fit_preview", "fit_table", "out_of_memory", "step_graph"]

logger = logging.getLogger("neuron_remat.fit")  # the public name, not the private module's


# --------------------------------------------------------------------------------------
# What fit learned from its compiles.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompiledFit:
    """What `fit` learned from compiling the step, and the confirmed choice.

    The model: ``bytes(S) = fixed_bytes + scale x kept(S) + workspace_slope x read(S)``,
    kept(S) the residuals of every layer, read(S) the bytes one layer's backward reads that
    S recomputes (`workspace_bytes` for the choice), both as the backend stores them;
    `fixed_bytes` is the fitted intercept: the state and the step's policy-independent
    temporaries, less what the slope's line over-counts at read(S) = 0 (it can be
    negative). `workspace_error_bytes` is the model's largest
    miss on the compiles made (before the per-tag corrections). `measured` is False when
    the backend had no ``memory_analysis()`` and `bytes` is the uncalibrated model's.
    `stop` says why the search ended: the budget was spent, no set that recomputes less
    was even a long shot (`LONG_SHOT`), the bisection converged, and so on (the plan's
    ``"search: ..."`` note says the same).

    `bytes`, `flops` and `recompute_flops` are always `Plan.policy`'s compile (one policy
    on every layer, for hosts that take one). Where `fit(per_layer=True)` returns a mix
    (`Plan.layer_policies`), `mix_bytes`, `mix_flops` and `mix_recompute_flops` are that
    mixed step's compile (its recompute as XLA counts it); None otherwise.

    `unexplored` counts the save sets the search did not compile that recompute less than
    its choice and that its model gives at least `PLAUSIBLE` (8%) chance to fit: where it
    is not 0, fitting again with a larger ``max_compiles`` may find a better plan (a note
    names the greatest expected gain and a budget 3 compiles larger, at most:
    `advised_max_compiles`). 0 where no
    compile gave a byte figure (``memory_analysis()``'s or an out-of-memory error's): no
    figure calibrated the chances.

    `reused` counts the compiles taken from an earlier fit of the same step at the same
    limit (``fit(resume=...)``): those of `compiles` that were not compiled again (each
    such probe's `Probe.reused` is True). `step_key` names the step (`_step_key`): a fit
    resumes only a fit of the step with the same key."""

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
    scale: float = 1.0  # compiled bytes per kept byte (as stored), fitted
    mix_bytes: int | None = None
    mix_flops: float | None = None
    mix_recompute_flops: float | None = None
    unexplored: int = 0
    reused: int = 0
    step_key: str = ""

    @property
    def advised_max_compiles(self) -> int | None:
        """Where `unexplored` is not 0, the budget the plan's note advises fitting again with
        (with ``resume=`` this plan): up to `ADVISED_MORE` compiles more than it made, one
        per set left; None otherwise."""
        return _advised(self.compiles, self.unexplored)

    @property
    def overhead(self) -> float:
        """Recompute as a fraction of the step without remat (every layer counted)."""
        return self.recompute_flops / self.step_flops if self.step_flops else float("nan")

    @property
    def mix_overhead(self) -> float | None:
        """The per-layer mix's recompute as a fraction of the step (None: no mix)."""
        if self.mix_recompute_flops is None:
            return None
        return self.mix_recompute_flops / self.step_flops if self.step_flops else float("nan")


# --------------------------------------------------------------------------------------
# fit
# --------------------------------------------------------------------------------------

ADVISED_MORE = 3
"""At most how many compiles more than a plan made its note advises where the search left
sets that may fit (`CompiledFit.advised_max_compiles`): a step's compile can take minutes
on Neuron; over the README's sweeps, fitting again so mends more than half of the flagged
misses."""

_OPTIONS = ("candidates", "max_compiles", "progress", "band", "runner_ups", "per_layer",
            "max_sets", "resume")


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
    ms = plan_options.get("max_sets", 2)
    if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, np.integer))
                           or ms < 1):
        raise ValueError(f"max_sets={ms!r}: give the most distinct save sets in a per-layer "
                         "mix, an int of at least 1, or None for no limit")
    pl = plan_options.get("per_layer", False)
    if not isinstance(pl, (bool, np.bool_)):
        raise ValueError(f"per_layer={pl!r}: give True or False")
    cands = plan_options.get("candidates")
    if cands is not None and not isinstance(cands, str) and not (
            isinstance(cands, (list, tuple, set, frozenset))
            and all(isinstance(t, str) for t in cands)):
        raise ValueError(f"candidates={cands!r}: give tag names, a list of str or one "
                         "comma-separated str")
    return mc, float(band)


def _setup(make_step: Callable[[Any], Any], args: Sequence[Any], device: DeviceSpec | None,
           reserve: float | int | None, plan_options: dict[str, Any]) -> tuple[Any, ...]:
    max_compiles, band = _check_options(plan_options)
    device = as_device(device, "fit(device=...)")
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
    asked = plan_options.get("candidates")
    tags = _pool(graph, asked)
    if asked is not None:
        second = {c: u for c, u in aliases(graph, [c for c in _named(asked)
                                                   if c in graph.tags]).items() if u in tags}
        for c, first in second.items():
            logger.info("neuron_remat.fit: candidate %s names the value %s names: decided "
                        "as %s", c, first, first)
        left = [c for c in dict.fromkeys(_named(asked)) if c not in tags and c not in second]
        if left:
            logger.warning("neuron_remat.fit: candidates %s are not decided: saving them "
                           "saves no recompute, or less than %g FLOPs per byte kept "
                           "(cheaper to redo than to hold)", left, DEFAULT_MIN_FLOPS_PER_BYTE)
    return device, hbm, held, limit, graph, tags, max_compiles, band


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
            a budget given is a hard cap: at most that many compiles, in every case. By
            default 6 up to 8 tags, and with the compile as the oracle 2 +
            ceil(log2(frontier - 1)); with memory figures one more per tag where full
            remat does not fit or fits within `TIGHT` (4) x the uncertainty of the
            limit; with the compile as the oracle one more per tag where its
            out-of-memory figures put full remat that close; in both, there and before a
            refusal, one more per tag outside the pool where ``candidates`` is not given),
            ``progress`` (called with one line per compile and the search's plan and
            end), ``band`` (the uncertainty of a prediction before any compile has
            missed, a share of full remat's bytes; 0.02), ``runner_ups`` (how many to
            list; 3), ``per_layer`` (True: then a mix of save sets over the layers, no
            remat among them, compiled to confirm it: `fit_per_layer`, among the same
            ``candidates``; a ``max_compiles`` given caps the two together, the uniform
            fit getting all but `MIX_COMPILES` of it, and at least 3), ``max_sets``
            (distinct sets in that mix, at least 1, None for any; 2) and ``resume`` (the
            `Plan` an earlier `fit` of this step at this limit returned, its
            `CompiledFit`, or the JSON of either as ``neuron-remat fit --json`` prints
            it: a save set compiled there is read back, not compiled again, and still
            counts against ``max_compiles``; see `CompiledFit.reused`; a per-layer mix is
            compiled again).

    Returns a `Plan` whose `Plan.policy` is exactly what was compiled (no remat:
    ``jax.checkpoint_policies.everything_saveable``) and whose `Plan.compiled` holds that
    compile's bytes and FLOPs, the number of compiles and each probe. The compiled bytes
    are at most ``HBM per core - reserve``. On a backend without ``memory_analysis()``
    the compile is the oracle (an out-of-memory error: over), `Plan.compiled.measured` is
    False and its bytes are the model's.

    Raises `NoFitError` (with the numbers) when no compiled save set fits, and ValueError
    when the step has no checkpointed layer, ignores its policy, or an option is wrong;
    among those, `StepTraceError` when the step fails to trace and `CompileFailedError`
    when a compile fails for a reason other than memory (the cause chained).
    """
    if plan_options.get("per_layer"):  # the uniform fit, then a compiled mix (fit_per_layer)
        cap, _ = _check_options(plan_options)
        options = {k: v for k, v in plan_options.items() if k not in ("per_layer", "max_sets")}
        if cap is not None:  # a hard cap over both: the mix gets MIX_COMPILES of it
            options["max_compiles"] = max(3, cap - MIX_COMPILES)
        uniform = fit(make_step, *args, device=device, reserve=reserve, **options)
        return fit_per_layer(uniform, make_step, *args,
                             max_sets=plan_options.get("max_sets", 2),
                             progress=plan_options.get("progress"),
                             candidates=plan_options.get("candidates"), max_compiles=cap)
    plan_options.pop("per_layer", None)
    plan_options.pop("max_sets", None)
    progress = plan_options.get("progress") or (lambda line: logger.info("%s", line))
    device, hbm, held, limit, graph, tags, max_compiles, band = _setup(
        make_step, args, device, reserve, plan_options)
    cands = _candidates(graph, tags)
    key = _step_key(graph, args)
    earlier = _resumed(plan_options.get("resume"), limit, key)
    budget = max_compiles or _max_compiles(len(tags))
    stretch = _stretch(len(tags), budget_given=max_compiles is not None)
    probes: list[Probe] = []
    results: dict[Any, _Compiled] = {}
    progress(f"fit: {len(tags)} candidate tags, {len(cands)} save sets (no remat "
             f"included); " + (
                 f"at most {budget} compiles (max_compiles), whatever the backend reports"
                 if max_compiles else
                 f"at most {budget} compiles ({budget + stretch} if full remat does not "
                 f"fit, or fits with less than {TIGHT:g} x the uncertainty to spare; a "
                 f"backend without memory_analysis() bisects instead: at most "
                 f"{_oracle_cap(len(_frontier(cands)))}, {stretch} more if its "
                 f"out-of-memory figures put full remat that close to the limit)"))

    def measure(c: _Candidate, predicted: int | None) -> _Compiled:
        label = ("full remat" if c.saved == () else NO_REMAT if c.saved is None
                 else "every tag saved" if not probes[1:] and len(c.saved) == len(tags)
                 else "search")
        reused = _set_key(c.saved) in earlier
        progress(f"compile {len(probes) + 1}: {label} ({_what(c.saved)}) "
                 + ("(read back from resume)" if reused else "..."))
        before = "; ".join(f"{p.label} ({_what(p.saved)})" for p in probes)
        r = earlier[_set_key(c.saved)] if reused else compile_named(
            lambda: make_step(_policy(c.saved)), args,
            f"fit: compile {len(probes) + 1} ({_what(c.saved)})"
            + (f", after {before}," if before else ""))
        results[c.saved] = r
        probes.append(probe_of(label, c.saved, r, predicted, reused))
        if r.bytes is not None:
            said = f"{fmt_bytes(r.bytes)} ({'fits' if r.bytes <= limit else 'over'} " \
                   f"{fmt_bytes(limit)})"
        else:
            said = ("out of memory" + (f" ({fmt_bytes(r.reported)} reported)"
                                       if r.reported else "")) if r.oom else "compiled"
        progress(f"compile {len(probes)}: {said}, {r.flops / 1e9:.4g} GFLOP, "
                 + ("not compiled again" if reused else f"{r.seconds:.1f} s"))
        return r

    if graph.shards > 1:
        progress(f"fit: {_shards_note(graph.shards)}")
    spare = _spare(graph, tags) if plan_options.get("candidates") is None else []
    if spare:
        progress(f"fit: {len(spare)} tags outside the candidates "
                 f"({', '.join(c.saved[0] for c in spare)}) are compiled alone too, one "
                 "compile more each where full remat does not fit or fits that close, and "
                 "before a refusal; where one fits, the sets that hold it join the "
                 "candidates" + ("" if max_compiles is None else " (within max_compiles)"))
    search = _Search(cands, measure, limit, budget, band, stretch, progress,
                     budget_given=max_compiles is not None, spare=spare,
                     beside=lambda t: [c for c in _candidates(graph, (*tags, t), False)
                                       if t in (c.saved or ())])
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
    notes = [f"search: {search.stop}"]
    left = search.unexplored()
    if left:
        notes.append(_unexplored_note(left, best, graph, search.used))
    if graph.shards > 1:
        notes.append(_shards_note(graph.shards))
    cheaper = _fewest_ops(best, [c for c in search.candidates if search.fits(c.saved)],
                          results)
    if cheaper is not best:
        notes.append(f"{_what(cheaper.saved)} compiles to fewer FLOPs and transcendentals "
                     f"({_ops(results[cheaper.saved]) / 1e9:.4g} G) than "
                     f"{_what(best.saved)} ({_ops(results[best.saved]) / 1e9:.4g} G), which "
                     "the trace counts as recomputing less: the compile decides")
        best = cheaper
    r = results[best.saved]
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
        r = dataclasses.replace(r, bytes=model.predict(best.stored, best.read))
    else:
        model = search.model or _Model(0.0, 1.0, 1.0)
    if best.saved and not set(best.saved) <= set(tags):  # a tag outside the pool (spare)
        tags = (*tags, *best.saved)
    return _make_plan(graph, best, cands, device, hbm, held, limit, probes, model, tags, r,
                      plan_options, measured=measured, extra_notes=notes,
                      over={s for s, c in results.items() if c.over(limit)}, stop=search.stop,
                      unexplored=len(left), step_key=key)


def _set_key(saved: tuple[str, ...] | None) -> frozenset[str] | None:
    """A save set whatever the order of its tags (None: no remat), as `_resumed` keys it."""
    return None if saved is None else frozenset(saved)


def _step_key(graph: StepGraph, args: Sequence[Any]) -> str:
    """What names a step for ``fit(resume=...)``: a digest of its arguments' shapes and
    dtypes, its tags, and the trace's figures (FLOPs without remat, bytes kept with
    nothing and with everything saved, layer runs, pieces per core). Two steps that differ
    there compile to different programs; two that agree there may still (a changed
    activation of the same cost), which the caller of ``resume`` answers for."""
    import hashlib  # noqa: PLC0415

    import jax  # noqa: PLC0415

    leaves = [(tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", type(a).__name__)))
              for a in jax.tree.leaves(args)]
    text = repr((leaves, tuple(graph.tags), float(graph.no_remat_flops),
                 graph.kept_bytes(()), graph.no_remat_kept_bytes(), graph.count,
                 graph.shards))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _resumed(resume: Any, limit: int, key: str) -> dict[Any, _Compiled]:
    """The compiles of an earlier fit, by save set (`_set_key`), for ``fit(resume=...)``:
    `resume` is its `Plan`, its `CompiledFit`, or the JSON of either (a dict, as
    ``neuron-remat fit --json`` prints a plan). It must be of this step (its `step_key`,
    `key`) at this limit: an out-of-memory answer holds at one limit only. A per-layer
    mix's compiles are left out (they are not one save set's)."""
    if resume is None:
        return {}
    rec = resume.get("compiled", resume) if isinstance(resume, dict) else getattr(
        resume, "compiled", resume)

    def get(key: str) -> Any:
        return rec.get(key) if isinstance(rec, dict) else getattr(rec, key, None)

    probes, lim, earlier_key = get("probes"), get("limit_bytes"), get("step_key")
    if probes is None or lim is None:
        raise ValueError(f"resume={type(resume).__name__}: give the Plan an earlier fit "
                         "returned, its CompiledFit, or the JSON neuron-remat fit --json "
                         "printed; this holds no compiles")
    if int(lim) != limit:
        raise ValueError(f"resume: the earlier fit's limit was {fmt_bytes(int(lim))}, this "
                         f"one's is {fmt_bytes(limit)} (HBM per core less reserve); its "
                         "out-of-memory answers hold at its own limit: fit without resume")
    if earlier_key != key:
        raise ValueError(f"resume: the earlier fit was of another step (step key "
                         f"{earlier_key!r}, this step's {key!r}: its arguments' shapes or "
                         "dtypes, its tags or its traced bytes and FLOPs differ)")
    out: dict[Any, _Compiled] = {}
    for i, p in enumerate(probes, 1):
        try:
            p = p if isinstance(p, dict) else dataclasses.asdict(p)
            if p["label"] == MIX_LABEL:
                continue
            b = int(p["bytes"])
            out[_set_key(None if p["saved"] is None else tuple(p["saved"]))] = _Compiled(
                None if b < 0 else b, int(p["argument_bytes"]), int(p["output_bytes"]),
                int(p["temp_bytes"]), int(p["alias_bytes"]), float(p["flops"]),
                float(p["seconds"]), oom=bool(p.get("out_of_memory", False)),
                reported=p.get("reported_bytes"), fixed=p.get("fixed_bytes"),
                transcendentals=float(p.get("transcendentals") or 0.0))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"resume: compile {i} of the earlier fit is not as fit writes "
                             f"one ({type(err).__name__}: {err}); give the JSON neuron-remat "
                             "fit --json printed, unedited") from None
    return out


def _advised(compiles: int, left: int) -> int | None:
    """The budget to fit again with after `compiles`, where the search left `left` sets
    that may fit: one compile more per set, up to `ADVISED_MORE`; None where it left none."""
    return compiles + min(left, ADVISED_MORE) if left else None


def _unexplored_note(left: Sequence[tuple[_Candidate, float]], best: _Candidate,
                     graph: StepGraph, used: int) -> str:
    """The plan's note on the save sets the search left (`_Search.unexplored`: greatest
    expected gain first, each with its chance to fit) that recompute less than `best`."""
    top, p = left[0]
    many = len(left) > 1
    saved = 100 * (best.recompute - top.recompute) / graph.no_remat_flops
    budget = _advised(used, len(left)) or used  # `left` is never empty here
    return (f"{len(left)} save set{'s' if many else ''} not compiled recompute less than the "
            f"search's choice and {'are each' if many else 'is'} {PLAUSIBLE:.0%} or more "
            f"likely to fit by its model (the greatest expected gain: {_what(top.saved)}, "
            f"{p:.0%} likely, {saved:.3g} points of the step's FLOPs less recompute): fit "
            f"again with max_compiles={budget} (Plan.compiled.advised_max_compiles) and "
            f"resume=this plan for up to {budget - used} compiles more (its {used} are "
            "read back, not compiled again)")


def _shards_note(shards: int) -> str:
    return (f"the step's values are split {shards} ways over its devices (the mesh axes "
            f"its inputs are split over): the traced bytes and FLOPs (global shapes) count "
            f"1/{shards} per core, as memory_analysis() reports one core's (exact for a "
            "value split over every such axis; the compiles calibrate the rest)")


def _spare(graph: StepGraph, tags: Sequence[str]) -> list[_Candidate]:
    """Each tag of the step outside the pool `tags` (not worth deciding by the trace's
    count; not a second name of a pool tag's value; saving it changes something), alone:
    `_Search.spare`."""
    second = aliases(graph, graph.tags)
    full = _candidate(graph, ())
    alone = [_candidate(graph, (t,)) for t in graph.tags
             if t not in tags and second.get(t) not in tags]
    return [c for c in alone if (c.kept, c.recompute) != (full.kept, full.recompute)]


def _fewest_ops(best: _Candidate, fitted: Sequence[_Candidate],
                  results: dict[Any, _Compiled]) -> _Candidate:
    """Among the compiled sets that fit, the one whose compile counts the fewest operations
    (``cost_analysis()``'s flops and transcendentals: a set that recomputes a tanh trades
    one for the other), where every one has a count: the trace ranks by the FLOPs it
    recomputes, but the compiled program may differ (no remat can count more than saving
    every tag, its bfloat16 converts kept; XLA's own rewrites). `best` where the counts tie
    or are missing."""
    ops = {c.saved: _ops(results[c.saved]) for c in fitted}
    if not fitted or not all(f > 0 for f in ops.values()):  # NaN: no count
        return best
    least = min(fitted, key=lambda c: (ops[c.saved], c.recompute))
    return least if ops[least.saved] < ops.get(best.saved, _ops(results[best.saved])) \
        else best


def _ops(r: _Compiled) -> float:
    return r.flops + r.transcendentals


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
               stop: str = "", unexplored: int = 0, step_key: str = "") -> Plan:
    layers = graph.depth
    notes = list(extra_notes)
    if graph.count != layers:
        notes.append(f"the step runs each layer's backward {graph.count / layers:g} times (a "
                     "loop over micro-batches around the gradient, as gradient accumulation "
                     f"runs: {graph.count} runs of {layers} layers): kept bytes are one "
                     "micro-batch's, the recompute counts every run")
    kinds = graph.kinds()
    if kinds > 1:
        notes.append(f"the step checkpoints {kinds} different layers ({layers} in all): "
                     "figures per layer are the step's over its layers, an average; a "
                     "tag of some layers keeps more in each of them")
    no_remat = best.saved is None
    if no_remat:
        saved = tuple(graph.tags)
        kept, recompute, read = best.kept, 0, 0
        said = (f"compiles to {fmt_bytes(compiled.bytes or 0)} <= {fmt_bytes(limit)}"
                if measured else f"compiles (predicted {fmt_bytes(compiled.bytes or 0)})")
        notes.append(f"no remat fits: the step without remat {said}; the policy is "
                     "jax.checkpoint_policies.everything_saveable")
        workspace = 0
    else:
        saved, kept, recompute, read = best.saved, best.kept, best.recompute, best.read
        workspace = int(round(model.slope * read))
    base = (graph.kept_bytes(()), graph.recompute_flops(()))
    second = {t: u for t, u in aliases(graph, graph.tags).items() if u in tags}
    decisions = []
    for t in graph.tags:
        k1, f1 = graph.kept_bytes((t,)), graph.recompute_flops((t,))
        extra, gain = (k1 - base[0]) // layers, (base[1] - f1) / layers
        if t in second and not no_remat:
            first = second[t]
            decisions.append(TagDecision(  # the policy names the first name only
                t, False, max(extra, 0), max(float(gain), 0.0),
                f"another name of {first}'s value: " + ("kept, as " if first in saved
                                                        else "recomputed, as ") + first))
            continue
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
              and (c.saved in fits or model.predict(c.stored, c.read) <= limit)]
    runner = runner[:int(options.get("runner_ups", 3))]
    by = {c.saved: c for c in cands}
    error = max((abs(p.bytes - model.predict(by[p.saved].stored, by[p.saved].read))
                 for p in probes if p.saved in by and p.bytes >= 0), default=0) \
        if measured else 0
    record = CompiledFit(
        hbm_bytes=hbm, reserve_bytes=held, limit_bytes=limit, bytes=int(compiled.bytes or 0),
        flops=compiled.flops, no_remat=no_remat, compiles=len(probes),
        probes=tuple(probes), fixed_bytes=int(round(model.intercept)),
        workspace_slope=model.slope, workspace_bytes=workspace,
        workspace_error_bytes=int(error), layers=layers,
        step_flops=float(graph.no_remat_flops), recompute_flops=float(recompute),
        measured=measured, stop=stop, scale=model.scale, unexplored=unexplored,
        reused=sum(p.reused for p in probes), step_key=step_key)
    fwd = graph.no_remat_flops / 3 / layers
    return Plan(
        policy=_policy(best.saved), saved_tags=tuple(saved),
        kept_bytes_per_layer=kept // layers,
        budget_bytes_per_layer=(kept + max(limit - int(compiled.bytes or 0), 0)) // layers,
        recompute_flops_per_layer=recompute / layers, decisions=tuple(decisions),
        runner_ups=tuple(runner), layers_per_core=layers, inflight=1, device=device,
        forward_flops_per_layer=fwd, notes=tuple(notes), compiled=record,
        no_remat_bytes_per_layer=graph.no_remat_kept_bytes() // layers)


# --------------------------------------------------------------------------------------
# The dry run: what fit would compile.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitPreview:
    """What `fit` would do, having compiled full remat only: the predicted frontier (the
    Pareto save sets by predicted bytes and recompute, least recompute first), each with
    its predicted bytes, and the compile budget: `max_compiles`, and `stretch` more where
    full remat does not fit, or fits (or, with the compile as the oracle, is predicted)
    within `TIGHT` x the uncertainty of the limit (none when the caller gave
    ``max_compiles``: a hard cap)."""

    limit_bytes: int
    full_remat: Probe
    tags: tuple[str, ...]
    candidates: tuple[tuple[tuple[str, ...] | None, int, float], ...]  # saved, bytes, FLOPs
    max_compiles: int
    measured: bool
    step_flops: float
    stretch: int = 0
    tight: bool | None = None  # full remat over or within TIGHT x the uncertainty (band)
    spare: tuple[str, ...] = ()  # tags outside the pool, compiled alone (`_Search.spare`)
    shards: int = 1  # the pieces the step's values are split into (`_step._shards`)

    def to_dict(self) -> dict[str, Any]:
        return {"limit_bytes": self.limit_bytes, "tags": list(self.tags), "shards": self.shards,
                "max_compiles": self.max_compiles, "stretch": self.stretch,
                "tight": self.tight, "measured": self.measured, "spare": list(self.spare),
                "step_flops": self.step_flops,
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
        if fr.out_of_memory:
            said = "ran out of memory" + (f" ({fmt_bytes(fr.reported_bytes)} reported)"
                                          if fr.reported_bytes else "") + " against a limit of"
        else:
            said = "compiled to " + (fmt_bytes(fr.bytes) if self.measured
                                     else "(no memory figures)") + " of"
        lines.append("")
        lines.append(
            f"dry run: full remat {said} {fmt_bytes(self.limit_bytes)}; fit would make at "
            "most "
            f"{self.max_compiles} compiles among these {len(self.candidates)} sets ("
            + (f"{self.max_compiles + self.stretch} where full remat does not fit or is "
               f"within {TIGHT:g} x the uncertainty of the limit; " if self.stretch else "")
            + "predictions calibrated on full remat alone)")
        if self.stretch and self.tight is not None:
            lines.append(f"dry run: here full remat is {'' if self.tight else 'not '}that "
                         f"close: at most {self.max_compiles + self.tight * self.stretch} "
                         "compiles")
        if self.spare:
            lines.append(f"dry run: tags outside the candidates, each compiled alone where "
                         f"full remat does not fit or fits tightly, and before a refusal: "
                         f"{', '.join(self.spare)} (where one fits, the sets beside it too)")
        if self.shards > 1:
            lines.append(f"dry run: {_shards_note(self.shards)}")
        return "\n".join(lines)


def fit_preview(make_step: Callable[[Any], Any], *args: Any,
                device: DeviceSpec | None = None, reserve: float | int | None = None,
                **plan_options: Any) -> FitPreview:
    """`fit`'s dry run: compile full remat only (or read it back from ``resume``), and list
    the save sets fit would choose its compiles among (the predicted frontier), with their
    predicted bytes."""
    device, hbm, held, limit, graph, tags, max_compiles, band = _setup(
        make_step, args, device, reserve, plan_options)
    cands = _candidates(graph, tags)
    full = next(c for c in cands if c.saved == ())
    earlier = _resumed(plan_options.get("resume"), limit, _step_key(graph, args))
    r = earlier.get(frozenset()) or compile_named(lambda: make_step(_policy(())), args,
                                                  "fit --dry-run: full remat")
    measured = r.bytes is not None
    # an out-of-memory error's figure over the limit is the program's (`_Search._figure`)
    figure = r.bytes if measured else (
        r.reported if r.oom and r.reported is not None and r.reported > limit else None)
    base = figure if figure is not None else (r.fixed or 0) + full.stored + full.read
    model = _Model(float(base - full.stored - full.read), 1.0, 1.0)
    front = _frontier(cands, lambda c: model.predict(c.stored, c.read))
    probe = probe_of("full remat", (), r, reused=frozenset() in earlier)
    budget = max_compiles or (_max_compiles(len(tags)) if measured else
                              _oracle_cap(len(front)))
    tight = True if r.oom else None  # full remat does not fit: the rescue's budget
    if measured and r.bytes:  # the rescue's test (`_Search.run`), on this compile
        sigma = max(band * r.bytes, FLOOR * r.bytes)
        tight = r.bytes > limit or limit - r.bytes < TIGHT * sigma
    return FitPreview(limit, probe, tuple(tags),
                      tuple((c.saved, model.predict(c.stored, c.read), float(c.recompute))
                            for c in front), budget, measured, float(graph.no_remat_flops),
                      _stretch(len(tags), budget_given=max_compiles is not None), tight,
                      tuple(c.saved[0] for c in _spare(graph, tags))
                      if plan_options.get("candidates") is None else (), graph.shards)


def fit_table(plan: Plan) -> str:
    """Each compile of `fit`, then the plan, as text."""
    rec = plan.compiled
    if rec is None:
        return plan.table()
    rows = [("#", "compiled", "save", "bytes", "predicted", "fits", "GFLOP", "seconds")]
    for i, p in enumerate(rec.probes, 1):
        what = ("per layer" if p.label == MIX_LABEL else NO_REMAT if p.saved is None
                else tag_list(p.saved, width=48))
        shown = ("out of memory" if p.out_of_memory else fmt_bytes(p.bytes) if p.bytes >= 0
                 else "-")
        fits = ("no" if p.out_of_memory else "yes" if p.bytes < 0 else
                "yes" if p.bytes <= rec.limit_bytes else "no")
        rows.append((str(i), p.label, what, shown,
                     fmt_bytes(p.predicted_bytes) if p.predicted_bytes is not None else "-",
                     fits, f"{p.flops / 1e9:.4g}",
                     "resumed" if p.reused else f"{p.seconds:.1f}"))
    lines = grid(rows)
    lines.append("")
    chosen = NO_REMAT if rec.no_remat else f"save {tag_list(plan.saved_tags)}"
    lines.append(
        f"fit: {chosen}: {'compiled' if rec.measured else 'predicted'} "
        f"{fmt_bytes(rec.bytes)} of {fmt_bytes(rec.limit_bytes)} (HBM "
        f"{fmt_bytes(rec.hbm_bytes)} - reserve {fmt_bytes(rec.reserve_bytes)}), recompute "
        f"{100 * rec.overhead:.2f}% of the step, {rec.compiles} compiles")
    if rec.mix_bytes is not None and rec.mix_overhead is not None:
        lines.append(
            f"fit: per-layer mix (Plan.layer_policies, as listed below): compiled "
            f"{fmt_bytes(rec.mix_bytes)} of {fmt_bytes(rec.limit_bytes)}, recompute "
            f"{100 * rec.mix_overhead:.2f}% of the step")
    lines.append(
        f"model: {rec.fixed_bytes / 2**20:.3f} MiB intercept + {rec.scale:.3g} x kept "
        f"residuals of {rec.layers} layers (as the backend stores them) "
        f"+ {rec.workspace_slope:.3g} x one layer's recomputed reads "
        f"(here {fmt_bytes(rec.workspace_bytes)}); largest miss "
        f"{fmt_bytes(rec.workspace_error_bytes)}")
    lines.append("")
    lines.append(plan.table())
    return "\n".join(lines)
