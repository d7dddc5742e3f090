"""Stand-in for axlearn.common.input_base (apple/axlearn 34aed43c): ``Input`` (input_base.py:122),
the class ``trainer.SpmdTrainer.Config.input`` is typed with (trainer.py:39 imports it). Its
Config has no ``source``; ``input_dispatcher`` defaults to None (input_base.py:173)."""

from __future__ import annotations

from typing import Any, Optional

from axlearn.common.config import Configurable, config_class


class Input(Configurable):
    @config_class
    class Config(Configurable.Config):
        partition_spec: Optional[Any] = None
        input_dispatcher: Optional[Any] = None
        input_partitioner: Optional[Any] = None
