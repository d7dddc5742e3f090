"""Stand-in for axlearn.common.causal_lm.Model and axlearn.common.decoder (34aed43c): the
fields read (``model.dtype``, ``model.decoder.dim``, ``vocab_size``, ``transformer``,
``lm_head``: None when the embedding is shared)."""

from __future__ import annotations

from typing import Any, Optional

from axlearn.common.base_layer import BaseLayer
from axlearn.common.config import REQUIRED, Required, config_class


class LmHead(BaseLayer):
    pass


class Decoder(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        dim: Required[int] = REQUIRED
        vocab_size: Required[int] = REQUIRED
        transformer: Any = REQUIRED
        output_norm: Optional[Any] = None
        lm_head: Optional[Any] = None


class Model(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        decoder: Any = Decoder.default_config()
