"""`fit(make_step, *args, per_layer=True)`: make_step receives a tuple of per-layer policies
for the mixed probe, and the mix `fit` returns is confirmed by XLA's memory analysis.
Compiles several programs: marked slow."""

import jax
import jax.numpy as jnp
import pytest

import neuron_remat as nr
import reference as ref

CFG = nr.TransformerConfig(hidden=64, heads=4, kv_heads=2, ffn=192, layers=4, vocab=64,
                           name="fit-mix", flash_attention=False)


@pytest.mark.slow
def test_fit_per_layer_confirms_the_mix_by_compiling_it():
    params = jax.eval_shape(lambda: ref.init_stack(jax.random.PRNGKey(0), CFG))
    x = jax.ShapeDtypeStruct((2, 128, CFG.hidden), jnp.float32)
    seen = []

    def make_step(policy):
        seen.append(policy)

        def loss(p, x):
            return jnp.sum(nr.scan_layers(lambda h, q: ref.layer(h, q, CFG), p, x, policy) ** 2)

        return jax.jit(jax.grad(loss))

    def compiled_bytes(policy):
        m = make_step(policy).lower(params, x).compile().memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)

    full = compiled_bytes(nr.RegexPolicy([]))
    every = compiled_bytes(nr.RegexPolicy([r".*_proj", r".*context", r".*linear1_[01]"]))
    limit = (full + every) // 2
    dev = nr.parse_device(f"trn2:hbm={limit}B:cores=1")
    plan = nr.fit(make_step, params, x, device=dev, reserve=0, per_layer=True)
    assert plan.compiled.bytes <= limit
    if plan.layer_policies is not None:
        assert any(isinstance(p, tuple) and len(p) == CFG.layers for p in seen)
        mixed = plan.compiled.probes[-1]
        assert mixed.label == "per-layer mix"
        # the confirmed figure is XLA's, compiled independently here
        assert compiled_bytes(plan.layer_policies) == mixed.bytes <= limit
    else:
        assert any("per-layer" in n for n in plan.notes) or len(plan.layer_mix) == 1
