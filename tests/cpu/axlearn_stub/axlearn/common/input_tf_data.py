"""Stand-in for axlearn.common.input_tf_data (apple/axlearn 34aed43c): ``Input``
(input_tf_data.py:1228), the input Fuji's trainer configs use (``experiments/text/gpt/
common.py``:738). It adds to ``input_base.Input.Config`` the REQUIRED ``is_training``,
``source`` and ``processor`` and a ``batcher`` (input_tf_data.py:1242-1259); ``identity``
(input_tf_data.py:1038) is the processor ``get_trainer_config_fn`` sets."""

from __future__ import annotations

from typing import Any

from axlearn.common import input_base
from axlearn.common.config import REQUIRED, Required, config_class, config_for_function


def identity() -> Any:
    return lambda ds: ds


def batch(global_batch_size: int) -> Any:
    return lambda ds: ds


class Input(input_base.Input):
    @config_class
    class Config(input_base.Input.Config):
        is_training: Required[bool] = REQUIRED
        source: Required[Any] = REQUIRED
        processor: Required[Any] = REQUIRED
        batcher: Any = config_for_function(batch)
