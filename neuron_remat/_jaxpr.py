"""What JAX says about a function, read from its jaxprs, without building a graph.

Dtypes (`itemsize`, `is_differentiable`: bfloat16 and float8 included); a user's call
bound to positional array pytrees (`bind_call`: keywords at their positions, non-array
leaves static) and its layer input (`activation_argnums`); walking the jaxprs inside an
equation (`_walk`, `_sub_jaxprs`: a scan's body times its length, not a scatter's or a
reduction's per-element function, nor a Pallas kernel's body); the tag an equation applies
(`tag_of`, under either remat implementation); the residuals JAX keeps for the backward
(`residuals`, read from the traced VJP's structure); and FLOPs as XLA's cost analysis
counts them (`eqn_flops`, `jaxpr_cost`, `linearized_cost`). `_trace` builds the layer graph
from these.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as jc

NAME_PRIMITIVE = jc.NAME_PRIMITIVE
is_name_primitive = jc.is_name_primitive


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
    host: bool = False  # offloaded: kept in host memory (a device_put to it), not on device


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


def tag_of(eqn: Any) -> str | None:
    """The ``checkpoint_name`` tag `eqn` applies, or None: JAX's ``name`` primitive, or
    the ``CheckpointName`` primitive JAX's new remat (``jax_remat3``) traces instead."""
    if is_name_primitive(eqn.primitive):
        return str(eqn.params["name"])
    prim = eqn.params.get("_prim") if jc.CHECKPOINT_NAME is not None else None
    if prim is not None and isinstance(prim, jc.CHECKPOINT_NAME):
        return str(prim.name)
    return None


def is_checkpoint_call(eqn: Any) -> bool:
    """Whether `eqn` is a ``jax.checkpoint`` call: JAX's original ``remat2`` equation, or
    the ``RematTraced`` primitive of its new remat (``jax_remat3``)."""
    if str(eqn.primitive) == "remat2":
        return True
    prim = eqn.params.get("_prim") if jc.REMAT_TRACED is not None else None
    return prim is not None and isinstance(prim, jc.REMAT_TRACED)


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
        if prim == "device_put":  # an offloaded residual: the value it moves to the host
            var = eqn.invars[eqn.outvars.index(var)]
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
        host = "host" in str(getattr(aval, "memory_space", "")).lower()
        if kind == "input":
            name = "args" + jax.tree_util.keystr(flat_paths[what][0])
            out.append(Residual("argument", name, shape, dtype, nbytes, argnums[what], host))
        else:
            out.append(Residual(kind, what, shape, dtype, nbytes, host=host))
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
    output elements (nine times that for ``argmax``/``argmin``, whose comparator picks a
    value and an index: XLA's count for float32; int32 and bfloat16 differ by a few per
    step), nothing for data movement or transcendental functions (counted apart), except
    ``logistic``, which XLA expands to negate, exp, add and divide (3 FLOPs), and a gather
    in fill mode (``jnp.take``'s default), whose bounds check and select cost one per
    output element and three per index element (XLA's count for one index component, as
    ``jnp.take`` makes; a few more for several). A convolution counts its multiply-adds
    that read the input (`_conv_flops`), a pooling window its combines, and a primitive
    lowered to a program of its own (`_LOWERED`) XLA:CPU's count of it compiled alone."""
    name = str(eqn.primitive)
    if name in _KERNELS:  # what the kernel's author estimated (CostEstimate.flops), or 0
        return int(getattr(eqn.params.get("cost_estimate"), "flops", 0) or 0)
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = math.prod(lhs[i] for i in lhs_contract)
        return 2 * int(math.prod(eqn.outvars[0].aval.shape)) * int(k)
    if name in ("ragged_dot_general", "ragged_dot"):
        return _ragged_dot_flops(eqn)
    if name == "conv_general_dilated":
        return _conv_flops(eqn)
    if name in _LOWERED:
        counted = _xla_cpu_flops(eqn)
        if counted is not None:
            return counted
    if name in _WINDOW_REDUCE:  # (window - 1) combines per output element
        window = math.prod(eqn.params["window_dimensions"])
        return (window - 1) * int(math.prod(eqn.outvars[0].aval.shape))
    if name == "select_and_scatter_add":  # a max pool's gradient: select, then add
        source = int(math.prod(eqn.invars[0].aval.shape))
        return source * math.prod(eqn.params["window_dimensions"])
    if name == "logistic":
        return 3 * int(math.prod(eqn.outvars[0].aval.shape))
    if name == "gather" and "FILL_OR_DROP" in str(eqn.params.get("mode", "")):
        # jnp.take's default: XLA checks each index against the bounds and selects the
        # fill value, one FLOP per output element and three per index element
        return int(math.prod(eqn.outvars[0].aval.shape)) + 3 * int(
            math.prod(eqn.invars[1].aval.shape))
    if name in _FREE or _folded(eqn, name):
        return 0
    if name in ("argmax", "argmin"):  # a variadic reduce: its comparator is 9 ops a step
        return 9 * (int(math.prod(eqn.invars[0].aval.shape))
                    - int(math.prod(eqn.outvars[0].aval.shape)))
    if name in _REDUCE:
        size = int(math.prod(eqn.invars[0].aval.shape))
        if name.startswith("cum"):
            return size
        return size - int(math.prod(getattr(eqn.outvars[0].aval, "shape", ())))
    if name == "integer_pow":
        y = int(eqn.params.get("y", 2))
        per = max(1, abs(y).bit_length() - 1 + bin(abs(y)).count("1") - 1) + (y < 0)
        return per * int(math.prod(eqn.outvars[0].aval.shape))
    out = eqn.outvars[0].aval if eqn.outvars else None
    return int(math.prod(getattr(out, "shape", ()))) if out is not None else 0


_IDENTITY = {"add": 0, "mul": 1, "and": True, "or": False}
"""Binary operations XLA's algebraic simplifier removes when either operand is this
literal: ``x + 0``, ``x * 1``, ``x & True``, ``x | False`` (measured on XLA:CPU with JAX
0.7.2, 0.8.3, 0.10.2, 0.11.1 and 0.12; ``x / 1`` is kept by all, ``x - 0`` by 0.7.2's, so
neither is here)."""


def _folded(eqn: Any, name: str) -> bool:
    """Whether XLA does no arithmetic for `eqn`: every operand a literal (constant
    folding: MaxText converts a Python scalar to bfloat16), or an identity with a literal
    (`_IDENTITY`: MaxText's causal mask adds an offset of 0 to an iota, its norms add 0.0
    to a scale) whose other operand already has the output's shape and dtype, or a
    conversion to the dtype it has (a weak-type change: no instruction)."""
    ins = eqn.invars
    if ins and all(isinstance(v, jc.Literal) for v in ins):
        return True
    if name == "convert_element_type":
        return ins[0].aval.dtype == eqn.outvars[0].aval.dtype
    ident = _IDENTITY.get(name)
    if ident is None or len(ins) != 2:
        return False
    out = eqn.outvars[0].aval
    if name in ("and", "or") and out.dtype != np.bool_:  # bitwise on integers
        return False
    for i in (0, 1):
        lit, other = ins[i], ins[1 - i]
        if (isinstance(lit, jc.Literal) and np.size(lit.val) == 1
                and not isinstance(other, jc.Literal)
                and np.asarray(lit.val).item() == ident
                and other.aval.shape == out.shape and other.aval.dtype == out.dtype):
            return True
    return False


_WINDOW_REDUCE = {"reduce_window_sum", "reduce_window_max", "reduce_window_min"}

_LOWERED = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "erfc", "erf_inv",
            "lgamma", "digamma", "sort", "top_k", "fft"}
"""Primitives with no one HLO op of their own: JAX or XLA lowers each to a program whose
work depends on the backend's lowering and the shape (a cumulative sum to an associative
scan on the CPU and GPU, ``erfc`` to a polynomial, a sort to a comparison network), so the
trace counts what XLA:CPU's cost analysis counts for the equation compiled alone."""


def _xla_cpu_flops(eqn: Any) -> int | None:
    """XLA:CPU's FLOPs for `eqn` compiled alone (cached by primitive, parameters and
    operand types; 0 for a custom call XLA does not count, as ``top_k``'s), or None where
    that cannot be had (no CPU backend in this process, any error): the caller then counts
    one FLOP an output element."""
    try:
        key = (str(eqn.primitive), repr(sorted(eqn.params.items())),
               tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars))
    except AttributeError:
        return None
    if key not in _XLA_CPU_FLOPS:
        _XLA_CPU_FLOPS[key] = _compile_alone(eqn)
    return _XLA_CPU_FLOPS[key]


_XLA_CPU_FLOPS: dict[tuple[Any, ...], int | None] = {}


def _compile_alone(eqn: Any) -> int | None:
    """`eqn` alone, jitted on this process's CPU backend at its operand types: XLA's
    FLOPs, or None on any failure."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
        args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        with jax.default_device(cpu):
            compiled = jax.jit(lambda *a: eqn.primitive.bind(*a, **eqn.params)).lower(
                *args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float((cost or {}).get("flops", 0.0))
    except Exception:  # noqa: BLE001 -- any failure: the caller's closed-form count
        return None
    return max(int(flops), 0)  # a custom call XLA does not count (TopK) reports -1


def _taps(size_in: int, size_out: int, kernel: int, stride: int, pad_low: int,
          lhs_dilation: int, rhs_dilation: int) -> int:
    """Along one spatial dimension of a convolution, the (output, kernel tap) pairs that
    read a real input element: not padding, not a hole of the input's dilation (what
    XLA's cost analysis counts; a SAME convolution's border reads padding)."""
    out = np.arange(size_out)
    total = 0
    for k in range(kernel):
        at = out * stride - pad_low + k * rhs_dilation  # in the dilated, padded input
        real = (at >= 0) & (at % lhs_dilation == 0) & (at // lhs_dilation < size_in)
        total += int(np.count_nonzero(real))
    return total


def _conv_flops(eqn: Any) -> int:
    """2 x the multiply-adds of a ``conv_general_dilated`` that read real input: per
    output feature, each input feature of its group, each batch row of its batch group,
    and each (output position, kernel tap) pair that lands on the input (`_taps`, per
    spatial dimension). Its transposes in a backward pass (the input's gradient, with the
    input dilated by the stride; the kernel's, grouped over the batch) count the same."""
    p = eqn.params
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    n = len(lhs_spec) - 2
    lhs_dil = p.get("lhs_dilation") or (1,) * n
    rhs_dil = p.get("rhs_dilation") or (1,) * n
    taps = 1
    for i in range(n):
        taps *= _taps(lhs[lhs_spec[2 + i]], out[out_spec[2 + i]], rhs[rhs_spec[2 + i]],
                      p["window_strides"][i], p["padding"][i][0], lhs_dil[i], rhs_dil[i])
    fma = (lhs[lhs_spec[1]] // p["feature_group_count"]) * out[out_spec[1]] * (
        lhs[lhs_spec[0]] // p["batch_group_count"]) * taps
    return 2 * int(fma)


def _ragged_dot_flops(eqn: Any) -> int:
    """A ragged dot's work: each element of the left operand meets one group's right
    operand (its rows are split among the groups), so 2 x the left operand's elements x
    the right operand's free dimensions (neither contracted, batch nor group), whichever
    of its three forms (``jax.lax.ragged_dot``'s forward, and its two transposes). That is
    what a grouped-matmul kernel does (MaxText's megablox, a Neuron kernel), where the
    group sizes add up to the ragged dimension; rows left out of every group (padding, a
    capacity limit, local groups) are counted too, so it is an upper bound. XLA:CPU
    instead expands the op into a dense dot per group under masks, and its cost analysis
    counts that: the number of groups times this, and a select per element more."""
    dims = eqn.params.get("ragged_dot_dimension_numbers")
    rhs = eqn.invars[1].aval.shape
    if dims is None:  # the older primitive has one form: [m, k] x [groups, k, n]
        return 2 * int(math.prod(eqn.invars[0].aval.shape)) * int(rhs[-1])
    (_, rhs_contract), (_, rhs_batch) = dims.dot_dimension_numbers
    skip = {*rhs_contract, *rhs_batch, *dims.rhs_group_dimensions}
    free = math.prod(d for i, d in enumerate(rhs) if i not in skip)
    return 2 * int(math.prod(eqn.invars[0].aval.shape)) * int(free)


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


class AmbiguousInputError(ValueError):
    """Several arguments match the layer's output: which is the layer input is the
    caller's to say (``activation_argnums``)."""


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
    raise AmbiguousInputError(
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
