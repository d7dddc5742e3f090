"""Regex save policies, named presets, an audit of what a policy keeps, and the planner.

`RegexPolicy` is a JAX remat policy (``policy(prim, *args, **params)``) that keeps a
``checkpoint_name`` tag when one of its save patterns ``re.fullmatch``es the tag, offloads
it when an offload pattern does, and recomputes everything else. It is a frozen dataclass:
equal patterns make equal, equally hashed policies, so a host's jit cache is hit when a
policy is rebuilt. `save_and_offload_only_these_names_regex` builds one with axlearn's
exact keyword signature.

`audit` traces a function and says which tags it emits, which pattern decided each, which
patterns match nothing, and what JAX keeps. `plan` picks the tags to save that fit a memory
budget with the least recomputation, exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from jax._src.ad_checkpoint import name_p
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from . import memory_model as mm
from .device import GiB, MiB, DeviceSpec, looks_like_neuron

__all__ = [
    "AuditReport",
    "DeadPatternError",
    "NoFitError",
    "PRESETS",
    "Plan",
    "Preset",
    "RegexPolicy",
    "TagAudit",
    "audit",
    "plan",
    "preset",
    "save_and_offload_only_these_names_regex",
]

logger = logging.getLogger(__name__)

_NAME = str(name_p)

PatternLike = str | re.Pattern[str]
Patterns = PatternLike | Sequence[PatternLike] | None

# Strings a pattern must not match all of: if it does, it matches every tag there is.
_PROBES = ("x", "Z", "0", "_", ".", "a.b", "q_proj", "MultiheadAttention.q_proj",
           "TransformerFeedForwardLayer.linear2", "decoder_layer_input", "zzz_no_such_tag_42",
           "A-b c", "é", "[]()", "\t", "name/with/slashes", "x" * 300)


def _as_text(p: PatternLike) -> str:
    if isinstance(p, re.Pattern):
        flags = p.flags & ~re.UNICODE
        letters = "".join(c for f, c in ((re.IGNORECASE, "i"), (re.MULTILINE, "m"),
                                         (re.DOTALL, "s"), (re.VERBOSE, "x")) if flags & f)
        if flags & ~(re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE):
            raise ValueError(f"pattern {p.pattern!r} uses regex flags that cannot be written "
                             "inline; use i, m, s or x only")
        return f"(?{letters}:{p.pattern})" if letters else p.pattern
    if not isinstance(p, str):
        raise TypeError(f"a pattern must be a str or re.Pattern, got {type(p).__name__}: {p!r}")
    return p


def _top_level_split(pattern: str) -> list[str]:
    """Split `pattern` at its top-level ``|`` (outside groups, classes and escapes)."""
    parts, depth, start, i, in_class = [], 0, 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":
                i += 1  # a literal ] first in the class
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    parts.append(pattern[start:])
    return parts


def _alternatives(pattern: str) -> list[str]:
    """The top-level alternatives of `pattern`, looking through one group that wraps it
    all: ``(a|b.*)`` -> ``["a", "b.*"]``. Patterns that would change meaning when split
    (global inline flags, group references) are kept whole."""
    if re.search(r"\\\d|\(\?P=", pattern):
        return [pattern]
    inner = pattern
    m = re.fullmatch(r"\((\?:)?(.*)\)", pattern, re.DOTALL)
    if m and len(_top_level_split(pattern)) == 1 and _balanced(m.group(2)):
        inner = m.group(2)
    parts = _top_level_split(inner)
    if len(parts) == 1 or any(p == "" for p in parts):
        return [pattern]
    try:
        for part in parts:
            re.compile(part)
    except re.error:
        return [pattern]
    return parts


def _balanced(text: str) -> bool:
    """True when `text` is a valid regex by itself (so the outer group wrapped all of it)."""
    try:
        re.compile(text)
    except re.error:
        return False
    return True


def _normalise(patterns: Patterns, what: str) -> tuple[str, ...]:
    if patterns is None:
        return ()
    items = [patterns] if isinstance(patterns, (str, re.Pattern)) else list(patterns)
    out: list[str] = []
    for item in items:
        text = _as_text(item)
        if text == "":
            raise ValueError(f"an empty {what} pattern matches only an empty tag; leave it out")
        flags = re.match(r"\(\?([aiLmsux]+)\)", text)
        if flags:  # leading global flags become scoped ones, so patterns can be joined
            text = f"(?{flags.group(1)}:{text[flags.end():]})"
        try:
            re.compile(text)
        except re.error as err:
            raise ValueError(f"invalid regex {text!r} in {what} patterns: {err}") from None
        for part in _alternatives(text):
            if part not in out:
                out.append(part)
    return tuple(out)


def _alternation(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{p})" for p in patterns))


def _matches_everything(rx: re.Pattern[str]) -> bool:
    return all(rx.fullmatch(s) for s in _PROBES)


@dataclass(frozen=True)
class RegexPolicy:
    """Save (or offload) the ``checkpoint_name`` tags that fully match a pattern.

    Args:
        save: patterns of tags to keep in device memory (a string or a list, one pattern
            per line reads best); they are joined into one alternation. A pattern's
            top-level alternatives (``a|b``, or ``(a|b)``) are kept as separate patterns, so
            ``"a|b"`` and ``["a", "b"]`` make equal policies and the audit can tell which
            alternative matched nothing.
        offload: patterns of tags to move to `offload_dst` instead; save wins when both match.
        offload_src, offload_dst: memory kinds for offloaded tags (``"device"``,
            ``"pinned_host"``); required when there are offload patterns.
        allow_everything: accept a pattern that matches every tag (``.*``).
        allow_offload_on_neuron: the Neuron compiler does not document host offload, so a
            policy that offloads is refused on a Neuron host (`device.looks_like_neuron`:
            the override, an earlier detection, or Neuron device nodes) unless this is set.
    """

    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    offload_src: str | None = None
    offload_dst: str | None = None
    allow_everything: bool = field(default=False, compare=False)
    allow_offload_on_neuron: bool = field(default=False, compare=False)

    def __init__(self, save: Patterns = (), offload: Patterns = (), *,
                 offload_src: str | None = None, offload_dst: str | None = None,
                 allow_everything: bool = False, allow_offload_on_neuron: bool = False
                 ) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("save", _normalise(save, "save"))
        set_("offload", _normalise(offload, "offload"))
        set_("offload_src", offload_src)
        set_("offload_dst", offload_dst)
        set_("allow_everything", allow_everything)
        set_("allow_offload_on_neuron", allow_offload_on_neuron)
        self.__post_init__()

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("_save_rx", _alternation(self.save))
        set_("_offload_rx", _alternation(self.offload))
        set_("_decisions", {})
        if not self.allow_everything:
            for what, pats, rx in (("save", self.save, self._save_rx),
                                   ("offload", self.offload, self._offload_rx)):
                if rx is None:
                    continue
                culprit = next((p for p in pats if _matches_everything(re.compile(p))), None)
                if culprit is not None or _matches_everything(rx):
                    shown = repr(culprit) if culprit is not None else f"{what} patterns {pats}"
                    raise ValueError(
                        f"{shown} matches every tag, so the policy would {what} everything; "
                        "name the tags, or pass allow_everything=True")
        if self.offload and (not self.offload_src or not self.offload_dst):
            raise ValueError(
                f"offload patterns {list(self.offload)} need offload_src and offload_dst "
                f"(e.g. 'device' and 'pinned_host'); got offload_src={self.offload_src!r}, "
                f"offload_dst={self.offload_dst!r}")
        if self.offload and not self.allow_offload_on_neuron and looks_like_neuron():
            raise ValueError(
                f"offload patterns {list(self.offload)} on a Neuron device: the Neuron "
                "compiler does not document host offload; save or recompute instead, or "
                "pass allow_offload_on_neuron=True to try it")

    # The remat-policy protocol --------------------------------------------------------

    def __call__(self, prim: Any, *args: Any, **params: Any) -> Any:
        if prim is not name_p and str(prim) != _NAME:
            return Recompute
        name = params["name"]
        cached = self._decisions.get(name)  # type: ignore[attr-defined]
        if cached is None:
            cached = self._decide(name)
            self._decisions[name] = cached  # type: ignore[attr-defined]
        return cached

    def _decide(self, name: str) -> Any:
        if self._save_rx is not None and self._save_rx.fullmatch(name):  # type: ignore[attr-defined]
            return Saveable
        if self._offload_rx is not None and self._offload_rx.fullmatch(name):  # type: ignore[attr-defined]
            return Offloadable(src=self.offload_src, dst=self.offload_dst)
        return Recompute

    # Introspection ---------------------------------------------------------------------

    def action(self, tag: str) -> str:
        """``"save"``, ``"offload"`` or ``"recompute"`` for a tag."""
        decision = self(name_p, name=tag)
        if decision is Saveable:
            return "save"
        return "recompute" if decision is Recompute else "offload"

    def matching(self, tag: str) -> tuple[tuple[str, str], ...]:
        """Every (kind, pattern) that fully matches `tag`, saves first."""
        return tuple((kind, p) for kind, pats in (("save", self.save), ("offload", self.offload))
                     for p in pats if re.fullmatch(p, tag))

    @property
    def save_regex(self) -> str | None:
        """The save patterns as one regex string (what axlearn's
        ``names_which_can_be_saved`` takes)."""
        return "|".join(self.save) if self.save else None

    @property
    def offload_regex(self) -> str | None:
        return "|".join(self.offload) if self.offload else None

    def __or__(self, other: RegexPolicy) -> RegexPolicy:
        """Save what either saves; offload what either offloads."""
        if self.offload and other.offload and (
                (self.offload_src, self.offload_dst) != (other.offload_src, other.offload_dst)):
            raise ValueError("cannot combine policies that offload to different places")
        return RegexPolicy(self.save + other.save, self.offload + other.offload,
                           offload_src=self.offload_src or other.offload_src,
                           offload_dst=self.offload_dst or other.offload_dst,
                           allow_everything=self.allow_everything or other.allow_everything,
                           allow_offload_on_neuron=self.allow_offload_on_neuron
                           or other.allow_offload_on_neuron)

    def to_dict(self) -> dict[str, Any]:
        return {"save": list(self.save), "offload": list(self.offload),
                "offload_src": self.offload_src, "offload_dst": self.offload_dst,
                "save_regex": self.save_regex, "offload_regex": self.offload_regex}

    def __repr__(self) -> str:
        parts = [f"save={list(self.save)}"]
        if self.offload:
            parts.append(f"offload={list(self.offload)}, offload_src={self.offload_src!r}, "
                         f"offload_dst={self.offload_dst!r}")
        return f"RegexPolicy({', '.join(parts)})"

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        self.__post_init__()


def save_and_offload_only_these_names_regex(
    *,
    names_which_can_be_saved: Patterns,
    names_which_can_be_offloaded: Patterns,
    offload_src: str | None,
    offload_dst: str | None,
) -> RegexPolicy:
    """axlearn's ``save_and_offload_only_these_names_regex``, returning a `RegexPolicy`.

    Same keywords, same meaning: tags fully matching `names_which_can_be_saved` are saved,
    those matching `names_which_can_be_offloaded` are offloaded from `offload_src` to
    `offload_dst`, the rest recomputed; a None or empty pattern turns its branch off. A
    list of patterns is also accepted for either.
    """
    def clean(p: Patterns) -> Patterns:
        return None if p is None or (isinstance(p, str) and p == "") else p

    saved, offloaded = clean(names_which_can_be_saved), clean(names_which_can_be_offloaded)
    return RegexPolicy(saved, offloaded,
                       offload_src=offload_src if offloaded else None,
                       offload_dst=offload_dst if offloaded else None)


# --------------------------------------------------------------------------------------
# Presets.
# --------------------------------------------------------------------------------------

QKV_PROJ = r".*[kqv]_proj"
O_PROJ = r".*o_proj"
CONTEXT = r".*context"
LINEAR1 = r".*linear1_[01]"
LINEAR2 = r".*linear2"
NATIVE_ATTENTION = r".*([qkvo]_proj|context)"
EVERYTHING = r".*"


@dataclass(frozen=True)
class Preset:
    name: str
    policy: RegexPolicy
    reason: str


def _presets(*rows: Preset) -> Mapping[str, Preset]:
    return MappingProxyType({p.name: p for p in rows})


PRESETS: Mapping[str, Preset] = _presets(
    Preset("trn2-fuji-70b", RegexPolicy([QKV_PROJ, LINEAR1]),
           "axlearn's TRN2 choice for Fuji-70B (PR #898): q/k/v projections and the gated "
           "FFN's first matmuls; nothing offloaded"),
    Preset("native-attention", RegexPolicy([NATIVE_ATTENTION]),
           "axlearn's default: every attention matmul output and the attention context"),
    Preset("qkv-proj", RegexPolicy([QKV_PROJ]),
           "only the q/k/v projections: the cheapest useful save"),
    Preset("feed-forward", RegexPolicy([LINEAR1, LINEAR2]),
           "the FFN matmul outputs (linear2 is never read by the backward, so only "
           "linear1_* are kept)"),
    Preset("full", RegexPolicy(),
           "save nothing: recompute the whole layer (least memory)"),
    Preset("none", RegexPolicy([EVERYTHING], allow_everything=True),
           "save every tagged value (untagged norms, softmax and activations are still "
           "recomputed)"),
)


TRN2_ROLES = ("q_proj", "k_proj", "v_proj", "linear1_0", "linear1_1")
"""The tag roles the ``trn2-fuji-70b`` preset saves, for other tag vocabularies."""


def trn2_preset(tags: mm.TagNames | None = None) -> RegexPolicy:
    """axlearn's TRN2 choice, in the names of `tags` (axlearn's when None)."""
    if tags is None or tags == mm.AXLEARN_TAGS:
        return PRESETS["trn2-fuji-70b"].policy
    patterns = [tags.pattern(r) for r in TRN2_ROLES]
    return RegexPolicy([p for p in patterns if p is not None])


def preset(name: str) -> RegexPolicy:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name].policy


# --------------------------------------------------------------------------------------
# Audit.
# --------------------------------------------------------------------------------------


class DeadPatternError(ValueError):
    """A pattern matched none of the tags the function emits (``audit(strict=True)``)."""


@dataclass(frozen=True)
class TagAudit:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    count: int
    action: str
    pattern: str | None  # the pattern that decided (None: recomputed by default)
    also_matched: tuple[str, ...]
    kept_bytes: int  # what JAX keeps for this tag under the policy


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

    @property
    def saved_bytes(self) -> int:
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
                         _fmt_bytes(t.bytes * t.count), t.action, t.pattern or "-",
                         _fmt_bytes(t.kept_bytes)))
        lines = _grid(rows)
        lines.append("")
        lines.append(f"policy: {self.policy!r}")
        lines.append(
            f"kept for the backward: {_fmt_bytes(self.saved_bytes)} = tags "
            f"{_fmt_bytes(self.saved_tag_bytes)} + inputs {_fmt_bytes(self.saved_input_bytes)}"
            f" + other {_fmt_bytes(self.saved_other_bytes)}")
        lines.append(
            f"dot_generals recomputed vs no remat: {self.recomputed_dots} "
            f"(full remat: {self.full_remat_dots}); recompute "
            f"{self.recompute_flops / 1e9:.4g} GFLOP")
        for p in self.dead_patterns:
            lines.append(f"DEAD PATTERN: {p!r} matches no tag this function emits")
        for tag, pats in self.overlaps:
            lines.append(f"note: {tag!r} is matched by {len(pats)} patterns: {list(pats)}")
        return "\n".join(lines)


def audit(fn: Callable[..., Any], *args: Any, policy: RegexPolicy | Callable[..., Any],
          strict: bool = False, prevent_cse: bool = True, **kwargs: Any) -> AuditReport:
    """Trace ``fn(*args, **kwargs)`` under ``jax.checkpoint(fn, policy=policy)`` and report
    what each tag gets, which patterns are dead, and what JAX keeps and recomputes.

    `fn` is one layer, or a stack of layers without its own ``jax.checkpoint``. With
    ``strict=True`` a dead pattern raises `DeadPatternError`.
    """
    from . import _trace  # noqa: PLC0415

    if not isinstance(policy, RegexPolicy):
        raise TypeError(f"audit needs a RegexPolicy, got {policy!r}; wrap names with "
                        "RegexPolicy([re.escape(name), ...])")
    infos = _trace.emitted_tags(fn, args, kwargs)
    names = [i.name for i in infos]
    patterns = [*policy.save, *policy.offload]
    dead = tuple(p for p in patterns if not any(re.fullmatch(p, n) for n in names))
    if dead and strict:
        raise DeadPatternError(
            f"patterns {list(dead)} match none of the tags the function emits: {names}")
    wrapped = _trace.checkpointed(fn, policy, prevent_cse)
    res = _trace.residuals(wrapped, args, kwargs)
    kept_by_tag: dict[str, int] = {}
    for r in res:
        if r.kind == "tag":
            kept_by_tag[r.name] = kept_by_tag.get(r.name, 0) + r.bytes
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
                             kept_by_tag.get(info.name, 0)))
    cost = _trace.linearized_cost(wrapped, args, kwargs)
    base = _trace.linearized_cost(fn, args, kwargs)
    full = _trace.linearized_cost(_trace.checkpointed(fn, None, prevent_cse), args, kwargs)
    return AuditReport(
        policy=policy, tags=tuple(tags), dead_patterns=dead, overlaps=tuple(overlaps),
        saved_tag_bytes=sum(r.bytes for r in res if r.kind == "tag"),
        saved_input_bytes=sum(r.bytes for r in res if r.kind == "argument"),
        saved_other_bytes=sum(r.bytes for r in res if r.kind == "other"),
        other_residuals=tuple((r.name, r.bytes) for r in res if r.kind == "other"),
        recomputed_dots=cost.dot_generals - base.dot_generals,
        full_remat_dots=full.dot_generals - base.dot_generals,
        recompute_flops=cost.flops - base.flops)


# --------------------------------------------------------------------------------------
# Planner.
# --------------------------------------------------------------------------------------

DEFAULT_MIN_FLOPS_PER_BYTE = 8.0
"""A tag that saves fewer FLOPs of recompute per byte it keeps is elementwise work (a norm
or activation output: a few FLOPs per element), cheaper to redo than to hold. A matmul
output saves ``2 x contraction`` FLOPs per element, at least 32 per byte for any real
layer."""


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

    policy: RegexPolicy
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
    config: mm.TransformerConfig | None = None
    parallelism: mm.Parallelism | None = None
    no_remat_bytes_per_layer: int = 0
    notes: tuple[str, ...] = ()

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
        return self.budget.state.total_bytes + self.activation_bytes + self.budget.workspace_bytes

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
            "policy": self.policy.to_dict(),
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
            "runner_ups": [dataclasses.asdict(c) for c in self.runner_ups],
            "notes": list(self.notes),
        }
        if self.device is not None:
            out["device"] = self.device.to_dict()
        if self.budget is not None:
            b = self.budget
            out["budget"] = {"hbm_bytes": b.hbm_bytes, "state_bytes": b.state.total_bytes,
                             "params_bytes": b.state.params_bytes,
                             "grads_bytes": b.state.grads_bytes,
                             "optimizer_bytes": b.state.optimizer_bytes,
                             "reserve_bytes": b.reserve_bytes,
                             "workspace_bytes": b.workspace_bytes,
                             "available_bytes": b.available_bytes}
        if self.config is not None:
            out["model"] = self.config.name
        if self.parallelism is not None:
            out["parallelism"] = dataclasses.asdict(self.parallelism)
        return out

    def table(self) -> str:
        rows = [("tag", "bytes/layer", "recompute saved", "FLOP/B", "saved", "why")]
        for d in self.decisions:
            rows.append((d.tag, _fmt_bytes(d.bytes), f"{d.recompute_flops / 1e9:.4g} GFLOP",
                         f"{d.flops_per_byte:.4g}", "yes" if d.saved else "no", d.reason))
        lines = _grid(rows)
        lines.append("")
        if self.budget is not None:
            b = self.budget
            lines.append(
                f"per core: HBM {_fmt_bytes(b.hbm_bytes)} = state {_fmt_bytes(b.state.total_bytes)}"
                f" + reserve {_fmt_bytes(b.reserve_bytes)} + workspace "
                f"{_fmt_bytes(b.workspace_bytes)} + activations "
                f"{_fmt_bytes(self.activation_bytes)} + free {_fmt_bytes(self.headroom_bytes)}")
        lines.append(
            f"per layer: keeps {_fmt_bytes(self.kept_bytes_per_layer)} of "
            f"{_fmt_bytes(self.budget_bytes_per_layer)} budget x {self.layers_per_core} layers"
            f" x {self.inflight} in flight; recompute "
            f"{self.recompute_flops_per_layer / 1e9:.4g} GFLOP/layer"
            + (f" ({100 * self.overhead:.2f}% of a step)" if self.forward_flops_per_layer else ""))
        for c in self.runner_ups:
            lines.append(f"runner-up: {list(c.tags)}: {_fmt_bytes(c.kept_bytes)}/layer, "
                         f"{c.recompute_flops / 1e9:.4g} GFLOP/layer")
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append(f"policy: {self.policy!r}")
        lines.append(f"regex:  {self.policy.save_regex or '(save nothing)'}")
        return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


def _grid(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def _solve(footprint: mm.Footprint, candidates: Sequence[str], budget: int,
           keep: int = 4) -> list[Choice]:
    """The `keep` best feasible save sets (least recompute, then fewest bytes, then names),
    exactly: every subset is evaluated when the footprint is a joint model (at most 2**16)
    or small (2**8), otherwise a branch and bound over the additive per-tag costs."""
    if footprint.graph is not None or len(candidates) <= 8:
        if len(candidates) > 16:
            raise ValueError(f"{len(candidates)} candidate tags are too many to enumerate")
        found = []
        for r in range(len(candidates) + 1):
            for subset in itertools.combinations(candidates, r):
                kept, flops = footprint.evaluate(subset)
                if kept <= budget:
                    found.append(Choice(tuple(sorted(subset)), kept, flops))
        found.sort(key=lambda c: (c.recompute_flops, c.kept_bytes, len(c.tags), c.tags))
        return _distinct(found, keep)
    return _branch_and_bound(footprint, candidates, budget, keep)


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
    config: mm.TransformerConfig | None = None,
    shape: mm.StepShape | None = None,
    parallelism: mm.Parallelism | None = None,
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
    par: mm.Parallelism | None = None
    if footprint is None:
        if config is None or shape is None:
            raise ValueError("plan needs config= and shape= (a model), or footprint= with "
                             "budget_bytes=")
        if device is None:
            from .device import detect  # noqa: PLC0415

            device = detect()
        par = (parallelism or mm.Parallelism()).resolve(device)
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
    for t in pool:
        cost = fp[t]
        if t in always:
            continue
        if cost.recompute_flops <= 0:
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
    choices = _solve(fp, usable, per_layer, keep=1 + runner_ups)
    if not choices:
        full_kept, _ = fp.evaluate(())
        raise NoFitError(_no_fit_message(full_kept, per_layer, bud, config, shape, par))
    best = choices[0]
    for t in usable:
        cost = fp[t]
        if t in best.tags:
            decisions[t] = (f"saved: {cost.recompute_flops / cost.bytes:.3g} FLOP/B"
                            if cost.bytes else "saved: free to keep")
        else:
            alone, _ = fp.evaluate(best.tags + (t,))
            decisions[t] = ("does not fit: " if alone > per_layer else "") + (
                f"adding it keeps {_fmt_bytes(alone)} > {_fmt_bytes(per_layer)} budget"
                if alone > per_layer else "a better set fits without it")
    for t in always:
        decisions[t] = "always kept: the layer input (scan carry)"
    patterns = getattr(fp, "patterns", {t: re.escape(t) for t in fp})
    policy = RegexPolicy([patterns[t] for t in names if t in best.tags])
    if fp.no_remat_bytes and fp.no_remat_bytes <= per_layer:
        notes.append(f"no remat at all would fit too ({_fmt_bytes(fp.no_remat_bytes)}/layer): "
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
        notes=tuple(notes))


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
                    config: mm.TransformerConfig | None, shape: mm.StepShape | None,
                    par: mm.Parallelism | None) -> str:
    if per_layer > 0:
        msg = (f"even full recompute keeps {_fmt_bytes(full_kept)} per layer per core, over "
               f"the {_fmt_bytes(per_layer)} budget")
    else:
        msg = (f"even full recompute keeps {_fmt_bytes(full_kept)} per layer per core, and "
               "nothing is left for activations")
    if bud is not None:
        msg += (f" (HBM {_fmt_bytes(bud.hbm_bytes)} - state {_fmt_bytes(bud.state.total_bytes)}"
                f" - reserve {_fmt_bytes(bud.reserve_bytes)} - workspace "
                f"{_fmt_bytes(bud.workspace_bytes)} = {_fmt_bytes(bud.available_bytes)} for "
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
