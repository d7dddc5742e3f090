"""`fit` on steps laid out over several devices, as training runs on a TRN2's cores.

`jax.jit` over a mesh compiles one program per device and ``memory_analysis()`` reports
one device's bytes, while the step's jaxpr has global shapes. The step graph counts per
core: a value outside a ``shard_map`` at 1/shards of its global bytes (shards: the product
of the mesh axes the step's inputs are split over), one inside at its per-shard shape.
Each test runs in a subprocess with 8 XLA:CPU devices (the count is fixed when JAX's
backend starts).

Expected values come from JAX (``saved_residuals`` of one layer at one device's batch),
from XLA (the compiled plan, ``memory_analysis()``'s argument bytes, the partitioned
program's per-device residuals) or from shapes.
"""

from __future__ import annotations

import json
import textwrap

import host_devices


def _run(code: str) -> dict:
    out = host_devices.run(textwrap.dedent(code), 8)
    return json.loads(out.strip().splitlines()[-1])


_KEPT = """
import json, math
import jax, numpy as np
from jax._src.ad_checkpoint import save_only_these_names, saved_residuals
import sharded_zoo
from neuron_remat import _step

def jax_kept(spec, saved):
    # JAX's residuals of one layer at one device's batch, parameters excluded
    x = jax.ShapeDtypeStruct((spec.batch, spec.seq, spec.hidden), np.dtype(spec.dtype))
    state, _ = spec.abstract_args()
    p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                     state[0]["layers"])
    fn = jax.checkpoint(spec.layer, policy=save_only_these_names(*saved))
    return sum(math.prod(a.shape) * a.dtype.itemsize
               for a, d in saved_residuals(fn, x, p) if "argument p" not in d
               and not d.startswith("from the argument p"))

out = {}
for name in NAMES:
    s = sharded_zoo.STEPS[name]
    g = _step.step_graph(s.make_step(), *s.abstract_args())
    sets = [(), *((t,) for t in g.tags), tuple(g.tags)]
    out[name] = {"shards": g.shards, "layers": s.base.layers,
                 "graph": [g.kept_bytes(x) - g.kept_bytes(()) for x in sets],
                 "jax": [jax_kept(s.base, x) - jax_kept(s.base, ()) for x in sets]}
print(json.dumps(out))
"""


def test_a_sharded_steps_residuals_count_per_core():
    """Data parallel (state replicated) and FSDP (state split too), float32 and bfloat16:
    the graph's kept bytes of every tag alone and all together are JAX's for one layer at
    one device's batch, times the layers."""
    names = ["gqa4-adamw-dp8", "gqa4-adamw-fsdp8", "wide-ffn-sgd-bf16-fsdp8"]
    got = _run(f"NAMES = {names!r}\n" + _KEPT)
    for name in names:
        r = got[name]
        assert r["shards"] == 8, name
        assert r["graph"] == [r["layers"] * j for j in r["jax"]], name
        assert max(r["jax"]) > 0  # the test can fail: saving a tag keeps something


def test_tensor_parallel_heads_count_per_core():
    """A 4 x 2 mesh, the batch over ``data`` and Megatron's weights over ``model``: the
    values are split 8 ways (the two axes the inputs use, though no input is split more
    than 4 ways), and the kept bytes of the q, k, v projections and the FFN's hidden units
    are JAX's for one layer at one device's batch, heads and units (here the base step's). (The attention output, on
    the residual stream, is split over ``data`` only: counted at 1/8, it is half of what a
    core holds; the compiles calibrate that.)"""
    names = ["big-state-dp4tp2"]
    got = _run(f"NAMES = {names!r}\n" + _KEPT)["big-state-dp4tp2"]
    assert got["shards"] == 8
    # the sets: none, each of q, k, v, o, wi0, wi1 alone, all; the heads' and hidden units'
    for i in (1, 2, 3, 5, 6):
        assert got["graph"][i] == got["layers"] * got["jax"][i] > 0, i


def test_tensor_parallel_counts_against_xlas_partitioned_program():
    """The same step held to what XLA's partitioned program keeps on one device (the
    arrays its forward scan returns beyond full remat's): q and the FFN's hidden units
    exactly, and the one divisor's limit measured: the output projection's result,
    which the partitioner keeps whole over ``model``, counts half of what a core holds."""
    from xla_figures import per_device_residuals

    got = per_device_residuals("sharded_zoo", "STEPS", "big-state-dp4tp2", 8,
                               tags=("q", "o", "wi0"))  # the heads, the output, the units
    graph, xla = got["graph"], got["xla"]
    for tag in ("q", "wi0"):
        assert graph[tag] == xla[tag] > 0, tag
    assert 2 * graph["o"] == xla["o"] > 0


def test_the_shards_come_from_the_jit_and_a_shard_map_counts_once():
    """Shardings given to ``jax.jit`` (not on the arguments) split the values too; a tag
    inside a ``shard_map`` body (at its per-shard shape) is not divided again, one outside
    it is (expected from the shapes)."""
    got = _run("""
        import json, jax, jax.numpy as jnp, numpy as np
        from functools import partial
        from jax.ad_checkpoint import checkpoint_name
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from neuron_remat import _step
        mesh = Mesh(np.array(jax.devices()), ("data",))
        shard_map = partial(jax.shard_map, mesh=mesh)

        def layer(x, w):
            a = checkpoint_name(jnp.tanh(x @ w), "outside")
            inner = shard_map(lambda v: checkpoint_name(jnp.sin(v @ w), "inside"),
                              in_specs=P("data"), out_specs=P("data"))
            return jnp.tanh(inner(a) @ w)

        def make_step(policy):
            def loss(w, x):
                y, _ = jax.lax.scan(lambda c, _: (jax.checkpoint(layer, policy=policy)(c, w),
                                                  None), x, None, length=4)
                return (y ** 2).sum()
            return jax.jit(jax.grad(loss), in_shardings=(NamedSharding(mesh, P()),
                                                         NamedSharding(mesh, P("data"))))

        args = (jax.ShapeDtypeStruct((32, 32), jnp.float32),
                jax.ShapeDtypeStruct((64, 32), jnp.float32))
        g = _step.step_graph(make_step, *args)
        base = g.kept_bytes(())
        print(json.dumps({"shards": g.shards, "outside": g.kept_bytes(("outside",)) - base,
                          "inside": g.kept_bytes(("inside",)) - base}))
    """)
    assert got["shards"] == 8
    # 4 layers of a (64, 32) float32 value: whole 32 KiB, one core's piece 4 KiB
    assert got["outside"] == 4 * 64 * 32 * 4 // 8
    assert got["inside"] == 4 * 64 * 32 * 4 // 8  # per shard in the body: (8, 32)


def test_fit_plans_a_data_parallel_step_by_its_per_core_bytes():
    """Counted globally, a step over 8 devices keeps 8 times what its compile grows by,
    and `fit` took it for one whose memory ignores the policy: at 18 MiB it stopped after
    3 compiles with full remat. Per core, it searches: the plan recomputes less than full
    remat, fits, and states its policy's compile (XLA's figures, compiled again here)."""
    got = _run("""
        import json, jax
        import neuron_remat as nr
        import sharded_zoo
        from neuron_remat._step import _pool, step_graph
        s = sharded_zoo.STEPS["gqa4-adamw-dp8"]
        make, args = s.make_step(), s.abstract_args()
        limit = 18 << 20
        device = nr.parse_device(f"trn2.48xlarge:hbm={limit}B:cores=1", source="test")
        plan = nr.fit(make, *args, device=device, reserve=0,
                      candidates=[t for t in step_graph(make, *args).tags if t != "attn_scores"])
        full = make(jax.checkpoint_policies.nothing_saveable).lower(*args).compile()
        c = make(plan.policy).lower(*args).compile()
        m = c.memory_analysis()
        print(json.dumps({
            "notes": list(plan.notes), "saved": list(plan.saved_tags),
            "stated": [plan.compiled.bytes, plan.compiled.flops],
            "xla": [m.argument_size_in_bytes + m.output_size_in_bytes
                    + m.temp_size_in_bytes - m.alias_size_in_bytes,
                    c.cost_analysis()["flops"]],
            "full_flops": full.cost_analysis()["flops"], "limit": limit}))
    """)
    assert not any("does not follow" in n for n in got["notes"]), got["notes"]
    assert any("split 8 ways" in n for n in got["notes"])
    assert got["saved"] and got["xla"][1] < got["full_flops"]
    assert got["xla"][0] <= got["limit"]
    assert got["stated"] == got["xla"]


def test_fixed_bytes_are_one_cores_arguments():
    """With the compile as the oracle the model starts from the step's arguments and
    outputs less its donated state: per core, XLA's argument bytes (FSDP splits the state
    8 ways), where counting the global shapes would say 8 times as much."""
    got = _run("""
        import json, jax
        import sharded_zoo
        from neuron_remat._compile import _compile
        s = sharded_zoo.STEPS["big-state-fsdp8"]
        make, args = s.make_step(), s.abstract_args()
        step = make(jax.checkpoint_policies.nothing_saveable)
        r = _compile(step, args)
        m = step.lower(*args).compile().memory_analysis()
        print(json.dumps({"fixed": r.fixed, "argument": m.argument_size_in_bytes,
                          "output": m.output_size_in_bytes, "alias": m.alias_size_in_bytes}))
    """)
    xla = got["argument"] + got["output"] - got["alias"]
    # within 0.1%: XLA leaves a few small outputs unaliased (304 bytes here)
    assert abs(got["fixed"] - xla) <= 0.001 * xla, got
