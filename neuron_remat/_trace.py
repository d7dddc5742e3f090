"""What JAX itself says about a function: the tags it emits, the residuals a policy keeps,
and the work its linearized (backward) program does; `traced_footprint` measures a layer's
per-tag figures from them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax._src import ad_checkpoint as _jax_remat
from jax._src.ad_checkpoint import name_p, save_only_these_names
from jax.extend import core as jcore

from .graph import Footprint, TagCost

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
    params = dict(eqn.params)
    hi = params.pop("_prim", None)  # a jax_remat3 primitive keeps its jaxpr in its params
    params.update(getattr(hi, "params", None) or {})
    for value in params.values():
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
        name = tag_of(eqn)
        if name is None:
            continue
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


_CHECKPOINT_NAME = getattr(_jax_remat, "CheckpointName", None)  # jax_remat3's tag (JAX >= 0.10)


def tag_of(eqn: Any) -> str | None:
    """The ``checkpoint_name`` tag `eqn` applies, or None: JAX's ``name`` primitive, or
    the ``CheckpointName`` primitive JAX's new remat (``jax_remat3``) traces instead."""
    if is_name_primitive(eqn.primitive):
        return str(eqn.params["name"])
    prim = eqn.params.get("_prim") if _CHECKPOINT_NAME is not None else None
    if prim is not None and isinstance(prim, _CHECKPOINT_NAME):
        return str(prim.name)
    return None


def _inner_jaxpr(eqn: Any) -> Any:
    """The jaxpr of a call-like equation (jit, closed_call, ...) whose outputs are its
    inner jaxpr's outputs one to one, or None."""
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if isinstance(inner, jcore.ClosedJaxpr):
        inner = inner.jaxpr
    if isinstance(inner, jcore.Jaxpr) and len(inner.outvars) == len(eqn.outvars):
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
        if isinstance(var, jcore.Literal):
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
    0.7 and 0.8 call a saved tag "output of reduce_precision"). Arguments carry the index
    of the positional argument they are a leaf of, and their key path as name."""
    kwargs = kwargs or {}
    flat_paths, tree = jax.tree_util.tree_flatten_with_path(tuple(args))
    leaves = [leaf for _, leaf in flat_paths]
    argnums = leaf_argnums(args)

    def flat(*leaves: Any) -> Any:
        return fn(*jax.tree.unflatten(tree, leaves), **kwargs)

    closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(flat, *a), return_shape=True)(*leaves)
    jaxpr = closed.jaxpr
    n_res = len(jax.tree.leaves(shapes[1]))
    out, seen = [], set()
    for var in jaxpr.outvars[len(jaxpr.outvars) - n_res:]:
        if not isinstance(var, jcore.Literal):
            if var in seen:
                continue  # one buffer, listed once (as JAX lists it)
            seen.add(var)
        aval = var.aval
        shape, dtype, nbytes = tuple(aval.shape), str(np.dtype(aval.dtype)), _aval_bytes(aval)
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
}
_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
           "reduce_and", "reduce_or", "cumsum", "cummax", "cumlogsumexp"}


def eqn_flops(eqn: Any) -> int:
    name = str(eqn.primitive)
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = math.prod(lhs[i] for i in lhs_contract)
        return 2 * int(math.prod(eqn.outvars[0].aval.shape)) * int(k)
    if name in _FREE:
        return 0
    if name in _REDUCE:
        return int(math.prod(eqn.invars[0].aval.shape))
    if name == "integer_pow":
        y = abs(int(eqn.params.get("y", 2)))
        per = max(1, y.bit_length() - 1 + bin(y).count("1") - 1)
        return per * int(math.prod(eqn.outvars[0].aval.shape))
    out = eqn.outvars[0].aval if eqn.outvars else None
    return int(math.prod(getattr(out, "shape", ()))) if out is not None else 0


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


def traced_footprint(fn: Callable[..., Any], *args: Any,
                     activation_argnums: Sequence[int] = (0,),
                     tags: Sequence[str] | None = None, **kwargs: Any) -> Footprint:
    """Per-tag bytes and recompute FLOPs measured from `fn` itself.

    For each tag `fn` emits: the bytes JAX keeps when only that tag is saved, beyond what
    full remat keeps (from ``jax._src.ad_checkpoint.saved_residuals``), and the FLOPs of
    the recomputation it avoids (from the linearized program). Arguments in
    `activation_argnums` count as the layer's always-kept input; the others are parameters
    (model state, not activations).
    """
    only = tags
    acts = set(activation_argnums)
    bad = [i for i in acts if not 0 <= i < len(args)]
    if bad:
        raise ValueError(f"activation_argnums {bad} out of range for {len(args)} arguments")

    def kept(policy_names: frozenset[str]) -> tuple[int, dict[str, int]]:
        res = residuals(checkpointed(fn, save_only_these_names(*policy_names)), args, kwargs)
        by_tag: dict[str, int] = {}
        activation = 0
        for r in res:
            if r.kind == "tag":
                by_tag[r.name] = by_tag.get(r.name, 0) + r.bytes
                activation += r.bytes
            elif r.kind == "argument":
                if r.argnum is None or r.argnum in acts:  # unknown: count it, to be safe
                    activation += r.bytes
            else:
                activation += r.bytes
        return activation, by_tag

    def cost(policy_names: frozenset[str]) -> int:
        policy = save_only_these_names(*policy_names)
        return linearized_cost(checkpointed(fn, policy), args, kwargs).flops

    infos = emitted_tags(fn, args, kwargs)
    if only is not None:
        missing = sorted(set(only) - {i.name for i in infos})
        if missing:
            raise ValueError(f"tags {missing} are not emitted by the function; it emits "
                             f"{[i.name for i in infos]}")
        infos = [i for i in infos if i.name in set(only)]
    base_bytes, _ = kept(frozenset())
    base_flops = cost(frozenset())
    # What full remat recomputes beyond no remat, untagged work (norms, softmax,
    # activations) included: no save set avoids that part.
    full_recompute = float(max(base_flops - linearized_cost(fn, args, kwargs).flops, 0))
    forward = jaxpr_cost(_closed(fn, args, kwargs).jaxpr).flops
    costs: dict[str, Any] = {}
    for info in infos:
        one = frozenset([info.name])
        b, by_tag = kept(one)
        flops = base_flops - cost(one)
        extra = b - base_bytes
        always = info.name in by_tag and extra <= 0
        note = ""
        if always:
            note = "an input of the function: kept whatever the policy says"
        elif extra <= 0:
            note = "the backward never reads it: saving it keeps nothing"
        costs[info.name] = TagCost(
            bytes=info.bytes * info.count if always else max(extra, 0),
            recompute_flops=float(max(flops, 0)), always_kept=always,
            size_bytes=info.bytes * info.count, shape=info.shape, dtype=info.dtype, note=note)
    return Footprint(costs, always_kept_bytes=base_bytes, full_recompute_flops=full_recompute,
                     forward_flops=float(forward))
