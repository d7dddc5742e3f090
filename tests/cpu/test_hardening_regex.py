"""RegexPolicy decides exactly as ``re.fullmatch`` does, for every pattern it accepts
(hypothesis, differential against ``re`` itself): inline and compiled flags, empty and
zero-width quantifiers, alternations with empty branches, Unicode classes and Unicode
case folding. Patterns it does not accept are refused when the policy is built, in one
line. Unordered things are normalised (policies equal as sets of patterns are equal and
hash equal), and the offload memory kinds are checked.

These tests also pin the behaviour of CPython's private ``re._parser`` that `_regex` relies
on; they were run on Python 3.11 and 3.12."""

import re

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from neuron_remat import _regex
from neuron_remat import policies as pol

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.filter_too_much])

# Single characters, including non-ASCII ones whose case folding is special in re:
# 'ſ' (long s) and 'K' (Kelvin) fold to 's' and 'k', 'İ' and 'ı' are Turkish i's, 'ß', 'é'.
_ATOMS = ["a", "b", "s", "k", "_", r"\.", ".", "[ab]", "[^a]", r"\w", r"\W", r"\d", r"\s",
          "[a-c_]", "A", "S", "K", "é", "É", "ſ", "\u212a", "İ", "ı", "ß", "[à-ÿ]", r"\u00e9",
          r"[\w-]", r"[^\W\d]", "١", r"\N{LATIN SMALL LETTER E WITH ACUTE}", r"\x41",
          "[é-ſ]", "[.]", "[|]", "[]a]", "[^]a]", r"\|", r"\(", " ", "#"]
_ANCHORS = ["^", "$", r"\b", r"\B", r"\A", r"\Z"]
_QUANTIFIERS = ["*", "+", "?", "{2}", "{1,3}", "{0,2}", "*?", "+?", "??", "{0}", "{0,0}",
                "{,2}", "{1,}", "{0,1}?", "{3,3}"]
_FLAGS = ["i", "m", "s", "x", "a", "u"]


@st.composite
def regexes(draw, depth=0):
    """Small regexes over a tiny alphabet with the constructs that make matching hard."""
    kind = draw(st.sampled_from(
        ["atom"] * 4 + (["seq", "alt", "group", "repeat", "repeat", "scoped", "empty_alt"]
                        if depth < 3 else []) + ["anchor", "empty", "zero_width_repeat"]))
    if kind == "atom":
        return draw(st.sampled_from(_ATOMS))
    if kind == "anchor":
        return draw(st.sampled_from(_ANCHORS))
    if kind == "empty":
        return draw(st.sampled_from(["", "(?:)", "()", "(?#note)"]))
    if kind == "seq":
        return "".join(draw(st.lists(regexes(depth + 1), min_size=2, max_size=3)))
    if kind == "alt":
        return "|".join(draw(st.lists(regexes(depth + 1), min_size=2, max_size=3)))
    if kind == "empty_alt":  # an alternation with an empty branch, grouped or not
        inner = draw(regexes(depth + 1))
        form = draw(st.sampled_from(["{}|", "|{}", "(?:{}|)", "(|{})", "({}||b)"]))
        return form.format(inner)
    if kind == "group":
        return draw(st.sampled_from(["(", "(?:", "(?P<g{}>".format(depth)])) + draw(
            regexes(depth + 1)) + ")"
    if kind == "scoped":  # scoped inline flags, turned on or off
        on = "".join(draw(st.lists(st.sampled_from(["i", "m", "s", "x"]), max_size=2,
                                   unique=True)))
        off = "".join(draw(st.lists(st.sampled_from(["i", "m", "s", "x"]), max_size=2,
                                    unique=True)))
        off = "".join(c for c in off if c not in on)
        assume(on or off)
        letters = on + ("-" + off if off else "")
        return f"(?{letters}:" + draw(regexes(depth + 1)) + ")"
    if kind == "zero_width_repeat":  # quantified things that can match the empty string
        body = draw(st.sampled_from(["(?:)", "()", r"\b", "^", "$", "(?:a|)", "(?:|b)",
                                     "(?:a*)", "(?:a?b?)", r"(?:\B|a)"]))
        return body + draw(st.sampled_from(["*", "+", "?", "{2}", "{0,3}", "*?", "{1,}"]))
    inner = draw(regexes(depth + 1))
    return f"(?:{inner})" + draw(st.sampled_from(_QUANTIFIERS))


@st.composite
def global_flags(draw):
    letters = "".join(draw(st.lists(st.sampled_from(_FLAGS), max_size=3, unique=True)))
    if "a" in letters and "u" in letters:
        letters = letters.replace("u", "")
    return f"(?{letters})" if letters else ""


def compiled_flags():
    return st.lists(st.sampled_from([re.I, re.M, re.S, re.X, re.A, re.U]), max_size=3,
                    unique=True).map(lambda fs: sum(fs, 0))


TAGS = st.text(alphabet="abskAS_.1 \n#éÉſKİıß١|(", max_size=7)


def _compiles(pattern, flags=0):
    try:
        re.compile(pattern, flags)
    except (re.error, ValueError):
        return False
    return True


def _refusal_is_one_line(err):
    text = str(err)
    assert "\n" not in text.strip(), text
    return text


ACCEPTED_REFUSALS = ("exponential", "NFA states", "empty save pattern", "matches only an empty")


@settings(max_examples=300, **SETTINGS)
@given(flags=global_flags(), body=regexes(), tags=st.lists(TAGS, min_size=1, max_size=6))
@example(flags="", body="(?:)*", tags=["", "a"])
@example(flags="(?i)", body="ſ|\u212a", tags=["s", "S", "k", "K"])
@example(flags="", body="a|", tags=["", "a"])
@example(flags="(?x)", body="a #b|c", tags=["a", "c"])
@example(flags="", body="(?:$)+a", tags=["a"])
@example(flags="(?m)", body="a$\n?", tags=["a\n", "a"])
@example(flags="(?i)", body="(?:a){0}|a", tags=["", "a", "A"])
def test_a_string_pattern_decides_as_re_fullmatch(flags, body, tags):
    pattern = flags + body
    assume(_compiles(pattern))
    try:
        policy = pol.RegexPolicy(pattern, allow_everything=True)
    except ValueError as err:
        text = _refusal_is_one_line(err)
        assert any(w in text for w in ACCEPTED_REFUSALS), (pattern, text)
        assume(False)
    for tag in tags:
        want = re.fullmatch(pattern, tag) is not None
        assert (policy.action(tag) == "save") == want, (pattern, tag)
        if policy.save_regex is not None:
            assert (re.fullmatch(policy.save_regex, tag) is not None) == want, (
                pattern, policy.save_regex, tag)


@settings(max_examples=200, **SETTINGS)
@given(body=st.one_of(regexes(), st.tuples(global_flags(), regexes()).map("".join)),
       flags=compiled_flags(), tags=st.lists(TAGS, min_size=1, max_size=6))
@example(body="(?i)a", flags=re.M, tags=["A"])
@example(body="a # comment", flags=re.X, tags=["a"])
@example(body=r"\w", flags=re.A, tags=["é"])
@example(body="(?u)x", flags=0, tags=["x"])
def test_a_compiled_pattern_keeps_its_flags(body, flags, tags):
    assume(_compiles(body, flags))
    compiled = re.compile(body, flags)
    try:
        policy = pol.RegexPolicy([compiled], allow_everything=True)
    except ValueError as err:
        text = _refusal_is_one_line(err)
        assert any(w in text for w in ACCEPTED_REFUSALS + ("cannot be written inline",)), (
            body, flags, text)
        assume(False)
    for tag in tags:
        want = compiled.fullmatch(tag) is not None
        assert (policy.action(tag) == "save") == want, (body, flags, tag)


@settings(max_examples=150, **SETTINGS)
@given(patterns=st.lists(st.tuples(global_flags(), regexes()).map("".join)
                         .filter(_compiles), min_size=1, max_size=4),
       tags=st.lists(TAGS, min_size=1, max_size=6), data=st.data())
def test_several_patterns_decide_as_any_fullmatch_in_any_order(patterns, tags, data):
    try:
        policy = pol.RegexPolicy(patterns, allow_everything=True)
    except ValueError as err:
        assert any(w in _refusal_is_one_line(err) for w in ACCEPTED_REFUSALS), err
        assume(False)
    shuffled = data.draw(st.permutations(patterns))
    other = pol.RegexPolicy(shuffled, allow_everything=True)
    assert other == policy and hash(other) == hash(policy)
    assert pol.RegexPolicy(set(patterns), allow_everything=True) == policy
    for tag in tags:
        want = any(re.fullmatch(p, tag) for p in patterns)
        assert (policy.action(tag) == "save") == want, (patterns, tag)
        assert (re.fullmatch(policy.save_regex, tag) is not None) == want


@settings(max_examples=200, **SETTINGS)
@given(pattern=st.tuples(global_flags(), regexes()).map("".join).filter(_compiles),
       tag=TAGS)
def test_the_linear_time_matcher_agrees_with_re(pattern, tag):
    try:
        safe = _regex.SafePattern(pattern)
    except _regex.PatternError as err:
        assert "exponential" in str(err) or "NFA states" in str(err)
        assume(False)
    assert safe.fullmatch(tag) == (re.fullmatch(pattern, tag) is not None), (pattern, tag)


@settings(max_examples=300, **SETTINGS)
@given(text=st.text(alphabet="ab()[]|*+?{}\\^$.,-:=!<>PiI0123", max_size=12))
def test_any_text_is_a_policy_or_a_one_line_refusal(text):
    """Invalid regexes are refused when built, naming the pattern; valid ones decide as re."""
    valid = _compiles(text)
    try:
        policy = pol.RegexPolicy([text], allow_everything=True)
    except ValueError as err:
        msg = _refusal_is_one_line(err)
        assert repr(text) in msg or "empty" in msg, msg
        return
    assert valid, text
    for tag in ("", "a", "ab", "ba", "aab"):
        assert (policy.action(tag) == "save") == (re.fullmatch(text, tag) is not None)


# --- argument types -------------------------------------------------------------------


@pytest.mark.parametrize("patterns, words", [
    (b".*proj", "bytes"), ([b"a"], "bytes"), (re.compile(b"a"), "bytes"),
    (bytearray(b"a"), "bytes"), ([1], "int"), (3, "int"), ([None], "NoneType"),
    ({"a": 1}, "dict"), ([["a"]], "list")])
def test_a_pattern_of_another_type_is_refused_in_one_line(patterns, words):
    with pytest.raises((TypeError, ValueError)) as err:
        pol.RegexPolicy(patterns)
    text = _refusal_is_one_line(err.value)
    assert words in text and "str" in text, text
    assert "got int: 46" not in text


@pytest.mark.parametrize("kwargs, words", [
    (dict(offload_src="device", offload_dst="hbm"), "'hbm'"),
    (dict(offload_src="hbm", offload_dst="pinned_host"), "'hbm'"),
    (dict(offload_src="device", offload_dst="device"), "the same"),
    (dict(offload_src="pinned_host", offload_dst="pinned_host"), "the same"),
    (dict(offload_src=1, offload_dst="pinned_host"), "offload_src"),
    (dict(offload_src="device", offload_dst=None), "offload_dst"),
])
def test_offload_memory_kinds_are_checked(kwargs, words):
    with pytest.raises(ValueError) as err:
        pol.RegexPolicy(["a"], [".*b"], allow_offload_on_neuron=True, **kwargs)
    text = _refusal_is_one_line(err.value)
    assert words in text and "pinned_host" in text, text


def test_memory_kinds_without_offload_patterns_are_still_checked():
    with pytest.raises(ValueError, match="'hbm'"):
        pol.RegexPolicy(["a"], offload_src="device", offload_dst="hbm")
    ok = pol.RegexPolicy(["a"], [".*b"], offload_src="device", offload_dst="pinned_host",
                         allow_offload_on_neuron=True)
    assert ok.action("xb") == "offload"


@pytest.mark.parametrize("name", ["allow_everything", "allow_offload_on_neuron"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_switches_are_bools(name, value):
    with pytest.raises(TypeError, match=name):
        pol.RegexPolicy(["a"], **{name: value})


# --- unordered things are normalised ----------------------------------------------------


@settings(max_examples=200, **SETTINGS)
@given(names=st.lists(st.sampled_from([".*q_proj", ".*k_proj", "a|b", "(?i)c", "x+",
                                       ".*linear1_[01]", "z"]), min_size=1, max_size=5),
       data=st.data())
def test_policies_equal_as_sets_are_equal_and_hash_equal(names, data):
    a = pol.RegexPolicy(names)
    b = pol.RegexPolicy(data.draw(st.permutations(names)))
    c = pol.RegexPolicy(frozenset(names))
    assert a == b == c and hash(a) == hash(b) == hash(c)
    assert pol.RegexPolicy(set(names)).save == tuple(sorted(c.save))  # a set's order is fixed
    others = [n for n in [".*v_proj", "y"] if n not in names]
    assert pol.RegexPolicy(names + others[:1]) != a


def test_order_is_kept_for_display_but_not_for_equality():
    a, b = pol.RegexPolicy(["b", "a"]), pol.RegexPolicy(["a", "b"])
    assert a.save == ("b", "a") and a == b and hash(a) == hash(b)
    assert a.save_regex == "b|a"
    assert pol.RegexPolicy(["a"], ["c", "d"], offload_src="device", offload_dst="pinned_host",
                           allow_offload_on_neuron=True) == pol.RegexPolicy(
        ["a"], ["d", "c"], offload_src="device", offload_dst="pinned_host",
        allow_offload_on_neuron=True)
    # Save and offload are not interchangeable.
    assert pol.RegexPolicy(["a"], ["c"], offload_src="device", offload_dst="pinned_host",
                           allow_offload_on_neuron=True) != pol.RegexPolicy(
        ["c"], ["a"], offload_src="device", offload_dst="pinned_host",
        allow_offload_on_neuron=True)
