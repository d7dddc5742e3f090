"""Test helper: the ``checkpoint_name`` tags a jaxpr binds, at any depth (JAX's own record,
for comparing with the names the package reads)."""

from __future__ import annotations

from typing import Any

from jax.extend import core as jcore

from neuron_remat import _jax_compat


def names_in(closed: Any) -> set[str]:
    """Every tag bound in `closed` (a ClosedJaxpr) and in the jaxprs its equations hold,
    under the old remat (the name primitive) and under remat3 (a ``CheckpointName``)."""
    found: set[str] = set()

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if _jax_compat.is_name_primitive(eqn.primitive):
                found.add(eqn.params["name"])
            prim = eqn.params.get("_prim")
            if prim is not None and type(prim).__name__ == "CheckpointName":
                found.add(prim.name)
            for v in eqn.params.values():
                for item in v if isinstance(v, (tuple, list)) else (v,):
                    if isinstance(item, jcore.ClosedJaxpr):
                        walk(item.jaxpr)
                    elif isinstance(item, jcore.Jaxpr):
                        walk(item)

    walk(closed.jaxpr)
    return found
