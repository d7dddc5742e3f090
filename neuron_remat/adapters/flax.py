"""Flax: ``nn.remat`` (linen) and ``nnx.remat`` (NNX) with the resolved policy.

The policy is resolved the first time the wrapped module is traced, not when it is
wrapped, so ``Block = remat(Block, ...)`` at import time is safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..plugin import remat_args

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
    """``flax.nnx.remat(f)`` with the resolved policy; usable as a decorator."""
    from flax import nnx  # noqa: PLC0415

    cse, policy = remat_args(stack, prevent_cse, default, context)
    if f is None:
        return lambda g: nnx.remat(g, prevent_cse=cse, static_argnums=static_argnums,
                                   policy=policy)
    return nnx.remat(f, prevent_cse=cse, static_argnums=static_argnums, policy=policy)
