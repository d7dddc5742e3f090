"""Regex save policies and named presets.

`RegexPolicy` is a JAX remat policy (``policy(prim, *args, **params)``) that keeps a
``checkpoint_name`` tag when one of its save patterns ``re.fullmatch``es the tag, offloads
it when an offload pattern does, and recomputes everything else. It is a frozen dataclass:
equal patterns make equal, equally hashed policies, so a host's jit cache is hit when a
policy is rebuilt. `save_and_offload_only_these_names_regex` builds one with axlearn's
exact keyword signature.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from jax._src.ad_checkpoint import name_p
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from . import models
from .device import looks_like_neuron

__all__ = [
    "PRESETS",
    "Preset",
    "RegexPolicy",
    "preset",
    "save_and_offload_only_these_names_regex",
    "trn2_preset",
]


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


def trn2_preset(tags: models.TagNames | None = None) -> RegexPolicy:
    """axlearn's TRN2 choice, in the names of `tags` (axlearn's when None)."""
    if tags is None or tags == models.AXLEARN_TAGS:
        return PRESETS["trn2-fuji-70b"].policy
    patterns = [tags.pattern(r) for r in TRN2_ROLES]
    return RegexPolicy([p for p in patterns if p is not None])


def preset(name: str) -> RegexPolicy:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name].policy
