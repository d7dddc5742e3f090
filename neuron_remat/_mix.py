"""Per-layer plans against the compiled step (``fit(..., per_layer=True)``).

`fit_per_layer` takes a uniform plan `fit` returned and looks for a mix of save sets over
the layers (no remat among them) that recomputes less and still fits, priced from `fit`'s
compiles (`_mix_sets`), chosen by an exact knapsack (`_choose_mix`) and confirmed by a
compile.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._compile import CompileFailedError, Probe, _policy, compile_named, probe_of
from ._format import first_line, fmt_bytes
from ._belief import _Model
from ._search import NO_REMAT
from ._step import StepGraph, _pool, step_graph
from ._plan import LayerMix, Plan

logger = logging.getLogger("neuron_remat.fit")  # the public name, not the private module's


MIX_ATTEMPTS = 3
"""Compiles `fit_per_layer` spends on mixes: after a compiled mix misses its prediction,
the miss is reserved and the mix chosen again."""
MIX_LABEL = "per-layer mix"
"""The label of a mix's compile among a plan's probes (`Probe.label`)."""
MIX_COMPILES = 2
"""The share of a ``max_compiles`` the caller gave ``fit(..., per_layer=True)`` that the
mix gets: no remat (the mixes' end point, when `fit` did not compile it) and one mix."""


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
            return graph.no_remat_kept_bytes(stored=True), 0
        return graph.stored_bytes(saved), graph.read_bytes(saved)

    own = [p for p in probes
           if p.bytes >= 0 and not p.out_of_memory and p.label != MIX_LABEL
           and (p.saved is None or all(t in graph.tags for t in p.saved))]
    compiled = {p.saved: p.bytes for p in own}
    model = _Model.calibrate([(b, *shape(s)) for s, b in compiled.items()])
    n = graph.depth  # layers held at once: a loop over micro-batches repeats them
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
                  progress: Callable[[str], None] | None = None,
                  candidates: Sequence[str] | str | None = None,
                  max_compiles: int | None = None) -> Plan:
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
    several kinds, or no memory analysis), the uniform plan is returned with a note, and
    its figures as `fit` gave them.

    `candidates`: the tags a mix may save (`fit`'s option of that name; every useful tag
    when None). `max_compiles`: the compiles allowed in all, `uniform`'s included (a hard
    cap, as `fit`'s); no limit but `MIX_ATTEMPTS` when None.
    """
    say = progress or (lambda line: logger.info("%s", line))
    rec = uniform.compiled
    graph = step_graph(make_step, *args)
    own_recompute = uniform.recompute_flops_per_layer  # the graph's count, as fit states it

    def keep(note: str) -> Plan:
        return dataclasses.replace(uniform, notes=(*uniform.notes, note),
                                   recompute_flops_per_layer=own_recompute)

    if rec is None or not rec.measured:
        return keep("per-layer plan: not tried (no compiled calibration)")
    if rec.no_remat:
        return uniform  # nothing recomputes less
    if len(graph.layers) != 1:
        return keep(f"per-layer plan: not tried ({len(graph.layers)} checkpointed layers "
                    "that are not one scanned stack: an unrolled loop, or layers of several "
                    "kinds; one scanned stack is supported)")
    n = graph.depth
    tags = _pool(graph, candidates)
    best_tags = tuple(t for t in tags if t in uniform.saved_tags)  # as `_mix_sets` orders
    probes = list(rec.probes)
    has_no_remat = any(p.saved is None and p.label != MIX_LABEL for p in probes)
    left = MIX_ATTEMPTS + 1 if max_compiles is None else max_compiles - len(probes)
    if left < 1 + (not has_no_remat):
        return keep(f"per-layer plan: not tried (the budget of {max_compiles} compiles is "
                    "spent)")
    attempts = min(MIX_ATTEMPTS, left - (not has_no_remat))
    if not has_no_remat:
        # The other end point of the mixes, measured: no remat's untagged values make it
        # the model's least certain figure.
        say(f"compile {len(probes) + 1}: no remat (the per-layer plan's end point) ...")
        c = compile_named(lambda: make_step(_policy(None)), args,
                          f"fit per layer: compile {len(probes) + 1} (no remat)")
        if c.bytes is None and not c.oom:
            return keep("per-layer plan: the backend has no memory_analysis(); not tried")
        probes.append(probe_of(NO_REMAT, None, c))
        say(f"compile {len(probes)}: " + ("out of memory" if c.bytes is None
                                          else fmt_bytes(c.bytes)))
        rec = dataclasses.replace(rec, probes=tuple(probes), compiles=len(probes))
        uniform = dataclasses.replace(uniform, compiled=rec)
    sets, model = _mix_sets(graph, tags, probes)
    by_saved = {s.saved: s for s in sets}
    if best_tags not in by_saved:
        return keep("per-layer plan: not tried (the uniform set is not among the tags "
                    "worth deciding)")
    uniform_cost = by_saved[best_tags].cost
    # A mix states recompute as XLA counted it (see `_mix_sets`), the uniform set's too,
    # so that the two compare; a uniform plan that stands keeps fit's figure (`keep`).
    uniform = dataclasses.replace(uniform, recompute_flops_per_layer=uniform_cost)

    def mix_of(chosen: list[tuple[_MixSet, int]]) -> tuple[LayerMix, ...]:
        mix = []
        for s, k in sorted(chosen, key=lambda c: (c[0].cost, c[0].saved or ())):
            saved = tuple(graph.tags) if s.saved is None else s.saved
            kept = graph.no_remat_kept_bytes() if s.saved is None else graph.kept_bytes(s.saved)
            mix.append(LayerMix(saved, k, kept // n, s.cost, None, _policy(s.saved),
                                no_remat=s.saved is None))
        return tuple(mix)

    reserve = 0
    c = None
    for attempt in range(attempts):
        room = int(rec.limit_bytes - model.intercept - reserve)
        answer = _choose_mix(sets, n, room, max_sets)
        if answer is None or len(answer[1]) == 1 or answer[0] >= uniform_cost * n:
            if attempt == 0:  # the best mix is the uniform set
                one = by_saved.get(best_tags)
                return dataclasses.replace(
                    keep("per-layer plan: no mix that recomputes less is predicted to fit "
                         f"{fmt_bytes(rec.limit_bytes)}"), layer_policies=None,
                    layer_mix=mix_of([(dataclasses.replace(one, cost=own_recompute), n)])
                    if one is not None else ())
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
        try:
            c = compile_named(lambda: make_step(per), args,
                              f"fit per layer: compile {len(probes) + 1} (a mix)")
        except CompileFailedError as err:
            if attempt:  # the step ran a tuple before: this failure is the step's own
                raise
            # the first mix: likely a make_step that takes one policy, not a tuple of them
            why = (f"per-layer plan: not confirmed: {first_line(err)}; for a mix make_step "
                   f"gets a tuple of {n} policies, one per layer (run them with "
                   "neuron_remat.scan_layers); the uniform plan stands")
            logger.warning("neuron_remat.fit: %s", why)
            return keep(why)
        if c.bytes is None and not c.oom:
            return keep("per-layer plan: the backend has no memory_analysis(); not confirmed")
        probes.append(probe_of(MIX_LABEL, None, c, predicted + reserve))
        say(f"compile {len(probes)}: " + ("out of memory" if c.oom else
            f"{fmt_bytes(c.bytes)} ({'fits' if not c.over(rec.limit_bytes) else 'over'} "
            f"{fmt_bytes(rec.limit_bytes)})"))
        record = dataclasses.replace(rec, probes=tuple(probes), compiles=len(probes))
        if not c.over(rec.limit_bytes):
            # The compiled figures stay `Plan.policy`'s (the uniform set, for hosts that
            # take one policy); the mixed step's are its own, with its recompute as XLA
            # counts it (`_mix_sets`: a rolled scan's FLOPs count one body per scan).
            record = dataclasses.replace(record, mix_bytes=int(c.bytes), mix_flops=c.flops,
                                         mix_recompute_flops=cost)
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
