"""The one graph type the planner evaluates: a layer's dataflow on one core.

A `LayerGraph` holds the values of one layer (tensors, per core), the ops that produce them
with their FLOPs, and what each op's backward reads. For any choice of saved tags it answers
what JAX's ``jax.checkpoint`` does: a value the backward reads is kept when it is a layer
input or a saved tag, otherwise it is recomputed from its inputs, which are then read in
turn. Two builders make these graphs: the analytic one (`_analytic.layer_graph`, behind
`memory_model.layer_graph`) and the jaxpr one (`_trace`). A `Footprint` is the per-tag
view of a graph (or of measured figures) that the planner searches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from .models import dtype_bytes

__all__ = ["OP_KINDS", "Closures", "Evaluation", "Footprint", "LayerGraph", "Op", "Segment",
           "TagCost", "TagGroup", "Value", "find_groups", "op_bytes_moved", "op_kind",
           "op_seconds", "timed_graph"]


@dataclass(frozen=True)
class Value:
    """One tensor of the layer, per core."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str | None = None  # the tag role, when the host tags it
    dot: bool = False  # produced by a dot_general (what dots_saveable keeps)
    batch_dot: bool = False  # ... with batch dimensions (dots_with_no_batch_dims skips it)
    extra_bytes: int = 0  # stored with it under the same tag (flash attention's lse)
    itemsize: int = 0  # bytes per element when `dtype` is not a float type `models` knows
    # The value a jit's own residual copies (JAX < 0.9, `_trace`): saved when it is; its
    # rounding is the value's (one reduce_precision, counted once however many of the two
    # are kept), and without remat the value itself is kept.
    copy_of: str | None = None
    # The value a checkpoint inside a checkpointed layer recomputes again (`_trace`): the same
    # computation on the same inputs as this one of the layer's own recomputation. JAX keeps
    # one residual for both, so kept together they count once (bytes and rounding); each is
    # still recomputed where it is read.
    same_as: str | None = None
    # How many devices `shape` is spread over: a value of a program the compiler partitions
    # (a jit over several devices) has its global shape here, and a core holds 1/shards of
    # it (`_trace`: the step's devices; 1 inside a shard_map, whose shapes are per shard).
    shards: int = 1

    @property
    def bytes(self) -> int:
        return self._per_core(math.prod(self.shape) * (self.itemsize or dtype_bytes(self.dtype)))

    def bytes_as(self, itemsizes: Mapping[str, int]) -> int:
        """`bytes` with ``itemsizes[dtype]`` bytes per element where given (what a backend
        stores: `_step.STORED_ITEMSIZE`)."""
        size = itemsizes.get(self.dtype)
        return self.bytes if size is None else self._per_core(math.prod(self.shape) * size)

    def _per_core(self, nbytes: int) -> int:
        return -(-nbytes // self.shards) + self.extra_bytes

    @property
    def rounding_flops(self) -> int:
        """XLA's count for a ``reduce_precision`` of it (floating dtypes only)."""
        n = math.prod(self.shape) if self.dtype.startswith(("float", "bfloat")) else 0
        return -(-n // self.shards)


@dataclass(frozen=True)
class Op:
    """One step of the layer's forward.

    `needs` are the values its backward reads. `internal` are unnamed intermediate values
    its backward also reads: they are never tagged, so whenever the op is differentiated
    under ``jax.checkpoint`` it is recomputed; without remat they are kept.
    """

    name: str
    inputs: tuple[str, ...]
    output: str
    flops: int
    needs: tuple[str, ...] = ()
    internal: tuple[tuple[str, int], ...] = ()  # (what, bytes) kept without remat
    more_outputs: tuple[str, ...] = ()  # further results of a multi-output op
    kind: str = ""  # one of `OP_KINDS`; "" lets `op_kind` infer it
    # FLOPs by engine kind for a fused op that uses several engines at once (flash
    # attention: matmuls and an exp per score); empty: all `flops` are of `kind`.
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output, *self.more_outputs)


@dataclass(frozen=True)
class Evaluation:
    """What one policy keeps and recomputes for one layer on one core."""

    kept_bytes: int
    recompute_flops: int
    kept: tuple[str, ...]
    recomputed: tuple[str, ...]


@dataclass(frozen=True)
class LayerGraph:
    """The dataflow graph of one layer on one core (see the module docstring).

    `inputs` are kept whenever the backward reads them and count their bytes (the layer
    input, the scan carry); `params` are kept too but count nothing (parameters and
    constants: model state, not activations). `reads` are values the backward reads beyond
    the ops' `needs` (a traced graph lists everything its backward reads here).

    `outputs` are the layer's primal results (the jaxpr builder records them). When given,
    recompute FLOPs are step FLOPs under the policy minus step FLOPs without remat, as a
    compiled step counts them: work that only the backward reads (a JVP's side values, such
    as the mask of a max) is done in the forward without remat but moves into the backward
    under remat, so it is not extra work. Without `outputs` (the analytic graph, whose every
    op leads to the output) that term is empty.

    `round_saved`: JAX's remat rounds every saved intermediate (not inputs) of a float
    dtype with a ``reduce_precision`` (jax PR 22244), one FLOP per element in XLA's count;
    recompute FLOPs then include it. The jaxpr builder sets it.
    """

    values: Mapping[str, Value]
    ops: tuple[Op, ...]
    inputs: tuple[str, ...] = ("x",)
    params: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    round_saved: bool = False

    @functools.cached_property
    def _producers(self) -> dict[str, Op]:
        return {out: op for op in self.ops for out in op.outputs}

    @functools.cached_property
    def _by_name(self) -> dict[str, Op]:
        return {op.name: op for op in self.ops}

    @functools.cached_property
    def _held(self) -> frozenset[str]:
        return frozenset(self.inputs) | frozenset(self.params)

    def ancestors(self, values: Iterable[str]) -> set[str]:
        """Names of the ops that `values` are computed from (back to held inputs)."""
        held, producers = self._held, self._producers
        ops: set[str] = set()
        seen: set[str] = set()
        stack = list(values)
        while stack:
            v = stack.pop()
            if v in seen or v in held:
                continue
            seen.add(v)
            op = producers[v]
            if op.name not in ops:
                ops.add(op.name)
                stack.extend(op.inputs)
        return ops

    @functools.cached_property
    def moved(self) -> frozenset[str]:
        """Ops the forward runs without remat only because the backward reads their results
        (empty without `outputs`)."""
        if not self.outputs:
            return frozenset()
        return frozenset(self.ancestors(self.needed()) - self.ancestors(self.outputs))

    def needed(self) -> tuple[str, ...]:
        """Every value the backward reads, in first-read order."""
        out = dict.fromkeys(v for op in self.ops for v in op.needs)
        out.update(dict.fromkeys(self.reads))
        return tuple(out)

    def evaluate(self, saved: Callable[[Value], bool]) -> Evaluation:
        """Kept bytes and recompute FLOPs when `saved(value)` says which values are saveable.

        The plain traversal; `cost_of_roles` answers the same for tag sets, faster."""
        producers = self._producers
        held = self._held
        kept: dict[str, None] = {}
        recomputed: dict[str, None] = {}
        stack = [op.name for op in self.ops if op.internal]
        stack.extend(f"value:{v}" for v in self.needed())
        seen: set[str] = set()
        while stack:
            item = stack.pop()
            if item in seen:
                continue
            seen.add(item)
            if item.startswith("value:"):
                name = item[6:]
                value = self.values[name]
                if name in held or saved(value):
                    kept[name] = None
                else:
                    stack.append(producers[name].name)
                continue
            recomputed[item] = None
            op = self._by_name[item]
            stack.extend(f"value:{v}" for v in op.inputs)
        params = set(self.params)
        kept_bytes = sum(self.values[v].bytes for v in self.residuals(kept))
        flops = sum(o.flops for o in self.ops if o.name in recomputed)
        if self.moved:  # see the class docstring
            forward = self.ancestors(v for v in kept if v not in held)
            flops -= sum(self._by_name[o].flops for o in self.moved - forward)
        if self.round_saved:  # one rounding per value, a jit's copy of it (`copy_of`) too
            rounded = dict.fromkeys(self.values[v].copy_of or self.values[v].same_as or v
                                    for v in kept if v not in held)
            flops += sum(self.values[v].rounding_flops for v in rounded)
        order = [o.name for o in self.ops]
        return Evaluation(kept_bytes, flops,
                          tuple(v for v in self.values if v in kept and v not in params),
                          tuple(n for n in order if n in recomputed))

    def residuals(self, kept: Iterable[str]) -> tuple[str, ...]:
        """The residuals `kept` values take, each once: parameters take none, and a value
        `Value.same_as` another is that one's."""
        params = set(self.params)
        return tuple(dict.fromkeys(self.values[v].same_as or v for v in kept
                                   if v not in params))

    def evaluate_roles(self, roles: Iterable[str]) -> Evaluation:
        """`evaluate` with the values of `roles` saveable (names that are no role of this
        layer are ignored). Remembered per set: the search asks the same sets again (its
        bytes, stored bytes, FLOPs and reads of one candidate are four questions)."""
        chosen = self._roles.intersection(roles)
        cache = self._by_roles
        ev = cache.get(chosen)
        if ev is None:
            if len(cache) >= MEMO_LIMIT:
                cache.clear()
            ev = cache[chosen] = self.evaluate(
                lambda v: v.role is not None and v.role in chosen)
        return ev

    @functools.cached_property
    def _roles(self) -> frozenset[str]:
        return frozenset(v.role for v in self.values.values() if v.role is not None)

    @functools.cached_property
    def _by_roles(self) -> dict[frozenset[str], Evaluation]:
        return {}

    # -- fast exact evaluation of tag sets ---------------------------------------------

    @functools.cached_property
    def closures(self) -> Closures:
        """The recompute closures behind `cost_of_roles` (computed once per graph)."""
        return Closures.of(self)

    def cost_of_roles(self, roles: Iterable[str]) -> tuple[int, int]:
        """(kept bytes, recompute FLOPs) when the values of `roles` are saved: exactly what
        ``evaluate_roles(roles)`` gives, by a few bitmask unions instead of a traversal."""
        return self.closures.cost(self.closures.mask(roles))

    def forward_flops(self) -> int:
        return sum(op.flops for op in self.ops)

    def no_remat_bytes(self) -> int:
        """Bytes one layer keeps with no ``jax.checkpoint``: every value and internal
        intermediate its backward reads (the reference implementation's, under JAX 0.10)."""
        params = set(self.params)
        needed = dict.fromkeys(self.values[v].copy_of or v for v in self.needed())
        return (sum(self.values[v].bytes for v in needed if v not in params)
                + sum(b for op in self.ops for _, b in op.internal))

    def role_values(self) -> dict[str, Value]:
        return {v.role: v for v in self.values.values() if v.role is not None}


MEMO_LIMIT = 1 << 16  # evaluations remembered per graph


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


@dataclass(frozen=True)
class Segment:
    """What not saving one tagged value costs by itself: the ops recomputed to rebuild it,
    back to the held inputs and the other tagged values on its frontier."""

    ops: frozenset[str]
    held: frozenset[str]  # inputs and params it reads
    frontier: int  # bitmask over `Closures.tagged`


@dataclass(frozen=True, eq=False)
class Closures:
    """A graph cut at its tagged values: segment 0 is what the backward recomputes whatever
    is saved (its untagged reads, back to tagged values and inputs), segment i + 1 what
    tagged value i costs when it is not saved. Any tag set's cost is then a fixed point over
    at most one step per tagged value, with FLOPs and input bytes summed over 'atoms' (ops
    and inputs grouped by the segments that contain them)."""

    tagged: tuple[str, ...]  # tagged values, not inputs or params
    role_masks: Mapping[str, int]  # role -> its tagged values
    segments: tuple[Segment, ...]
    tag_bytes: tuple[int, ...]
    tag_flops: tuple[int, ...]  # what keeping each costs in FLOPs (`round_saved`)
    op_atoms: tuple[tuple[int, int], ...]  # (segment mask, FLOPs)
    held_atoms: tuple[tuple[int, int], ...]  # (segment mask, bytes)
    moved_flops: int  # `LayerGraph.moved`: FLOPs not extra unless a kept value needs them
    moved_atoms: tuple[tuple[int, int], ...]  # (mask of tagged values computed from, FLOPs)
    memo: dict[int, tuple[int, int, int]]  # saved mask -> (bytes, flops, segment mask)
    copy_atoms: tuple[tuple[int, int], ...] = ()  # (mask of a value and its jit copy, the
    # rounding counted twice when both are kept: `Value.copy_of`)
    same_atoms: tuple[tuple[int, int, int], ...] = ()  # (mask of a value and those
    # `Value.same_as` it, its bytes, its rounding): counted once however many are kept

    @classmethod
    def of(cls, graph: LayerGraph) -> Closures:
        held = graph._held
        tagged = tuple(n for n, v in graph.values.items() if v.role is not None and n not in held)
        index = {n: i for i, n in enumerate(tagged)}
        producers = graph._producers

        def walk(ops: set[str], values: Iterable[str]) -> Segment:
            ins: set[str] = set()
            frontier = 0
            stack = list(values)
            seen: set[str] = set()
            while stack:
                v = stack.pop()
                if v in seen:
                    continue
                seen.add(v)
                if v in held:
                    ins.add(v)
                elif v in index:
                    frontier |= 1 << index[v]
                else:
                    op = producers[v]
                    if op.name not in ops:
                        ops.add(op.name)
                        stack.extend(op.inputs)
            return Segment(frozenset(ops), frozenset(ins), frontier)

        base_ops = {op.name for op in graph.ops if op.internal}
        seeds = [v for name in base_ops for v in graph._by_name[name].inputs]
        segments = [walk(base_ops, [*graph.needed(), *seeds])]
        for name in tagged:
            op = producers[name]
            segments.append(walk({op.name}, op.inputs))
        op_sig: dict[str, int] = {}
        held_sig: dict[str, int] = {}
        for i, seg in enumerate(segments):
            for o in seg.ops:
                op_sig[o] = op_sig.get(o, 0) | 1 << i
            for v in seg.held:
                held_sig[v] = held_sig.get(v, 0) | 1 << i
        op_atoms: dict[int, int] = {}
        for op in graph.ops:
            if op.name in op_sig:
                op_atoms[op_sig[op.name]] = op_atoms.get(op_sig[op.name], 0) + op.flops
        params = set(graph.params)
        held_atoms: dict[int, int] = {}
        for v, sig in held_sig.items():
            if v not in params:
                held_atoms[sig] = held_atoms.get(sig, 0) + graph.values[v].bytes
        role_masks: dict[str, int] = {}
        for n, i in index.items():
            role = graph.values[n].role
            assert role is not None
            role_masks[role] = role_masks.get(role, 0) | 1 << i
        moved = graph.moved
        moved_sig = dict.fromkeys(moved, 0)
        if moved:
            for n, i in index.items():
                for o in graph.ancestors([n]) & moved:
                    moved_sig[o] |= 1 << i
        moved_atoms: dict[int, int] = {}
        for o, sig in moved_sig.items():
            moved_atoms[sig] = moved_atoms.get(sig, 0) + graph._by_name[o].flops
        copy_atoms = tuple(
            ((1 << i) | (1 << index[v.copy_of]), v.rounding_flops)
            for n, i in index.items() for v in [graph.values[n]]
            if graph.round_saved and v.copy_of in index and v.rounding_flops)
        groups: dict[str, int] = {}
        for n, i in index.items():
            first = graph.values[n].same_as
            if first is not None and first in index:
                groups[first] = groups.get(first, 1 << index[first]) | 1 << i
        same_atoms = tuple(
            (mask, graph.values[n].bytes,
             graph.values[n].rounding_flops if graph.round_saved else 0)
            for n, mask in groups.items())
        return cls(tagged, role_masks, tuple(segments),
                   tuple(graph.values[n].bytes for n in tagged),
                   tuple(graph.values[n].rounding_flops if graph.round_saved else 0
                         for n in tagged),
                   tuple(op_atoms.items()), tuple(held_atoms.items()),
                   sum(moved_atoms.values()), tuple(moved_atoms.items()), {}, copy_atoms,
                   same_atoms)

    def mask(self, roles: Iterable[str]) -> int:
        out = 0
        for r in roles:
            out |= self.role_masks.get(r, 0)
        return out

    def run(self, saved: int) -> tuple[int, int, int]:
        """(kept bytes, recompute FLOPs, mask of the segments recomputed) for `saved`."""
        hit = self.memo.get(saved)
        if hit is not None:
            return hit
        segs, done, kept = 1, 0, 0
        todo = self.segments[0].frontier
        while todo:
            done |= todo
            kept |= todo & saved
            nxt = 0
            for i in _bits(todo & ~saved):
                segs |= 2 << i
                nxt |= self.segments[i + 1].frontier
            todo = nxt & ~done
        nbytes = sum(self.tag_bytes[i] for i in _bits(kept))
        nbytes += sum(b for sig, b in self.held_atoms if sig & segs)
        flops = sum(f for sig, f in self.op_atoms if sig & segs)
        if self.moved_flops:
            flops -= self.moved_flops - sum(f for sig, f in self.moved_atoms if sig & kept)
        flops += sum(self.tag_flops[i] for i in _bits(kept))
        flops -= sum(f for both, f in self.copy_atoms if kept & both == both)
        for group, b, f in self.same_atoms:
            extra = (kept & group).bit_count() - 1
            if extra > 0:
                nbytes -= extra * b
                flops -= extra * f
        out = (nbytes, flops, segs)
        if len(self.memo) < MEMO_LIMIT:
            self.memo[saved] = out
        return out

    def cost(self, saved: int) -> tuple[int, int]:
        nbytes, flops, _ = self.run(saved)
        return nbytes, flops


@dataclass(frozen=True)
class TagCost:
    """What one tag costs to keep, and what keeping it saves, per layer per core.

    Attributes:
        bytes: bytes kept when the policy saves this tag (0 when the backward never reads
            it, so JAX keeps nothing even if asked).
        recompute_flops: FLOPs the backward does not redo when this tag alone is saved,
            compared with full remat (its producing matmul, and whatever only it needed).
        always_kept: kept whatever the policy says (the layer input / scan carry).
        size_bytes: the tensor's size, kept or not.
        shape, dtype: per core.
        note: why it is cheap, free, or always kept.
    """

    bytes: int
    recompute_flops: float
    always_kept: bool = False
    size_bytes: int = 0
    shape: tuple[int, ...] = ()
    dtype: str = ""
    note: str = ""

    @property
    def flops_per_byte(self) -> float:
        return self.recompute_flops / self.bytes if self.bytes else 0.0


@dataclass(frozen=True)
class TagGroup:
    """Tags that pay off only together: saving all of them avoids more recompute than the
    sum of saving each alone, because their recomputations share work (three slices of one
    fused q/k/v matmul). Figures are per layer per core, against saving none of them.

    Attributes:
        tags: the tags, in footprint order.
        bytes: bytes kept when all are saved.
        recompute_flops: recompute avoided when all are saved.
        alone_flops: the sum of what each avoids alone.
        shared: what their recomputations share, in words.
        shared_flops: FLOPs of that shared work.
    """

    tags: tuple[str, ...]
    bytes: int
    recompute_flops: float
    alone_flops: float
    shared: str
    shared_flops: float

    @property
    def flops_per_byte(self) -> float:
        return self.recompute_flops / self.bytes if self.bytes else 0.0

    @property
    def label(self) -> str:
        """``"q_proj+k_proj+v_proj: one fused matmul"`` (class prefixes dropped when the
        short names stay distinct)."""
        short = [t.rsplit(".", 1)[-1] for t in self.tags]
        names = short if len(set(short)) == len(short) else list(self.tags)
        return "+".join(names) + f": {self.shared}"


def find_groups(graph: LayerGraph, roles: Mapping[str, str]) -> tuple[TagGroup, ...]:
    """The groups of tags (`roles`: tag -> role in `graph`) that only pay off together.

    Candidates are the sets of tags whose recompute segments (`Closures`) share work that
    the backward does not recompute anyway; a candidate is a group when saving all of it
    avoids strictly more FLOPs than the sum of saving each alone (exact joint evaluation)."""
    cl = graph.closures
    by_role = {r: t for t, r in roles.items()}
    flops = {op.name: op.flops for op in graph.ops}
    base = cl.segments[0].ops
    owners: dict[str, set[str]] = {}
    for role, mask in cl.role_masks.items():
        for i in _bits(mask):
            for o in cl.segments[i + 1].ops:
                if o not in base and flops[o] > 0:
                    owners.setdefault(o, set()).add(role)
    shared: dict[frozenset[str], list[str]] = {}
    for o, rs in owners.items():
        if len(rs) > 1:
            shared.setdefault(frozenset(rs), []).append(o)
    order = list(roles)
    base_bytes, base_flops = graph.cost_of_roles(())
    out = []
    for rs, ops in shared.items():
        if not rs <= set(by_role):
            continue
        tags = tuple(t for t in order if roles[t] in rs)
        nbytes, left = graph.cost_of_roles(rs)
        joint = base_flops - left
        alone = sum(max(base_flops - graph.cost_of_roles((roles[t],))[1], 0) for t in tags)
        if joint <= alone:
            continue
        dots = [o for o in ops if graph.values[graph._by_name[o].output].dot]
        what = ("one fused matmul" if len(dots) == 1 else f"{len(dots)} shared matmuls"
                if dots else f"shared work ({len(ops)} ops)")
        out.append(TagGroup(tags, nbytes - base_bytes, float(joint), float(alone), what,
                            float(sum(flops[o] for o in ops))))
    out.sort(key=lambda g: (-g.recompute_flops, g.tags))
    return tuple(out)


class Footprint(dict):  # dict[str, TagCost]
    """Per-tag costs of one layer (a ``dict`` of tag -> `TagCost`) plus what the layer
    keeps whatever the policy says.

    Built by `layer_footprint` (the analytic graph) or `traced_footprint` (the graph of the
    traced program): both carry their `LayerGraph`, so `evaluate` is exact jointly for any
    tag set. A footprint without a graph (a plain mapping of measured costs) adds per-tag
    costs up.
    """

    def __init__(self, tags: Mapping[str, TagCost], *, always_kept_bytes: int,
                 patterns: Mapping[str, str] | None = None,
                 graph: LayerGraph | None = None, roles: Mapping[str, str] | None = None,
                 forward_flops: float = 0.0, no_remat_bytes: int = 0,
                 full_recompute_flops: float | None = None,
                 groups: Iterable[TagGroup] | None = None) -> None:
        super().__init__(tags)
        self._groups = None if groups is None else tuple(groups)
        # Additive footprints: what saving nothing recomputes. None: the sum of the tags'
        # savings (as if every recomputed FLOP belonged to some tag).
        self.full_recompute_flops = full_recompute_flops
        self.always_kept_bytes = always_kept_bytes
        self.patterns = dict(patterns or {t: re.escape(t) for t in tags})
        self.graph = graph
        self.roles = dict(roles or {})
        self.forward_flops = forward_flops
        self.no_remat_bytes = no_remat_bytes

    def evaluate(self, saved: Iterable[str]) -> tuple[int, float]:
        """(bytes kept per layer, recompute FLOPs per layer) when `saved` tags are saved."""
        chosen = frozenset(saved)
        unknown = chosen - set(self)
        if unknown:
            raise ValueError(f"tags {sorted(unknown)} are not in this footprint ({sorted(self)})")
        if self.graph is not None:
            kept_bytes, flops = self.graph.cost_of_roles(self.roles[t] for t in chosen)
            return kept_bytes, float(flops)
        kept = self.always_kept_bytes + sum(
            self[t].bytes for t in chosen if not self[t].always_kept)
        if self.full_recompute_flops is None:  # what the unsaved tags recompute, summed
            return kept, math.fsum(c.recompute_flops for t, c in self.items()
                                   if not c.always_kept and t not in chosen)
        avoided = math.fsum(self[t].recompute_flops for t in chosen if not self[t].always_kept)
        return kept, max(0.0, self.full_recompute_flops - avoided)  # never below 0 by rounding

    @property
    def groups(self) -> tuple[TagGroup, ...]:
        """Tags that only pay off together (`find_groups`; none for additive footprints)."""
        if self._groups is None:
            self._groups = () if self.graph is None else find_groups(
                self.graph, {t: self.roles[t] for t in self if t in self.roles})
        return self._groups

    def __repr__(self) -> str:
        return f"Footprint({dict(self)!r}, always_kept_bytes={self.always_kept_bytes})"


# --------------------------------------------------------------------------------------
# Time: a roofline cost per op (the planner's ``objective="time"``).
# --------------------------------------------------------------------------------------

OP_KINDS = ("matmul", "elementwise", "transcendental", "reduction", "copy", "layout")
"""What an op does, which decides the engine that runs it: ``matmul`` on the tensor engine;
``elementwise`` and ``reduction`` on the vector engine; ``transcendental`` (exp, tanh,
rsqrt, logistic, erf: one per element) on the scalar engine; ``copy`` moves data only
(transpose, gather, concatenate: HBM time); ``layout`` costs nothing (reshape, broadcast,
a slice of a fused matmul's result: XLA makes these views or fuses them)."""

ENGINE_OF = {"matmul": "tensor", "elementwise": "vector", "reduction": "vector",
             "transcendental": "scalar"}
"""The engine each computing op kind runs on (`device.EngineRates`)."""

_TRANSCENDENTAL = {"exp", "exp2", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt", "sin",
                   "cos", "erf", "erf_inv", "pow", "expm1", "atan2", "cbrt", "tan",
                   "softmax", "activation"}
_REDUCTION = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
              "reduce_and", "reduce_or", "cumsum", "cummax", "cumlogsumexp", "reduce_precision"}
_LAYOUT = {"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "slice", "name",
           "stop_gradient", "sharding_constraint", "device_put", "copy", "copy_p",
           "convert_element_type_p", "iota"}
_COPY = {"transpose", "gather", "scatter", "concatenate", "pad", "dynamic_slice",
         "dynamic_update_slice", "rev", "select_and_gather_add", "split"}


def op_kind(op: Op, graph: LayerGraph) -> str:
    """`op.kind` when its builder set it; otherwise inferred: a ``dot_general`` (the value
    it produces is a dot) is a matmul, then by the primitive name that starts a traced op's
    name (``exp:12``), else elementwise."""
    if op.kind:
        return op.kind
    value = graph.values.get(op.output)
    if value is not None and value.dot:
        return "matmul"
    prim = op.name.split(":", 1)[0]
    # a grouped matmul (not a dot to dots_saveable)
    if prim in ("ragged_dot_general", "ragged_dot"):
        return "matmul"
    if prim in _TRANSCENDENTAL:
        return "transcendental"
    if prim in _REDUCTION:
        return "reduction"
    if prim in _LAYOUT:
        return "layout"
    if prim in _COPY:
        return "copy"
    if prim == "convert_element_type" and op.flops == 0:
        return "layout"  # a weak-type change: no instruction
    # the analytic builder's ops it leaves to inference (`_analytic`: router, top-k, routing)
    if prim == "flash_attention":
        return "matmul"
    if prim.endswith(("activation", "softmax")):
        return "transcendental"
    if prim.startswith("top_k"):
        return "reduction"
    if prim.endswith(("_split", "_concat", "dispatch", "_gather")):
        return "copy"
    return "elementwise"


def op_bytes_moved(op: Op, graph: LayerGraph) -> int:
    """Bytes the op reads and writes in HBM when it runs alone: its distinct inputs
    (parameters included: a matmul reads its weights) and its outputs."""
    names = dict.fromkeys((*op.inputs, *op.outputs))
    return sum(graph.values[n].bytes for n in names if n in graph.values)


def op_seconds(op: Op, graph: LayerGraph, rates: object) -> float:
    """The op's roofline time on one core: ``max(work / engine rate, bytes moved / HBM
    bandwidth)``, the engine by `op_kind` and the rates an `EngineRates` (`neuron_remat.device`).

    Work is `Op.flops`, except that a transcendental op counts at least one operation per
    output element (XLA's FLOP count, which `_jaxpr.eqn_flops` follows, gives them none).
    ``layout`` ops cost nothing. This is a bound per op: it ignores fusion (a fused chain
    of elementwise ops moves its tensors once) and overlap between engines."""
    kind = op_kind(op, graph)
    if kind == "layout":
        return 0.0
    moved = op_bytes_moved(op, graph) / rates.hbm_bytes_per_s  # type: ignore[attr-defined]
    if kind == "copy":
        return moved
    rate = {"tensor": rates.tensor_flops, "vector": rates.vector_flops,  # type: ignore
            "scalar": rates.scalar_flops}  # type: ignore[attr-defined]
    if op.parts:  # engines of a fused op work side by side: the busiest one decides
        busy = dict.fromkeys(rate, 0.0)
        for part, flops in op.parts:
            busy[ENGINE_OF[part]] += flops / rate[ENGINE_OF[part]]
        return max(*busy.values(), moved)
    work = float(op.flops)
    if kind == "transcendental":
        out = graph.values.get(op.output)
        work = max(work, math.prod(out.shape) / out.shards if out is not None else 0.0)
    return max(work / rate[ENGINE_OF[kind]], moved)


PICOSECONDS = 1e12


def timed_graph(graph: LayerGraph, rates: object) -> LayerGraph:
    """`graph` with each op's `flops` replaced by its `op_seconds` in picoseconds (an
    integer), so that the same exact evaluation (`cost_of_roles`, `Closures`) answers
    recompute time instead of recompute FLOPs. The ``reduce_precision`` JAX adds per saved
    value is an artefact of XLA's FLOP count and is not priced (`round_saved` off)."""
    ops = tuple(dataclasses.replace(op, flops=int(round(op_seconds(op, graph, rates)
                                                          * PICOSECONDS)))
                for op in graph.ops)
    return dataclasses.replace(graph, ops=ops, round_saved=False)
