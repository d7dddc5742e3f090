"""Bad input, as a new user types it: every parser answers in bounded time with a value or
a one-line ValueError naming the input and what is valid; the CLI exits 2 without a
traceback; nothing is silently accepted. Property-based tests (hypothesis) cover the
device override, sizes, core lists and the CLI's numbers."""

import contextlib
import io
import logging
import math
import re
import sys
import threading
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from neuron_remat import cli, device as dev, models, plugin
from neuron_remat.cli import main

from fake_hosts import dmi

GiB, MiB = dev.GiB, dev.MiB
FAST = settings(deadline=None, max_examples=300,
                suppress_health_check=[HealthCheck.too_slow])
CLI_SETTINGS = settings(deadline=None, max_examples=120,
                        suppress_health_check=[HealthCheck.too_slow])
UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
         "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "k": 1 << 10, "g": 1 << 30}
OTHER_DIGITS = "٣۴५৬७౮๙１"  # Arabic-Indic, Devanagari, Bengali, Thai, fullwidth ...


def env(**values):
    return {"PATH": "/nonexistent", **values}


def run_cli(*argv):
    """(exit code, stdout, stderr) of the CLI; any exception escaping it fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def one_line_error(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


# ----------------------------------------------------------------------------------------
# Sizes: parse_bytes
# ----------------------------------------------------------------------------------------


@FAST
@given(n=st.integers(min_value=0, max_value=10**25), unit=st.sampled_from(sorted(UNITS)),
       pad=st.sampled_from(["", " ", "  "]))
def test_sizes_with_units_are_exact_and_bounded(n, unit, pad):
    text = f"{pad}{n}{pad}{unit}{pad}"
    want = n * UNITS[unit]
    if 1 <= want <= dev.MAX_BYTES and len(text) <= dev.MAX_SIZE_CHARS:
        assert dev.parse_bytes(text) == want
    else:
        with pytest.raises(ValueError, match="positive|larger than|too long"):
            dev.parse_bytes(text)


@FAST
@given(whole=st.integers(0, 10**6), frac=st.integers(0, 10**6),
       unit=st.sampled_from(sorted(UNITS)))
def test_decimal_sizes_round_down_to_bytes_but_never_split_a_byte(whole, frac, unit):
    text = f"{whole}.{frac:06d}{unit}"
    exact = Fraction(f"{whole}.{frac:06d}") * UNITS[unit]
    if UNITS[unit] == 1 and exact.denominator != 1:
        with pytest.raises(ValueError, match="whole number of bytes"):
            dev.parse_bytes(text)
    elif math.floor(exact) < 1:
        with pytest.raises(ValueError, match="positive"):
            dev.parse_bytes(text)
    else:
        assert dev.parse_bytes(text) == math.floor(exact)


@FAST
@given(text=st.text(max_size=80) | st.from_regex(r"\s*[0-9٣１.]{0,12}\s*[A-Za-z]{0,4}\s*"))
@example("9" * 309 + "GiB")
@example("٣GiB")
@example("1e3")
@example("-5MiB")
def test_any_text_is_a_size_or_a_value_error(text):
    try:
        value = dev.parse_bytes(text, what="--reserve")
    except ValueError as err:
        assert "--reserve" in str(err) and "\n" not in str(err)
        assert len(str(err)) < 400  # a pasted novel is cut short in the message
    else:
        assert isinstance(value, int) and 1 <= value <= dev.MAX_BYTES
        assert text.isascii()  # other scripts' digits are refused


@FAST
@given(x=st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10, 10**20))
@example(1.9)
def test_numbers_are_whole_bytes_or_refused(x):
    if isinstance(x, float) and not (math.isfinite(x) and x.is_integer()):
        with pytest.raises(ValueError, match="whole number of bytes"):
            dev.parse_bytes(x)
    elif 1 <= x <= dev.MAX_BYTES:
        assert dev.parse_bytes(x) == int(x)
    else:
        with pytest.raises(ValueError):
            dev.parse_bytes(x)


def test_sizes_refuse_other_types_and_bools():
    with pytest.raises(ValueError, match="whole number of bytes"):
        dev.parse_bytes(1.9)  # was 1
    with pytest.raises(ValueError, match="whole number of bytes"):
        dev.parse_bytes("1.9")
    for bad in (True, None, [64]):
        with pytest.raises(TypeError, match="not a size"):
            dev.parse_bytes(bad)


# ----------------------------------------------------------------------------------------
# Core lists: NEURON_RT_VISIBLE_CORES, NEURON_RT_NUM_CORES
# ----------------------------------------------------------------------------------------


@st.composite
def core_lists(draw):
    """A core list as people write it, and the set of cores it names."""
    spans = draw(st.lists(st.tuples(st.integers(0, 140), st.integers(0, 20)), min_size=1,
                          max_size=8))
    pieces, named = [], []
    for lo, width in spans:
        hi = lo + width
        gap = draw(st.sampled_from(["", " "]))
        pieces.append(str(lo) if width == 0 and draw(st.booleans()) else f"{lo}{gap}-{gap}{hi}")
        named.extend(range(lo, hi + 1))
    return ", ".join(pieces) if draw(st.booleans()) else ",".join(pieces), named


@FAST
@given(case=core_lists(), total=st.sampled_from([None, 4, 32, 64, 128]))
def test_core_lists_count_like_the_list_they_name(case, total):
    text, named = case
    limit = total if total is not None else 128
    if max(named) >= limit:  # an index beyond the machine is named first
        with pytest.raises(ValueError, match=r"names core \d+ but"):
            dev._parse_core_list(text, total)
    elif len(set(named)) != len(named):
        with pytest.raises(ValueError, match="twice"):
            dev._parse_core_list(text, total)
    else:
        assert dev._parse_core_list(text, total) == (len(named), max(named))


@FAST
@given(lo=st.integers(0, 10**15), width=st.integers(0, 10**15))
@example(0, 99999999)
@example(0, 10**15)
def test_huge_ranges_are_refused_without_building_them(lo, width):
    text = f"{lo}-{lo + width}"
    if lo + width < 64:
        assert dev._parse_core_list(text, 64) == (width + 1, lo + width)
    else:
        with pytest.raises(ValueError, match="NEURON_RT_VISIBLE_CORES"):
            dev._parse_core_list(text, 64)


@FAST
@given(text=st.text(max_size=40))
@example("٣")
@example("0-٣")
@example("0\x85")  # U+0085, which str.strip() takes for a space
@example("1" * 5000)
def test_any_core_list_is_a_count_or_a_value_error(text):
    try:
        count, top = dev._parse_core_list(text, None)
    except ValueError as err:
        assert "NEURON_RT_VISIBLE_CORES" in str(err) and len(str(err)) < 400
    else:
        assert 1 <= count <= top + 1 <= 128 and text.isascii()


@pytest.mark.parametrize("text", ["3\x85", "\x853", "3\u2003", "\u00a03"])
def test_a_count_padded_with_other_spaces_is_refused(text):
    """Only ASCII whitespace pads a count (str.strip() takes U+0085 and U+2003 too)."""
    from neuron_remat.device import parsing

    with pytest.raises(ValueError, match="ASCII digits"):
        parsing._ascii_int(text, what="NEURON_RT_NUM_CORES", low=1, high=8, valid="1 to 8")
    assert parsing._ascii_int(" 3\t", what="NEURON_RT_NUM_CORES", low=1, high=8,
                              valid="1 to 8") == 3


def test_a_huge_visible_core_range_on_a_detected_trn2_is_refused_at_once(tmp_path):
    dmi(tmp_path, "trn2.48xlarge")
    for raw in ("0-99999999", "0-99999999999999"):  # took > 60 s; the second: MemoryError
        with pytest.raises(ValueError, match=r"NEURON_RT_VISIBLE_CORES=.*valid indices 0-63"):
            dev.detect(root=str(tmp_path), environ=env(NEURON_RT_VISIBLE_CORES=raw),
                       use_jax=False, refresh=True)


@pytest.mark.parametrize("variables, words", [
    ({"NEURON_RT_VISIBLE_CORES": "٣"}, ["ASCII"]),
    ({"NEURON_RT_NUM_CORES": "٣"}, ["ASCII", "1-64"]),
    ({"NEURON_RT_NUM_CORES": "²"}, ["ASCII"]),  # isdigit() but not int()
    ({"NEURON_RT_NUM_CORES": "9" * 400}, ["ASCII"]),
])
def test_runtime_variables_take_ascii_digits_only(tmp_path, variables, words):
    dmi(tmp_path, "trn2.48xlarge")
    with pytest.raises(ValueError) as err:
        dev.detect(root=str(tmp_path), environ=env(**variables), use_jax=False)
    for word in words:
        assert word in str(err.value)


# ----------------------------------------------------------------------------------------
# The device override
# ----------------------------------------------------------------------------------------

BASES = [*dev.INSTANCES, *dev.NEURON_FAMILIES, "cpu", "TRN2.48XLARGE", "trn9", ""]
VALUES = st.one_of(st.integers(-2, 200).map(str), st.sampled_from(
    ["1", "2", "64MiB", "1B", "1.5GiB", "0", "lots", "٣", "9" * 40, "2TiB", "1023KiB", " 2 "]))


@st.composite
def overrides(draw):
    base = draw(st.sampled_from(BASES))
    keys = draw(st.lists(st.sampled_from(["lnc", "hbm", "cores", "LNC", "speed"]), max_size=3))
    opts = [f"{k}={draw(VALUES)}" for k in keys]
    environ = env()
    if draw(st.booleans()):
        environ["NEURON_LOGICAL_NC_CONFIG"] = draw(st.sampled_from(["1", "2", "3", ""]))
    if draw(st.booleans()):
        environ["NEURON_RT_VISIBLE_CORES"] = draw(st.sampled_from(["0-3", "0-31", "0-99999999",
                                                                  "5", "x"]))
    return ":".join([base, *opts]), environ


@FAST
@given(case=overrides())
@example(("trn2.48xlarge:cores=65", env()))
@example(("trn2.48xlarge:hbm=1B", env()))
@example(("trn2.48xlarge:hbm=" + "9" * 309, env()))
@example(("trn2.48xlarge:lnc=1", env(NEURON_LOGICAL_NC_CONFIG="2")))
def test_the_override_is_a_consistent_device_or_a_value_error(case):
    text, environ = case
    try:
        spec = dev.parse_device(text, environ=environ)
    except ValueError as err:
        assert "\n" not in str(err) and len(str(err)) < 600
        return
    if spec.family == "cpu":
        return
    opts = dict(p.split("=", 1) for p in text.split(":")[1:])
    opts = {k.strip().lower(): v.strip() for k, v in opts.items()}
    inst = dev.INSTANCES.get(text.split(":")[0].lower())
    total = (inst.chips if inst else 1) * spec.cores_per_chip
    assert 1 <= spec.cores <= total
    assert dev.MIN_HBM_PER_CORE <= spec.hbm_bytes_per_core <= dev.MAX_HBM_PER_CORE
    lnc_env = environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    if "lnc" in opts:
        assert spec.lnc == int(opts["lnc"])
        assert lnc_env in ("", opts["lnc"])  # a contradiction is refused
    elif lnc_env and dev.CHIPS[spec.family].lnc_options:
        assert spec.lnc == int(lnc_env)
        assert any("NEURON_LOGICAL_NC_CONFIG" in e.found for e in spec.evidence)
    visible = environ.get("NEURON_RT_VISIBLE_CORES")
    if "cores" in opts:
        assert spec.cores == int(opts["cores"])
    if visible:
        assert any("NEURON_RT_VISIBLE_CORES" in e.found for e in spec.evidence)
        assert spec.cores == dev._parse_core_list(visible, total)[0]


@FAST
@given(text=st.text(max_size=300))
def test_any_override_text_is_a_device_or_a_value_error(text):
    try:
        dev.parse_device(text, environ=env())
    except ValueError as err:
        assert "NEURON_REMAT_DEVICE" in str(err) and "\n" not in str(err)


def test_override_contradictions_are_refused_and_agreements_recorded():
    with pytest.raises(ValueError, match="lnc=1 but NEURON_LOGICAL_NC_CONFIG=2"):
        dev.parse_device("trn2.48xlarge:lnc=1", environ=env(NEURON_LOGICAL_NC_CONFIG="2"))
    with pytest.raises(ValueError, match="cores=8 but NEURON_RT_VISIBLE_CORES gives 4|"
                                         "cores=8 but NEURON_RT_VISIBLE_CORES=0-3"):
        dev.parse_device("trn2.48xlarge:cores=8", environ=env(NEURON_RT_VISIBLE_CORES="0-3"))
    spec = dev.detect(environ=env(NEURON_REMAT_DEVICE="trn2.48xlarge",
                                  NEURON_LOGICAL_NC_CONFIG="1",
                                  NEURON_RT_VISIBLE_CORES="0-31"))
    assert (spec.lnc, spec.cores, spec.hbm_bytes_per_core) == (1, 32, 12 * GiB)
    found = " | ".join(e.found for e in spec.evidence)
    assert "NEURON_LOGICAL_NC_CONFIG=1 -> LNC=1" in found
    assert "NEURON_RT_VISIBLE_CORES=0-31 -> 32 cores" in found
    # Named on the command line, the device is read under the same variables as the
    # override and a detected device (issue 19): this process's cores.
    named = dev.parse_device("trn2.48xlarge", source="command line",
                             environ=env(NEURON_RT_VISIBLE_CORES="0-3"))
    assert named.cores == 4
    assert "NEURON_RT_VISIBLE_CORES=0-3 -> 4 cores" in " | ".join(e.found for e in named.evidence)
    assert dev.parse_device("trn2.48xlarge", source="command line", environ=env()).cores == 64


@pytest.mark.parametrize("text, words", [
    ("trn2.48xlarge:cores=65", ["cores=65", "1-64", "trn2.48xlarge at LNC=2"]),
    ("trn2:cores=5", ["1-4", "one trn2 chip"]),
    ("trn2.48xlarge:hbm=1B", ["below 1 MiB", "1MiB to 1TiB"]),
    ("trn2.48xlarge:hbm=2TiB", ["larger than 1 TiB"]),
    ("trn2.48xlarge:hbm=" + "9" * 40, ["larger than 1 TiB"]),
    ("trn2.48xlarge:hbm=" + "9" * 309, ["too long"]),
    ("trn2.48xlarge:cores=٣", ["ASCII"]),
    ("trn2.48xlarge:hbm=٣GiB", ["ASCII"]),
])
def test_override_values_beyond_the_device_are_refused(text, words):
    with pytest.raises(ValueError) as err:
        dev.parse_device(text, environ=env())
    for word in words:
        assert word in str(err.value)


# ----------------------------------------------------------------------------------------
# StepShape, Parallelism (the Python API)
# ----------------------------------------------------------------------------------------


@FAST
@given(opt=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                     st.integers(-10, 10**400), st.text(max_size=8),
                     st.sampled_from(["adamw", "sgd"])))
@example(float("nan"))
@example(float("inf"))
def test_step_shape_optimizer_is_known_or_finite_bytes(opt):
    valid = (opt in ("adamw", "sgd") if isinstance(opt, str) else
             not isinstance(opt, bool) and 0 <= opt <= 1024)  # NaN compares False
    if valid:
        shape = models.StepShape(seq_len=8, optimizer=opt)
        assert math.isfinite(shape.optimizer_bytes_per_param())
    else:
        with pytest.raises(ValueError, match="optimizer"):
            models.StepShape(seq_len=8, optimizer=opt)


@pytest.mark.parametrize("kwargs, words", [
    ({"seq_len": True}, ["seq_len", "positive integer"]),
    ({"seq_len": 8, "micro_batch": False}, ["micro_batch"]),
    ({"seq_len": 2**40}, ["seq_len", "beyond"]),
    ({"seq_len": 8, "param_dtype": "bool"}, ["param_dtype", "floating-point"]),
    ({"seq_len": 8, "activation_dtype": "int8"}, ["activation_dtype"]),
    ({"seq_len": 8, "param_dtype": None}, ["param_dtype"]),
])
def test_step_shape_refuses(kwargs, words):
    with pytest.raises(ValueError) as err:
        models.StepShape(**kwargs)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"microbatches": 4}, ["microbatches=4", "pp=1"]),
    ({"tp": True}, ["tp"]),
    ({"fsdp": True}, ["fsdp"]),
    ({"hosts": 2**40}, ["hosts", "beyond"]),
    ({"sequence_parallel": "false"}, ["sequence_parallel", "True or False"]),
    ({"zero1": 1}, ["zero1"]),
    ({"schedule": ["1f1b"]}, ["schedule"]),
])
def test_parallelism_refuses(kwargs, words):
    with pytest.raises(ValueError) as err:
        models.Parallelism(**kwargs)
    for word in words:
        assert word in str(err.value)
    assert models.Parallelism(pp=4, microbatches=8).inflight == 4


# ----------------------------------------------------------------------------------------
# The CLI
# ----------------------------------------------------------------------------------------

PLAN = ["plan", "--model", "llama3-8b", "--device", "trn2.48xlarge", "--seq-len", "4096"]
NUMBER_TEXT = st.one_of(
    st.integers(-5, 300).map(str), st.integers(10**9, 10**400).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e999", "٣", "１", "²", " 4 ",
                     "0.5", "1GiB", "3GiB", "0x10", "", "four", "9" * 309 + "GiB"]))
INT_FLAGS = ["--seq-len", "--micro-batch", "--tp", "--fsdp", "--dp", "--pp", "--hosts",
             "--microbatches"]


@CLI_SETTINGS
@given(flag=st.sampled_from([*INT_FLAGS, "--optimizer", "--reserve"]), text=NUMBER_TEXT)
@example("--optimizer", "inf")
@example("--seq-len", "0")
@example("--reserve", "9" * 309 + "GiB")
@example("--microbatches", "4")
@example("--hosts", "1000000000")  # fsdp=-1 then resolved beyond any job: hosts is named
def test_cli_numbers_are_planned_or_refused_in_one_line(flag, text):
    rc, out, err = run_cli(*PLAN, flag, text)
    event(f"exit {rc}")
    assert rc in (0, 1, 2), (rc, err)
    if rc == 2:
        line = one_line_error(err)
        # The flag, or its field where two flags clash (seq_len=1 with tp=4 and sequence
        # parallelism), is named.
        assert flag in line or flag[2:].replace("-", "_") in line, line
    elif rc == 0:
        assert "policy:" in out


@FAST
@given(n=st.integers(-10**12, 10**12), low=st.sampled_from([0, 1]))
def test_cli_count_type_accepts_exactly_its_range(n, low):
    parse = cli._count(low, allow=(-1,), high=1000)
    if n == -1 or low <= n <= 1000:
        assert parse(str(n)) == n
    else:
        with pytest.raises(Exception, match="valid: an integer from"):
            parse(str(n))


@pytest.mark.parametrize("text", ["5\x85", "\u20035", "5\u00a0"])
def test_cli_count_padded_with_other_spaces_is_refused(text):
    """A count is ASCII digits padded with ASCII spaces (str.strip() takes U+0085 too)."""
    parse = cli._count(1, high=1000, what="a count")
    with pytest.raises(Exception, match="is not a count; valid: an integer from 1"):
        parse(text)
    assert parse(" 5\t") == 5


@pytest.mark.parametrize("argv, words", [
    (["--optimizer", "inf"], ["--optimizer", "'inf'", "adamw"]),
    (["--seq-len", "0"], ["--seq-len", "0 is out of range", "from 1"]),
    (["--microbatches", "4"], ["--microbatches 4", "--pp"]),
    (["--param-dtype", "bool"], ["--param-dtype", "'bool'", "float32"]),
    (["--reserve", "9" * 309], ["--reserve", "fraction"]),
    (["--reserve", "9" * 30 + "GiB"], ["--reserve", "larger than"]),
    (["--reserve", "nan"], ["--reserve", "fraction"]),
    (["--reserve", "-3GiB"], ["--reserve", "'-3GiB'"]),  # was "expected one argument"
    (["--device", "cpu"], ["a CPU has no HBM to plan for"]),
    (["--device", "trn2.48xlarge:cores=65"], ["cores=65", "1-64"]),
    (["--tp", "٣"], ["--tp", "'٣'"]),
    (["--candidates", "q_proj,,k_proj"], ["--candidates", "empty entry"]),
    (["--fsdp", "-2"], ["--fsdp", "or -1"]),
    (["--schedule", "zigzag"], ["--schedule", "'zigzag'"]),
])
def test_cli_plan_refuses_in_one_line(argv, words):
    base = [a for a in PLAN if a not in ("--device", "trn2.48xlarge")] if "--device" in argv \
        else PLAN
    rc, _, err = run_cli(*base, *argv)
    line = one_line_error(err)
    assert rc == 2
    for word in words:
        assert word in line


def test_cli_errors_under_json_are_json(capsys):
    import json

    for flag in ("--json", "--js"):  # an abbreviation argparse takes, too
        assert main([*PLAN, "--seq-len", "0", flag]) == 2
        assert "--seq-len" in json.loads(capsys.readouterr().out)["error"]


def test_cli_model_files_are_named(tmp_path):
    cases = {"empty.json": b"", "null.json": b"null", "list.json": b"[1]",
             "broken.json": b'{"hidden_size":', "latin1.json": b'{"a": "\xe9"}',
             "deep.json": b"[" * 100000}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        rc, _, err = run_cli("plan", "--model", str(tmp_path / name), "--device",
                             "trn2.48xlarge", "--seq-len", "128")
        line = one_line_error(err)
        assert rc == 2 and name in line, line
    rc, _, err = run_cli("plan", "--model", str(tmp_path / "missing.json"))
    assert rc == 2 and "no such file" in one_line_error(err)
    rc, _, err = run_cli("plan", "--model", str(tmp_path))
    assert rc == 2 and "is a directory" in one_line_error(err)


def test_cli_audit_targets_and_patterns(tmp_path, monkeypatch):
    (tmp_path / "user_mod.py").write_text(
        "def boom():\n    raise RuntimeError('nope')\n"
        "def three():\n    return 3\n"
        "def keyed():\n    return (lambda x: x), {'x': 1.0}\n"
        "value = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [
        (["os:nonexistent"], "os has no attribute 'nonexistent'"),  # was AttributeError
        (["no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
        (["user_mod:boom"], "user_mod:boom() raised RuntimeError: nope"),
        (["user_mod:three"], "must return (fn, args)"),
        (["user_mod:keyed"], "returned args of type dict; give a tuple"),  # was its keys
        (["user_mod:value"], "not a function"),
        (["user_mod"], "not MODULE:FUNCTION"),
        # Patterns are checked before the target runs; two patterns may reuse a group name.
        (["user_mod:three", "--save", "(a"], "invalid regex '(a'"),
        (["user_mod:three", "--save", "(?P<n>a)", "(?P<n>b)"], "must return (fn, args)"),
    ]
    for argv, words in cases:
        rc, _, err = run_cli("audit", *argv)
        line = one_line_error(err)
        assert rc == 2 and words in line, line


def test_cli_bugs_are_one_line_exit_3_and_shown_with_verbose(monkeypatch):
    def buggy(args):
        raise KeyError("oops")

    monkeypatch.setattr(cli, "_cmd_presets", buggy)
    rc, _, err = run_cli("presets")
    assert rc == cli.EXIT_INTERNAL
    assert "internal error" in one_line_error(err) and "KeyError" in err
    rc, _, err = run_cli("-v", "presets")
    assert rc == cli.EXIT_INTERNAL and "Traceback" in err


# ----------------------------------------------------------------------------------------
# The provider
# ----------------------------------------------------------------------------------------


def test_the_fallback_warning_is_given_once_from_sixteen_threads(monkeypatch, caplog):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    caplog.set_level(logging.WARNING, logger="neuron_remat")
    start = threading.Barrier(16)
    answers = []

    def host_thread(i):
        start.wait()
        for layer in range(4):  # every thread, every layer, the same cause
            answers.append(plugin.provide(layer=f"t{i}.layer{layer}", model="no-such-model"))

    threads = [threading.Thread(target=host_thread, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert answers == [None] * 64
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "unknown model 'no-such-model'" in warnings[0].getMessage()
    # Another cause is another warning.
    plugin.provide(layer="x", model="no-such-model-2")
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_a_choice_from_provide_names_its_provider(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    assert plugin.provide(layer="x").provider == "neuron_remat"  # the preset
    planned = plugin.provide(layer="x", model="llama3-8b", shape={"seq_len": 4096},
                             parallelism={"tp": 4, "fsdp": -1})
    assert planned.provider == plugin.PROVIDER_NAME == "neuron_remat"
    assert planned.plan is not None


# ----------------------------------------------------------------------------------------
# Benchmarks: figures over their targets are flagged
# ----------------------------------------------------------------------------------------


def _overheads_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(path))
    try:
        import overheads
    finally:
        sys.path.remove(str(path))
    return overheads


def _fake_results(trace_overhead, plan_ms):
    det = {"first_call_fresh_process_ms": 1.0, "cold_refresh_ms": 1.0, "warm_us": 1.0,
           "device": "cpu"}
    return {
        "import": {"bytecode_cached": {"neuron_remat_ms": 20.0, "jax_ms": 500.0,
                                       "backends_started_at_import": False},
                   "as_run": {"neuron_remat_ms": 30.0, "jax_ms": 600.0,
                              "PYTHONDONTWRITEBYTECODE": None}},
        "import_breakdown": [],
        "detect": {k: det for k in ("default", "override", "use_jax=False")},
        "plan": {"median_ms": plan_ms, "first_ms": 2 * plan_ms},
        "trace": [{"layers": 32, "scan": False, "overhead": trace_overhead, "regex_ms": 100,
                   "jax_ms": 95, "repeat": 3},
                  {"layers": 32, "scan": True, "overhead": 0.3, "regex_ms": 10, "jax_ms": 8,
                   "repeat": 3}],
        "policy_calls": {"calls_per_trace_32_unrolled": {"name": 10, "other": 100},
                         "extra_us_per_trace": 5.0, "regex": {"name_call_ns": 1,
                                                              "other_call_ns": 1},
                         "jax": {"name_call_ns": 1, "other_call_ns": 1}},
    }


def test_overheads_table_flags_figures_over_target():
    ov = _overheads_module()
    bad = _fake_results(0.056, 80.0)  # +5.6% against < 2%, 80 ms against < 50 ms
    bad["targets"] = ov.targets(bad)
    assert [t["met"] for t in bad["targets"]] == [True, False, False]
    text = ov.report(bad)
    flagged = [ln for ln in text.splitlines() if "OVER TARGET" in ln]
    assert any("trace overhead, 32 layers unrolled" in ln and "+5.60%" in ln for ln in flagged)
    assert any(ln.startswith("plan()") for ln in flagged)
    assert "2 figure(s) OVER TARGET" in text
    good = _fake_results(0.01, 10.0)
    good["targets"] = ov.targets(good)
    text = ov.report(good)
    assert "OVER TARGET" not in text and "every figure with a target meets it" in text
    assert re.search(r"unrolled\s+\+1\.00%\s+< 2%\s+ok", text)


# ----------------------------------------------------------------------------------------
# More of the same kind: the Python API and the switches
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lnc", [True, 2.0, "2"])
def test_lnc_is_an_integer_not_a_bool_or_text(lnc):
    with pytest.raises(ValueError, match="lnc="):
        dev.from_instance_type("trn2.48xlarge", lnc=lnc)  # lnc=True was LNC 1, silently


@pytest.mark.parametrize("timeout", [float("nan"), 0, -1, float("inf"), True, "5"])
def test_the_neuron_ls_timeout_is_bounded(timeout):
    with pytest.raises(ValueError, match="neuron_ls_timeout"):
        dev.detect(neuron_ls_timeout=timeout, refresh=True, use_jax=False)


def test_switches_that_are_neither_on_nor_off_are_reported_once(monkeypatch, caplog):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    monkeypatch.setenv("NEURON_REMAT_DISABLE", "enabled")
    caplog.set_level(logging.WARNING, logger="neuron_remat")
    for layer in range(3):
        assert plugin.provide(layer=f"l{layer}") is not None  # read as off
    warned = [r.getMessage() for r in caplog.records if "is not a switch" in r.getMessage()]
    assert len(warned) == 1 and "NEURON_REMAT_DISABLE='enabled'" in warned[0]
    monkeypatch.setenv("NEURON_REMAT_DISABLE", " ON ")
    assert plugin.provide(layer="l9") is None


def test_cli_plot_and_offload_destinations_are_checked_before_work(tmp_path):
    for path, words in ((tmp_path / "missing" / "x.png", "does not exist"),
                        (tmp_path / "x.txt", "must end in")):
        rc, _, err = run_cli(*PLAN, "--plot", str(path))
        assert rc == 2 and words in one_line_error(err) and "--plot" in err
    rc, _, err = run_cli("audit", "os:getcwd", "--offload", "x", "--offload-dst", "bogus")
    assert rc == 2 and "--offload-dst" in one_line_error(err)


def test_prevent_cse_is_a_bool_not_a_truthy_string():
    with pytest.raises(ValueError, match="prevent_cse='no'"):
        plugin.resolve_policy(layer="x", prevent_cse="no")  # was passed on, and truthy
    with pytest.raises(ValueError, match="prevent_cse=1"):
        plugin.checkpoint(lambda x: x, prevent_cse=1)
    assert plugin.resolve_policy(layer="x", prevent_cse=False).prevent_cse is False


def test_numpy_integers_are_integers_and_numpy_bools_are_not():
    import numpy as np

    shape = models.StepShape(seq_len=np.int64(4096), micro_batch=np.int32(2))
    assert type(shape.seq_len) is int and shape.tokens == 8192
    par = models.Parallelism(tp=np.int64(4), fsdp=np.int64(-1), pp=np.int16(2),
                             microbatches=np.int64(8))
    assert (type(par.tp), par.fsdp, par.microbatches) == (int, -1, 8)
    with pytest.raises(ValueError, match="seq_len"):
        models.StepShape(seq_len=np.bool_(True))


def test_cli_model_that_is_not_a_regular_file():
    rc, _, err = run_cli("plan", "--model", "/dev/zero")  # reading it would never end
    assert rc == 2 and "not a regular file" in one_line_error(err)


def test_an_lnc_variable_ignored_on_trn1_is_in_the_evidence():
    spec = dev.parse_device("trn1.32xlarge", environ=env(NEURON_LOGICAL_NC_CONFIG="1"))
    assert spec.lnc is None
    assert any("NEURON_LOGICAL_NC_CONFIG ignored: trn1" in e.found for e in spec.evidence)
