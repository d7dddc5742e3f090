"""Stand-in for axlearn.common.trainer (34aed43c): the SpmdTrainer.Config fields a mesh rule
and the adapter use, the input/learner configs beneath them (input_tf_data.Input,
input_dispatch.SpmdInputDispatcher, learner.Learner), and ``select_mesh_config``
(trainer.py:1414), which applies the first mesh rule whose regex fully matches."""

from __future__ import annotations

import re
from typing import Any, Optional

from axlearn.common.config import REQUIRED, Configurable, Required, config_class, maybe_instantiate


class SpmdInputDispatcher(Configurable):
    @config_class
    class Config(Configurable.Config):
        global_logical_batch_size: Required[int] = REQUIRED
        partition_spec: Optional[Any] = None


class Input(Configurable):
    @config_class
    class Config(Configurable.Config):
        is_training: bool = True
        source: Any = REQUIRED
        input_dispatcher: Any = SpmdInputDispatcher.default_config()


class Learner(Configurable):
    @config_class
    class Config(Configurable.Config):
        optimizer: Optional[Any] = None
        forward_fn_transformation: Optional[Any] = None


class SpmdTrainer(Configurable):
    @config_class
    class Config(Configurable.Config):
        name: str = "trainer"
        model: Any = REQUIRED
        input: Any = REQUIRED
        learner: Any = Learner.default_config()
        train_dtype: Any = "float32"
        mesh_shape: Optional[Any] = None
        mesh_axis_names: Optional[Any] = None
        mesh_rules: Optional[Any] = None
        batch_axis_names: Any = "data"


def select_mesh_config(trainer_config: Any, *, mesh_selector: str) -> None:
    for pattern, rule in trainer_config.mesh_rules or ():
        if re.fullmatch(pattern, mesh_selector):
            if isinstance(rule, tuple) or rule is None:
                trainer_config.mesh_shape = rule
            else:
                maybe_instantiate(rule)(trainer_config)
            return
