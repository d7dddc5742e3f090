"""XLA's own figures for a compiled step: the expected values the fit tests hold
`neuron_remat` to, computed here from ``memory_analysis()`` and ``cost_analysis()``, never
by the package (whose `fit` keeps its own sum)."""

from __future__ import annotations

from typing import Any


def compiled_bytes(compiled: Any) -> int:
    """Arguments + outputs + temporaries - donated (aliased) buffers, as XLA reports them."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def compiled_flops(compiled: Any) -> float:
    """XLA's FLOPs (``cost_analysis()`` is a dict, or a list of one on older JAX); a
    KeyError where it gives none."""
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def full_and_no_remat_bytes(make_step: Any, args: Any) -> tuple[int, int]:
    """XLA's bytes of ``make_step(policy)`` compiled for ``args`` under full remat (save
    nothing) and under no remat (``everything_saveable``)."""
    import jax  # noqa: PLC0415

    policies = (jax.checkpoint_policies.save_only_these_names(),
                jax.checkpoint_policies.everything_saveable)
    full, none = (compiled_bytes(make_step(p).lower(*args).compile()) for p in policies)
    return full, none


def measure(step: Any, args: Any) -> tuple[int, float]:
    """Compile ``step`` (a jitted function) for ``args``: its bytes and FLOPs."""
    c = step.lower(*args).compile()
    return compiled_bytes(c), compiled_flops(c)


def scan_step_flops(layer: Any, policy: Any, x: Any, params: Any) -> float:
    """XLA's FLOPs (the lowered program's ``cost_analysis()``) of the gradient, with
    respect to the input and both layers' parameters, of a sum over a scan of two
    ``layer(h, params)`` (`params` stacked twice), each layer ``jax.checkpoint``ed with
    `policy` (None: not checkpointed). XLA counts a scan body once, so a policy's figure
    less no remat's is one layer's recompute."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    f = layer if policy is None else jax.checkpoint(layer, policy=policy)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)

    def loss(h: Any, ps: Any) -> Any:
        return jax.lax.scan(lambda c, q: (f(c, q), None), h, ps)[0].sum()

    cost = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, stacked).cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def jax_kept_bytes(fn: Any, args: Any, activation: int = 0) -> int:
    """The bytes JAX keeps for `fn`'s backward (``saved_residuals``), the arguments left out
    but the activation (argument `activation`, named as `fn`'s signature names it): what a
    layer keeps beyond its parameters."""
    import inspect

    from jax._src.ad_checkpoint import saved_residuals

    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL:  # fn(*a): a[i]
        name = f"{params[0].name}[{activation}]"
    else:
        name = params[activation].name
    mine = (f"from the argument {name}", f"from the argument {name}[",
            f"from the argument {name}.")
    return sum(int(a.size) * a.dtype.itemsize for a, why in saved_residuals(fn, *args)
               if not why.startswith("from the argument") or why == mine[0]
               or why.startswith(mine[1:]))
