"""Stand-in for axlearn.common.learner (apple/axlearn 34aed43c): ``Learner`` with the
``forward_fn_transformation`` field (learner.py:191, default None) that gradient
accumulation sets (``with_minibatch_steps``)."""

from __future__ import annotations

from typing import Any, Optional

from axlearn.common.config import REQUIRED, Configurable, Required, config_class


class Learner(Configurable):
    @config_class
    class Config(Configurable.Config):
        optimizer: Required[Any] = REQUIRED
        forward_fn_transformation: Optional[Any] = None
