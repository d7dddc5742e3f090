"""What JAX itself says about a function: the tags it emits, the residuals a policy keeps,
and the work its linearized (backward) program does; `traced_footprint` measures a layer's
per-tag figures from them.

The traced graph follows every primitive that holds a jaxpr, as JAX's remat partial
evaluation does: calls (``jit``, ``closed_call``, custom JVP/VJP calls, nested
checkpoints) are inlined; ``shard_map`` bodies are inlined at their per-shard shapes (bytes
per shard are bytes per core); a custom VJP's residuals are what its forward returns (its
``custom_lin`` reads them); ``scan`` bodies are inlined with their values stacked over the
scan's length and their work times it; a ``cond`` counts its costliest branch (named in
`Footprint.notes`); a ``while`` whose trip count JAX cannot know is one opaque op counting
one iteration (named), and so is a Pallas kernel (``pallas_call``: its cost estimate's
FLOPs; named). A scatter's update function and a reduction's are part of that op. Any
other primitive holding a jaxpr is an error naming it.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as jc
from .graph import Footprint, LayerGraph, Op, TagCost, Value

logger = logging.getLogger(__name__)

NAME_PRIMITIVE = jc.NAME_PRIMITIVE
is_name_primitive = jc.is_name_primitive


class UnsupportedPrimitiveError(ValueError):
    """The traced program holds a jaxpr inside a primitive the graph builder does not know."""


@dataclass(frozen=True)
class TagInfo:
    """One ``checkpoint_name`` tag as the traced program emits it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # per emission
    count: int  # emissions per call (scan bodies count once per iteration)


@dataclass(frozen=True)
class Residual:
    """One value JAX keeps for the backward."""

    kind: str  # "tag", "argument" or "other"
    name: str  # the tag, the argument, or JAX's description
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    argnum: int | None = None  # for arguments: which positional argument it belongs to


# --- dtypes ---------------------------------------------------------------------------


def itemsize(dtype: Any) -> int:
    """Bytes per element of any JAX dtype: numpy's, ml_dtypes' (bfloat16, float8), and
    extended dtypes (typed PRNG keys), which numpy does not know."""
    if dtype is None:
        return 0
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return int(getattr(dtype, "itemsize", 0) or 0)


def is_differentiable(dtype: Any) -> bool:
    """Whether values of `dtype` get tangents: JAX's floating and complex types (bfloat16
    and float8 included, which numpy's ``inexact`` misses); not integers, booleans, keys."""
    if dtype is None:
        return False
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:
        return False


def _dtype_name(dtype: Any) -> str:
    try:
        return str(np.dtype(dtype))
    except TypeError:
        return str(dtype)


def _aval_bytes(aval: Any) -> int:
    return int(math.prod(getattr(aval, "shape", ()))) * itemsize(getattr(aval, "dtype", None))


def _leaf_dtype(leaf: Any) -> Any:
    dtype = getattr(leaf, "dtype", None)
    return dtype if dtype is not None else jnp.result_type(leaf)


# --- calling a user's function ----------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A user's ``fn(*args, **kwargs)`` as a function of positional array pytrees.

    Keyword arguments that name positional parameters are bound to their positions (so
    ``f(p, x=x)`` is ``f(p, x)``); any others travel as one last argument, a dict. Leaves
    that are not arrays (Python numbers, booleans, strings, None, any other object) are
    static: closed over, as ``jit``'s ``static_argnums`` would hold them, so a Python flag
    can steer the layer's control flow. Integer, boolean and PRNG-key arrays are inputs
    that get no tangent."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    n_positional: int  # arguments before the keyword dict (when there is one)


def _is_array_leaf(leaf: Any) -> bool:
    return (isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))
            or (hasattr(leaf, "shape") and hasattr(leaf, "dtype")))


def bind_call(fn: Callable[..., Any], args: Sequence[Any],
              kwargs: dict[str, Any] | None = None) -> Call:
    """`fn` and its arguments as a `Call` (see there); a call `fn` cannot accept is refused
    in one line."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r:.80}")
    pos, kw = tuple(args), dict(kwargs or {})
    if kw:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        if sig is not None:
            try:
                bound = sig.bind(*pos, **kw)
            except TypeError as err:
                raise TypeError(f"{getattr(fn, '__name__', 'fn')}{sig} cannot take these "
                                f"arguments: {err}") from None
            pos, kw = tuple(bound.args), dict(bound.kwargs)
    n = len(pos)
    call_fn: Callable[..., Any] = fn
    full: tuple[Any, ...] = pos
    if kw:
        full = (*pos, kw)

        def call_fn(*a: Any) -> Any:
            return fn(*a[:n], **a[n])

    flat, tree = jax.tree.flatten(full)
    static = [not _is_array_leaf(leaf) for leaf in flat]
    if not any(static):
        return Call(call_fn, full, n)
    masked = [None if s else leaf for leaf, s in zip(flat, static)]
    inner = call_fn

    def with_static(*a: Any) -> Any:
        dynamic = iter(jax.tree.leaves(a))
        leaves = [leaf if s else next(dynamic) for leaf, s in zip(flat, static)]
        return inner(*jax.tree.unflatten(tree, leaves))

    return Call(with_static, tuple(jax.tree.unflatten(tree, masked)), n)


def _walk(jaxpr: Any, mult: int = 1) -> Iterator[tuple[Any, int]]:
    for eqn in jaxpr.eqns:
        yield eqn, mult
        for sub, m in _sub_jaxprs(eqn):
            yield from _walk(sub, mult * m)


_COMBINERS = {"update_jaxpr", "select_jaxpr", "scatter_jaxpr"}
"""Parameters holding the scalar function an op applies per element (a scatter's update, a
select_and_scatter's selection and update): part of that op, not a program of their own."""
_REDUCERS = {"reduce", "reduce_window"}
"""Primitives whose ``jaxpr`` parameter is the scalar function they reduce with."""
_KERNELS = {"pallas_call"}
"""Primitives whose ``jaxpr`` parameter is a kernel's body (over memory references, run at
each point of a grid): the kernel is one opaque op, its FLOPs its own cost estimate
(`eqn_flops`). No tag can be applied inside one."""


def _sub_jaxprs(eqn: Any) -> Iterator[tuple[Any, int]]:
    """(jaxpr, multiplicity) for each jaxpr inside an equation's parameters that is a
    program of its own: not the per-element function of a scatter or a reduction (a
    gather's transpose, in the backward of any indexing, is a scatter-add holding one), nor
    a Pallas kernel's body."""
    prim = str(eqn.primitive)
    mult = int(eqn.params.get("length", 1)) if prim == "scan" else 1
    params = dict(eqn.params)
    hi = params.pop("_prim", None)  # a jax_remat3 primitive keeps its jaxpr in its params
    params.update(getattr(hi, "params", None) or {})
    for key in _COMBINERS | ({"jaxpr"} if prim in _REDUCERS | _KERNELS else set()):
        params.pop(key, None)
    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, jc.ClosedJaxpr):
                yield item.jaxpr, mult
            elif isinstance(item, jc.Jaxpr):
                yield item, mult


def _jvp_jaxpr(call: Call) -> tuple[Any, list[bool], list[int]]:
    """The JVP jaxpr of `call` (primal leaves, then tangents of the differentiable ones),
    which leaves are differentiable, and the argument each primal leaf belongs to."""
    leaves, tree = jax.tree.flatten(call.args)
    diff = [is_differentiable(_leaf_dtype(leaf)) for leaf in leaves]

    def jvp(primals: list[Any], tangents: list[Any]) -> Any:
        def flat(*inexact: Any) -> Any:
            it = iter(inexact)
            full = [next(it) if d else leaf for d, leaf in zip(diff, primals)]
            return call.fn(*jax.tree.unflatten(tree, full))

        return jax.jvp(flat, [p for p, d in zip(primals, diff) if d], tangents)

    tangents = [leaf for leaf, d in zip(leaves, diff) if d]
    closed = jax.make_jaxpr(jvp)(leaves, tangents)
    return closed, diff, leaf_argnums(call.args)


def emitted_tags(fn: Callable[..., Any], args: Sequence[Any],
                 kwargs: dict[str, Any] | None = None) -> list[TagInfo]:
    """Every tag `fn` emits when differentiated, in program order, merged by name: those
    in scan bodies (counted per iteration), custom VJP forwards and shard_map bodies (at
    per-shard shapes) too."""
    call = bind_call(fn, args, kwargs)
    closed, diff, _ = _jvp_jaxpr(call)
    n, m = len(diff), sum(diff)
    built = _build(closed, [False] * n + [True] * m, None)
    return list(built.tags.values())


def tag_of(eqn: Any) -> str | None:
    """The ``checkpoint_name`` tag `eqn` applies, or None: JAX's ``name`` primitive, or
    the ``CheckpointName`` primitive JAX's new remat (``jax_remat3``) traces instead."""
    if is_name_primitive(eqn.primitive):
        return str(eqn.params["name"])
    prim = eqn.params.get("_prim") if jc.CHECKPOINT_NAME is not None else None
    if prim is not None and isinstance(prim, jc.CHECKPOINT_NAME):
        return str(prim.name)
    return None


def _inner_jaxpr(eqn: Any) -> Any:
    """The jaxpr of a call-like equation (jit, closed_call, shard_map, ...) whose outputs
    are its inner jaxpr's outputs one to one, or None."""
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if isinstance(inner, jc.ClosedJaxpr):
        inner = inner.jaxpr
    if isinstance(inner, jc.Jaxpr) and len(inner.outvars) == len(eqn.outvars):
        return inner
    return None


def _source(var: Any, jaxpr: Any) -> tuple[str, Any]:
    """Where `var` of `jaxpr` comes from: ``("tag", name)``, ``("input", index)`` (the
    index-th input of `jaxpr`) or ``("other", description)``. Looks through what only
    forwards a value: ``reduce_precision`` (JAX's remat inserts it on saved values), and
    call equations that return one of their inputs. A value a tag is applied to counts as
    that tag (JAX < 0.9 may keep it rather than the tag's output)."""
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    tagged = {}
    for eqn in jaxpr.eqns:
        name = tag_of(eqn)
        if name is not None:
            tagged.setdefault(eqn.invars[0], name)
    inputs = {v: i for i, v in enumerate(jaxpr.invars)}
    while True:
        if isinstance(var, jc.Literal):
            return "other", "a literal"
        if var in inputs:
            return "input", inputs[var]
        if var in jaxpr.constvars:
            return "other", "a constant"
        eqn = producers.get(var)
        if eqn is None:
            return "other", "an unknown value"
        name = tag_of(eqn)
        if name is not None:
            return "tag", name
        prim = str(eqn.primitive)
        if prim == "reduce_precision":
            var = eqn.invars[0]
            continue
        inner = _inner_jaxpr(eqn)
        if inner is not None:
            kind, what = _source(inner.outvars[eqn.outvars.index(var)], inner)
            if kind == "input":
                var = eqn.invars[what]
                continue
            if kind == "tag":
                return kind, what
        if var in tagged:
            return "tag", tagged[var]
        label = eqn.params.get("name")
        return "other", f"output of {prim}" + (f" {label!r}" if isinstance(label, str) else "")


def residuals(fn: Callable[..., Any], args: Sequence[Any],
              kwargs: dict[str, Any] | None = None) -> list[Residual]:
    """The values JAX keeps for the backward of `fn` (already wrapped in ``jax.checkpoint``
    when a policy is to apply), what ``jax._src.ad_checkpoint.saved_residuals`` lists.

    Read from the structure of the traced VJP (the residual outputs of ``jax.vjp`` traced
    by ``jax.make_jaxpr``, followed back to the tag, argument or operation that made
    them), not from JAX's descriptions, whose wording differs between JAX versions (JAX
    0.7 and 0.8 call a saved tag "output of reduce_precision"). The VJP is taken with
    respect to the differentiable (floating) leaves; integer, boolean and key arguments are
    inputs too and are listed when kept. Arguments carry the index of the positional
    argument they are a leaf of, and their key path as name."""
    call = bind_call(fn, args, kwargs)
    flat_paths, tree = jax.tree_util.tree_flatten_with_path(call.args)
    leaves = [leaf for _, leaf in flat_paths]
    argnums = leaf_argnums(call.args)
    diff = [is_differentiable(_leaf_dtype(leaf)) for leaf in leaves]

    def vjp(*all_leaves: Any) -> Any:
        def flat(*inexact: Any) -> Any:
            it = iter(inexact)
            full = [next(it) if d else leaf for d, leaf in zip(diff, all_leaves)]
            return call.fn(*jax.tree.unflatten(tree, full))

        return jax.vjp(flat, *[leaf for leaf, d in zip(all_leaves, diff) if d])

    closed, shapes = jax.make_jaxpr(vjp, return_shape=True)(*leaves)
    jaxpr = closed.jaxpr
    n_res = len(jax.tree.leaves(shapes[1]))
    out, seen = [], set()
    for var in jaxpr.outvars[len(jaxpr.outvars) - n_res:]:
        if not isinstance(var, jc.Literal):
            if var in seen:
                continue  # one buffer, listed once (as JAX lists it)
            seen.add(var)
        aval = var.aval
        shape, dtype, nbytes = tuple(aval.shape), _dtype_name(aval.dtype), _aval_bytes(aval)
        kind, what = _source(var, jaxpr)
        if kind == "input":
            name = "args" + jax.tree_util.keystr(flat_paths[what][0])
            out.append(Residual("argument", name, shape, dtype, nbytes, argnums[what]))
        else:
            out.append(Residual(kind, what, shape, dtype, nbytes))
    return out


def leaf_argnums(args: Sequence[Any]) -> list[int]:
    """For each flattened leaf of `args`, the index of the argument it belongs to."""
    return [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]


# XLA's cost analysis counts one FLOP per element for arithmetic, none for data movement,
# and transcendental functions separately; this mirrors it on jaxpr equations.
_FREE = {
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather", "scatter",
    "iota", "copy", "copy_p", "select_and_gather_add", "rev", "name", "pjit", "jit",
    "closed_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call", "scan",
    "while", "cond", "stop_gradient", "optimization_barrier", "sharding_constraint",
    "device_put", "split", "mul_transpose", "convert_element_type_p",
    "exp", "exp2", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt", "sin", "cos",
    "erf", "erf_inv", "pow", "expm1", "atan2", "cbrt", "random_bits", "random_wrap",
    "random_unwrap", "random_seed", "threefry2x32",
    "remat2", "call_hi_primitive",  # remat calls (and remat3's tags): their jaxprs are walked
    "shard_map", "custom_lin", "custom_vjp_call_jaxpr", "closed_call", "core_call",
    # collectives and their bookkeeping (no arithmetic in XLA's per-op count)
    "pvary", "pbroadcast", "psum", "psum2", "psum_invariant", "pmax", "pmin", "all_gather",
    "all_to_all", "ppermute", "reduce_scatter", "axis_index",
}
_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
           "reduce_and", "reduce_or", "cumsum", "cummax", "cumlogsumexp"}


def eqn_flops(eqn: Any) -> int:
    """FLOPs of one equation as XLA's HloCostAnalysis counts its lowering: 2 per
    multiply-add of a matmul, one per element of arithmetic, a reduction's input minus
    output elements, nothing for data movement or transcendental functions (counted apart),
    except ``logistic``, which XLA expands to negate, exp, add and divide (3 FLOPs)."""
    name = str(eqn.primitive)
    if name in _KERNELS:  # what the kernel's author estimated (CostEstimate.flops), or 0
        return int(getattr(eqn.params.get("cost_estimate"), "flops", 0) or 0)
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = math.prod(lhs[i] for i in lhs_contract)
        return 2 * int(math.prod(eqn.outvars[0].aval.shape)) * int(k)
    if name == "logistic":
        return 3 * int(math.prod(eqn.outvars[0].aval.shape))
    if name in _FREE:
        return 0
    if name in _REDUCE:
        size = int(math.prod(eqn.invars[0].aval.shape))
        if name.startswith("cum"):
            return size
        return size - int(math.prod(getattr(eqn.outvars[0].aval, "shape", ())))
    if name == "integer_pow":
        y = int(eqn.params.get("y", 2))
        per = max(1, abs(y).bit_length() - 1 + bin(abs(y)).count("1") - 1) + (y < 0)
        return per * int(math.prod(eqn.outvars[0].aval.shape))
    if name == "convert_element_type" and eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype:
        return 0  # a weak-type change: no instruction
    out = eqn.outvars[0].aval if eqn.outvars else None
    return int(math.prod(getattr(out, "shape", ()))) if out is not None else 0


# --------------------------------------------------------------------------------------
# The jaxpr builder of the layer graph.
# --------------------------------------------------------------------------------------

# Call-like equations whose body is inlined: their inside is ordinary dataflow that JAX's
# remat partial evaluation splits equation by equation (its rules for these recurse). A
# shard_map's body has per-shard shapes, so its values count per shard: per core.
_CALLS = {"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat2", "remat",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "shard_map",
          "named_call", "xla_call"}
# Kept for callers that read it (the primitives whose bodies `_build` handles itself).
_LOOPS = {"scan", "while", "cond"}


def _inner(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if isinstance(j, jc.ClosedJaxpr):
            return j.jaxpr, j.consts
        if isinstance(j, jc.Jaxpr):
            return j, ()
    return None


def _body_flops(jaxpr: Any) -> int:
    return sum(eqn_flops(e) * m for e, m in _walk(jaxpr))


def _unknown_outs(jaxpr: Any, unknown_in: Sequence[bool]) -> list[bool]:
    """Which outputs of `jaxpr` depend on its unknown inputs (a conservative dataflow
    pass: an equation with any unknown input has unknown outputs)."""
    unk = {v for v, u in zip(jaxpr.invars, unknown_in) if u}
    for eqn in jaxpr.eqns:
        ins = [not isinstance(a, jc.Literal) and a in unk for a in eqn.invars]
        if not any(ins):
            continue
        prim = str(eqn.primitive)
        inner = _inner(eqn) if prim in _CALLS else None
        outs: list[bool] | None = None
        if inner is not None and len(inner[0].invars) == len(ins):
            outs = _unknown_outs(inner[0], ins)  # a call: output by output
        elif prim == "scan":
            body = eqn.params["jaxpr"].jaxpr
            nc, nk = jc.scan_counts(eqn.params)
            carry = ins[nc:nc + nk]
            while True:
                outs = _unknown_outs(body, [*ins[:nc], *carry, *ins[nc + nk:]])
                new = [a or b for a, b in zip(carry, outs[:nk])]
                if new == carry:
                    break
                carry = new
        elif prim == "cond":
            per = [_unknown_outs(b.jaxpr, ins[1:]) for b in eqn.params["branches"]]
            outs = [any(col) for col in zip(*per)] if not ins[0] else None
        if outs is None or len(outs) != len(eqn.outvars):
            unk.update(eqn.outvars)
        else:
            unk.update(o for o, u in zip(eqn.outvars, outs) if u)
    return [not isinstance(o, jc.Literal) and o in unk for o in jaxpr.outvars]


def _tags_in(jaxpr: Any) -> dict[str, None]:
    return {t: None for e, _ in _walk(jaxpr) if (t := tag_of(e)) is not None}


@dataclass
class Built:
    """What `_build` makes of a jaxpr: the graph, the tags it emits (`TagInfo`, per
    emission, at per-shard shapes), tags JAX emits that no value of the graph carries (and
    why), and notes on what was approximated (which cond branch is counted, while loops)."""

    graph: LayerGraph
    tags: dict[str, TagInfo] = field(default_factory=dict)
    hidden: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def jaxpr_graph(jaxpr: Any, *, unknown: Sequence[bool],
                activation: Sequence[bool] | None = None) -> LayerGraph:
    """The `LayerGraph` of a jaxpr split into a known (primal) and an unknown part.

    `unknown[i]` says whether invar i is unknown (a tangent or cotangent) or known (a primal
    value: a layer activation or a parameter). `activation[i]` (one entry per invar; those of
    unknown invars are ignored) says whether a known invar is an activation, whose bytes
    count when the backward reads it (default: every known invar); the others are
    parameters, kept at no cost. Constants of the jaxpr count as parameters. Give the JVP
    jaxpr of a layer (primals known, tangents unknown) or the body of a differentiated
    ``remat`` (residuals known, cotangents unknown).

    Each equation whose inputs are all known becomes an `Op` (FLOPs as XLA's cost analysis
    counts them, `eqn_flops`), each known variable a `Value`, tagged with the
    ``checkpoint_name`` that produced it. The graph's `reads` are the known variables that
    live unknown equations read: exactly what the backward reads. Under a names policy,
    JAX's remat partial evaluation (``pe.partial_eval_jaxpr_custom``) keeps such a value
    when it is an input or a saved name, and otherwise recomputes its equation, whose
    inputs are read in turn: what `LayerGraph.evaluate` computes. Every intermediate is
    explicit, so no `Op.internal`.

    Primitives holding jaxprs are followed as the module docstring says: calls and
    ``shard_map`` inlined (per-shard shapes), ``scan`` bodies inlined with each value
    stacked over the length (a leading dimension) and each op's FLOPs times it, a ``cond``'s
    costliest branch inlined, a ``while`` one opaque op counting one iteration, a
    ``pallas_call`` kernel one opaque op of its cost estimate's FLOPs, and
    ``optimization_barrier`` the identity; a scatter's or a reduction's per-element function
    is part of that op. Any other primitive holding a jaxpr raises
    `UnsupportedPrimitiveError`.
    """
    return _build(jaxpr, unknown, activation).graph


def _build(jaxpr: Any, unknown: Sequence[bool],
           activation: Sequence[bool] | None) -> Built:
    if isinstance(jaxpr, jc.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    unknown = list(unknown)
    if len(unknown) != len(jaxpr.invars):
        raise ValueError(f"unknown has {len(unknown)} entries for {len(jaxpr.invars)} invars")
    acts = [True] * len(unknown) if activation is None else list(activation)
    if len(acts) != len(unknown):
        raise ValueError(f"activation has {len(acts)} entries for {len(unknown)} invars")

    values: dict[str, Value] = {}
    unk: set[str] = set()
    ops: list[Op] = []
    staged: list[tuple[list[str], list[str], list[str]]] = []  # (unknown in, known in, out)
    inputs: list[str] = []
    params: list[str] = []
    tags: dict[str, TagInfo] = {}
    hidden: dict[str, str] = {}
    notes: list[str] = []
    counter = [0]

    def fresh(aval: Any, lead: tuple[int, ...], prefix: str = "v", role: str | None = None,
              eqn: Any = None) -> str:
        name = f"{prefix}{counter[0]}"
        counter[0] += 1
        dot = batch = False
        if eqn is not None and str(eqn.primitive) == "dot_general":
            dot = True
            (_, _), (lb, _) = eqn.params["dimension_numbers"]
            batch = bool(lb)
        dtype = getattr(aval, "dtype", None)
        values[name] = Value(name, (*lead, *getattr(aval, "shape", ())), _dtype_name(dtype),
                             role, dot=dot, batch_dot=batch, itemsize=itemsize(dtype) or 1)
        return name

    def const(aval: Any) -> str:
        name = fresh(aval, (), "const")
        params.append(name)
        return name

    def read(env: dict[Any, str | None], atom: Any) -> str | None:
        return None if isinstance(atom, jc.Literal) else env[atom]

    def hide(jx: Any, why: str) -> None:
        for t in _tags_in(jx):
            hidden.setdefault(t, why)

    def note_tag(name: str, eqn: Any, lead: tuple[int, ...]) -> None:
        aval = eqn.invars[0].aval
        mult = math.prod(lead)
        info = tags.get(name)
        if info is None:
            tags[name] = TagInfo(name, tuple(aval.shape), _dtype_name(aval.dtype),
                                 _aval_bytes(aval), mult)
        else:  # the same name twice (e.g. a kernel's output and its log-sum-exp)
            tags[name] = TagInfo(name, info.shape, info.dtype, info.bytes + _aval_bytes(aval),
                                 max(info.count, mult))

    def plain(eqn: Any, ins: list[str | None], env: dict[Any, str | None],
              lead: tuple[int, ...], flops: int, label: str | None = None) -> None:
        prim = str(eqn.primitive)
        tag = tag_of(eqn)
        present = [n for n in ins if n is not None]
        is_unknown = any(n in unk for n in present)
        if tag is not None:
            if is_unknown:
                hidden.setdefault(tag, "applied to a value computed from tangents only")
            else:
                note_tag(tag, eqn, lead)
                hidden.pop(tag, None)
        outs = [fresh(ov.aval, lead, role=tag, eqn=eqn) for ov in eqn.outvars]
        env.update(zip(eqn.outvars, outs))
        if not outs:
            return
        if is_unknown:
            unk.update(outs)
            staged.append(([n for n in present if n in unk],
                           [n for n in present if n not in unk], outs))
            for n in outs:  # unknown values are not part of the graph
                values.pop(n)
        else:
            ops.append(Op(f"{label or prim}:{len(ops)}", tuple(dict.fromkeys(present)),
                          outs[0], flops * math.prod(lead), more_outputs=tuple(outs[1:])))

    def inline(sub: Any, ins: list[str | None], lead: tuple[int, ...]) -> list[str | None]:
        subenv: dict[Any, str | None] = {cv: const(cv.aval) for cv in sub.constvars}
        subenv.update(zip(sub.invars, ins))
        expand(sub, subenv, lead)
        return [read(subenv, o) for o in sub.outvars]

    def scan(eqn: Any, ins: list[str | None], env: dict[Any, str | None],
             lead: tuple[int, ...]) -> None:
        closed = eqn.params["jaxpr"]
        body = closed.jaxpr if isinstance(closed, jc.ClosedJaxpr) else closed
        nc, nk = jc.scan_counts(eqn.params)
        length = int(eqn.params["length"])
        inner_lead = (*lead, length)
        is_unk = [n is not None and n in unk for n in ins]
        carry_unk = is_unk[nc:nc + nk]
        while True:  # a carry is unknown when its update is (JAX's fixpoint)
            outs = _unknown_outs(body, [*is_unk[:nc], *carry_unk, *is_unk[nc + nk:]])
            new = [a or b for a, b in zip(carry_unk, outs[:nk])]
            if new == carry_unk:
                break
            carry_unk = new
        # A known carry the backward reads is not stacked: JAX's staged scan recomputes
        # the carry chain from its initial value (the carry update is no saveable name).
        # So each iteration's carry is a value recomputed from the initial carry and what
        # the update reads, at the update's work times the length.
        need = {v for v in body.outvars[:nk] if not isinstance(v, jc.Literal)}
        chain = 0
        for e in reversed(body.eqns):
            if any(o in need for o in e.outvars):
                need.update(a for a in e.invars if not isinstance(a, jc.Literal))
                chain += eqn_flops(e) + sum(eqn_flops(s) * m for sub, mm in _sub_jaxprs(e)
                                            for s, m in _walk(sub, mm))
        update_reads = [n for i, (v, n) in enumerate(zip(body.invars, ins))
                        if v in need and not nc <= i < nc + nk and n is not None]
        body_ins: list[str | None] = list(ins[:nc])
        first = True
        for v, u, init in zip(body.invars[nc:nc + nk], carry_unk, ins[nc:nc + nk]):
            if u:
                name = f"dc{counter[0]}"
                counter[0] += 1
                unk.add(name)
            else:
                name = fresh(v.aval, inner_lead, "carry")
                srcs = ((init,) if init is not None else ()) + tuple(update_reads)
                ops.append(Op(f"scan_carry:{len(ops)}", tuple(dict.fromkeys(srcs)), name,
                              chain * math.prod(inner_lead) if first else 0))
                first = False
            body_ins.append(name)
        body_ins.extend(ins[nc + nk:])
        outs_named = inline(body, body_ins, inner_lead)
        env.update(zip(eqn.outvars, outs_named))

    def cond(eqn: Any, ins: list[str | None], env: dict[Any, str | None],
             lead: tuple[int, ...]) -> None:
        branches = eqn.params["branches"]
        costs = [_body_flops(b.jaxpr) for b in branches]
        chosen = max(range(len(branches)), key=lambda i: (costs[i], i))
        notes.append(f"a cond with {len(branches)} branches (FLOPs {costs}): branch "
                     f"{chosen}, the costliest, is counted")
        counted = _tags_in(branches[chosen].jaxpr)
        for i, b in enumerate(branches):
            if i != chosen:
                for t in _tags_in(b.jaxpr):
                    if t not in counted:
                        hidden.setdefault(t, f"only in branch {i} of a cond; branch {chosen} "
                                             "(the costliest) is counted")
        b = branches[chosen]
        sub_ins = ins[1:]
        subenv: dict[Any, str | None] = {cv: const(cv.aval) for cv in b.jaxpr.constvars}
        subenv.update(zip(b.jaxpr.invars, sub_ins))
        expand(b.jaxpr, subenv, lead)
        env.update(zip(eqn.outvars, (read(subenv, o) for o in b.jaxpr.outvars)))

    def while_loop(eqn: Any, ins: list[str | None], env: dict[Any, str | None],
                   lead: tuple[int, ...]) -> None:
        body, cond_j = eqn.params["body_jaxpr"], eqn.params["cond_jaxpr"]
        if any(n is not None and n in unk for n in ins):
            raise UnsupportedPrimitiveError(
                "a while_loop carries a differentiated value: JAX cannot differentiate a "
                "while_loop in reverse mode (its trip count is unknown); write it with "
                "lax.scan, or fori_loop with static bounds")
        hide(body.jaxpr, "inside a while_loop, whose trip count is unknown: JAX saves "
                         "nothing inside it")
        hide(cond_j.jaxpr, "inside a while_loop's condition")
        notes.append("a while_loop with an unknown trip count: one opaque op whose work "
                     "counts one iteration")
        plain(eqn, ins, env, lead, _body_flops(body.jaxpr) + _body_flops(cond_j.jaxpr),
              "while(trip count unknown, one iteration counted)")

    def expand(jx: Any, env: dict[Any, str | None], lead: tuple[int, ...]) -> None:
        for eqn in jx.eqns:
            ins = [read(env, a) for a in eqn.invars]
            prim = str(eqn.primitive)
            if tag_of(eqn) is not None:
                plain(eqn, ins, env, lead, eqn_flops(eqn))
            elif prim in _CALLS and _inner(eqn) is not None:
                sub, _ = _inner(eqn)  # type: ignore[misc]
                if len(sub.invars) != len(ins) or len(sub.outvars) != len(eqn.outvars):
                    raise UnsupportedPrimitiveError(
                        f"cannot follow {prim}: its jaxpr takes {len(sub.invars)} inputs "
                        f"for {len(ins)} operands")
                if prim == "shard_map":
                    mesh = eqn.params.get("mesh")
                    shape = dict(getattr(mesh, "shape", {}) or {})
                    note = (f"a shard_map over mesh {shape}: its values count per shard "
                            "(per core)")
                    if note not in notes:
                        notes.append(note)
                env.update(zip(eqn.outvars, inline(sub, ins, lead)))
            elif prim == "scan":
                scan(eqn, ins, env, lead)
            elif prim == "cond":
                cond(eqn, ins, env, lead)
            elif prim == "while":
                while_loop(eqn, ins, env, lead)
            elif prim == "optimization_barrier":
                env.update(zip(eqn.outvars, ins))
            elif prim in _KERNELS:
                note = (f"a {prim} kernel: one opaque op, its FLOPs its cost estimate's (0 "
                        "where it gives none)")
                if note not in notes:
                    notes.append(note)
                plain(eqn, ins, env, lead, eqn_flops(eqn))
            elif any(True for _ in _sub_jaxprs(eqn)):
                raise UnsupportedPrimitiveError(
                    f"the traced program holds a jaxpr inside a {prim!r} equation, which "
                    "neuron_remat does not know how to follow; its tags and residuals "
                    "would be missed. Please report it (primitives followed: "
                    f"{sorted(_CALLS | _LOOPS)})")
            else:
                plain(eqn, ins, env, lead, eqn_flops(eqn))

    env: dict[Any, str | None] = {cv: const(cv.aval) for cv in jaxpr.constvars}
    for i, (v, u, a) in enumerate(zip(jaxpr.invars, unknown, acts)):
        if u:
            name = f"d{i}"
            unk.add(name)
        else:
            name = fresh(v.aval, (), "in")
            (inputs if a else params).append(name)
        env[v] = name
    expand(jaxpr, env, ())

    live = {n for n in (read(env, o) for o in jaxpr.outvars) if n is not None and n in unk}
    reads: list[str] = []
    for u_in, k_in, outs in reversed(staged):
        if live.intersection(outs):
            live.update(u_in)
            reads.extend(reversed(k_in))
    reads = list(dict.fromkeys(reversed(reads)))
    outs = [n for n in (read(env, o) for o in jaxpr.outvars) if n is not None and n not in unk]
    outs = list(dict.fromkeys(outs))
    for t in tags:
        hidden.pop(t, None)
    graph = LayerGraph(values=values, ops=tuple(ops), inputs=tuple(inputs),
                       params=tuple(params), reads=tuple(reads), outputs=tuple(outs),
                       round_saved=True)
    return Built(graph, tags, hidden, notes)


@dataclass(frozen=True)
class ProgramCost:
    dot_generals: int  # equations, as written (a scan body counts once)
    dot_flops: int  # scan bodies multiplied by their length
    flops: int


def jaxpr_cost(jaxpr: Any) -> ProgramCost:
    dots = dot_flops = flops = 0
    for eqn, mult in _walk(jaxpr):
        f = eqn_flops(eqn) * mult
        flops += f
        if str(eqn.primitive) == "dot_general":
            dots += 1
            dot_flops += f
    return ProgramCost(dots, dot_flops, flops)


def linearized_cost(fn: Callable[..., Any], args: Sequence[Any],
                    kwargs: dict[str, Any] | None = None) -> ProgramCost:
    """Work in the linearized program of `fn`: what the backward does, recomputation
    included (the same program jax.linearize prints), with respect to the differentiable
    leaves of the arguments.

    Traced abstractly (inside `jax.eval_shape`): on concrete arrays `jax.linearize` runs
    the primal computation eagerly, op by op, and compiles every `lax.scan` it meets."""
    call = bind_call(fn, args, kwargs)
    leaves, tree = jax.tree.flatten(call.args)
    diff = [is_differentiable(_leaf_dtype(leaf)) for leaf in leaves]
    tangents = [jax.ShapeDtypeStruct(np.shape(leaf), _leaf_dtype(leaf))
                for leaf, d in zip(leaves, diff) if d]
    found: list[Any] = []

    def trace(*primals: Any) -> None:
        def flat(*inexact: Any) -> Any:
            it = iter(inexact)
            full = [next(it) if d else leaf for d, leaf in zip(diff, primals)]
            return call.fn(*jax.tree.unflatten(tree, full))

        _, lin = jax.linearize(flat, *[p for p, d in zip(primals, diff) if d])
        found.append(jax.make_jaxpr(lin)(*tangents))

    jax.eval_shape(trace, *leaves)
    return jaxpr_cost(found[0].jaxpr)


def checkpointed(fn: Callable[..., Any], policy: Any, prevent_cse: bool = True
                 ) -> Callable[..., Any]:
    return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)


def _signature(tree: Any) -> tuple[Any, list[tuple[tuple[int, ...], str]]]:
    leaves, struct = jax.tree.flatten(tree)
    return struct, [(tuple(np.shape(leaf)), _dtype_name(_leaf_dtype(leaf))) for leaf in leaves]


def activation_argnums(fn: Callable[..., Any], args: Sequence[Any],
                       kwargs: dict[str, Any] | None = None) -> tuple[int, ...]:
    """The positional argument that is the layer input: the one whose pytree structure,
    shapes and dtypes match what `fn` returns (the scan carry). Every other argument is a
    parameter. Raises ValueError, naming the candidates, when none or several match.
    Keyword arguments naming positional parameters count at their positions."""
    call = bind_call(fn, args, kwargs)
    out = jax.eval_shape(call.fn, *call.args)
    want = _signature(out)
    cands = call.args[:call.n_positional]
    found = [i for i, a in enumerate(cands) if _signature(a) == want]
    if len(found) == 1:
        return (found[0],)
    shapes = [s for s, _ in want[1]]
    described = ", ".join(f"{i}: {jax.tree.map(lambda a: tuple(np.shape(a)), a)}"
                          for i, a in enumerate(cands)) or "none"
    if not found:
        raise ValueError(
            f"cannot tell which argument is the layer input: none matches the output "
            f"({want[0]} with shapes {shapes}); arguments are {described}. Pass "
            "activation_argnums=(i,) naming the layer input (the scan carry)")
    raise ValueError(
        f"cannot tell which argument is the layer input: arguments {found} all match the "
        f"output ({want[0]} with shapes {shapes}). Pass activation_argnums=(i,) naming the "
        "layer input (the scan carry)")


def resolve_activation_argnums(fn: Callable[..., Any], args: Sequence[Any],
                               kwargs: dict[str, Any] | None,
                               given: Sequence[int] | int | None) -> tuple[int, ...]:
    """`given` checked against the arguments, or inferred by `activation_argnums`."""
    if given is None:
        return activation_argnums(fn, args, kwargs)
    n = bind_call(fn, args, kwargs).n_positional
    if isinstance(given, (bool, np.bool_)) or not isinstance(given, (int, np.integer, tuple,
                                                                      list)):
        raise TypeError(f"activation_argnums must be an int or a sequence of ints, got "
                        f"{type(given).__name__}: {given!r:.60}")
    nums = (given,) if isinstance(given, (int, np.integer)) else tuple(given)
    bad = [i for i in nums if isinstance(i, (bool, np.bool_))
           or not isinstance(i, (int, np.integer)) or not 0 <= i < n]
    if bad:
        raise ValueError(f"activation_argnums {bad} out of range for {n} positional "
                         f"arguments (valid: 0 to {n - 1})")
    return tuple(int(i) for i in nums)


def _traced(call: Call, acts: Sequence[int]) -> Built:
    closed, diff, nums = _jvp_jaxpr(call)
    n, m = len(diff), sum(diff)
    chosen = set(acts)
    return _build(closed, [False] * n + [True] * m,
                  [nums[i] in chosen for i in range(n)] + [False] * m)


def traced_graph(fn: Callable[..., Any], args: Sequence[Any],
                 kwargs: dict[str, Any] | None = None,
                 activation_argnums: Sequence[int] = (0,)) -> LayerGraph:
    """The `LayerGraph` of `fn`'s JVP jaxpr: primal arguments known (those in
    `activation_argnums` count their bytes, the others are parameters), tangents of every
    floating argument unknown, as when a training step differentiates the layer with
    respect to its input and its parameters."""
    return _traced(bind_call(fn, args, kwargs), activation_argnums).graph


def traced_footprint(fn: Callable[..., Any], *args: Any,
                     activation_argnums: Sequence[int] | int | None = None,
                     tags: Sequence[str] | None = None, **kwargs: Any) -> Footprint:
    """Bytes kept and recompute FLOPs of `fn`'s tags, from `fn`'s own traced program.

    The footprint carries the layer's graph (`jaxpr_graph` of its JVP), so
    ``footprint.evaluate(saved_tags)`` is exact jointly for any subset: the bytes JAX keeps
    (as ``saved_residuals`` reports them, parameters excluded; a shard_map's values per
    shard, i.e. per core) and the recompute FLOPs (as XLA's cost analysis counts them, a
    scan's body times its length). Per-tag figures (`TagCost`) are each tag alone;
    `Footprint.groups` lists tags that only pay off together (three slices of one fused
    matmul). ``footprint.notes`` names what the graph approximates (the cond branch
    counted, a while loop's unknown trip count); a tag JAX emits that no graph value
    carries (inside a while loop, in an uncounted cond branch) is in the footprint with 0
    bytes and a note saying why.

    The layer input is the argument matching the output's structure, shapes and dtypes
    (`activation_argnums` overrides); every other argument is a parameter. Arguments may
    be given by keyword; non-array leaves (Python numbers, flags, None) are static;
    integer, boolean and PRNG-key arrays get no tangent. `tags` restricts the footprint to
    some of the tags (the others are then never saved).
    """
    call = bind_call(fn, args, kwargs)
    acts = resolve_activation_argnums(call.fn, call.args, None, activation_argnums)
    built = _traced(call, acts)
    graph = built.graph
    order: dict[str, list[Value]] = {}
    for v in graph.values.values():
        if v.role is not None:
            order.setdefault(v.role, []).append(v)
    missing_tags = [t for t in built.tags if t not in order and t not in built.hidden]
    if missing_tags:  # a bug of ours, not the user's: say so
        raise RuntimeError(f"internal error in neuron_remat: tags {missing_tags} are "
                           "emitted but not in the traced graph; please report it")
    hidden = {t: why for t, why in built.hidden.items() if t not in order}
    if tags is not None:
        emitted = [*order, *hidden]
        missing = sorted(set(tags) - set(emitted))
        if missing:
            raise ValueError(f"tags {missing} are not emitted by the function; it emits "
                             f"{emitted}")
        order = {t: vs for t, vs in order.items() if t in set(tags)}
        hidden = {t: w for t, w in hidden.items() if t in set(tags)}
    base_bytes, base_flops = graph.cost_of_roles(())
    costs: dict[str, TagCost] = {}
    for tag, vals in order.items():
        nbytes, flops = graph.cost_of_roles((tag,))
        extra, saved = nbytes - base_bytes, base_flops - flops
        size = sum(v.bytes for v in vals)
        kept = set(graph.evaluate_roles((tag,)).kept)
        always = extra <= 0 and any(v.name in kept for v in vals)
        note = ""
        if always:
            note = "a view of the layer input: kept whatever the policy says"
        elif extra <= 0 and saved <= 0:
            note = "the backward never reads it: saving it keeps nothing"
        costs[tag] = TagCost(bytes=size if always else max(extra, 0),
                             recompute_flops=float(max(saved, 0)), always_kept=always,
                             size_bytes=size, shape=vals[0].shape, dtype=vals[0].dtype,
                             note=note)
    for tag, why in hidden.items():
        info = built.tags.get(tag)
        costs[tag] = TagCost(bytes=0, recompute_flops=0.0, size_bytes=0,
                             shape=info.shape if info else (),
                             dtype=info.dtype if info else "", note=why)
    fp = Footprint(costs, always_kept_bytes=base_bytes, graph=graph,
                   roles={t: t for t in costs}, forward_flops=float(graph.forward_flops()),
                   no_remat_bytes=graph.no_remat_bytes())
    fp.notes = tuple(built.notes)  # type: ignore[attr-defined]
    for line in built.notes:
        logger.info("traced footprint: %s", line)
    return fp
