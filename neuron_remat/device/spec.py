"""The answer: `DeviceSpec`, the device a plan is made for, and the `Evidence` behind it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .facts import CHIPS, NEURON_FAMILIES, GiB, InstanceFacts


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
        from .._format import describe_device  # noqa: PLC0415 - _format imports this module

        return describe_device(self)


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
