"""Stand-in for axlearn.common.causal_lm (apple/axlearn 34aed43c): ``Model`` (causal_lm.py:359),
whose Config holds ``decoder`` (a ``decoder.Decoder`` config, causal_lm.py:367) and, from
``BaseLayer``, ``dtype``. ``LmHead`` and ``Decoder`` live in ``axlearn.common.decoder``."""

from __future__ import annotations

from typing import Any

from axlearn.common.base_layer import BaseLayer
from axlearn.common.config import config_class
from axlearn.common.decoder import Decoder


class Model(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        decoder: Any = Decoder.default_config()
