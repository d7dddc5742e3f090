"""Stand-in for the norms of axlearn.common.layers (34aed43c): ``BaseNormalizationLayer``
(layers.py:286), ``LayerNorm`` (336) and ``RMSNorm`` (403), with ``eps`` 1e-8,
``forward_dtype`` float32 and the partition-spec fields the TRN2 mesh rule sets
(layers.py:318-369), and ``Linear`` (715)."""

from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp

from axlearn.common.base_layer import BaseLayer
from axlearn.common.config import config_class


class BaseNormalizationLayer(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        eps: float = 1e-8
        forward_dtype: Optional[Any] = jnp.float32
        input_partition_spec: Optional[Any] = None
        output_partition_spec: Optional[Any] = None


class RMSNorm(BaseNormalizationLayer):
    pass


class LayerNorm(BaseNormalizationLayer):
    pass


class Linear(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        bias: bool = True
