"""The footprint of a model whose layers are of several kinds (mixture-of-experts and dense
feed-forward blocks), and what is particular to experts: the layer kinds each pipeline
stage holds (`stage_mix`) and the expert all-to-all's buffers (`all_to_all_bytes`).

Each kind's per-core graph comes from the one analytic builder (`_analytic.layer_graph`,
re-exported here): pre-norm attention (grouped-query or MLA) then a feed-forward block,
dense or routed experts (a linear router, float32 scores, top-k; every expert a buffer of
``MoEConfig.capacity`` rows; the outputs gathered back and weighted) with optional shared
experts beside them. Each ``ep`` core holds ``experts / ep`` experts whose buffers take the
group's tokens (``tokens x k x capacity_factor`` rows per core at balanced routing; the
all-to-all that moves them is workspace, `all_to_all_bytes`).

**Mixed models** (DeepSeek's dense first layers, Llama 4's interleaving) are planned with
**one save set for every layer kind**, not one per kind. A host's policy is one function
of the tag name, and the attention tags (``q_proj``, ``context``, ...) are the same names in
dense and MoE layers, so per-kind sets could only differ in the feed-forward tags anyway;
one set chosen against the sum over the layers a core holds (`KindsFootprint`: kept bytes
of the fullest pipeline stage, recompute averaged over the model) is exact for that
constraint and never lets the rarer kind overflow the budget that the commoner kind fits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ._analytic import layer_graph
from .graph import Footprint, LayerGraph, TagCost
from .models import Parallelism, StepShape, TransformerConfig, dtype_bytes

__all__ = ["KindsFootprint", "all_to_all_bytes", "layer_footprint", "layer_graph",
           "layer_graphs", "stage_mix"]

def layer_graphs(config: TransformerConfig, shape: StepShape,
                 parallelism: Parallelism | None = None) -> dict[str, LayerGraph]:
    """Layer kind -> its per-core graph."""
    return {kind: layer_graph(config, shape, parallelism, kind) for kind in config.layer_kinds()}


def stage_mix(config: TransformerConfig, pp: int = 1) -> list[dict[str, int]]:
    """Per pipeline stage, how many layers of each kind it holds (contiguous stages)."""
    per = config.layers // pp
    out = []
    for j in range(pp):
        idx = range(j * per, (j + 1) * per)
        moe = sum(1 for i in idx if config.is_moe_layer(i))
        out.append({k: n for k, n in (("dense", per - moe), ("moe", moe)) if n})
    return out


def all_to_all_bytes(config: TransformerConfig, shape: StepShape,
                     parallelism: Parallelism | None = None) -> int:
    """Send and receive buffers of the expert all-to-all on one core (0 without ``ep``):
    each holds the core's routed rows (``experts / ep x capacity``) of `hidden` values."""
    par = parallelism or Parallelism()
    if config.moe is None or par.ep == 1:
        return 0
    rows = config.moe.experts // par.ep * config.moe.capacity(shape.tokens, par.ep)
    return 2 * rows * config.hidden * dtype_bytes(shape.activation_dtype)


class KindsFootprint(Footprint):
    """The footprint of a model with several layer kinds, planned with one save set.

    ``evaluate(saved)`` gives the kept bytes per layer of the fullest pipeline stage (its
    total over the layers it holds, divided by their number, rounded up) and the recompute
    FLOPs per layer averaged over the model. `kind_graphs` holds each kind's graph and
    `tag_roles` what each tag saves in each kind (a MaxText alias saves two roles)."""

    def __init__(self, tags: Mapping[str, TagCost], *, kind_graphs: Mapping[str, LayerGraph],
                 tag_roles: Mapping[str, Mapping[str, tuple[str, ...]]],
                 stages: list[dict[str, int]], counts: Mapping[str, int], **kw: Any) -> None:
        super().__init__(tags, **kw)
        self.kind_graphs = dict(kind_graphs)
        self.tag_roles = {t: dict(r) for t, r in tag_roles.items()}
        self.stages, self.counts = stages, dict(counts)

    def evaluate_kinds(self, saved: Iterable[str]) -> dict[str, tuple[int, int]]:
        chosen = frozenset(saved)
        unknown = chosen - set(self)
        if unknown:
            raise ValueError(f"tags {sorted(unknown)} are not in this footprint ({sorted(self)})")
        out = {}
        for kind, graph in self.kind_graphs.items():
            roles = {r for t in chosen for r in self.tag_roles[t].get(kind, ())}
            ev = graph.evaluate_roles(roles)
            out[kind] = (ev.kept_bytes, ev.recompute_flops)
        return out

    def evaluate(self, saved: Iterable[str]) -> tuple[int, float]:
        per = self.evaluate_kinds(saved)
        kept = max(math.ceil(sum(n * per[k][0] for k, n in stage.items()) / sum(stage.values()))
                   for stage in self.stages)
        total = sum(self.counts.values())
        flops = sum(n * per[k][1] for k, n in self.counts.items()) / total
        return kept, flops


def layer_footprint(config: TransformerConfig, shape: StepShape,
                    parallelism: Parallelism | None = None) -> KindsFootprint:
    """Per-tag bytes and recompute FLOPs (per layer per core, on the mix of layer kinds a
    core holds) for a model with experts or latent attention."""
    par = parallelism or Parallelism()
    graphs = layer_graphs(config, shape, par)
    counts = config.layer_kinds()
    aliases = dict(config.tags.aliases)
    tag_roles: dict[str, dict[str, tuple[str, ...]]] = {}
    role_of: dict[str, str] = {}
    patterns: dict[str, str] = {}
    for kind in graphs:
        for role in config.kind_roles(kind):
            for name, pattern_role in ((config.tag(role), role), (aliases.get(role), role)):
                if name is None:
                    continue
                have = tag_roles.setdefault(name, {}).setdefault(kind, ())
                if pattern_role not in have:
                    tag_roles[name][kind] = have + (pattern_role,)
                if name not in role_of or name == config.tag(role):
                    role_of.setdefault(name, role)
                if name not in patterns:
                    patterns[name] = (".*" if config.tags.prefixed else "") + \
                        re.escape(name)
    probe = KindsFootprint({}, kind_graphs=graphs, tag_roles=tag_roles,
                           stages=stage_mix(config, par.pp), counts=counts,
                           always_kept_bytes=0)
    full_kept, full_flops = probe.evaluate(())
    tags: dict[str, TagCost] = {}
    main = max(counts, key=lambda k: (counts[k], k))
    for name, by_kind in tag_roles.items():
        probe[name] = TagCost(0, 0.0)
        kept, flops = probe.evaluate((name,))
        kind = main if main in by_kind else next(iter(by_kind))
        value = graphs[kind].role_values()[by_kind[kind][0]]
        is_input = role_of[name] == "input"
        if is_input:
            note = "the layer input (scan carry): kept whatever the policy says"
        elif kept == full_kept:
            note = "the backward never reads it: saving it keeps nothing and saves nothing"
        elif len(by_kind) < len(counts):
            note = f"only in {', '.join(by_kind)} layers"
        else:
            note = ""
        tags[name] = TagCost(bytes=value.bytes if is_input else kept - full_kept,
                             recompute_flops=float(full_flops - flops), always_kept=is_input,
                             size_bytes=value.bytes, shape=value.shape, dtype=value.dtype,
                             note=note)
    forward = sum(n * graphs[k].forward_flops() for k, n in counts.items()) / config.layers
    return KindsFootprint(
        tags, kind_graphs=graphs, tag_roles=tag_roles, stages=stage_mix(config, par.pp),
        counts=counts, always_kept_bytes=full_kept, patterns=patterns, graph=graphs[main],
        roles=role_of, forward_flops=forward,
        no_remat_bytes=max(g.no_remat_bytes() for g in graphs.values()))
