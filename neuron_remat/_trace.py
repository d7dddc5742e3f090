"""What JAX itself says about a function: the tags it emits, the residuals a policy keeps,
and the work its linearized (backward) program does; `traced_footprint` measures a layer's
per-tag figures from them."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.ad_checkpoint import name_p, saved_residuals
from jax.extend import core as jcore

from .graph import Footprint, LayerGraph, Op, TagCost, Value

NAME_PRIMITIVE = str(name_p)


def is_name_primitive(prim: Any) -> bool:
    return prim is name_p or str(prim) == NAME_PRIMITIVE


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


def _aval_bytes(aval: Any) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _sub_jaxprs(eqn: Any) -> Iterator[tuple[Any, int]]:
    """(jaxpr, multiplicity) for each jaxpr inside an equation's parameters."""
    mult = int(eqn.params.get("length", 1)) if str(eqn.primitive) == "scan" else 1
    for value in eqn.params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, jcore.ClosedJaxpr):
                yield item.jaxpr, mult
            elif isinstance(item, jcore.Jaxpr):
                yield item, mult


def _walk(jaxpr: Any, mult: int = 1) -> Iterator[tuple[Any, int]]:
    for eqn in jaxpr.eqns:
        yield eqn, mult
        for sub, m in _sub_jaxprs(eqn):
            yield from _walk(sub, mult * m)


def _closed(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)


def emitted_tags(fn: Callable[..., Any], args: Sequence[Any],
                 kwargs: dict[str, Any] | None = None) -> list[TagInfo]:
    """Every tag `fn` emits, in program order, merged by name."""
    closed = _closed(fn, args, kwargs or {})
    found: dict[str, TagInfo] = {}
    for eqn, mult in _walk(closed.jaxpr):
        if not is_name_primitive(eqn.primitive):
            continue
        name = eqn.params["name"]
        aval = eqn.invars[0].aval
        info = found.get(name)
        if info is None:
            found[name] = TagInfo(name, tuple(aval.shape), str(np.dtype(aval.dtype)),
                                  _aval_bytes(aval), mult)
        else:
            # The same name twice (e.g. a kernel's output and its log-sum-exp).
            found[name] = TagInfo(name, info.shape, info.dtype,
                                  info.bytes + _aval_bytes(aval), max(info.count, mult))
    return list(found.values())


_NAMED = re.compile(r"named '(?P<name>.*)' from ")
_ARG = re.compile(r"from the argument (?P<name>.*)$")


def residuals(fn: Callable[..., Any], args: Sequence[Any],
              kwargs: dict[str, Any] | None = None) -> list[Residual]:
    """What JAX's saved-residuals analysis keeps for `fn` (already wrapped in
    ``jax.checkpoint`` when a policy is to apply). Arguments carry the index of the
    positional argument they are a leaf of (None if JAX's description cannot say)."""
    leaves, tree = jax.tree.flatten(tuple(args))
    argnums = leaf_argnums(args)
    kwargs = kwargs or {}

    def flat(*leaves: Any) -> Any:
        return fn(*jax.tree.unflatten(tree, leaves), **kwargs)

    out = []
    for aval, src in saved_residuals(flat, *leaves):
        shape, dtype = tuple(aval.shape), str(np.dtype(aval.dtype))
        nbytes = _aval_bytes(aval)
        if m := _NAMED.search(src):
            out.append(Residual("tag", m.group("name"), shape, dtype, nbytes))
        elif m := _ARG.search(src):
            name = m.group("name")
            idx = re.fullmatch(r"leaves\[(\d+)\]", name)
            argnum = argnums[int(idx.group(1))] if idx else None
            out.append(Residual("argument", name, shape, dtype, nbytes, argnum))
        else:
            out.append(Residual("other", src, shape, dtype, nbytes))
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
}
_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
           "reduce_and", "reduce_or", "cumsum", "cummax", "cumlogsumexp"}


def eqn_flops(eqn: Any) -> int:
    """FLOPs of one equation as XLA's HloCostAnalysis counts its lowering: 2 per
    multiply-add of a matmul, one per element of arithmetic, a reduction's input minus
    output elements, nothing for data movement or transcendental functions (counted apart),
    except ``logistic``, which XLA expands to negate, exp, add and divide (3 FLOPs)."""
    name = str(eqn.primitive)
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
# remat partial evaluation splits equation by equation (its rules for these recurse).
_INLINE = {"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat2", "remat",
           "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
# Loops and branches stay single (opaque) ops: their FLOPs are their bodies' (a scan's times
# its length, every cond branch added), and a loop that mixes primal and tangent inputs is
# treated as part of the backward, which then reads all its primal inputs.
_LOOPS = {"scan", "while", "cond"}


def _inner(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if isinstance(j, jcore.ClosedJaxpr):
            return j.jaxpr, j.consts
        if isinstance(j, jcore.Jaxpr):
            return j, ()
    return None


def _op_flops(eqn: Any) -> int:
    if str(eqn.primitive) in _LOOPS:
        return sum(eqn_flops(e) * m for sub, mult in _sub_jaxprs(eqn) for e, m in _walk(sub, mult))
    return eqn_flops(eqn)


def _itemsize(aval: Any) -> int:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:  # extended dtypes (PRNG keys)
        return int(getattr(dtype, "itemsize", 0) or 0)


def jaxpr_graph(jaxpr: Any, *, unknown: Sequence[bool],
                activation: Sequence[bool] | None = None) -> LayerGraph:
    """The `LayerGraph` of a jaxpr split into a known (primal) and an unknown part.

    `unknown[i]` says whether invar i is unknown (a tangent or cotangent) or known (a primal
    value: a layer activation or a parameter). `activation[i]` (one entry per invar; those of
    unknown invars are ignored) says whether a known invar is an activation, whose bytes
    count when the backward reads it (default: every known invar); the others are
    parameters, kept at no cost. Constants of the jaxpr count as parameters. Give the JVP jaxpr of a layer (primals known,
    tangents unknown) or the body of a differentiated ``remat`` (residuals known, cotangents
    unknown).

    Call-like equations (jit, closed_call, custom_jvp/vjp calls, nested checkpoints) are
    inlined and ``optimization_barrier`` is the identity. Each equation whose inputs are all
    known becomes an `Op` (FLOPs as XLA's cost analysis counts them, `eqn_flops`), each known
    variable a `Value`, tagged with the ``checkpoint_name`` that produced it. The graph's
    `reads` are the known variables that live unknown equations read: exactly what the
    backward reads. Under a names policy, JAX's remat partial evaluation
    (``pe.partial_eval_jaxpr_custom``) keeps such a value when it is an input or a saved
    name, and otherwise recomputes its equation, whose inputs are read in turn: what
    `LayerGraph.evaluate` computes. Every intermediate is explicit, so no `Op.internal`.
    Loops and branches (scan, while, cond) are single opaque ops (see `_LOOPS`).
    """
    closed_consts: Sequence[Any] = ()
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr, closed_consts = jaxpr.jaxpr, jaxpr.consts
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
    counter = [0]

    def fresh(aval: Any, prefix: str = "v", role: str | None = None,
              eqn: Any = None) -> str:
        name = f"{prefix}{counter[0]}"
        counter[0] += 1
        dot = batch = False
        if eqn is not None and str(eqn.primitive) == "dot_general":
            dot = True
            (_, _), (lb, _) = eqn.params["dimension_numbers"]
            batch = bool(lb)
        values[name] = Value(name, tuple(getattr(aval, "shape", ())),
                             str(getattr(aval, "dtype", "")), role, dot=dot, batch_dot=batch,
                             itemsize=_itemsize(aval) or 1)
        return name

    def const(aval: Any) -> str:
        name = fresh(aval, "const")
        params.append(name)
        return name

    def read(env: dict[Any, str | None], atom: Any) -> str | None:
        return None if isinstance(atom, jcore.Literal) else env[atom]

    def expand(jx: Any, env: dict[Any, str | None]) -> None:
        for eqn in jx.eqns:
            ins = [read(env, a) for a in eqn.invars]
            prim = str(eqn.primitive)
            inner = _inner(eqn) if prim in _INLINE else None
            if inner is not None:
                sub, consts = inner
                subenv: dict[Any, str | None] = {cv: const(cv.aval) for cv in sub.constvars}
                assert len(consts) in (0, len(sub.constvars))
                subenv.update(zip(sub.invars, ins))
                expand(sub, subenv)
                for ov, so in zip(eqn.outvars, sub.outvars):
                    env[ov] = read(subenv, so)
                continue
            if prim == "optimization_barrier":
                env.update(zip(eqn.outvars, ins))
                continue
            named = is_name_primitive(eqn.primitive)
            outs = [fresh(ov.aval, role=eqn.params["name"] if named else None, eqn=eqn)
                    for ov in eqn.outvars]
            env.update(zip(eqn.outvars, outs))
            present = [n for n in ins if n is not None]
            if not outs:
                continue
            if any(n in unk for n in present):
                unk.update(outs)
                staged.append(([n for n in present if n in unk],
                               [n for n in present if n not in unk], outs))
                for n in outs:  # unknown values are not part of the graph
                    values.pop(n)
            else:
                ops.append(Op(f"{prim}:{len(ops)}", tuple(dict.fromkeys(present)), outs[0],
                              _op_flops(eqn), more_outputs=tuple(outs[1:])))

    env: dict[Any, str | None] = {cv: const(cv.aval) for cv in jaxpr.constvars}
    del closed_consts
    for i, (v, u, a) in enumerate(zip(jaxpr.invars, unknown, acts)):
        if u:
            name = f"d{i}"
            unk.add(name)
        else:
            name = fresh(v.aval, "in")
            (inputs if a else params).append(name)
        env[v] = name
    expand(jaxpr, env)

    live = {n for n in (read(env, o) for o in jaxpr.outvars) if n is not None and n in unk}
    reads: list[str] = []
    for u_in, k_in, outs in reversed(staged):
        if live.intersection(outs):
            live.update(u_in)
            reads.extend(reversed(k_in))
    reads = list(dict.fromkeys(reversed(reads)))
    outs = [n for n in (read(env, o) for o in jaxpr.outvars) if n is not None and n not in unk]
    return LayerGraph(values=values, ops=tuple(ops), inputs=tuple(inputs),
                      params=tuple(params), reads=tuple(reads), outputs=tuple(outs),
                      round_saved=True)


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
    included (the same program jax.linearize prints).

    Traced abstractly (inside `jax.eval_shape`): on concrete arrays `jax.linearize` runs
    the primal computation eagerly, op by op, and compiles every `lax.scan` it meets."""
    kwargs = kwargs or {}
    tangents = jax.tree.map(lambda a: np.zeros(np.shape(a), _tangent_dtype(a)), tuple(args))
    found: list[Any] = []

    def trace(*primals: Any) -> None:
        _, lin = jax.linearize(lambda *a: fn(*a, **kwargs), *primals)
        found.append(jax.make_jaxpr(lin)(*tangents))

    jax.eval_shape(trace, *args)
    return jaxpr_cost(found[0].jaxpr)


def _tangent_dtype(a: Any) -> Any:
    dtype = np.dtype(getattr(a, "dtype", np.float32))
    return dtype if np.issubdtype(dtype, np.inexact) else jax.dtypes.float0


def checkpointed(fn: Callable[..., Any], policy: Any, prevent_cse: bool = True
                 ) -> Callable[..., Any]:
    return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)


def activation_argnums(fn: Callable[..., Any], args: Sequence[Any],
                       kwargs: dict[str, Any] | None = None) -> tuple[int, ...]:
    """The positional argument that is the layer input: the one whose pytree structure,
    shapes and dtypes match what `fn` returns (the scan carry). Every other argument is a
    parameter. Raises ValueError, naming the candidates, when none or several match."""
    kwargs = kwargs or {}
    out = jax.eval_shape(lambda *a: fn(*a, **kwargs), *args)

    def signature(tree: Any) -> tuple[Any, list[tuple[tuple[int, ...], str]]]:
        leaves, struct = jax.tree.flatten(tree)
        return struct, [(tuple(np.shape(leaf)), str(jnp.result_type(leaf))) for leaf in leaves]

    want = signature(out)
    found = [i for i, a in enumerate(args) if signature(a) == want]
    if len(found) == 1:
        return (found[0],)
    shapes = [s for s, _ in want[1]]
    described = ", ".join(f"{i}: {jax.tree.map(lambda a: tuple(np.shape(a)), a)}"
                          for i, a in enumerate(args)) or "none"
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
    nums = (given,) if isinstance(given, int) else tuple(given)
    bad = [i for i in nums if not isinstance(i, int) or not 0 <= i < len(args)]
    if bad:
        raise ValueError(f"activation_argnums {bad} out of range for {len(args)} positional "
                         f"arguments (valid: 0 to {len(args) - 1})")
    return nums


def traced_graph(fn: Callable[..., Any], args: Sequence[Any],
                 kwargs: dict[str, Any] | None = None,
                 activation_argnums: Sequence[int] = (0,)) -> LayerGraph:
    """The `LayerGraph` of `fn`'s JVP jaxpr: primal arguments known (those in
    `activation_argnums` count their bytes, the others are parameters), tangents of every
    inexact argument unknown, as when a training step differentiates the layer with respect
    to its input and its parameters."""
    kwargs = kwargs or {}
    leaves, tree = jax.tree.flatten(tuple(args))
    nums = leaf_argnums(args)
    acts = set(activation_argnums)
    diff = [np.issubdtype(np.dtype(jnp.result_type(leaf)), np.inexact) for leaf in leaves]

    def jvp(primals: list[Any], tangents: list[Any]) -> Any:
        def flat(*inexact: Any) -> Any:
            it = iter(inexact)
            full = [next(it) if d else leaf for d, leaf in zip(diff, primals)]
            return fn(*jax.tree.unflatten(tree, full), **kwargs)

        return jax.jvp(flat, [p for p, d in zip(primals, diff) if d], tangents)

    tangents = [leaf for leaf, d in zip(leaves, diff) if d]
    closed = jax.make_jaxpr(jvp)(leaves, tangents)
    n, m = len(leaves), len(tangents)
    return jaxpr_graph(closed, unknown=[False] * n + [True] * m,
                       activation=[nums[i] in acts for i in range(n)] + [False] * m)


def traced_footprint(fn: Callable[..., Any], *args: Any,
                     activation_argnums: Sequence[int] | int | None = None,
                     tags: Sequence[str] | None = None, **kwargs: Any) -> Footprint:
    """Bytes kept and recompute FLOPs of `fn`'s tags, from `fn`'s own traced program.

    The footprint carries the layer's graph (`jaxpr_graph` of its JVP), so
    ``footprint.evaluate(saved_tags)`` is exact jointly for any subset: the bytes JAX keeps
    (as ``saved_residuals`` reports them, parameters excluded) and the recompute FLOPs (as
    XLA's cost analysis counts them). Per-tag figures (`TagCost`) are each tag alone;
    `Footprint.groups` lists tags that only pay off together (three slices of one fused
    matmul).

    The layer input is the argument matching the output's structure, shapes and dtypes
    (`activation_argnums` overrides); every other argument is a parameter. `tags` restricts
    the footprint to some of the tags (the others are then never saved).
    """
    acts = resolve_activation_argnums(fn, args, kwargs, activation_argnums)
    graph = traced_graph(fn, args, kwargs, acts)
    order: dict[str, list[Value]] = {}
    for v in graph.values.values():
        if v.role is not None:
            order.setdefault(v.role, []).append(v)
    if tags is not None:
        missing = sorted(set(tags) - set(order))
        if missing:
            raise ValueError(f"tags {missing} are not emitted by the function; it emits "
                             f"{list(order)}")
        order = {t: vs for t, vs in order.items() if t in set(tags)}
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
    return Footprint(costs, always_kept_bytes=base_bytes, graph=graph,
                     roles={t: t for t in costs}, forward_flops=float(graph.forward_flops()),
                     no_remat_bytes=graph.no_remat_bytes())
