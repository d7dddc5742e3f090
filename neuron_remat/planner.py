"""The planner: the save set that fits a memory budget with the least recomputation,
chosen exactly over the footprint it is given (analytic or traced)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from . import memory_model as mm
from . import models
from ._format import fmt_bytes, fmt_seconds
from ._plan import (OBJECTIVES, Choice, GroupDecision, LayerMix, NoFitError, Plan,
                    TagDecision)
from .device import DeviceSpec, EngineRates, as_device, engine_rates
from .graph import PICOSECONDS, timed_graph
from .policies import RegexPolicy

__all__ = ["OBJECTIVES", "Choice", "GroupDecision", "LayerMix", "NoFitError",
           "Plan", "TagDecision", "dead_patterns", "plan", "plan_footprint",
           "refuse_dead_patterns"]

logger = logging.getLogger(__name__)

DEFAULT_MIN_FLOPS_PER_BYTE = 8.0
"""A tag that saves fewer FLOPs of recompute per byte it keeps is elementwise work (a norm
or activation output: a few FLOPs per element), cheaper to redo than to hold. A matmul
output saves ``2 x contraction`` FLOPs per element, at least 32 per byte for any real
layer."""


def _solve(footprint: mm.Footprint, candidates: Sequence[str], budget: int,
           keep: int = 4, budget_for: Callable[[tuple[str, ...]], int] | None = None
           ) -> list[Choice]:
    """The `keep` best feasible save sets (least recompute, then fewest bytes, then names),
    exactly: every subset is evaluated jointly on the footprint's graph when it has one
    (`_solve_joint`, up to `MAX_JOINT_TAGS` candidates), or when an additive footprint is
    small (2**8); otherwise a branch and bound over the additive per-tag costs.
    `budget_for(subset)`, when given, is each enumerated subset's own budget (its policy's
    workspace; never below `budget`); the branch and bound keeps the single `budget`."""
    if footprint.graph is not None:
        return _solve_joint(footprint, candidates, budget, keep, budget_for)
    if len(candidates) <= 8:
        found = []
        for r in range(len(candidates) + 1):
            for subset in itertools.combinations(candidates, r):
                kept, flops = footprint.evaluate(subset)
                if kept <= (budget if budget_for is None else budget_for(subset)):
                    found.append(Choice(tuple(sorted(subset)), kept, flops))
        found.sort(key=lambda c: (c.recompute_flops, c.kept_bytes, len(c.tags), c.tags))
        return _distinct(found, keep)
    return _branch_and_bound(footprint, candidates, budget, keep)


MAX_JOINT_TAGS = 20
"""Candidate tags a joint footprint is searched over exhaustively (2**20 tag sets)."""


def _solve_joint(footprint: mm.Footprint, candidates: Sequence[str], budget: int,
                 keep: int, budget_for: Callable[[tuple[str, ...]], int] | None = None
                 ) -> list[Choice]:
    """`_solve` on a footprint with a graph: every tag set is evaluated jointly (the
    graph's bitmask evaluation, one union per tag set built from a smaller one)."""
    n = len(candidates)
    if n > MAX_JOINT_TAGS:
        raise ValueError(f"{n} candidate tags are too many to search jointly (at most "
                         f"{MAX_JOINT_TAGS}); restrict candidates=")
    graph = footprint.graph
    assert graph is not None
    closures = graph.closures
    bits = [closures.mask([footprint.roles[t]]) for t in candidates]
    saved = [0] * (1 << n)
    found = []
    run = closures.run
    # A policy's own budget is never below `budget` (full remat's workspace is the
    # largest) nor above saving every candidate's.
    top = budget if budget_for is None else max(budget, budget_for(tuple(candidates)))
    for i in range(1 << n):
        if i:
            low = i & -i
            saved[i] = saved[i ^ low] | bits[low.bit_length() - 1]
        kept, flops, _ = run(saved[i])
        if kept <= budget or (kept <= top and budget_for is not None and kept <= budget_for(
                tuple(candidates[j] for j in range(n) if i >> j & 1))):
            found.append((flops, kept, i.bit_count(), i))
    found.sort()

    def tags(i: int) -> tuple[str, ...]:
        return tuple(sorted(candidates[j] for j in range(n) if i >> j & 1))

    # `_distinct` over the front of the list, built incrementally; ties in cost, bytes and
    # size are ordered by tag names, as `_solve` orders them.
    out: list[Choice] = []
    start = 0
    while start < len(found) and len(out) < keep:
        end = start
        while end < len(found) and found[end][:3] == found[start][:3]:
            end += 1
        tied = sorted((Choice(tags(i), k, float(f)) for f, k, _, i in found[start:end]),
                      key=lambda c: c.tags)
        for c in tied:
            if not any(set(o.tags) <= set(c.tags) and o.recompute_flops <= c.recompute_flops
                       for o in out):
                out.append(c)
                if len(out) == keep:
                    break
        start = end
    return out


def _distinct(choices: list[Choice], keep: int) -> list[Choice]:
    """Drop choices that only add tags saving nothing to a better one."""
    out: list[Choice] = []
    for c in choices:
        if any(set(o.tags) <= set(c.tags) and o.recompute_flops <= c.recompute_flops
               for o in out):
            continue
        out.append(c)
        if len(out) == keep:
            break
    return out


def _branch_and_bound(footprint: mm.Footprint, candidates: Sequence[str], budget: int,
                      keep: int) -> list[Choice]:
    base_kept, base_flops = footprint.evaluate(())
    cap = budget - base_kept
    items = sorted(((footprint[t].bytes, footprint[t].recompute_flops, t) for t in candidates),
                   key=lambda it: (-(it[1] / it[0]) if it[0] else -math.inf, it[2]))
    best: list[tuple[float, int, tuple[str, ...]]] = []  # (gain, bytes, tags)

    def bound(i: int, room: int, gain: float) -> float:
        for b, f, _ in items[i:]:
            if b <= room:
                room, gain = room - b, gain + f
            else:
                return gain + (f * room / b if b else f)
        return gain

    def worst() -> float:
        return min(g for g, _, _ in best) if len(best) >= keep else -math.inf

    def visit(i: int, room: int, gain: float, chosen: tuple[str, ...]) -> None:
        if i == len(items):
            best.append((gain, cap - room, tuple(sorted(chosen))))
            best.sort(key=lambda e: (-e[0], e[1], e[2]))
            del best[keep * 4:]
            return
        if bound(i, room, gain) < worst():
            return
        b, f, t = items[i]
        if b <= room:
            visit(i + 1, room - b, gain + f, chosen + (t,))
        visit(i + 1, room, gain, chosen)

    if cap >= 0:
        visit(0, cap, 0.0, ())
    found = [Choice(tags, base_kept + used, base_flops - gain) for gain, used, tags in best]
    found.sort(key=lambda c: (c.recompute_flops, c.kept_bytes, len(c.tags), c.tags))
    return _distinct(found, keep)


def plan(
    device: DeviceSpec | None = None,
    config: models.TransformerConfig | None = None,
    shape: models.StepShape | None = None,
    parallelism: models.Parallelism | None = None,
    candidates: Iterable[str] | None = None,
    *,
    budget_bytes: int | None = None,
    reserve: float | int | None = None,
    min_flops_per_byte: float = DEFAULT_MIN_FLOPS_PER_BYTE,
    runner_ups: int = 3,
    objective: str | None = None,
    rates: EngineRates | str | None = None,
    per_layer: bool = False,
    max_sets: int | None = 2,
) -> Plan:
    """Choose the tags a described model's layers save: the set that fits the budget with
    the least recompute.

    `config` and `shape` describe the model and one step; `parallelism` how it is split
    (default: FSDP over every core of one host, ``Parallelism(fsdp=-1)``, as the plugin
    assumes without one); `device` is detected when None. The
    budget is what one layer may keep on one core once the state, the reserve (`reserve`,
    a fraction of HBM or bytes) and the step's workspace are held (`memory_model.budget`);
    `budget_bytes` overrides it. For a footprint you measured or traced, use
    `plan_footprint`.

    `candidates` restricts the tags considered (tag names, or roles such as ``q_proj``).
    Tags saving fewer than `min_flops_per_byte` FLOPs per byte kept are never saved.
    `runner_ups` is how many next-best sets the plan lists. Raises `NoFitError` when even
    full recompute does not fit.

    `objective` is what is minimised: ``"flops"`` (recompute FLOPs) or ``"time"``
    (recompute time: each op of the layer graph priced by a roofline over `rates`, an
    `EngineRates` or a name in `device.ENGINE_RATES`, by default the device's). The default
    is ``"time"`` on a Neuron device whose rates are known, ``"flops"`` elsewhere. Under
    ``"time"`` a tag is not worth saving when recomputing it takes less time than writing
    and reading it (``2 x bytes / HBM bandwidth``), in place of `min_flops_per_byte`.

    `per_layer=True` also finds the optimal mix of save sets over the model's layers per
    core: each layer takes one set of the frontier of (kept bytes, recompute), all layers
    together within the budget, least total recompute (an exact knapsack over the layers).
    The plan's fields stay those of the best uniform set; `Plan.layer_mix` and
    `Plan.layer_policies` (one policy per layer, None when the best mix is uniform) give
    the mix. `max_sets` bounds the distinct sets in the mix (2: a scanned stack runs as two
    scans, `scan_layers`; each further scan costs the compiler another working set); None
    leaves it free.
    """
    _check_plan_numbers(budget_bytes, min_flops_per_byte, runner_ups, reserve)
    _check_counts(max_sets=max_sets)
    device = as_device(device, "plan(device=...)")
    if isinstance(config, str):
        config = models.get_model(config)
    if config is None:
        raise ValueError("plan needs a model: config=None; give a TransformerConfig or a "
                         "built-in name (get_model), or call plan_footprint with a footprint "
                         "and a byte budget")
    if not isinstance(config, models.TransformerConfig):
        raise TypeError(f"plan(config=...): {str(config)[:60]!r} ({type(config).__name__}) "
                        "is not a model; give a TransformerConfig or a built-in model name")
    if not isinstance(shape, models.StepShape):
        hint = (f" ({config.name}'s default: StepShape(seq_len={config.default_seq_len}))"
                if config.default_seq_len else "")
        raise ValueError(f"plan needs the step's shape: shape={shape!r}; give "
                         f"StepShape(seq_len=...){hint}")
    if device is None:
        from .device import detect  # noqa: PLC0415

        device = detect()
    # Plan in the names the host emits on this device (axlearn on Neuron: no
    # flash-attention tag, so attention is recomputed under any names policy).
    config = dataclasses.replace(config, tags=models.host_tags(config.tags, device))
    notes = list(models.shape_notes(config, shape))
    par = (parallelism or models.Parallelism(fsdp=-1)).resolve(device)
    bud = mm.budget(device, config, shape, par, reserve=reserve)
    fp = mm.layer_footprint(config, shape, par)
    per_layer_bytes = bud.per_layer_bytes if budget_bytes is None else int(budget_bytes)
    budget_for: Callable[[tuple[str, ...]], int] | None = None
    if bud.graph is not None and budget_bytes is None:
        budget_for = _own_workspace(bud, getattr(fp, "roles", {}))
    return _choose(fp, per_layer_bytes, candidates, notes=notes, device=device, config=config,
                   shape=shape, par=par, bud=bud, budget_for=budget_for,
                   layers=bud.layers_per_core, inflight=bud.inflight,
                   min_flops_per_byte=min_flops_per_byte, runner_ups=runner_ups,
                   objective=objective, rates=rates, per_layer_mix=bool(per_layer),
                   max_sets=max_sets)


def plan_footprint(
    footprint: Mapping[str, Any] | mm.Footprint,
    budget_bytes: int,
    candidates: Iterable[str] | None = None,
    *,
    device: DeviceSpec | None = None,
    min_flops_per_byte: float = DEFAULT_MIN_FLOPS_PER_BYTE,
    runner_ups: int = 3,
    objective: str | None = None,
    rates: EngineRates | str | None = None,
    per_layer: bool = False,
    layers: int | None = None,
    max_sets: int | None = 2,
) -> Plan:
    """Choose the tags a layer saves, given its footprint and a byte budget.

    `footprint` comes from `layer_footprint` or `traced_footprint`, or is any mapping of tag
    -> object with ``.bytes`` and ``.recompute_flops``. `budget_bytes` is what one layer may
    keep on one core, its always-kept input included. `device` only picks the default
    objective and its engine rates (``"time"`` on a Neuron device when the footprint has a
    graph). `per_layer=True` mixes save sets over `layers` layers (required then) sharing
    ``layers x budget_bytes``. The other arguments are `plan`'s.
    """
    _check_plan_numbers(budget_bytes, min_flops_per_byte, runner_ups, None)
    _check_counts(layers=layers, max_sets=max_sets)
    device = as_device(device, "plan_footprint(device=...)")
    if budget_bytes is None:
        raise ValueError("plan_footprint needs budget_bytes= (what one layer may keep on one "
                         "core, its input included)")
    fp = footprint if isinstance(footprint, mm.Footprint) else _as_footprint(footprint)
    _check_footprint(fp)
    if per_layer and layers is None:
        raise ValueError("plan_footprint(per_layer=True) needs layers= (how many layers share "
                         "layers x budget_bytes)")
    return _choose(fp, int(budget_bytes), candidates, notes=[], device=device, config=None,
                   shape=None, par=None, bud=None, budget_for=None, layers=layers or 1,
                   inflight=1, min_flops_per_byte=min_flops_per_byte, runner_ups=runner_ups,
                   objective=objective, rates=rates, per_layer_mix=bool(per_layer),
                   max_sets=max_sets)


def _check_counts(**counts: int | None) -> None:
    what = {"layers": "layers sharing the budget",
            "max_sets": "distinct save sets in a per-layer plan"}
    for name, value in counts.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name}={value!r}: give a positive int ({what[name]}) or None")


def _choose(fp: mm.Footprint, per_layer: int, candidates: Iterable[str] | None, *,
            notes: list[str], device: DeviceSpec | None,
            config: models.TransformerConfig | None, shape: models.StepShape | None,
            par: models.Parallelism | None, bud: mm.Budget | None,
            budget_for: Callable[[tuple[str, ...]], int] | None, layers: int, inflight: int,
            min_flops_per_byte: float, runner_ups: int, objective: str | None,
            rates: EngineRates | str | None, per_layer_mix: bool,
            max_sets: int | None) -> Plan:
    """The choice both entry points share: one layer's footprint against `per_layer` bytes
    (or `budget_for(tags)`, a budget that depends on the set's own workspace)."""
    obj, rts = _resolve_objective(objective, rates, device, fp)
    cost_fp = fp if obj == "flops" else _timed_footprint(fp, rts)

    names = list(fp)
    always = [t for t in names if getattr(fp[t], "always_kept", False)]
    pool = _candidates(fp, candidates)
    decisions: dict[str, str] = {}
    usable = []
    # Groups of tags that only pay off together are judged jointly: a member that saves
    # nothing alone is usable when its whole group is a candidate and pays.
    groups = [g for g in getattr(fp, "groups", ()) if set(g.tags) <= set(pool)]
    if obj == "flops":
        paying = [g for g in groups if g.recompute_flops > 0 and (
            not g.bytes or g.recompute_flops / g.bytes >= min_flops_per_byte)]
    else:
        paying = [g for g in groups if _time_pays(cost_fp, g.tags, g.bytes, rts)[0]]
    for t in pool:
        cost = fp[t]
        if t in always:
            continue
        if any(t in g.tags for g in paying):
            usable.append(t)
        elif cost.recompute_flops <= 0 and obj == "flops":
            decisions[t] = "saving it saves no recompute" + (
                ": the backward never reads it" if cost.bytes == 0 else "")
        elif obj == "time":
            pays, why = _time_pays(cost_fp, (t,), cost.bytes, rts)
            if pays:
                usable.append(t)
            else:
                decisions[t] = why
        elif cost.bytes and cost.recompute_flops / cost.bytes < min_flops_per_byte:
            decisions[t] = (f"cheap to recompute: {cost.recompute_flops / cost.bytes:.3g} "
                            f"FLOP/B < {min_flops_per_byte:g}")
        else:
            usable.append(t)
    for t in names:
        if t not in pool and t not in always:
            decisions[t] = "not a candidate"
    usable.sort()
    choices = _solve(cost_fp, usable, per_layer, keep=1 + runner_ups, budget_for=budget_for)
    if obj == "time":  # picoseconds back to FLOPs and seconds
        choices = [Choice(c.tags, c.kept_bytes, fp.evaluate(c.tags)[1],
                          c.recompute_flops / PICOSECONDS) for c in choices]
    if not choices:
        full_kept, _ = fp.evaluate(())
        raise NoFitError(_no_fit_message(full_kept, per_layer, bud, config, shape, par))
    best = choices[0]
    if budget_for is not None:
        per_layer = budget_for(best.tags)
    saved_groups = [g for g in paying if set(g.tags) <= set(best.tags)]
    for t in usable:
        cost = fp[t]
        mine = next((g for g in saved_groups if t in g.tags), None)
        if t in best.tags and mine is not None:
            others = ", ".join(o for o in mine.tags if o != t)
            decisions[t] = (f"saved with {others} ({mine.shared}): "
                            f"{mine.flops_per_byte:.3g} FLOP/B together")
        elif t in best.tags and not cost.bytes:
            decisions[t] = "saved: free to keep"
        elif t in best.tags and obj == "time":
            assert rts is not None
            decisions[t] = (f"saved: {fmt_seconds(_time_saved(cost_fp, (t,)))} of recompute "
                            f"for {fmt_seconds(2 * cost.bytes / rts.hbm_bytes_per_s)} to "
                            "write and read it")
        elif t in best.tags:
            decisions[t] = f"saved: {cost.recompute_flops / cost.bytes:.3g} FLOP/B"
        else:
            group = next((g for g in paying if t in g.tags), None)
            adding = best.tags + ((t,) if group is None else tuple(
                o for o in group.tags if o not in best.tags))
            alone, _ = fp.evaluate(adding)
            what = "adding it" if group is None else f"adding {group.label}"
            decisions[t] = ("does not fit: " if alone > per_layer else "") + (
                f"{what} keeps {fmt_bytes(alone)} > {fmt_bytes(per_layer)} budget"
                if alone > per_layer else "a better set fits without it")
    for t in always:
        decisions[t] = "always kept: the layer input (scan carry)"
    patterns = getattr(fp, "patterns", {t: re.escape(t) for t in fp})
    policy = RegexPolicy([patterns[t] for t in names if t in best.tags])
    if fp.no_remat_bytes and fp.no_remat_bytes <= per_layer:
        notes.append(f"no remat at all would fit too ({fmt_bytes(fp.no_remat_bytes)}/layer): "
                     "untagged values (norms, softmax) are then not recomputed either")
    if config is not None and shape is not None and par is not None:
        notes.extend(_untagged_notes(config, shape, par, fp, best))
    ordered = [t for t in names if t in decisions]
    mix: tuple[LayerMix, ...] = ()
    layer_policies = None
    if per_layer_mix:
        if budget_for is not None and bud is not None:
            free = bud.hbm_bytes - bud.state.total_bytes - bud.reserve_bytes
            roles = getattr(fp, "roles", {})

            def cap_for(tags: tuple[str, ...]) -> int:
                return (free - bud.workspace_for(roles.get(t, t) for t in tags)) // inflight
        else:
            fixed = per_layer * layers

            def cap_for(tags: tuple[str, ...]) -> int:
                return fixed
        mix, layer_policies, rounded = _layer_mix(fp, cost_fp, obj, usable, layers, cap_for,
                                                  best, names, patterns, max_sets)
        if rounded:
            notes.append("per-layer plan: bytes rounded up to coarser units to keep the "
                         "knapsack small; the mix fits but may be short of the optimum")
    fwd_seconds = None
    if obj == "time":
        assert cost_fp.graph is not None
        fwd_seconds = cost_fp.graph.forward_flops() / PICOSECONDS
    return Plan(
        policy=policy, saved_tags=tuple(t for t in names if t in best.tags),
        kept_bytes_per_layer=best.kept_bytes, budget_bytes_per_layer=per_layer,
        recompute_flops_per_layer=best.recompute_flops,
        decisions=tuple(TagDecision(t, t in best.tags or t in always, fp[t].bytes,
                                    fp[t].recompute_flops, decisions[t]) for t in ordered),
        runner_ups=tuple(choices[1:]), layers_per_core=layers, inflight=inflight,
        device=device, budget=bud, forward_flops_per_layer=fp.forward_flops,
        config=config, parallelism=par, no_remat_bytes_per_layer=fp.no_remat_bytes,
        notes=tuple(notes),
        groups=tuple(GroupDecision(g.tags, g.label, g.bytes, g.recompute_flops, g.alone_flops,
                                   g.shared, set(g.tags) <= set(best.tags)) for g in groups),
        objective=obj, rates=rts, recompute_seconds_per_layer=best.recompute_seconds,
        forward_seconds_per_layer=fwd_seconds, layer_mix=mix, layer_policies=layer_policies)


# What an untagged role is, for the note that names the tag that would help.
_UNTAGGED_WHAT = {
    "moe_linear1_0": "the routed experts' first (gate) projection",
    "moe_linear1_1": "the routed experts' up projection",
    "moe_linear2": "the routed experts' down projection",
    "gate_weights": "the router's top-k weights", "gate_assignment": "the router's top-k choice",
    "q_a": "the low-rank query projection", "q_a_norm": "the normalised low-rank query",
    "kv_a": "the key-value latent", "kv_a_norm": "the normalised key-value latent",
    "input": "the layer input", "q_proj": "the query projection", "k_proj": "the key projection",
    "v_proj": "the value projection", "o_proj": "the output projection",
    "linear1_0": "the FFN's first projection", "linear1_1": "the FFN's up projection",
    "linear2": "the FFN's down projection"}
_HOST_DETAIL = {"axlearn": " (axlearn's mixture_of_experts.py einsums wi_0, wi_1 and wo carry "
                           "no remat name)"}


def _untagged_notes(config: models.TransformerConfig, shape: models.StepShape,
                    par: models.Parallelism, fp: mm.Footprint, best: Choice) -> list[str]:
    """A note when most of the plan's recompute is work no tag of the host covers (saving
    every tag would still recompute it), naming the roles whose tags would let a plan save
    it and how much each would avoid. The attention kernel's own residuals are left out: a
    host cannot tag inside a kernel."""
    if best.recompute_flops <= 0:
        return []
    _, floor = fp.evaluate(tuple(fp))
    if floor < 0.5 * best.recompute_flops:
        return []
    tags = config.tags
    missing = [r for r in (*models.ROLES, *models.MOE_ROLES, *models.MLA_ROLES)
               if r != "context" and getattr(tags, r, None) is None]
    proposed = {r: models.MAXTEXT_TAGS.name(r) or models.AXLEARN_TAGS.name(r) or r
                for r in missing}
    hyp = dataclasses.replace(config, tags=dataclasses.replace(
        tags, vocabulary=f"{tags.vocabulary}+untagged", **proposed))
    new = [r for r in hyp.roles if r in proposed]
    if not new:
        return []
    hfp = mm.layer_footprint(hyp, shape, par)
    have = tuple(t for t in fp if t in hfp)
    gains = []
    for r in new:
        name = hyp.tag(r)
        if name in hfp and name not in have:
            gain = floor - hfp.evaluate(have + (name,))[1]
            if gain > 0.01 * floor:
                gains.append((gain, r, name))
    if not gains:
        return []
    gains.sort(reverse=True)
    host = models.host_of(tags)
    detail = _HOST_DETAIL.get(host, "") if any(r.startswith("moe_") for _, r, _ in gains) \
        else ""
    helps = "; ".join(f"{name!r} ({r}) up to {g / 1e9:.4g}" for g, r, name in gains)
    return [f"{floor / 1e9:.4g} of the {best.recompute_flops / 1e9:.4g} GFLOP/layer this plan "
            f"recomputes is work no {host} tag covers (saving every tag still recomputes it):"
            f" {host} tags nothing on {', '.join(_UNTAGGED_WHAT.get(r, r) for _, r, _ in gains)}"
            f"{detail}. A checkpoint_name there would let a plan save it; GFLOP/layer each "
            f"would avoid: {helps}"]


def dead_patterns(policy: RegexPolicy, names: Iterable[str]) -> list[str]:
    """The save and offload patterns of `policy` that fully match none of `names` (the tag
    names a host emits): a plan naming them would keep nothing for them."""
    return list(policy.dead_patterns(names))


def refuse_dead_patterns(policy: RegexPolicy, names: Iterable[str], *,
                         host: str = "the host") -> None:
    """Raise ValueError when a pattern of `policy` matches none of the names `host` emits."""
    emitted = sorted(set(names))
    dead = dead_patterns(policy, emitted)
    if dead:
        raise ValueError(f"patterns {dead} match none of the tags {host} emits ({emitted})")


def _own_workspace(bud: mm.Budget, roles: Mapping[str, str]
                   ) -> Callable[[tuple[str, ...]], int]:
    """Per-layer budget of a save set with its own policy's workspace."""
    return lambda subset: bud.per_layer_bytes_for(roles.get(t, t) for t in subset)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _whole(value: Any) -> bool:
    """An integer, or a float with no fractional part (not a bool)."""
    if isinstance(value, numbers.Integral):
        return not isinstance(value, (bool, np.bool_))
    return _is_real(value) and math.isfinite(value) and float(value).is_integer()


def _check_plan_numbers(budget_bytes: Any, min_flops_per_byte: Any, runner_ups: Any,
                        reserve: Any = None) -> None:
    """plan's own numbers: one line naming the argument and what is valid."""
    if reserve is not None and not (
            (isinstance(reserve, numbers.Integral) and not isinstance(reserve, (bool, np.bool_))
             and reserve >= 0)
            or (isinstance(reserve, float) and math.isfinite(reserve) and 0 <= reserve < 1)):
        raise ValueError(f"plan: reserve={reserve!r:.60} is not valid; valid: a fraction of "
                         "HBM in [0, 1) as a float, or whole bytes >= 0 as an int")
    if budget_bytes is not None and not (_whole(budget_bytes) and budget_bytes >= 0):
        raise ValueError(f"plan: budget_bytes={budget_bytes!r:.60} is not a budget; valid: a "
                         "whole number of bytes >= 0 (finite)")
    if not (_is_real(min_flops_per_byte) and math.isfinite(min_flops_per_byte)
            and min_flops_per_byte >= 0):
        raise ValueError(f"plan: min_flops_per_byte={min_flops_per_byte!r:.60} is not valid; "
                         "valid: a finite number >= 0")
    if not (isinstance(runner_ups, numbers.Integral) and not isinstance(runner_ups, bool)
            and 0 <= runner_ups <= 1000):
        raise ValueError(f"plan: runner_ups={runner_ups!r:.60} is not valid; valid: an "
                         "integer from 0 to 1000")


def _check_footprint(fp: Mapping[str, Any]) -> None:
    """Every tag's cost: whole bytes >= 0 and finite recompute FLOPs >= 0."""
    full = getattr(fp, "full_recompute_flops", None)
    if full is not None and not (_is_real(full) and math.isfinite(full) and full >= 0):
        raise ValueError(f"plan: footprint.full_recompute_flops={full!r:.60} is not valid; "
                         "valid: a finite number of FLOPs >= 0")
    for name in fp:
        cost = fp[name]
        if not isinstance(name, str):
            raise ValueError(f"plan: footprint key {name!r:.60} is not a tag name; valid: str")
        if not (_whole(cost.bytes) and cost.bytes >= 0):
            raise ValueError(f"plan: footprint[{name!r}].bytes={cost.bytes!r:.60} is not valid; "
                             "valid: a whole number of bytes >= 0")
        flops = cost.recompute_flops
        if not (_is_real(flops) and math.isfinite(flops) and flops >= 0):
            raise ValueError(f"plan: footprint[{name!r}].recompute_flops={flops!r:.60} is not "
                             "valid; valid: a finite number of FLOPs >= 0")


def _as_footprint(mapping: Mapping[str, Any]) -> mm.Footprint:
    if not isinstance(mapping, Mapping):
        raise TypeError(f"plan_footprint: footprint= must be a mapping of tag -> cost (from "
                        f"layer_footprint or traced_footprint); got {type(mapping).__name__}")
    tags = {}
    for name, cost in mapping.items():
        if not hasattr(cost, "bytes") or not hasattr(cost, "recompute_flops"):
            raise TypeError(f"footprint[{name!r}] = {cost!r:.80} lacks .bytes and "
                            ".recompute_flops")
        _check_footprint({name: cost})
        tags[name] = mm.TagCost(bytes=int(cost.bytes), recompute_flops=float(cost.recompute_flops),
                                always_kept=bool(getattr(cost, "always_kept", False)))
    always = sum(c.bytes for c in tags.values() if c.always_kept)
    return mm.Footprint(tags, always_kept_bytes=always,
                        full_recompute_flops=getattr(mapping, "full_recompute_flops", None))


def _candidates(fp: mm.Footprint, candidates: Iterable[str] | None) -> list[str]:
    if candidates is None:
        return list(fp)
    roles = getattr(fp, "roles", {})
    by_role = {r: t for t, r in roles.items()}
    out: list[str] = []
    for c in candidates:
        c = c.strip()
        tag = c if c in fp else by_role.get(c)
        if tag is None:
            raise ValueError(f"candidate {c!r} is not a tag of this layer; valid: "
                             f"{sorted(fp)}" + (f" or roles {sorted(by_role)}" if by_role else ""))
        if tag not in out:
            out.append(tag)
    return out


def _no_fit_message(full_kept: int, per_layer: int, bud: mm.Budget | None,
                    config: models.TransformerConfig | None, shape: models.StepShape | None,
                    par: models.Parallelism | None) -> str:
    if per_layer > 0:
        msg = (f"even full recompute keeps {fmt_bytes(full_kept)} per layer per core, over "
               f"the {fmt_bytes(per_layer)} budget")
    else:
        msg = (f"even full recompute keeps {fmt_bytes(full_kept)} per layer per core, and "
               "nothing is left for activations")
    if bud is not None:
        msg += (f" (HBM {fmt_bytes(bud.hbm_bytes)} - state {fmt_bytes(bud.state.total_bytes)}"
                f" - reserve {fmt_bytes(bud.reserve_bytes)} - workspace "
                f"{fmt_bytes(bud.workspace_bytes)} = {fmt_bytes(bud.available_bytes)} for "
                f"{bud.layers_per_core} layers x {bud.inflight} in flight)")
    hints = []
    usual = int(mm.DEFAULT_RESERVE_FRACTION * bud.hbm_bytes) if bud is not None else 0
    if bud is not None and bud.reserve_bytes - usual >= -bud.available_bytes > 0:
        # a reserve above the default's 10% that alone leaves nothing for activations
        hints.append(f"lower the reserve (now {fmt_bytes(bud.reserve_bytes)}, "
                     f"{bud.reserve_bytes / bud.hbm_bytes:.0%} of HBM)")
    if bud is not None and bud.state.total_bytes > bud.hbm_bytes // 2:
        hints.append("shard the model state further (more fsdp, tp or hosts, or zero1)")
    # doubling tp takes cores from fsdp x dp: only where those have two to give
    spare = par.fsdp * par.dp if par is not None and par.fsdp > 0 else 0
    if par is not None and config is not None and config.heads % (par.tp * 2) == 0 \
            and spare % 2 == 0 and spare >= 2:
        hints.append(f"raise tp (tp={par.tp * 2} divides heads={config.heads}, with "
                     f"fsdp x dp = {spare // 2})")
    if par is not None and not par.sequence_parallel and par.tp > 1:
        hints.append("turn on sequence parallelism")
    if shape is not None and shape.micro_batch > 1:
        hints.append(f"lower micro_batch (now {shape.micro_batch})")
    if shape is not None:
        hints.append(f"shorten seq_len (now {shape.seq_len})")
    if config is not None and not config.flash_attention:
        hints.append("use flash attention (no seq x seq probabilities)")
    return msg + ". To fit: " + "; ".join(hints or ["give the layer more memory"]) + "."


# --------------------------------------------------------------------------------------
# The time objective.
# --------------------------------------------------------------------------------------


def _resolve_objective(objective: str | None, rates: EngineRates | str | None,
                       device: DeviceSpec | None, fp: mm.Footprint
                       ) -> tuple[str, EngineRates | None]:
    """(objective, rates): ``"time"`` by default on a Neuron device with known rates and a
    footprint with a graph; an explicit ``"time"`` that cannot be priced is an error."""
    if objective is not None and objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is not an objective; valid: "
                         f"{', '.join(OBJECTIVES)}")
    rts = rates if isinstance(rates, EngineRates) else engine_rates(
        device, rates if isinstance(rates, str) else None)
    if rates is not None and not isinstance(rates, (str, EngineRates)):
        raise ValueError(f"rates={rates!r}: give an EngineRates or a name of "
                         "neuron_remat.device.ENGINE_RATES")
    if objective is None:
        neuron = device is not None and device.is_neuron
        return ("time", rts) if (neuron and rts is not None and fp.graph is not None) \
            else ("flops", rts if rates is not None else None)
    if objective == "time":
        if rts is None:
            raise ValueError("objective='time' needs engine rates: pass rates= (an "
                             "EngineRates or one of neuron_remat.device.ENGINE_RATES) or "
                             "plan for a device with known rates (trn2, H100, H200)")
        if fp.graph is None:
            raise ValueError("objective='time' needs a footprint with a layer graph "
                             "(layer_footprint or traced_footprint), not per-tag figures")
    return objective, rts


def _timed_footprint(fp: mm.Footprint, rates: EngineRates | None) -> mm.Footprint:
    """`fp` whose evaluation answers recompute picoseconds instead of FLOPs."""
    assert fp.graph is not None and rates is not None
    return mm.Footprint(dict(fp), always_kept_bytes=fp.always_kept_bytes,
                        patterns=fp.patterns, graph=timed_graph(fp.graph, rates),
                        roles=fp.roles, forward_flops=fp.forward_flops,
                        no_remat_bytes=fp.no_remat_bytes, groups=())


def _time_saved(cost_fp: mm.Footprint, tags: Sequence[str]) -> float:
    """Seconds of recompute saving `tags` saves, on a `_timed_footprint`."""
    return (cost_fp.evaluate(())[1] - cost_fp.evaluate(tags)[1]) / PICOSECONDS


def _time_pays(cost_fp: mm.Footprint, tags: Sequence[str], nbytes: int,
               rates: EngineRates | None) -> tuple[bool, str]:
    """Whether saving `tags` saves more recompute time than writing and reading their
    `nbytes` costs, and why not."""
    assert rates is not None
    saved = _time_saved(cost_fp, tags)
    moving = 2 * nbytes / rates.hbm_bytes_per_s
    if saved <= 0:
        return False, "saving it saves no recompute time" + (
            ": the backward never reads it" if nbytes == 0 else "")
    if saved <= moving:
        return False, (f"cheap to recompute: saves {1e6 * saved:.3g} us <= "
                       f"{1e6 * moving:.3g} us to write and read it")
    return True, ""


# --------------------------------------------------------------------------------------
# Per-layer plans: the optimal mix of save sets over identical layers.
# --------------------------------------------------------------------------------------


def _all_sets(cost_fp: mm.Footprint, fp: mm.Footprint, usable: Sequence[str]
              ) -> list[tuple[int, float, tuple[str, ...]]]:
    """(kept bytes, objective cost, tags) of every subset of `usable`."""
    n = len(usable)
    if n > MAX_JOINT_TAGS:
        raise ValueError(f"{n} candidate tags are too many for a per-layer plan (at most "
                         f"{MAX_JOINT_TAGS}); restrict candidates=")
    out = []
    graph = cost_fp.graph
    if graph is not None:
        closures = graph.closures
        bits = [closures.mask([cost_fp.roles[t]]) for t in usable]
        saved = [0] * (1 << n)
        for i in range(1 << n):
            if i:
                low = i & -i
                saved[i] = saved[i ^ low] | bits[low.bit_length() - 1]
            kept, cost, _ = closures.run(saved[i])
            out.append((kept, cost, tuple(usable[j] for j in range(n) if i >> j & 1)))
        return out
    for r in range(n + 1):
        for subset in itertools.combinations(usable, r):
            kept, cost = fp.evaluate(subset)
            out.append((kept, cost, tuple(subset)))
    return out


def _frontier(sets: Iterable[tuple[int, float, tuple[str, ...]]]
              ) -> list[tuple[int, float, tuple[str, ...]]]:
    """The sets no other set beats on both kept bytes and cost (fewest tags on ties)."""
    out: list[tuple[int, float, tuple[str, ...]]] = []
    for kept, cost, tags in sorted(sets, key=lambda e: (e[0], e[1], len(e[2]), e[2])):
        if not out or cost < out[-1][1]:
            out.append((kept, cost, tags))
    return out


MAX_KNAPSACK_CELLS = 1 << 23
"""Layers x byte units the per-layer knapsack may tabulate; beyond it bytes are rounded up
to coarser units (the mix still fits, but may be slightly short of the optimum)."""


def _knapsack(points: Sequence[tuple[int, float]], layers: int, cap: int,
              max_sets: int | None = None
              ) -> tuple[float, int, tuple[int, ...], bool] | None:
    """Counts of each point for `layers` layers with total kept bytes <= `cap` and the
    least total cost (then the fewest bytes): a dynamic programme over layers x bytes in
    units of the points' greatest common divisor, which is exact (tensor sizes share large
    power-of-two factors, so the table is small). The last item is False when the table
    would exceed `MAX_KNAPSACK_CELLS` and bytes were rounded up to coarser units."""
    import numpy as np  # noqa: PLC0415

    n = len(points)
    if not n or cap < 0:
        return None
    if max_sets is not None and max_sets <= 2:
        return _knapsack_pairs(points, layers, cap, max_sets)
    if max_sets is not None and max_sets < n:  # every choice of max_sets points, exactly
        found = None
        for chosen in itertools.combinations(range(n), max_sets):
            got = _knapsack([points[i] for i in chosen], layers, cap)
            if got is not None and (found is None or got[:2] < found[0][:2]):
                found = (got, chosen)
        if found is None:
            return None
        (total, nbytes, sub, exact), chosen = found
        counts = [0] * n
        for i, k in zip(chosen, sub):
            counts[i] = k
        return total, nbytes, tuple(counts), exact
    unit = 0
    for b, _ in points:
        unit = math.gcd(unit, int(b))
    unit = max(unit, 1)
    exact = True
    if layers * (cap // unit + 1) > MAX_KNAPSACK_CELLS:
        unit = -(-cap * layers // MAX_KNAPSACK_CELLS)
        exact = False
    sizes = [-(-int(b) // unit) for b, _ in points]
    room = cap // unit
    inf = math.inf
    prev = np.full(room + 1, inf)
    prev[0] = 0.0
    choice = np.zeros((layers + 1, room + 1), dtype=np.int32)
    for c in range(1, layers + 1):
        new = np.full(room + 1, inf)
        for j, (size, (_, cost)) in enumerate(zip(sizes, points)):
            if size > room:
                continue
            cand = prev[:room + 1 - size] + float(cost)
            tail = new[size:]
            better = cand < tail
            tail[better] = cand[better]
            choice[c, size:][better] = j
        prev = new
    if not np.isfinite(prev).any():
        return None
    u = int(np.argmin(prev))  # the least cost, then the fewest bytes
    total = float(prev[u])
    counts = [0] * n
    for c in range(layers, 0, -1):
        j = int(choice[c, u])
        counts[j] += 1
        u -= sizes[j]
    nbytes = sum(k * int(b) for k, (b, _) in zip(counts, points))
    return total, nbytes, tuple(counts), exact


def _knapsack_pairs(points: Sequence[tuple[int, float]], layers: int, cap: int,
                    max_sets: int) -> tuple[float, int, tuple[int, ...], bool] | None:
    """`_knapsack` with at most `max_sets` (1 or 2) distinct points: every pair and count,
    exactly."""
    n = len(points)
    best: tuple[float, int, tuple[int, ...]] | None = None
    pairs = [(i, i) for i in range(n)] if max_sets == 1 else \
        [(i, j) for i in range(n) for j in range(i, n)]
    for i, j in pairs:
        (bi, ci), (bj, cj) = points[i], points[j]
        for k in range(layers + 1) if i != j else (layers,):
            nbytes = k * bi + (layers - k) * bj
            if nbytes > cap:
                continue
            cost = k * ci + (layers - k) * cj
            if best is None or (cost, nbytes) < best[:2]:
                counts = [0] * n
                counts[i] += k
                counts[j] += layers - k
                best = (cost, nbytes, tuple(counts))
    return None if best is None else (best[0], best[1], best[2], True)


MIX_WORKSPACE_TAGS = 10
"""Candidate tags up to which a per-layer plan prices every tag set's own workspace."""


def _layer_mix(fp: mm.Footprint, cost_fp: mm.Footprint, objective: str,
               usable: Sequence[str], layers: int, cap_for: Callable[[tuple[str, ...]], int],
               best: Choice, names: Sequence[str], patterns: Mapping[str, str],
               max_sets: int | None = None
               ) -> tuple[tuple[LayerMix, ...], tuple[RegexPolicy, ...] | None, bool]:
    """The optimal mix of frontier sets over `layers` layers (`plan(per_layer=True)`).

    `cap_for(tags)` is what all layers together may keep when `tags` is one of the sets
    used (the largest workspace of the sets used decides, so each distinct capacity is
    solved with the sets that allow it). The best uniform set is always a candidate, so the
    mix never does worse than it."""
    every = _all_sets(cost_fp, fp, usable)
    # Each set's own capacity (its workspace) matters: a set the frontier drops for a tie
    # can allow more bytes. Up to 2**MIX_WORKSPACE_TAGS sets are each priced; beyond, the
    # frontier's only.
    points = every if len(usable) <= MIX_WORKSPACE_TAGS else _frontier(every)
    best_cost = best.recompute_flops if objective == "flops" else round(
        (best.recompute_seconds or 0.0) * PICOSECONDS)
    mine = tuple(sorted(best.tags))
    if not any(tuple(sorted(p[2])) == mine for p in points):
        points.append((best.kept_bytes, best_cost, best.tags))
    caps = {p[2]: cap_for(p[2]) for p in points}
    found: tuple[float, int, list[tuple[tuple[str, ...], int]]] | None = None
    rounded = False
    for cap in sorted(set(caps.values()), reverse=True):
        allowed = _frontier(p for p in points if caps[p[2]] >= cap)
        answer = _knapsack([(p[0], p[1]) for p in allowed], layers, cap, max_sets)
        if answer is None:
            continue
        cost, nbytes, counts, exact = answer
        if not exact:
            rounded = True
        if found is None or (cost, nbytes) < (found[0], found[1]):
            found = (cost, nbytes, [(p[2], k) for p, k in zip(allowed, counts) if k])
    if found is None:  # cannot happen when the uniform best fits; keep it then
        found = (best_cost, best.kept_bytes * layers, [(best.tags, layers)])
    used = found[2]
    if len(used) == 1:
        used = [(best.tags, layers)]
    mix = []
    for tags, k in used:
        kept, flops = fp.evaluate(tags)
        secs = None
        if objective == "time":
            secs = cost_fp.evaluate(tags)[1] / PICOSECONDS
        ordered = tuple(t for t in names if t in tags)
        policy = RegexPolicy([patterns[t] for t in ordered])
        mix.append(LayerMix(ordered, k, kept, flops, secs, policy))
    mix.sort(key=lambda m: (m.recompute_seconds if m.recompute_seconds is not None
                            else m.recompute_flops, m.tags))
    if len(mix) == 1:
        return tuple(mix), None, rounded
    per = tuple(m.policy for m in mix for _ in range(m.layers))
    return tuple(mix), per, rounded  # type: ignore[return-value]
