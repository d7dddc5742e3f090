"""neuron_remat: plan and inject JAX remat (checkpoint) policies that fit Trainium HBM at
the least recompute.

    >>> import neuron_remat as nr
    >>> spec = nr.from_instance_type("trn2.48xlarge")
    >>> plan = nr.plan(spec, nr.get_model("fuji-70b"), nr.StepShape(seq_len=4096),
    ...                nr.Parallelism(tp=4, fsdp=-1, hosts=8))
    >>> layer = nr.checkpoint(my_layer, stack="stacked", model="fuji-70b")  # doctest: +SKIP

Nothing here touches hardware or starts JAX's backends at import time.
"""

from .device import DeviceSpec, detect, from_instance_type, parse_device
from ._trace import traced_footprint
from .audit import AuditReport, audit
from .memory_model import Budget, Footprint, TagCost, budget, layer_footprint, model_state_bytes
from .models import (
    AXLEARN_TAGS,
    MAXTEXT_TAGS,
    MODELS,
    Parallelism,
    StepShape,
    TagNames,
    TransformerConfig,
    from_hf_config,
    get_model,
)
from .planner import CompiledFit, LayerMix, NoFitError, Plan, Probe, plan
from .fit import fit, fit_per_layer, fit_table
from .multihost import PolicyMismatchError
from .plugin import RematChoice, checkpoint, provide, resolve_policy
from .stack import scan_layers
from .policies import PRESETS, RegexPolicy, preset, save_and_offload_only_these_names_regex

__version__ = "0.1.0"

__all__ = [
    "AXLEARN_TAGS", "MAXTEXT_TAGS", "MODELS", "PRESETS", "AuditReport", "Budget",
    "CompiledFit", "DeviceSpec", "Footprint", "NoFitError", "Parallelism", "Plan",
    "PolicyMismatchError", "Probe", "RegexPolicy", "RematChoice", "StepShape", "TagCost",
    "TagNames", "TransformerConfig", "audit", "budget", "checkpoint", "detect", "fit",
    "fit_table", "from_hf_config", "from_instance_type", "get_model", "layer_footprint",
    "model_state_bytes", "parse_device", "plan", "preset", "provide", "resolve_policy",
    "scan_layers", "fit_per_layer", "LayerMix",
    "save_and_offload_only_these_names_regex", "traced_footprint",
]
