"""The planner: the save set that fits a memory budget with the least recomputation,
chosen exactly over the footprint it is given (analytic or traced)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import memory_model as mm
from . import models
from ._format import fmt_bytes, grid
from .device import DeviceSpec
from .policies import RegexPolicy

__all__ = ["Choice", "CompiledFit", "GroupDecision", "NoFitError", "Plan", "Probe",
           "TagDecision", "dead_patterns", "plan", "refuse_dead_patterns"]

logger = logging.getLogger(__name__)

DEFAULT_MIN_FLOPS_PER_BYTE = 8.0
"""A tag that saves fewer FLOPs of recompute per byte it keeps is elementwise work (a norm
or activation output: a few FLOPs per element), cheaper to redo than to hold. A matmul
output saves ``2 x contraction`` FLOPs per element, at least 32 per byte for any real
layer."""


class NoFitError(ValueError):
    """Even full recompute does not fit the budget."""


@dataclass(frozen=True)
class Probe:
    """One compile of the training step (`fit`): what XLA allocated and computed.

    `bytes` is ``argument + output + temp - alias`` from ``memory_analysis()`` (-1 when the
    backend reports none: then the compile is the oracle, `out_of_memory` its answer);
    `saved` is None for no remat. `predicted_bytes` is what the fitted model said before this compile
    (None for the probes it was fitted on)."""

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
    the backend had no ``memory_analysis()`` and `bytes` is the uncalibrated model's."""

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

    @property
    def overhead(self) -> float:
        """Recompute as a fraction of the step without remat (every layer counted)."""
        return self.recompute_flops / self.step_flops if self.step_flops else float("nan")


@dataclass(frozen=True)
class TagDecision:
    tag: str
    saved: bool
    bytes: int
    recompute_flops: float
    reason: str

    @property
    def flops_per_byte(self) -> float:
        return self.recompute_flops / self.bytes if self.bytes else 0.0


@dataclass(frozen=True)
class GroupDecision:
    """Tags that only pay off together (a `TagGroup` of the footprint) and whether the plan
    saves all of them."""

    tags: tuple[str, ...]
    label: str
    bytes: int
    recompute_flops: float
    alone_flops: float
    shared: str
    saved: bool

    @property
    def flops_per_byte(self) -> float:
        return self.recompute_flops / self.bytes if self.bytes else 0.0


@dataclass(frozen=True)
class Choice:
    """One save set with its cost per layer per core."""

    tags: tuple[str, ...]
    kept_bytes: int
    recompute_flops: float


@dataclass(frozen=True)
class Plan:
    """The save set that fits, and why.

    Bytes are per core; `kept_bytes_per_layer` includes what the layer keeps whatever
    the policy says (its input).
    """

    policy: RegexPolicy | Callable[..., Any]  # fit's no remat: everything_saveable
    saved_tags: tuple[str, ...]
    kept_bytes_per_layer: int
    budget_bytes_per_layer: int
    recompute_flops_per_layer: float
    decisions: tuple[TagDecision, ...]
    runner_ups: tuple[Choice, ...]
    layers_per_core: int = 1
    inflight: int = 1
    device: DeviceSpec | None = None
    budget: mm.Budget | None = None
    forward_flops_per_layer: float = 0.0
    config: models.TransformerConfig | None = None
    parallelism: models.Parallelism | None = None
    no_remat_bytes_per_layer: int = 0
    notes: tuple[str, ...] = ()
    groups: tuple[GroupDecision, ...] = ()
    compiled: CompiledFit | None = None  # set by `fit`: the compiled step's figures

    @property
    def headroom_bytes(self) -> int:
        """Budget left unused (per core)."""
        return (self.budget_bytes_per_layer - self.kept_bytes_per_layer) * \
            self.layers_per_core * self.inflight

    @property
    def activation_bytes(self) -> int:
        """Kept activations per core: every layer held, every micro-batch in flight."""
        return self.kept_bytes_per_layer * self.layers_per_core * self.inflight

    @property
    def predicted_bytes_per_core(self) -> int:
        """State + kept activations + workspace: the predicted peak per core (reserve not
        included)."""
        if self.budget is None:
            return self.activation_bytes
        return self.budget.state.total_bytes + self.activation_bytes + self.workspace_bytes

    @property
    def workspace_bytes(self) -> int:
        """The workspace of this plan's policy (`Budget.workspace_for`); 0 without a
        budget."""
        if self.budget is None:
            return 0
        if self.config is None:
            return self.budget.workspace_bytes
        roles = [r for r in self.config.roles if self.config.tag(r) in self.saved_tags]
        return self.budget.workspace_for(roles)

    @property
    def recompute_flops(self) -> float:
        """Recompute FLOPs per core per step (every layer held, every micro-batch)."""
        return self.recompute_flops_per_layer * self.layers_per_core * self.inflight

    @property
    def overhead(self) -> float:
        """Recompute as a fraction of a no-remat step (forward + backward = 3 x forward)."""
        step = 3 * self.forward_flops_per_layer
        return self.recompute_flops_per_layer / step if step else float("nan")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": (self.policy.to_dict() if hasattr(self.policy, "to_dict")
                       else {"jax": getattr(self.policy, "__name__", repr(self.policy))}),
            "saved_tags": list(self.saved_tags),
            "kept_bytes_per_layer": self.kept_bytes_per_layer,
            "budget_bytes_per_layer": self.budget_bytes_per_layer,
            "recompute_flops_per_layer": self.recompute_flops_per_layer,
            "recompute_flops_per_step": self.recompute_flops,
            "overhead": self.overhead,
            "layers_per_core": self.layers_per_core,
            "inflight": self.inflight,
            "activation_bytes": self.activation_bytes,
            "predicted_bytes_per_core": self.predicted_bytes_per_core,
            "headroom_bytes": self.headroom_bytes,
            "no_remat_bytes_per_layer": self.no_remat_bytes_per_layer,
            "decisions": [dataclasses.asdict(d) for d in self.decisions],
            "groups": [{**dataclasses.asdict(g), "flops_per_byte": g.flops_per_byte}
                       for g in self.groups],
            "runner_ups": [dataclasses.asdict(c) for c in self.runner_ups],
            "notes": list(self.notes),
        }
        if self.compiled is not None:
            out["compiled"] = dataclasses.asdict(self.compiled)
            out["compiled"]["overhead"] = self.compiled.overhead
        if self.device is not None:
            out["device"] = self.device.to_dict()
        if self.budget is not None:
            b = self.budget
            out["budget"] = {"hbm_bytes": b.hbm_bytes, "state_bytes": b.state.total_bytes,
                             "params_bytes": b.state.params_bytes,
                             "grads_bytes": b.state.grads_bytes,
                             "optimizer_bytes": b.state.optimizer_bytes,
                             "reserve_bytes": b.reserve_bytes,
                             "workspace_bytes": self.workspace_bytes,
                             "available_bytes": b.available_bytes}
        if self.config is not None:
            out["model"] = self.config.name
        if self.parallelism is not None:
            out["parallelism"] = dataclasses.asdict(self.parallelism)
        return out

    def table(self) -> str:
        rows = [("tag", "bytes/layer", "recompute saved", "FLOP/B", "saved", "why")]
        for d in self.decisions:
            rows.append((d.tag, fmt_bytes(d.bytes), f"{d.recompute_flops / 1e9:.4g} GFLOP",
                         f"{d.flops_per_byte:.4g}", "yes" if d.saved else "no", d.reason))
        lines = grid(rows)
        for g in self.groups:
            lines.append(
                f"together: {g.label}: keeps {fmt_bytes(g.bytes)}, saves "
                f"{g.recompute_flops / 1e9:.4g} GFLOP ({g.flops_per_byte:.4g} FLOP/B; alone "
                f"{g.alone_flops / 1e9:.4g} GFLOP): " + ("saved" if g.saved else "not saved"))
        lines.append("")
        if self.budget is not None:
            b = self.budget
            lines.append(
                f"per core: HBM {fmt_bytes(b.hbm_bytes)} = state {fmt_bytes(b.state.total_bytes)}"
                f" + reserve {fmt_bytes(b.reserve_bytes)} + workspace "
                f"{fmt_bytes(self.workspace_bytes)} + activations "
                f"{fmt_bytes(self.activation_bytes)} + free {fmt_bytes(self.headroom_bytes)}")
        lines.append(
            f"per layer: keeps {fmt_bytes(self.kept_bytes_per_layer)} of "
            f"{fmt_bytes(self.budget_bytes_per_layer)} budget x {self.layers_per_core} layers"
            f" x {self.inflight} in flight; recompute "
            f"{self.recompute_flops_per_layer / 1e9:.4g} GFLOP/layer"
            + (f" ({100 * self.overhead:.2f}% of a step)" if self.forward_flops_per_layer else ""))
        for c in self.runner_ups:
            lines.append(f"runner-up: {list(c.tags)}: {fmt_bytes(c.kept_bytes)}/layer, "
                         f"{c.recompute_flops / 1e9:.4g} GFLOP/layer")
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append(f"policy: {self.policy!r}")
        if hasattr(self.policy, "save_regex"):
            lines.append(f"regex:  {self.policy.save_regex or '(save nothing)'}")
        return "\n".join(lines)


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
    footprint: Mapping[str, Any] | None = None,
    budget_bytes: int | None = None,
    reserve: float | int | None = None,
    min_flops_per_byte: float = DEFAULT_MIN_FLOPS_PER_BYTE,
    runner_ups: int = 3,
) -> Plan:
    """Choose the tags to save: the set that fits the budget with the least recompute.

    Either describe the model (`config`, `shape`, `parallelism`, and `device`, detected
    when None), or pass a `footprint` (from `layer_footprint` or `traced_footprint`, or any
    mapping of tag -> object with ``.bytes`` and ``.recompute_flops``) with `budget_bytes`:
    what one layer may keep on one core, its always-kept input included.

    `candidates` restricts the tags considered (tag names, or roles such as ``q_proj``).
    Tags saving fewer than `min_flops_per_byte` FLOPs per byte kept are never saved.
    Raises `NoFitError` when even full recompute does not fit.
    """
    notes: list[str] = []
    bud: mm.Budget | None = None
    par: models.Parallelism | None = None
    if footprint is None:
        if config is None or shape is None:
            raise ValueError("plan needs config= and shape= (a model), or footprint= with "
                             "budget_bytes=")
        if device is None:
            from .device import detect  # noqa: PLC0415

            device = detect()
        # Plan in the names the host emits on this device (axlearn on Neuron: no
        # flash-attention tag, so attention is recomputed under any names policy).
        config = dataclasses.replace(config, tags=models.host_tags(config.tags, device))
        par = (parallelism or models.Parallelism()).resolve(device)
        bud = mm.budget(device, config, shape, par, reserve=reserve)
        fp = mm.layer_footprint(config, shape, par)
        per_layer = bud.per_layer_bytes if budget_bytes is None else int(budget_bytes)
        layers, inflight = bud.layers_per_core, bud.inflight
    else:
        if budget_bytes is None:
            raise ValueError("plan(footprint=...) needs budget_bytes= (what one layer may "
                             "keep on one core, its input included)")
        fp = footprint if isinstance(footprint, mm.Footprint) else _as_footprint(footprint)
        per_layer = int(budget_bytes)
        layers, inflight = 1, 1

    names = list(fp)
    always = [t for t in names if getattr(fp[t], "always_kept", False)]
    pool = _candidates(fp, candidates)
    decisions: dict[str, str] = {}
    usable = []
    # Groups of tags that only pay off together are judged jointly: a member that saves
    # nothing alone is usable when its whole group is a candidate and pays.
    groups = [g for g in getattr(fp, "groups", ()) if set(g.tags) <= set(pool)]
    paying = [g for g in groups if g.recompute_flops > 0 and (
        not g.bytes or g.recompute_flops / g.bytes >= min_flops_per_byte)]
    for t in pool:
        cost = fp[t]
        if t in always:
            continue
        if any(t in g.tags for g in paying):
            usable.append(t)
        elif cost.recompute_flops <= 0:
            decisions[t] = "saving it saves no recompute" + (
                ": the backward never reads it" if cost.bytes == 0 else "")
        elif cost.bytes and cost.recompute_flops / cost.bytes < min_flops_per_byte:
            decisions[t] = (f"cheap to recompute: {cost.recompute_flops / cost.bytes:.3g} "
                            f"FLOP/B < {min_flops_per_byte:g}")
        else:
            usable.append(t)
    for t in names:
        if t not in pool and t not in always:
            decisions[t] = "not a candidate"
    usable.sort()
    budget_for: Callable[[tuple[str, ...]], int] | None = None
    if bud is not None and bud.graph is not None and budget_bytes is None:
        budget_for = _own_workspace(bud, getattr(fp, "roles", {}))

    choices = _solve(fp, usable, per_layer, keep=1 + runner_ups, budget_for=budget_for)
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
        elif t in best.tags:
            decisions[t] = (f"saved: {cost.recompute_flops / cost.bytes:.3g} FLOP/B"
                            if cost.bytes else "saved: free to keep")
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
    ordered = [t for t in names if t in decisions]
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
                                   g.shared, set(g.tags) <= set(best.tags)) for g in groups))


def dead_patterns(policy: RegexPolicy, names: Iterable[str]) -> list[str]:
    """The save and offload patterns of `policy` that fully match none of `names` (the tag
    names a host emits): a plan naming them would keep nothing for them."""
    emitted = list(names)
    return [p for p in (*policy.save, *policy.offload)
            if not any(re.fullmatch(p, n) for n in emitted)]


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


def _as_footprint(mapping: Mapping[str, Any]) -> mm.Footprint:
    tags = {}
    for name, cost in mapping.items():
        if not hasattr(cost, "bytes") or not hasattr(cost, "recompute_flops"):
            raise TypeError(f"footprint[{name!r}] = {cost!r} lacks .bytes and .recompute_flops")
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
    if bud is not None and bud.state.total_bytes > bud.hbm_bytes // 2:
        hints.append("shard the model state further (more fsdp, tp or hosts, or zero1)")
    if par is not None and config is not None and config.heads % (par.tp * 2) == 0:
        hints.append(f"raise tp (tp={par.tp * 2} divides heads={config.heads})")
    if par is not None and not par.sequence_parallel and par.tp > 1:
        hints.append("turn on sequence parallelism")
    if shape is not None and shape.micro_batch > 1:
        hints.append(f"lower micro_batch (now {shape.micro_batch})")
    if shape is not None:
        hints.append(f"shorten seq_len (now {shape.seq_len})")
    if config is not None and not config.flash_attention:
        hints.append("use flash attention (no seq x seq probabilities)")
    return msg + ". To fit: " + "; ".join(hints or ["give the layer more memory"]) + "."
