"""Regex save policies and named presets.

`RegexPolicy` is a JAX remat policy (``policy(prim, *args, **params)``) that keeps a
``checkpoint_name`` tag when one of its save patterns ``re.fullmatch``es the tag, offloads
it when an offload pattern does, and recomputes everything else. It is a frozen dataclass:
equal patterns make equal, equally hashed policies, so a host's jit cache is hit when a
policy is rebuilt. `save_and_offload_only_these_names_regex` builds one with axlearn's
exact keyword signature.

Both of JAX's remat implementations honour it. The original one (``jax.checkpoint``'s
default through JAX 0.12) calls the policy on every primitive. The new one (``jax_remat3``,
opt-in) depends on the JAX version. In JAX 0.10 it never calls a policy: it asks ``name in
policy.saveable_names`` of instances of its own ``SaveOnlyTheseNames``, treats every other
callable as full remat and has no offload. A `RegexPolicy` is such an instance (on JAX
versions that have the class), and its ``saveable_names`` answers membership with the save
patterns, so both implementations make the same decisions; tags the offload patterns match
are recomputed there (the memory-safe reading), and `warn_if_ignored` says so once. In JAX
0.12 remat3 calls any policy about tags and matmuls and honours offload
(`remat3_asks_any_policy`), so nothing is lost and nothing is warned about.

Patterns are matched by `_regex.SafePattern`, in time linear in the tag's length; a
pattern that would need unbounded backtracking is refused when the policy is built.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from . import _jax_compat, _regex, models
from ._jax_compat import name_p
from .device import looks_like_neuron

__all__ = [
    "MEMORY_KINDS",
    "NamesPolicy",
    "PRESETS",
    "Preset",
    "RegexPolicy",
    "ResolvingPolicy",
    "preset",
    "active_remat",
    "save_and_offload_only_these_names_regex",
    "trn2_preset",
    "warn_if_ignored",
]

logger = logging.getLogger(__name__)


_NAME = str(name_p)

PatternLike = str | re.Pattern[str]
Patterns = PatternLike | Sequence[PatternLike] | None

# Strings a pattern must not match all of: if it does, it matches every tag there is.
_PROBES = ("x", "Z", "0", "_", ".", "a.b", "q_proj", "MultiheadAttention.q_proj",
           "TransformerFeedForwardLayer.linear2", "decoder_layer_input", "zzz_no_such_tag_42",
           "A-b c", "é", "[]()", "\t", "name/with/slashes", "x" * 300)


_INLINE = ((re.IGNORECASE, "i"), (re.MULTILINE, "m"), (re.DOTALL, "s"), (re.VERBOSE, "x"),
           (re.ASCII, "a"))
_WRITABLE = re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE | re.ASCII | re.UNICODE
_LEADING_FLAGS = re.compile(r"\(\?[aiLmsux]+\)")
_VERBOSE_GAP = re.compile(r"(?:\s|#[^\n]*(?:\n|$))*")
MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")
"""The memory kinds an offload may name (JAX's ``Offloadable`` src and dst)."""


def _shown(p: Any) -> str:
    text = repr(p)
    return text if len(text) <= 80 else text[:77] + "..."


def _as_text(p: Any, what: str) -> str:
    """`p` as one pattern string whose flags (a compiled pattern's, or leading global
    inline flags) are scoped to it, so it can be joined with others unchanged."""
    if isinstance(p, re.Pattern):
        if not isinstance(p.pattern, str):
            raise TypeError(f"{what} pattern {_shown(p.pattern)} is a bytes pattern; tags are "
                            "str, so give a str pattern (e.g. decoded)")
        pattern, flags = p.pattern, p.flags
        if flags & ~_WRITABLE:
            raise ValueError(f"{what} pattern {_shown(pattern)} uses regex flags that cannot "
                             "be written inline; valid: re.I, re.M, re.S, re.X, re.A, re.U")
    elif isinstance(p, str):
        pattern = p
        try:
            flags = re.compile(p).flags
        except re.error as err:
            raise ValueError(f"invalid regex {_shown(p)} in {what} patterns: {err}") from None
        except (RecursionError, OverflowError):
            raise ValueError(f"regex {_shown(p)} in {what} patterns is too large or nests "
                             "too deeply") from None
    else:
        kind = "bytes" if isinstance(p, (bytes, bytearray, memoryview)) else type(p).__name__
        raise TypeError(f"a {what} pattern must be a str or a compiled str pattern "
                        f"(re.Pattern[str]); got {kind}: {_shown(p)}")
    letters = "".join(c for f, c in _INLINE if flags & f)
    if not letters and not pattern.startswith("(?"):
        return pattern
    # Take the leading global flags off (they may be several, and under verbose be
    # separated by blanks and comments), then scope every flag in force to the body.
    body, verbose = pattern, bool(flags & re.VERBOSE)
    while True:
        if verbose:
            body = body[_VERBOSE_GAP.match(body).end():]
        m = _LEADING_FLAGS.match(body)
        if m is None:
            break
        body = body[m.end():]
    text = _scoped(letters, body) if letters else body
    try:
        ok = (re.compile(text).flags & ~re.UNICODE) == 0
    except re.error:
        ok = False
    if not ok:
        raise ValueError(f"{what} pattern {_shown(pattern)}: its flags ({letters}) cannot be "
                         "scoped to it; put global flags such as (?i) at its very start")
    return text


def _scoped(letters: str, body: str) -> str:
    """`body` under inline flags scoped to it; a verbose body's trailing comment ends at
    the newline, before the closing parenthesis."""
    return f"(?{letters}:{body}\n)" if "x" in letters else f"(?{letters}:{body})"


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
    if re.search(r"\\\d|\(\?P=|\(\?\(", pattern):
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
    """The patterns as strings, each flag scoped to its own pattern, split at top-level
    alternatives, without repeats; in the order given, or sorted when given unordered."""
    if patterns is None:
        return ()
    if isinstance(patterns, (str, re.Pattern, bytes, bytearray, memoryview)):
        items = [patterns]
    elif isinstance(patterns, Mapping) or not isinstance(
            patterns, (Sequence, set, frozenset, Iterable)):
        raise TypeError(f"{what} patterns must be a str, a compiled pattern, or a list of "
                        f"them; got {type(patterns).__name__}: {_shown(patterns)}")
    else:
        items = list(patterns)
    out: list[str] = []
    for item in items:
        text = _as_text(item, what)
        if text == "" or re.fullmatch(r"\(\?[aiLmsux]+:\n?\)", text):
            raise ValueError(f"an empty {what} pattern ({_shown(item)}) matches only an "
                             "empty tag; leave it out")
        for part in _alternatives(text):
            if part not in out:
                out.append(part)
    if isinstance(patterns, (set, frozenset)):
        out.sort()  # a set's iteration order differs between processes; fix one
    return tuple(out)


def _matchers(patterns: tuple[str, ...], what: str) -> tuple[_regex.SafePattern, ...]:
    out = []
    for p in patterns:
        try:
            out.append(_regex.SafePattern(p))
        except _regex.PatternError as err:
            raise _regex.PatternError(f"{err} (in the {what} patterns)") from None
    return tuple(out)


def _matches_everything(matchers: Sequence[_regex.SafePattern]) -> bool:
    return all(any(m.fullmatch(s) for m in matchers) for s in _PROBES)


# The policy base JAX's new remat (jax_remat3) recognises; JAX < 0.9 has no such class
# (and no remat3), so there any base will do.
_NamesBase: type = _jax_compat.policy_class("SaveOnlyTheseNames") or object


class _RegexNames:
    """The ``saveable_names`` JAX's remat3 consults: ``name in`` it is the policy's save
    decision for that tag. It cannot be iterated: the set a regex names is open."""

    __slots__ = ("_saves",)

    def __init__(self, saves: Callable[[str], bool]) -> None:
        self._saves = saves

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._saves(name)

    def __repr__(self) -> str:
        return "<tags the save patterns fully match>"


@dataclass(frozen=True, eq=False)
class NamesPolicy(_NamesBase):
    """Base of policy objects both JAX remat implementations honour: a subclass decides
    per ``checkpoint_name`` tag in `saves` (and may decide more in ``__call__``, which the
    original implementation calls); JAX's new remat (``jax_remat3``) asks
    ``name in policy.saveable_names``, which answers with `saves`. Compared by identity
    unless a subclass says otherwise."""

    saveable_names: Any = field(default=None, init=False, repr=False, compare=False)

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __post_init__(self) -> None:
        object.__setattr__(self, "saveable_names", _RegexNames(self.saves))

    def saves(self, name: str) -> bool:
        """Whether the tag `name` is kept in device memory for the backward."""
        return self(name_p, name=name) in (Saveable, True)

    def __call__(self, prim: Any, *args: Any, **params: Any) -> Any:
        raise NotImplementedError


_DotsBase = _jax_compat.policy_class("DotsSaveable")  # JAX >= 0.9


@dataclass(frozen=True, eq=False)
class ResolvingPolicy(NamesPolicy, *((_DotsBase,) if _DotsBase is not None else ())):
    """A `NamesPolicy` whose answers are only known when JAX traces (an adapter's policy,
    resolved on first use). JAX's new remat asks it about tags (``saveable_names``) and,
    being a ``DotsSaveable`` too, about matmuls, so a resolved ``dots_saveable`` keeps its
    dots under both implementations. `answer` turns a decision into what both accept."""

    only_if_no_batch_dims: bool = field(default=False, init=False, repr=False, compare=False)

    @staticmethod
    def answer(decision: Any) -> Any:
        """`decision` as a bool where it is one (remat3's matmul rule reads truthiness,
        and JAX's ``Recompute`` is truthy); offload decisions pass through."""
        if decision is Saveable:
            return True
        if decision is Recompute or decision is None:
            return False
        return decision


@dataclass(frozen=True)
class RegexPolicy(NamesPolicy):
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
        for name, value in (("allow_everything", allow_everything),
                            ("allow_offload_on_neuron", allow_offload_on_neuron)):
            if not isinstance(value, bool):
                raise TypeError(f"RegexPolicy: {name} must be True or False; got "
                                f"{type(value).__name__}: {_shown(value)}")
        for name, value in (("offload_src", offload_src), ("offload_dst", offload_dst)):
            if value is not None and value not in MEMORY_KINDS:
                raise ValueError(f"RegexPolicy: {name}={_shown(value)} is not a memory kind; "
                                 f"valid: {', '.join(map(repr, MEMORY_KINDS))}")
        if offload_src is not None and offload_src == offload_dst:
            raise ValueError(f"RegexPolicy: offload_src and offload_dst are the same "
                             f"({offload_src!r}), so nothing would move; valid: 'device' to "
                             "'pinned_host' (or back)")
        set_ = functools.partial(object.__setattr__, self)
        set_("save", _normalise(save, "save"))
        set_("offload", _normalise(offload, "offload"))
        set_("offload_src", offload_src)
        set_("offload_dst", offload_dst)
        set_("allow_everything", allow_everything)
        set_("allow_offload_on_neuron", allow_offload_on_neuron)
        self.__post_init__()

    # Equal as sets: the order of the patterns never changes a decision (save wins over
    # offload whatever the order), so it does not change equality, the hash, or the
    # fingerprint processes of a multi-host job compare (`canonical`).

    def canonical(self) -> tuple[Any, ...]:
        """What the policy decides by, in an order-free, process-independent form:
        (sorted save patterns, sorted offload patterns, offload_src, offload_dst)."""
        return (tuple(sorted(set(self.save))), tuple(sorted(set(self.offload))),
                self.offload_src, self.offload_dst)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RegexPolicy):
            return NotImplemented
        return self.canonical() == other.canonical()

    def __hash__(self) -> int:
        return hash(("RegexPolicy", self.canonical()))

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("_save_rx", _matchers(self.save, "save"))
        set_("_offload_rx", _matchers(self.offload, "offload"))
        set_("_decisions", {})
        super().__post_init__()
        if not self.allow_everything:
            for what, pats, rx in (("save", self.save, self._save_rx),
                                   ("offload", self.offload, self._offload_rx)):
                if not rx:
                    continue
                culprit = next((m.pattern for m in rx if _matches_everything([m])), None)
                if culprit is not None or _matches_everything(rx):
                    shown = repr(culprit) if culprit is not None else f"{what} patterns {pats}"
                    raise ValueError(
                        f"{shown} matches every tag, so the policy would {what} everything; "
                        "name the tags, or pass allow_everything=True")
        if self.offload and (not self.offload_src or not self.offload_dst):
            raise ValueError(
                f"offload patterns {list(self.offload)} need offload_src and offload_dst "
                f"(valid: {', '.join(map(repr, MEMORY_KINDS))}, e.g. 'device' and "
                f"'pinned_host'); got offload_src={self.offload_src!r}, "
                f"offload_dst={self.offload_dst!r}")
        if self.offload and not self.allow_offload_on_neuron and looks_like_neuron():
            raise ValueError(
                f"offload patterns {list(self.offload)} on a Neuron device: the Neuron "
                "compiler does not document host offload; save or recompute instead, or "
                "pass allow_offload_on_neuron=True (neuron-remat audit: "
                "--allow-offload-on-neuron) to try it")

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
        if any(m.fullmatch(name) for m in self._save_rx):  # type: ignore[attr-defined]
            return Saveable
        if any(m.fullmatch(name) for m in self._offload_rx):  # type: ignore[attr-defined]
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
        return tuple((kind, m.pattern) for kind, ms in (("save", self._save_rx),  # type: ignore[attr-defined]
                                                         ("offload", self._offload_rx))  # type: ignore[attr-defined]
                     for m in ms if m.fullmatch(tag))

    def dead_patterns(self, names: Iterable[str]) -> tuple[str, ...]:
        """The save and offload patterns that fully match none of `names` (the tags a
        function or host emits): they would keep nothing. Linear-time matching (`_regex`);
        the one check audit, the planner and the plugin share."""
        live = {p for n in set(names) for _, p in self.matching(n)}
        return tuple(p for p in (*self.save, *self.offload) if p not in live)

    @property
    def save_regex(self) -> str | None:
        """The save patterns as one regex string (what axlearn's
        ``names_which_can_be_saved`` takes): a lone pattern as it is, several joined
        with their group numbers and names rewritten so none changes meaning."""
        return _joined(self.save)

    @property
    def offload_regex(self) -> str | None:
        return _joined(self.offload)

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
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "saveable_names"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        self.__post_init__()


def _joined(patterns: tuple[str, ...]) -> str | None:
    if not patterns:
        return None
    return patterns[0] if len(patterns) == 1 else _regex.join(patterns)


def active_remat() -> str:
    """``"remat3"`` when JAX's new remat implementation is on (``jax_remat3``, JAX >= 0.10),
    else ``"remat2"`` (``jax.checkpoint``'s original implementation)."""
    return "remat3" if _jax_compat.remat3_on() else "remat2"


_WARNED: set[tuple[str, str]] = set()
_WARN_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def remat3_asks_any_policy() -> bool:
    """Whether this JAX's new remat (``jax_remat3``) asks any callable policy about tags and
    matmuls and honours its ``Offloadable`` answers, as JAX 0.12 does. JAX 0.10's remat3
    honours only JAX's own policy types and never offloads. Read from the signature of the
    tag primitive's remat rule (0.12 passes the trace, whose policy it calls; 0.10 passes the
    policy, whose type it inspects); nothing is traced."""
    params = _jax_compat.remat3_rule_params()
    return len(params) > 1 and params[1] == "trace"


def remat3_ignores_closures() -> bool:
    """Whether the active remat would treat a plain policy closure (axlearn's
    ``save_and_offload_only_these_names_regex``) as full remat: ``jax_remat3`` on a JAX whose
    remat3 honours only its own policy types."""
    return active_remat() == "remat3" and not remat3_asks_any_policy()


def _honoured_by_remat3(policy: Any) -> bool:
    kinds = tuple(k for k in map(_jax_compat.policy_class, ("SaveOnlyTheseNames",
                                                             "SaveAnyNamesButThese",
                                                             "DotsSaveable")) if k is not None)
    return (policy is None or policy is _jax_compat.everything_saveable
            or policy is _jax_compat.nothing_saveable or isinstance(policy, kinds))


def warn_if_ignored(policy: Any, where: str = "jax.checkpoint", *,
                    names_only: bool = False) -> str | None:
    """Log a warning, once per kind of policy, when the active remat implementation would
    not honour `policy`, and return its text (None when it would be honoured).

    Under ``jax_remat3`` JAX honours only its own policy types: any other callable
    (``dots_saveable``, a closure such as axlearn's regex policy, ...) becomes full remat,
    and an offload decision becomes recompute, silently. Adapters call this where they
    hand a policy to JAX; `where` names that place in the message. With `names_only`,
    `policy` reaches JAX inside a `NamesPolicy` wrapper, so its decisions on tags are kept
    and only what else it saves is lost.
    """
    if active_remat() != "remat3" or remat3_asks_any_policy():
        return None
    if isinstance(policy, NamesPolicy) and not isinstance(policy, RegexPolicy):
        return None
    if isinstance(policy, RegexPolicy):
        if not policy.offload:
            return None
        key = ("offload", "RegexPolicy")
        text = (f"{where}: jax_remat3 is on and JAX's new remat has no offload; the tags "
                f"{list(policy.offload)} would offload to {policy.offload_dst!r} are "
                "recomputed instead. Turn jax_remat3 off (JAX_REMAT3=false) to offload, or "
                "save those tags.")
    elif _honoured_by_remat3(policy):
        return None
    elif names_only:
        kind = getattr(policy, "__qualname__", None) or type(policy).__qualname__
        key = ("names-only", f"{getattr(policy, '__module__', '')}.{kind}")
        text = (f"{where}: jax_remat3 is on and JAX's new remat only saves checkpoint_name "
                f"tags; the policy {kind} ({policy!r:.80}) keeps its decisions on tags, but "
                "anything else it would save (dots, other primitives) is recomputed. Name "
                "the values with checkpoint_name and save them by name, or turn jax_remat3 "
                "off (JAX_REMAT3=false).")
    else:
        kind = getattr(policy, "__qualname__", None) or type(policy).__qualname__
        key = ("ignored", f"{getattr(policy, '__module__', '')}.{kind}")
        text = (f"{where}: jax_remat3 is on and JAX's new remat honours only its own policy "
                f"types (save_only_these_names, save_any_names_but_these, dots_saveable, "
                f"everything_saveable); the policy {kind} ({policy!r:.80}) is ignored and "
                "every value is recomputed (full remat). Use neuron_remat.RegexPolicy or "
                "neuron_remat.policies.save_and_offload_only_these_names_regex (honoured by "
                "both implementations), or turn jax_remat3 off (JAX_REMAT3=false).")
    with _WARN_LOCK:
        first = key not in _WARNED
        _WARNED.add(key)
    if first:
        logger.warning("%s", text)
    return text


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
