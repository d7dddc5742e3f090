"""MaxText: config overrides that select the resolved policy through ``remat_policy: custom``.

Each of MaxText's per-tensor keys (``query_proj: device``, ``mlpwi_0: remat``, ...) is set to
what the policy does with the tag of that name (`_maxtext_keys`: the keys of the MaxText
installed, else a copy of its ``base.yml``'s).

`overrides` resolves the policy when called (detecting the device, which starts JAX's
backends): call it where the MaxText config is assembled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import models
from .._maxtext_keys import ALLOWED_VALUES, BASE_YML_KEYS, remat_keys
from .._maxtext_keys import overrides_of as _overrides
from ..planner import Plan
from ..plugin import resolve_policy

__all__ = ["ALLOWED_VALUES", "BASE_YML_KEYS", "as_args", "overrides", "overrides_for",
           "remat_keys"]


def overrides_for(plan: Plan, *, fused_qkv: bool = False) -> dict[str, str]:
    """``{"remat_policy": "custom", <key>: remat|device|offload, ...}`` for a `Plan` made
    with MaxText's tag names (``MAXTEXT_TAGS``)."""
    if plan.config is not None and models.host_of(plan.config.tags) != "maxtext":
        raise ValueError("plan with MaxText's tag names (tags=MAXTEXT_TAGS) to get MaxText "
                         f"overrides; this plan uses {plan.config.tags.vocabulary!r} names")
    return _overrides(plan.policy, fused_qkv)


def overrides(*, fused_qkv: bool = False, stack: str = "repeated",
              **context: Any) -> dict[str, str] | None:
    """Resolve the policy for a MaxText decoder (scanned layers by default), in MaxText's
    tag names, and return its overrides; None when no provider answered (MaxText's own
    ``remat_policy`` then stands)."""
    choice = resolve_policy(tags=models.MAXTEXT_TAGS, stack=stack, **context)
    if choice.provider is None or choice.policy is None:
        return None
    return _overrides(choice.policy, fused_qkv)


def as_args(values: dict[str, str]) -> list[str]:
    """``key=value`` strings for MaxText's command line (``python -m MaxText.train ...``)."""
    return [f"{k}={v}" for k, v in values.items()]
