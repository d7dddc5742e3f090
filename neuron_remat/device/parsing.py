"""Parsing what people type: sizes (`parse_bytes`), the device text of
``NEURON_REMAT_DEVICE`` and the command line (`parse_device`), instance names
(`from_instance_type`), and the Neuron runtime's variables (``NEURON_LOGICAL_NC_CONFIG``,
``NEURON_RT_VISIBLE_CORES``, ``NEURON_RT_NUM_CORES``). Bad values raise `ValueError` naming
the value and what is valid."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

from .facts import CHIPS, INSTANCES, NEURON_FAMILIES, GiB, InstanceFacts, KiB, MiB
from .spec import DeviceSpec, Evidence, _cpu_spec, _spec

OVERRIDE_ENV = "NEURON_REMAT_DEVICE"

_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "kb": 10**3,
    "m": MiB, "mib": MiB, "mb": 10**6,
    "g": GiB, "gib": GiB, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}


# Bounds on what people type: a size or a core list longer than this is not one.
MAX_SIZE_CHARS = 64
MAX_BYTES = 1 << 60  # 1 EiB: no device, reserve or budget comes near it
MIN_HBM_PER_CORE = MiB  # smaller is no device; scaled-down simulations use MiB
MAX_HBM_PER_CORE = 1 << 40  # 1 TiB per core: far beyond any Neuron chip
_MAX_OVERRIDE_CHARS = 200
_MAX_CORE_LIST_CHARS = 4096


def _show(text: Any, limit: int = 48) -> str:
    """`repr` of a value for an error message, cut short when a user pasted a novel."""
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[:limit - 5]}...{shown[-4:]} ({len(str(text))} chars)"


def parse_bytes(text: str | int, *, what: str = "size", max_bytes: int = MAX_BYTES) -> int:
    """``"64MiB"``, ``"1.5GiB"``, ``"24GB"`` or a plain integer -> bytes (binary units for
    ``K``/``M``/``G``, decimal for ``KB``/``MB``/``GB``).

    Arithmetic is exact: a fraction of a larger unit is rounded down to whole bytes
    (``"0.1GiB"``), while a fraction of a byte (``"1.9"``, ``1.9``) is refused. Only ASCII
    digits count, the text is at most `MAX_SIZE_CHARS` long, and the result lies in
    ``1..max_bytes``; anything else raises `ValueError` naming `what`.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise TypeError(f"{what} {_show(text)} is a {type(text).__name__}, not a size; give "
                        "a number of bytes or a string such as '64MiB'")
    if isinstance(text, float):
        if not math.isfinite(text) or not text.is_integer():
            raise ValueError(f"{what} {text!r} is not a whole number of bytes")
        value = int(text)
    elif isinstance(text, int):
        value = text
    else:
        if len(text) > MAX_SIZE_CHARS:
            raise ValueError(f"{what} {_show(text)} is too long to be a size (at most "
                             f"{MAX_SIZE_CHARS} characters, e.g. '64MiB')")
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", text, re.ASCII)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(
                f"{what} {_show(text)} is not a size; write a number (ASCII digits) with an "
                "optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '64MiB' or '24GiB'"
            )
        from fractions import Fraction  # noqa: PLC0415  (imports decimal: only when parsing)

        exact = Fraction(m.group(1)) * _UNITS[unit]
        if _UNITS[unit] == 1 and exact.denominator != 1:
            raise ValueError(f"{what} {text!r} is not a whole number of bytes")
        value = math.floor(exact)
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {_show(text)}"
                         + (" (less than one byte)" if isinstance(text, str) else ""))
    if value > max_bytes:
        raise ValueError(f"{what} {_show(text)} is larger than {_human(max_bytes)}, the "
                         "most this accepts")
    return value


def _human(n: int) -> str:
    for unit, size in (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", GiB),
                       ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


_ASCII_SPACE = " \t\n\r\f\v"
"""What a count or a core list may be padded with: ASCII whitespace, what a regex's
whitespace class matches under re.ASCII (``str.strip()`` would also take U+0085 and other
scripts' spaces)."""


def _ascii_int(text: str, *, what: str, low: int, high: int, valid: str) -> int:
    """A plain ASCII integer in ``low..high`` (no signs, no other scripts' digits or
    spaces)."""
    raw = text.strip(_ASCII_SPACE)
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
        raise ValueError(f"{what}={_show(text)} is not a positive integer in ASCII digits; "
                         f"valid: {valid}")
    n = int(raw)
    if not low <= n <= high:
        raise ValueError(f"{what}={n} is out of range; valid: {valid}")
    return n


def _valid_names() -> str:
    return (
        f"families: {', '.join(NEURON_FAMILIES)}, cpu; "
        f"instance types: {', '.join(sorted(INSTANCES))}"
    )


def _resolve_lnc(family: str, lnc: int | None, *, what: str) -> int | None:
    chip = CHIPS[family]
    if lnc is not None and (isinstance(lnc, bool) or not isinstance(lnc, int)):
        raise ValueError(f"{what}: lnc={lnc!r} is a {type(lnc).__name__}; give the integer "
                         "1 or 2")
    if not chip.lnc_options:
        if lnc is not None:
            raise ValueError(
                f"{what}: lnc={lnc} does not apply to {family} (logical NeuronCore "
                f"configuration exists on {', '.join(f for f, c in CHIPS.items() if c.lnc_options)})"
            )
        return None
    if lnc is None:
        return chip.default_lnc
    if lnc not in chip.lnc_options:
        raise ValueError(
            f"{what}: lnc={lnc} is not valid for {family}; valid: "
            f"{', '.join(map(str, chip.lnc_options))}"
        )
    return lnc


def from_instance_type(name: str, *, lnc: int | None = None) -> DeviceSpec:
    """The spec of a whole instance, for planning on a machine that is not the target.

    >>> from_instance_type("trn2.48xlarge").cores
    64
    """
    if not isinstance(name, str):
        raise TypeError(f"instance type {_show(name)} ({type(name).__name__}) is not a name; give a "
                        f"string, one of {', '.join(sorted(INSTANCES))}")
    key = name.strip().lower()
    if key not in INSTANCES:
        raise ValueError(
            f"unknown instance type {name!r}; known: {', '.join(sorted(INSTANCES))}"
        )
    inst = INSTANCES[key]
    lnc = _resolve_lnc(inst.family, lnc, what=f"instance {name!r}")
    return _spec(inst.family, instance=inst, lnc=lnc, source="instance_type",
                 evidence=(Evidence("instance_type", f"{key}, LNC={lnc}", True),))


def as_device(value: DeviceSpec | str | None, where: str) -> DeviceSpec | None:
    """A device argument as a `DeviceSpec`: a spec as it is, a string parsed
    (`parse_device`, e.g. ``"trn2.48xlarge"`` or ``"trn2:hbm=16GiB"``), None kept (the
    caller detects). Anything else is a TypeError naming `where` (``"fit(device=...)"``)."""
    if value is None or isinstance(value, DeviceSpec):
        return value
    if isinstance(value, str):
        try:
            return parse_device(value, source="argument")
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    raise TypeError(f"{where}: {_show(value)} ({type(value).__name__}) is not a device; give a DeviceSpec "
                    "(detect(), parse_device(...)) or a string such as 'trn2.48xlarge'")


def parse_device(text: str, *, source: str = "override",
                 environ: Mapping[str, str] | None = None) -> DeviceSpec:
    """Parse the override syntax: ``BASE[:lnc=N][:hbm=SIZE][:cores=N]``.

    ``BASE`` is an instance type (``trn2.48xlarge``), a Neuron family (``trn2``: one chip)
    or ``cpu``. ``hbm`` is HBM per core (1 MiB to 1 TiB), for scaled-down simulations on
    small machines. ``cores`` is how many of the device's logical cores this process uses
    (at most all of them).

    The runtime's variables in `environ` (default ``os.environ``) describe this process,
    and they apply unless the text says otherwise: ``NEURON_LOGICAL_NC_CONFIG`` gives the
    LNC when ``lnc`` is not written, and ``NEURON_RT_VISIBLE_CORES``/``NEURON_RT_NUM_CORES``
    give the cores when ``cores`` is not written, whatever the `source` (the
    ``NEURON_REMAT_DEVICE`` override or a device named on the command line), as for a
    detected device. Where both are given and disagree, the contradiction is a
    `ValueError`; where a variable applies, the evidence says so.
    """
    if not isinstance(text, str):
        raise TypeError(f"device {_show(text)} is a {type(text).__name__}; give a string "
                        "such as 'trn2.48xlarge'")
    what = f"{OVERRIDE_ENV}={_show(text)}" if source == "override" else f"device {_show(text)}"
    if len(text) > _MAX_OVERRIDE_CHARS:
        raise ValueError(f"{what} is too long to be a device; "
                         f"write BASE[:lnc=N][:hbm=SIZE][:cores=N], e.g. trn2.48xlarge:lnc=1")
    env = os.environ if environ is None else environ
    parts = [p.strip() for p in text.strip().split(":")]
    base = parts[0].lower()
    opts: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("lnc", "hbm", "cores") or not value.strip():
            raise ValueError(
                f"{what}: option {_show(part)} is not one of lnc=1|2, hbm=SIZE (per core, "
                "e.g. 64MiB), cores=N"
            )
        if key in opts:
            raise ValueError(f"{what}: option {key!r} given twice")
        opts[key] = value.strip()
    if base == "cpu":
        if opts:
            raise ValueError(f"{what}: options {sorted(opts)} do not apply to cpu")
        return _cpu_spec("cpu", source, (Evidence(source, "cpu", True),))
    if base in INSTANCES:
        instance: InstanceFacts | None = INSTANCES[base]
        family = instance.family
    elif base in NEURON_FAMILIES:
        instance, family = None, base
    else:
        raise ValueError(f"{what}: unknown device {_show(parts[0])}; valid {_valid_names()}")
    notes = [Evidence(source, "", True)]  # filled in below
    env_lnc = _lnc_from_env(env, family)
    if "lnc" in opts:
        if opts["lnc"] not in ("1", "2"):
            raise ValueError(f"{what}: lnc={_show(opts['lnc'])} is not valid; valid: 1, 2")
        lnc: int | None = int(opts["lnc"])
        if env_lnc is not None and env_lnc != lnc:
            raise ValueError(
                f"{what} says lnc={lnc} but NEURON_LOGICAL_NC_CONFIG={env_lnc} in this "
                "environment: the runtime would use the latter; make them agree or unset one")
    else:
        lnc = env_lnc
        if env_lnc is not None:
            notes.append(Evidence("env", f"NEURON_LOGICAL_NC_CONFIG={env_lnc} -> LNC={env_lnc} "
                                         f"(the device text names no lnc)"))
    lnc = _resolve_lnc(family, lnc, what=what)
    if env_lnc is None and (env.get("NEURON_LOGICAL_NC_CONFIG") or "").strip():
        notes.append(Evidence("env", f"NEURON_LOGICAL_NC_CONFIG ignored: {family} has no "
                                     "logical-core configuration"))
    hbm = None
    if "hbm" in opts:
        hbm = parse_bytes(opts["hbm"], what=f"{what}: hbm", max_bytes=MAX_HBM_PER_CORE)
        if hbm < MIN_HBM_PER_CORE:
            raise ValueError(f"{what}: hbm={opts['hbm']} per core is below 1 MiB, smaller "
                             "than any device; valid: 1MiB to 1TiB per core")
    per_chip = CHIPS[family].cores_per_chip(lnc)
    total = (instance.chips if instance else 1) * per_chip
    where = f"{instance.name if instance else f'one {family} chip'} at LNC={lnc}"
    cores = None
    if "cores" in opts:
        cores = _ascii_int(opts["cores"], what=f"{what}: cores", low=1, high=total,
                           valid=f"1-{total} (the logical cores of {where})")
    # The runtime's core variables apply to a named device as to the override and to a
    # detected one: read, validated and honoured alike.
    visible, visible_note = _visible_cores(env, total)
    if visible is not None and cores is not None and visible != cores:
        raise ValueError(
            f"{what} says cores={cores} but {visible_note.split(' -> ')[0]} in this "
            f"environment gives {visible}: make them agree or unset one")
    if visible is not None:
        notes.append(Evidence("env", visible_note + f" (the {source}'s device)"))
        cores = visible
    found = f"{base}, LNC={lnc}" + (f", hbm={hbm} B/core" if hbm else "") + (
        f", cores={cores}" if cores is not None else "")
    notes[0] = Evidence(source, found, True)
    return _spec(family, instance=instance, lnc=lnc, source=source, cores=cores, hbm=hbm,
                 evidence=tuple(notes))


# --------------------------------------------------------------------------------------
# Environment variables the Neuron runtime reads.
# --------------------------------------------------------------------------------------


def _lnc_from_env(environ: Mapping[str, str], family: str) -> int | None:
    raw = environ.get("NEURON_LOGICAL_NC_CONFIG")
    if raw is None or raw.strip() == "":
        return None
    if raw.strip() not in ("1", "2"):
        raise ValueError(
            f"NEURON_LOGICAL_NC_CONFIG={_show(raw)} is not valid; valid values: 1, 2"
        )
    if not CHIPS[family].lnc_options:
        return None  # the runtime ignores it on trn1/inf2, and so do we
    return int(raw)


def _max_cores() -> int:
    """The most logical cores any known instance has (at the smallest LNC)."""
    return max(inst.chips * CHIPS[inst.family].physical_cores for inst in INSTANCES.values())


def _parse_core_list(raw: str, total: int | None = None) -> tuple[int, int]:
    """``NEURON_RT_VISIBLE_CORES`` -> (number of cores, highest index), in time linear in
    the text and without building the list: ``0-99999999`` is refused at once."""
    name = "NEURON_RT_VISIBLE_CORES"
    limit = total if total is not None else _max_cores()
    scope = (f"this machine has {total} logical cores (valid indices 0-{total - 1})"
             if total is not None else
             f"no Neuron instance has more than {limit} logical cores")
    if len(raw) > _MAX_CORE_LIST_CHARS:
        raise ValueError(f"{name}={_show(raw)} is too long to be a core list; valid "
                         "forms: '3', '0-3', '0,2,4-7'")
    spans: list[tuple[int, int]] = []
    for piece in raw.split(","):
        piece = piece.strip(_ASCII_SPACE)
        m = re.fullmatch(r"([0-9]+)(?:\s*-\s*([0-9]+))?", piece, re.ASCII)
        if not m:
            raise ValueError(
                f"{name}={_show(raw)} is not a core index or inclusive range; "
                "valid forms: '3', '0-3', '0,2,4-7' (ASCII digits)"
            )
        if max(len(m.group(1)), len(m.group(2) or "")) > 9:
            raise ValueError(f"{name}={_show(raw)} names a core index with more than 9 "
                             f"digits; {scope}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"{name}={_show(raw)}: range {piece!r} runs backwards; "
                             f"valid: '{hi}-{lo}' (low to high)")
        if hi >= limit:
            raise ValueError(f"{name}={_show(raw)} names core {hi} but {scope}")
        spans.append((lo, hi))
    spans.sort()
    for (_, hi_a), (lo_b, _) in zip(spans, spans[1:]):
        if lo_b <= hi_a:
            raise ValueError(f"{name}={_show(raw)} names core {lo_b} twice; valid: each "
                             "core once, e.g. '0-3' or '0,2,4-7'")
    return sum(hi - lo + 1 for lo, hi in spans), spans[-1][1]


def _visible_cores(environ: Mapping[str, str], total: int | None) -> tuple[int | None, str]:
    """Cores this process may use per the runtime's variables, or None when unset."""
    raw = environ.get("NEURON_RT_VISIBLE_CORES", "").strip(_ASCII_SPACE)
    if raw:
        n, _ = _parse_core_list(raw, total)
        return n, f"NEURON_RT_VISIBLE_CORES={_show(raw, 60)[1:-1]} -> {n} cores"
    raw = environ.get("NEURON_RT_NUM_CORES", "").strip()
    if raw:
        limit = total if total is not None else _max_cores()
        valid = (f"1-{total} (the logical cores of this machine)" if total is not None
                 else f"1-{limit} (no Neuron instance has more)")
        n = _ascii_int(raw, what="NEURON_RT_NUM_CORES", low=1, high=limit, valid=valid)
        return n, f"NEURON_RT_NUM_CORES={n}"
    return None, ""
