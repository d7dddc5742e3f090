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

The package has one module per concept, each importing only those before it:
`facts` (chips, instances, engine rates, with their sources) -> `spec` (`DeviceSpec`,
`Evidence`) -> `parsing` (sizes, the device text, the runtime's variables) -> `detection`
(the machine's evidence, `detect`, its cache). Every name is also here, as
``neuron_remat.device.X``.
"""

from .detection import _CACHE, _ENV_KEYS, _LOCK, detect, looks_like_neuron
from .facts import (CHIPS, ENGINE_RATES, INSTANCES, NEURON_FAMILIES, OTHER_FAMILIES, ChipFacts,
                    EngineRates, GiB, InstanceFacts, KiB, MiB, engine_rates)
from .parsing import (MAX_BYTES, MAX_HBM_PER_CORE, MAX_SIZE_CHARS, MIN_HBM_PER_CORE,
                      OVERRIDE_ENV, _parse_core_list, _show, as_device, from_instance_type,
                      parse_bytes, parse_device)
from .spec import DeviceSpec, Evidence

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
    "as_device",
    "detect",
    "engine_rates",
    "from_instance_type",
    "looks_like_neuron",
    "parse_bytes",
    "parse_device",
]
