"""Stand-in for axlearn.common.base_layer (axlearn/common/base_layer.py at 34aed43c:
``RematSpec`` is a dataclass of prevent_cse and policy; ``BaseLayer._remat_name`` tags
``f"{type(self).__name__}.{name}"``; ``BaseLayer.Config.remat_spec`` defaults to None)."""

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

    @classmethod
    def remat_name(cls, name: str) -> str:
        """The checkpoint name this layer class gives `name` (as ``_remat_name`` does)."""
        return f"{cls.__name__}.{name}"
