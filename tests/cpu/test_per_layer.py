"""Per-layer plans (`plan(..., per_layer=True)`): the mix of save sets over the layers is
the optimum a brute force over every assignment of tag sets to layers finds."""

import itertools

import numpy as np

import jax
import jax.numpy as jnp
import pytest

import neuron_remat as nr
from neuron_remat import memory_model as mm

from small_layer import CFG, layer

CANDS = ["MultiheadAttention.q_proj", "MultiheadAttention.k_proj",
         "TransformerFeedForwardLayer.linear1_0"]


@pytest.fixture(scope="module")
def footprint():
    """The small layer's traced footprint, from abstract arguments (nothing runs)."""
    import reference as ref

    params = jax.eval_shape(lambda: ref.init_layer(jax.random.PRNGKey(0), CFG))
    x = jax.ShapeDtypeStruct((2, 8, CFG.hidden), jnp.float32)
    return nr.traced_footprint(layer, x, params)


def _subsets(tags):
    return [s for r in range(len(tags) + 1) for s in itertools.combinations(tags, r)]


def _brute(costs, layers, cap, max_sets=None):
    """Least total recompute over every assignment of a subset to each layer (using at
    most `max_sets` distinct subsets)."""
    best = None
    for combo in itertools.product(range(len(costs)), repeat=layers):
        if max_sets is not None and len(set(combo)) > max_sets:
            continue
        combo = [costs[i] for i in combo]
        kept = sum(c[0] for c in combo)
        if kept <= cap:
            flops = sum(c[1] for c in combo)
            best = flops if best is None else min(best, flops)
    return best


@pytest.mark.parametrize("layers", [2, 3, 4])
def test_mix_is_the_brute_force_optimum(footprint, layers):
    cands = [t for t in CANDS if t in footprint]
    assert len(cands) == 3, sorted(footprint)
    costs = [footprint.evaluate(s) for s in _subsets(cands)]
    lo = min(c[0] for c in costs)
    hi = max(c[0] for c in costs)
    checked = mixed = 0
    for frac in (0.1, 0.3, 0.45, 0.6, 0.8, 0.95):
        budget = int(lo + frac * (hi - lo))
        p = nr.plan_footprint(footprint=footprint, budget_bytes=budget, candidates=cands,
                    layers=layers, per_layer=True, min_flops_per_byte=0, max_sets=None)
        expected = _brute(costs, layers, budget * layers)
        two = nr.plan_footprint(footprint=footprint, budget_bytes=budget, candidates=cands,
                      layers=layers, per_layer=True, min_flops_per_byte=0)
        assert len(two.layer_mix) <= 2
        assert two.mixed_recompute_flops == pytest.approx(
            _brute(costs, layers, budget * layers, max_sets=2), rel=1e-12)
        assert p.mixed_recompute_flops == pytest.approx(expected, rel=1e-12)
        assert p.mixed_kept_bytes <= budget * layers
        assert sum(m.layers for m in p.layer_mix) == layers
        assert p.mixed_recompute_flops <= p.recompute_flops_per_layer * layers
        if p.layer_policies is not None:
            mixed += 1
            assert len(p.layer_policies) == layers
            assert len({m.tags for m in p.layer_mix}) == len(p.layer_mix) > 1
        checked += 1
    assert checked == 6 and mixed >= 1  # some budget falls between frontier points


def test_uniform_best_mix_gives_no_layer_policies(footprint):
    every = [t for t in footprint if not footprint[t].always_kept]
    kept, _ = footprint.evaluate(every)
    p = nr.plan_footprint(footprint=footprint, budget_bytes=kept + 10, layers=4, per_layer=True)
    assert p.layer_policies is None
    assert [m.layers for m in p.layer_mix] == [4]


def test_per_layer_needs_layers_with_a_footprint(footprint):
    with pytest.raises(ValueError, match="layers="):
        nr.plan_footprint(footprint=footprint, budget_bytes=1 << 30, per_layer=True)
    with pytest.raises(ValueError, match="layers=0"):
        nr.plan_footprint(footprint=footprint, budget_bytes=1 << 30, per_layer=True, layers=0)


def test_analytic_mix_respects_each_sets_workspace():
    """The analytic path: all layers' kept bytes plus the largest workspace of the sets
    used fit what HBM leaves; brute force over assignments on a 4-layer model."""
    cfg = nr.TransformerConfig(hidden=256, heads=4, kv_heads=2, ffn=768, layers=4, vocab=256,
                               name="mix-4")
    shape = nr.StepShape(seq_len=512)
    par = nr.Parallelism(tp=1)
    cands = ["q_proj", "o_proj", "linear1_0"]
    planned = 0
    for hbm in ("79872KiB", "80896KiB", "82432KiB", "82944KiB"):  # 78 to 81 MiB
        dev = nr.parse_device(f"trn2:hbm={hbm}:cores=1")
        bud = mm.budget(dev, cfg, shape, par)
        fp = mm.layer_footprint(cfg, shape, par)
        free = bud.hbm_bytes - bud.state.total_bytes - bud.reserve_bytes
        costs = []
        for s in _subsets(cands):
            kept, flops = fp.evaluate(s)
            costs.append((kept, flops, bud.workspace_for(fp.roles[t] for t in s)))
        best = None
        for combo in itertools.product(costs, repeat=cfg.layers):
            if sum(c[0] for c in combo) * bud.inflight <= free - max(c[2] for c in combo):
                f = sum(c[1] for c in combo)
                best = f if best is None else min(best, f)
        try:
            p = nr.plan(dev, cfg, shape, par, candidates=cands, per_layer=True,
                        objective="flops", min_flops_per_byte=0, max_sets=None)
        except nr.NoFitError:
            assert best is None
            continue
        assert p.mixed_recompute_flops == pytest.approx(best, rel=1e-12), hbm
        planned += 1
    assert planned >= 3


MIX_DEVICE = "trn2:hbm=82432KiB:cores=1"
MIX_MODEL = nr.TransformerConfig(hidden=256, heads=4, kv_heads=2, ffn=768, layers=4, vocab=256,
                                 name="mix-4")


def test_provider_and_adapters_answer_per_layer_index(monkeypatch):
    """`layer_index=` (unrolled stacks): each layer gets its own policy of the per-layer
    plan, through the provider and the JAX, Flax and Equinox adapters' deferred policy."""
    from neuron_remat import plugin
    from neuron_remat.adapters import equinox as eqx_adapter
    from neuron_remat.adapters import flax as flax_adapter

    monkeypatch.setenv("NEURON_REMAT_DEVICE", MIX_DEVICE)
    ctx = dict(model=MIX_MODEL, shape={"seq_len": 512}, parallelism={"tp": 1})
    whole = nr.plan(nr.parse_device(MIX_DEVICE), MIX_MODEL, nr.StepShape(seq_len=512),
                    nr.Parallelism(tp=1), per_layer=True)
    assert whole.layer_policies is not None and len(set(whole.layer_policies)) == 2
    got = [plugin.provide(layer_index=i, **ctx).policy for i in range(4)]
    assert got == list(whole.layer_policies)
    # numpy's integers (a host looping over np.arange) are layer numbers too
    plugin.clear_cache()
    assert [plugin.provide(layer_index=i, **ctx).policy
            for i in np.arange(4)] == list(whole.layer_policies)
    assert plugin.provide(**ctx).policy == whole.policy  # no index: the uniform plan
    f = nr.checkpoint(lambda x: x, layer_index=3, **ctx)
    x = jnp.ones(3)
    jax.grad(lambda x: jnp.sum(f(x)))(x)  # resolves when traced
    deferred = [plugin.deferred(layer_index=i, stack="stacked", **ctx) for i in range(4)]
    assert [d.resolve().policy for d in deferred] == list(whole.layer_policies)
    # the Flax and Equinox adapters carry layer_index in the same deferred context
    _, pol = plugin.remat_args("stacked", None, None, dict(layer_index=1, **ctx))
    assert pol.resolve().policy == whole.layer_policies[1]
    assert callable(flax_adapter.remat) and callable(eqx_adapter.filter_checkpoint)
    with pytest.raises(ValueError, match="layer_index=4"):
        plugin._provide(None, "stacked", MIX_MODEL, None, {"seq_len": 512}, {"tp": 1},
                        nr.parse_device(MIX_DEVICE), 4)
    with pytest.raises(ValueError, match="layer_index=-1"):
        plugin._provide(None, "stacked", MIX_MODEL, None, {"seq_len": 512}, {"tp": 1},
                        nr.parse_device(MIX_DEVICE), -1)


def test_table_and_json_show_the_mix(footprint):
    cands = [t for t in CANDS if t in footprint]
    costs = sorted(footprint.evaluate(s)[0] for s in _subsets(cands))
    budget = (costs[0] + costs[-1]) // 2
    p = nr.plan_footprint(footprint=footprint, budget_bytes=budget, candidates=cands, layers=4,
                per_layer=True)
    d = p.to_dict()
    assert sum(m["layers"] for m in d["layer_mix"]) == 4
    assert d["mixed"]["recompute_flops"] == pytest.approx(p.mixed_recompute_flops)
    assert "per-layer plan:" in p.table()


def _scan_setup():
    import reference as ref

    def lay(h, p):
        return ref.layer(h, p, CFG)

    q = nr.RegexPolicy([r".*q_proj"])
    every = nr.RegexPolicy([r".*_proj", r".*linear1_[01]", r".*context"])
    return ref, lay, q, every, [every, every, q, q]


def test_scan_layers_keeps_what_each_run_says():
    """What a mixed stack keeps follows the policy of each run (JAX's saved residuals;
    traced, nothing compiled)."""
    from jax._src.ad_checkpoint import saved_residuals

    ref, lay, q, every, mixed = _scan_setup()
    params = jax.eval_shape(lambda: ref.init_stack(jax.random.PRNGKey(0), CFG, layers=4))
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), params)
    x = jnp.zeros((2, 8, CFG.hidden))
    def kept(f):
        # (shape, dtype) of what JAX keeps for the backward, the arguments left out
        return sorted((tuple(a.shape), str(a.dtype)) for a, why in saved_residuals(f, params)
                      if not why.startswith("from the argument"))

    def by_hand(p):
        # the expected stack, written here: layers 0-1 scanned under `every`, 2-3 under `q`
        def run(h, ps, policy):
            body = jax.checkpoint(lay, policy=policy)
            return jax.lax.scan(lambda c, w: (body(c, w), None), h, ps)[0]

        h = run(x, jax.tree.map(lambda a: a[:2], p), every)
        return run(h, jax.tree.map(lambda a: a[2:], p), q)

    assert kept(lambda p: nr.scan_layers(lay, p, x, mixed)) == kept(by_hand)
    assert kept(lambda p: nr.scan_layers(lay, p, x, mixed)) != kept(
        lambda p: nr.scan_layers(lay, p, x, q))  # the runs' policies differ, and show
    assert nr.stack.policy_runs(mixed) == [(0, 2, every), (2, 4, q)]
    with pytest.raises(ValueError, match="3 entries for 4"):
        nr.scan_layers(lay, params, x, mixed[:3])


@pytest.mark.parametrize(("params", "policies", "match"), [
    ({"w": np.ones((3, 4, 4))}, (None, "None", None),
     r"policies\[1\]='None' \(str\) is not a remat policy"),
    ({"w": np.ones((3, 4, 4))}, "full", r"policies='full' \(str\) is not a remat policy"),
    ({"w": np.ones((3, 4, 4))}, 3, r"policies=3 \(int\) is not a remat policy"),
    ({"s": np.ones((4,)), "w": np.ones((3, 4, 4))}, None,
     r"stacked_params\['w'\] has shape \(3, 4, 4\) but stacked_params\['s'\] has \(4,\)"),
    ({"w": 1.0}, None, r"stacked_params\['w'\] is a float with no shape"),
])
def test_scan_layers_refuses_what_is_not_a_policy_or_a_stack(params, policies, match):
    # refused before tracing: without the check these ran forward and failed only under
    # jax.grad, inside lax.scan, or with an IndexError
    with pytest.raises(ValueError, match=match):
        jax.grad(lambda x: nr.scan_layers(lambda h, p: jnp.tanh(h @ p["w"]), params, x,
                                          policies).sum())(jnp.ones((2, 4)))


def test_scan_layers_takes_a_numpy_array_of_policies():
    pols = np.array([None, None, None], dtype=object)
    out = nr.scan_layers(lambda h, p: h @ p["w"], {"w": np.eye(4)[None].repeat(3, 0)},
                         jnp.ones((2, 4)), pols)
    assert out.shape == (2, 4)


@pytest.mark.slow
def test_scan_layers_computes_what_the_plain_stack_computes():
    """Values and gradients of a mixed stack equal the plain stack's (one compile)."""
    ref, lay, q, every, mixed = _scan_setup()
    params = jax.jit(lambda k: ref.init_stack(k, CFG, layers=4))(jax.random.PRNGKey(0))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, CFG.hidden)), jnp.float32)

    @jax.jit
    def differences(p, x):
        out = nr.scan_layers(lay, p, x, mixed)
        plain = ref.stack(x, p, CFG, policy="none")
        g1 = jax.grad(lambda p: jnp.sum(nr.scan_layers(lay, p, x, mixed) ** 2))(p)
        g2 = jax.grad(lambda p: jnp.sum(ref.stack(x, p, CFG, policy="none") ** 2))(p)
        return jnp.max(jnp.abs(out - plain)), jnp.max(jnp.stack([
            jnp.max(jnp.abs(a - b) / (1 + jnp.abs(b)))
            for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2))]))

    d_out, d_grad = differences(params, x)
    assert float(d_out) < 1e-5 and float(d_grad) < 1e-4
