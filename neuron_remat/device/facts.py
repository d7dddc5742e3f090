"""Published facts about the hardware: chips, instances and engine rates, each row with
its source. Plain data and lookups; nothing here reads the machine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .spec import DeviceSpec

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

NEURON_FAMILIES = ("trn1", "trn2", "trn3", "inf2")
OTHER_FAMILIES = ("cpu", "gpu", "tpu", "unknown")


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
