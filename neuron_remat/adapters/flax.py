"""Flax: ``nn.remat`` (linen) and ``nnx.remat`` (NNX) with the resolved policy.

The policy is resolved the first time the wrapped module is traced, not when it is
wrapped, so ``Block = remat(Block, ...)`` at import time is safe.

``prevent_cse``: `nnx_remat` builds ``nnx.remat`` on the first call, so it runs with the
answering provider's ``prevent_cse`` unless the caller gives one. Linen's ``nn.remat``
transforms the class when it is wrapped, before any provider is asked: there the caller's
value, else the stack's usual one, decides, and a provider that answers otherwise gets one
warning naming the value to pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..plugin import remat_args, resolve_on_call

__all__ = ["nnx_remat", "remat"]


def remat(target: Any, *, default: Any = None, stack: str = "stacked",
          prevent_cse: bool | None = None, static_argnums: int | tuple[int, ...] = (),
          variables: Any = True, rngs: Any = True, methods: Any = None,
          **context: Any) -> Any:
    """``flax.linen.remat(target)`` with the policy the providers choose for `context`
    (``layer=``, ``model=``, ``shape=``, ...), or `default` when none answers."""
    import flax.linen as nn  # noqa: PLC0415

    cse, policy = remat_args(stack, prevent_cse, default, context)
    return nn.remat(target, variables=variables, rngs=rngs, prevent_cse=cse,
                    static_argnums=static_argnums, methods=methods, policy=policy)


def nnx_remat(f: Callable[..., Any] | None = None, *, default: Any = None,
              stack: str = "stacked", prevent_cse: bool | None = None,
              static_argnums: int | tuple[int, ...] = (), **context: Any) -> Any:
    """``flax.nnx.remat(f)`` with the resolved policy and ``prevent_cse`` (the caller's,
    else the answering provider's), built on the first call; usable as a decorator."""
    from flax import nnx  # noqa: PLC0415

    def wrap(g: Callable[..., Any]) -> Callable[..., Any]:
        return resolve_on_call(
            g, lambda cse, policy: nnx.remat(g, prevent_cse=cse,
                                             static_argnums=static_argnums, policy=policy),
            stack=stack, prevent_cse=prevent_cse, default=default, context=context)

    return wrap if f is None else wrap(f)
