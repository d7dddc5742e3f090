"""The time objective: a roofline cost per op (engine by op kind), device rates with their
sources, and plans that minimise recompute time. Expected values are independent
arithmetic on the published rates, or a brute force over the graph's own traversal."""

import itertools
import math

import jax
import jax.numpy as jnp
import pytest

import neuron_remat as nr
from neuron_remat import device, graph, memory_model as mm
from neuron_remat.graph import LayerGraph, Op, Value

RATES = device.EngineRates("test", tensor_flops=100e12, vector_flops=1e12, scalar_flops=2e12,
                           hbm_bytes_per_s=1e12, source="test")


def _graph():
    v = {
        "x": Value("x", (1024, 512), "bfloat16"),
        "w": Value("w", (512, 2048), "bfloat16"),
        "y": Value("y", (1024, 2048), "bfloat16", dot=True),
        "e": Value("e", (1024, 2048), "float32"),
        "s": Value("s", (1024,), "float32"),
        "r": Value("r", (1024, 512), "bfloat16"),
        "t": Value("t", (512, 1024), "bfloat16"),
    }
    ops = (Op("dot_general:0", ("x", "w"), "y", 2 * 1024 * 2048 * 512),
           Op("exp:1", ("y",), "e", 0),
           Op("reduce_sum:2", ("e",), "s", 1024 * 2048 - 1024),
           Op("add:3", ("x", "x"), "r", 1024 * 512),
           Op("reshape:4", ("r",), "r2", 0),
           Op("transpose:5", ("r",), "t", 0))
    v["r2"] = Value("r2", (1024 * 512,), "bfloat16")
    return LayerGraph(values=v, ops=ops, params=("w",))


def test_roofline_per_op_kind():
    g = _graph()
    ops = {o.name.split(":")[0]: o for o in g.ops}
    kinds = {k: graph.op_kind(o, g) for k, o in ops.items()}
    assert kinds == {"dot_general": "matmul", "exp": "transcendental",
                     "reduce_sum": "reduction", "add": "elementwise", "reshape": "layout",
                     "transpose": "copy"}
    # matmul: 2*1024*2048*512 FLOPs at 100 TFLOP/s = 21.47 us; moves (1024*512 + 512*2048
    # + 1024*2048) * 2 bytes = 7340032 B at 1 TB/s = 7.34 us -> compute-bound.
    assert graph.op_seconds(ops["dot_general"], g, RATES) == pytest.approx(
        2 * 1024 * 2048 * 512 / 100e12)
    # exp: XLA counts 0 FLOPs; one per element on the scalar engine: 2097152 / 2e12 =
    # 1.05 us; moves 2097152 * (2 + 4) B = 12.58 us -> memory-bound.
    assert graph.op_seconds(ops["exp"], g, RATES) == pytest.approx(2097152 * 6 / 1e12)
    # reduction on the vector engine: 2096128 FLOPs / 1e12 = 2.10 us; moves
    # 2097152 * 4 + 1024 * 4 B = 8.39 us -> memory-bound.
    assert graph.op_seconds(ops["reduce_sum"], g, RATES) == pytest.approx(
        (2097152 * 4 + 4096) / 1e12)
    # add: x read once (distinct inputs) + r written: 2 * 524288 * 2 B = 2.10 us; 524288
    # FLOPs on the vector engine = 0.52 us.
    assert graph.op_seconds(ops["add"], g, RATES) == pytest.approx(2 * 524288 * 2 / 1e12)
    assert graph.op_seconds(ops["reshape"], g, RATES) == 0.0
    assert graph.op_seconds(ops["transpose"], g, RATES) == pytest.approx(2 * 524288 * 2 / 1e12)


def test_each_kind_on_its_own_engine_when_compute_bound():
    # With HBM this fast every op is compute-bound, so each op's time is its work over
    # its engine's rate alone: a wrong engine (all on the tensor engine, say) cannot pass.
    fast = device.EngineRates("fast-hbm", tensor_flops=100e12, vector_flops=1e12,
                              scalar_flops=2e12, hbm_bytes_per_s=1e18, source="test")
    g = _graph()
    ops = {o.name.split(":")[0]: o for o in g.ops}
    assert graph.op_seconds(ops["dot_general"], g, fast) == pytest.approx(
        2 * 1024 * 2048 * 512 / 100e12)  # tensor engine
    assert graph.op_seconds(ops["exp"], g, fast) == pytest.approx(
        1024 * 2048 / 2e12)  # scalar engine, one op per element
    assert graph.op_seconds(ops["reduce_sum"], g, fast) == pytest.approx(
        (1024 * 2048 - 1024) / 1e12)  # vector engine
    assert graph.op_seconds(ops["add"], g, fast) == pytest.approx(1024 * 512 / 1e12)
    assert graph.op_seconds(ops["reshape"], g, fast) == 0.0
    # the same op is 100x slower per FLOP on the vector engine than a matmul's FLOP
    per_flop = {k: graph.op_seconds(ops[k], g, fast) / ops[k].flops
                for k in ("dot_general", "add")}
    assert per_flop["add"] / per_flop["dot_general"] == pytest.approx(100.0)


def test_fused_op_takes_its_busiest_engine():
    g = _graph()
    big = Op("fused", ("x",), "r", 10**9, kind="matmul",
             parts=(("matmul", 10**9), ("transcendental", 4 * 10**6),
                    ("elementwise", 3 * 10**6)))
    # tensor 1e9 / 1e14 = 10 us; scalar 4e6 / 2e12 = 2 us; vector 3e6 / 1e12 = 3 us.
    assert graph.op_seconds(big, g, RATES) == pytest.approx(10e-6)
    slow = Op("fused", ("x",), "r", 10**9, kind="matmul",
              parts=(("matmul", 10**8), ("transcendental", 4 * 10**7),
                     ("elementwise", 3 * 10**6), ("reduction", 10**7)))
    # vector: (3e6 + 1e7) / 1e12 = 13 us beats scalar 20 us? no: scalar 4e7 / 2e12 = 20 us.
    assert graph.op_seconds(slow, g, RATES) == pytest.approx(20e-6)


def test_trn2_and_gpu_rates():
    trn = device.engine_rates(nr.from_instance_type("trn2.48xlarge"))
    assert trn.tensor_flops == pytest.approx(2 * 79e12)  # LNC=2: two physical cores
    assert trn.vector_flops == pytest.approx(2 * 1.0e12)
    assert trn.scalar_flops == pytest.approx(2 * 1.2e12)
    assert trn.hbm_bytes_per_s == pytest.approx(2 * 2.9e12 / 8)
    one = device.engine_rates(nr.from_instance_type("trn2.48xlarge", lnc=1))
    assert one.tensor_flops == pytest.approx(79e12)
    gpu = device.DeviceSpec("gpu", None, None, 1, 1, 141 << 30, "jax",
                            device_kind="NVIDIA H200")
    assert device.engine_rates(gpu).hbm_bytes_per_s == pytest.approx(4.8e12)
    assert device.engine_rates(None, "h100-sxm").tensor_flops == pytest.approx(989e12)
    assert all(r.source for r in device.ENGINE_RATES.values())
    assert device.engine_rates(nr.parse_device("cpu")) is None
    with pytest.raises(ValueError, match="rates='a100'"):
        device.engine_rates(None, "a100")


def test_traced_graph_kinds():
    from neuron_remat import _trace

    def f(x, w):
        y = x @ w
        return jnp.sum(jnp.exp(y) + 1.0, axis=-1)

    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    jaxpr = jax.make_jaxpr(f)(x, w)
    g = _trace.jaxpr_graph(jaxpr, unknown=[False, False])
    kinds = {o.name.split(":")[0]: graph.op_kind(o, g) for o in g.ops}
    assert kinds["dot_general"] == "matmul"
    assert kinds["exp"] == "transcendental"
    assert kinds["reduce_sum"] == "reduction"
    assert kinds["add"] == "elementwise"


def test_time_plan_is_the_brute_force_over_the_graph():
    """The time plan's save set is the one with the least recompute time among those that
    fit, each priced by summing op_seconds over the ops JAX would recompute
    (`LayerGraph.evaluate`'s traversal, not the closures the planner searches)."""
    dev = nr.from_instance_type("trn2.48xlarge")
    cfg = nr.get_model("llama3-8b")
    shape, par = nr.StepShape(seq_len=8192), nr.Parallelism(tp=4, sequence_parallel=True,
                                                             fsdp=-1)
    rates = device.engine_rates(dev)
    p = nr.plan(dev, cfg, shape, par, objective="time", budget_bytes=150 << 20,
                min_flops_per_byte=0)
    import dataclasses

    from neuron_remat import models
    cfg = dataclasses.replace(cfg, tags=models.host_tags(cfg.tags, dev))
    g = mm.layer_graph(cfg, shape, par.resolve(dev))
    usable = [d.tag for d in p.decisions if d.tag != "input" and (
        d.saved or "does not fit" in d.reason or "better set" in d.reason)]
    fp = mm.layer_footprint(cfg, shape, par.resolve(dev))
    best = None
    for r in range(len(usable) + 1):
        for s in itertools.combinations(usable, r):
            ev = g.evaluate_roles(fp.roles[t] for t in s)
            if ev.kept_bytes > 150 << 20:
                continue
            secs = sum(graph.op_seconds(o, g, rates) for o in g.ops if o.name in ev.recomputed)
            if best is None or secs < best[0] - 1e-12:
                best = (secs, s)
    assert p.objective == "time"
    assert p.recompute_seconds_per_layer == pytest.approx(best[0], rel=1e-6)
    mine = g.evaluate_roles(fp.roles[t] for t in p.saved_tags if t != "input")
    assert mine.kept_bytes <= 150 << 20  # the plan's own set, priced the same way, ties
    assert sum(graph.op_seconds(o, g, rates) for o in g.ops if o.name in mine.recomputed) \
        == pytest.approx(best[0], rel=1e-9)
    fwd = sum(graph.op_seconds(o, g, rates) for o in g.ops)
    assert p.forward_seconds_per_layer == pytest.approx(fwd, rel=1e-6)
    assert "% of step time" in p.table()


def test_default_objective():
    shape = nr.StepShape(seq_len=4096)
    par = nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=8)
    trn = nr.plan(nr.from_instance_type("trn2.48xlarge"), nr.get_model("fuji-70b"), shape, par)
    assert trn.objective == "time" and trn.rates is not None
    flops = nr.plan(nr.from_instance_type("trn2.48xlarge"), nr.get_model("fuji-70b"), shape,
                    par, objective="flops")
    assert flops.objective == "flops" and flops.recompute_seconds_per_layer is None
    fp = {"a": mm.TagCost(bytes=10, recompute_flops=100.0)}
    assert nr.plan_footprint(footprint=fp, budget_bytes=100).objective == "flops"
    with pytest.raises(ValueError, match="needs engine rates"):
        nr.plan_footprint(footprint=fp, budget_bytes=100, objective="time")
    with pytest.raises(ValueError, match="layer graph"):
        nr.plan_footprint(footprint=fp, budget_bytes=100, objective="time", rates="h200-sxm")
    with pytest.raises(ValueError, match="objective='seconds'"):
        nr.plan_footprint(footprint=fp, budget_bytes=100, objective="seconds")
    assert math.isnan(flops.time_overhead)
