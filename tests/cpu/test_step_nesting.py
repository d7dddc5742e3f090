"""Nesting around and inside a checkpointed layer. Loops around the gradient: a step that
runs each micro-batch's forward and backward in one iteration of a ``lax.scan`` or
``fori_loop`` (gradient accumulation, as MaxText, axlearn and ``optax.microbatching`` run
it) repeats its layers' backward but holds one micro-batch's residuals at a time; a
scanned stack of scanned groups holds every layer's. The step graph counts the runs for
the recompute and the copies held for the bytes (`_step.LayerBackward.held`). A
checkpoint inside a checkpointed layer leaves remats that are not a layer's backward,
which the step graph tells apart.

Expected values: JAX's ``saved_residuals`` of one layer times the layers held, the arrays
XLA's compiled forward loop returns (`xla_figures.kept_against_xla`), and the FLOPs of the
transposed jaxpr JAX builds for a save set."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax.ad_checkpoint import checkpoint_name as cn

from neuron_remat._step import step_graph
from xla_figures import kept_against_xla

D, ROWS, LAYERS, GROUPS, MICRO = 128, 256, 3, 2, 4


def _layer(x, w):
    h = cn(jnp.tanh(x @ w), "h")
    return x + cn(jnp.sin(h) @ w.T, "o")


def _stack(policy, ws, x):
    """A scanned stack of `_layer`; `ws` [LAYERS, D, D]."""
    body = jax.checkpoint(_layer, policy=policy)
    return jax.lax.scan(lambda h, w: (body(h, w), None), x, ws)[0]


def _grouped(policy, ws, x):
    """A scanned stack of scanned groups; `ws` [GROUPS, LAYERS, D, D]."""
    return jax.lax.scan(lambda h, g: (_stack(policy, g, h), None), x, ws)[0]


def _loss(stack):
    return lambda policy: lambda ws, x: jnp.sum(stack(policy, ws, x) ** 2)


def _plain(stack):
    return lambda policy: jax.jit(jax.grad(_loss(stack)(policy)))


def _micro_batched(stack, loop: str):
    """The gradient summed over `MICRO` micro-batches by `loop`: ``"scan"`` (one per
    iteration, the data scanned over), ``"fori"`` (a ``fori_loop`` taking each by its index,
    as ``optax.microbatching.microbatch`` does: the data a constant of the loop) or
    ``"python"`` (a Python loop: each micro-batch's gradient traced one after another)."""
    def make(policy):
        grad = jax.grad(_loss(stack)(policy))

        def step(ws, xs):
            acc = jnp.zeros_like(ws)
            if loop == "scan":
                return jax.lax.scan(lambda a, x: (a + grad(ws, x), None), acc, xs)[0]
            if loop == "fori":
                return jax.lax.fori_loop(0, MICRO, lambda i, a: a + grad(ws, xs[i]), acc)
            for i in range(MICRO):
                acc = acc + grad(ws, xs[i])
            return acc

        return jax.jit(step)
    return make


def _per_layer(saved: tuple[str, ...]) -> int:
    """What JAX keeps for one layer's backward under `saved`, its weights left out."""
    f = jax.checkpoint(_layer, policy=jax.checkpoint_policies.save_only_these_names(*saved))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize
               for a, why in saved_residuals(f, jnp.ones((ROWS, D)), jnp.ones((D, D)))
               if why != "from the argument w")


X = jax.ShapeDtypeStruct((ROWS, D), jnp.float32)
XS = jax.ShapeDtypeStruct((MICRO, ROWS, D), jnp.float32)
W1 = jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32)
W2 = jax.ShapeDtypeStruct((GROUPS, LAYERS, D, D), jnp.float32)
CASES = {  # name: (make_step, args, runs, held)
    "stack": (_plain(_stack), (W1, X), LAYERS, LAYERS),
    "stack, accumulated": (_micro_batched(_stack, "scan"), (W1, XS), MICRO * LAYERS, LAYERS),
    "stack, indexed": (_micro_batched(_stack, "fori"), (W1, XS), MICRO * LAYERS, LAYERS),
    "groups": (_plain(_grouped), (W2, X), GROUPS * LAYERS, GROUPS * LAYERS),
    "groups, accumulated": (_micro_batched(_grouped, "scan"), (W2, XS),
                            MICRO * GROUPS * LAYERS, GROUPS * LAYERS),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_loop_over_micro_batches_holds_one_micro_batchs_residuals(case):
    make_step, args, runs, held = CASES[case]
    g = step_graph(make_step, *args)
    assert (g.count, g.depth) == (runs, held)
    for saved in [(), ("h",), ("o",), ("h", "o")]:
        assert g.kept_bytes(saved) == held * _per_layer(saved), saved
    # the recompute counts every run: a layer's, times the runs
    assert g.recompute_flops(()) == runs * g.layers[0].graph.evaluate_roles(()).recompute_flops


def test_an_unrolled_loop_over_micro_batches_holds_every_micro_batch():
    """A Python loop over the micro-batches is no loop in the jaxpr: one stack's backward per
    micro-batch, each its own layers. XLA:CPU holds them all at once, so saving both tags
    grows the compiled step by every micro-batch's residuals, which is what the graph
    keeps (`compiled_bytes` of the two compiles)."""
    from xla_figures import compiled_bytes

    make_step, args = _micro_batched(_stack, "python"), (W1, XS)
    g = step_graph(make_step, *args)
    assert (g.count, g.depth) == (MICRO * LAYERS, MICRO * LAYERS)
    save = jax.checkpoint_policies.save_only_these_names
    grown = (compiled_bytes(make_step(save("h", "o")).lower(*args).compile())
             - compiled_bytes(make_step(save()).lower(*args).compile()))
    kept = g.stored_bytes(("h", "o")) - g.stored_bytes(())
    assert kept == MICRO * LAYERS * (_per_layer(("h", "o")) - _per_layer(()))
    assert abs(grown - kept) <= 0.01 * kept, (grown, kept)


def test_an_accumulated_steps_kept_bytes_are_what_xla_keeps():
    """XLA's compiled forward loop of the accumulated stack returns what the graph keeps:
    one micro-batch's residuals, for each tag and both."""
    make_step, args, _, _ = CASES["stack, accumulated"]
    got = kept_against_xla(make_step, args, step_graph(make_step, *args))
    assert got["graph"] == got["xla"]
    assert got["graph"]["h,o"] == LAYERS * (_per_layer(("h", "o")) - _per_layer(()))


def test_fit_on_an_accumulated_step_says_the_layers_run_more_than_once():
    """`fit`'s plan of the accumulated stack: its layers are the stack's, its kept bytes
    one micro-batch's, and a note says the backward runs once per micro-batch."""
    import neuron_remat as nr

    make_step, args, _, _ = CASES["stack, accumulated"]
    full = make_step(jax.checkpoint_policies.nothing_saveable).lower(*args).compile()
    size = full.memory_analysis()
    hbm = 4 * (size.argument_size_in_bytes + size.output_size_in_bytes
               + size.temp_size_in_bytes)
    device = nr.parse_device(f"trn2.48xlarge:hbm={hbm}B:cores=1", source="test")
    plan = nr.fit(make_step, *args, device=device, reserve=0, candidates=["h", "o"])
    assert plan.layers_per_core == LAYERS
    assert plan.compiled.no_remat or plan.kept_bytes_per_layer == _per_layer(plan.saved_tags)
    assert any(f"{MICRO:g} times" in n and "micro-batch" in n for n in plan.notes), plan.notes


# --------------------------------------------------------------------------------------
# A checkpoint inside a checkpointed layer.
# --------------------------------------------------------------------------------------


def _attention(x, w):
    q = cn(x @ w, "q")
    return cn(jax.nn.softmax(q @ x.T, axis=-1) @ x, "ctx")


def _nested_layer(x, w, inner):
    """`_attention` under a checkpoint of its own (policy `inner`), inside the layer."""
    a = jax.checkpoint(_attention, policy=inner)(x, w)
    return x + cn(jnp.tanh((x + a) @ w), "h") @ w.T


@pytest.mark.parametrize("inner", ["nothing", "q"])
def test_a_checkpoint_inside_a_checkpointed_layer_is_read(inner):
    """The inner checkpoint (saving nothing, or ``q``) leaves a remat of its own in the
    forward pass (no cotangents: it is not a layer's backward) and one inside the layer's
    backward, which recomputes ``q`` again: the same residual to JAX as the layer's
    recomputation of it. The graph reads the layer; what it keeps for each tag alone and all
    together is what XLA's forward loop returns (``q`` once), and its recompute under each
    save set is what the transposed jaxpr JAX builds for that set computes
    (`_jaxpr.jaxpr_cost`; XLA may merge the layer's and the inner checkpoint's
    recomputations)."""
    from neuron_remat import _jaxpr
    from neuron_remat._step import _traced

    save = jax.checkpoint_policies.save_only_these_names
    layer = functools.partial(_nested_layer, inner=save() if inner == "nothing" else save("q"))

    def make_step(policy):
        def loss(ws, x):
            body = jax.checkpoint(layer, policy=policy)
            return jnp.sum(jax.lax.scan(lambda h, w: (body(h, w), None), x, ws)[0] ** 2)
        return jax.jit(jax.grad(loss))

    args = (W1, X)
    g = step_graph(make_step, *args)
    assert len(g.layers) == 1 and set(g.tags) == {"q", "ctx", "h"}
    got = kept_against_xla(make_step, args, g)
    assert got["graph"] == got["xla"], got
    # the fast evaluation of tag sets counts the inner recomputation's value once too
    graph = g.layers[0].graph
    for r in range(4):
        for saved in itertools.combinations(sorted(g.tags), r):
            ev = graph.evaluate_roles(saved)
            assert graph.cost_of_roles(saved) == (ev.kept_bytes, ev.recompute_flops), saved

    def jaxpr_flops(saved):
        return _jaxpr.jaxpr_cost(_traced(make_step(save(*saved)), args)[0].jaxpr).flops

    for saved in [("q",), ("ctx",), ("h",), ("q", "ctx"), ("q", "h")]:
        spared = g.recompute_flops(()) - g.recompute_flops(saved)
        # roundings aside: the graph counts XLA's reduce_precision of each value kept (one
        # FLOP an element), which the jaxpr does not hold, and the inner checkpoint's own
        # saved q is one more
        assert abs(spared - (jaxpr_flops(()) - jaxpr_flops(saved))) <= \
            2 * len(saved) * LAYERS * ROWS * D, saved


def test_a_foreign_step_with_a_nested_checkpoint_keeps_what_xla_keeps():
    """foreign_zoo's ``linen-gpt2-nested``: Flax's GPT-2 with the attention's heads under a
    ``jax.checkpoint`` inside the block's ``nn.remat``. The heads' recomputation reads the
    causal mask through ``jnp.tril`` and ``jnp.where`` (jitted, a literal operand each), and
    the softmax it tags is the layer's own recomputation again: what the graph keeps for
    each tag alone and all together is what XLA's forward loop returns."""
    import foreign_zoo

    spec = foreign_zoo.STEPS["linen-gpt2-nested"]
    make_step, args = spec.make_step(), spec.abstract_args()
    got = kept_against_xla(make_step, args, step_graph(make_step, *args))
    assert got["graph"] == got["xla"], got
    assert got["xla"]["h/attn/attn_weights"] > 0
