"""`traced_footprint` of axlearn's mixture-of-experts layer, held to JAX.

Skipped unless axlearn imports (a real checkout at commit
34aed43c1b6e581c4753d06d7cbeedd5010ef26b, Python 3.12, JAX 0.8.3: README, "The tests on a
real axlearn"). The layer is axlearn's ``TransformerLayer`` as Fuji's stack holds it (RMSNorm,
causal GQA 4:2 with the rotary embedding) whose feed-forward is axlearn's
``TransformerFeedForwardMoE`` (4 experts, top-2, 2 dispatch groups, capacity factor 2,
SwiGLU experts; ``axlearn_zoo.moe_layer_config``, each setting cited there), with a bfloat16
forward, routed by ``TopKGating`` (which tags its top-k outputs) or by ``Top2Gating`` (the
config's default, which tags nothing). For each router:

* the footprint reads exactly the tags in the layer's VJP jaxpr (axlearn's
  ``"<LayerClass>.<name>"`` names); ``TopKGating.gate_weights`` (a top-k output the layer
  never uses) keeps nothing; the experts' einsums carry no tag;
* the kept bytes of the footprint equal those JAX's ``saved_residuals`` lists (the layer
  input counted, the parameters not) for the layer under ``save_only_these_names(*saved)``
  in its ``RematSpec`` (axlearn's own ``jax.checkpoint``), for no tag, every tag, each tag
  alone and every tag but one; and an outer ``jax.checkpoint`` keeps the same bytes.

On JAX < 0.9 (axlearn's pin is 0.8.3), JAX keeps ``TopKGating.gate_assignment`` twice when
saved: under its name, and as the residual of the jitted ``jnp.take_along_axis`` that reads
it (mixture_of_experts.py 942), since the backward also reads it outside that jit, through
the dispatch mask's one-hot (966). The footprint counted it once (2048 bytes short of JAX's
on the 9 sets that save it) until it modelled the jit's copy.
"""

from __future__ import annotations

import pytest

import axlearn_zoo as az
from xla_figures import jax_kept_bytes

_WHY = az.available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

_ATTENTION = tuple(f"GroupedQueryAttention.{t}"
                   for t in ("context", "k_proj", "o_proj", "q_proj", "v_proj"))
TAGS = {
    "Top2Gating": tuple(sorted((*_ATTENTION, "TransformerLayer.input"))),
    "TopKGating": tuple(sorted((*_ATTENTION, "TransformerLayer.input",
                                "TopKGating.gate_assignment", "TopKGating.gate_weights"))),
}
"""The footprint's tags for each router (the first test asserts them)."""

def _cases():
    """(router, saved tags) for none, every tag, each alone and every tag but one."""
    for gating, tags in TAGS.items():
        sets = [("none", ()), ("all", tags), *((f"only {t}", (t,)) for t in tags),
                *((f"all but {t}", tuple(u for u in tags if u != t)) for t in tags)]
        for label, saved in sets:
            yield pytest.param(gating, saved, id=f"{gating}-{label}")


_LAYERS: dict = {}


def _layer(gating):
    """(layer function of (params, x) without remat, params, x, its traced footprint),
    built once per router."""
    if gating not in _LAYERS:
        import neuron_remat as nr

        fn, params, x = az.moe_layer(gating)
        _LAYERS[gating] = fn, params, x, nr.traced_footprint(fn, params, x,
                                                              activation_argnums=1)
    return _LAYERS[gating]


def _kept_bytes(fn, params, x):
    """Bytes of what JAX's ``saved_residuals`` lists for ``fn(params, x)``: the layer input
    counted, the parameters not (as the footprint counts)."""
    return jax_kept_bytes(fn, (params, x), 1)


def jax_kept(gating, saved):
    """What JAX keeps for the layer with ``save_only_these_names(*saved)`` in its
    ``RematSpec`` (axlearn's ``jax.checkpoint`` around ``TransformerLayer.forward``)."""
    import jax

    fn, params, x = az.moe_layer(gating, jax.checkpoint_policies.save_only_these_names(*saved))
    return _kept_bytes(fn, params, x)


@pytest.mark.parametrize("gating", az.MOE_GATINGS)
def test_footprint_reads_every_tag_jax_emits(gating):
    import jax
    from jaxpr_names import names_in

    fn, params, x, fp = _layer(gating)
    emitted = names_in(jax.make_jaxpr(lambda p, x: jax.vjp(fn, p, x))(params, x))
    assert set(fp) == emitted, (sorted(fp), sorted(emitted))
    assert tuple(sorted(fp)) == TAGS[gating], sorted(fp)
    assert not any(t.startswith("TransformerFeedForwardMoE.") for t in fp)  # no expert tag
    if gating == "TopKGating":
        # _top_k tags both outputs (mixture_of_experts.py 801-802); _compute_index keeps
        # only the indices (814): the backward never reads the weights' tag.
        weights = fp["TopKGating.gate_weights"]
        assert weights.bytes == 0 and weights.recompute_flops == 0, weights
        assert "never reads" in weights.note, weights.note


@pytest.mark.parametrize("gating, saved", list(_cases()))
def test_kept_bytes_are_jaxs(gating, saved):
    """The footprint's kept bytes for `saved` are JAX's (see the module docstring)."""
    assert _layer(gating)[3].evaluate(saved)[0] == jax_kept(gating, saved), saved


@pytest.mark.parametrize("gating", az.MOE_GATINGS)
def test_the_ground_truth_is_the_same_under_an_outer_checkpoint(gating):
    """The layer wrapped in ``jax.checkpoint`` from outside (no ``RematSpec``) keeps what it
    keeps with the policy in its ``RematSpec``, for every tag saved and for none."""
    import jax

    fn, params, x, _ = _layer(gating)
    for saved in [(), TAGS[gating]]:
        outer = jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*saved))
        assert _kept_bytes(outer, params, x) == jax_kept(gating, saved), saved
