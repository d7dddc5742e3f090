"""Stand-in for axlearn.common.base_layer (axlearn/common/base_layer.py at 34aed43c:
``RematSpec`` (base_layer.py:235) is a dataclass of prevent_cse (default True) and policy
(default None); ``BaseLayer.Config.remat_spec`` defaults to None)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from axlearn.common.config import Configurable, config_class


@dataclasses.dataclass
class RematSpec:
    prevent_cse: bool = True
    policy: Optional[Any] = None


class BaseLayer(Configurable):
    @config_class
    class Config(Configurable.Config):
        dtype: Optional[Any] = None
        remat_spec: Optional[RematSpec] = None
        param_partition_spec: Optional[Any] = None
