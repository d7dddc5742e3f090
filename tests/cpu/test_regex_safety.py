"""RegexPolicy's patterns: linear-time matching, refusals, joining, and (hypothesis) the
same decisions as ``any(re.fullmatch(p, tag) for p in patterns)``."""

import json
import re
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from neuron_remat import _regex
from neuron_remat import policies as pol
from neuron_remat.cli import main

# --- catastrophic backtracking ----------------------------------------------------------


def test_nested_repeat_is_matched_in_linear_time():
    # re.fullmatch("(.+)+b", "x" * 30) runs for minutes; the policy answers at once. Run
    # in a subprocess with a timeout, so a regression fails instead of hanging the suite.
    code = textwrap.dedent("""
        import time
        from neuron_remat.policies import RegexPolicy
        p = RegexPolicy(["(.+)+b", "(a*)*c", "(x|x)*y"])
        t = time.perf_counter()
        out = [p.action("x" * n) for n in (30, 300, 3000)]
        out += [p.action("x" * 29 + "b"), p.action("a" * 40 + "c"), p.action("x" * 50 + "y")]
        print(out, time.perf_counter() - t)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    actions, seconds = run.stdout.rsplit("]", 1)
    assert actions + "]" == str(["recompute"] * 3 + ["save"] * 3)
    assert float(seconds) < 5


@pytest.mark.parametrize("pattern", [r"(a+)+\1", r"(?=(x+)+y).*", r"(a|ab)*(?!c)",
                                     r"(.)\1.*.*.*"])
def test_backtracking_only_patterns_with_unbounded_work_are_refused(pattern):
    # Back-references and look-arounds need re's backtracking; with nested, alternated or
    # many repeats that can take exponential time, so the pattern is refused, by name.
    with pytest.raises(ValueError, match=re.escape(repr(pattern))) as err:
        pol.RegexPolicy([pattern])
    assert "exponential" in str(err.value) and "save patterns" in str(err.value)


@pytest.mark.parametrize("pattern, tag, action", [
    (r"(a)\1", "aa", "save"), (r"(a)\1", "ab", "recompute"),
    (r"(?=.*proj)q.*", "q_proj", "save"), (r"(?!x).*_proj", "x_proj", "recompute"),
    (r"(?P<c>[a-z])x(?P=c)", "axa", "save")])
def test_bounded_backtracking_patterns_are_accepted_and_exact(pattern, tag, action):
    assert pol.RegexPolicy([pattern]).action(tag) == action


def test_huge_counted_repeat_is_refused_not_unrolled():
    with pytest.raises(ValueError, match="NFA states"):
        pol.RegexPolicy(["(ab){3000}(cd){3000}x{9000}"])
    # among several patterns, the error names the one at fault
    with pytest.raises(ValueError, match=r"regex 'a\{100000\}': it makes more than"):
        pol.RegexPolicy(["q_proj", "a{100000}"])


# --- joining patterns --------------------------------------------------------------------


def test_group_references_keep_their_meaning_across_patterns():
    policy = pol.RegexPolicy(["(b)c", "(a)\\1"])
    assert policy.action("aa") == "save" and policy.action("bc") == "save"
    assert policy.action("ab") == "recompute"
    joined = policy.save_regex
    assert [bool(re.fullmatch(joined, t)) for t in ("aa", "bc", "ab", "bb")] == \
        [True, True, False, False]


def test_numbered_and_named_conditionals_and_octal_escapes_are_rewritten_right():
    patterns = ["(x)(y)?(?(2)z|w)", "(?P<q>p)?(?(q)1|2)(?P=q)?\\1?", "[\\1]\\101"]
    policy = pol.RegexPolicy(patterns)
    for tag in ("xyz", "xw", "xz", "p1p", "p1pp", "2", "\x01A", "1A", "p1"):
        want = any(re.fullmatch(p, tag) for p in patterns)
        assert (policy.action(tag) == "save") == want, tag
        assert bool(re.fullmatch(policy.save_regex, tag)) == want, tag


def test_verbose_pattern_with_a_trailing_comment_is_accepted():
    policy = pol.RegexPolicy(["(?x)a#c", "b"])
    assert policy.action("a") == "save" and policy.action("b") == "save"
    assert policy.action("a#c") == "recompute"
    assert re.fullmatch(policy.save_regex, "a") and re.fullmatch(policy.save_regex, "b")
    compiled = re.compile(r"q  _proj  # the query projection", re.VERBOSE)
    assert pol.RegexPolicy([compiled, "k_proj"]).action("q_proj") == "save"


def test_duplicate_group_names_across_patterns_are_fine():
    policy = pol.RegexPolicy(["(?P<n>a)", "(?P<n>b)(?P=n)"])
    assert [policy.action(t) for t in ("a", "bb", "b")] == ["save", "save", "recompute"]
    assert re.fullmatch(policy.save_regex, "bb") and not re.fullmatch(policy.save_regex, "ab")


def test_cli_audit_with_duplicate_group_names_does_not_raise(tmp_path, monkeypatch, capsys):
    (tmp_path / "dupmod.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp
        from jax.ad_checkpoint import checkpoint_name

        def make():
            def f(x):
                return jnp.sum(jnp.sin(checkpoint_name(jnp.sin(x), "a"))
                               * checkpoint_name(x * 2, "bb"))
            return f, (jnp.ones((4,)),)
    """))
    monkeypatch.chdir(tmp_path)
    assert main(["audit", "dupmod:make", "--save", "(?P<n>a)", "(?P<n>b)(?P=n)",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {t["name"]: t["action"] for t in data["tags"]} == {"a": "save", "bb": "save"}
    assert data["dead_patterns"] == []


# --- the property: RegexPolicy decides as re.fullmatch does ------------------------------

_ATOMS = ["a", "b", "_", r"\.", ".", "[ab]", "[^a]", r"\w", r"\d", r"\s", "[a-c_]", "A"]


@st.composite
def _regexes(draw, depth=0):
    """Small regexes over a tiny alphabet, with the constructs tag patterns use and the
    ones that make joining or matching hard (groups, references, look-arounds, flags)."""
    kind = draw(st.sampled_from(
        ["atom"] * 4 + (["seq", "alt", "group", "repeat", "repeat"] if depth < 3 else [])
        + ["anchor", "ref", "look", "named"]))
    if kind == "atom":
        return draw(st.sampled_from(_ATOMS))
    if kind == "anchor":
        return draw(st.sampled_from(["^", "$", r"\b", r"\B", r"\A", r"\Z"]))
    if kind == "seq":
        return "".join(draw(st.lists(_regexes(depth + 1), min_size=2, max_size=3)))
    if kind == "alt":
        return "|".join(draw(st.lists(_regexes(depth + 1), min_size=2, max_size=3)))
    if kind == "group":
        return draw(st.sampled_from(["(", "(?:", "(?i:", "(?s:"])) + draw(
            _regexes(depth + 1)) + ")"
    if kind == "repeat":
        inner = draw(_regexes(depth + 1))
        q = draw(st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,2}", "*?", "+?"]))
        return f"(?:{inner}){q}"
    if kind == "ref":
        return draw(st.sampled_from(["(a)\\1", "([ab])\\1", "(?P<g>b)(?P=g)", "(_)?(?(1)a|b)"]))
    if kind == "named":
        return "(?P<n>" + draw(_regexes(depth + 1)) + ")"
    return draw(st.sampled_from(["(?=a)", "(?!b)", "(?<=a)", "(?<!_)"]))


_GLOBAL_FLAGS = st.sampled_from(["", "", "", "(?i)", "(?x)", "(?s)", "(?a)"])
_TAGS = st.text(alphabet="ab_.A1 \n", max_size=7)


def _valid(p):
    try:
        re.compile(p)
    except re.error:
        return False
    return True


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.filter_too_much])
@given(st.lists(st.tuples(_GLOBAL_FLAGS, _regexes()).map("".join).filter(_valid),
                min_size=1, max_size=3),
       st.lists(_TAGS, min_size=1, max_size=6))
def test_decision_equals_any_fullmatch(patterns, tags):
    try:
        policy = pol.RegexPolicy(patterns, allow_everything=True)
    except ValueError as err:
        # The only refusals: re's backtracking with unbounded work, or a too-large NFA.
        assert "exponential" in str(err) or "NFA states" in str(err), err
        assume(False)
    joined = policy.save_regex
    for tag in tags:
        want = any(re.fullmatch(p, tag) for p in patterns)
        assert (policy.action(tag) == "save") == want, (patterns, tag)
        assert bool(re.fullmatch(joined, tag)) == want, (patterns, joined, tag)


@settings(max_examples=300, deadline=None)
@given(st.tuples(_GLOBAL_FLAGS, _regexes()).map("".join).filter(_valid), _TAGS)
def test_safe_pattern_agrees_with_re(pattern, tag):
    try:
        safe = _regex.SafePattern(pattern)
    except _regex.PatternError:
        assume(False)
    assert safe.fullmatch(tag) == bool(re.fullmatch(pattern, tag))


def test_the_one_dead_pattern_check_is_linear_time_and_agrees_with_re():
    # audit, the planner and the plugin share RegexPolicy.dead_patterns: against tags that
    # make re.fullmatch("(.+)+b", ...) backtrack for minutes, each answers at once.
    code = textwrap.dedent("""
        from neuron_remat import planner, plugin
        from neuron_remat.policies import RegexPolicy
        p = RegexPolicy(["(.+)+b", "q_proj", "(x|x)*y"])
        names = ["x" * 3000, "q_proj"]
        assert p.dead_patterns(names) == ("(.+)+b", "(x|x)*y"), p.dead_patterns(names)
        assert planner.dead_patterns(p, names) == ["(.+)+b", "(x|x)*y"]
        try:
            plugin._check_names(p, names)
        except ValueError as err:
            assert "(.+)+b" in str(err)
        else:
            raise AssertionError("the plugin accepted dead patterns")
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    # Against re on tags short enough for it.
    p = pol.RegexPolicy(["a.*", "b+", "c"], ["d|e"], offload_src="device",
                        offload_dst="pinned_host")
    for names in (["a1", "bb"], ["c", "e"], [], ["abc", "d"]):
        expected = tuple(q for q in (*p.save, *p.offload)  # "d|e" is held as "d", "e"
                         if not any(re.fullmatch(q, n) for n in names))
        assert p.dead_patterns(names) == expected, names
