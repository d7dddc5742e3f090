"""Analytic layer graphs for mixture-of-experts feed-forward blocks and multi-head latent
attention (MLA), per core, and the footprint of a model that mixes layer kinds.

`memory_model.layer_graph` hands any config with experts or latent attention here. A layer
is pre-norm attention (grouped-query or MLA) then a feed-forward block: dense, or routed
experts (a linear router, float32 scores, top-k; every expert a buffer of
``MoEConfig.capacity`` rows; the outputs gathered back and weighted) with optional shared
experts beside them. Shapes are per core: heads and feed-forward widths split over ``tp``,
each ``ep`` core holding ``experts / ep`` experts whose buffers take the group's tokens
(``tokens x k x capacity_factor`` rows per core at balanced routing; the all-to-all that
moves them is workspace, `all_to_all_bytes`).

**Mixed models** (DeepSeek's dense first layers, Llama 4's interleaving) are planned with
**one save set for every layer kind**, not one per kind. A host's policy is one function
of the tag name, and the attention tags (``q_proj``, ``context``, ...) are the same names in
dense and MoE layers, so per-kind sets could only differ in the feed-forward tags anyway;
one set chosen against the sum over the layers a core holds (`KindsFootprint`: kept bytes
of the fullest pipeline stage, recompute averaged over the model) is exact for that
constraint and never lets the rarer kind overflow the budget that the commoner kind fits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .graph import Footprint, LayerGraph, Op, TagCost, Value
from .models import Parallelism, StepShape, TransformerConfig, dtype_bytes

__all__ = ["KindsFootprint", "all_to_all_bytes", "layer_footprint", "layer_graph",
           "layer_graphs", "stage_mix"]

_ACT = {  # activation -> (FLOPs per element, elementwise pieces JAX keeps without remat)
    "silu": (4, 2), "gelu": (8, 4), "gelu_tanh": (8, 4), "relu": (1, 1)}


class _Builder:
    """Values and ops of one layer on one core, for `config` at `shape`."""

    def __init__(self, config: TransformerConfig, shape: StepShape, par: Parallelism,
                 kind: str) -> None:
        self.config, self.shape, self.par = config, shape, par
        self.act = shape.activation_dtype
        self.f32 = self.act == "float32"
        self.cvt = 0 if self.f32 else 1
        self.ebytes = dtype_bytes(self.act)
        sp = par.tp if par.sequence_parallel else 1
        self.sp = sp
        self.t_full = shape.micro_batch * shape.seq_len
        self.t_rep = self.t_full // sp
        self.emitted = set(config.kind_roles(kind))
        self.values: dict[str, Value] = {}
        self.ops: list[Op] = []

    def val(self, name: str, shp: tuple[int, ...], role: str | None = None,
            dtype: str | None = None, **kw: Any) -> str:
        self.values[name] = Value(name, shp, dtype or self.act,
                                  role if role in self.emitted else None, **kw)
        return name

    def op(self, name: str, inputs: tuple[str, ...], out: str, flops: int,
           needs: tuple[str, ...] = (), internal: tuple[tuple[str, int], ...] = ()) -> str:
        self.ops.append(Op(name, inputs, out, int(flops), needs=needs, internal=internal))
        return out

    def norm(self, name: str, src: str, rows: int, width: int, role: str | None = None,
             kind: str | None = None) -> str:
        """An RMS or layer norm over `width` (float32 statistics), as
        `memory_model.layer_graph` counts one."""
        kind = kind or self.config.norm
        n = rows * width
        per_elem = (4 if kind == "rms" else 7) + 2 * self.cvt
        internal = (("float32 normalised values", n * 4), ("float32 norm statistics", 2 * rows * 4),
                    ("broadcast norm scale", width * 4))
        if kind == "layer":
            internal += (("float32 centred values", n * 4),)
        elif not self.f32:
            internal += (("float32 copy of the norm input", n * 4),)
        out = self.val(f"{name}_out", (rows, width), role)
        reads = (src,) if self.f32 and kind == "rms" else ()
        return self.op(name, (src,), out, per_elem * n + rows, needs=reads, internal=internal)

    def matmul(self, name: str, src: str, out_shape: tuple[int, ...], contract: int,
               role: str | None, batch: bool = False, reads: tuple[str, ...] | None = None,
               inputs: tuple[str, ...] | None = None) -> str:
        out = self.val(name, out_shape, role, dot=True, batch_dot=batch)
        return self.op(f"{name}_matmul", inputs or (src,), out,
                       2 * math.prod(out_shape) * contract, needs=reads or (src,))

    def graph(self) -> LayerGraph:
        return LayerGraph(values=dict(self.values), ops=tuple(self.ops))

    # --- attention ----------------------------------------------------------------------

    def attention(self, n1: str) -> str:
        cfg, b, s = self.config, self.shape.micro_batch, self.shape.seq_len
        tp, t = self.par.tp, self.t_full
        heads = cfg.heads // tp
        if cfg.mla is None:
            assert cfg.kv_heads is not None and cfg.head_dim is not None
            kv = cfg.kv_heads // tp if cfg.kv_heads % tp == 0 else 1
            d = dv = cfg.head_dim
            q = self.matmul("q", n1, (t, heads, d), cfg.hidden, "q_proj")
            k = self.matmul("k", n1, (t, kv, d), cfg.hidden, "k_proj")
            v = self.matmul("v", n1, (t, kv, d), cfg.hidden, "v_proj")
        else:
            m = cfg.mla
            d, dv = m.qk_head_dim, m.v_head_dim
            if m.q_lora_rank:
                qa = self.matmul("q_a", n1, (t, m.q_lora_rank), cfg.hidden, "q_a")
                qn = self.norm("q_a_norm", qa, t, m.q_lora_rank, "q_a_norm", "rms")
                q = self.matmul("q", qn, (t, heads, d), m.q_lora_rank, "q_proj")
            else:
                q = self.matmul("q", n1, (t, heads, d), cfg.hidden, "q_proj")
            kva = self.matmul("kv_a", n1, (t, m.kv_lora_rank + m.qk_rope_head_dim),
                              cfg.hidden, "kv_a")
            latent = self.op("kv_a_split", (kva,), self.val("latent", (t, m.kv_lora_rank)), 0)
            cn = self.norm("kv_a_norm", latent, t, m.kv_lora_rank, "kv_a_norm", "rms")
            kv_b = self.matmul("kv_b", cn, (t, heads, m.qk_nope_head_dim + dv),
                               m.kv_lora_rank, None)
            # k: the per-head no-RoPE part beside the one RoPE key broadcast to every head.
            k = self.op("k_concat", (kv_b, kva), self.val("k", (t, heads, d), "k_proj"), 0)
            v = self.op("v_split", (kv_b,), self.val("v", (t, heads, dv), "v_proj"), 0)
            kv = heads
        if cfg.flash_attention:
            lse = b * heads * s * 4
            ctx = self.val("context", (t, heads, dv), "context", extra_bytes=lse)
            causal = 0.5 if cfg.causal else 1.0
            attn = int(causal * (2 * b * heads * s * s * (d + dv) + 5 * b * heads * s * s))
            self.op("flash_attention", (q, k, v), ctx, attn, needs=(q, k, v, ctx))
        else:
            del kv
            scores = self.matmul("scores", q, (b, heads, s, s), d, None, batch=True,
                                 reads=(q, k), inputs=(q, k))
            elems = b * heads * s * s
            sm_flops = elems * (5 + (1 if cfg.causal else 0) + 2 * self.cvt)
            probs = self.val("probs", (b, heads, s, s))
            small = b * heads * s * 4
            internal = (("softmax exp (float32)", elems * 4),
                        ("softmax row sums (float32)", 2 * small))
            if cfg.causal:
                internal += (("causal mask (bool)", elems), ("masked scores", elems * self.ebytes))
            self.op("softmax", (scores,), probs, sm_flops, internal=internal)
            ctx = self.matmul("context", probs, (t, heads, dv), s, "context", batch=True,
                              reads=(probs, v), inputs=(probs, v))
        return self.matmul("o", ctx, (self.t_rep, cfg.hidden), heads * dv * self.sp, "o_proj")

    # --- feed-forward -------------------------------------------------------------------

    def dense_ffn(self, n2: str, width: int, prefix: str = "") -> str:
        cfg, t = self.config, self.t_full
        f = width // self.par.tp
        a = self.matmul(f"{prefix}linear1_0", n2, (t, f), cfg.hidden, "linear1_0")
        flops, pieces = _ACT[cfg.activation]
        n_ff = t * f
        gate = self.val(f"{prefix}gated", (t, f))
        if cfg.gated_ffn:
            g = self.matmul(f"{prefix}linear1_1", n2, (t, f), cfg.hidden, "linear1_1")
            self.op(f"{prefix}activation", (a, g), gate, (flops + 1) * n_ff, needs=(a, g),
                    internal=(("activation pieces", (pieces + 1) * n_ff * self.ebytes),))
        else:
            self.op(f"{prefix}activation", (a,), gate, flops * n_ff, needs=(a,),
                    internal=(("activation pieces", pieces * n_ff * self.ebytes),))
        return self.matmul(f"{prefix}linear2", gate, (self.t_rep, cfg.hidden), f * self.sp,
                           "linear2")

    def moe_ffn(self, n2: str) -> str:
        cfg, t, par = self.config, self.t_full, self.par
        moe = cfg.moe
        assert moe is not None
        h, e, k = cfg.hidden, moe.experts, moe.experts_per_token
        local, cap = e // par.ep, moe.capacity(t, par.ep)
        rows, f = local * cap, moe.expert_ffn // par.tp  # tokens per expert per core: cap
        logits = self.matmul("router", n2, (t, e), h, None)
        scores = self.val("router_probs", (t, e), dtype="float32")
        score_flops = 4 * t * e - t if moe.router == "softmax" else 3 * t * e
        self.op("router_scores", (logits,), scores, score_flops,
                internal=(("router score pieces (float32)", 2 * t * e * 4 + 2 * t * 4),))
        weights = self.val("gate_weights", (t, k), "gate_weights", dtype="float32")
        experts = self.val("gate_assignment", (t, k), "gate_assignment", dtype="int32")
        self.op("top_k_indices", (scores,), experts, 0)
        self.op("top_k", (scores,), weights, 0, needs=(experts,))
        # Buffer slots in token order (a cumulative count per expert), as int32 indices;
        # the FLOPs are as XLA counts the one-hot cumulative sum (a log-depth scan),
        # fitted on its CPU backend: negligible beside the experts at any real size.
        slots = self.val("slots", (t * k + local * cap,), dtype="int32")
        self.op("route", (experts,), slots, 22 * t * k * e + 16 * t * k)
        xs = self.val("dispatched", (local, cap, h))
        self.op("dispatch", (n2, slots), xs, 0, needs=(slots,))
        a = self.matmul("moe_linear1_0", xs, (local, cap, f), h, "moe_linear1_0", batch=True)
        flops, pieces = _ACT[cfg.activation]
        gate = self.val("moe_gated", (local, cap, f))
        if cfg.gated_ffn:
            g = self.matmul("moe_linear1_1", xs, (local, cap, f), h, "moe_linear1_1",
                            batch=True)
            self.op("moe_activation", (a, g), gate, (flops + 1) * rows * f, needs=(a, g),
                    internal=(("activation pieces", (pieces + 1) * rows * f * self.ebytes),))
        else:
            self.op("moe_activation", (a,), gate, flops * rows * f, needs=(a,),
                    internal=(("activation pieces", pieces * rows * f * self.ebytes),))
        ys = self.matmul("moe_linear2", gate, (local, cap, h), f, "moe_linear2", batch=True)
        picked = self.val("combined_rows", (t, k, h))
        self.op("combine_gather", (ys, slots), picked, 0, needs=(slots,))
        y = self.val("moe_out", (self.t_rep, h), dot=True, batch_dot=True)
        self.op("combine", (weights, picked), y, 2 * t * k * h,
                needs=(weights, picked))
        return y


def layer_graph(config: TransformerConfig, shape: StepShape,
                parallelism: Parallelism | None = None, kind: str | None = None) -> LayerGraph:
    """The per-core graph of one `kind` layer (default: the kind most layers are)."""
    par = parallelism or Parallelism()
    par.check(config, shape)
    kinds = config.layer_kinds()
    kind = kind or max(kinds, key=lambda k: (kinds[k], k))
    if kind not in kinds:
        raise ValueError(f"model {config.name!r} has no {kind!r} layers; it has "
                         f"{', '.join(kinds)}")
    bld = _Builder(config, shape, par, kind)
    h = config.hidden
    x = bld.val("x", (bld.t_rep, h), "input")
    n1 = bld.norm("norm1", x, bld.t_rep, h)
    o = bld.attention(n1)
    x1 = bld.op("residual1", (x, o), bld.val("x1", (bld.t_rep, h)), bld.t_rep * h)
    n2 = bld.norm("norm2", x1, bld.t_rep, h)
    if kind == "dense":
        y = bld.dense_ffn(n2, config.ffn)
    else:
        assert config.moe is not None
        y = bld.moe_ffn(n2)
        if config.moe.shared_ffn:
            ys = bld.dense_ffn(n2, config.moe.shared_ffn, prefix="shared_")
            y = bld.op("shared_add", (y, ys), bld.val("ffn_out", (bld.t_rep, h)),
                       bld.t_rep * h)
    bld.op("residual2", (x1, y), bld.val("out", (bld.t_rep, h)), bld.t_rep * h)
    return bld.graph()


def layer_graphs(config: TransformerConfig, shape: StepShape,
                 parallelism: Parallelism | None = None) -> dict[str, LayerGraph]:
    """Layer kind -> its per-core graph."""
    return {kind: layer_graph(config, shape, parallelism, kind) for kind in config.layer_kinds()}


def stage_mix(config: TransformerConfig, pp: int = 1) -> list[dict[str, int]]:
    """Per pipeline stage, how many layers of each kind it holds (contiguous stages)."""
    per = config.layers // pp
    out = []
    for j in range(pp):
        idx = range(j * per, (j + 1) * per)
        moe = sum(1 for i in idx if config.is_moe_layer(i))
        out.append({k: n for k, n in (("dense", per - moe), ("moe", moe)) if n})
    return out


def all_to_all_bytes(config: TransformerConfig, shape: StepShape,
                     parallelism: Parallelism | None = None) -> int:
    """Send and receive buffers of the expert all-to-all on one core (0 without ``ep``):
    each holds the core's routed rows (``experts / ep x capacity``) of `hidden` values."""
    par = parallelism or Parallelism()
    if config.moe is None or par.ep == 1:
        return 0
    rows = config.moe.experts // par.ep * config.moe.capacity(shape.tokens, par.ep)
    return 2 * rows * config.hidden * dtype_bytes(shape.activation_dtype)


class KindsFootprint(Footprint):
    """The footprint of a model with several layer kinds, planned with one save set.

    ``evaluate(saved)`` gives the kept bytes per layer of the fullest pipeline stage (its
    total over the layers it holds, divided by their number, rounded up) and the recompute
    FLOPs per layer averaged over the model. `kind_graphs` holds each kind's graph and
    `tag_roles` what each tag saves in each kind (a MaxText alias saves two roles)."""

    def __init__(self, tags: Mapping[str, TagCost], *, kind_graphs: Mapping[str, LayerGraph],
                 tag_roles: Mapping[str, Mapping[str, tuple[str, ...]]],
                 stages: list[dict[str, int]], counts: Mapping[str, int], **kw: Any) -> None:
        super().__init__(tags, **kw)
        self.kind_graphs = dict(kind_graphs)
        self.tag_roles = {t: dict(r) for t, r in tag_roles.items()}
        self.stages, self.counts = stages, dict(counts)

    def evaluate_kinds(self, saved: Iterable[str]) -> dict[str, tuple[int, int]]:
        chosen = frozenset(saved)
        unknown = chosen - set(self)
        if unknown:
            raise ValueError(f"tags {sorted(unknown)} are not in this footprint ({sorted(self)})")
        out = {}
        for kind, graph in self.kind_graphs.items():
            roles = {r for t in chosen for r in self.tag_roles[t].get(kind, ())}
            ev = graph.evaluate_roles(roles)
            out[kind] = (ev.kept_bytes, ev.recompute_flops)
        return out

    def evaluate(self, saved: Iterable[str]) -> tuple[int, float]:
        per = self.evaluate_kinds(saved)
        kept = max(math.ceil(sum(n * per[k][0] for k, n in stage.items()) / sum(stage.values()))
                   for stage in self.stages)
        total = sum(self.counts.values())
        flops = sum(n * per[k][1] for k, n in self.counts.items()) / total
        return kept, flops


def layer_footprint(config: TransformerConfig, shape: StepShape,
                    parallelism: Parallelism | None = None) -> KindsFootprint:
    """Per-tag bytes and recompute FLOPs (per layer per core, on the mix of layer kinds a
    core holds) for a model with experts or latent attention."""
    par = parallelism or Parallelism()
    graphs = layer_graphs(config, shape, par)
    counts = config.layer_kinds()
    aliases = dict(config.tags.aliases)
    tag_roles: dict[str, dict[str, tuple[str, ...]]] = {}
    role_of: dict[str, str] = {}
    patterns: dict[str, str] = {}
    for kind in graphs:
        for role in config.kind_roles(kind):
            for name, pattern_role in ((config.tag(role), role), (aliases.get(role), role)):
                if name is None:
                    continue
                have = tag_roles.setdefault(name, {}).setdefault(kind, ())
                if pattern_role not in have:
                    tag_roles[name][kind] = have + (pattern_role,)
                if name not in role_of or name == config.tag(role):
                    role_of.setdefault(name, role)
                if name not in patterns:
                    patterns[name] = (".*" if config.tags.prefixed else "") + \
                        re.escape(name)
    probe = KindsFootprint({}, kind_graphs=graphs, tag_roles=tag_roles,
                           stages=stage_mix(config, par.pp), counts=counts,
                           always_kept_bytes=0)
    full_kept, full_flops = probe.evaluate(())
    tags: dict[str, TagCost] = {}
    main = max(counts, key=lambda k: (counts[k], k))
    for name, by_kind in tag_roles.items():
        probe[name] = TagCost(0, 0.0)
        kept, flops = probe.evaluate((name,))
        kind = main if main in by_kind else next(iter(by_kind))
        value = graphs[kind].role_values()[by_kind[kind][0]]
        is_input = role_of[name] == "input"
        if is_input:
            note = "the layer input (scan carry): kept whatever the policy says"
        elif kept == full_kept:
            note = "the backward never reads it: saving it keeps nothing and saves nothing"
        elif len(by_kind) < len(counts):
            note = f"only in {', '.join(by_kind)} layers"
        else:
            note = ""
        tags[name] = TagCost(bytes=value.bytes if is_input else kept - full_kept,
                             recompute_flops=float(full_flops - flops), always_kept=is_input,
                             size_bytes=value.bytes, shape=value.shape, dtype=value.dtype,
                             note=note)
    forward = sum(n * graphs[k].forward_flops() for k, n in counts.items()) / config.layers
    return KindsFootprint(
        tags, kind_graphs=graphs, tag_roles=tag_roles, stages=stage_mix(config, par.pp),
        counts=counts, always_kept_bytes=full_kept, patterns=patterns, graph=graphs[main],
        roles=role_of, forward_flops=forward,
        no_remat_bytes=max(g.no_remat_bytes() for g in graphs.values()))
