"""MaxText: config overrides that select the resolved policy through ``remat_policy: custom``.

MaxText reads one key per tensor (``query_proj: device``, ``mlpwi_0: remat``, ...) and saves
the tags set to ``device``, offloads those set to ``offload`` and recomputes the rest. Its
config keys are its checkpoint tag names. `BASE_YML_KEYS` is a copy of the per-tensor keys
of MaxText's ``src/maxtext/configs/base.yml`` (AI-Hypercomputer/maxtext, commit
e591f30cbbf217ed67ef71263ec0538239f9c3b8, lines 355-382), in its order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import memory_model as mm
from ..plugin import resolve_policy
from ..policies import Plan, RegexPolicy

__all__ = ["ALLOWED_VALUES", "BASE_YML_KEYS", "as_args", "overrides", "overrides_for"]

BASE_YML_KEYS = (
    "decoder_layer_input", "indexer_cutoff_threshold", "context", "mlpwi", "mlpwi_0",
    "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo", "query_proj", "key_proj",
    "value_proj", "kv_proj", "qkv_proj", "out_proj", "query_wa_proj", "kv_wa_proj", "mla_q",
    "mla_kv", "attention_out", "engram",
)
ALLOWED_VALUES = ("remat", "device", "offload")
# The roles axlearn's TRN2 preset saves, for when no model is described.
_PRESET_ROLES = ("q_proj", "k_proj", "v_proj", "linear1_0", "linear1_1")


def _roles_saved(plan: Plan) -> set[str]:
    config = plan.config
    if config is None:
        raise ValueError("the plan has no model description to map onto MaxText keys")
    return {r for r in config.roles if config.tag(r) in plan.saved_tags}


def _keys_for(roles: set[str], *, fused_qkv: bool, gated: bool, flash: bool) -> dict[str, str]:
    tags = mm.MAXTEXT_TAGS
    out = {key: "remat" for key in BASE_YML_KEYS}
    out["decoder_layer_input"] = "device"  # the scan carry: MaxText cannot remat it
    for role in roles:
        name = tags.name(role, gated=gated, flash=flash)
        if name is not None and name in out:
            out[name] = "device"
    if fused_qkv and {"q_proj", "k_proj", "v_proj"} <= roles:
        # With fused_qkv MaxText tags the fused matmul output and the split q, k, v: keep
        # the fused tensor once rather than both.
        for key in ("query_proj", "key_proj", "value_proj"):
            out[key] = "remat"
        out["qkv_proj"] = "device"
    return out


def overrides_for(plan: Plan, *, fused_qkv: bool = False) -> dict[str, str]:
    """``{"remat_policy": "custom", <key>: remat|device|offload, ...}`` for a `Plan`."""
    assert plan.config is not None
    keys = _keys_for(_roles_saved(plan), fused_qkv=fused_qkv, gated=plan.config.gated_ffn,
                     flash=plan.config.flash_attention)
    return {"remat_policy": "custom", **keys}


def overrides(*, model: Any = None, fused_qkv: bool = False, stack: str = "repeated",
              **context: Any) -> dict[str, str] | None:
    """Resolve the policy for a MaxText decoder (scanned layers by default) and return its
    overrides, or None when no provider answered (MaxText's own ``remat_policy`` stands).
    The model is planned with MaxText's tag names."""
    if model is not None:
        from ..plugin import _as_config  # noqa: PLC0415

        model = dataclasses.replace(_as_config(model, None), tags=mm.MAXTEXT_TAGS)
    choice = resolve_policy(model=model, stack=stack, **context)
    if choice.provider is None or choice.policy is None:
        return None
    if choice.plan is not None:
        return overrides_for(choice.plan, fused_qkv=fused_qkv)
    policy = choice.policy
    if not isinstance(policy, RegexPolicy):
        raise TypeError(f"MaxText overrides need a regex policy; got {policy!r}")
    keys = _keys_for(set(_PRESET_ROLES), fused_qkv=fused_qkv, gated=True, flash=False)
    return {"remat_policy": "custom", **keys}


def as_args(values: dict[str, str]) -> list[str]:
    """``key=value`` strings for MaxText's command line (``python -m MaxText.train ...``)."""
    return [f"{k}={v}" for k, v in values.items()]
