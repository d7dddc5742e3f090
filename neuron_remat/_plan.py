"""What the planner and `fit` return: the `Plan` (the save set that fits, and why), the
per-tag and per-group decisions behind it, its runner-ups and per-layer mixes, and
`NoFitError` when even full recompute does not fit. `planner` makes plans from footprints;
`fit` from compiles of the step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import memory_model as mm
from . import models
from ._format import fmt_bytes, grid
from .device import DeviceSpec, EngineRates
from .policies import RegexPolicy

__all__ = ["OBJECTIVES", "Choice", "GroupDecision", "LayerMix", "NoFitError", "Plan",
           "TagDecision"]


class NoFitError(ValueError):
    """Even full recompute does not fit the budget."""


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
    recompute_seconds: float | None = None  # under ``objective="time"``


@dataclass(frozen=True)
class LayerMix:
    """One save set of a per-layer plan and how many layers (per core) use it; figures per
    layer per core. `no_remat` marks `fit`'s layers without remat (`policy`
    ``everything_saveable``; `tags` then lists every tag, all of them kept, as
    `Plan.saved_tags` does for a plan without remat)."""

    tags: tuple[str, ...]
    layers: int
    kept_bytes: int
    recompute_flops: float
    recompute_seconds: float | None = None
    policy: RegexPolicy | Callable[..., Any] | None = None  # fit's no remat: everything_saveable
    no_remat: bool = False


OBJECTIVES = ("flops", "time")
"""What the planner minimises: recompute FLOPs, or recompute time priced per op by a
roofline over the device's engine rates (`graph.op_seconds`)."""


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
    # set by `fit`: its `CompiledFit` (the compiled step's figures; the planner never reads
    # it, so the type lives with `fit`)
    compiled: Any = None
    # objective="time": what the plan minimised and its figures (`OBJECTIVES`)
    objective: str = "flops"
    rates: EngineRates | None = None
    recompute_seconds_per_layer: float | None = None
    forward_seconds_per_layer: float | None = None
    # per_layer=True: the optimal mix of save sets over the layers. The fields above stay
    # those of the best uniform set (for hosts that take one policy; `fit`'s `compiled`
    # bytes and FLOPs too, the mixed step's in its `mix_*` fields); `layer_policies` has
    # one policy per layer (layer order), None when the best mix is uniform. Where `fit`
    # returns a mix, the uniform set's `recompute_flops_per_layer` and the mix's are both
    # as XLA counts them (a compiled set's FLOPs less no remat's), so that they compare.
    layer_mix: tuple[LayerMix, ...] = ()
    layer_policies: tuple[RegexPolicy, ...] | None = None

    def counts_tag(self, name: str) -> bool:
        """Whether the plan knows the tag `name`: one it decided on (saved or recomputed),
        or, for a plan made for a model, one its host's vocabulary names
        (`models.TagNames.knows`). A layer tag it does not know was never costed: the
        plan's policy recomputes it."""
        if any(d.tag == name for d in self.decisions):
            return True
        return self.config is not None and self.config.tags.knows(name)

    @property
    def time_overhead(self) -> float:
        """Recompute time as a fraction of a no-remat step's (forward + backward taken as 3
        x the forward's roofline time); nan without ``objective="time"`` figures."""
        if not self.forward_seconds_per_layer or self.recompute_seconds_per_layer is None:
            return float("nan")
        return self.recompute_seconds_per_layer / (3 * self.forward_seconds_per_layer)

    @property
    def mixed_kept_bytes(self) -> int:
        """Kept bytes of all layers of one micro-batch under the per-layer plan (the uniform
        plan's when there is no mix)."""
        if not self.layer_mix:
            return self.kept_bytes_per_layer * self.layers_per_core
        return sum(m.kept_bytes * m.layers for m in self.layer_mix)

    @property
    def mixed_recompute_flops(self) -> float:
        """Recompute FLOPs of all layers of one micro-batch under the per-layer plan."""
        if not self.layer_mix:
            return self.recompute_flops_per_layer * self.layers_per_core
        return sum(m.recompute_flops * m.layers for m in self.layer_mix)

    @property
    def mixed_overhead(self) -> float:
        """`overhead` of the per-layer plan (recompute over a no-remat step's FLOPs)."""
        step = 3 * self.forward_flops_per_layer * self.layers_per_core
        return self.mixed_recompute_flops / step if step else float("nan")

    @property
    def mixed_time_overhead(self) -> float:
        """`time_overhead` of the per-layer plan."""
        if not self.layer_mix:
            return self.time_overhead
        if not self.forward_seconds_per_layer or any(
                m.recompute_seconds is None for m in self.layer_mix):
            return float("nan")
        total = sum(m.recompute_seconds * m.layers for m in self.layer_mix)  # type: ignore
        return total / (3 * self.forward_seconds_per_layer * self.layers_per_core)

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
        included). For `fit`'s plans, the compiled step's bytes (`CompiledFit.bytes`:
        measured, or the model's where the backend reports none)."""
        if self.compiled is not None and getattr(self.compiled, "bytes", None) is not None:
            return int(self.compiled.bytes)
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
        out["objective"] = self.objective
        if self.rates is not None:
            out["rates"] = self.rates.to_dict()
        if self.recompute_seconds_per_layer is not None:
            out["recompute_seconds_per_layer"] = self.recompute_seconds_per_layer
            out["forward_seconds_per_layer"] = self.forward_seconds_per_layer
            out["time_overhead"] = self.time_overhead
        if self.layer_mix:
            out["layer_mix"] = [{"tags": list(m.tags), "layers": m.layers,
                                 "no_remat": m.no_remat,
                                 "kept_bytes_per_layer": m.kept_bytes,
                                 "recompute_flops_per_layer": m.recompute_flops,
                                 "recompute_seconds_per_layer": m.recompute_seconds,
                                 "policy": (m.policy.to_dict() if hasattr(m.policy, "to_dict")
                                            else {"jax": getattr(m.policy, "__name__",
                                                                 repr(m.policy))}
                                            if m.policy is not None else None)}
                                for m in self.layer_mix]
            out["mixed"] = {"kept_bytes": self.mixed_kept_bytes,
                            "recompute_flops": self.mixed_recompute_flops,
                            "overhead": self.mixed_overhead,
                            "time_overhead": self.mixed_time_overhead,
                            "uniform": self.layer_policies is None}
        if self.compiled is not None:
            out["compiled"] = dataclasses.asdict(self.compiled)
            out["compiled"]["overhead"] = self.compiled.overhead
            out["compiled"]["advised_max_compiles"] = getattr(
                self.compiled, "advised_max_compiles", None)
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
        if self.recompute_seconds_per_layer is not None:
            lines.append(
                f"time ({self.rates.name if self.rates else 'roofline'}): recompute "
                f"{1e3 * self.recompute_seconds_per_layer:.4g} ms/layer of a "
                f"{3e3 * (self.forward_seconds_per_layer or 0):.4g} ms/layer step "
                f"({100 * self.time_overhead:.2f}% of step time); objective: {self.objective}")
        lines.extend(self._runner_up_lines())
        lines.extend(_mix_lines(self))
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append(f"policy: {self.policy!r}")
        if hasattr(self.policy, "save_regex"):
            lines.append(f"regex:  {self.policy.save_regex or '(save nothing)'}")
        how, line = self.paste()
        lines.append(f"# {how}:")
        lines.append(line)
        return "\n".join(lines)

    def _runner_up_lines(self) -> list[str]:
        """Runner-ups, with exact ties (same bytes and recompute) on one line; a set that
        ties the plan itself is shown as a tie, not as worse."""
        best = (self.kept_bytes_per_layer, self.recompute_flops_per_layer,
                self.recompute_seconds_per_layer)
        tied: list[tuple[tuple[int, float, float | None], list[tuple[str, ...]]]] = []
        for c in self.runner_ups:
            key = (c.kept_bytes, c.recompute_flops, c.recompute_seconds)
            same = next((g for g in tied if g[0] == key), None)
            if same is None:
                tied.append((key, [c.tags]))
            else:
                same[1].append(c.tags)
        lines = []
        for (kept, flops, seconds), sets in tied:
            alts = " or ".join(str(list(t)) for t in sets)
            cost = f"{fmt_bytes(kept)}/layer, {flops / 1e9:.4g} GFLOP/layer" + (
                f", {1e3 * seconds:.4g} ms/layer" if seconds is not None else "")
            if (kept, flops, seconds) == best:
                lines.append(f"tie: {alts}: {cost}, exactly as good as the plan")
            else:
                lines.append(f"runner-up{' (tied)' if len(sets) > 1 else ''}: {alts}: {cost}")
        return lines

    @property
    def host(self) -> str:
        """Whose tag names were planned: ``axlearn``, ``maxtext``, or ``jax`` (a user's own
        names or a traced footprint)."""
        host = models.host_of(self.config.tags) if self.config is not None else "jax"
        return host if host in ("axlearn", "maxtext") else "jax"

    def paste(self) -> tuple[str, str]:
        """(where it goes, the line to paste) for the host whose tags were planned:
        axlearn's ``remat_spec`` assignment, MaxText's ``remat_policy=custom`` keys, or a
        ``jax.checkpoint`` call (also what Flax's ``nn.remat`` and Equinox's
        ``filter_checkpoint`` take as ``policy=``). A plan whose policy is no remat (fit's,
        when the whole step fits without it) says so."""
        if not hasattr(self.policy, "save_regex"):
            return ("no remat: the step fits without recomputing anything",
                    "layer = jax.checkpoint(layer, "
                    "policy=jax.checkpoint_policies.everything_saveable)  # or no checkpoint")
        regex = self.policy.save_regex
        if self.host == "axlearn":
            from .policies import remat3_ignores_closures  # noqa: PLC0415

            fn = ("neuron_remat.policies.save_and_offload_only_these_names_regex"
                  if remat3_ignores_closures() else "save_and_offload_only_these_names_regex")
            return ("axlearn: in the trainer config after the mesh rules, prevent_cse=False for "
                    "RepeatedTransformerLayer (or put remat_plan_modifier() last in the TRN2 "
                    "mesh rule to plan at launch)",
                    "cfg.model.decoder.transformer.layer.remat_spec = RematSpec(prevent_cse=True,"
                    f" policy=config_for_function({fn}).set(names_which_can_be_saved="
                    f"{regex!r}, names_which_can_be_offloaded=None, offload_src=None, "
                    "offload_dst=None))")
        if self.host == "maxtext":  # every key, as the adapter's overrides set them
            from ._maxtext_keys import overrides_of  # noqa: PLC0415

            keys = overrides_of(self.policy, fused_qkv=False)
            return ("MaxText: on the command line (or the same keys in the config YAML)",
                    " ".join(f"{k}={v}" for k, v in keys.items()))
        prefixed = self.config is not None and self.config.tags.prefixed
        names = ", ".join(repr(t) for t in self.saved_tags)
        policy = (f"neuron_remat.RegexPolicy({list(self.policy.save)!r})" if prefixed else
                  f"jax.checkpoint_policies.save_only_these_names({names})")
        return ("JAX: prevent_cse=True as here is safe anywhere (inside lax.scan False is "
                "enough); Flax nn.remat and Equinox filter_checkpoint take the same policy=",
                f"layer = jax.checkpoint(layer, policy={policy}, prevent_cse=True)")


def _mix_lines(p: Plan) -> list[str]:
    """The table's lines for a per-layer plan."""
    if not p.layer_mix:
        return []
    if p.layer_policies is None:
        return [f"per-layer plan: the uniform set is the best mix ({p.layers_per_core} layers)"]
    lines = []
    for m in p.layer_mix:
        secs = (f", {1e3 * m.recompute_seconds:.4g} ms" if m.recompute_seconds is not None
                else "")
        what = "no remat" if m.no_remat else list(m.tags)
        lines.append(f"per-layer plan: {m.layers} x {what}: {fmt_bytes(m.kept_bytes)}"
                     f"/layer, {m.recompute_flops / 1e9:.4g} GFLOP{secs}/layer")
    uni = 100 * p.overhead
    lines.append(f"per-layer plan: keeps {fmt_bytes(p.mixed_kept_bytes)} over "
                 f"{p.layers_per_core} layers, recompute {100 * p.mixed_overhead:.2f}% of step"
                 f" FLOPs (uniform {uni:.2f}%)" + (
                     f", {100 * p.mixed_time_overhead:.2f}% of step time (uniform "
                     f"{100 * p.time_overhead:.2f}%)" if p.recompute_seconds_per_layer
                     is not None else ""))
    return lines
