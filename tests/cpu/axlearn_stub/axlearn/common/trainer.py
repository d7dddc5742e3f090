"""Stand-in for axlearn.common.trainer (apple/axlearn 34aed43c): the ``SpmdTrainer.Config``
fields a mesh rule and the adapter use (trainer.py:94-218: ``input``, ``mesh_shape``,
``mesh_axis_names``, ``model`` and ``learner`` REQUIRED, ``batch_axis_names`` "data",
``mesh_rules`` None, ``train_dtype`` None), ``Input`` imported from ``input_base``
(trainer.py:39) and ``select_mesh_config`` (trainer.py:1414-1436), which applies the first
mesh rule whose regex fully matches the selector: a shape (or None) is the mesh, anything
else is a ConfigModifier config that is instantiated and called on the trainer config."""

from __future__ import annotations

import re
from typing import Any, Optional

from axlearn.common.config import REQUIRED, Configurable, Required, config_class, maybe_instantiate
from axlearn.common.input_base import Input  # noqa: F401  (as trainer.py imports it)


class SpmdTrainer(Configurable):
    @config_class
    class Config(Configurable.Config):
        name: str = "trainer"
        input: Required[Any] = REQUIRED
        mesh_shape: Required[Any] = REQUIRED
        mesh_axis_names: Required[Any] = REQUIRED
        batch_axis_names: Optional[Any] = "data"
        mesh_rules: Optional[Any] = None
        model: Required[Any] = REQUIRED
        learner: Required[Any] = REQUIRED
        train_dtype: Optional[Any] = None


def select_mesh_config(trainer_config: Any, *, mesh_selector: str) -> None:
    for pattern, rule in trainer_config.mesh_rules or ():
        if re.fullmatch(pattern, mesh_selector):
            if isinstance(rule, tuple) or rule is None:
                trainer_config.mesh_shape = rule
            else:
                maybe_instantiate(rule)(trainer_config)
            return
