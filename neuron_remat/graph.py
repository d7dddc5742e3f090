"""The one graph type the planner evaluates: a layer's dataflow on one core.

A `LayerGraph` holds the values of one layer (tensors, per core), the ops that produce them
with their FLOPs, and what each op's backward reads. For any choice of saved tags it answers
what JAX's ``jax.checkpoint`` does: a value the backward reads is kept when it is a layer
input or a saved tag, otherwise it is recomputed from its inputs, which are then read in
turn. Two builders make these graphs: the analytic one (`memory_model.layer_graph`) and the
jaxpr one (`_trace`). A `Footprint` is the per-tag view of a graph (or of measured figures)
that the planner searches.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .models import dtype_bytes

__all__ = ["Evaluation", "Footprint", "LayerGraph", "Op", "TagCost", "Value"]


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

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype) + self.extra_bytes


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


@dataclass(frozen=True)
class Evaluation:
    """What one policy keeps and recomputes for one layer on one core."""

    kept_bytes: int
    recompute_flops: int
    kept: tuple[str, ...]
    recomputed: tuple[str, ...]


@dataclass(frozen=True)
class LayerGraph:
    """The analytic dataflow graph of one layer on one core (see the module docstring)."""

    values: Mapping[str, Value]
    ops: tuple[Op, ...]
    inputs: tuple[str, ...] = ("x",)

    @functools.cached_property
    def _producers(self) -> dict[str, Op]:
        return {op.output: op for op in self.ops}

    @functools.cached_property
    def _by_name(self) -> dict[str, Op]:
        return {op.name: op for op in self.ops}

    def evaluate(self, saved: Callable[[Value], bool]) -> Evaluation:
        """Kept bytes and recompute FLOPs when `saved(value)` says which values are saveable."""
        producers = self._producers
        kept: dict[str, None] = {}
        recomputed: dict[str, None] = {}
        stack = [op.name for op in self.ops if op.internal]
        for op in self.ops:
            stack.extend(f"value:{v}" for v in op.needs)
        seen: set[str] = set()
        while stack:
            item = stack.pop()
            if item in seen:
                continue
            seen.add(item)
            if item.startswith("value:"):
                name = item[6:]
                value = self.values[name]
                if name in self.inputs or saved(value):
                    kept[name] = None
                else:
                    stack.append(producers[name].name)
                continue
            recomputed[item] = None
            op = self._by_name[item]
            stack.extend(f"value:{v}" for v in op.inputs)
        kept_bytes = sum(self.values[v].bytes for v in kept)
        flops = sum(o.flops for o in self.ops if o.name in recomputed)
        order = [o.name for o in self.ops]
        return Evaluation(kept_bytes, flops, tuple(v for v in self.values if v in kept),
                          tuple(n for n in order if n in recomputed))

    def evaluate_roles(self, roles: Iterable[str]) -> Evaluation:
        chosen = frozenset(roles)
        return self.evaluate(lambda v: v.role is not None and v.role in chosen)

    def forward_flops(self) -> int:
        return sum(op.flops for op in self.ops)

    def no_remat_bytes(self) -> int:
        """Bytes one layer keeps with no ``jax.checkpoint``: every value and internal
        intermediate its backward reads (the reference implementation's, under JAX 0.10)."""
        needed = {v for op in self.ops for v in op.needs}
        return (sum(self.values[v].bytes for v in needed)
                + sum(b for op in self.ops for _, b in op.internal))

    def role_values(self) -> dict[str, Value]:
        return {v.role: v for v in self.values.values() if v.role is not None}


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


class Footprint(dict):  # dict[str, TagCost]
    """Per-tag costs of one layer (a ``dict`` of tag -> `TagCost`) plus what the layer
    keeps whatever the policy says.

    Built by `layer_footprint` (analytic: exact joint evaluation through the layer graph)
    or `traced_footprint` (measured: costs add up per tag).
    """

    def __init__(self, tags: Mapping[str, TagCost], *, always_kept_bytes: int,
                 patterns: Mapping[str, str] | None = None,
                 graph: LayerGraph | None = None, roles: Mapping[str, str] | None = None,
                 forward_flops: float = 0.0, no_remat_bytes: int = 0,
                 full_recompute_flops: float | None = None) -> None:
        super().__init__(tags)
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
            ev = self.graph.evaluate_roles(self.roles[t] for t in chosen)
            return ev.kept_bytes, float(ev.recompute_flops)
        full = self.full_recompute_flops
        if full is None:
            full = sum(c.recompute_flops for c in self.values() if not c.always_kept)
        kept = self.always_kept_bytes + sum(
            self[t].bytes for t in chosen if not self[t].always_kept)
        return kept, full - sum(self[t].recompute_flops for t in chosen
                                if not self[t].always_kept)

    def __repr__(self) -> str:
        return f"Footprint({dict(self)!r}, always_kept_bytes={self.always_kept_bytes})"
