"""Recompute FLOPs of a top-1 MoE routed with ``argmax`` and ``jnp.take`` (foreign code's
usual way): the traced footprint against XLA's cost analysis of a training step over a
scan of two such layers (a scan body counts once, so a policy's FLOPs less no remat's are
one layer's recompute). ``jnp.take``'s default fill mode adds a bounds check and select
that XLA counts; ``argmax`` is a variadic reduce whose comparator XLA counts per step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name as cn

import neuron_remat as nr

T, D, F, E = 16, 32, 48, 4


def _layer(mode):
    def layer(x, p):
        idx = jnp.argmax(cn(x @ p["router"], "router"), -1)
        w1 = jnp.take(p["w1"], idx, axis=0, mode=mode)
        return x + cn(jnp.einsum("td,tdf->tf", x, w1), "up") @ p["w2"]
    return layer


X = jnp.ones((T, D)) * 0.1
P = {"router": jnp.ones((D, E)) + jnp.arange(E), "w1": jnp.ones((E, D, F)),
     "w2": jnp.ones((F, D))}


def _xla_step_flops(layer, policy) -> float:
    f = layer if policy is None else jax.checkpoint(layer, policy=policy)
    ps = jax.tree.map(lambda a: jnp.stack([a, a]), P)

    def loss(x, ps):
        return jax.lax.scan(lambda h, q: (f(h, q), None), x, ps)[0].sum()

    c = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(X, ps).cost_analysis()
    return (c[0] if isinstance(c, list) else c)["flops"]


@pytest.mark.parametrize("mode", [None, "clip"])
def test_moe_routing_recompute_is_xlas(mode):
    layer = _layer(mode)
    fp = nr.traced_footprint(layer, X, P)
    base = _xla_step_flops(layer, None)
    for saved in [(), ("router",), ("router", "up")]:
        xla = _xla_step_flops(layer, jax.checkpoint_policies.save_only_these_names(*saved))
        assert fp.evaluate(saved)[1] == pytest.approx(xla - base, rel=1e-6), saved
