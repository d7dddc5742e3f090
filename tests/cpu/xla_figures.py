"""XLA's own figures for a compiled step: the expected values the fit tests hold
`neuron_remat` to, computed here from ``memory_analysis()``, ``cost_analysis()`` and the
optimized (per-device) HLO, never by the package (whose `fit` keeps its own sum)."""

from __future__ import annotations

from collections import Counter
from typing import Any


def compiled_bytes(compiled: Any) -> int:
    """Arguments + outputs + temporaries - donated (aliased) buffers, as XLA reports them."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def compiled_flops(compiled: Any) -> float:
    """XLA's FLOPs (``cost_analysis()`` is a dict, or a list of one on older JAX); a
    KeyError where it gives none."""
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def full_and_no_remat_bytes(make_step: Any, args: Any) -> tuple[int, int]:
    """XLA's bytes of ``make_step(policy)`` compiled for ``args`` under full remat (save
    nothing) and under no remat (``everything_saveable``)."""
    import jax  # noqa: PLC0415

    policies = (jax.checkpoint_policies.save_only_these_names(),
                jax.checkpoint_policies.everything_saveable)
    full, none = (compiled_bytes(make_step(p).lower(*args).compile()) for p in policies)
    return full, none


def measure(step: Any, args: Any) -> tuple[int, float]:
    """Compile ``step`` (a jitted function) for ``args``: its bytes and FLOPs."""
    c = step.lower(*args).compile()
    return compiled_bytes(c), compiled_flops(c)


def scan_step_flops(layer: Any, policy: Any, x: Any, params: Any) -> float:
    """XLA's FLOPs (the lowered program's ``cost_analysis()``) of the gradient, with
    respect to the input and both layers' parameters, of a sum over a scan of two
    ``layer(h, params)`` (`params` stacked twice), each layer ``jax.checkpoint``ed with
    `policy` (None: not checkpointed). XLA counts a scan body once, so a policy's figure
    less no remat's is one layer's recompute."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    f = layer if policy is None else jax.checkpoint(layer, policy=policy)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)

    def loss(h: Any, ps: Any) -> Any:
        return jax.lax.scan(lambda c, q: (f(c, q), None), h, ps)[0].sum()

    cost = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, stacked).cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def jax_kept_bytes(fn: Any, args: Any, activation: int = 0) -> int:
    """The bytes JAX keeps for `fn`'s backward (``saved_residuals``), the arguments left out
    but the activation (argument `activation`, named as `fn`'s signature names it): what a
    layer keeps beyond its parameters."""
    import inspect

    from jax._src.ad_checkpoint import saved_residuals

    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL:  # fn(*a): a[i]
        name = f"{params[0].name}[{activation}]"
    else:
        name = params[activation].name
    mine = (f"from the argument {name}", f"from the argument {name}[",
            f"from the argument {name}.")
    return sum(int(a.size) * a.dtype.itemsize for a, why in saved_residuals(fn, *args)
               if not why.startswith("from the argument") or why == mine[0]
               or why.startswith(mine[1:]))


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
             "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def first_loop_arrays(compiled: Any, loops: int = 1) -> Counter:
    """The arrays the compiled program's first `loops` ``while`` loops return, in the order
    of XLA's optimized HLO text (per device: after SPMD partitioning, one device's shapes),
    by type (``bf16[4,2,32,128]``). In a training step over a scanned stack the first loop
    is the forward scan, which returns the carry and, stacked over the layers, the
    residuals the backward reads: what saving a tag adds there is what XLA keeps for it on
    one device. A step of two stacks, one after the other, runs their two forward scans
    first (a loop inside a layer would come before them: such a step needs another
    reading)."""
    import re  # noqa: PLC0415

    found: Counter = Counter()
    seen = 0
    for line in compiled.as_text().splitlines():
        if " while(" in line and "=" in line:
            result = line.split("=", 1)[1].split(" while(", 1)[0]
            found += Counter(re.findall(r"([a-z]+\d*\[[\d,]*\])", result))
            seen += 1
            if seen == loops:
                return found
    raise AssertionError(f"the compiled program has {seen} while loops, not {loops}")


def array_bytes(arrays: Counter) -> int:
    """Bytes of `arrays` (`first_loop_arrays`' types, with their counts)."""
    import math  # noqa: PLC0415

    total = 0
    for kind, n in arrays.items():
        dtype, dims = kind[:-1].split("[")
        total += n * _ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def kept_against_xla(make_step: Any, args: Any, graph: Any,
                     tags: Any = None, loops: int = 1) -> dict[str, dict[str, int]]:
    """For each of `tags` alone and all of them together (the step graph's tags when
    None; keys: the tags joined by commas): ``{"graph": the step graph's kept bytes over
    full remat, "xla": what the compiled program keeps per device over full remat}``
    (`first_loop_arrays` of the first `loops` loops: a step with that many scanned stacks,
    one after the other; it raises where the program has fewer loops to read)."""
    from jax._src.ad_checkpoint import save_only_these_names  # noqa: PLC0415

    def xla(saved: tuple[str, ...]) -> Counter:
        return first_loop_arrays(make_step(save_only_these_names(*saved)).lower(*args)
                                 .compile(), loops)

    chosen = list(graph.tags if tags is None else tags)
    base, out = xla(()), {"graph": {}, "xla": {}}
    for saved in [*((t,) for t in chosen), tuple(chosen)]:
        got = xla(saved)
        out["graph"][",".join(saved)] = graph.kept_bytes(saved) - graph.kept_bytes(())
        out["xla"][",".join(saved)] = array_bytes(got - base) - array_bytes(base - got)
    return out


_PER_DEVICE = """
import json, sys
from neuron_remat import _step
from xla_figures import kept_against_xla
zoo, table, name, only = sys.argv[1:5]
spec = getattr(__import__(zoo), table)[name]
make_step, args = spec.make_step(), spec.abstract_args()
graph = _step.step_graph(make_step, *args)
tags = [t for t in graph.tags if not only or t in only.split(",")]
print(json.dumps({"shards": graph.shards, **kept_against_xla(make_step, args, graph, tags)}))
"""


def per_device_residuals(zoo: str, table: str, name: str, devices: int,
                         tags: tuple[str, ...] = ()) -> dict[str, Any]:
    """For the step `name` of ``<zoo>.<table>`` (a scanned step over `devices` devices),
    in a process that sees that many: `kept_against_xla`'s figures for the step's tags, or
    those of them in `tags` when given, and ``"shards"``: the step graph's divisor."""
    import json  # noqa: PLC0415

    import host_devices  # noqa: PLC0415

    code = (f"import sys; sys.argv[1:] = {[zoo, table, name, ','.join(tags)]!r}\n"
            + _PER_DEVICE)
    return json.loads(host_devices.run(code, devices).strip().splitlines()[-1])
