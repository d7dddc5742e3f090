"""Scans inside a layer, as foreign code writes them: the traced footprint models a scan
whose carry's tangent is not fed by the layer's weights or inputs (a chunked FFN, a carry
updated from itself); a scan whose tangent carry is (an RNN, a loop of sub-blocks, an
accumulator of the input) is refused in one line naming audit, which reports what JAX keeps
for it. Expected values: JAX's ``saved_residuals``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax.ad_checkpoint import checkpoint_name as cn

import neuron_remat as nr

from neuron_remat.policies import RegexPolicy


def _inner_loop(x, w):  # three applications of one sub-block
    def body(h, _):
        return h + cn(jnp.tanh(h @ w), "inner"), None
    return jax.lax.scan(body, x, None, length=3)[0]


def _rnn(x, w):
    def body(c, xt):
        c = cn(jnp.tanh(c @ w + xt), "state")
        return c, cn(c * 2, "out")
    return x + jax.lax.scan(body, x[0], x)[1]


def _accumulate(x, w):
    def body(a, xt):
        return a + cn(jnp.sin(xt @ w), "term"), None
    return x + jax.lax.scan(body, jnp.zeros_like(x[0]), x)[0]


def _chunked(x, w):  # no carry: each chunk on its own
    ys = jax.lax.scan(lambda c, xc: (c, cn(jnp.tanh(xc @ w), "chunk") @ w.T), None,
                      x.reshape(2, 2, 32))[1]
    return x + ys.reshape(x.shape)


def _self_carry(x, w):  # the carry's update reads only the carry
    h = cn(jnp.tanh(x @ w), "h")
    s = jax.lax.scan(lambda c, _: (c * 0.5 + jnp.sin(c), None), h, None, length=3)[0]
    return x + s


X, W = jnp.ones((4, 32)), jnp.ones((32, 32)) * 0.01


def _jax_kept(f, saved, arguments=False) -> int:
    """What JAX keeps for `f`'s backward under `saved` (its arguments too when asked)."""
    g = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(*saved))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, why in saved_residuals(g, X, W)
               if arguments or not why.startswith("from the argument"))


@pytest.mark.parametrize("f", [_inner_loop, _rnn, _accumulate])
def test_a_scan_fed_by_the_weights_is_refused_and_audit_reports_it(f):
    with pytest.raises(nr.UnsupportedPrimitiveError) as err:
        nr.traced_footprint(f, X, W)
    assert "audit(" in str(err.value) and "\n" not in str(err.value)
    tags = [t.name for t in nr.audit(f, X, W, policy=RegexPolicy([])).tags]
    assert tags
    for saved in ((), tuple(tags)):
        report = nr.audit(f, X, W, policy=RegexPolicy([t for t in saved]))
        assert report.saved_bytes + report.saved_param_bytes == _jax_kept(f, saved, True)


@pytest.mark.parametrize("f", [_chunked, _self_carry])
def test_a_scan_not_fed_by_the_weights_is_modelled(f):
    fp = nr.traced_footprint(f, X, W)
    base = _jax_kept(f, ())
    for t in fp:
        assert fp.evaluate((t,))[0] - fp.evaluate(())[0] == _jax_kept(f, (t,)) - base, t


LAYERS = 3


def _stack_step(policy):
    def loss(ws, x):
        body = jax.checkpoint(_chunked, policy=policy)
        return jnp.sum(jax.lax.scan(lambda h, w: (body(h, w), None), x, ws)[0] ** 2)
    return jax.jit(jax.grad(loss))


STACK_ARGS = (jax.ShapeDtypeStruct((LAYERS, 32, 32), jnp.float32),
              jax.ShapeDtypeStruct((4, 32), jnp.float32))


def test_fit_reads_a_stack_of_layers_with_an_inner_scan():
    """`fit`'s reading of a scanned stack's backward: a layer with a chunked inner scan,
    whose weight gradient the backward accumulates in a carry, is read (the refusal above
    is the forward trace's, not the backward's)."""
    from neuron_remat._step import step_graph

    g = step_graph(_stack_step, *STACK_ARGS)
    assert g.tags == ("chunk",) and g.count == LAYERS


def test_fit_keeps_what_jax_keeps_for_a_tag_in_an_inner_scan():
    """The weights a layer's backward reads are told from its cotangents though the only
    tag that depends on them is inside the inner scan's body (they were taken for a
    cotangent: the tag read as computed from tangents, saving it as keeping nothing)."""
    from neuron_remat._step import step_graph

    g = step_graph(_stack_step, *STACK_ARGS)
    one = _jax_kept(_chunked, ("chunk",)) - _jax_kept(_chunked, ())
    assert one > 0
    assert g.kept_bytes(("chunk",)) - g.kept_bytes(()) == LAYERS * one
