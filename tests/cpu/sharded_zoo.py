"""The zoo's scanned steps laid out over several devices, as training runs (test fixtures).

A TRN2 job splits its step over cores: the batch over data-parallel devices, and with
fully sharded data parallelism (FSDP) the parameters and optimizer state too. `jax.jit`
then compiles one program per device (XLA's SPMD partitioner), whose ``memory_analysis()``
is one device's, while the step's jaxpr keeps global shapes. Each `Sharded` step is a
`zoo.Spec` with the batch times `devices`, over a one-axis mesh of that many devices:

- ``dp``: the batch split over the devices, the state replicated on each;
- ``fsdp``: the batch split, and every state array split along its largest dimension the
  device count divides (the layers' stacked weights along a feature dimension, the
  embedding along the vocabulary), as FSDP shards them;
- ``tp``: a mesh of ``data`` x ``model`` (`devices` / 2 x 2), the batch split over
  ``data``, and Megatron's tensor parallelism over ``model``: the q, k, v and the FFN's
  input projections split by output unit (heads, hidden units), the attention output and
  FFN output projections by input unit, the head by vocabulary; norms and embedding
  whole. The heads' and hidden units' activations are split over both axes, the
  residual stream (a layer's output) over ``data`` only.

Under ``dp`` and ``fsdp`` each device holds the base step's batch: a layer's residuals
are the base step's.
The steps follow zoo.py's protocol (benchmarks/fit_sweep.py ``--steps-module
tests.cpu.sharded_zoo --host-devices 8``). JAX must see the devices: XLA:CPU makes them
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``, read when JAX's backend
starts (a test runs these in a subprocess with it set). None of these steps was looked at
while `fit`'s search constants were chosen: they are all ``held-out``, whatever their
base step's split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

try:
    from . import host_devices, zoo
except ImportError:  # imported with tests/cpu on sys.path (fit_sweep's steps modules)
    import host_devices  # type: ignore[no-redef]
    import zoo  # type: ignore[no-redef]

MODES = ("dp", "fsdp", "tp")
_BY_OUTPUT = {"wq", "wk", "wv", "wqkv", "w1a", "w1b", "head"}  # split along the last axis
_BY_INPUT = {"wo", "w2"}  # split along the axis before it


@dataclass(frozen=True)
class Sharded:
    """`base` over a mesh of `devices` devices in `mode` (one of `MODES`)."""

    base: zoo.Spec
    mode: str
    devices: int = 8

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: one of {MODES}")

    @property
    def name(self) -> str:
        if self.mode == "tp":
            return f"{self.base.name}-dp{self.devices // 2}tp2"
        return f"{self.base.name}-{self.mode}{self.devices}"

    split = "held-out"

    @property
    def note(self) -> str:
        return (f"{self.base.name} ({self.base.split}) with the batch x{self.devices} over "
                f"{self.devices} devices, {self.mode}")

    @property
    def extra(self) -> dict[str, Any]:
        return self.base.extra

    @property
    def scan(self) -> bool:
        return self.base.scan

    def spec(self) -> zoo.Spec:
        return dataclasses.replace(self.base, batch=self.base.batch * self.devices)

    def make_step(self) -> Any:
        return self.spec().make_step()

    def mesh(self) -> jax.sharding.Mesh:
        found = host_devices.first(self.devices, self.name)
        if self.mode == "tp":
            return jax.sharding.Mesh(np.array(found).reshape(-1, 2), ("data", "model"))
        return jax.sharding.Mesh(np.array(found), ("data",))

    def abstract_args(self) -> tuple[Any, Any]:
        mesh = self.mesh()
        state, tokens = self.spec().abstract_args()
        P = jax.sharding.PartitionSpec

        def placed(path: Any, a: Any) -> Any:
            spec = P()
            if self.mode == "fsdp":
                dims = [i for i, n in enumerate(a.shape) if n % self.devices == 0]
                if dims:
                    at = max(dims, key=lambda i: (a.shape[i], -i))
                    spec = P(*[None] * at, "data")
            elif self.mode == "tp" and a.ndim >= 2:
                name = next((str(getattr(k, "key", "")) for k in reversed(path)
                             if getattr(k, "key", None) is not None), "")
                at = a.ndim - 1 if name in _BY_OUTPUT else a.ndim - 2 if name in _BY_INPUT \
                    else None
                if at is not None and a.shape[at] % 2 == 0:
                    spec = P(*[None] * at, "model")
            return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                        sharding=jax.sharding.NamedSharding(mesh, spec))

        return (jax.tree_util.tree_map_with_path(placed, state),
                jax.ShapeDtypeStruct(tokens.shape, tokens.dtype,
                                     sharding=jax.sharding.NamedSharding(mesh, P("data"))))


STEPS: dict[str, Sharded] = {
    s.name: s for s in (Sharded(spec, mode) for spec in zoo.ZOO.values() if spec.scan
                        for mode in MODES)}
