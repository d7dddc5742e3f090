"""`fit` on training steps of axlearn's real layers (tests/cpu/axlearn_zoo.py), held to JAX
and XLA.

Skipped unless axlearn imports (a real checkout at the commit axlearn_zoo cites, Python
3.12, JAX 0.8.3: README, "The tests on a real axlearn"). The steps are held out: nothing
in `fit` was tuned on them. Their layer is Fuji's, rotary embedding included, whose
strided slices JAX 0.8 lowers to gathers: the layer's backward holds a scatter-add, which
the trace once took for a program of its own and refused; one step has axlearn's
``GroupedQueryAttention``, the other its ``FlashAttention`` (the kernel called through
``jax.shard_map``). On each step:

* every tag in the step's jaxpr (axlearn's own ``"<LayerClass>.<name>"`` names) is one
  `fit` reads from the step's checkpointed layers, and the bytes its graph keeps for each
  of the 6 most useful tags alone and each pair are those JAX's ``saved_residuals`` lists;
* at a size between full remat and no remat, the plan's policy, compiled, fits and has
  the figures the plan states;
* the traced footprint of Fuji's ``TransformerLayer`` (bfloat16), and of the same layer
  with axlearn's ``FlashAttention`` (its kernel through ``jax.shard_map``): JAX's tags,
  and its kept bytes on every save set of none, all, one and all but one equal to
  ``saved_residuals``'s;
* in Fuji-70B's TRN2 layout over 8 devices, per core, the kept bytes of each tag alone
  and all together are what XLA's partitioned program keeps on one device;
* through axlearn's own gradient accumulation (``with_minibatch_steps``, 2 micro-batches),
  each layer's backward runs twice but its residuals are held once, and the kept bytes of
  4 tags alone and together are what XLA's program keeps for one micro-batch.
"""

from __future__ import annotations

import itertools

import pytest

import axlearn_zoo as az
from xla_figures import compiled_bytes, compiled_flops, full_and_no_remat_bytes

_WHY = az.available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

@pytest.fixture(scope="module", params=["axlearn-fuji", "axlearn-fuji-flash"])
def step(request):
    spec = az.STEPS[request.param]
    make_step, args = spec.make_step(), spec.abstract_args()
    return make_step, args, *full_and_no_remat_bytes(make_step, args), spec


def test_fit_reads_every_tag_axlearn_emits(step):
    import importlib

    import jax
    from jaxpr_names import names_in

    make_step, args, _, _, spec = step
    emitted = names_in(jax.make_jaxpr(make_step(
        jax.checkpoint_policies.save_only_these_names()))(*args))
    attention = "FlashAttention" if spec.flash else "GroupedQueryAttention"
    assert {f"{attention}.q_proj", f"{attention}.k_proj", f"{attention}.o_proj",
            "TransformerFeedForwardLayer.linear1_0",
            "TransformerFeedForwardLayer.linear1_1"} <= emitted, emitted
    graph = importlib.import_module("neuron_remat._fit").step_graph(make_step, *args)
    assert set(graph.tags) == emitted


def _jax_kept(spec, saved, args):
    """Bytes of the residuals JAX's ``saved_residuals`` lists for the loss of `spec`'s step
    under ``save_only_these_names(*saved)``, arguments left out."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    from axlearn.common import utils
    from axlearn.common.module import functional

    from neuron_remat._jax_compat import saved_residuals

    model = spec._model(jax.checkpoint_policies.save_only_these_names(*saved))  # noqa: SLF001

    def loss_fn(params, batch):  # the step's loss (axlearn_zoo._make)
        params = utils.cast_floats(params, to_dtype=jnp.bfloat16)
        (loss, _), _ = functional(model, prng_key=jax.random.PRNGKey(1), state=params,
                                  inputs=dict(input_batch=batch), is_training=True)
        return loss

    (params, _), batch = args
    with az.mesh() if spec.flash else contextlib.nullcontext():
        residuals = saved_residuals(loss_fn, params, batch)
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
               for a, why in residuals if not why.startswith("from the argument"))


def test_kept_bytes_are_jaxs_for_each_tag_and_pair(step):
    """The graph `fit` reads keeps, over full remat, what JAX lists for the step: each of
    its 6 most useful tags alone and each pair (the rotary embedding's gathers included;
    JAX 0.8.3 is axlearn's pin)."""
    import importlib

    F = importlib.import_module("neuron_remat._fit")
    G = importlib.import_module("neuron_remat._step")
    make_step, args, _, _, spec = step
    graph = F.step_graph(make_step, *args)
    pool = G._pool(graph, None)[:6]  # noqa: SLF001
    assert len(pool) == 6
    base, jax_base = graph.kept_bytes(()), _jax_kept(spec, (), args)
    for saved in [*itertools.combinations(pool, 1), *itertools.combinations(pool, 2)]:
        assert (graph.kept_bytes(saved) - base
                == _jax_kept(spec, saved, args) - jax_base), saved


@pytest.fixture(scope="module", params=["GroupedQueryAttention", "FlashAttention"])
def fuji_layer(request):
    """axlearn's ``TransformerLayer`` as the step's stack holds it (Fuji's, RoPE included),
    or with axlearn's ``FlashAttention`` in its place (its kernel called through
    ``jax.shard_map``; on the CPU axlearn's reference kernel, under a one-device mesh of
    Fuji's axes), bfloat16 parameters and input: (attention class, layer function of
    (params, x), params, x, the mesh to trace under)."""
    import contextlib

    import jax
    import jax.numpy as jnp
    from axlearn.common.module import functional

    flash = request.param == "FlashAttention"
    cfg = az.model_config(az.SIZES, jax.checkpoint_policies.nothing_saveable,
                          prevent_cse=False, rope=True, flash=flash)
    mesh = az.mesh() if flash else contextlib.nullcontext()
    with mesh:
        layer = cfg.decoder.transformer.layer.clone(
            name="layer", input_dim=az.SIZES["hidden_dim"]).instantiate(parent=None)
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                              layer.initialize_parameters_recursively(jax.random.PRNGKey(0)))
    x = jnp.ones((az.SIZES["batch"], az.SIZES["seq"], az.SIZES["hidden_dim"]), jnp.bfloat16)

    def fn(params, x):
        out, _ = functional(layer, prng_key=jax.random.PRNGKey(1), state=params,
                            inputs=dict(data=x), is_training=True)
        return out.data

    return request.param, fn, params, x, mesh


def test_traced_footprint_of_fujis_layer_is_jaxs(fuji_layer):
    """`traced_footprint` of axlearn's layer (bfloat16, rotary embedding; its attention
    through ``shard_map`` with ``FlashAttention``): every tag JAX's VJP jaxpr holds, and
    kept bytes equal to ``saved_residuals``'s (the layer input counted, the parameters not)
    for no tag, every tag, each alone and each left out."""
    import jax
    import numpy as np
    from jaxpr_names import names_in

    import neuron_remat as nr
    from neuron_remat._jax_compat import saved_residuals

    attention, fn, params, x, mesh = fuji_layer

    def jax_kept(saved):
        f = jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*saved))
        total = 0
        for aval, why in saved_residuals(f, params, x):
            nbytes = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
            if why.startswith("from the argument"):  # the input yes, the parameters no
                total += nbytes if (aval.shape, aval.dtype) == (x.shape, x.dtype) else 0
            else:
                total += nbytes
        return total

    with mesh:
        fp = nr.traced_footprint(fn, params, x, activation_argnums=1)
        emitted = names_in(jax.make_jaxpr(lambda p, x: jax.vjp(fn, p, x))(params, x))
        assert set(fp) == emitted, (sorted(fp), sorted(emitted))
        # the projections and the FFN's three; the flash kernel tags no context
        assert {f"{attention}.{t}" for t in ("q_proj", "k_proj", "v_proj", "o_proj")} \
            <= emitted
        assert (f"{attention}.context" in emitted) == (attention != "FlashAttention")
        if attention == "FlashAttention":
            assert any("shard_map" in n for n in fp.notes), fp.notes
        tags = sorted(fp)
        subsets = [(), tuple(tags), *((t,) for t in tags),
                   *(tuple(u for u in tags if u != t) for t in tags)]
        for saved in subsets:
            assert fp.evaluate(saved)[0] == jax_kept(saved), saved


def test_fit_between_full_and_no_remat_states_its_compile(step):
    import neuron_remat as nr

    make_step, args, full, none, _ = step
    assert none > 1.4 * full  # a scanned stack: no remat keeps every layer's activations
    hbm = int(full + 0.3 * (none - full))
    device = nr.parse_device(f"trn2.48xlarge:hbm={hbm}B:cores=1", source="test")
    plan = nr.fit(make_step, *args, device=device, reserve=0, progress=lambda line: None)
    compiled = make_step(plan.policy).lower(*args).compile()
    rec = plan.compiled
    assert compiled_bytes(compiled) <= hbm
    assert rec.measured and (rec.bytes, rec.flops) == (compiled_bytes(compiled),
                                                        compiled_flops(compiled))


def test_trn2_layout_counts_each_tag_as_xla_partitions_it():
    """Fuji's TRN2 layout over 8 devices (2 along fsdp x 4 along model: its mesh rule's
    tensor parallelism within a chip, sequence-parallel norms, the state split by the
    parameters' partition specs): the graph's kept bytes of each tag alone and of all
    together are one device's residuals as XLA partitioned them: what the compiled
    program's forward scan returns beyond full remat's, per device. Under this layout
    every tag is split 8 ways (the heads or hidden units over model, the batch over fsdp,
    and the attention output along the sequence over model), so the step's one divisor
    is exact; counted globally each would be 8 times XLA's."""
    from xla_figures import per_device_residuals

    got = per_device_residuals("axlearn_zoo", "SHARDED", "axlearn-fuji-trn2-tp4", 8)
    assert got["shards"] == 8
    assert got["graph"] == got["xla"]
    assert all(v > 0 for k, v in got["xla"].items() if "proj" in k or "linear1" in k), got


def test_ga2_axlearns_gradient_accumulation_runs_each_layer_twice_holds_it_once():
    """``axlearn-fuji-ga2``: axlearn's ``with_minibatch_steps(steps=2)`` around the
    trainer's forward function (a ``jax.custom_vjp`` whose forward scans the micro-batches'
    forward and backward). The step runs each of the 4 scanned layers' backward once a
    micro-batch (count 8) but holds one micro-batch's residuals at a time (depth 4), and the
    graph's kept bytes over full remat, of 4 tags alone and together, are what XLA's
    compiled program keeps: the arrays its first ``while`` loop, the layer stack's forward
    scan inside the accumulation loop's body, returns for one micro-batch."""
    import importlib

    from xla_figures import kept_against_xla

    G = importlib.import_module("neuron_remat._step")
    spec = az.STEPS["axlearn-fuji-ga2"]
    make_step, args = spec.make_step(), spec.abstract_args()
    graph = G.step_graph(make_step, *args)
    assert [(layer.count, layer.held) for layer in graph.layers] == [(8, 4)]
    assert (graph.count, graph.depth) == (8, 4)
    tags = ["GroupedQueryAttention.q_proj", "GroupedQueryAttention.k_proj",
            "GroupedQueryAttention.context", "TransformerFeedForwardLayer.linear1_0"]
    got = kept_against_xla(make_step, args, graph, tags)
    assert got["graph"] == got["xla"], got
    assert all(v > 0 for v in got["xla"].values()), got


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [
    ("axlearn-fuji", []), ("axlearn-fuji-flash", []), ("axlearn-fuji-norope", []),
    ("axlearn-fuji-moe", []), ("axlearn-fuji-flash-fsdp8", ["--host-devices", "8"]),
    ("axlearn-fuji-trn2-tp4", ["--host-devices", "8"]), ("axlearn-fuji-ga2", [])])
def test_the_readme_figures_of_fit_are_the_sweep_of_the_committed_table(name, extra,
                                                                          tmp_path):
    """`benchmarks/axlearn_fit.py --bare-oracle` on a fresh cache, filled from the step's
    committed compile table (benchmarks/brute_force/<step>.json: it compiles nothing),
    gives the step's row of the README's table of the oracle without figures."""
    import readme_tables as R

    R.swept_bare_row("axlearn_fit.py", name, extra, tmp_path)


@pytest.mark.slow
def test_the_readme_figures_of_fit_with_the_tags_outside_the_pool_are_the_sweep(tmp_path):
    """`benchmarks/axlearn_fit.py --spare --steps axlearn-fuji-moe` on a fresh cache, filled
    from the committed table over the pool and the two tags outside it, gives the README's
    rows of that sweep (the rows marked "before" are the code before, on the same table)."""
    import readme_tables as R

    name = "axlearn-fuji-moe+spare"
    R.require(name)
    result = R.sweep("axlearn_fit.py", ["--spare", "--steps", "axlearn-fuji-moe"], name,
                     tmp_path / "sweep.json")
    modes = result["steps"]["axlearn-fuji-moe"]["modes"]
    got = R.rows("| mode | gap 0 | <= 0.5 pt | > 2 pt | max gap | within cap | refusals |")
    for mode, label in (("memory_analysis", "`memory_analysis()`"), ("oracle", "oracle")):
        rows, s = modes[mode]["rows"], modes[mode]["summary"]
        gaps = [r["gap"] for r in rows if r.get("gap") is not None]
        top = max(gaps)
        assert got[label][1:] == [
            str(sum(g <= 1e-12 for g in gaps)), str(sum(g <= 0.005 + 1e-12 for g in gaps)),
            str(sum(g > 0.02 + 1e-12 for g in gaps)),
            "0" if top == 0 else f"{100 * top:.2f} pt",
            f"{100 * s['share_within_cap']:.0f}%", str(s["refusals_while_some_fits"])], label
