"""neuron_remat: plan and inject JAX remat (checkpoint) policies that fit Trainium HBM at
the least recompute.

    >>> import neuron_remat as nr
    >>> spec = nr.from_instance_type("trn2.48xlarge")
    >>> plan = nr.plan(spec, nr.get_model("fuji-70b"), nr.StepShape(seq_len=4096),
    ...                nr.Parallelism(tp=4, fsdp=-1, hosts=8))
    >>> layer = nr.checkpoint(my_layer, stack="stacked", model="fuji-70b")  # doctest: +SKIP

Nothing here touches hardware or starts JAX's backends at import time.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below, for type checkers; at run time each loads on first use
    from ._trace import traced_footprint
    from ._audit import AuditReport, audit
    from .device import DeviceSpec, detect, from_instance_type, parse_device
    from ._compile import Probe
    from ._fit import CompiledFit, fit, fit_table
    from ._mix import fit_per_layer
    from .memory_model import (Budget, Footprint, TagCost, budget, layer_footprint,
                               model_state_bytes)
    from .models import (AXLEARN_TAGS, MAXTEXT_TAGS, MODELS, Parallelism, StepShape,
                         TagNames, TransformerConfig, from_hf_config, get_model)
    from .multihost import PolicyMismatchError
    from ._plan import LayerMix, NoFitError, Plan
    from .planner import plan, plan_footprint
    from .plugin import RematChoice, checkpoint, provide, resolve_policy
    from .policies import PRESETS, RegexPolicy, preset, save_and_offload_only_these_names_regex
    from .stack import scan_layers

# Public name -> the module that defines it. Loaded lazily (PEP 562), so that importing the
# package, and the CLI's `--help`, `detect` and `models`, never import JAX.
_EXPORTS = {
    "traced_footprint": "_trace",
    "AuditReport": "_audit", "audit": "_audit",
    "DeviceSpec": "device", "detect": "device", "from_instance_type": "device",
    "parse_device": "device",
    "fit": "_fit", "fit_per_layer": "_mix", "fit_table": "_fit",
    "Budget": "memory_model", "Footprint": "memory_model", "TagCost": "memory_model",
    "budget": "memory_model", "layer_footprint": "memory_model",
    "model_state_bytes": "memory_model",
    "AXLEARN_TAGS": "models", "MAXTEXT_TAGS": "models", "MODELS": "models",
    "Parallelism": "models", "StepShape": "models", "TagNames": "models",
    "TransformerConfig": "models", "from_hf_config": "models", "get_model": "models",
    "load_hf_config": "models",
    "PolicyMismatchError": "multihost",
    "CompiledFit": "_fit", "Probe": "_compile", "CompileFailedError": "_compile",
    "StepTraceError": "_step", "AmbiguousInputError": "_jaxpr",
    "UnsupportedPrimitiveError": "_trace",
    "LayerMix": "_plan", "NoFitError": "_plan", "Plan": "_plan",
    "plan": "planner", "plan_footprint": "planner",
    "RematChoice": "plugin", "checkpoint": "plugin", "provide": "plugin",
    "resolve_policy": "plugin",
    "PRESETS": "policies", "RegexPolicy": "policies", "preset": "policies",
    "save_and_offload_only_these_names_regex": "policies",
    "scan_layers": "stack",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"

__all__ = [
    "AXLEARN_TAGS", "MAXTEXT_TAGS", "MODELS", "PRESETS", "AuditReport", "Budget",
    "CompiledFit", "DeviceSpec", "Footprint", "NoFitError", "Parallelism", "Plan",
    "PolicyMismatchError", "Probe", "RegexPolicy", "RematChoice", "StepShape", "TagCost",
    "TagNames", "TransformerConfig", "audit", "budget", "checkpoint", "detect", "fit",
    "fit_table", "from_hf_config", "from_instance_type", "get_model", "layer_footprint",
    "load_hf_config",
    "model_state_bytes", "parse_device", "plan", "plan_footprint", "preset", "provide",
    "resolve_policy",
    "scan_layers", "fit_per_layer", "LayerMix", "AmbiguousInputError", "CompileFailedError",
    "StepTraceError", "UnsupportedPrimitiveError",
    "save_and_offload_only_these_names_regex", "traced_footprint",
]
