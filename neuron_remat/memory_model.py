"""Bytes kept and FLOPs recomputed per checkpoint tag, for one transformer layer on one core.

The analytic model is a small dataflow graph of one pre-norm decoder layer (attention with
grouped KV heads, then a gated or plain feed-forward block), built for the per-core shapes
that tensor, sequence, fully-sharded and pipeline parallelism leave. For any choice of
saved tags it answers, exactly for that graph, what JAX's ``jax.checkpoint`` does:

* the backward needs some values: each matmul reads both operands, a norm or softmax reads
  its own intermediate values, an add reads nothing;
* a needed value that is the layer input, or a tag the policy saves, is kept;
* any other needed value is recomputed from its inputs, which become needed in turn.

So saving a tag only helps when the backward reads it, or reads something computed from it:
``linear2`` (the feed-forward output, only added to the residual stream) is never kept
even when saved, and saving it recomputes nothing less. The norms, softmax and activation
functions have no tag: under any names policy they are recomputed, never kept.

JAX's ``dots_saveable`` keeps every ``dot_general`` output, the ``seq x seq`` attention scores
included (`Value.batch_dot` marks them; ``dots_with_no_batch_dims_saveable`` skips them), so
it is no cheap option for long sequences.

`layer_footprint` reports, per tag, the bytes kept if saved and the FLOPs saved by keeping
it; `model_state_bytes` the parameters, gradients and optimizer state per core; `budget`
what is left per layer. `traced_footprint` measures the same per-tag figures from a real
function with JAX's own saved-residuals analysis, so a layer this model does not describe
can still be planned from the truth.

Known differences from Korthikanti et al. 2022 (``sbh(34 + 5as/h)`` bytes per layer, 16-bit,
no recompute), which `korthikanti_terms` itemises:

* no dropout: their attention-probability mask (``as^2b``), dropout output (``2as^2b``) and
  the two ``sbh`` masks after attention and MLP are not kept;
* float32 norm statistics (one float32 per token per norm) that they leave out;
* without remat, JAX also keeps unfused elementwise intermediates (softmax ``exp``,
  activation pieces, float32 norm copies). `LayerGraph.no_remat_bytes` counts those for the
  tests' plain-JAX reference layer (tests/cpu/reference.py); under any ``jax.checkpoint``
  policy they are recomputed, so plans do not depend on them.
"""


from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from . import _analytic
from ._analytic import FLASH_BLOCK, flash_forward_flops, flash_score_elements  # noqa: F401
from ._format import fmt_bytes
from .device import GiB, DeviceSpec
from .graph import Footprint, LayerGraph, TagCost
from .models import Parallelism, StepShape, TransformerConfig, dtype_bytes

__all__ = [
    "Budget",
    "Footprint",
    "LayerGraph",
    "ModelState",
    "TagCost",
    "backward_working_set",
    "budget",
    "korthikanti_terms",
    "layer_footprint",
    "layer_graph",
    "model_state_bytes",
]

logger = logging.getLogger(__name__)


def layer_graph(config: TransformerConfig, shape: StepShape,
                parallelism: Parallelism | None = None) -> LayerGraph:
    """Build the per-core graph of one layer of `config` (for a model with several layer
    kinds, the kind most of its layers are; `moe.layer_graphs` gives each). The one
    analytic builder, `_analytic.LayerBuilder`, builds dense, MoE and MLA layers alike."""
    return _analytic.layer_graph(config, shape, parallelism)


# --------------------------------------------------------------------------------------
# Per-tag figures.
# --------------------------------------------------------------------------------------


def layer_footprint(config: TransformerConfig, shape: StepShape,
                    parallelism: Parallelism | None = None) -> Footprint:
    """Per-tag bytes and recompute FLOPs for one layer on one core (analytic).

    Keys are the tag names the host emits (``q_proj``, ... in `config.tags`). A model with
    experts or latent attention gets `moe.layer_footprint` (every layer kind, one save set)."""
    if config.moe is not None or config.mla is not None:
        from . import moe  # noqa: PLC0415

        return moe.layer_footprint(config, shape, parallelism)
    graph = layer_graph(config, shape, parallelism)
    full = graph.evaluate_roles(())
    by_role = graph.role_values()
    tags: dict[str, TagCost] = {}
    roles: dict[str, str] = {}
    patterns: dict[str, str] = {}
    for role in config.roles:
        value = by_role[role]
        name = config.tag(role)
        assert name is not None
        alone = graph.evaluate_roles((role,))
        kept = alone.kept_bytes - full.kept_bytes
        saved_flops = full.recompute_flops - alone.recompute_flops
        if role == "input":
            note = "the layer input (scan carry): kept whatever the policy says"
        elif kept == 0:
            note = "the backward never reads it: saving it keeps nothing and saves nothing"
        else:
            note = ""
        tags[name] = TagCost(bytes=value.bytes if role == "input" else kept,
                             recompute_flops=float(saved_flops), always_kept=role == "input",
                             size_bytes=value.bytes, shape=value.shape, dtype=value.dtype,
                             note=note)
        roles[name] = role
        pat = config.pattern(role)
        assert pat is not None
        patterns[name] = pat
    return Footprint(tags, always_kept_bytes=full.kept_bytes, patterns=patterns, graph=graph,
                     roles=roles, forward_flops=float(graph.forward_flops()),
                     no_remat_bytes=graph.no_remat_bytes())


# --------------------------------------------------------------------------------------
# Model state and budget.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelState:
    """Parameters, gradients and optimizer state held by one core."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    params_per_core: int

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def model_state_bytes(config: TransformerConfig, shape: StepShape,
                      parallelism: Parallelism | None = None) -> ModelState:
    """State per core: layer weights split over ``tp x fsdp`` and the stages, embeddings
    split over ``tp x fsdp`` (vocabulary-parallel); the stage holding them is assumed worst."""
    par = parallelism or Parallelism()
    if par.fsdp == -1:
        raise ValueError("resolve fsdp=-1 first (Parallelism.resolve(device))")
    par.check(config, shape)
    assert config.kv_heads is not None and config.head_dim is not None
    tp, fsdp = par.tp, par.fsdp
    kv_per_core = config.kv_heads // tp if config.kv_heads % tp == 0 else 1
    h, d = config.hidden, config.head_dim
    per_layer = (
        h * d * 2 * (config.heads // tp)  # q and o projections
        + h * d * 2 * kv_per_core  # k and v projections (replicated when tp > kv_heads)
        + (3 if config.gated_ffn else 2) * h * (config.ffn // tp)
        + h * (2 if config.norm == "rms" else 4)  # norms are replicated over tp
    ) / fsdp
    layers = config.layers // par.pp
    if config.moe is not None or config.mla is not None:
        layers, per_layer = 1, _layers_per_core(config, par)
    emb = config.vocab * h / (tp * fsdp)
    embeddings = emb * (1 if config.tie_embeddings or par.pp > 1 else 2) + h
    params = int(math.ceil(layers * per_layer + embeddings))
    pbytes = dtype_bytes(shape.param_dtype)
    opt = shape.optimizer_bytes_per_param() / (par.dp if par.zero1 else 1)
    return ModelState(params_bytes=params * pbytes, grads_bytes=params * pbytes,
                      optimizer_bytes=int(params * opt), params_per_core=params)


def _layers_per_core(config: TransformerConfig, par: Parallelism) -> float:
    """Layer parameters one core holds, for a model with experts or latent attention: the
    fullest pipeline stage; attention and dense feed-forward split over ``tp x fsdp``,
    routed experts over `Parallelism.expert_shards` (``tp x ep x`` what fsdp has left)."""
    from .moe import stage_mix  # noqa: PLC0415

    tp, shards = par.tp, par.tp * par.fsdp
    mult = 3 if config.gated_ffn else 2
    norms = (4 if config.details.sandwich_norm else 2) * config.hidden * (
        1 if config.norm == "rms" else 2)
    h, m = config.hidden, config.mla
    if m is not None:  # the latent down-projections and their norms are replicated over tp
        replicated = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + (
            h * m.q_lora_rank + m.q_lora_rank if m.q_lora_rank else 0)
        attn = (config.attention_params() - replicated) / tp + replicated
    else:  # k and v are replicated when tp > kv_heads
        assert config.kv_heads is not None and config.head_dim is not None
        kv = config.kv_heads // tp if config.kv_heads % tp == 0 else 1
        kv_params = 2 * h * config.head_dim * config.kv_heads + (
            2 * config.head_dim * config.kv_heads if config.details.qkv_bias else 0)
        attn = (config.attention_params() - kv_params) / tp + kv_params * kv / config.kv_heads
    dense = mult * config.hidden * config.ffn
    best = 0.0
    for stage in stage_mix(config, par.pp):
        total = stage.get("dense", 0) * ((attn + norms) * tp + dense) / shards
        if "moe" in stage:
            moe = config.moe
            assert moe is not None
            routed = moe.experts * mult * config.hidden * moe.expert_ffn
            rest = config.ffn_params("moe") - routed
            total += stage["moe"] * (((attn + norms) * tp + rest) / shards
                                     + routed / par.expert_shards())
        best = max(best, total)
    return best


DEFAULT_RESERVE_FRACTION = 0.10
"""Share of HBM held back for temporaries, collectives' buffers and fragmentation."""
RUNTIME_BYTES_PER_PHYSICAL_CORE = 96 * 10**6
"""Neuron runtime microcode per physical core (neuron-runtime device-memory doc)."""


@dataclass(frozen=True)
class Budget:
    """HBM per core, and what is left for each layer's kept activations.

    ``per_layer_bytes = (hbm - state - reserve - workspace) / (layers_per_core x inflight)``
    where `workspace` is what is live only once: one layer's backward working set or the
    float32 logits and their gradient, whichever is larger. The working set depends on
    the policy (`backward_working_set`: more when little is saved); `workspace_bytes` is
    full remat's, the largest, and `per_layer_bytes_for(roles)` what a layer may keep
    under a policy saving `roles`, with that policy's own workspace.
    """

    hbm_bytes: int
    state: ModelState
    reserve_bytes: int
    workspace_bytes: int
    layers_per_core: int
    inflight: int
    head_bytes: int = 0
    graph: LayerGraph | None = field(default=None, repr=False, compare=False)

    @property
    def available_bytes(self) -> int:
        return self.hbm_bytes - self.state.total_bytes - self.reserve_bytes - self.workspace_bytes

    @property
    def per_layer_bytes(self) -> int:
        return self.available_bytes // (self.layers_per_core * self.inflight)

    def workspace_for(self, roles: Iterable[str]) -> int:
        """The workspace under a policy saving the tags of `roles`."""
        if self.graph is None:
            return self.workspace_bytes
        return max(backward_working_set(self.graph, roles), self.head_bytes)

    def per_layer_bytes_for(self, roles: Iterable[str]) -> int:
        """What each layer may keep under a policy saving `roles` (its own workspace)."""
        free = self.hbm_bytes - self.state.total_bytes - self.reserve_bytes
        return (free - self.workspace_for(roles)) // (self.layers_per_core * self.inflight)


def backward_working_set(graph: LayerGraph, roles: Iterable[str]) -> int:
    """One layer's backward working set under a names policy saving `roles`: the values its
    backward reads that the policy recomputes, the untagged intermediates of the ops it
    recomputes (`Op.internal`: softmax and norm temporaries), and the layer's largest
    value (the gradient being formed). Saving a tag the backward reads shrinks it; with
    no remat nothing is recomputed."""
    ev = graph.evaluate_roles(roles)
    held = set(ev.kept) | set(graph.inputs) | set(graph.params)
    read = sum(graph.values[v].bytes for v in graph.needed() if v not in held)
    redone = set(ev.recomputed)
    internal = sum(b for op in graph.ops if op.name in redone for _, b in op.internal)
    return read + internal + max(v.bytes for v in graph.values.values())


def reserve_bytes(device: DeviceSpec, reserve: float | int | None = None) -> int:
    """The reserve: a fraction of HBM (a float in ``[0, 1)``), bytes (an int), or by
    default 10% plus the Neuron runtime's 96 MB per physical core."""
    hbm = device.hbm_bytes_per_core
    if reserve is None:
        runtime = RUNTIME_BYTES_PER_PHYSICAL_CORE * device.physical_cores_per_core \
            if device.is_neuron and hbm > 4 * GiB else 0  # scaled-down simulations skip it
        return int(DEFAULT_RESERVE_FRACTION * hbm) + runtime
    if isinstance(reserve, bool) or not isinstance(reserve, (numbers.Integral, float)) or \
            reserve < 0 or (isinstance(reserve, float) and reserve >= 1):
        raise ValueError(f"reserve={reserve!r}: give a fraction of HBM in [0, 1) as a float, "
                         "or bytes as an int")
    if isinstance(reserve, numbers.Integral) and hbm and reserve >= hbm:
        raise ValueError(f"reserve={reserve!r} bytes ({fmt_bytes(reserve)}) is not less than "
                         f"the {fmt_bytes(hbm)} of HBM per core of {device.family}; give less, "
                         "or a fraction of HBM in [0, 1)")
    return int(reserve * hbm) if isinstance(reserve, float) else int(reserve)


def head_bytes(config: TransformerConfig, shape: StepShape, parallelism: Parallelism) -> int:
    """Float32 logits and their gradient for one micro-batch (vocabulary split over tp)."""
    return 2 * shape.tokens * math.ceil(config.vocab / parallelism.tp) * 4


def budget(device: DeviceSpec, config: TransformerConfig, shape: StepShape,
           parallelism: Parallelism | None = None,
           reserve: float | int | None = None) -> Budget:
    """What each layer may keep on one core of `device` (see `Budget`); `parallelism`
    defaults to FSDP over every core of one host (``Parallelism(fsdp=-1)``)."""
    if not device.hbm_bytes_per_core:
        raise ValueError(
            f"device {device.family!r} has no HBM figure; plan for a Neuron device "
            "(device=from_instance_type('trn2.48xlarge'), NEURON_REMAT_DEVICE=...) or pass "
            "budget_bytes= with a footprint")
    par = (parallelism or Parallelism(fsdp=-1)).resolve(device)
    par.check(config, shape)
    state = model_state_bytes(config, shape, par)
    graph = layer_graph(config, shape, par)
    head = head_bytes(config, shape, par)
    if config.moe is not None or config.mla is not None:
        from . import moe  # noqa: PLC0415

        # MoE and MLA layers keep the no-remat working set of their heaviest layer kind,
        # plus the expert all-to-all buffers, whatever is saved (conservative).
        workspace = max([head] + [
            g.no_remat_bytes() for g in moe.layer_graphs(config, shape, par).values()]) + \
            moe.all_to_all_bytes(config, shape, par)
        return Budget(hbm_bytes=device.hbm_bytes_per_core, state=state,
                      reserve_bytes=reserve_bytes(device, reserve), workspace_bytes=workspace,
                      layers_per_core=config.layers // par.pp, inflight=par.inflight,
                      head_bytes=head)
    workspace = max(backward_working_set(graph, ()), head)
    return Budget(hbm_bytes=device.hbm_bytes_per_core, state=state,
                  reserve_bytes=reserve_bytes(device, reserve), workspace_bytes=workspace,
                  layers_per_core=config.layers // par.pp, inflight=par.inflight,
                  head_bytes=head, graph=graph)


# --------------------------------------------------------------------------------------
# Korthikanti et al. accounting.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    what: str
    bytes: int


def korthikanti_terms(config: TransformerConfig, shape: StepShape) -> dict[str, Any]:
    """The paper's per-layer no-recompute total ``sbh(34 + 5as/h)`` (16-bit, no parallelism)
    beside this model's figure for the same layer, with every difference named.

    ``model_bytes`` counts what a fused implementation keeps, as the paper does: the values
    the backward reads (both operands of each matmul, the softmax output, the activation's
    input and output) and each norm's input. ``differences`` are the paper's dropout terms,
    which this layer does not have. ``jax_extras`` are the unfused intermediate values JAX
    keeps without remat for the reference implementation, and ``fused_only_bytes`` what it
    does not keep that the fused count does (a LayerNorm's input: JAX keeps the centred
    float32 values instead); `LayerGraph.no_remat_bytes` is ``model_bytes - fused_only_bytes
    + sum(jax_extras)``."""
    if shape.activation_dtype not in ("bfloat16", "float16"):
        raise ValueError("the paper counts 16-bit activations; use activation_dtype='bfloat16'")
    if config.kv_heads != config.heads or config.gated_ffn or config.flash_attention:
        raise ValueError("the paper's layer has multi-head attention, a plain MLP and no "
                         "flash attention")
    s, b, h, a = shape.seq_len, shape.micro_batch, config.hidden, config.heads
    sbh, as2b = s * b * h, a * s * s * b
    paper = sbh * 34 + 5 * as2b
    graph = layer_graph(config, shape)
    needed = {v for op in graph.ops for v in op.needs}
    fused = needed | {op.inputs[0] for op in graph.ops if op.name.startswith("norm")}
    model = sum(graph.values[v].bytes for v in fused)
    differences = [
        Term("attention-probability dropout mask (1 byte each)", -as2b),
        Term("attention-probability dropout output", -2 * as2b),
        Term("dropout mask after the attention block", -sbh),
        Term("dropout mask after the MLP block", -sbh),
    ]
    extras = [Term(f"{op.name}: {what}", nbytes) for op in graph.ops
              for what, nbytes in op.internal]
    return {"paper_bytes": paper, "model_bytes": model, "differences": differences,
            "unexplained_bytes": model - paper - sum(t.bytes for t in differences),
            "jax_extras": extras,
            "fused_only_bytes": sum(graph.values[v].bytes for v in fused - needed)}
