"""Stand-in for axlearn.common.decoder (apple/axlearn 34aed43c): ``Decoder`` (decoder.py:467;
its Config fields ``vocab_size`` and ``dim`` REQUIRED, ``transformer`` defaulting to a
``StackedTransformerLayer`` config, ``output_norm`` to a ``LayerNorm`` config, ``lm_head`` to
None, which shares the embedding) and ``LmHead`` (decoder.py:921)."""

from __future__ import annotations

from typing import Any, Optional

from axlearn.common.attention import StackedTransformerLayer
from axlearn.common.base_layer import BaseLayer
from axlearn.common.config import REQUIRED, Required, config_class
from axlearn.common.layers import LayerNorm


class LmHead(BaseLayer):
    pass


class Decoder(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        vocab_size: Required[int] = REQUIRED
        dim: Required[int] = REQUIRED
        transformer: Any = StackedTransformerLayer.default_config()
        output_norm: Optional[Any] = LayerNorm.default_config()
        lm_head: Optional[Any] = None
