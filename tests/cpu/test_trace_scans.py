"""Scans inside a layer, as foreign code writes them: the traced footprint models a scan
whose carry's tangent is not fed by the layer's weights or inputs (a chunked FFN, a carry
updated from itself) and one whose tangent carry is (an RNN, a loop of sub-blocks, an
accumulator of the input, a gated linear recurrence as a gated delta net runs it, chunked
or not, a scan of scans, work that does not vary over the loop). Expected values: JAX's
``saved_residuals`` for the bytes, XLA's cost analysis of a training step for the recompute
FLOPs, on every subset of the tags."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax.ad_checkpoint import checkpoint_name as cn

import neuron_remat as nr

from neuron_remat.policies import RegexPolicy
from xla_figures import jax_kept_bytes, scan_step_flops


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


def _kept_with_input(f, saved, args) -> int:
    """What JAX keeps for `f`'s backward under `saved`, its weights left out (the layer
    input, its first argument, counted): the traced footprint's kept bytes."""
    g = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(*saved))
    return jax_kept_bytes(g, args, 0)


@pytest.mark.parametrize("f", [_inner_loop, _rnn, _accumulate])
def test_a_scan_fed_by_the_weights_is_modelled_and_audit_reports_it(f):
    fp = nr.traced_footprint(f, X, W)
    tags = [t.name for t in nr.audit(f, X, W, policy=RegexPolicy([])).tags]
    assert sorted(fp) == sorted(tags)
    for saved in ((), tuple(tags)):
        report = nr.audit(f, X, W, policy=RegexPolicy([t for t in saved]))
        assert report.saved_bytes + report.saved_param_bytes == _jax_kept(f, saved, True)
    for r in range(len(tags) + 1):
        for saved in itertools.combinations(tags, r):
            assert fp.evaluate(saved)[0] == _kept_with_input(f, saved, (X, W)), saved


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


# --------------------------------------------------------------------------------------
# Scans with a differentiated carry fed by the layer's inputs or weights, held to JAX and
# XLA on every subset of their tags. Each scan is unrolled (``unroll=True``: the same
# residuals and remat for JAX) so that XLA's cost analysis counts every iteration, in the
# lowered HLO (before XLA's fusion copies an elementwise producer into each unrolled
# consumer). Recompute FLOPs: those of a training step over a scan of two layers (XLA
# counts that loop's body once) under the policy, less the same without remat.
# --------------------------------------------------------------------------------------

STEPS, D, CHUNK = 8, 16, 4


def _unrolled(body, init, xs, length=None):
    return jax.lax.scan(body, init, xs, length=length, unroll=True)


def _tanh_rnn(x, p):  # tags outside the scan and on the body's matmul, state and output
    xs = cn(x @ p["wx"], "xproj")

    def body(h, xt):
        h = cn(jnp.tanh(cn(h @ p["wh"], "hw") + xt), "h")
        return h, cn(h * 2.0, "y")
    return x + _unrolled(body, jnp.tanh(x[0]), xs)[1] @ p["wo"]


def _gated_recurrence(x, p):  # S_t = a_t S_{t-1} + k_t v_t^T, o_t = q_t S_t
    q, k, v = cn(x @ p["wq"], "q"), cn(x @ p["wk"], "k"), cn(x @ p["wv"], "v")
    a = cn(jax.nn.sigmoid(x @ p["wa"]), "gate")

    def body(s, inp):
        qt, kt, vt, at = inp
        s = at[:, None] * s + jnp.outer(kt, vt)
        return s, qt @ s
    o = _unrolled(body, jnp.zeros((D, D)), (q, k, v, a))[1]
    return x + cn(o, "o") @ p["wo"]


def _chunked_recurrence(x, p):  # the same over chunks, as a chunked gated delta net runs it
    q, k, v = (cn(x @ p[w], "qkv") for w in ("wq", "wk", "wv"))  # one name, three values
    g = cn(jax.nn.sigmoid(x @ p["wa"]), "gate").reshape(STEPS // CHUNK, CHUNK)
    causal = (jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
              >= jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)).astype(jnp.float32)

    def body(s, inp):
        qc, kc, vc, gc = inp
        o = cn((qc @ kc.T) * causal, "scores") @ vc + qc @ s
        return jnp.prod(gc) * s + cn(kc.T @ vc, "kv"), o
    chunks = [t.reshape(STEPS // CHUNK, CHUNK, D) for t in (q, k, v)]
    o = _unrolled(body, jnp.zeros((D, D)), (*chunks, g))[1]
    return x + o.reshape(STEPS, D) @ p["wo"]


def _sum_of_terms(x, p):  # an accumulator of the input
    def body(acc, xt):
        return acc + cn(jnp.sin(xt @ p["wh"]), "term"), None
    return x + cn(_unrolled(body, jnp.zeros_like(x[0]), cn(x * 1.5, "xs"))[0], "acc")


def _scan_of_scans(x, p):  # an RNN over chunks, each chunk an inner RNN
    xs = cn(x @ p["wx"], "xproj").reshape(STEPS // CHUNK, CHUNK, D)

    def inner(h, xt):
        h = cn(jnp.tanh(cn(h @ p["wh"], "hw") + xt), "h")
        return h, h

    def outer(s, xc):
        h, ys = _unrolled(inner, s, xc)
        return cn(jnp.sin(h @ p["wo"]), "s"), ys
    return x + _unrolled(outer, jnp.tanh(x[0]), xs)[1].reshape(STEPS, D)


def _hoisted(x, p):  # work and a tag inside the body that do not vary over the loop
    def body(h, xt):
        w2 = cn(jnp.sin(p["wh"]) * 2.0, "w2")
        m = (jax.lax.broadcasted_iota(jnp.int32, (D,), 0) > 3).astype(jnp.float32)
        h = jnp.tanh(h @ w2 + xt) * m
        return h, h
    return x + _unrolled(body, jnp.tanh(x[0]), x)[1]


def _weights(*names):
    keys = jax.random.split(jax.random.PRNGKey(0), len(names))
    return {n: jax.random.normal(k, (D, 1 if n == "wa" else D)) / 4
            for n, k in zip(names, keys)}


RECURRENT = {
    "tanh_rnn": (_tanh_rnn, ("wx", "wh", "wo")),
    "gated_recurrence": (_gated_recurrence, ("wq", "wk", "wv", "wa", "wo")),
    "chunked_recurrence": (_chunked_recurrence, ("wq", "wk", "wv", "wa", "wo")),
    "sum_of_terms": (_sum_of_terms, ("wh",)),
    "scan_of_scans": (_scan_of_scans, ("wx", "wh", "wo")),
    "hoisted": (_hoisted, ("wh",)),
}
XR = jax.random.normal(jax.random.PRNGKey(1), (STEPS, D))
# JAX's new remat (``jax_remat3``) hoists nothing out of a scan: its forward runs work that
# does not vary over the loop once per iteration, where the step without remat runs it once.
# The graph stacks that work and its residuals as remat3 does (the bytes are exact), but
# does not count that extra forward work.
REMAT3 = bool(getattr(jax.config, "jax_remat3", False))


def _xla_step_flops(layer, p, saved=None) -> float:
    return scan_step_flops(layer, None if saved is None else
                           jax.checkpoint_policies.save_only_these_names(*saved), XR, p)


@pytest.mark.parametrize("name", list(RECURRENT))
def test_a_differentiated_carry_keeps_and_recomputes_what_jax_does(name):
    layer, names = RECURRENT[name]
    p = _weights(*names)
    fp = nr.traced_footprint(layer, XR, p)
    tags = sorted(fp)
    assert len(tags) >= 1
    base = _xla_step_flops(layer, p)
    for r in range(len(tags) + 1):
        for saved in itertools.combinations(tags, r):
            nbytes, flops = fp.evaluate(saved)
            assert nbytes == _kept_with_input(layer, saved, (XR, p)), saved
            if not (name == "hoisted" and REMAT3):  # see REMAT3
                assert flops == _xla_step_flops(layer, p, saved) - base, saved
            plain = fp.graph.evaluate_roles(saved)  # the carries' cycles: both walks agree
            assert (plain.kept_bytes, plain.recompute_flops) == (nbytes, flops), saved
