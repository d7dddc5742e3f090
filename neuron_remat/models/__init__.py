"""Model, step and parallelism descriptions, the built-in models and the Hugging Face
``config.json`` loader, one concept per module:

* `config`: `TransformerConfig` (one decoder layer, as far as activation memory is
  concerned) and its family extras, `MoEConfig` and `MLAConfig`;
* `shapes`: `StepShape` (one training step as a data-parallel replica sees it) and
  `Parallelism` (how the job is split over cores);
* `tags`: `TagNames`, what a host library calls each checkpointed value of a layer;
* `catalogue`: the built-in models, `MODELS` and `get_model`;
* `hf`: `from_hf_config` and `load_hf_config`.

Every public name is importable from ``neuron_remat.models`` itself.
"""

from .config import (_ROUTERS, ACTIVATIONS, ContextLimits, LayerDetails, MLAConfig, MoEConfig,
                     TransformerConfig, dtype_bytes)
from .tags import (_ALL_ROLES, AXLEARN_NEURON_TAGS, AXLEARN_TAGS, MAXTEXT_NEURON_TAGS,
                   MAXTEXT_TAGS, MLA_ROLES, MOE_ROLES, ROLES, TagNames, host_of, host_tags)
from .shapes import (_FLOAT_DTYPES, _MAX_OPT_BYTES, _MAX_SIZE, _OPTIMIZERS, _SCHEDULES,
                     Parallelism, StepShape, shape_notes)
from .catalogue import _ALIASES, MODELS, get_model
from .hf import from_hf_config, load_hf_config

__all__ = [
    "AXLEARN_NEURON_TAGS",
    "AXLEARN_TAGS",
    "MAXTEXT_NEURON_TAGS",
    "MAXTEXT_TAGS",
    "ACTIVATIONS",
    "ContextLimits",
    "LayerDetails",
    "MLAConfig",
    "MODELS",
    "MLA_ROLES",
    "MOE_ROLES",
    "MoEConfig",
    "ROLES",
    "Parallelism",
    "StepShape",
    "TagNames",
    "TransformerConfig",
    "dtype_bytes",
    "from_hf_config",
    "get_model",
    "host_of",
    "host_tags",
    "load_hf_config",
    "shape_notes",
]
