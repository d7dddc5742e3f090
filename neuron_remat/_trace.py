"""The jaxpr builder of the layer graph: `jaxpr_graph` makes one exact `LayerGraph` of a
jaxpr split into known (primal) and unknown (tangent) values, and `traced_footprint`
measures a layer's per-tag figures from its JVP's graph. What it reads of JAX (dtypes, a
bound call, tags, FLOPs per equation) comes from `_jaxpr`.

The traced graph follows every primitive that holds a jaxpr, as JAX's remat partial
evaluation does: calls (``jit``, ``closed_call``, custom JVP/VJP calls, nested
checkpoints) are inlined; ``shard_map`` bodies are inlined at their per-shard shapes (bytes
per shard are bytes per core); a custom VJP's residuals are what its forward returns (its
``custom_lin`` reads them); ``scan`` bodies are inlined with their values stacked over the
scan's length and their work times it, work that does not vary over the loop once (JAX
hoists it), and each primal carry as a step of no work from its initial value and the
body's carry out (a cycle: recomputing the carry chain walks the body once, as JAX's staged
scan does, whether or not the layer's inputs or weights feed the differentiated carry: an
RNN, a linear recurrence, an accumulator); a ``cond`` counts its costliest branch (named in
`Footprint.notes`); a ``while`` whose trip count JAX cannot know is one opaque op counting
one iteration (named), and so is a Pallas kernel (``pallas_call``: its cost estimate's
FLOPs; named). A scatter's update function and a reduction's are part of that op. Any
other primitive holding a jaxpr is an error naming it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _jax_compat as jc
from ._jaxpr import (_KERNELS, Call, TagInfo, _aval_bytes, _dtype_name, _jvp_jaxpr, _sub_jaxprs,
                     _walk, bind_call, eqn_flops, itemsize, resolve_activation_argnums, tag_of)
from .graph import Footprint, LayerGraph, Op, TagCost, Value

logger = logging.getLogger(__name__)


class UnsupportedPrimitiveError(ValueError):
    """The traced program holds a jaxpr inside a primitive the graph builder does not know."""


@dataclass(frozen=True)
class _ScanValue(Value):
    """A value computed inside a scan body, stacked over its length. Saved, it is a
    residual the scan returns (JAX's ``_scan_partial_eval_custom``): no equation of the
    forward reads it, so JAX's remat puts no ``reduce_precision`` on it (it rounds only
    residuals the forward also uses), and saving it costs no rounding FLOPs."""

    @property
    def rounding_flops(self) -> int:
        return 0


def emitted_tags(fn: Callable[..., Any], args: Sequence[Any],
                 kwargs: dict[str, Any] | None = None) -> list[TagInfo]:
    """Every tag `fn` emits when differentiated, in program order, merged by name: those
    in scan bodies (counted per iteration, but once on work that does not vary over the
    loop, which JAX hoists), custom VJP forwards and shard_map bodies (at per-shard shapes)
    too."""
    return list(emitted_build(fn, args, kwargs).tags.values())


def emitted_build(fn: Callable[..., Any], args: Sequence[Any],
                  kwargs: dict[str, Any] | None = None) -> Built:
    """`emitted_tags`'s build of `fn`'s JVP: its tags, and its notes (a shard_map's values
    count per shard, which cond branch is counted, ...)."""
    call = bind_call(fn, args, kwargs)
    closed, diff, _ = _jvp_jaxpr(call)
    n, m = len(diff), sum(diff)
    return _build(closed, [False] * n + [True] * m, None)


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
# Calls whose known operands JAX < 0.9 copies into residuals of their own
# (`jc.JIT_COPIES_OPERAND_RESIDUALS`), and calls JAX's remat recomputes whole (they have no
# partial evaluation rule: nothing inside them is split, so no copy is made there).
_JITS = {"pjit", "jit"}
_REMATS = {"checkpoint", "remat2", "remat"}
_WHOLE = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}


@dataclass(frozen=True)
class _Scope:
    """Where `_build` expands equations: inside scans of lengths `lead` (outermost first;
    empty at the top), with `over` the values a scan slices per iteration (its ``xs``),
    which vary over that scan though computed outside it: name -> scan depth."""

    lead: tuple[int, ...] = ()
    over: Mapping[str, int] = field(default_factory=dict)
    shards: int = 1  # devices a value here is spread over (`_build`'s `shards`; 1 in a shard_map)


def _per_core(flops: int, shards: int) -> int:
    """An op's FLOPs on one of the `shards` devices a partitioned program spreads it over."""
    return flops if shards == 1 else -(-flops // shards)


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
    per_shard: bool = False  # a shard_map was inlined: its values are at per-shard shapes


def jaxpr_graph(jaxpr: Any, *, unknown: Sequence[bool],
                activation: Sequence[bool] | None = None, shards: int = 1,
                nested: bool = False) -> LayerGraph:
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
    stacked over the length (a leading dimension) and each op's FLOPs times it (but for
    work that does not vary over the loop, which JAX hoists; a saved value of the body is
    a residual the scan returns, which JAX does not round), each carry the previous
    iteration's carry out (the tangent's too, for what the backward reads), a ``cond``'s
    costliest branch inlined, a ``while`` one opaque op counting one iteration, a
    ``pallas_call`` kernel one opaque op of its cost estimate's FLOPs, and
    ``optimization_barrier`` the identity; a scatter's or a reduction's per-element function
    is part of that op. Any other primitive holding a jaxpr raises
    `UnsupportedPrimitiveError`.

    `shards`: the devices a program the compiler partitions spreads its values over (a
    jit over several devices, whose jaxpr has global shapes): each value outside a
    ``shard_map`` body counts 1/`shards` of its bytes and each op 1/`shards` of its
    FLOPs, per core (`Value.shards`).

    `nested`: `jaxpr` is a layer's transposed remat body, in which a checkpoint inside the
    layer is a remat of its own that recomputes its part of the layer again: a value it
    recomputes by the same equation on the same inputs as the layer's recomputation is the
    same residual to JAX (`Value.same_as`).
    """
    return _build(jaxpr, unknown, activation, shards=shards, nested=nested).graph


def _build(jaxpr: Any, unknown: Sequence[bool],
           activation: Sequence[bool] | None, remat3: bool = False,
           jit_copies: bool = False, shards: int = 1, nested: bool = False) -> Built:
    """`jaxpr_graph`'s build. `remat3`: model ``jax_remat3``'s remat, which hoists nothing
    out of a scan and rounds every residual, a scan's too (`_ScanValue`, `level`).
    `jit_copies`: `jaxpr` is a JVP that JAX's remat has yet to split (not a remat body it
    already split), so on JAX < 0.9 a jit's operands are copied (`jit_operand`)."""
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
    per_shard = [False]
    counter = [0]
    whole = [0]  # depth inside calls JAX's remat recomputes whole (`_WHOLE`)
    jit_copies = jit_copies and jc.JIT_COPIES_OPERAND_RESIDUALS
    depth: dict[str, int] = {}  # a value's scan depth: how many scans' lengths stack it
    # `nested`: each known equation's outputs by (equation, its inputs as first computed),
    # and a value recomputed inside an inner transposed remat -> the first one
    computed: dict[tuple[Any, ...], list[str]] | None = {} if nested and any(
        str(e.primitive) in _REMATS for e, _ in _walk(jaxpr)) else None
    first: dict[str, str] = {}
    tagged_from: dict[str, str] = {}  # a tag's value -> the value it names
    inner = [0]  # depth inside inner transposed remats

    def fresh(aval: Any, lead: tuple[int, ...], prefix: str = "v", role: str | None = None,
              eqn: Any = None, in_scan: bool | None = None, spread: int = shards) -> str:
        name = f"{prefix}{counter[0]}"
        counter[0] += 1
        depth[name] = len(lead)
        dot = batch = False
        if eqn is not None and str(eqn.primitive) == "dot_general":
            dot = True
            (_, _), (lb, _) = eqn.params["dimension_numbers"]
            batch = bool(lb)
        dtype = getattr(aval, "dtype", None)
        kind = (_ScanValue if (bool(lead) if in_scan is None else in_scan) and not remat3
                else Value)
        values[name] = kind(name, (*lead, *getattr(aval, "shape", ())), _dtype_name(dtype),
                            role, dot=dot, batch_dot=batch, itemsize=itemsize(dtype) or 1,
                            shards=spread)
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

    def level(ins: Sequence[str | None], scope: _Scope) -> int:
        """How many of the enclosing scans an equation reading `ins` varies over: the
        deepest of its inputs. JAX hoists work that does not vary over a scan out of its
        loop (``_scan_partial_eval``): it runs once, and a residual of it is one value,
        not one per iteration."""
        if remat3:  # its scan rule stacks and recomputes the whole body per iteration
            return len(scope.lead)
        got = [scope.over.get(n, depth.get(n, 0)) for n in ins if n is not None]
        return min(max(got, default=0), len(scope.lead))

    def plain(eqn: Any, ins: list[str | None], env: dict[Any, str | None],
              scope: _Scope, flops: int, label: str | None = None) -> None:
        prim = str(eqn.primitive)
        lead = scope.lead[:level(ins, scope)]
        tag = tag_of(eqn)
        present = [n for n in ins if n is not None]
        is_unknown = any(n in unk for n in present)
        if tag is not None:
            if is_unknown:
                hidden.setdefault(tag, "applied to a value computed from tangents only")
            else:
                note_tag(tag, eqn, lead)
                hidden.pop(tag, None)
        outs = [fresh(ov.aval, lead, role=tag, eqn=eqn, in_scan=bool(scope.lead),
                      spread=scope.shards) for ov in eqn.outvars]
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
                          outs[0], _per_core(flops * math.prod(lead), scope.shards),
                          more_outputs=tuple(outs[1:])))
            if computed is not None:
                same(eqn, ins, outs, lead)

    def canon(n: str) -> str:
        """`n` followed back through `same`'s earlier copies and through tags (a tag is the
        identity)."""
        while n in first or n in tagged_from:
            n = first[n] if n in first else tagged_from[n]
        return n

    def same(eqn: Any, ins: list[str | None], outs: list[str], lead: tuple[int, ...]) -> None:
        """`nested`: mark `outs` the same as an earlier equation's, where inside an inner
        transposed remat the same equation reads the same values (`Value.same_as`)."""
        assert computed is not None
        try:
            # a literal by its value; a constant a call's literal operand became, by type
            key = (str(eqn.primitive), repr(sorted(eqn.params.items())), lead,
                   tuple(canon(n) if n is not None else
                         repr(a) if isinstance(a, jc.Literal) else f"const:{a.aval}"
                         for n, a in zip(ins, eqn.invars)))
        except Exception:  # noqa: BLE001  parameters without a stable repr: never merged
            return
        if tag_of(eqn) is not None and ins and ins[0] is not None:
            tagged_from[outs[0]] = canon(ins[0])
        earlier = computed.get(key)
        if earlier is None:
            computed[key] = outs
            return
        if not inner[0] or len(earlier) != len(outs):
            return
        for new, old in zip(outs, earlier):
            first[new] = old
            v, w = values[new], values.get(old)
            if w is not None and v.role is not None and v.role == w.role:
                values[new] = dataclasses.replace(v, same_as=old)

    def jit_operand(name: str | None) -> str | None:
        """JAX < 0.9: a known value entering a jit, where the jit's backward reads it, is
        also the jit's own residual. Inside, a copy stands for it (0 FLOPs, the same tag):
        kept when the policy saves the value, else recomputed from it."""
        if name is None or name in unk or name in inputs or name in params:
            return name
        copy = f"jitcopy{counter[0]}"
        counter[0] += 1
        depth[copy] = depth.get(name, 0)
        values[copy] = dataclasses.replace(values[name], name=copy, copy_of=name)
        ops.append(Op(f"jit_operand:{len(ops)}", (name,), copy, 0))
        return copy

    def inline(sub: Any, ins: list[str | None], scope: _Scope) -> list[str | None]:
        subenv: dict[Any, str | None] = {cv: const(cv.aval) for cv in sub.constvars}
        subenv.update(zip(sub.invars, ins))
        expand(sub, subenv, scope)
        return [read(subenv, o) for o in sub.outvars]

    def scan(eqn: Any, ins: list[str | None], env: dict[Any, str | None],
             scope: _Scope) -> None:
        closed = eqn.params["jaxpr"]
        body = closed.jaxpr if isinstance(closed, jc.ClosedJaxpr) else closed
        nc, nk = jc.scan_counts(eqn.params)
        length = int(eqn.params["length"])
        inner_lead = (*scope.lead[:level(ins, scope)], length)
        is_unk = [n is not None and n in unk for n in ins]
        carry_unk = is_unk[nc:nc + nk]
        while True:  # a carry is unknown when its update is (JAX's fixpoint)
            outs = _unknown_outs(body, [*is_unk[:nc], *carry_unk, *is_unk[nc + nk:]])
            new = [a or b for a, b in zip(carry_unk, outs[:nk])]
            if new == carry_unk:
                break
            carry_unk = new
        # A known carry is not stacked: JAX's staged scan carries it again, from its initial
        # value, so each iteration's carry in is the previous iteration's carry out (the
        # value the body returns), a step of no work. The op making the stacked carry in
        # reads the initial carry and the stacked carry out, which the inlined body computes
        # from the carry in: a cycle, which recomputing walks once, so the update's ops are
        # recomputed once at their work times the length (as the staged scan does), and not
        # at all when the carry out is a saved name (a residual, stacked).
        body_ins: list[str | None] = list(ins[:nc])
        known: list[tuple[int, str, str | None]] = []  # (carry index, carry in, initial)
        for i, (v, u, init) in enumerate(zip(body.invars[nc:nc + nk], carry_unk,
                                             ins[nc:nc + nk])):
            if u:
                name = f"dc{counter[0]}"
                counter[0] += 1
                unk.add(name)
                if init is not None and init in unk:  # the tangent carry starts from it
                    staged.append(([init], [], [name]))
            else:
                name = fresh(v.aval, inner_lead, "carry", spread=scope.shards)
                known.append((i, name, init))
            body_ins.append(name)
        body_ins.extend(ins[nc + nk:])
        over = {**scope.over, **{n: len(inner_lead) for n in ins[nc + nk:] if n is not None}}
        outs_named = inline(body, body_ins, _Scope(inner_lead, over, scope.shards))
        for v, name, out in zip(carry_unk, body_ins[nc:nc + nk], outs_named[:nk]):
            if v and out is not None and out in unk:  # the next iteration's tangent carry
                staged.append(([out], [], [name]))
        for i, name, init in known:
            srcs = tuple(n for n in (init, outs_named[i]) if n is not None and n != name)
            ops.append(Op(f"scan_carry:{len(ops)}", tuple(dict.fromkeys(srcs)), name, 0))
        env.update(zip(eqn.outvars, outs_named))

    def cond(eqn: Any, ins: list[str | None], env: dict[Any, str | None],
             scope: _Scope) -> None:
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
        expand(b.jaxpr, subenv, scope)
        env.update(zip(eqn.outvars, (read(subenv, o) for o in b.jaxpr.outvars)))

    def while_loop(eqn: Any, ins: list[str | None], env: dict[Any, str | None],
                   scope: _Scope) -> None:
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
        plain(eqn, ins, env, scope, _body_flops(body.jaxpr) + _body_flops(cond_j.jaxpr),
              "while(trip count unknown, one iteration counted)")

    def expand(jx: Any, env: dict[Any, str | None], scope: _Scope) -> None:
        for eqn in jx.eqns:
            ins = [read(env, a) for a in eqn.invars]
            prim = str(eqn.primitive)
            if tag_of(eqn) is not None:
                plain(eqn, ins, env, scope, eqn_flops(eqn))
            elif prim in _CALLS and _inner(eqn) is not None:
                sub, _ = _inner(eqn)  # type: ignore[misc]
                if len(sub.invars) != len(ins) or len(sub.outvars) != len(eqn.outvars):
                    raise UnsupportedPrimitiveError(
                        f"cannot follow {prim}: its jaxpr takes {len(sub.invars)} inputs "
                        f"for {len(ins)} operands")
                if prim == "shard_map":
                    per_shard[0] = True
                    mesh = eqn.params.get("mesh")
                    shape = dict(getattr(mesh, "shape", {}) or {})
                    note = (f"a shard_map over mesh {shape}: its values count per shard "
                            "(per core)")
                    if note not in notes:
                        notes.append(note)
                if prim in _JITS and jit_copies and not whole[0]:
                    ins = [jit_operand(n) for n in ins]
                whole[0] += prim in _WHOLE
                again = (computed is not None and prim in _REMATS
                         and any(n is not None and n in unk for n in ins))
                inner[0] += again
                in_scope = dataclasses.replace(scope, shards=1) if prim == "shard_map" \
                    else scope
                env.update(zip(eqn.outvars, inline(sub, ins, in_scope)))
                inner[0] -= again
                whole[0] -= prim in _WHOLE
            elif prim == "scan":
                scan(eqn, ins, env, scope)
            elif prim == "cond":
                cond(eqn, ins, env, scope)
            elif prim == "while":
                while_loop(eqn, ins, env, scope)
            elif prim == "optimization_barrier":
                env.update(zip(eqn.outvars, ins))
            elif prim in _KERNELS:
                note = (f"a {prim} kernel: one opaque op, its FLOPs its cost estimate's (0 "
                        "where it gives none)")
                if note not in notes:
                    notes.append(note)
                plain(eqn, ins, env, scope, eqn_flops(eqn))
            elif any(True for _ in _sub_jaxprs(eqn)):
                raise UnsupportedPrimitiveError(
                    f"the traced program holds a jaxpr inside a {prim!r} equation, which "
                    "neuron_remat does not know how to follow; its tags and residuals "
                    "would be missed. Please report it (primitives followed: "
                    f"{sorted(_CALLS | _LOOPS)})")
            else:
                plain(eqn, ins, env, scope, eqn_flops(eqn))

    env: dict[Any, str | None] = {cv: const(cv.aval) for cv in jaxpr.constvars}
    for i, (v, u, a) in enumerate(zip(jaxpr.invars, unknown, acts)):
        if u:
            name = f"d{i}"
            unk.add(name)
        else:
            name = fresh(v.aval, (), "in")
            (inputs if a else params).append(name)
        env[v] = name
    expand(jaxpr, env, _Scope(shards=shards))

    live = {n for n in (read(env, o) for o in jaxpr.outvars) if n is not None and n in unk}
    reads: list[str] = []
    while True:  # again while a scan's tangent carry makes more live (its cycle)
        before = len(live)
        reads = []
        for u_in, k_in, outs in reversed(staged):
            if live.intersection(outs):
                live.update(u_in)
                reads.extend(reversed(k_in))
        if len(live) == before:
            break
    reads = list(dict.fromkeys(reversed(reads)))
    outs = [n for n in (read(env, o) for o in jaxpr.outvars) if n is not None and n not in unk]
    outs = list(dict.fromkeys(outs))
    for t in tags:
        hidden.pop(t, None)
    graph = LayerGraph(values=values, ops=tuple(ops), inputs=tuple(inputs),
                       params=tuple(params), reads=tuple(reads), outputs=tuple(outs),
                       round_saved=True)
    return Built(graph, tags, hidden, notes, per_shard[0])


def _traced(call: Call, acts: Sequence[int]) -> Built:
    closed, diff, nums = _jvp_jaxpr(call)
    n, m = len(diff), sum(diff)
    chosen = set(acts)
    return _build(closed, [False] * n + [True] * m,
                  [nums[i] in chosen for i in range(n)] + [False] * m,
                  remat3=jc.remat3_on(), jit_copies=True)


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
    scan's body times its length, its work that does not vary over the loop once; with
    ``jax_remat3`` on when this is called, as JAX's new remat runs: nothing hoisted out of
    a scan, every residual rounded). Per-tag figures (`TagCost`) are each tag alone;
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
        if v.role is not None and v.copy_of is None:
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
