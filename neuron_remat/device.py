"""What accelerator this process trains on, and how much HBM each of its cores has.

`detect()` answers from the first piece of evidence that decides, in this order:

1. ``NEURON_REMAT_DEVICE``: an explicit override (``trn2.48xlarge``, ``trn2``,
   ``trn2.48xlarge:lnc=1``, ``trn2:hbm=64MiB``, ``cpu``). This is how laptops and CI
   plan for a TRN2 they do not have.
2. JAX: the default backend and, on the ``neuron`` platform, ``device_kind``
   (``NC_v3d`` = TRN2 at LNC=2, ``NC_v3`` = TRN2 at LNC=1, ``NC_v2`` = TRN1/Inf2) and the
   local device count. A GPU or TPU backend decides at once; a CPU backend does not, since
   a Neuron host without the Neuron PJRT plugin also reports ``cpu``.
3. Neuron sysfs (``/sys/devices/virtual/neuron_device/neuron*/info/architecture/*``) and,
   when ``/dev/neuron*`` exists but sysfs cannot say, ``neuron-ls -j`` under a short timeout.
4. EC2 DMI (``/sys/devices/virtual/dmi/id/product_name`` where ``sys_vendor`` is Amazon EC2).

JAX's ``NC_v2`` and a 32 GiB ``neuron-ls`` device are Trn1 or Inf2; sysfs or DMI decide
between them when they can, and Trn1 is assumed when they cannot.

The logical-core configuration comes from ``NEURON_LOGICAL_NC_CONFIG`` (default 2 on
TRN2/TRN3) and the visible cores from ``NEURON_RT_VISIBLE_CORES`` or ``NEURON_RT_NUM_CORES``.
Every step, including those that found nothing, is recorded in `DeviceSpec.evidence`.

Values a person typed (the override, the ``NEURON_*`` variables, an instance name) raise
`ValueError` naming the bad value and the valid ones. Values the machine reported (an
unreadable sysfs file, a missing, hanging or garbled ``neuron-ls``) are logged and the next
evidence is tried. On a machine with no accelerator `detect()` returns a ``cpu`` spec.

Nothing here runs at import time: JAX is imported, and its backends started, only when
`detect()` reaches step 2.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHIPS",
    "INSTANCES",
    "ChipFacts",
    "DeviceSpec",
    "ENGINE_RATES",
    "EngineRates",
    "Evidence",
    "InstanceFacts",
    "NEURON_FAMILIES",
    "detect",
    "engine_rates",
    "from_instance_type",
    "looks_like_neuron",
    "parse_bytes",
    "parse_device",
]

logger = logging.getLogger(__name__)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

NEURON_FAMILIES = ("trn1", "trn2", "trn3", "inf2")
OTHER_FAMILIES = ("cpu", "gpu", "tpu", "unknown")

OVERRIDE_ENV = "NEURON_REMAT_DEVICE"


# --------------------------------------------------------------------------------------
# Hardware facts: one table per kind of fact, each row with its source.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChipFacts:
    """Published figures for one Neuron chip generation."""

    family: str
    chip: str
    physical_cores: int
    hbm_bytes: int
    lnc_options: tuple[int, ...]  # () where logical-core grouping does not exist
    default_lnc: int | None
    device_kinds: tuple[tuple[int | None, str], ...]  # (lnc, JAX device_kind)
    source: str
    verified: bool = True
    note: str = ""

    def cores_per_chip(self, lnc: int | None) -> int:
        """Logical cores per chip at `lnc` (physical cores where LNC does not apply)."""
        return self.physical_cores // lnc if lnc else self.physical_cores

    def hbm_per_core(self, lnc: int | None) -> int:
        return self.hbm_bytes // self.cores_per_chip(lnc)


_SDK = "aws-neuron-sdk about-neuron/arch/neuron-hardware/"

CHIPS: dict[str, ChipFacts] = {
    "inf2": ChipFacts(
        "inf2", "Inferentia2", 2, 32 * GiB, (), None, ((None, "NC_v2"),),
        source=_SDK + "inferentia2.rst; NC_v2 device kind: aws-neuron-sdk issue 1340",
        note="16 GiB per NeuronCore-v2 (driver address map: two 16 GiB HBMs per chip)",
    ),
    "trn1": ChipFacts(
        "trn1", "Trainium1", 2, 32 * GiB, (), None, ((None, "NC_v2"),),
        source=_SDK + "trainium.rst",
        note="16 GiB per NeuronCore-v2 (driver address map: two 16 GiB HBMs per chip)",
    ),
    "trn2": ChipFacts(
        "trn2", "Trainium2", 8, 96 * GiB, (1, 2), 2, ((1, "NC_v3"), (2, "NC_v3d")),
        source=_SDK + "trainium2.rst; LNC: Neuron training best-practices page "
        "('64 ranks per instance and approximately 24 GiB of HBM per rank')",
        note="LNC=2: 4 logical cores x 24 GiB; LNC=1: 8 cores sharing 24 GiB banks in "
        "pairs, about 12 GiB each (derived)",
    ),
    "trn3": ChipFacts(
        "trn3", "Trainium3", 8, 144 * GiB, (1, 2), 2, (),
        source=_SDK + "trainium3.rst",
        verified=False,
        note="per-core split derived, unverified (about 36 GiB per logical core at LNC=2); "
        "JAX device_kind strings unknown; override with NEURON_REMAT_DEVICE=trn3:hbm=...",
    ),
}


@dataclass(frozen=True)
class InstanceFacts:
    """One EC2 instance type: which chip, how many."""

    name: str
    family: str
    chips: int
    source: str
    verified: bool = True


def _instances(*rows: InstanceFacts) -> dict[str, InstanceFacts]:
    return {row.name: row for row in rows}


INSTANCES: dict[str, InstanceFacts] = _instances(
    InstanceFacts("inf2.xlarge", "inf2", 1, "aws-neuron-sdk inf2-arch.rst"),
    InstanceFacts("inf2.8xlarge", "inf2", 1, "aws-neuron-sdk inf2-arch.rst"),
    InstanceFacts("inf2.24xlarge", "inf2", 6, "aws-neuron-sdk inf2-arch.rst"),
    InstanceFacts("inf2.48xlarge", "inf2", 12, "aws-neuron-sdk inf2-arch.rst"),
    InstanceFacts("trn1.2xlarge", "trn1", 1, "aws-neuron-sdk trn1-arch.rst"),
    InstanceFacts("trn1.32xlarge", "trn1", 16, "aws-neuron-sdk trn1-arch.rst"),
    InstanceFacts("trn1n.32xlarge", "trn1", 16, "aws-neuron-sdk trn1-arch.rst"),
    InstanceFacts("trn2.48xlarge", "trn2", 16, "aws-neuron-sdk trn2-arch.rst"),
    InstanceFacts("trn2u.48xlarge", "trn2", 16, "aws-neuron-sdk trn2-arch.rst"),
    # neuron-ls documents this name in its trn2 example header.
    InstanceFacts("trn2n.48xlarge", "trn2", 16, "aws-neuron-sdk neuron-ls.rst example"),
    InstanceFacts("trn2.3xlarge", "trn2", 1, "third-party listings", verified=False),
)

# JAX device_kind -> (family, lnc). NC_v2 is shared by Trn1 and Inf2; other evidence
# (sysfs, DMI) tells them apart, and Trn1 is assumed when nothing does.
_DEVICE_KINDS: dict[str, tuple[str, int | None]] = {
    "NC_v2": ("trn1", None),
    "NC_v3": ("trn2", 1),
    "NC_v3d": ("trn2", 2),
}

# Names the sysfs architecture files, neuron-ls and people use for each family.
_FAMILY_WORDS: dict[str, str] = {
    "trn1": "trn1", "trainium": "trn1", "trainium1": "trn1", "trn1n": "trn1",
    "trn2": "trn2", "trainium2": "trn2", "trn2n": "trn2", "trn2u": "trn2", "trn2p": "trn2",
    "trn3": "trn3", "trainium3": "trn3",
    "inf2": "inf2", "inferentia2": "inf2",
}


# --------------------------------------------------------------------------------------
# The answer.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """One detection step: what it looked at and what it found."""

    step: str
    found: str
    decided: bool = False

    def __str__(self) -> str:
        mark = "*" if self.decided else "-"
        return f"{mark} {self.step}: {self.found}"


@dataclass(frozen=True)
class DeviceSpec:
    """The accelerator a plan is made for.

    Attributes:
        family: ``trn1``, ``trn2``, ``trn3``, ``inf2``; or ``cpu``, ``gpu``, ``tpu``,
            ``unknown`` for other backends.
        instance_type: the EC2 instance type, e.g. ``trn2.48xlarge``, when known.
        lnc: logical NeuronCore configuration (1 or 2) on TRN2/TRN3, else None.
        cores: logical cores visible to this process.
        cores_per_chip: logical cores per chip.
        hbm_bytes_per_core: HBM per logical core, before the runtime takes its share.
        source: the evidence that decided: ``override``, ``jax``, ``sysfs``,
            ``neuron-ls``, ``dmi``, ``instance_type`` or ``default``.
        verified: False when a figure rests on a row the sources mark unverified.
        device_kind: JAX's ``device_kind`` when JAX reported one.
        evidence: every step taken, in order (not part of equality).
    """

    family: str
    instance_type: str | None
    lnc: int | None
    cores: int
    cores_per_chip: int
    hbm_bytes_per_core: int
    source: str
    verified: bool = True
    device_kind: str | None = None
    evidence: tuple[Evidence, ...] = field(default=(), compare=False, repr=False)

    @property
    def is_neuron(self) -> bool:
        return self.family in NEURON_FAMILIES

    @property
    def physical_cores_per_core(self) -> int:
        """Physical NeuronCores behind one logical core (the LNC), 1 elsewhere."""
        return self.lnc or 1

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["hbm_gib_per_core"] = round(self.hbm_bytes_per_core / GiB, 3)
        out["is_neuron"] = self.is_neuron
        out["evidence"] = [dataclasses.asdict(e) for e in self.evidence]
        return out

    def describe(self) -> str:
        """One line for this device (what `detect`, `plan`, `fit` and the plugin's logs
        print)."""
        from ._format import describe_device  # noqa: PLC0415 - _format imports this module

        return describe_device(self)


# --------------------------------------------------------------------------------------
# Parsing what people type.
# --------------------------------------------------------------------------------------

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


def _ascii_int(text: str, *, what: str, low: int, high: int, valid: str) -> int:
    """A plain ASCII integer in ``low..high`` (no signs, no other scripts' digits)."""
    raw = text.strip()
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


def _spec(
    family: str,
    *,
    instance: InstanceFacts | None,
    lnc: int | None,
    source: str,
    chips: int | None = None,
    cores: int | None = None,
    hbm: int | None = None,
    device_kind: str | None = None,
    evidence: tuple[Evidence, ...] = (),
) -> DeviceSpec:
    chip = CHIPS[family]
    per_chip = chip.cores_per_chip(lnc)
    if chips is None:
        chips = instance.chips if instance else 1
    verified = chip.verified and (instance.verified if instance else True)
    if hbm is not None:
        verified = True  # the user or the machine gave the figure
    return DeviceSpec(
        family=family,
        instance_type=instance.name if instance else None,
        lnc=lnc,
        cores=cores if cores is not None else chips * per_chip,
        cores_per_chip=per_chip,
        hbm_bytes_per_core=hbm if hbm is not None else chip.hbm_per_core(lnc),
        source=source,
        verified=verified,
        device_kind=device_kind,
        evidence=evidence,
    )


def _cpu_spec(family: str, source: str, evidence: tuple[Evidence, ...], cores: int = 1,
              device_kind: str | None = None) -> DeviceSpec:
    return DeviceSpec(family=family, instance_type=None, lnc=None, cores=cores,
                      cores_per_chip=cores, hbm_bytes_per_core=0, source=source,
                      device_kind=device_kind, evidence=evidence)


def from_instance_type(name: str, *, lnc: int | None = None) -> DeviceSpec:
    """The spec of a whole instance, for planning on a machine that is not the target.

    >>> from_instance_type("trn2.48xlarge").cores
    64
    """
    key = name.strip().lower()
    if key not in INSTANCES:
        raise ValueError(
            f"unknown instance type {name!r}; known: {', '.join(sorted(INSTANCES))}"
        )
    inst = INSTANCES[key]
    lnc = _resolve_lnc(inst.family, lnc, what=f"instance {name!r}")
    return _spec(inst.family, instance=inst, lnc=lnc, source="instance_type",
                 evidence=(Evidence("instance_type", f"{key}, LNC={lnc}", True),))


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
        piece = piece.strip()
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
    raw = environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
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


# --------------------------------------------------------------------------------------
# Evidence from the machine. Each probe returns a partial answer or None, and never
# raises for what the machine reported.
# --------------------------------------------------------------------------------------


@dataclass
class _Probe:
    family: str | None = None
    instance: InstanceFacts | None = None
    chips: int | None = None
    cores: int | None = None  # logical cores as the probe counted them
    lnc: int | None = None
    hbm: int | None = None
    device_kind: str | None = None
    provisional: bool = False  # the family could be another with the same signature


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(4096).strip()  # sysfs and DMI files are a line; never a stream
    except FileNotFoundError:
        return None
    except OSError as err:  # PermissionError for root-only (0400) files, EIO, ...
        logger.info("neuron_remat: cannot read %s (%s); ignoring it", path, err)
        return None


def _family_word(text: str | None) -> str | None:
    if not text:
        return None
    word = text.strip().lower()
    if word in INSTANCES:
        return INSTANCES[word].family
    return _FAMILY_WORDS.get(word) or _FAMILY_WORDS.get(word.split(".")[0])


def _probe_jax(notes: list[Evidence]) -> tuple[_Probe | None, str | None, int]:
    """(neuron probe, other family, local device count) from JAX; (None, None, 0) when
    JAX cannot say."""
    try:
        import jax  # noqa: PLC0415  (imported on first detection, never at import time)

        backend = jax.default_backend()
        devices = jax.local_devices()
    except Exception as err:  # noqa: BLE001  a broken plugin must not break detection
        notes.append(Evidence("jax", f"unavailable ({type(err).__name__}: {err})"))
        return None, None, 0
    kind = getattr(devices[0], "device_kind", None) if devices else None
    if backend == "neuron":
        family, lnc = _DEVICE_KINDS.get(kind or "", (None, None))
        desc = f"backend neuron, device_kind {kind!r}, {len(devices)} local devices"
        if family is None:
            desc += " (device_kind not recognised: family taken from later evidence)"
        notes.append(Evidence("jax", desc))
        # NC_v2 is both Trn1 and Inf2: later evidence may say which.
        probe = _Probe(family=family, cores=len(devices), lnc=lnc, device_kind=kind,
                       provisional=kind == "NC_v2")
        return probe, None, len(devices)
    other = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(
        backend, "unknown")
    notes.append(Evidence("jax", f"backend {backend!r} ({len(devices)} local devices, "
                                 f"device_kind {kind!r})"))
    return None, other, len(devices)


def _probe_sysfs(root: str, notes: list[Evidence]) -> _Probe | None:
    base = os.path.join(root, "sys/devices/virtual/neuron_device")
    devs = sorted(glob.glob(os.path.join(base, "neuron[0-9]*")))
    if not devs:
        notes.append(Evidence("sysfs", f"no Neuron devices under {base}"))
        return None
    arch = os.path.join(devs[0], "info", "architecture")
    words = {n: _read(os.path.join(arch, n)) for n in ("arch_type", "device_name", "instance_type")}
    family = None
    for name in ("arch_type", "device_name", "instance_type"):
        family = family or _family_word(words[name])
    inst_text = (words["instance_type"] or "").lower()
    instance = INSTANCES.get(inst_text)
    physical = _read(os.path.join(devs[0], "core_count"))
    shown = ", ".join(f"{k}={v!r}" for k, v in words.items() if v is not None) or "unreadable"
    notes.append(Evidence(
        "sysfs", f"{len(devs)} devices; {shown}"
        + (f"; core_count={physical}" if physical and physical.isdigit() else "")
        + ("" if family else "; family not recognised")))
    return _Probe(family=family, instance=instance, chips=len(devs))


def _find_neuron_ls(root: str, environ: Mapping[str, str]) -> str | None:
    path = environ.get("PATH", os.defpath)
    extra = os.path.join(root, "opt/aws/neuron/bin")
    return shutil.which("neuron-ls", path=os.pathsep.join([path, extra]))


def _probe_neuron_ls(root: str, environ: Mapping[str, str], timeout: float,
                     notes: list[Evidence]) -> _Probe | None:
    if not glob.glob(os.path.join(root, "dev/neuron[0-9]*")):
        notes.append(Evidence("neuron-ls", "not run: no /dev/neuron* device nodes"))
        return None
    exe = _find_neuron_ls(root, environ)
    if exe is None:
        notes.append(Evidence("neuron-ls", "not found on PATH or in /opt/aws/neuron/bin"))
        logger.info("neuron_remat: /dev/neuron* exists but neuron-ls is not installed")
        return None
    try:
        run = subprocess.run([exe, "-j"], capture_output=True, text=True, timeout=timeout,
                             env=dict(environ), check=False)
    except subprocess.TimeoutExpired:
        notes.append(Evidence("neuron-ls", f"timed out after {timeout:g} s"))
        logger.warning("neuron_remat: %s -j hung for %.3g s; ignoring it", exe, timeout)
        return None
    except OSError as err:
        notes.append(Evidence("neuron-ls", f"could not run ({err})"))
        return None
    try:
        chips = json.loads(run.stdout)
        if not isinstance(chips, list) or not chips or not all(isinstance(c, dict) for c in chips):
            raise ValueError("expected a non-empty JSON list of device objects")
        nc = [int(c["nc_count"]) for c in chips]
        mem = int(chips[0]["memory_size"])
        lnc_raw = chips[0].get("logical_neuroncore_config")
        lnc = int(lnc_raw) if lnc_raw is not None else None
    except (ValueError, KeyError, TypeError) as err:
        snippet = (run.stdout or run.stderr or "").strip()[:80]
        notes.append(Evidence("neuron-ls", f"unusable output ({err}): {snippet!r}"))
        logger.warning("neuron_remat: neuron-ls -j printed unusable output (%s)", err)
        return None
    family = {96 * GiB: "trn2", 144 * GiB: "trn3", 32 * GiB: "trn1"}.get(mem)
    notes.append(Evidence(
        "neuron-ls", f"{len(chips)} devices, nc_count {nc[0]}, memory_size {mem}, LNC {lnc}"))
    return _Probe(family=family, chips=len(chips), cores=sum(nc), lnc=lnc,
                  provisional=family == "trn1",  # 32 GiB per device: Trn1 or Inf2
                  hbm=mem // nc[0] if nc[0] else None)


def _probe_dmi(root: str, notes: list[Evidence]) -> _Probe | None:
    dmi = os.path.join(root, "sys/devices/virtual/dmi/id")
    vendor = _read(os.path.join(dmi, "sys_vendor"))
    product = _read(os.path.join(dmi, "product_name"))
    if product is None:
        notes.append(Evidence("dmi", "no product_name"))
        return None
    name = product.strip().lower()
    if vendor is not None and not vendor.lower().startswith("amazon"):
        notes.append(Evidence("dmi", f"sys_vendor {vendor!r} is not Amazon EC2"))
        return None
    if name in INSTANCES:
        notes.append(Evidence("dmi", f"product_name {product!r}, sys_vendor {vendor!r}"))
        return _Probe(family=INSTANCES[name].family, instance=INSTANCES[name])
    notes.append(Evidence("dmi", f"product_name {product!r} is not a Neuron instance"))
    return None


# --------------------------------------------------------------------------------------
# detect()
# --------------------------------------------------------------------------------------

_CACHE: dict[tuple[Any, ...], DeviceSpec] = {}
_LOCK = threading.Lock()
_ENV_KEYS = (OVERRIDE_ENV, "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VISIBLE_CORES",
             "NEURON_RT_NUM_CORES")


def detect(
    *,
    refresh: bool = False,
    root: str = "/",
    environ: Mapping[str, str] | None = None,
    use_jax: bool = True,
    neuron_ls_timeout: float = 5.0,
) -> DeviceSpec:
    """Detect the device this process trains on (see the module docstring for the order).

    The answer is cached per process, per `root` and per value of the ``NEURON_*``
    variables that matter; ``refresh=True`` looks again. Thread-safe.

    Args:
        refresh: ignore the cache and look again.
        root: filesystem root for sysfs, DMI and ``/dev`` (tests lay out fake trees).
        environ: environment to read (default ``os.environ``).
        use_jax: ask JAX (step 2). Off, detection never starts a JAX backend.
        neuron_ls_timeout: seconds ``neuron-ls -j`` may take.
    """
    if isinstance(neuron_ls_timeout, bool) or not isinstance(neuron_ls_timeout, (int, float)) \
            or not 0 < neuron_ls_timeout <= 600:  # NaN fails too
        raise ValueError(f"neuron_ls_timeout={neuron_ls_timeout!r}: give seconds above 0 and "
                         "at most 600")
    env = os.environ if environ is None else environ
    key = (os.path.abspath(root), use_jax, neuron_ls_timeout, env.get("PATH"),
           tuple(env.get(k) for k in _ENV_KEYS))
    with _LOCK:
        if not refresh and key in _CACHE:
            return _CACHE[key]
        spec = _detect(root, env, use_jax, neuron_ls_timeout)
        _CACHE[key] = spec
    logger.info("neuron_remat: detected %s", spec.describe())
    return spec


def looks_like_neuron(*, root: str = "/", environ: Mapping[str, str] | None = None) -> bool:
    """A cheap guess, for checks that must not probe: True when ``NEURON_REMAT_DEVICE``
    names a Neuron device, an earlier `detect` found one, or Neuron device nodes or sysfs
    entries exist. Never raises, never asks JAX or runs ``neuron-ls``."""
    env = os.environ if environ is None else environ
    override = env.get(OVERRIDE_ENV, "").strip()
    if override:
        try:
            return parse_device(override, environ=env).is_neuron
        except ValueError:
            return False
    if any(spec.is_neuron for spec in list(_CACHE.values())):
        return True
    return bool(glob.glob(os.path.join(root, "dev/neuron[0-9]*")) or glob.glob(
        os.path.join(root, "sys/devices/virtual/neuron_device/neuron[0-9]*")))


def _detect(root: str, env: Mapping[str, str], use_jax: bool, timeout: float) -> DeviceSpec:
    override = env.get(OVERRIDE_ENV, "").strip()
    if override:
        return parse_device(override, source="override", environ=env)
    notes: list[Evidence] = [Evidence("override", f"{OVERRIDE_ENV} not set")]

    jax_probe, other, n_local = None, None, 0
    if use_jax:
        jax_probe, other, n_local = _probe_jax(notes)
    else:
        notes.append(Evidence("jax", "skipped (use_jax=False)"))
    if other in ("gpu", "tpu", "unknown"):
        return _cpu_spec(other, "jax", _mark_decided(notes, "jax"), cores=max(n_local, 1))

    probes: list[tuple[str, _Probe]] = []
    if jax_probe is not None:
        probes.append(("jax", jax_probe))
    sysfs = _probe_sysfs(root, notes)
    if sysfs is not None:
        probes.append(("sysfs", sysfs))
    if sysfs is None or sysfs.family is None:
        ls = _probe_neuron_ls(root, env, timeout, notes)
        if ls is not None:
            probes.append(("neuron-ls", ls))
    else:
        notes.append(Evidence("neuron-ls", "not needed: sysfs answered"))
    dmi = _probe_dmi(root, notes)
    if dmi is not None:
        probes.append(("dmi", dmi))

    found = [(name, p) for name, p in probes if p.family]
    decided = found[0] if found else None
    if decided is not None and decided[1].provisional:  # Trn1 or Inf2: ask the rest
        decided = next(((name, p) for name, p in found[1:]
                        if not p.provisional and p.family in ("trn1", "inf2")), decided)
    if decided is None:
        if jax_probe is not None:  # neuron backend with an unknown device kind
            notes.append(Evidence("default", "Neuron backend of unknown generation"))
            return _cpu_spec("unknown", "jax", _mark_decided(notes, "jax"),
                             cores=jax_probe.cores or 1, device_kind=jax_probe.device_kind)
        source = "jax" if other == "cpu" else "default"
        notes.append(Evidence("default", "no Neuron hardware found: cpu"))
        return _cpu_spec("cpu", source, _mark_decided(notes, source))

    source, first = decided
    family = first.family
    assert family is not None
    # Later evidence fills what earlier evidence left open; it never overrides a family
    # (but for telling Inf2 from Trn1, above).
    instance = next((p.instance for _, p in probes if p.instance and p.instance.family == family), None)
    lnc = next((p.lnc for _, p in probes if p.lnc is not None), None)
    env_lnc = _lnc_from_env(env, family)
    if lnc is None:
        lnc = env_lnc
    elif env_lnc is not None and env_lnc != lnc:
        notes.append(Evidence("env", f"NEURON_LOGICAL_NC_CONFIG={env_lnc} disagrees with the "
                                     f"hardware's LNC={lnc}; using the hardware's"))
    lnc = _resolve_lnc(family, lnc, what="detected device")
    chips = next((p.chips for _, p in probes if p.chips), None)
    per_chip = CHIPS[family].cores_per_chip(lnc)
    total = chips * per_chip if chips else (instance.chips * per_chip if instance else None)
    hbm = next((p.hbm for _, p in probes if p.hbm), None)
    kind = jax_probe.device_kind if jax_probe else None
    if jax_probe is not None and jax_probe.cores:
        cores = jax_probe.cores  # the runtime has already applied the visible-core variables
        _visible_cores(env, total)  # but a bad value is refused here too, as on every path
        applied = [f"{k}={_show(env[k], 40)[1:-1]}" for k in
                   ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES") if env.get(k, "").strip()]
        if applied:
            notes.append(Evidence("env", f"{', '.join(applied)}: already applied by the "
                                         f"runtime, which shows JAX {cores} cores"))
    else:
        n, visible_note = _visible_cores(env, total)
        cores = n if n is not None else (total or per_chip)
        if visible_note:
            notes.append(Evidence("env", visible_note))
    return _spec(family, instance=instance, lnc=lnc, source=source, chips=chips, cores=cores,
                 hbm=hbm, device_kind=kind, evidence=_mark_decided(notes, source))


def _mark_decided(notes: list[Evidence], step: str) -> tuple[Evidence, ...]:
    """Flag the first note of the deciding step."""
    out, done = [], False
    for note in notes:
        if not done and note.step == step:
            note, done = dataclasses.replace(note, decided=True), True
        out.append(note)
    return tuple(out)


# --------------------------------------------------------------------------------------
# Engine rates, for the time objective (`graph.op_seconds`).
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineRates:
    """Peak rates of one core (the unit a `LayerGraph` describes), per engine.

    Attributes:
        name: a short key (``trn2-core``, ``h100-sxm``, ``h200-sxm``).
        tensor_flops: matmul FLOP/s (bf16 dense).
        vector_flops: elementwise and reduction FLOP/s (fp32).
        scalar_flops: transcendental (exp, tanh, rsqrt, ...) FLOP/s (fp32): one per element.
        hbm_bytes_per_s: HBM bandwidth one core gets.
        source: where the figures come from.
        derived: what was computed from the published figures, in words.
    """

    name: str
    tensor_flops: float
    vector_flops: float
    scalar_flops: float
    hbm_bytes_per_s: float
    source: str
    derived: str = ""

    def scaled(self, cores: int, name: str | None = None) -> EngineRates:
        """The rates of `cores` of these cores working as one (a TRN2 logical core at
        LNC=2 is two physical cores)."""
        if cores == 1:
            return self
        return dataclasses.replace(
            self, name=name or f"{self.name}x{cores}", tensor_flops=self.tensor_flops * cores,
            vector_flops=self.vector_flops * cores, scalar_flops=self.scalar_flops * cores,
            hbm_bytes_per_s=self.hbm_bytes_per_s * cores,
            derived=(self.derived + "; " if self.derived else "") + f"x{cores} cores")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ENGINE_RATES: dict[str, EngineRates] = {
    # One physical NeuronCore-v3. Engines: aws-neuron-sdk about-neuron/arch/neuron-hardware/
    # neuron-core-v3.rst and trainium2.rst (tensor ~79 TFLOP/s bf16 dense per core, vector
    # ~1.0 and scalar ~1.2 TFLOP/s fp32); HBM 2.9 TB/s per chip shared by 8 physical cores.
    "trn2-core": EngineRates(
        "trn2-core", 79e12, 1.0e12, 1.2e12, 2.9e12 / 8,
        source="aws-neuron-sdk about-neuron/arch/neuron-hardware/trainium2.rst and "
        "neuron-core-v3.rst (tensor ~79 TFLOP/s bf16, vector ~1.0, scalar ~1.2 TFLOP/s "
        "fp32 per physical core; HBM 2.9 TB/s per chip)",
        derived="HBM per physical core = 2.9 TB/s / 8 cores"),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 tensor 989 TFLOP/s dense (1,979
    # with sparsity), FP32 67 TFLOP/s, HBM3 3.35 TB/s.
    "h100-sxm": EngineRates(
        "h100-sxm", 989e12, 67e12, 67e12, 3.35e12,
        source="NVIDIA H100 Tensor Core GPU datasheet, SXM column (BF16 tensor 1,979 "
        "TFLOP/s with sparsity = 989 dense; FP32 67 TFLOP/s; 3.35 TB/s)",
        derived="transcendentals priced at the FP32 rate (the datasheet gives no SFU rate)"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM, HBM3e 4.8 TB/s.
    "h200-sxm": EngineRates(
        "h200-sxm", 989e12, 67e12, 67e12, 4.8e12,
        source="NVIDIA H200 Tensor Core GPU datasheet, SXM column (BF16 tensor 1,979 "
        "TFLOP/s with sparsity = 989 dense; FP32 67 TFLOP/s; 4.8 TB/s)",
        derived="transcendentals priced at the FP32 rate (the datasheet gives no SFU rate)"),
}
"""Per-core engine rates the time objective prices ops with; `engine_rates(device)` picks
one for a `DeviceSpec`."""


def engine_rates(device: DeviceSpec | None, name: str | None = None) -> EngineRates | None:
    """The rates of one core of `device` (or the `ENGINE_RATES` entry `name`), or None when
    no figures are known (the time objective then cannot be used).

    TRN2: a logical core is `DeviceSpec.physical_cores_per_core` physical cores. GPUs: by
    JAX's ``device_kind`` (``NVIDIA H100 80GB HBM3``, ``NVIDIA H200``)."""
    if name is not None:
        if name not in ENGINE_RATES:
            raise ValueError(f"rates={name!r} is not a known device; valid: "
                             f"{', '.join(ENGINE_RATES)}")
        return ENGINE_RATES[name]
    if device is None:
        return None
    if device.family == "trn2":
        lnc = device.physical_cores_per_core
        return ENGINE_RATES["trn2-core"].scaled(lnc, f"trn2-lnc{lnc}")
    kind = (device.device_kind or "").upper()
    if device.family == "gpu" and "H200" in kind:
        return ENGINE_RATES["h200-sxm"]
    if device.family == "gpu" and "H100" in kind:
        return ENGINE_RATES["h100-sxm"]
    return None
