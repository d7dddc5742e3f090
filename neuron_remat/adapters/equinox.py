"""Equinox: ``eqx.filter_checkpoint`` with the resolved policy (resolved when traced).

``filter_checkpoint`` returns an Equinox module holding the wrapped function (its arrays are
leaves of the model), so it is built when wrapped and ``prevent_cse`` is fixed then: the
caller's value, else the stack's usual one. A provider that answers otherwise gets one
warning naming the value to pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..plugin import remat_args

__all__ = ["filter_checkpoint"]


def filter_checkpoint(fn: Callable[..., Any] | None = None, *, default: Any = None,
                      stack: str = "stacked", prevent_cse: bool | None = None,
                      **context: Any) -> Any:
    """``equinox.filter_checkpoint(fn)`` with the policy the providers choose for
    `context`, or `default` when none answers; usable as a decorator."""
    import equinox as eqx  # noqa: PLC0415

    cse, policy = remat_args(stack, prevent_cse, default, context)
    if fn is None:
        return lambda g: eqx.filter_checkpoint(g, prevent_cse=cse, policy=policy)
    return eqx.filter_checkpoint(fn, prevent_cse=cse, policy=policy)
