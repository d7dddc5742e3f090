"""Stand-in for axlearn.common.utils (apple/axlearn 34aed43c):
``save_and_offload_only_these_names_regex`` (utils.py:163-196), with axlearn's keyword-only
signature and behaviour. It returns a plain closure, as axlearn's does: for the name
primitive, a name that fully matches ``names_which_can_be_saved`` (when that pattern is
given) is Saveable, else one fully matching ``names_which_can_be_offloaded`` is
Offloadable(offload_src -> offload_dst); everything else is recomputed. Written for the tests;
no axlearn code."""

from __future__ import annotations

import re
from typing import Any

from jax._src.ad_checkpoint import name_p
from jax.ad_checkpoint import Offloadable, Recompute, Saveable


def save_and_offload_only_these_names_regex(
    *,
    names_which_can_be_saved: Any,
    names_which_can_be_offloaded: Any,
    offload_src: Any,
    offload_dst: Any,
) -> Any:
    def decide(prim: Any, *_: Any, **params: Any) -> Any:
        if str(prim) != str(name_p):
            return Recompute
        name = params["name"]
        if names_which_can_be_saved and re.fullmatch(names_which_can_be_saved, name):
            return Saveable
        if names_which_can_be_offloaded and re.fullmatch(names_which_can_be_offloaded, name):
            return Offloadable(src=offload_src, dst=offload_dst)
        return Recompute

    return decide
