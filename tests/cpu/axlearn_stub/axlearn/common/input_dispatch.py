"""Stand-in for axlearn.common.input_dispatch (apple/axlearn 34aed43c): ``BaseInputDispatcher``
(its Config's ``global_logical_batch_size`` is REQUIRED, input_dispatch.py:35) and
``SpmdInputDispatcher`` (input_dispatch.py:328, adding ``partition_spec``), which
``experiments/text/gpt/common.py``'s ``get_trainer_config_fn`` sets as the input's dispatcher
(common.py:732-741)."""

from __future__ import annotations

from typing import Any, Optional

from axlearn.common.config import REQUIRED, Configurable, Required, config_class


class BaseInputDispatcher(Configurable):
    @config_class
    class Config(Configurable.Config):
        global_logical_batch_size: Required[int] = REQUIRED


class SpmdInputDispatcher(BaseInputDispatcher):
    @config_class
    class Config(BaseInputDispatcher.Config):
        partition_spec: Optional[Any] = None
