"""On a trn2 instance: a step laid out over several NeuronCores (the batch split along a
one-axis mesh of up to 4 local cores, the state replicated) is counted per core. The step
graph's divisor is the core count, and the bytes it keeps for each tag alone and for all of
them are what the partitioned program keeps on one core: the arrays the compiled step's
forward scan returns beyond full remat's (tests/cpu/xla_figures.py reads them from the
optimized HLO; where the plugin's executable gives no HLO text, that half skips). The
small scanned decoder of test_trn2_fit.py keeps the compiles short."""

import importlib
import pathlib
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples import fit_demo  # noqa: E402

from test_trn2_fit import CONFIG  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "cpu"))
from xla_figures import kept_against_xla  # noqa: E402

F = importlib.import_module("neuron_remat._fit")


def test_a_step_over_several_cores_is_counted_per_core():
    devices = jax.devices()[:4]
    n = len(devices)
    if n < 2:
        pytest.skip(f"needs 2 or more NeuronCores: JAX sees {n}")
    mesh = Mesh(np.array(devices), ("data",))
    make_step = fit_demo.make_step_factory(CONFIG)
    state, tokens = fit_demo.abstract_args(CONFIG, batch=n, seq=128)
    tokens = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype,
                                  sharding=NamedSharding(mesh, PartitionSpec("data", None)))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())), state)
    args = (state, tokens)
    graph = F.step_graph(make_step, *args)
    assert graph.shards == n
    try:
        got = kept_against_xla(make_step, args, graph)
    except (AssertionError, NotImplementedError) as err:
        pytest.skip(f"no optimized HLO with the forward scan to read ({err})")
    assert got["graph"] == got["xla"], n
