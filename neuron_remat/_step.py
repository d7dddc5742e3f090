"""The per-layer graphs of a training step, read from its jaxpr.

`step_graph(make_step, *args)` traces ``make_step(save nothing)`` once (no compile) and
finds each checkpointed layer's backward: a ``remat2`` equation with
``differentiated=True`` (inside the backward ``scan`` of a scanned stack, once per
unrolled layer). Its jaxpr is the transposed layer: residual inputs (with nothing saved:
the layer's inputs), then the output cotangents. The equations that do not depend on the
cotangents are the recomputation, the others the backward proper, and the recomputed
values the backward reads are what any policy must either keep or recompute. That makes
one exact `graph.LayerGraph` per layer (`LayerBackward`): for every save set, the bytes
kept and the FLOPs recomputed, jointly; `StepGraph` sums them over the step's layers, in
JAX's bytes and as the backend stores them (`STORED_ITEMSIZE`), per core: a jit over
several devices traces global shapes, and its values count 1/`_shards` of them. The
recompute counts every run of a layer's backward, the bytes the copies held at once: a
loop over micro-batches around the gradient (gradient accumulation) runs each layer once a
micro-batch but frees each micro-batch's residuals before the next (`_held`). `_pool`
picks the tags worth deciding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend import core as jcore

from . import _jaxpr, _trace
from ._compile import _jitted, pieces
from ._format import first_line
from ._jax_compat import (is_name_primitive, jit_in_shardings, remat3_off,
                          save_only_these_names, scan_counts)
from .graph import LayerGraph
from .planner import DEFAULT_MIN_FLOPS_PER_BYTE

STORED_ITEMSIZE: dict[str, dict[str, int]] = {"cpu": {"bfloat16": 4}}
"""Bytes per element a backend stores where they differ from the dtype's, by
``jax.default_backend()``. XLA:CPU computes and keeps bfloat16 as float32: saving the one
tag of 16 scanned layers, 4 MiB of bfloat16 residuals in JAX's count, grows the compiled
step by 7.75 MiB (by 4 MiB in float16, 8.5 MiB in float32: tests/cpu/test_fit.py), and on
the zoo's bfloat16 steps a least-squares fit of the compiled bytes gives about 2 bytes per
bfloat16 byte kept. Neuron, GPUs and TPUs keep bfloat16 at 2 bytes."""



def _depends(jaxpr: Any, seeds: set[Any]) -> tuple[set[Any], list[bool]]:
    """Variables depending on `seeds`, and for each equation whether it does."""
    tainted = set(seeds)
    marks = []
    for eqn in jaxpr.eqns:
        hit = any(isinstance(v, jcore.Var) and v in tainted for v in eqn.invars)
        marks.append(hit)
        if hit:
            tainted.update(eqn.outvars)
    return tainted, marks


def _tags_reached(eqn: Any, tainted: set[Any]) -> bool:
    """Whether a tag depends on `eqn`'s inputs in `tainted`: `eqn` is a tag, or holds one in
    a jaxpr of its own (a scan's body, a call's) that depends on them. A jaxpr whose inputs
    are the equation's, one for one (a call, a remat, a scan), is followed in; any other
    holding a tag counts as reached. (A checkpoint inside a checkpointed layer transposes
    to a remat whose recomputation holds its tags and whose cotangent inputs feed none.)"""
    if is_name_primitive(eqn.primitive):
        return True
    for sub, _ in _jaxpr._sub_jaxprs(eqn):
        if not _trace._tags_in(sub):
            continue
        if len(sub.invars) != len(eqn.invars):
            return True
        seeds = {b for a, b in zip(eqn.invars, sub.invars)
                 if isinstance(a, jcore.Var) and a in tainted}
        reached, marks = _depends(sub, seeds)
        if any(m and _tags_reached(e, reached) for m, e in zip(marks, sub.eqns)):
            return True
    return False


def _cotangent_count(body: Any) -> int:
    """How many trailing inputs of a transposed remat body are output cotangents.

    JAX's remat transpose binds the residuals (the layer's non-linear primal inputs, and
    saved values) first, then the nonzero output cotangents. The cotangents are the
    largest trailing run of inputs that no tag (``checkpoint_name``, also one inside a
    scan's body or a call) depends on, and every
    gradient the body returns depends on them. (The smallest run that every gradient
    depends on is not enough: with a carry and a per-layer output, the output's cotangent
    alone reaches every gradient.) A trailing parameter that feeds no tag would be taken
    for a cotangent too; it only moves work the backward does anyway between the two
    sides, and keeps nothing."""
    n = len(body.invars)
    outs = [v for v in body.outvars if isinstance(v, jcore.Var)]
    found = 0
    for k in range(1, n):
        tainted, marks = _depends(body, set(body.invars[n - k:]))
        if any(m and _tags_reached(e, tainted) for m, e in zip(marks, body.eqns)):
            break
        found = k
    if found:
        tainted, _ = _depends(body, set(body.invars[n - found:]))
        if all(v in tainted for v in outs):
            return found
    raise _NotABackward("cannot tell the output cotangents from the residuals in a layer's "
                        "backward: no trailing inputs that the gradients depend on and no "
                        "tag does")


class _NotABackward(ValueError):
    """A remat equation with no output cotangents among its inputs (`_cotangent_count`)."""


@dataclass(frozen=True)
class LayerBackward:
    """One checkpointed layer's backward, as the traced step holds it.

    `graph` is exact for any save set (`LayerGraph.evaluate_roles` with tag names as the
    roles); `count` is how many times the step runs it (a scan's length, or 1 per
    unrolled copy; times the micro-batches of a loop around the gradient); `held` how many
    copies of its residuals the step holds at once: `count` less the repeats of a loop
    that runs forward and backward in each iteration (gradient accumulation's loop over
    micro-batches frees one micro-batch's residuals before the next; `_held`); `needed`
    are the forward values its backward reads."""

    graph: LayerGraph
    count: int
    tags: tuple[str, ...]
    needed: tuple[str, ...]
    held: int = 0  # 0: `count`

    def __post_init__(self) -> None:
        if not self.held:
            object.__setattr__(self, "held", self.count)

    def recomputed_read_bytes(self, saved: Iterable[str],
                              itemsizes: Mapping[str, int] | None = None) -> int:
        """Bytes of the values this layer's backward reads that a save set recomputes:
        what its working set holds beyond the kept residuals (at `itemsizes` per element
        where given, by dtype: `STORED_ITEMSIZE`)."""
        ev = self.graph.evaluate_roles(saved)
        skip = set(ev.kept) | set(self.graph.inputs) | set(self.graph.params)
        return sum(self.graph.values[v].bytes_as(itemsizes or {})
                   for v in self.needed if v not in skip)

    def stored_kept_bytes(self, kept: Iterable[str], itemsizes: Mapping[str, int]) -> int:
        """What an evaluation's `kept` values take (parameters count nothing, as in
        `LayerGraph.evaluate`), at `itemsizes` per element where given."""
        return sum(self.graph.values[v].bytes_as(itemsizes)
                   for v in self.graph.residuals(kept))


def _layer_backward(eqn: Any, count: int, outer: Sequence[tuple[Any, Any]] = (),
                    shards: int = 1) -> LayerBackward:
    """The graph of one transposed remat equation's body (`_trace.jaxpr_graph`): the
    cotangents are unknown; of the residuals, those shaped like a cotangent are the
    layer's activations (the carry), the others its parameters. `outer` are the
    equations around it, outermost first, each with the jaxpr of it that holds the next
    (`_remat_bodies`)."""
    body = eqn.params["jaxpr"]
    n_ct = _cotangent_count(body)
    n_res = len(body.invars) - n_ct
    ct_avals = {(tuple(v.aval.shape), str(v.aval.dtype)) for v in body.invars[n_res:]}
    activation = [(tuple(v.aval.shape), str(v.aval.dtype)) in ct_avals
                  for v in body.invars[:n_res]] + [False] * n_ct
    graph = _trace.jaxpr_graph(body, unknown=[False] * n_res + [True] * n_ct,
                               activation=activation, shards=shards, nested=True)
    tags = tuple(dict.fromkeys(v.role for v in graph.values.values() if v.role is not None))
    acts = [v for v, a in zip(eqn.invars, activation) if a] or list(eqn.invars[:n_res])
    return LayerBackward(graph, count, tags, graph.needed(), _held(acts, outer, count))


_VIEWS = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims",
                    "broadcast_in_dim", "transpose", "copy", "copy_p", "reduce_precision",
                    "sharding_constraint", "device_put"})
"""Equations that pass a value on without computing a new one: a residual reached
through them is still the one its jaxpr was given."""


def _source(made: Mapping[Any, Any], var: Any) -> Any:
    """`var` followed back through `_VIEWS` (`made`: a jaxpr's equations by the variables
    they make): an input of the jaxpr, or the output of an equation that computes it."""
    while var in made and str(made[var].primitive) in _VIEWS and made[var].invars:
        var = made[var].invars[0]
    return var


def _held(acts: Sequence[Any], outer: Sequence[tuple[Any, Any]], count: int) -> int:
    """How many copies of a layer's residuals the step holds at once, of the `count` runs.

    The residuals a transposed layer reads (`acts`: its activation inputs) are followed
    out through the equations around it, innermost first. A scan whose body gets them as
    a scanned-over input stacks one per iteration (a scanned stack's backward, the
    forward's per-layer outputs); a scan that gets them as a constant or carry does not;
    a scan whose body computes them itself, in every iteration, frees them before the
    next one, and so does every scan around that (gradient accumulation: each
    micro-batch's forward and backward run inside one iteration of its loop). Calls pass
    them through; an equation whose inputs cannot be matched to its body's counts its
    length, as the step's runs do."""
    held, vars_ = count, [v for v in acts if isinstance(v, jcore.Var)]
    lengths = [int(e.params.get("length", 1)) if str(e.primitive) == "scan" else 1
               for e, _ in outer]
    for k in range(len(outer) - 1, -1, -1):
        eqn, body = outer[k]
        if not vars_ or len(body.invars) != len(eqn.invars):
            return held
        index = {v: i for i, v in enumerate(body.invars)}
        made = {o: e for e in body.eqns for o in e.outvars}
        found = [index.get(_source(made, v)) for v in vars_]
        given = [i for i in found if i is not None]
        stacked = lengths[k] > 1 and any(i >= sum(scan_counts(eqn.params)) for i in given)
        if not stacked and len(given) < len(found):  # computed in each iteration
            return max(held // math.prod(lengths[:k + 1]), 1)
        if lengths[k] > 1 and not stacked:
            held //= lengths[k]  # the same residuals in every iteration: held once
        vars_ = [eqn.invars[i] for i in given if isinstance(eqn.invars[i], jcore.Var)]
    return held


def _remat_bodies(jaxpr: Any, mult: int = 1, outer: tuple[tuple[Any, Any], ...] = ()
                  ) -> Iterable[tuple[Any, int, tuple[tuple[Any, Any], ...]]]:
    """Each transposed remat equation in `jaxpr`, with how many times the step runs it and
    the equations around it (`_layer_backward`'s `outer`)."""
    for eqn in jaxpr.eqns:
        if str(eqn.primitive) == "remat2" and eqn.params.get("differentiated"):
            yield eqn, mult, outer
            continue
        for sub, m in _jaxpr._sub_jaxprs(eqn):
            yield from _remat_bodies(sub, mult * m, (*outer, (eqn, sub)))


@dataclass(frozen=True)
class StepGraph:
    """Every checkpointed layer's backward in one training step, per core."""

    layers: tuple[LayerBackward, ...]
    tags: tuple[str, ...]
    no_remat_flops: int  # the step's FLOPs without remat (jaxpr count, scans multiplied)
    # bytes per element the compiling backend stores, where not the dtype's (STORED_ITEMSIZE)
    itemsizes: Mapping[str, int] = field(default_factory=dict)
    # the pieces the compiler splits the step's values into (`_shards`): every byte and FLOP
    # here is one core's
    shards: int = 1

    @property
    def count(self) -> int:
        """How many layer backwards the step runs (`LayerBackward.count`)."""
        return sum(layer.count for layer in self.layers)

    @property
    def depth(self) -> int:
        """How many layers' residuals the step holds at once (`LayerBackward.held`): the
        layers per core; `count` divides by it where a loop over micro-batches repeats
        them."""
        return sum(layer.held for layer in self.layers)

    def kept_bytes(self, saved: Iterable[str]) -> int:
        """Bytes every layer's residuals take, all layers together (JAX's count)."""
        s = tuple(saved)
        return sum(layer.held * layer.graph.evaluate_roles(s).kept_bytes for layer in self.layers)

    def stored_bytes(self, saved: Iterable[str]) -> int:
        """`kept_bytes` as the backend stores them (`itemsizes`): what the compiled step
        holds for them."""
        if not self.itemsizes:
            return self.kept_bytes(saved)
        s = tuple(saved)
        return sum(layer.held * layer.stored_kept_bytes(layer.graph.evaluate_roles(s).kept,
                                                         self.itemsizes)
                   for layer in self.layers)

    def recompute_flops(self, saved: Iterable[str]) -> int:
        s = tuple(saved)
        return sum(layer.count * layer.graph.evaluate_roles(s).recompute_flops
                   for layer in self.layers)

    def no_remat_kept_bytes(self, stored: bool = False) -> int:
        """What every layer keeps without remat: every value its backward reads (with
        `stored`, as the backend stores them)."""
        total = 0
        for layer in self.layers:
            ev = layer.graph.evaluate(lambda v: True)
            total += layer.held * (layer.stored_kept_bytes(ev.kept, self.itemsizes)
                                    if stored else ev.kept_bytes)
        return total

    def kinds(self) -> int:
        """How many different layers the step checkpoints (by what each keeps with each
        of its tags saved alone, with nothing and with everything): 1 for a stack of one
        layer, unrolled or scanned."""
        # not by the tags' names, which may carry the layer's number (layers.3.q)
        return len({(tuple(sorted(layer.graph.evaluate_roles((t,)).kept_bytes
                                  for t in layer.tags)),
                     layer.graph.evaluate_roles(()).kept_bytes,
                     layer.graph.evaluate(lambda v: True).kept_bytes)
                    for layer in self.layers})

    def read_bytes(self, saved: Iterable[str]) -> int:
        """The most one layer's backward reads of what `saved` recomputes, as the backend
        stores it (`LayerBackward.recomputed_read_bytes`)."""
        s = tuple(saved)
        return max(layer.recomputed_read_bytes(s, self.itemsizes) for layer in self.layers)


class StepTraceError(ValueError):
    """The user's step failed to trace with the arguments given: its error, not
    neuron_remat's (the cause is chained)."""


def step_graph(make_step: Callable[[Any], Any], *args: Any) -> StepGraph:
    """Trace ``make_step(save nothing)`` on `args` (no compile) and read its layers.

    The trace uses JAX's original remat implementation even when ``jax_remat3`` is on: its
    backward keeps each layer in a ``remat2`` equation whose recomputation carries the
    tags, while remat3 inlines the layer and drops them. A `RegexPolicy` makes the same
    decisions under both, so the graph is the same; the probes compile under the
    implementation the host really runs."""
    with remat3_off():
        try:
            closed, shardings = _traced(make_step(save_only_these_names()), args)
        except Exception as err:  # noqa: BLE001  the user's step, failing as it will
            raise StepTraceError(
                f"make_step(policy)(*args) raised {type(err).__name__} when traced: "
                f"{first_line(err)} "
                "(make_step takes a JAX remat policy and returns the training step, which "
                "is called with the args given)") from err
    shards = _shards([*shardings, *_constraints(closed.jaxpr)])
    layers, unread = [], []
    for eqn, m, outer in _remat_bodies(closed.jaxpr):
        try:
            layers.append(_layer_backward(eqn, m, outer, shards))
        except _NotABackward as err:
            unread.append((eqn, err))
    read = {t for layer in layers for t in layer.tags}
    for eqn, err in unread:
        # A checkpoint inside a checkpointed layer leaves a remat of its own in the
        # forward pass (its primal half, no cotangents): its tags are the outer layer's,
        # whose backward recomputes it. Any other such remat is a layer not read.
        if not layers or not set(_trace._tags_in(eqn.params["jaxpr"])) <= read:
            raise ValueError(str(err)) from None
    if not layers:
        raise ValueError(
            "make_step(policy) built a step with no checkpointed layer: its jaxpr holds no "
            "remat2 equation with differentiated=True. Wrap each layer in "
            "jax.checkpoint(layer, policy=policy) (inside its scan) and differentiate it")
    tags: dict[str, None] = {}
    for layer in layers:
        tags.update((t, None) for t in layer.tags)
    # Tags no backward reads are DCE'd from the remat bodies; list them too (saving one
    # keeps nothing and saves nothing, and the plan says so).
    tags.update((e.params["name"], None) for e, _ in _jaxpr._walk(closed.jaxpr)
                if _jaxpr.is_name_primitive(e.primitive))
    no_remat, _ = _traced(make_step(jax.checkpoint_policies.everything_saveable), args)
    return StepGraph(tuple(layers), tuple(tags), _per_core_flops(no_remat.jaxpr, shards),
                     STORED_ITEMSIZE.get(jax.default_backend(), {}), shards)


def _traced(step: Any, args: Sequence[Any]) -> tuple[Any, list[tuple[Any, tuple[int, ...]]]]:
    """The step's closed jaxpr as its jit traces it, and the shardings its inputs are given
    (each with the input's global shape: the arguments' own, and the jit's
    ``in_shardings``). A ``jax.jit`` with static arguments keeps them static
    (``make_jaxpr`` would make every argument a tracer); a wrapper whose ``trace`` is not
    JAX's (``nnx.jit``'s gives no jaxpr) or that has none (``eqx.filter_jit``) is traced
    through ``make_jaxpr``."""
    given = [(getattr(leaf, "sharding", None), tuple(getattr(leaf, "shape", ())))
             for leaf in jax.tree.leaves(args)]
    jitted = _jitted(step)
    trace = getattr(jitted, "trace", None)
    if callable(trace):
        traced = trace(*args)
        closed = getattr(traced, "jaxpr", None)
        if closed is not None and hasattr(closed, "jaxpr"):  # a ClosedJaxpr
            declared = jit_in_shardings(traced)
            if len(declared) == len(closed.in_avals):
                given += [(s, tuple(a.shape)) for s, a in zip(declared, closed.in_avals)]
            return closed, given
    return jax.make_jaxpr(jitted)(*args), given


def _constraints(jaxpr: Any) -> list[tuple[Any, tuple[int, ...]]]:
    """The shardings the step's ``with_sharding_constraint``s give, with their operands'
    global shapes (MaxText and axlearn constrain their activations so)."""
    return [(e.params.get("sharding"), tuple(e.invars[0].aval.shape))
            for e, _ in _jaxpr._walk(jaxpr) if str(e.primitive) == "sharding_constraint"]


def _shards(shardings: Iterable[tuple[Any, tuple[int, ...]]]) -> int:
    """Into how many pieces the compiler splits the step's values: the product of the
    sizes of the mesh axes that the inputs' and constraints' shardings split anything
    over (the batch over ``data``, the weights over ``model``: 8 on a 4 x 2 mesh), or, for
    a sharding that names no mesh axes, the pieces it splits its value into; the most of
    these, 1 when nothing is split. The trace reads global shapes and a core holds one
    piece: exact where the activations are split over every axis, as under data and
    fully sharded data parallelism, and for a tensor-parallel layer's heads and hidden
    units; a value a tensor-parallel layer keeps whole on each core (its output, after
    the reduction over the axis) counts too little, which the compiles calibrate
    (`_belief._Model`)."""
    most = 1
    used: dict[tuple[tuple[str, int], ...], set[str]] = {}  # a mesh's axes -> those used
    for sharding, shape in shardings:
        axes = _mesh_axes(sharding)
        if axes is not None:
            used.setdefault(tuple(axes[0].items()), set()).update(axes[1])
            continue
        most = max(most, pieces(sharding, shape) or 1)
    for mesh, names in used.items():
        most = max(most, math.prod(size for n, size in mesh if n in names))
    return most


def _mesh_axes(sharding: Any) -> tuple[dict[str, int], set[str]] | None:
    """A named sharding's mesh axis sizes and the axes its spec splits over; None for any
    other sharding (or none)."""
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    shape = getattr(mesh, "shape", None)
    if spec is None or not isinstance(shape, Mapping):
        return None
    names: set[str] = set()
    for entry in spec:
        names.update(n for n in (entry if isinstance(entry, tuple) else (entry,))
                     if isinstance(n, str))
    return dict(shape), names


def _per_core_flops(jaxpr: Any, shards: int) -> int:
    """The jaxpr's FLOPs on one core (`_jaxpr.jaxpr_cost`'s count) where the compiler
    splits its work `shards` ways: a shard_map's body is already per shard."""
    if shards == 1:
        return _jaxpr.jaxpr_cost(jaxpr).flops
    total = 0
    for eqn in jaxpr.eqns:
        if str(eqn.primitive) == "shard_map":
            total += sum(_jaxpr.jaxpr_cost(sub).flops * m for sub, m in _jaxpr._sub_jaxprs(eqn))
            continue
        total += _trace._per_core(_jaxpr.eqn_flops(eqn), shards)
        total += sum(_per_core_flops(sub, shards) * m for sub, m in _jaxpr._sub_jaxprs(eqn))
    return total


def _named(candidates: Iterable[str] | str) -> list[str]:
    """The tag names `candidates` gives: a list, or one comma-separated str."""
    if isinstance(candidates, str):
        candidates = candidates.split(",")
    return [c.strip() for c in candidates]


def _pool(graph: StepGraph, candidates: Iterable[str] | None) -> tuple[str, ...]:
    """The tags worth deciding: those whose saving saves recompute, alone or beside the
    others, of at least `DEFAULT_MIN_FLOPS_PER_BYTE` for each byte it keeps; of two that
    name one value (`aliases`), the first."""
    if candidates is not None:
        chosen = _named(candidates)
        bad = [c for c in chosen if c not in graph.tags]
        if bad:
            raise ValueError(f"candidates {bad} are not tags of this step; its tags: "
                             f"{list(graph.tags)}")
    else:
        chosen = list(graph.tags)
    # Useful: saving it recomputes less, alone or beside every other tag (a tag may pay
    # only with others), by at least the planner's `DEFAULT_MIN_FLOPS_PER_BYTE` for each
    # byte it keeps, one way or the other: below that it is elementwise work (a cast, a
    # norm or activation output), cheaper to redo than to hold, and the compiled FLOPs can
    # even grow with it (XLA adds converts around a saved bfloat16 value).
    base, base_kept = graph.recompute_flops(()), graph.kept_bytes(())
    everything = tuple(dict.fromkeys(chosen))
    most, most_kept = graph.recompute_flops(everything), graph.kept_bytes(everything)

    def pays(saved: float, kept: int) -> bool:
        return saved > 0 and (kept <= 0 or saved / kept >= DEFAULT_MIN_FLOPS_PER_BYTE)

    out = []
    for t in everything:
        rest = tuple(o for o in everything if o != t)
        if pays(base - graph.recompute_flops((t,)), graph.kept_bytes((t,)) - base_kept) or \
                pays(graph.recompute_flops(rest) - most, most_kept - graph.kept_bytes(rest)):
            out.append(t)
    second = aliases(graph, out)
    return tuple(t for t in out if t not in second)


def aliases(graph: StepGraph, tags: Sequence[str]) -> dict[str, str]:
    """The tags of `tags` that name the same value as another, each mapped to the first
    name in the step's order (`graph.tags`): MaxText names a routed expert's projection
    twice (``mlpwi_0`` and ``moe_mlpwi_0``, one ``checkpoint_name`` around the other), and
    saving either keeps the value. Two tags of the same layers are one value when saving
    either alone, or both, keeps the same bytes and recomputes the same FLOPs, and does
    so beside every other tag too (two alike tags, a K and a V projection, keep twice as
    much together). A tag whose saving changes nothing alone names no value of its own
    to compare; it is nobody's alias."""
    order = {t: i for i, t in enumerate(graph.tags)}
    tags = sorted(dict.fromkeys(tags), key=lambda t: order.get(t, len(order)))
    kept, flops = graph.kept_bytes, graph.recompute_flops
    base = (kept(()), flops(()))
    where = {t: tuple(i for i, layer in enumerate(graph.layers) if t in layer.tags)
             for t in tags}
    alone = {t: (kept((t,)), flops((t,))) for t in tags}
    out: dict[str, str] = {}
    first: list[str] = []
    for t in tags:
        if alone[t] == base:
            continue
        for u in first:
            if where[u] != where[t] or alone[u] != alone[t]:
                continue
            pair = (u, t)
            others = tuple(o for o in tags if o not in pair)
            if (kept(pair), flops(pair)) == alone[t] and \
                    (kept((*others, u)), flops((*others, u))) == \
                    (kept((*others, t)), flops((*others, t))) == \
                    (kept((*others, *pair)), flops((*others, *pair))):
                out[t] = u
                break
        else:
            first.append(t)
    return out
