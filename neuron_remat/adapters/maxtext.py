"""MaxText: config overrides that select the resolved policy through ``remat_policy: custom``.

MaxText reads one key per tensor (``query_proj: device``, ``mlpwi_0: remat``, ...) and saves
the tags set to ``device``, offloads those set to ``offload`` and recomputes the rest. Its
config keys are its checkpoint tag names, so each key is set to what the resolved policy
does with the tag of that name. `BASE_YML_KEYS` is a copy of the per-tensor keys of
MaxText's ``src/maxtext/configs/base.yml`` (AI-Hypercomputer/maxtext, commit
e591f30cbbf217ed67ef71263ec0538239f9c3b8, lines 355-382), in its order; where MaxText is
installed, its own config's keys are set instead (`remat_keys`).

`overrides` resolves the policy when called (detecting the device, which starts JAX's
backends): call it where the MaxText config is assembled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._jax_compat import name_p
from jax.ad_checkpoint import Offloadable, Saveable

from .. import models
from ..planner import Plan
from ..plugin import resolve_policy

__all__ = ["ALLOWED_VALUES", "BASE_YML_KEYS", "as_args", "overrides", "overrides_for",
           "remat_keys"]

BASE_YML_KEYS = (
    "decoder_layer_input", "indexer_cutoff_threshold", "context", "mlpwi", "mlpwi_0",
    "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo", "query_proj", "key_proj",
    "value_proj", "kv_proj", "qkv_proj", "out_proj", "query_wa_proj", "kv_wa_proj", "mla_q",
    "mla_kv", "attention_out", "engram",
)
ALLOWED_VALUES = ("remat", "device", "offload")


def _setting(policy: Callable[..., Any], key: str) -> str:
    decision = policy(name_p, name=key)
    if decision is Saveable or decision is True:
        return "device"
    return "offload" if isinstance(decision, Offloadable) else "remat"


def remat_keys() -> tuple[str, ...]:
    """The per-tensor remat keys of the MaxText installed here (its config's
    ``RematAndOffload`` fields of type ``RematLocation``: MaxText 0.2.5 has 24, with
    ``moe_x_sorted`` and ``moe_routing_maps``), else `BASE_YML_KEYS`. MaxText refuses keys
    its config does not have, and leaves a key not set at the user's value."""
    try:
        from maxtext.configs import types  # noqa: PLC0415 - the host, only when installed
        fields = types.RematAndOffload.model_fields
        keys = tuple(n for n, f in fields.items() if f.annotation is types.RematLocation)
    except Exception:  # noqa: BLE001 - not installed, or another layout: the copy stands
        return BASE_YML_KEYS
    return keys or BASE_YML_KEYS


def _overrides(policy: Callable[..., Any], fused_qkv: bool) -> dict[str, str]:
    keys = {key: _setting(policy, key) for key in remat_keys()}
    keys["decoder_layer_input"] = "device"  # the scan carry: MaxText cannot remat it
    qkv = ("query_proj", "key_proj", "value_proj")
    if fused_qkv and "qkv_proj" in keys and all(keys.get(k) == "device" for k in qkv):
        # With fused_qkv MaxText tags the fused matmul output and the split q, k, v: keep
        # the fused tensor once rather than both.
        keys.update({k: "remat" for k in qkv}, qkv_proj="device")
    return {"remat_policy": "custom", **keys}


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
