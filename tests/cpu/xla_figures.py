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
