"""The analytic builder: the per-core `LayerGraph` of one described decoder layer.

One builder for every layer `TransformerConfig` describes: pre-norm attention (grouped-query,
with separate or fused q/k/v projections, or multi-head latent attention), then a
feed-forward block (dense, gated or plain; or routed experts with optional shared experts
beside them). Shapes are per core: heads and feed-forward widths split over ``tp``, the
layer input, norms and residual adds over the sequence too with sequence parallelism, each
``ep`` core holding ``experts / ep`` experts whose buffers take the group's tokens.

Each op carries its FLOPs (as XLA counts the same computation), the values its backward
reads, the unnamed intermediates JAX keeps without remat, and its engine kind for the
roofline time (`graph.op_seconds`). `memory_model` (dense models, model state, budget) and
`moe` (several layer kinds, one save set) both build their graphs here; `_trace` is the
other builder, from a real function's jaxpr.
"""

from __future__ import annotations

import math
from typing import Any

from .graph import LayerGraph, Op, Value
from .models import Parallelism, StepShape, TransformerConfig, dtype_bytes

__all__ = ["FLASH_BLOCK", "LayerBuilder", "flash_forward_flops", "flash_score_elements",
           "layer_graph"]

FLASH_BLOCK = 128  # query rows per block of a flash-attention kernel

_ACT = {  # activation -> (FLOPs per element, elementwise pieces JAX keeps without remat)
    "silu": (4, 2), "gelu": (8, 4), "gelu_tanh": (8, 4), "relu": (1, 1)}


def flash_score_elements(s: int, *, causal: bool = True, block: int = FLASH_BLOCK) -> int:
    """Score elements a flash-attention forward computes per head: all ``s x s`` of them, or
    with a causal mask, for each block of `block` query rows, the keys up to its last row."""
    elems = 0
    for start in range(0, s, block):
        rows = min(start + block, s) - start
        elems += rows * (min(start + block, s) if causal else s)
    return elems


def flash_forward_flops(b: int, s: int, heads: int, d: int, *, causal: bool = True,
                        convert: bool = False, block: int = FLASH_BLOCK,
                        dv: int | None = None) -> int:
    """FLOPs of a flash-attention forward (XLA's count of the same computation): per score
    element it computes, a multiply-add per q/k head dimension (`d`) and per value
    dimension (`dv`, default `d`), and the scale, causal mask, row max, subtraction and row
    sum (plus a conversion each way when the activations are narrower than the float32
    scores); per output element the final division; per row the log-sum-exp. A causal
    kernel works in blocks of `block` query rows and reads, for each, only the keys up to
    its last row: ``(n + 1) / 2n`` of the score matrix for ``n`` blocks (diagonal blocks are
    computed whole)."""
    dv = d if dv is None else dv
    elems = flash_score_elements(s, causal=causal, block=block)
    per = 2 * (d + dv) + 4 + (1 if causal else 0) + (2 if convert else 0)
    return b * heads * (elems * per + s * dv + s)


class LayerBuilder:
    """Values and ops of one layer of `kind` (``"dense"`` or ``"moe"`` feed-forward) on one
    core, for `config` at `shape` split by `par`. Only the roles `config` emits in a layer
    of that kind are tagged."""

    def __init__(self, config: TransformerConfig, shape: StepShape, par: Parallelism,
                 kind: str = "dense") -> None:
        self.config, self.shape, self.par = config, shape, par
        self.act = shape.activation_dtype
        self.f32 = self.act == "float32"
        self.cvt = 0 if self.f32 else 1  # a dtype conversion: one op per element
        self.ebytes = dtype_bytes(self.act)
        self.sp = par.tp if par.sequence_parallel else 1
        self.t_full = shape.micro_batch * shape.seq_len  # tokens per core in the tp regions
        self.t_rep = self.t_full // self.sp  # ... and outside them
        self.emitted = set(config.kind_roles(kind))
        self.values: dict[str, Value] = {}
        self.ops: list[Op] = []

    def val(self, name: str, shp: tuple[int, ...], role: str | None = None,
            dtype: str | None = None, **kw: Any) -> str:
        self.values[name] = Value(name, shp, dtype or self.act,
                                  role if role in self.emitted else None, **kw)
        return name

    def op(self, name: str, inputs: tuple[str, ...], out: str, flops: int,
           needs: tuple[str, ...] = (), internal: tuple[tuple[str, int], ...] = (),
           kind: str = "", parts: tuple[tuple[str, int], ...] = ()) -> str:
        """Append an op; `kind` "" lets `graph.op_kind` infer the engine from the name."""
        self.ops.append(Op(name, inputs, out, int(flops), needs=needs, internal=internal,
                           kind=kind, parts=parts))
        return out

    def graph(self) -> LayerGraph:
        return LayerGraph(values=dict(self.values), ops=tuple(self.ops))

    # --- the pieces every layer has ---------------------------------------------------

    def norm(self, name: str, src: str, rows: int, width: int, role: str | None = None,
             kind: str | None = None) -> str:
        """An RMS or layer norm over `width`, float32 statistics. Without remat JAX keeps
        the float32 normalised values and statistics (and the centred values for LayerNorm,
        which then never reads its input); with narrower activations it reads a float32 copy
        of the input rather than the input itself."""
        kind = kind or self.config.norm
        n = rows * width
        per_elem = (4 if kind == "rms" else 7) + 2 * self.cvt
        internal = (("float32 normalised values", n * 4),
                    ("float32 norm statistics", 2 * rows * 4),
                    ("broadcast norm scale", width * 4))
        if kind == "layer":
            internal += (("float32 centred values", n * 4),)
        elif not self.f32:
            internal += (("float32 copy of the norm input", n * 4),)
        out = self.val(f"{name}_out", (rows, width), role)
        reads = (src,) if self.f32 and kind == "rms" else ()
        return self.op(name, (src,), out, per_elem * n + rows, needs=reads, internal=internal,
                       kind="elementwise",
                       parts=(("elementwise", per_elem * n), ("transcendental", rows)))

    def matmul(self, name: str, src: str, out_shape: tuple[int, ...], contract: int,
               role: str | None, batch: bool = False, reads: tuple[str, ...] | None = None,
               inputs: tuple[str, ...] | None = None) -> str:
        out = self.val(name, out_shape, role, dot=True, batch_dot=batch)
        return self.op(f"{name}_matmul", inputs or (src,), out,
                       2 * math.prod(out_shape) * contract, needs=reads or (src,),
                       kind="matmul")

    def add(self, name: str, a: str, b: str, out: str) -> str:
        rows, width = self.values[out].shape
        return self.op(name, (a, b), out, rows * width, kind="elementwise")

    def activation(self, name: str, a: str, g: str | None, out: str, n: int) -> str:
        """The feed-forward activation over `n` elements of `a` (times `g` when gated)."""
        flops, pieces = _ACT[self.config.activation]
        ins = (a,) if g is None else (a, g)
        total = flops + (0 if g is None else 1)
        internal = (("activation pieces", (pieces + len(ins) - 1) * n * self.ebytes),)
        if self.config.activation == "relu":  # a comparison and a select: no exp
            return self.op(name, ins, out, total * n, needs=ins, internal=internal,
                           kind="elementwise")
        return self.op(name, ins, out, total * n, needs=ins, internal=internal,
                       kind="transcendental",
                       parts=(("transcendental", n), ("elementwise", (total - 1) * n)))

    # --- attention ----------------------------------------------------------------------

    def attention(self, n1: str) -> str:
        """q, k and v (grouped-query, fused or separate; or latent), the attention core
        (a flash kernel, or scores, softmax and context) and the output projection."""
        cfg, t, h = self.config, self.t_full, self.config.hidden
        heads = cfg.heads // self.par.tp
        if cfg.mla is not None:
            q, k, v, d, dv = self._latent_qkv(n1, heads)
        else:
            assert cfg.kv_heads is not None and cfg.head_dim is not None
            tp = self.par.tp
            kv = cfg.kv_heads // tp if cfg.kv_heads % tp == 0 else 1
            d = dv = cfg.head_dim
            if cfg.fused_qkv:
                q, k, v = self._fused_qkv(n1, heads, kv, d)
            else:
                q = self.matmul("q", n1, (t, heads, d), h, "q_proj")
                k = self.matmul("k", n1, (t, kv, d), h, "k_proj")
                v = self.matmul("v", n1, (t, kv, d), h, "v_proj")
        ctx = self._flash(q, k, v, heads, d, dv) if cfg.flash_attention else \
            self._softmax_attention(q, k, v, heads, d, dv)
        # The output projection runs over all t_full tokens, then reduce-scatters to t_rep.
        return self.matmul("o", ctx, (self.t_rep, h), heads * dv * self.sp, "o_proj")

    def _fused_qkv(self, n1: str, heads: int, kv: int, d: int) -> tuple[str, str, str]:
        """One matmul produces q, k and v side by side (untagged); each is sliced out and
        tagged. A slice costs no FLOPs and its backward reads nothing, so saving one or two
        slices still recomputes the matmul for the others; only all three avoid it."""
        t = self.t_full
        qkv = self.matmul("qkv", n1, (t, heads + 2 * kv, d), self.config.hidden, None)
        out = []
        for name, role, n in (("q", "q_proj", heads), ("k", "k_proj", kv), ("v", "v_proj", kv)):
            out.append(self.val(name, (t, n, d), role))
            self.op(f"{name}_slice", (qkv,), name, 0, kind="layout")
        return out[0], out[1], out[2]

    def _latent_qkv(self, n1: str, heads: int) -> tuple[str, str, str, int, int]:
        """Multi-head latent attention: queries through an optional low-rank projection and
        its norm; keys and values from a shared latent (normed) and one RoPE key that every
        head shares. Returns q, k, v and the q/k and v head widths."""
        cfg, t, h = self.config, self.t_full, self.config.hidden
        m = cfg.mla
        assert m is not None
        d, dv = m.qk_head_dim, m.v_head_dim
        if m.q_lora_rank:
            qa = self.matmul("q_a", n1, (t, m.q_lora_rank), h, "q_a")
            qn = self.norm("q_a_norm", qa, t, m.q_lora_rank, "q_a_norm", "rms")
            q = self.matmul("q", qn, (t, heads, d), m.q_lora_rank, "q_proj")
        else:
            q = self.matmul("q", n1, (t, heads, d), h, "q_proj")
        kva = self.matmul("kv_a", n1, (t, m.kv_lora_rank + m.qk_rope_head_dim), h, "kv_a")
        latent = self.op("kv_a_split", (kva,), self.val("latent", (t, m.kv_lora_rank)), 0)
        cn = self.norm("kv_a_norm", latent, t, m.kv_lora_rank, "kv_a_norm", "rms")
        kv_b = self.matmul("kv_b", cn, (t, heads, m.qk_nope_head_dim + dv), m.kv_lora_rank,
                           None)
        # k: the per-head no-RoPE part beside the one RoPE key broadcast to every head.
        k = self.op("k_concat", (kv_b, kva), self.val("k", (t, heads, d), "k_proj"), 0)
        v = self.op("v_split", (kv_b,), self.val("v", (t, heads, dv), "v_proj"), 0)
        return q, k, v, d, dv

    def _flash(self, q: str, k: str, v: str, heads: int, d: int, dv: int) -> str:
        """A flash kernel: no ``seq x seq`` values kept; its output and the float32
        log-sum-exp are what its backward reads besides q, k and v."""
        cfg, b, s = self.config, self.shape.micro_batch, self.shape.seq_len
        ctx = self.val("context", (self.t_full, heads, dv), "context",
                       extra_bytes=b * heads * s * 4)
        attn = flash_forward_flops(b, s, heads, d, causal=cfg.causal, convert=bool(self.cvt),
                                   dv=dv)
        scores = b * heads * flash_score_elements(s, causal=cfg.causal)
        mm = 2 * (d + dv)
        return self.op("flash_attention", (q, k, v), ctx, attn, needs=(q, k, v, ctx),
                       kind="matmul", parts=(("matmul", mm * scores),
                                             ("transcendental", scores),
                                             ("elementwise", attn - (mm + 1) * scores)))

    def _softmax_attention(self, q: str, k: str, v: str, heads: int, d: int, dv: int) -> str:
        cfg, b, s = self.config, self.shape.micro_batch, self.shape.seq_len
        scores = self.matmul("scores", q, (b, heads, s, s), d, None, batch=True, reads=(q, k),
                             inputs=(q, k))
        elems = b * heads * s * s
        # scale, causal select, softmax (max, subtract, sum, divide), conversions
        sm_flops = elems * (5 + (1 if cfg.causal else 0) + 2 * self.cvt)
        probs = self.val("probs", (b, heads, s, s))
        small = b * heads * s * 4
        internal = (("softmax exp (float32)", elems * 4),
                    ("softmax row sums (float32)", 2 * small))
        if cfg.causal:
            internal += (("causal mask (bool)", elems), ("masked scores", elems * self.ebytes))
        self.op("softmax", (scores,), probs, sm_flops, internal=internal,
                kind="transcendental",
                parts=(("transcendental", elems), ("elementwise", sm_flops - elems)))
        return self.matmul("context", probs, (self.t_full, heads, dv), s, "context",
                           batch=True, reads=(probs, v), inputs=(probs, v))

    # --- feed-forward -------------------------------------------------------------------

    def dense_ffn(self, n2: str, width: int, prefix: str = "") -> str:
        cfg, t = self.config, self.t_full
        f = width // self.par.tp
        a = self.matmul(f"{prefix}linear1_0", n2, (t, f), cfg.hidden, "linear1_0")
        gate = self.val(f"{prefix}gated", (t, f))
        g = self.matmul(f"{prefix}linear1_1", n2, (t, f), cfg.hidden, "linear1_1") \
            if cfg.gated_ffn else None
        self.activation(f"{prefix}activation", a, g, gate, t * f)
        return self.matmul(f"{prefix}linear2", gate, (self.t_rep, cfg.hidden), f * self.sp,
                           "linear2")

    def moe_ffn(self, n2: str) -> str:
        """Routed experts: a linear router, float32 scores, top-k; every local expert a
        buffer of `MoEConfig.capacity` rows; the outputs gathered back and weighted."""
        cfg, t, par = self.config, self.t_full, self.par
        moe = cfg.moe
        assert moe is not None
        h, e, k = cfg.hidden, moe.experts, moe.experts_per_token
        local, cap = e // par.ep, moe.capacity(t, par.ep)
        f = moe.expert_ffn // par.tp  # tokens per expert per core: cap
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
        gate = self.val("moe_gated", (local, cap, f))
        g = self.matmul("moe_linear1_1", xs, (local, cap, f), h, "moe_linear1_1",
                        batch=True) if cfg.gated_ffn else None
        self.activation("moe_activation", a, g, gate, local * cap * f)
        ys = self.matmul("moe_linear2", gate, (local, cap, h), f, "moe_linear2", batch=True)
        picked = self.val("combined_rows", (t, k, h))
        self.op("combine_gather", (ys, slots), picked, 0, needs=(slots,))
        y = self.val("moe_out", (self.t_rep, h), dot=True, batch_dot=True)
        return self.op("combine", (weights, picked), y, 2 * t * k * h, needs=(weights, picked))


def layer_graph(config: TransformerConfig, shape: StepShape,
                parallelism: Parallelism | None = None, kind: str | None = None) -> LayerGraph:
    """The per-core graph of one layer of `kind` (``"dense"`` or ``"moe"``; default: the
    kind most of `config`'s layers are)."""
    par = parallelism or Parallelism()
    par.check(config, shape)
    kinds = config.layer_kinds()
    kind = kind or max(kinds, key=lambda k: (kinds[k], k))
    if kind not in kinds:
        raise ValueError(f"model {config.name!r} has no {kind!r} layers; it has "
                         f"{', '.join(kinds)}")
    bld = LayerBuilder(config, shape, par, kind)
    rows, h = bld.t_rep, config.hidden
    x = bld.val("x", (rows, h), "input")
    n1 = bld.norm("norm1", x, rows, h)
    o = bld.attention(n1)
    x1 = bld.add("residual1", x, o, bld.val("x1", (rows, h)))
    n2 = bld.norm("norm2", x1, rows, h)
    if kind == "dense":
        y = bld.dense_ffn(n2, config.ffn)
    else:
        assert config.moe is not None
        y = bld.moe_ffn(n2)
        if config.moe.shared_ffn:
            ys = bld.dense_ffn(n2, config.moe.shared_ffn, prefix="shared_")
            y = bld.add("shared_add", y, ys, bld.val("ffn_out", (rows, h)))
    bld.add("residual2", x1, y, bld.val("out", (rows, h)))
    return bld.graph()
