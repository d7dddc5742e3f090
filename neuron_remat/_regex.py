"""Tag patterns that cannot hang: `SafePattern` fullmatches in time linear in the tag's
length, and `join` writes several patterns as one regex without changing what any of them
means.

Python's ``re`` backtracks: ``(.+)+b`` against thirty ``x`` never finishes. A `SafePattern`
uses ``re``'s own parser, then runs the parsed pattern as a Thompson NFA (every state
advanced in lock step, O(tag length x pattern size)). Single characters and anchors are
still tested by ``re`` itself (each one compiled alone, with the flags in force there), so
case folding, ``\\w``, ``\\b`` and ``$`` mean exactly what they mean to ``re``. Constructs no
NFA can run (back-references, look-arounds, conditionals, atomic groups, possessive
repeats) are left to ``re``, but only in patterns whose backtracking is bounded (no nested
or alternated repetition, at most two repeats); others are refused with a `PatternError`.

The parse tree comes from CPython's private ``re._parser`` (``sre_parse`` on 3.10): no
public API gives it, and a linear-time matcher needs it. Its behaviour is pinned by the
differential tests in ``tests/cpu/test_hardening_regex.py`` (generated patterns with inline
and compiled flags, empty and zero-width repeats, empty alternatives, Unicode classes and
case folding, decided here and by ``re.fullmatch``), run on Python 3.11.7 and 3.12.1; run
them before trusting a newer Python.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

try:  # Python >= 3.11
    from re import _compiler as _sre_compile  # type: ignore[attr-defined]
    from re import _constants as _sre_c  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_compile as _sre_compile  # type: ignore[no-redef]
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

__all__ = ["PatternError", "SafePattern", "join"]

MAX_STATES = 20_000
"""The largest NFA a pattern may make (counted repeats are unrolled: ``a{5000}`` is 5000)."""

_CHAR = {_sre_c.LITERAL, _sre_c.NOT_LITERAL, _sre_c.ANY, _sre_c.IN}
_REPEAT = {_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT}
# Constructs an NFA cannot run; re runs them (in patterns whose backtracking is bounded).
_BACKTRACKING = {getattr(_sre_c, n) for n in (
    "GROUPREF", "GROUPREF_EXISTS", "GROUPREF_IGNORE", "GROUPREF_LOC_IGNORE",
    "GROUPREF_UNI_IGNORE", "ASSERT", "ASSERT_NOT", "ATOMIC_GROUP", "POSSESSIVE_REPEAT")
    if hasattr(_sre_c, n)}


_TYPE_FLAGS = re.ASCII | re.LOCALE | re.UNICODE


def _combine_flags(flags: int, add: int, remove: int) -> int:
    """The flags in force inside a scoped ``(?add-remove:...)`` group, as re's compiler
    combines them: a character-type flag added (``a``, ``u``) replaces the one in force."""
    if add & _TYPE_FLAGS:
        flags &= ~_TYPE_FLAGS
    return (flags | add) & ~remove


class PatternError(ValueError):
    """A pattern that is invalid, too large, or could take exponential time."""


class _NeedsBacktracking(Exception):
    pass


def _alone(node: tuple[Any, Any], flags: int) -> re.Pattern[str]:
    """`node` compiled by itself under `flags` (the flags in force where it stands)."""
    state = _sre_parse.State()
    state.flags = flags
    return _sre_compile.compile(_sre_parse.SubPattern(state, [node]), flags)


_ALONE: dict[tuple[str, int], re.Pattern[str]] = {}  # compiled single nodes, shared


class _Program:
    """A Thompson NFA: ("char", test, next), ("at", test, next), ("split", a, b),
    ("jump", a) and ("match",)."""

    def __init__(self) -> None:
        self.code: list[list[Any]] = []
        self.tests: list[re.Pattern[str]] = []
        self._tests: dict[tuple[str, int], int] = {}

    def emit(self, *op: Any) -> int:
        if len(self.code) >= MAX_STATES:
            raise PatternError(f"it makes more than {MAX_STATES} NFA states (a large "
                               "counted repeat?); write it shorter")
        self.code.append(list(op))
        return len(self.code) - 1

    def test(self, node: tuple[Any, Any], flags: int) -> int:
        key = (repr(node), flags)
        if key not in self._tests:
            self._tests[key] = len(self.tests)
            compiled = _ALONE.get(key)
            if compiled is None:
                compiled = _ALONE[key] = _alone(node, flags)
            self.tests.append(compiled)
        return self._tests[key]

    def patch(self, holes: list[tuple[int, int]], target: int) -> None:
        for pc, slot in holes:
            self.code[pc][slot] = target

    def sequence(self, items: Sequence[tuple[Any, Any]], flags: int
                 ) -> list[tuple[int, int]]:
        """Emit `items` in order; returns the dangling exits (patched by the caller)."""
        if not items:  # the empty pattern (e.g. a branch's empty alternative)
            return [(self.emit("jump", None), 1)]
        holes: list[tuple[int, int]] = []
        for item in items:
            start = len(self.code)
            new = self.item(item, flags)
            self.patch(holes, start)
            holes = new
        return holes

    def item(self, node: tuple[Any, Any], flags: int) -> list[tuple[int, int]]:
        op, av = node
        if op in _CHAR:
            return [(self.emit("char", self.test(node, flags), None), 2)]
        if op is _sre_c.AT:
            return [(self.emit("at", self.test(node, flags), None), 2)]
        if op is _sre_c.SUBPATTERN:
            _group, add, remove, sub = av
            return self.sequence(sub, _combine_flags(flags, add, remove))
        if op is _sre_c.BRANCH:
            holes: list[tuple[int, int]] = []
            alternatives = av[1]
            for i, alt in enumerate(alternatives):
                if i < len(alternatives) - 1:
                    split = self.emit("split", len(self.code) + 1, None)
                    holes += self.sequence(alt, flags)
                    self.code[split][2] = len(self.code)
                else:
                    holes += self.sequence(alt, flags)
            return holes
        if op in _REPEAT:
            lo, hi, sub = av
            if hi is not _sre_c.MAXREPEAT and hi == 0:  # x{0}: matches the empty string
                return self.sequence([], flags)
            holes = []
            for _ in range(lo):
                start = len(self.code)
                self.patch(holes, start)
                holes = self.sequence(sub, flags)
            if hi is _sre_c.MAXREPEAT:
                loop = self.emit("split", None, None)
                self.patch(holes, loop)
                self.code[loop][1] = len(self.code)
                body = self.sequence(sub, flags)
                self.patch(body, loop)
                return [(loop, 2)]
            exits: list[tuple[int, int]] = []
            for _ in range(hi - lo):
                split = self.emit("split", None, None)
                self.patch(holes, split)
                self.code[split][1] = len(self.code)
                exits.append((split, 2))
                holes = self.sequence(sub, flags)
            return exits + holes
        raise _NeedsBacktracking(op)

    def fullmatch(self, text: str) -> bool:
        code, tests = self.code, self.tests
        cache: dict[tuple[int, str], bool] = {}

        def closure(starts: list[int], pos: int) -> list[int]:
            seen: set[int] = set()
            out: list[int] = []
            stack = list(reversed(starts))
            while stack:
                pc = stack.pop()
                if pc in seen:
                    continue
                seen.add(pc)
                op = code[pc]
                kind = op[0]
                if kind == "jump":
                    stack.append(op[1])
                elif kind == "split":
                    stack.append(op[2])
                    stack.append(op[1])
                elif kind == "at":
                    if tests[op[1]].match(text, pos) is not None:
                        stack.append(op[2])
                else:
                    out.append(pc)
            return out

        current = closure([0], 0)
        for pos, ch in enumerate(text):
            step = []
            for pc in current:
                op = code[pc]
                if op[0] != "char":
                    continue
                key = (op[1], ch)
                ok = cache.get(key)
                if ok is None:
                    ok = cache[key] = tests[op[1]].fullmatch(ch) is not None
                if ok:
                    step.append(op[2])
            if not step:
                return False
            current = closure(step, pos + 1)
        return any(code[pc][0] == "match" for pc in current)


def _bounded_backtracking(items: Sequence[tuple[Any, Any]]) -> str | None:
    """Why re could backtrack without bound on `items`, or None when it cannot: every
    repeat is over one character (no nesting, no alternatives) and there are at most two."""
    repeats = 0

    def single_char(sub: Sequence[tuple[Any, Any]]) -> bool:
        while len(sub) == 1 and sub[0][0] is _sre_c.SUBPATTERN:
            sub = sub[0][1][3]
        return len(sub) == 1 and sub[0][0] in _CHAR

    def walk(seq: Sequence[tuple[Any, Any]]) -> str | None:
        nonlocal repeats
        for op, av in seq:
            subs: list[Sequence[tuple[Any, Any]]] = []
            if op in _REPEAT or op is getattr(_sre_c, "POSSESSIVE_REPEAT", None):
                lo, hi, sub = av
                if hi is _sre_c.MAXREPEAT or hi > 1:
                    if not single_char(sub):
                        return "a repeated group or alternation"
                    repeats += 1
                subs = [sub]
            elif op is _sre_c.SUBPATTERN:
                subs = [av[3]]
            elif op is _sre_c.BRANCH:
                subs = list(av[1])
            elif op in (_sre_c.ASSERT, _sre_c.ASSERT_NOT):
                subs = [av[1]]
            elif op is getattr(_sre_c, "ATOMIC_GROUP", None):
                subs = [av]
            elif op is _sre_c.GROUPREF_EXISTS:
                subs = [s for s in av[1:] if s is not None]
            for sub in subs:
                why = walk(sub)
                if why:
                    return why
        if repeats > 2:
            return "more than two repeats"
        return None

    return walk(items)


class SafePattern:
    """One tag pattern, fullmatched without catastrophic backtracking.

    Raises `PatternError` when the pattern is invalid, would make more than `MAX_STATES`
    NFA states, or needs ``re``'s backtracking (a back-reference, look-around,
    conditional, atomic group or possessive repeat) together with nested, alternated or
    more than two repeats.
    """

    __slots__ = ("pattern", "_fullmatch", "groups", "groupnames")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        try:
            compiled = re.compile(pattern)
            parsed = _sre_parse.parse(pattern, 0)
        except re.error as err:
            raise PatternError(f"invalid regex {pattern!r}: {err}") from None
        except RecursionError:
            raise PatternError(f"regex {pattern!r} nests too deeply") from None
        self.groups = compiled.groups
        self.groupnames = dict(compiled.groupindex)
        program = _Program()
        try:
            holes = program.sequence(list(parsed), parsed.state.flags)
            program.patch(holes, program.emit("match"))
        except PatternError as err:  # too many states: name the pattern
            raise PatternError(f"regex {pattern[:60]!r}{'...' if len(pattern) > 60 else ''}: "
                               f"{err}") from None
        except _NeedsBacktracking:
            why = _bounded_backtracking(list(parsed))
            if why is not None:
                raise PatternError(
                    f"regex {pattern!r} needs backtracking (a back-reference, look-around, "
                    f"conditional, atomic group or possessive repeat) and has {why}, so "
                    "matching it could take exponential time (or a high power of the tag's "
                    "length); drop the back-reference or "
                    "look-around, or simplify the repeats") from None
            self._fullmatch: Callable[[str], bool] = (
                lambda text, rx=compiled: rx.fullmatch(text) is not None)
        else:
            self._fullmatch = program.fullmatch

    def fullmatch(self, text: str) -> bool:
        """True when the whole of `text` matches (``re.fullmatch``'s answer)."""
        return self._fullmatch(text)

    def __repr__(self) -> str:
        return f"SafePattern({self.pattern!r})"


def _is_verbose(pattern: str) -> bool:
    try:
        return bool(re.compile(pattern).flags & re.VERBOSE)
    except re.error:
        return False


def _rewrite_refs(pattern: str, offset: int, rename: dict[str, str]) -> str:
    """`pattern` with group numbers shifted by `offset` and named groups renamed, in
    back-references (``\\N``, ``(?P=name)``) and conditionals (``(?(N)``, ``(?(name)``)."""
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            m = re.match(r"\\([1-9][0-9]?)(?![0-7])|\\([1-9][0-9]?)$", pattern[i:])
            octal = re.match(r"\\(0[0-7]{0,2}|[0-7]{3})", pattern[i:])
            if m and not in_class and not octal:
                num = int(m.group(1) or m.group(2))
                out.append(f"(?:\\{num + offset})")
                i += m.end()
                continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            out.append(c)
            i += 1
            if pattern[i:i + 1] == "^":
                out.append("^")
                i += 1
            if pattern[i:i + 1] == "]":
                out.append("]")
                i += 1
            continue
        m = (re.match(r"\(\?P<(\w+)>", pattern[i:]) or re.match(r"\(\?P=(\w+)\)", pattern[i:])
             or re.match(r"\(\?\((\w+)\)", pattern[i:]))
        if m:
            ref = m.group(1)
            new = str(int(ref) + offset) if ref.isdigit() else rename.get(ref, ref)
            text = m.group(0)
            out.append(text[:m.start(1)] + new + text[m.end(1):])
            i += m.end()
            continue
        out.append(c)
        i += 1
    return "".join(out)


def join(patterns: Sequence[str]) -> str:
    """One regex that fullmatches what any of `patterns` fullmatches.

    Group numbers and names are rewritten so that each pattern's back-references still
    point into that pattern (``(b)c`` and ``(a)\\1`` join as ``(b)c|(a)(?:\\2)``),
    a group name used by two patterns is renamed in the later one, and a verbose pattern's
    trailing comment cannot swallow the closing parenthesis.
    """
    parts: list[str] = []
    offset = 0
    names: set[str] = set()
    for k, p in enumerate(patterns):
        compiled = re.compile(p)
        rename: dict[str, str] = {}
        for name in compiled.groupindex:
            new = name
            while new in names:
                new = f"{new}_{k}"
            rename[name] = new
            names.add(new)
        text = _rewrite_refs(p, offset, rename) if compiled.groups else p
        if _is_verbose(p):
            parts.append(f"(?:{text}\n)")
        elif "|" in p:  # (conservatively) an alternation of its own
            parts.append(f"(?:{text})")
        else:
            parts.append(text)
        offset += compiled.groups
    joined = "|".join(parts)
    re.compile(joined)  # cannot fail for valid parts; fail loudly if it somehow does
    return joined
