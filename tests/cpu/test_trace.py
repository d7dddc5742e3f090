"""The traced layer graph held to JAX and XLA: for every tag set, the bytes JAX keeps and the
FLOPs a compiled training step spends; the planner's joint search against brute force over
compiled programs; tags that only pay off together; the layer input found from the output.

Layers are the reference layer's variants (separate q/k/v, fused q/k/v, MaxText names) and
a small user layer with a jitted block and a custom-JVP activation, each called both
``f(x, params)`` and ``f(params, x)``. Shapes are tiny so that compiles stay fast, and
float32 (XLA's CPU backend computes bfloat16 in float32).
"""

import json
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name, checkpoint_policies

from neuron_remat._jax_compat import saved_residuals

import neuron_remat as nr
from neuron_remat import _trace, graph as gr, memory_model as mm, models, planner
from neuron_remat import policies as pol
import reference as ref
from tag_sets import every_or_covering, every_subset
from xla_figures import jax_kept_bytes, scan_step_flops

CFG = models.TransformerConfig(hidden=64, heads=4, kv_heads=2, ffn=256, layers=2, vocab=64,
                               name="tiny-gqa")
MAXTEXT = models.TransformerConfig(hidden=64, heads=4, kv_heads=2, ffn=256, layers=2,
                                   vocab=64, name="tiny-maxtext", tags=models.MAXTEXT_TAGS)
BATCH, SEQ = 1, 32
TRN2_REGEX = r".*[kqv]_proj|.*linear1_[01]"  # axlearn's TRN2 remat regex (PR 898)
DEFAULT_REGEX = r".*([qkvo]_proj|context)"  # axlearn's default save regex


def _x(config=CFG):
    return jax.random.normal(jax.random.PRNGKey(1), (BATCH, SEQ, config.hidden))


def user_layer(params, x):
    """Not the reference layer: a jitted MLP block, relu (a custom JVP), a tagged norm."""
    @jax.jit
    def block(w1, w2, h):
        a = checkpoint_name(h @ w1, "mlp_in")
        return checkpoint_name(jax.nn.relu(a) @ w2, "mlp_out")

    n = checkpoint_name(x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6), "norm")
    return x + jnp.tanh(block(params["w1"], params["w2"], n))


def _user_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    return {"w1": jax.random.normal(k1, (CFG.hidden, 128)) / 8,
            "w2": jax.random.normal(k2, (128, CFG.hidden)) / 11}


VARIANTS = {
    "separate": (CFG, False),
    "fused": (CFG, True),
    "maxtext": (MAXTEXT, False),
}


def _call(variant, order):
    """(fn, args, index of the activation argument) for a variant called in `order`."""
    x = _x()
    if variant == "user":
        p = _user_params()
        if order == "params-first":
            return user_layer, (p, x), 1
        return (lambda x, p: user_layer(p, x)), (x, p), 0
    config, fused = VARIANTS[variant]
    p = ref.init_layer(jax.random.PRNGKey(0), config, fused_qkv=fused)
    if order == "params-first":
        return (lambda p, x: ref.layer_params_first(p, x, config)), (p, x), 1
    return (lambda x, p: ref.layer(x, p, config)), (x, p), 0


def _activation_bytes(fn, args, act):
    """What JAX keeps for the backward, parameters excluded."""
    return jax_kept_bytes(fn, args, act)


def _replayed(fn, args):
    """`fn` as its traced program: the same equations, re-traced about twice as fast (every
    tag set below re-traces the layer under another policy)."""
    closed = jax.make_jaxpr(fn)(*args)
    run = jax.extend.core.jaxpr_as_fun(closed)
    _, tree = jax.tree.flatten(args)

    def replay(*a):
        (out,) = run(*jax.tree.leaves(a))
        return out

    return replay


# --- bytes: every subset, exactly ------------------------------------------------------


@pytest.mark.parametrize("order", ["activation-first", "params-first"])
@pytest.mark.parametrize("variant", ["separate", "fused", "maxtext", "user"])
def test_kept_bytes_equal_jax_residuals_for_every_tag_set(variant, order):
    """Every subset of the tags (with NR_TEST_TAG_SETS=covering, as CI's runs on the other
    JAX versions set it, a sample covering every pair: `tag_sets`)."""
    fn, args, act = _call(variant, order)
    fp = nr.traced_footprint(fn, *args)
    tags = list(fp)
    assert len(tags) == (3 if variant == "user" else 9)
    replay = _replayed(fn, args)
    for subset in every_or_covering(tags):
        policy = checkpoint_policies.save_only_these_names(*subset)
        measured = _activation_bytes(jax.checkpoint(replay, policy=policy), args, act)
        assert fp.evaluate(subset)[0] == measured, subset
    # Without remat JAX keeps every value the backward reads (and a scalar literal or two).
    assert fp.no_remat_bytes == pytest.approx(_activation_bytes(fn, args, act), abs=16)


def _router(w, x):
    """A top-2 router in the shape of axlearn's ``TopKGating`` (mixture_of_experts.py
    941-1006 at 34aed43c): the chosen experts' indices are tagged, then read by a jit
    (``jnp.take_along_axis`` is one) and, outside it, by a dispatch mask."""
    gates = jax.nn.softmax(x @ w, axis=-1)
    idx = checkpoint_name(jax.lax.top_k(gates, 2)[1], "idx")
    picked = jax.jit(lambda g, i: jnp.take_along_axis(g, i, axis=-1))(gates, idx)
    mask = jnp.sum(idx[..., None] == jnp.arange(gates.shape[-1]), axis=-2)
    spread = jnp.sum(mask.astype(gates.dtype) * gates, axis=-1, keepdims=True)
    return x + jnp.sum(picked, axis=-1, keepdims=True) + spread


def test_a_value_a_jit_and_the_code_around_it_read_is_kept_as_jax_keeps_it():
    """JAX before 0.9 keeps such a value twice when saved: under its name, and as the
    jit's own residual (the jit's known half returns the operand its staged half reads;
    later versions forward it). The footprint keeps what the running JAX keeps."""
    w, x = jnp.ones((8, 4)) / 8, jnp.arange(128 * 8, dtype=jnp.float32).reshape(128, 8) / 1e3
    fp = nr.traced_footprint(_router, w, x, activation_argnums=1)
    assert set(fp) == {"idx"}
    for subset in every_subset(list(fp)):
        policy = checkpoint_policies.save_only_these_names(*subset)
        want = _activation_bytes(jax.checkpoint(_router, policy=policy), (w, x), 1)
        assert fp.evaluate(subset)[0] == want, subset


def _read_in_and_around_a_jit(x, w):
    """A float value (``t``) read by a jit's backward (the jitted sin's derivative) and by
    the backward outside it; beside it one read outside any jit (``u``)."""
    t = checkpoint_name(x @ w, "t")
    u = checkpoint_name(jnp.tanh(x @ w.T), "u")
    return jnp.tanh((jax.jit(jnp.sin)(t) + jnp.sin(t) + u) @ w.T)


def test_a_value_a_jit_and_the_code_around_it_read_costs_what_jax_and_xla_count():
    """The same on a float value: on JAX < 0.9 its jit's copy is kept too, but rounded once
    (one ``reduce_precision``), so XLA's recompute FLOPs (a training step over a scan of two
    layers, less the same without remat) equal the footprint's on every subset."""
    x, w = jnp.ones((16, 16)), jnp.ones((16, 16)) / 16
    fp = nr.traced_footprint(_read_in_and_around_a_jit, x, w, activation_argnums=0)

    def step_flops(policy):
        return scan_step_flops(_read_in_and_around_a_jit, policy, x, w)

    base = step_flops(None)
    for subset in every_subset(["t", "u"]):
        policy = checkpoint_policies.save_only_these_names(*subset)
        want = _activation_bytes(jax.checkpoint(_read_in_and_around_a_jit, policy=policy),
                                 (x, w), 0)
        assert fp.evaluate(subset) == (want, step_flops(policy) - base), subset
        plain = fp.graph.evaluate_roles(subset)
        assert (plain.kept_bytes, plain.recompute_flops) == fp.evaluate(subset), subset


def test_fast_evaluation_equals_the_traversal_on_every_tag_set():
    graphs = [mm.layer_graph(CFG, models.StepShape(seq_len=SEQ, micro_batch=2)),
              mm.layer_graph(models.TransformerConfig(
                  hidden=64, heads=4, ffn=256, layers=2, vocab=64, gated_ffn=False,
                  norm="layer", activation="gelu"), models.StepShape(seq_len=SEQ)),
              mm.layer_graph(models.TransformerConfig(
                  hidden=64, heads=4, kv_heads=2, ffn=256, layers=2, vocab=64,
                  flash_attention=True), models.StepShape(seq_len=SEQ),
                  models.Parallelism(tp=2, sequence_parallel=True))]
    for variant in ("fused", "user"):
        fn, args, _ = _call(variant, "params-first")
        graphs.append(nr.traced_footprint(fn, *args).graph)
    for g in graphs:
        roles = sorted(g.role_values())
        for subset in every_subset(roles):
            plain = g.evaluate_roles(subset)
            assert g.cost_of_roles(subset) == (plain.kept_bytes, plain.recompute_flops), subset


# --- FLOPs: compiled training steps ----------------------------------------------------


_COMPILED: dict = {}


def _step_flops(fused, saved):
    """Compiled FLOPs of a training step over a scan of 2 layers (XLA counts the body
    once, so differences between policies are one layer's)."""
    key = (fused, None if saved == "none" else tuple(sorted(saved)))
    if key not in _COMPILED:
        params = ref.init_stack(jax.random.PRNGKey(0), CFG, 2, fused_qkv=fused)
        policy = "none" if saved == "none" else checkpoint_policies.save_only_these_names(
            *saved)

        def loss(x, p):
            return jnp.sum(ref.stack(x, p, CFG, policy=policy, scan=True))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(_x(), params).compile()
        _COMPILED[key] = compiled.cost_analysis()["flops"]
    return _COMPILED[key]


def _jax_rounding(fused, subset):
    """Elements of the floating intermediates JAX keeps for one layer under `subset`
    (``saved_residuals``, arguments excluded): JAX's remat puts a ``reduce_precision``
    (one FLOP per element in XLA's count) on each."""
    params = ref.init_layer(jax.random.PRNGKey(0), CFG, fused_qkv=fused)
    fn = jax.checkpoint(lambda x, p: ref.layer(x, p, CFG),
                        policy=checkpoint_policies.save_only_these_names(*subset))
    return sum(int(np.prod(aval.shape)) for aval, what in saved_residuals(fn, _x(), params)
               if not what.startswith("from the argument")
               and jnp.issubdtype(aval.dtype, jnp.floating))


def _assert_flops_close(fp, subset, measured, fused):
    # Within 1%, plus one more rounding of each kept intermediate (counted from JAX's
    # residuals): XLA fuses JAX's reduce_precision into each consumer of the saved value,
    # so it counts it about twice.
    predicted = fp.evaluate(subset)[1]
    assert abs(predicted - measured) <= 0.01 * measured + _jax_rounding(fused, subset), (
        subset, predicted, measured)


@pytest.fixture(scope="module")
def fused_fp():
    return nr.traced_footprint(lambda p, x: ref.layer_params_first(p, x, CFG),
                               ref.init_layer(jax.random.PRNGKey(0), CFG, fused_qkv=True), _x())


@pytest.fixture(scope="module")
def separate_fp():
    return nr.traced_footprint(lambda x, p: ref.layer(x, p, CFG), _x(),
                               ref.init_layer(jax.random.PRNGKey(0), CFG))


def test_recompute_flops_match_compiled_steps_separate_qkv(separate_fp):
    fp = separate_fp
    names = ref.tag_names(CFG)
    base = _step_flops(False, "none")
    for roles in [(), ("q_proj",), ("q_proj", "k_proj", "v_proj"), ("context", "o_proj"),
                  ("linear1_0", "linear1_1"), tuple(names)]:
        subset = tuple(names[r] for r in roles)
        _assert_flops_close(fp, subset, _step_flops(False, subset) - base, False)


CANDIDATES = ("q_proj", "k_proj", "v_proj", "context")


@pytest.fixture(scope="module")
def fused_compiled(fused_fp):
    """Compiled step FLOPs (minus no remat) of every subset of CANDIDATES, fused q/k/v."""
    names = ref.tag_names(CFG)
    cands = tuple(names[r] for r in CANDIDATES)
    base = _step_flops(True, "none")
    return {frozenset(s): _step_flops(True, s) - base for s in every_subset(cands)}


@pytest.mark.slow  # about 35 s (every subset compiled): run by CI's slow step
def test_recompute_flops_match_compiled_steps_fused_qkv(fused_fp, fused_compiled):
    for subset, measured in fused_compiled.items():
        _assert_flops_close(fused_fp, tuple(subset), measured, True)


def test_plan_is_the_compiled_optimum_at_every_budget(fused_fp, fused_compiled):
    fp = fused_fp
    names = ref.tag_names(CFG)
    cands = [names[r] for r in CANDIDATES]
    levels = sorted({fp.evaluate(s)[0] for s in fused_compiled})
    assert len(levels) >= 6
    budgets = [int(b) for b in np.linspace(levels[0], levels[-1], 7)]
    chosen = set()
    for budget in budgets:
        plan = planner.plan_footprint(footprint=fp, budget_bytes=budget, candidates=cands,
                            min_flops_per_byte=0)
        fits = {s: f for s, f in fused_compiled.items() if fp.evaluate(s)[0] <= budget}
        best = min(fits.values())
        got = fused_compiled[frozenset(plan.saved_tags)]
        assert got == pytest.approx(best, rel=1e-9, abs=1), (budget, plan.saved_tags)
        assert plan.kept_bytes_per_layer <= budget
        chosen.add(plan.saved_tags)
    assert len(chosen) >= 3  # the budgets really move the plan


def test_fused_layer_plan_beats_the_trn2_regex_at_its_budget(fused_fp):
    fp = fused_fp
    regex = pol.RegexPolicy([TRN2_REGEX])
    saved = tuple(t for t in fp if regex.action(t) == "save")
    assert len(saved) == 5
    budget, _ = fp.evaluate(saved)
    plan = nr.plan_footprint(footprint=fp, budget_bytes=budget)
    base = _step_flops(True, "none")
    regex_flops = _step_flops(True, saved) - base
    plan_flops = _step_flops(True, plan.saved_tags) - base
    assert plan.kept_bytes_per_layer <= budget
    assert plan_flops <= regex_flops
    # q, k and v pay off only together: judged as a group, never dismissed as cheap.
    reasons = {d.tag: d.reason for d in plan.decisions}
    (group,) = plan.groups
    for t in group.tags:
        assert "cheap" not in reasons[t] and "no recompute" not in reasons[t]
        if group.saved:
            assert "one fused matmul" in reasons[t]


# --- groups and display ----------------------------------------------------------------


def test_fused_qkv_is_one_group_with_joint_figures(fused_fp, separate_fp):
    fp = fused_fp
    qkv = tuple(f"MultiheadAttention.{r}" for r in ("q_proj", "k_proj", "v_proj"))
    for t in qkv:
        assert fp[t].recompute_flops == 0  # alone, saving a slice avoids no matmul
    (group,) = fp.groups
    assert group.tags == qkv and group.label == "q_proj+k_proj+v_proj: one fused matmul"
    t, h = BATCH * SEQ, CFG.hidden
    matmul = 2 * t * h * (CFG.heads + 2 * CFG.kv_heads) * CFG.head_dim
    assert group.shared_flops == matmul
    base_bytes, base_flops = fp.evaluate(())
    both_bytes, both_flops = fp.evaluate(qkv)
    assert (group.bytes, group.recompute_flops) == (both_bytes - base_bytes,
                                                    base_flops - both_flops)
    assert group.bytes == sum(fp[x].bytes for x in qkv)
    assert group.alone_flops == 0
    # Separate projections: nothing pays off only together.
    assert separate_fp.groups == ()
    assert mm.layer_footprint(CFG, models.StepShape(seq_len=SEQ)).groups == ()


def test_plan_table_and_json_show_groups(fused_fp):
    plan = nr.plan_footprint(footprint=fused_fp, budget_bytes=fused_fp.evaluate(())[0] + 10**6)
    text = plan.table()
    assert "together: q_proj+k_proj+v_proj: one fused matmul" in text
    assert "cheap to recompute" not in next(
        line for line in text.splitlines() if line.startswith("MultiheadAttention.q_proj"))
    data = json.loads(json.dumps(plan.to_dict()))
    (group,) = data["groups"]
    assert group["label"] == "q_proj+k_proj+v_proj: one fused matmul" and group["saved"]
    assert group["flops_per_byte"] > planner.DEFAULT_MIN_FLOPS_PER_BYTE


def test_min_flops_per_byte_judges_groups_jointly(fused_fp):
    fp = fused_fp
    group = fp.groups[0]
    cands = list(group.tags)
    loose = fp.evaluate(())[0] + group.bytes
    above = nr.plan_footprint(footprint=fp, budget_bytes=loose, candidates=cands,
                    min_flops_per_byte=group.flops_per_byte * 0.99)
    assert set(above.saved_tags) == set(group.tags)
    below = nr.plan_footprint(footprint=fp, budget_bytes=loose, candidates=cands,
                    min_flops_per_byte=group.flops_per_byte * 1.01)
    assert below.saved_tags == ()
    assert all("saves no recompute" in d.reason for d in below.decisions
               if d.tag in group.tags)


# --- the layer input -------------------------------------------------------------------


def test_params_first_plans_like_activation_first():
    fn_x, args_x, _ = _call("fused", "activation-first")
    fn_p, args_p, _ = _call("fused", "params-first")
    a, b = nr.traced_footprint(fn_x, *args_x), nr.traced_footprint(fn_p, *args_p)
    assert dict(a) == dict(b) and a.always_kept_bytes == b.always_kept_bytes == _x().size * 4
    budget = a.evaluate(())[0] + 200_000
    assert nr.plan_footprint(footprint=a, budget_bytes=budget).saved_tags == \
        nr.plan_footprint(footprint=b, budget_bytes=budget).saved_tags
    # The parameters are not activations: a tight budget that fits x still plans.
    tight = nr.plan_footprint(footprint=b, budget_bytes=b.evaluate(())[0])
    assert tight.saved_tags == () and tight.kept_bytes_per_layer == _x().size * 4
    # Overridden: the weights then count as kept activations.
    forced = nr.traced_footprint(fn_p, *args_p, activation_argnums=(0, 1))
    weights = sum(v.size * 4 for v in jax.tree.leaves(args_p[0]))
    assert forced.evaluate(())[0] == b.evaluate(())[0] + weights


def test_ambiguous_or_missing_layer_input_is_a_clear_error():
    x = jnp.ones((2, 8))
    with pytest.raises(ValueError, match=r"arguments \[0, 1\] all match.*activation_argnums"):
        nr.traced_footprint(lambda a, b: checkpoint_name(a * b, "t"), x, x)
    with pytest.raises(ValueError, match=r"none matches the output.*activation_argnums"):
        nr.traced_footprint(lambda a, b: jnp.sum(checkpoint_name(a * b, "t")), x, x)
    with pytest.raises(ValueError, match=r"activation_argnums \[2\] out of range"):
        nr.traced_footprint(lambda a, b: a * b, x, x, activation_argnums=(2,))
    fp = nr.traced_footprint(lambda a, b: checkpoint_name(a * b, "t"), x, x,
                             activation_argnums=1)
    assert fp.graph.inputs and fp.evaluate(())[0] == x.size * 4  # a is a parameter


def test_audit_infers_the_layer_input():
    fn, args, _ = _call("separate", "params-first")
    report = nr.audit(fn, *args, policy=nr.preset("trn2-fuji-70b"))
    weights = sum(v.size * 4 for v in jax.tree.leaves(args[0]))
    assert report.activation_argnums == (1,)
    assert report.saved_input_bytes == _x().size * 4
    assert report.saved_param_bytes == weights


# --- the builder on its own ------------------------------------------------------------


def test_jaxpr_graph_splits_known_and_unknown():
    def f(w, x):
        h = checkpoint_name(jnp.sin(x @ w), "h")
        return jnp.sum(h * h)

    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    closed = jax.make_jaxpr(lambda p, t: jax.jvp(f, p, t))((w, x), (w, x))
    g = _trace.jaxpr_graph(closed, unknown=[False, False, True, True],
                           activation=[False, True, False, False])
    assert len(g.params) == 1 and len(g.inputs) == 1
    (h,) = [v for v in g.values.values() if v.role == "h"]
    assert h.shape == (4, 8)
    dots = [op for op in g.ops if op.name.startswith("dot_general")]
    assert len(dots) == 1 and dots[0].flops == 2 * 4 * 8 * 8
    assert g.values[dots[0].output].dot
    # Saving h: the backward reads h (for h * h) and cos(x @ w), recomputed from x @ w.
    saved = g.evaluate_roles(["h"])
    assert h.name in saved.kept
    assert [n.split(":")[0] for n in saved.recomputed] == ["dot_general", "cos"]
    none = g.evaluate_roles([])
    # The tag's own equation: JAX's name primitive, or remat3's CheckpointName call.
    tag_prim = next(op.name.split(":")[0] for op in g.ops if h.name in op.outputs)
    assert tag_prim in ("name", "call_hi_primitive")
    assert [n.split(":")[0] for n in none.recomputed] == ["dot_general", "sin", "cos", tag_prim]
    # sin and cos are transcendental (no FLOPs in XLA's count); keeping h costs its rounding.
    assert saved.recompute_flops == none.recompute_flops + h.rounding_flops
    assert none.kept_bytes == x.size * 4  # the weights are parameters


def test_analytic_and_traced_graphs_agree_on_the_reference_layer(separate_fp):
    analytic = mm.layer_footprint(CFG, models.StepShape(seq_len=SEQ, micro_batch=BATCH,
                                                        activation_dtype="float32"))
    names = ref.tag_names(CFG)
    for role, tag in names.items():
        assert analytic[role].bytes == separate_fp[tag].bytes, role
    for roles in [(), ("q_proj", "k_proj", "v_proj", "linear1_0", "linear1_1")]:
        a = analytic.evaluate(roles)
        t = separate_fp.evaluate([names[r] for r in roles])
        assert a[0] == t[0]
        assert t[1] == pytest.approx(a[1], rel=0.05)


def test_tags_restrict_the_footprint(separate_fp):
    fn, args, _ = _call("separate", "activation-first")
    fp = nr.traced_footprint(fn, *args, tags=["MultiheadAttention.q_proj"])
    assert list(fp) == ["MultiheadAttention.q_proj"]
    assert fp.evaluate(["MultiheadAttention.q_proj"]) == separate_fp.evaluate(
        ["MultiheadAttention.q_proj"])
    with pytest.raises(ValueError, match=re.escape("['nope'] are not emitted")):
        nr.traced_footprint(fn, *args, tags=["nope"])
    assert isinstance(fp.graph, gr.LayerGraph)
