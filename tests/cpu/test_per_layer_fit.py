"""`fit(make_step, *args, per_layer=True)`: make_step receives a tuple of per-layer policies
for the mixed probe, and the mix `fit` returns is confirmed by XLA's memory analysis.
Compiles several programs: marked slow."""

import jax
import jax.numpy as jnp
import pytest

import neuron_remat as nr
import reference as ref
from xla_figures import measure

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

    every = compiled_bytes(nr.RegexPolicy([r".*_proj", r".*context", r".*linear1_[01]"]))
    none = compiled_bytes(jax.checkpoint_policies.everything_saveable)
    # halfway from saving every tag to no remat: some layers without remat fit
    limit = (every + none) // 2
    dev = nr.parse_device(f"trn2:hbm={limit}B:cores=1")
    plan = nr.fit(make_step, params, x, device=dev, reserve=0, per_layer=True)
    assert plan.compiled.bytes <= limit
    # the plan's compiled figure is its one policy's, compiled independently here
    assert compiled_bytes(plan.policy) == plan.compiled.bytes
    assert plan.layer_policies is not None, plan.notes
    assert any(isinstance(p, tuple) and len(p) == CFG.layers for p in seen)
    mixed = plan.compiled.probes[-1]
    assert mixed.label == "per-layer mix"
    # the mix's confirmed figure is XLA's, compiled independently here
    assert compiled_bytes(plan.layer_policies) == mixed.bytes == plan.compiled.mix_bytes
    assert mixed.bytes <= limit


@pytest.mark.slow
def test_fit_per_layer_between_every_tag_and_no_remat_on_a_zoo_step():
    """A zoo step (a train one, shortened) at a limit 3/4 of the way from "every tag" to no
    remat, both compiled here: the mix fit returns (no remat on some layers) compiles within
    the limit, and its FLOPs beat the best uniform set's by the FLOPs the plan says it
    saves, within 0.3 points of the step's FLOPs: XLA's, compiled here, each step counted
    as it runs (`zoo.as_run_flops`: XLA:CPU counts a rolled scan's body once)."""
    import dataclasses
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import zoo

    # gqa4-adamw without its attention-scores tag: saving the scores keeps about what no
    # remat keeps, which leaves no room for a mix between "every tag" and no remat.
    base = zoo.ZOO["gqa4-adamw"]
    spec = dataclasses.replace(base, seq=32, hidden=64, ffn=128,
                               tags={r: t for r, t in base.tags.items() if r != "scores"})
    makers, args = {1: spec.make_step(), 2: spec.make_step(unroll=2)}, spec.abstract_args()
    make = makers[1]
    none = jax.checkpoint_policies.everything_saveable
    every = nr.RegexPolicy([re.escape(t) for t in spec.tags.values() if t])

    e, n = measure(make(every), args)[0], measure(make(none), args)[0]
    limit = int(e + 0.75 * (n - e))
    dev = nr.parse_device(f"trn2.48xlarge:hbm={limit}B:cores=1", source="test")
    plan = nr.fit(make, *args, device=dev, reserve=0, per_layer=True)
    assert plan.layer_policies is not None, plan.notes
    assert len(plan.layer_policies) == spec.layers
    assert none in plan.layer_policies  # some layers without remat
    # the mix marks those layers, by count, and its JSON says so
    assert sum(m.layers for m in plan.layer_mix if m.no_remat) == \
        sum(p is none for p in plan.layer_policies)
    assert [m["no_remat"] for m in plan.to_dict()["layer_mix"]] == \
        [m.policy is none for m in plan.layer_mix]
    mixed_bytes, mixed_flops = measure(make(plan.layer_policies), args)
    assert mixed_bytes == plan.compiled.probes[-1].bytes <= limit
    # XLA's FLOPs as each step runs: no remat (the step), the uniform plan, the mix (its
    # rolled count is the compile above).
    seen: dict = {(repr(plan.layer_policies), 1): mixed_flops}

    def flops(policy, unroll):
        key = (repr(policy), unroll)
        if key not in seen:
            seen[key] = measure(makers[unroll](policy), args)[1]
        return seen[key]

    step = zoo.as_run_flops(spec, none, flops)
    uniform = zoo.as_run_flops(spec, plan.policy, flops)
    mixed = zoo.as_run_flops(spec, plan.layer_policies, flops)
    measured = 100 * (uniform - mixed) / step
    # the plan's FLOPs saved (uniform - mixed recompute, all layers) over XLA's step
    saved = plan.recompute_flops_per_layer * plan.layers_per_core - plan.mixed_recompute_flops
    predicted = 100 * saved / step
    assert measured > 0
    assert abs(measured - predicted) <= 0.3, (measured, predicted)


@pytest.mark.slow
def test_a_mix_compiled_over_the_limit_is_chosen_again_with_its_miss_reserved():
    """Running a stack as several scans costs memory the model does not see. On the
    shortened gqa4-adamw at 3/4 of the way from "every tag" to no remat, XLA:CPU compiles
    the first mix (2 layers without remat) about 0.47 MiB over its prediction and over the
    limit; `fit` reserves the miss, chooses again, and the mix it then compiles (fewer
    layers without remat) fits: its figure, compiled again here, is the plan's."""
    import dataclasses
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import zoo

    base = zoo.ZOO["gqa4-adamw"]
    spec = dataclasses.replace(base, seq=32, hidden=64, ffn=128,
                               tags={r: t for r, t in base.tags.items() if r != "scores"})
    make, args = spec.make_step(), spec.abstract_args()
    none = jax.checkpoint_policies.everything_saveable
    every = nr.RegexPolicy([re.escape(t) for t in spec.tags.values() if t])

    def total(step):
        m = step.lower(*args).compile().memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)

    e, n = total(make(every)), total(make(none))
    limit = int(e + 0.75 * (n - e))
    dev = nr.parse_device(f"trn2.48xlarge:hbm={limit}B:cores=1", source="test")
    plan = nr.fit(make, *args, device=dev, reserve=0, per_layer=True)
    mixes = [p for p in plan.compiled.probes if p.label == "per-layer mix"]
    assert len(mixes) >= 2 and mixes[0].bytes > limit, (plan.notes, mixes)
    assert plan.layer_policies is not None, plan.notes
    assert total(make(plan.layer_policies)) == plan.compiled.mix_bytes == mixes[-1].bytes
    assert mixes[-1].bytes <= limit
    assert total(make(plan.policy)) == plan.compiled.bytes <= limit  # the uniform policy's
    assert (f"fit: per-layer mix (Plan.layer_policies, as listed below): compiled "
            f"{mixes[-1].bytes / 2**20:.4g} MiB") in nr.fit_table(plan)
    # chosen again with the miss reserved: the last mix's prediction (the reserve
    # included) is within the limit, and the reserve is the first mix's miss
    assert mixes[-1].predicted_bytes <= limit
    miss = mixes[0].bytes - mixes[0].predicted_bytes
    from neuron_remat._format import fmt_bytes

    assert fmt_bytes(miss) + " reserved" in plan.notes[-1], plan.notes
    off = sum(1 for p in plan.layer_policies if p is none)
    assert 0 < off < spec.layers


def test_choose_mix_is_the_brute_force_over_counts():
    """`fit_per_layer`'s choice over priced sets (per-layer bytes, a workspace held once,
    recompute per layer) against every assignment of sets to layers, enumerated here."""
    import importlib
    import itertools
    import random

    M = importlib.import_module("neuron_remat._mix")
    rng = random.Random(7)
    for trial in range(40):
        sets = [M._MixSet(None, rng.randint(50, 100), 0, 0.0)] + [
            M._MixSet((f"t{i}",), rng.randint(0, 60), rng.randint(0, 30),
                      float(rng.randint(1, 50))) for i in range(3)]
        layers = rng.randint(2, 4)
        room = rng.randint(40, 100 * layers)
        best = None
        for pick in itertools.product(range(len(sets)), repeat=layers):
            used = {sets[i] for i in pick}
            if len(used) > 2:
                continue
            nbytes = sum(sets[i].per_layer for i in pick) + max(s.workspace for s in used)
            if nbytes <= room:
                cost = sum(sets[i].cost for i in pick)
                best = cost if best is None else min(best, cost)
        got = M._choose_mix(sets, layers, room, 2)
        if best is None:
            assert got is None, trial
            continue
        assert got is not None and got[0] == pytest.approx(best), trial
        chosen = got[1]
        assert sum(k for _, k in chosen) == layers and len(chosen) <= 2
        assert sum(s.per_layer * k for s, k in chosen) + max(s.workspace for s, _ in chosen) \
            <= room
