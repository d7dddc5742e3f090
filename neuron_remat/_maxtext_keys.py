"""MaxText's per-tensor remat keys, and the setting each takes under a policy.

MaxText reads one key per tensor (``query_proj: device``, ``mlpwi_0: remat``, ...) under
``remat_policy: custom``: it saves the tags set to ``device``, offloads those set to
``offload`` and recomputes the rest. Its keys are its checkpoint tag names, so each key is
set to what the policy does with the tag of that name. `BASE_YML_KEYS` is a copy of the
per-tensor keys of MaxText's ``src/maxtext/configs/base.yml`` (AI-Hypercomputer/maxtext,
commit e591f30cbbf217ed67ef71263ec0538239f9c3b8, lines 355-382), in its order; where
MaxText is installed its own config's keys are used instead (`remat_keys`). Both the
adapter's overrides (`adapters.maxtext`) and a plan's paste line (`Plan.paste`) are made
here, so they say the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.ad_checkpoint import Offloadable, Saveable

from ._jax_compat import name_p

__all__ = ["ALLOWED_VALUES", "BASE_YML_KEYS", "overrides_of", "remat_keys"]

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


def overrides_of(policy: Callable[..., Any], fused_qkv: bool) -> dict[str, str]:
    """``{"remat_policy": "custom", <key>: remat|device|offload, ...}`` for `policy`: every
    key of `remat_keys`, the scan carry kept (MaxText cannot remat it)."""
    keys = {key: _setting(policy, key) for key in remat_keys()}
    keys["decoder_layer_input"] = "device"  # the scan carry: MaxText cannot remat it
    qkv = ("query_proj", "key_proj", "value_proj")
    if fused_qkv and "qkv_proj" in keys and all(keys.get(k) == "device" for k in qkv):
        # With fused_qkv MaxText tags the fused matmul output and the split q, k, v: keep
        # the fused tensor once rather than both.
        keys.update({k: "remat" for k in qkv}, qkv_proj="device")
    return {"remat_policy": "custom", **keys}
