"""What a policy does to a real function, according to JAX: the tags it emits, which pattern
decided each, which patterns match nothing, what JAX keeps and what it recomputes."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from . import _jaxpr, _trace
from ._jax_compat import remat3_off
from ._format import first_line, fmt_bytes, grid
from .policies import RegexPolicy

logger = logging.getLogger("neuron_remat.audit")

__all__ = ["AuditReport", "DeadPatternError", "LayerError", "TagAudit", "audit"]


class LayerError(ValueError):
    """The user's function itself failed to trace with the given arguments (as it would
    under ``jax.eval_shape``): its error, not neuron_remat's."""


class DeadPatternError(ValueError):
    """A pattern matched none of the tags the function emits (``audit(strict=True)``)."""


@dataclass(frozen=True)
class TagAudit:
    """One tag: its `shape`, `dtype` and `bytes` per emission as the program computes it
    (inside a ``shard_map``, per shard: per core), `count` emissions per call, what the
    policy does with it, and `kept_bytes`: what JAX keeps for it on the device under the
    policy, as ``saved_residuals`` lists it (a shard_map's residuals at their global
    shapes, all shards together); `offloaded_bytes`: what an offloading policy moves to
    host memory for it instead."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    count: int
    action: str
    pattern: str | None  # the pattern that decided (None: recomputed by default)
    also_matched: tuple[str, ...]
    kept_bytes: int  # what JAX keeps for this tag under the policy
    offloaded_bytes: int = 0  # what JAX keeps for it in host memory (offloaded)


@dataclass(frozen=True)
class AuditReport:
    """What a policy does to a function, according to JAX."""

    policy: RegexPolicy
    tags: tuple[TagAudit, ...]
    dead_patterns: tuple[str, ...]
    overlaps: tuple[tuple[str, tuple[str, ...]], ...]
    saved_tag_bytes: int
    saved_input_bytes: int
    saved_other_bytes: int
    other_residuals: tuple[tuple[str, int], ...]
    recomputed_dots: int
    full_remat_dots: int
    recompute_flops: int
    saved_param_bytes: int = 0  # parameters JAX keeps: model state, not activations
    activation_argnums: tuple[int, ...] = ()
    per_shard: bool = False  # tags inside a shard_map: `TagAudit.bytes` per shard
    # jax.checkpoint calls inside the function (nn.remat, filter_checkpoint): their own
    # policy decides what they keep, and the figures are against that function
    inner_checkpoints: int = 0
    saved_host_bytes: int = 0  # offloaded residuals, in host memory: not in saved_bytes

    @property
    def saved_bytes(self) -> int:
        """Activation bytes kept for the backward (tags, layer input, other); parameters are
        counted apart, in `saved_param_bytes`."""
        return self.saved_tag_bytes + self.saved_input_bytes + self.saved_other_bytes

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["policy"] = self.policy.to_dict()
        out["saved_bytes"] = self.saved_bytes
        return out

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self) -> str:
        rows = [("tag", "shape", "dtype", "bytes", "action", "decided by", "kept")]
        for t in self.tags:
            rows.append((t.name, "x".join(map(str, t.shape)) or "scalar", t.dtype,
                         fmt_bytes(t.bytes * t.count), t.action, t.pattern or "-",
                         fmt_bytes(t.kept_bytes) + (f" (+{fmt_bytes(t.offloaded_bytes)} host)"
                                                    if t.offloaded_bytes else "")))
        lines = grid(rows)
        lines.append("")
        lines.append(f"policy: {self.policy!r}")
        lines.append(
            f"kept for the backward: {fmt_bytes(self.saved_bytes)} = tags "
            f"{fmt_bytes(self.saved_tag_bytes)} + inputs {fmt_bytes(self.saved_input_bytes)}"
            f" + other {fmt_bytes(self.saved_other_bytes)} (parameters "
            f"{fmt_bytes(self.saved_param_bytes)} apart; layer input: argument "
            f"{', '.join(map(str, self.activation_argnums))})"
            + (f"; offloaded to host memory {fmt_bytes(self.saved_host_bytes)}"
               if self.saved_host_bytes else ""))
        lines.append(
            f"dot_generals recomputed vs no remat: {self.recomputed_dots} "
            f"(full remat: {self.full_remat_dots}); recompute "
            f"{self.recompute_flops / 1e9:.4g} GFLOP")
        for p in self.dead_patterns:
            lines.append(f"DEAD PATTERN: {p!r} matches no tag this function emits")
        for tag, pats in self.overlaps:
            lines.append(f"note: {tag!r} is matched by {len(pats)} patterns: {list(pats)}")
        if self.per_shard:
            lines.append("note: a tag's bytes are per shard inside a shard_map; kept is what "
                         "JAX keeps, all shards together")
        if self.inner_checkpoints:
            lines.append(f"WARNING: {_INNER.format(n=self.inner_checkpoints)}")
        return "\n".join(lines)


_INNER = ("the function already holds {n} jax.checkpoint (nn.remat, filter_checkpoint, "
          "scan_layers): inside them their own policy decides what is kept, and the recompute "
          "figures compare against that function, not one without remat; audit the layer "
          "without its checkpoint")


def audit(fn: Callable[..., Any], *args: Any, policy: RegexPolicy | Callable[..., Any],
          strict: bool = False, prevent_cse: bool = True,
          activation_argnums: Sequence[int] | int | None = None, **kwargs: Any) -> AuditReport:
    """Trace ``fn(*args, **kwargs)`` under ``jax.checkpoint(fn, policy=policy)`` and report
    what each tag gets, which patterns are dead, and what JAX keeps and recomputes.

    `fn` is one layer, or a stack of layers without its own ``jax.checkpoint``. The layer
    input is the argument matching the output's structure, shapes and dtypes (as in
    `traced_footprint`; `activation_argnums` overrides); the other arguments are parameters,
    whose kept bytes are reported apart. Arguments take the forms `traced_footprint`
    takes (keywords, static Python values, integer, boolean and key arrays). A function
    that fails to trace with these arguments raises `LayerError`. When no argument
    matches (`fn` is a loss, not a layer), every argument counts as an input; when several
    do, the call is ambiguous (a ValueError naming them: pass `activation_argnums`). With
    ``strict=True`` a dead pattern raises `DeadPatternError`.
    """
    if not isinstance(policy, RegexPolicy):
        raise TypeError(f"audit needs a RegexPolicy, got {policy!r}; wrap names with "
                        "RegexPolicy([re.escape(name), ...])")
    call = _jaxpr.bind_call(fn, args, kwargs)
    try:
        jax.eval_shape(call.fn, *call.args)
    except Exception as err:  # noqa: BLE001  the user's function, failing as it will
        name = getattr(fn, "__name__", type(fn).__name__)
        raise LayerError(f"{name} raised {type(err).__name__} when traced with these "
                         f"arguments: {first_line(err)}"
                         ) from err
    fn, args, kwargs = call.fn, call.args, {}
    try:
        acts = _jaxpr.resolve_activation_argnums(fn, args, kwargs, activation_argnums)
    except ValueError as err:
        if activation_argnums is not None or isinstance(err, _jaxpr.AmbiguousInputError):
            raise
        # Not a layer (a loss, a function with several outputs): no argument is the layer
        # input, so every argument JAX keeps is reported as an input, as JAX sees it.
        acts = tuple(range(call.n_positional))
    with remat3_off():  # calls wrapped before still trace as remat3's
        inner = sum(_jaxpr.is_checkpoint_call(e)
                    for e, _ in _jaxpr._walk(jax.make_jaxpr(fn)(*args).jaxpr))
    if inner:
        logger.warning("audit: %s", _INNER.format(n=inner))
    built = _trace.emitted_build(fn, args, kwargs)
    infos = list(built.tags.values())
    names = [i.name for i in infos]
    dead = policy.dead_patterns(names)
    if dead and strict:
        raise DeadPatternError(
            f"patterns {list(dead)} match none of the tags the function emits: {names}")
    wrapped = _jaxpr.checkpointed(fn, policy, prevent_cse)
    res = _jaxpr.residuals(wrapped, args, kwargs)
    kept_by_tag: dict[str, int] = {}
    off_by_tag: dict[str, int] = {}
    for r in res:
        if r.kind == "tag":
            into = off_by_tag if r.host else kept_by_tag
            into[r.name] = into.get(r.name, 0) + r.bytes
    host, res = [r for r in res if r.host], [r for r in res if not r.host]
    tags = []
    overlaps = []
    for info in infos:
        matched = policy.matching(info.name)
        action = policy.action(info.name)
        decider = next((p for kind, p in matched if kind == action), None)
        if len(matched) > 1:
            overlaps.append((info.name, tuple(p for _, p in matched)))
        tags.append(TagAudit(info.name, info.shape, info.dtype, info.bytes, info.count, action,
                             decider, tuple(p for _, p in matched if p != decider),
                             kept_by_tag.get(info.name, 0), off_by_tag.get(info.name, 0)))
    cost = _jaxpr.linearized_cost(wrapped, args, kwargs)
    base = _jaxpr.linearized_cost(fn, args, kwargs)
    full = _jaxpr.linearized_cost(_jaxpr.checkpointed(fn, None, prevent_cse), args, kwargs)
    return AuditReport(
        policy=policy, tags=tuple(tags), dead_patterns=dead, overlaps=tuple(overlaps),
        saved_tag_bytes=sum(r.bytes for r in res if r.kind == "tag"),
        saved_input_bytes=sum(r.bytes for r in res if r.kind == "argument"
                              and (r.argnum is None or r.argnum in acts)),
        saved_param_bytes=sum(r.bytes for r in res if r.kind == "argument"
                              and r.argnum is not None and r.argnum not in acts),
        activation_argnums=acts,
        saved_other_bytes=sum(r.bytes for r in res if r.kind == "other"),
        other_residuals=tuple((r.name, r.bytes) for r in res if r.kind == "other"),
        recomputed_dots=cost.dot_generals - base.dot_generals,
        full_remat_dots=full.dot_generals - base.dot_generals,
        recompute_flops=cost.flops - base.flops, per_shard=built.per_shard,
        inner_checkpoints=inner, saved_host_bytes=sum(r.bytes for r in host))
