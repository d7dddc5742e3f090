"""Model, step and parallelism descriptions, the built-in models and the Hugging Face
``config.json`` loader.

A `TransformerConfig` says what one decoder layer looks like as far as activation memory
is concerned; `StepShape` is one training step as a data-parallel replica sees it;
`Parallelism` is how the job is split over cores. `TagNames` is what a host library calls
each checkpointed value of a layer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .device import DeviceSpec

__all__ = [
    "AXLEARN_NEURON_TAGS",
    "AXLEARN_TAGS",
    "MAXTEXT_NEURON_TAGS",
    "MAXTEXT_TAGS",
    "ACTIVATIONS",
    "MLAConfig",
    "MODELS",
    "MLA_ROLES",
    "MOE_ROLES",
    "MoEConfig",
    "ROLES",
    "Parallelism",
    "StepShape",
    "TagNames",
    "TransformerConfig",
    "dtype_bytes",
    "from_hf_config",
    "get_model",
    "host_of",
    "host_tags",
    "load_hf_config",
]

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int32": 4, "int8": 1, "bool": 1,
}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype named like numpy/JAX (``"bfloat16"``, ``"float32"``)."""
    key = str(name).lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[key]


# --------------------------------------------------------------------------------------
# Tag vocabularies.
# --------------------------------------------------------------------------------------

ROLES = ("input", "q_proj", "k_proj", "v_proj", "context", "o_proj",
         "linear1_0", "linear1_1", "linear2")
MOE_ROLES = ("gate_weights", "gate_assignment", "moe_linear1_0", "moe_linear1_1", "moe_linear2")
"""Roles of a mixture-of-experts feed-forward block: the router's top-k weights and expert
indices, and the routed experts' two input projections and output projection (shared
experts are a dense feed-forward block beside them and use the dense roles)."""
MLA_ROLES = ("q_a", "q_a_norm", "kv_a", "kv_a_norm")
"""Roles of a multi-head latent attention block besides the dense ones: the low-rank query
projection and its normalised value, and the joint key-value latent (with the shared RoPE
key) and its normalised main part."""
_ALL_ROLES = ROLES + MOE_ROLES + MLA_ROLES


@dataclass(frozen=True)
class TagNames:
    """What a host library calls each checkpointed value of a layer.

    `prefixed` says the host adds a class prefix (axlearn tags ``MultiheadAttention.q_proj``),
    so patterns match the name after any ``Class.`` prefix. A role set to None is not
    emitted by the host.
    """

    vocabulary: str = "axlearn"
    input: str | None = "input"
    q_proj: str | None = "q_proj"
    k_proj: str | None = "k_proj"
    v_proj: str | None = "v_proj"
    context: str | None = "context"
    o_proj: str | None = "o_proj"
    linear1_0: str | None = "linear1_0"
    linear1_1: str | None = "linear1_1"
    linear1_ungated: str | None = "linear1_0"
    linear2: str | None = "linear2"
    flash_context: str | None = "flash_residuals"
    prefixed: bool = True
    # Mixture of experts (MOE_ROLES) and latent attention (MLA_ROLES).
    gate_weights: str | None = "gate_weights"
    gate_assignment: str | None = "gate_assignment"
    moe_linear1_0: str | None = None
    moe_linear1_1: str | None = None
    moe_linear2: str | None = None
    q_a: str | None = "q_a_proj"
    q_a_norm: str | None = "q_a_norm"
    kv_a: str | None = "kv_a_proj"
    kv_a_norm: str | None = "kv_a_norm"
    aliases: tuple[tuple[str, str], ...] = ()
    """(role, name): a second name the host tags the same value with; saving either keeps it."""

    def name(self, role: str, *, gated: bool = True, flash: bool = False) -> str | None:
        if role not in _ALL_ROLES:
            raise ValueError(f"unknown tag role {role!r}; valid: {', '.join(_ALL_ROLES)}")
        if role == "linear1_0" and not gated:
            return self.linear1_ungated
        if role == "context" and flash:
            return self.flash_context
        return getattr(self, role)

    def pattern(self, role: str, *, gated: bool = True, flash: bool = False) -> str | None:
        """The regex that matches this role's tag (after any prefix, as axlearn's
        ``.*q_proj`` does)."""
        name = self.name(role, gated=gated, flash=flash)
        if name is None:
            return None
        return (".*" if self.prefixed else "") + re.escape(name)


AXLEARN_TAGS = TagNames()
"""axlearn's names (``BaseLayer._remat_name``: ``f"{type(self).__name__}.{name}"``); its
GPU and TPU flash-attention kernels tag their residuals ``flash_residuals`` (not the Neuron
kernel: see `AXLEARN_NEURON_TAGS`).

Mixture of experts: at apple/axlearn 34aed43c1b6e581c4753d06d7cbeedd5010ef26b,
``axlearn/common/mixture_of_experts.py`` tags only the router's top-k output
(``TopKGating.gate_weights`` and ``.gate_assignment``, in ``BaseGating._top_k``); the expert
einsums (``wi_0``, ``wi_1``, ``wo``) carry no remat name, so under any names policy they are
recomputed. axlearn has no latent-attention layer at that commit: the MLA names here
(``q_a_proj``, ``q_a_norm``, ``kv_a_proj``, ``kv_a_norm``: Hugging Face DeepSeek's module
names) are for a host layer written in its style."""

AXLEARN_NEURON_TAGS = TagNames(vocabulary="axlearn-neuron", flash_context=None)
"""What axlearn's layer emits on a Neuron device (apple/axlearn 34aed43c): its
``FlashAttention`` layer hands attention to the NKI kernel
(``flash_attention/neuron_attention.py``, a ``custom_vjp`` with no ``checkpoint_name``) and
does not tag ``context`` (``flash_attention/layer.py`` ``_compute_attention``); only the GPU
and TPU kernels tag ``flash_residuals``. So under any names policy the kernel's forward is
recomputed in the backward. Native attention (``MultiheadAttention``,
``GroupedQueryAttention``) still tags ``context``."""


MAXTEXT_TAGS = TagNames(
    vocabulary="maxtext", input="decoder_layer_input", q_proj="query_proj",
    k_proj="key_proj", v_proj="value_proj", context="attention_out", o_proj="out_proj",
    linear1_0="mlpwi_0", linear1_1="mlpwi_1", linear1_ungated="mlpwi", linear2="mlpwo",
    flash_context="context", prefixed=False,
    gate_weights=None, gate_assignment=None, moe_linear1_0="moe_mlpwi_0",
    moe_linear1_1="moe_mlpwi_1", moe_linear2="moe_mlpwo", q_a="query_wa_proj",
    q_a_norm="mla_q", kv_a="kv_wa_proj", kv_a_norm="mla_kv",
    aliases=(("moe_linear1_0", "mlpwi_0"), ("moe_linear2", "mlpwo")),
)
"""MaxText's names (``layers/attentions.py``, ``layers/linears.py``, ``decoders.py``): the
attention output before the output projection is ``attention_out``; ``context`` is the
flash kernels' output and log-sum-exp (cuDNN and TPU splash paths only).

Mixture of experts and MLA, from AI-Hypercomputer/maxtext
e591f30cbbf217ed67ef71263ec0538239f9c3b8: ``layers/moe.py``'s sparse (grouped-matmul) path
tags the routed experts ``moe_mlpwi_0`` (also named ``mlpwi_0``), ``moe_mlpwi_1`` and
``moe_mlpwo`` (also named ``mlpwo``), so a dense ``mlpwi_0`` or ``mlpwo`` in a policy saves
the routed value too; shared experts are a dense ``MlpBlock`` (``mlpwi_0``, ``mlpwi_1``,
``mlpwo``); the router is not tagged. ``layers/attention_mla.py`` tags ``query_wa_proj``
(the low-rank query), ``mla_q`` (after its norm), ``kv_wa_proj`` (the key-value latent with
the RoPE key), ``mla_kv`` (the normalised latent), then ``query_proj``, ``key_proj``,
``value_proj``, ``attention_out`` and ``out_proj``."""

MAXTEXT_NEURON_TAGS = dataclasses.replace(MAXTEXT_TAGS, vocabulary="maxtext-neuron",
                                          flash_context=None)
"""What MaxText's layer emits on a Neuron device: ``context`` (the flash kernel's output and
log-sum-exp) is tagged only by its cuDNN and TPU splash attention kernels
(``layers/attention_op.py`` at AI-Hypercomputer/maxtext e591f30c), which do not run on
Neuron; every other name is tagged by the layer itself and stands."""

_NEURON_VOCABULARIES = {AXLEARN_TAGS: AXLEARN_NEURON_TAGS, MAXTEXT_TAGS: MAXTEXT_NEURON_TAGS}


def host_tags(tags: TagNames, device: DeviceSpec | None) -> TagNames:
    """The vocabulary the host really emits on `device`. On a Neuron device the GPU and TPU
    flash-attention kernels' tags are not emitted: axlearn's names become
    `AXLEARN_NEURON_TAGS` (no ``flash_residuals``) and MaxText's `MAXTEXT_NEURON_TAGS` (no
    ``context``). Anything else (a user's own `TagNames`) is returned as is."""
    if device is not None and device.is_neuron:
        return _NEURON_VOCABULARIES.get(tags, tags)
    return tags


def host_of(tags: TagNames) -> str:
    """The host a vocabulary belongs to: ``axlearn``, ``maxtext`` or the vocabulary's own
    name (``axlearn-neuron`` is axlearn's)."""
    return tags.vocabulary.split("-", 1)[0]


# --------------------------------------------------------------------------------------
# Model, step and parallelism descriptions.
# --------------------------------------------------------------------------------------


def _positive(owner: str, **values: Any) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: {key} must be a positive integer, got {value!r}")


ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
"""Feed-forward activations: SiLU (swish), exact (erf) GeLU, tanh-approximated GeLU, ReLU."""
_ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts feed-forward blocks of a decoder.

    Attributes:
        experts: routed experts per MoE layer.
        experts_per_token: experts each token is routed to (top-k).
        expert_ffn: feed-forward width of one routed expert.
        shared_ffn: total feed-forward width of the always-on shared experts (DeepSeek
            ``n_shared_experts x moe_intermediate_size``, Qwen2-MoE
            ``shared_expert_intermediate_size``); 0 for none.
        dense_layers: indices of the layers whose feed-forward block is dense (width
            ``TransformerConfig.ffn``): DeepSeek's ``first_k_dense_replace`` first layers,
            the layers Llama 4's ``interleave_moe_layer_step`` or Qwen's
            ``decoder_sparse_step`` skip.
        capacity_factor: expert buffers hold ``capacity_factor x tokens x k / experts``
            rows each (GShard/axlearn style; tokens past it are dropped); None is dropless
            (grouped matmul over the ``tokens x k`` routed rows, MaxText's sparse path),
            planned at balanced routing.
        router: ``"softmax"`` or ``"sigmoid"`` scores over the experts.
        router_bias: a per-expert score-correction bias (DeepSeek-V3).
        shared_gate: a sigmoid gate on the shared experts' output (Qwen2-MoE).
    """

    experts: int
    experts_per_token: int
    expert_ffn: int
    shared_ffn: int = 0
    dense_layers: tuple[int, ...] = ()
    capacity_factor: float | None = None
    router: str = "softmax"
    router_bias: bool = False
    shared_gate: bool = False

    def __post_init__(self) -> None:
        _positive("moe", experts=self.experts, experts_per_token=self.experts_per_token,
                  expert_ffn=self.expert_ffn)
        if self.experts_per_token > self.experts:
            raise ValueError(f"moe: experts_per_token={self.experts_per_token} exceeds "
                             f"experts={self.experts}")
        if isinstance(self.shared_ffn, bool) or not isinstance(self.shared_ffn, int) \
                or self.shared_ffn < 0:
            raise ValueError(f"moe: shared_ffn must be an integer >= 0, got {self.shared_ffn!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0
               for i in self.dense_layers):
            raise ValueError(f"moe: dense_layers must be layer indices >= 0, got "
                             f"{self.dense_layers!r}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                               or not 0 < cf < 1e6):
            raise ValueError(f"moe: capacity_factor={cf!r}; give a number > 0, or None "
                             "for dropless routing")
        if self.router not in _ROUTERS:
            raise ValueError(f"moe: router={self.router!r}; valid: {', '.join(_ROUTERS)}")

    def capacity(self, tokens: int, group: int = 1) -> int:
        """Rows one expert's buffer holds when `group` cores of `tokens` tokens each route
        to it (the capacity factor's ceiling; dropless: the balanced share, unrounded up)."""
        share = tokens * group * self.experts_per_token / self.experts
        cf = 1.0 if self.capacity_factor is None else self.capacity_factor
        return max(1, math.ceil(cf * share))


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank
    projection (`q_lora_rank`, 0 for a full one), keys and values through a shared latent
    of `kv_lora_rank` plus one RoPE key of `qk_rope_head_dim` shared by all heads."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0

    def __post_init__(self) -> None:
        _positive("mla", kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                  qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        if isinstance(self.q_lora_rank, bool) or not isinstance(self.q_lora_rank, int) \
                or self.q_lora_rank < 0:
            raise ValueError(f"mla: q_lora_rank must be an integer >= 0 (0: no low-rank "
                             f"query), got {self.q_lora_rank!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer, as far as activation memory is concerned.

    `kv_heads` defaults to `heads` (multi-head attention) and `head_dim` to
    ``hidden // heads``. `flash_attention` means the attention kernel keeps no
    ``seq x seq`` probabilities: its backward recomputes them from q, k, v, its output and
    the float32 log-sum-exp. `fused_qkv` means one matmul produces q, k and v together
    (axlearn's ``FusedQKVLinear``/``FusedGroupedQKVLinear``), which are then sliced out and
    tagged: saving one slice avoids no matmul, saving all three avoids it.
    """

    hidden: int
    heads: int
    ffn: int
    layers: int
    vocab: int
    kv_heads: int | None = None
    head_dim: int | None = None
    gated_ffn: bool = True
    flash_attention: bool = False
    norm: Literal["rms", "layer"] = "rms"
    activation: str = "silu"
    causal: bool = True
    tie_embeddings: bool = False
    tags: TagNames = AXLEARN_TAGS
    name: str = "custom"
    source: str = ""
    default_seq_len: int | None = None
    fused_qkv: bool = False
    # Mixture of experts, latent attention and per-family details (param_count exactness).
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    qkv_bias: bool = False  # Qwen2 / Qwen2.5 / Qwen2-MoE
    qk_norm: bool = False  # RMS norms on q and k per head (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # norms after attention and feed-forward too (Gemma 2/3)
    # What config.json says of sequence lengths (None: not said). Not modelled, but
    # `shape_notes` tells a plan when its seq_len goes past them.
    max_positions: int | None = None  # max_position_embeddings
    sliding_window: int | None = None  # the window of sliding-window attention layers
    sliding_layers: int | None = None  # how many layers use it (None: all of them)

    def __post_init__(self) -> None:
        _positive(f"model {self.name!r}", hidden=self.hidden, heads=self.heads)
        for key in ("kv_heads", "head_dim", "max_positions", "sliding_window",
                    "sliding_layers"):
            if getattr(self, key) is not None:
                _positive(f"model {self.name!r}", **{key: getattr(self, key)})
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim is None and self.mla is not None:
            object.__setattr__(self, "head_dim", self.mla.qk_head_dim)
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(
                    f"{self.name}: hidden={self.hidden} is not divisible by heads="
                    f"{self.heads}; give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        _positive(f"model {self.name!r}", hidden=self.hidden, heads=self.heads,
                  kv_heads=self.kv_heads, head_dim=self.head_dim, ffn=self.ffn,
                  layers=self.layers, vocab=self.vocab)
        assert self.kv_heads is not None
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: heads={self.heads} is not a multiple of kv_heads="
                f"{self.kv_heads}; valid kv_heads divide {self.heads}")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"model {self.name!r}: norm={self.norm!r}; valid: 'rms', 'layer'")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"model {self.name!r}: activation={self.activation!r}; valid: "
                f"{', '.join(ACTIVATIONS)}")
        if self.moe is not None:
            late = [i for i in self.moe.dense_layers if i >= self.layers]
            if late:
                raise ValueError(f"model {self.name!r}: dense_layers {late} are past the "
                                 f"last layer ({self.layers - 1})")

    @property
    def roles(self) -> tuple[str, ...]:
        """Tag roles this layer emits (of every layer kind, for a mixed model)."""
        if self.moe is None and self.mla is None:
            return tuple(r for r in ROLES if (self.gated_ffn or r != "linear1_1")
                         and self.tag(r) is not None)
        found = {r for kind in self.layer_kinds() for r in self.kind_roles(kind)}
        return tuple(r for r in _ALL_ROLES if r in found)

    def layer_kinds(self) -> dict[str, int]:
        """Layer kind -> how many layers of it: ``"dense"`` and ``"moe"`` feed-forward."""
        if self.moe is None:
            return {"dense": self.layers}
        dense = len(self.moe.dense_layers)
        return {k: n for k, n in (("dense", dense), ("moe", self.layers - dense)) if n}

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index not in self.moe.dense_layers

    def kind_roles(self, kind: str) -> tuple[str, ...]:
        """Tag roles a layer of `kind` emits."""
        if kind not in ("dense", "moe"):
            raise ValueError(f"unknown layer kind {kind!r}; valid: 'dense', 'moe'")
        attn = ["input", "q_proj", "k_proj", "v_proj", "context", "o_proj"]
        if self.mla is not None:
            attn[1:1] = (["q_a", "q_a_norm"] if self.mla.q_lora_rank else []) + \
                ["kv_a", "kv_a_norm"]
        dense_ffn = ["linear1_0"] + (["linear1_1"] if self.gated_ffn else []) + ["linear2"]
        if kind == "dense":
            ffn = dense_ffn
        else:
            assert self.moe is not None
            ffn = ["gate_weights", "gate_assignment", "moe_linear1_0"] + (
                ["moe_linear1_1"] if self.gated_ffn else []) + ["moe_linear2"]
            if self.moe.shared_ffn:
                ffn += dense_ffn
        return tuple(r for r in attn + ffn if self.tag(r) is not None)

    def tag(self, role: str) -> str | None:
        """The name the host emits for `role` in this layer (None: not emitted)."""
        return self.tags.name(role, gated=self.gated_ffn, flash=self.flash_attention)

    def pattern(self, role: str) -> str | None:
        return self.tags.pattern(role, gated=self.gated_ffn, flash=self.flash_attention)

    def attention_params(self) -> int:
        """Parameters of one attention block (its norm not included)."""
        assert self.kv_heads is not None and self.head_dim is not None
        h, d = self.hidden, self.head_dim
        if self.mla is not None:
            m = self.mla
            q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * self.heads * m.qk_head_dim
                 if m.q_lora_rank else h * self.heads * m.qk_head_dim)
            kv = (h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
                  + m.kv_lora_rank * self.heads * (m.qk_nope_head_dim + m.v_head_dim))
            return q + kv + self.heads * m.v_head_dim * h
        attn = h * d * (2 * self.heads + 2 * self.kv_heads)
        if self.qkv_bias:
            attn += d * (self.heads + 2 * self.kv_heads)
        if self.qk_norm:
            attn += 2 * d
        return attn

    def ffn_params(self, kind: str = "dense") -> int:
        """Parameters of one feed-forward block of `kind` (``"dense"`` or ``"moe"``)."""
        mult = 3 if self.gated_ffn else 2
        if kind == "dense" or self.moe is None:
            return mult * self.hidden * self.ffn
        m, h = self.moe, self.hidden
        routed = m.experts * mult * h * m.expert_ffn + h * m.experts
        return (routed + (m.experts if m.router_bias else 0) + mult * h * m.shared_ffn
                + (h if m.shared_gate else 0))

    def params_per_layer(self, kind: str = "dense") -> int:
        norms = (4 if self.sandwich_norm else 2) * self.hidden * (1 if self.norm == "rms" else 2)
        return self.attention_params() + self.ffn_params(kind) + norms

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2) + self.hidden

    def param_count(self) -> int:
        """Every parameter: layers of each kind, embeddings (and the unembedding unless
        tied), the final norm. Hugging Face checkpoints' extra modules (DeepSeek-V3's
        multi-token-prediction layer) are not counted."""
        return sum(n * self.params_per_layer(k) for k, n in self.layer_kinds().items()) + \
            self.embedding_params()

    def active_param_count(self) -> int:
        """Parameters one token passes through (top-k routed experts, not all)."""
        if self.moe is None:
            return self.param_count()
        m, mult = self.moe, 3 if self.gated_ffn else 2
        idle = (m.experts - m.experts_per_token) * mult * self.hidden * m.expert_ffn
        return self.param_count() - self.layer_kinds().get("moe", 0) * idle


_OPTIMIZERS = ("adamw", "sgd")


def _integral_to_int(obj: Any, keys: tuple[str, ...]) -> None:
    """numpy integers (from a config, an array shape) become ints; bools stay, to be
    refused."""
    for key in keys:
        value = getattr(obj, key)
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
            object.__setattr__(obj, key, int(value))


_FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
_MAX_SIZE = 1 << 31  # bound on lengths, batches and degrees: beyond any job, still exact
_MAX_OPT_BYTES = 1024  # optimizer-state bytes per parameter (AdamW keeps 8 to 12)


@dataclass(frozen=True)
class StepShape:
    """One training step as one data-parallel replica sees it.

    `optimizer` is ``"adamw"`` (two float32 moments, plus a float32 master copy when
    parameters are not float32), ``"sgd"`` (no state) or a number: optimizer-state bytes
    per parameter.
    """

    seq_len: int
    micro_batch: int = 1
    activation_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    optimizer: str | float = "adamw"

    def __post_init__(self) -> None:
        _integral_to_int(self, ("seq_len", "micro_batch"))
        _positive("step shape", seq_len=self.seq_len, micro_batch=self.micro_batch)
        for key in ("seq_len", "micro_batch"):
            if getattr(self, key) > _MAX_SIZE:
                raise ValueError(f"step shape: {key}={getattr(self, key)} is beyond the "
                                 f"{_MAX_SIZE} this planner models; valid: 1-{_MAX_SIZE}")
        for key in ("activation_dtype", "param_dtype"):
            value = getattr(self, key)
            if not isinstance(value, str) or value.lower() not in _FLOAT_DTYPES:
                raise ValueError(f"step shape: {key}={value!r} is not a floating-point dtype "
                                 f"to train in; valid: {', '.join(_FLOAT_DTYPES)}")
        opt = self.optimizer
        if isinstance(opt, str):
            if opt not in _OPTIMIZERS:
                raise ValueError(
                    f"optimizer={opt!r} is not known; valid: "
                    f"{', '.join(_OPTIMIZERS)}, or optimizer-state bytes per parameter")
        elif (isinstance(opt, bool) or not isinstance(opt, numbers.Real)
              or not 0 <= opt <= _MAX_OPT_BYTES):  # NaN fails the comparison too
            raise ValueError(
                f"optimizer={opt!r}: give 'adamw', 'sgd' or optimizer-state bytes per "
                f"parameter, a finite number from 0 to {_MAX_OPT_BYTES}")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch

    def optimizer_bytes_per_param(self) -> float:
        if self.optimizer == "adamw":
            master = 0 if dtype_bytes(self.param_dtype) == 4 else 4
            return 8.0 + master
        if self.optimizer == "sgd":
            return 0.0
        return float(self.optimizer)


_SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Parallelism:
    """How the job is split over cores.

    Attributes:
        tp: tensor (model) parallel degree: heads and the feed-forward width are split.
        sequence_parallel: the layer input, norms and residual adds are split over the
            sequence across the `tp` group (Megatron-style); without it they are replicated.
        fsdp: fully-sharded data parallel degree (parameters, gradients and optimizer state
            sharded; the batch split); ``-1`` takes every core the other degrees leave.
        dp: plain data-parallel degree (replicated state).
        pp: pipeline stages; each core holds ``layers / pp`` layers.
        schedule: ``"1f1b"`` (a stage holds up to `pp` micro-batches in flight) or
            ``"gpipe"`` (all `microbatches` in flight).
        microbatches: micro-batches per step, for ``gpipe``.
        zero1: shard the optimizer state over `dp` as well.
        hosts: instances in the job, to resolve ``fsdp=-1`` and check the core count.
        ep: expert-parallel degree, carved out of the data-parallel cores (it divides
            ``fsdp x dp``): each core of an `ep` group holds ``experts / ep`` experts, and
            the group's tokens reach them by all-to-all. Expert weights are split over
            ``tp x ep`` and, beyond the group, over what fsdp has left
            (``fsdp / gcd(fsdp, ep)``).
    """

    tp: int = 1
    sequence_parallel: bool = False
    fsdp: int = 1
    dp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int | None = None
    zero1: bool = False
    hosts: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        _integral_to_int(self, ("tp", "fsdp", "dp", "pp", "hosts", "microbatches", "ep"))
        _positive("parallelism", tp=self.tp, dp=self.dp, pp=self.pp, hosts=self.hosts,
                  ep=self.ep)
        if self.fsdp != -1 or isinstance(self.fsdp, bool):
            _positive("parallelism", fsdp=self.fsdp)
        for key in ("tp", "fsdp", "dp", "pp", "hosts", "microbatches", "ep"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, bool) and isinstance(value, int) \
                    and value > _MAX_SIZE:
                raise ValueError(f"parallelism: {key}={value} is beyond any job; valid: "
                                 f"1-{_MAX_SIZE}")
        for key in ("sequence_parallel", "zero1"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"parallelism: {key}={getattr(self, key)!r} must be True or "
                                 "False")
        if not isinstance(self.schedule, str) or self.schedule not in _SCHEDULES:
            raise ValueError(
                f"pipeline schedule {self.schedule!r} is not known; valid: {', '.join(_SCHEDULES)}")
        if self.microbatches is not None:
            _positive("parallelism", microbatches=self.microbatches)
            if self.pp == 1:
                raise ValueError(
                    f"parallelism: microbatches={self.microbatches} applies to a pipeline, "
                    "but pp=1; set pp > 1 or leave microbatches unset")
        if self.schedule == "gpipe" and self.pp > 1 and self.microbatches is None:
            raise ValueError("schedule='gpipe' needs microbatches (how many are in flight)")

    @property
    def degree(self) -> int:
        if self.fsdp == -1:
            raise ValueError("fsdp=-1 is not resolved yet; call resolve(device)")
        return self.tp * self.fsdp * self.dp * self.pp

    @property
    def inflight(self) -> int:
        """Micro-batches whose activations one stage holds at once (1 without pipelining)."""
        if self.pp == 1:
            return 1
        if self.schedule == "gpipe":
            assert self.microbatches is not None
            return self.microbatches
        return min(self.pp, self.microbatches or self.pp)

    def resolve(self, device: DeviceSpec | None) -> Parallelism:
        """Fill ``fsdp=-1`` and check the degrees cover ``device.cores x hosts`` exactly."""
        total = device.cores * self.hosts if device is not None and device.cores else None
        if total is not None and total > _MAX_SIZE:
            raise ValueError(
                f"parallelism: {device.cores} cores x hosts={self.hosts} = {total} cores is "  # type: ignore[union-attr]
                f"beyond any job; valid: at most {_MAX_SIZE} cores in all")
        par = self
        if self.fsdp == -1:
            if total is None:
                raise ValueError("fsdp=-1 needs a device to know how many cores there are")
            rest = self.tp * self.dp * self.pp
            if total % rest:
                raise ValueError(
                    f"fsdp=-1: tp*dp*pp={rest} does not divide the {total} cores "
                    f"({device.cores} x {self.hosts} hosts)")  # type: ignore[union-attr]
            par = dataclasses.replace(self, fsdp=total // rest)
        if total is not None and par.degree != total:
            raise ValueError(
                f"parallel degrees tp={par.tp} x fsdp={par.fsdp} x dp={par.dp} x pp={par.pp} "
                f"= {par.degree}, but the job has {total} cores ({device.cores} per host x "  # type: ignore[union-attr]
                f"{self.hosts} hosts); make them multiply to {total} (fsdp=-1 fills the rest)")
        return par

    def check(self, config: TransformerConfig, shape: StepShape) -> None:
        """Raise ValueError when `config` cannot be split this way."""
        assert config.kv_heads is not None
        if config.heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide heads={config.heads}; valid tp: "
                f"{_divisors(config.heads)}")
        if config.kv_heads % self.tp and self.tp % config.kv_heads:
            raise ValueError(
                f"tp={self.tp} and kv_heads={config.kv_heads}: one must divide the other "
                "(kv heads are split, or replicated one per core)")
        if config.ffn % self.tp:
            raise ValueError(f"tp={self.tp} does not divide ffn={config.ffn}")
        if self.sequence_parallel and shape.seq_len % self.tp:
            raise ValueError(
                f"sequence_parallel needs seq_len={shape.seq_len} divisible by tp={self.tp}")
        if config.layers % self.pp:
            raise ValueError(
                f"pp={self.pp} does not divide layers={config.layers}; valid pp: "
                f"{_divisors(config.layers)}")
        self._check_experts(config)

    def expert_shards(self) -> int:
        """Cores one expert weight is split over (see `ep`)."""
        return self.tp * self.ep * (self.fsdp // math.gcd(self.fsdp, self.ep))

    def _check_experts(self, config: TransformerConfig) -> None:
        moe = config.moe
        if moe is None:
            if self.ep != 1:
                raise ValueError(f"ep={self.ep}: model {config.name!r} has no experts; "
                                 "expert parallelism needs a mixture-of-experts model")
            return
        if moe.experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide experts={moe.experts}; valid ep: "
                             f"{_divisors(moe.experts)}")
        if self.fsdp != -1 and (self.fsdp * self.dp) % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the data-parallel cores fsdp x dp "
                             f"= {self.fsdp * self.dp}; expert parallelism is carved out of them")
        for key, width in (("expert_ffn", moe.expert_ffn), ("shared_ffn", moe.shared_ffn)):
            if width % self.tp:
                raise ValueError(f"tp={self.tp} does not divide {key}={width}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 128) + 1) if n % d == 0)


# --------------------------------------------------------------------------------------
# Built-in models.
# --------------------------------------------------------------------------------------

_AXLEARN_FUJI = ("apple/axlearn axlearn/experiments/text/gpt/fuji.py (num_layers, "
                 "hidden_dim=128*heads, scaled_hidden_dim 8/3 or 3.5 rounded to 256, "
                 "VOCAB_SIZE, MAX_SEQUENCE_LENGTH)")
_HF_LLAMA3 = "Hugging Face meta-llama/Meta-Llama-3-{} config.json"


def _model(name: str, **kw: Any) -> TransformerConfig:
    # Long-sequence training uses a flash-attention kernel; the paper's GPT-3 layer does not.
    kw.setdefault("flash_attention", True)
    return TransformerConfig(name=name, **kw)


MODELS: dict[str, TransformerConfig] = {m.name: m for m in (
    _model("fuji-7b-v1", hidden=4096, heads=32, ffn=11008, layers=32, vocab=32768,
           tie_embeddings=True, default_seq_len=2048, source=_AXLEARN_FUJI),
    _model("fuji-7b-v2", hidden=4096, heads=32, ffn=11008, layers=32, vocab=32768,
           tie_embeddings=True, default_seq_len=4096, source=_AXLEARN_FUJI),
    _model("fuji-7b-v3", hidden=4096, heads=32, kv_heads=8, ffn=11008, layers=32,
           vocab=131072, tie_embeddings=True, default_seq_len=8192, source=_AXLEARN_FUJI),
    _model("fuji-70b-v1", hidden=8192, heads=64, ffn=28672, layers=80, vocab=32768,
           default_seq_len=2048, source=_AXLEARN_FUJI),
    _model("fuji-70b-v2", hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80,
           vocab=32768, default_seq_len=4096, source=_AXLEARN_FUJI),
    _model("fuji-70b-v3", hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80,
           vocab=131072, default_seq_len=8192, source=_AXLEARN_FUJI),
    _model("llama3-8b", hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=32,
           vocab=128256, default_seq_len=8192, source=_HF_LLAMA3.format("8B")),
    _model("llama3-70b", hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80,
           vocab=128256, default_seq_len=8192, source=_HF_LLAMA3.format("70B")),
    _model("gpt3-175b", hidden=12288, heads=96, ffn=4 * 12288, layers=96, vocab=51200,
           gated_ffn=False, norm="layer", activation="gelu", default_seq_len=2048,
           flash_attention=False,
           tie_embeddings=True,
           source="Brown et al. 2020; as configured in Korthikanti et al. 2022, Table 3"),
)}
_HF = "Hugging Face {} config.json"
for _m in (
    # All-MoE: 8 experts, top-2, every layer (intermediate_size is the expert width).
    _model("mixtral-8x7b", hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=32,
           vocab=32000, default_seq_len=4096,
           moe=MoEConfig(experts=8, experts_per_token=2, expert_ffn=14336),
           source=_HF.format("mistralai/Mixtral-8x7B-v0.1") + "; 46.7B total (Mistral AI)"),
    # MLA (q_lora_rank 1536, kv_lora_rank 512, 128+64 qk, 128 v), 256 routed experts top-8
    # plus one shared, first_k_dense_replace 3 (dense width 18432), sigmoid router with
    # noaux_tc bias. The 14B multi-token-prediction module is not counted (671B, not 685B).
    _model("deepseek-v3", hidden=7168, heads=128, ffn=18432, layers=61, vocab=129280,
           default_seq_len=4096,
           mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128),
           moe=MoEConfig(experts=256, experts_per_token=8, expert_ffn=2048, shared_ffn=2048,
                         dense_layers=(0, 1, 2), router="sigmoid", router_bias=True),
           source=_HF.format("deepseek-ai/DeepSeek-V3") + "; 671B total (model card)"),
    _model("qwen3-30b-a3b", hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144,
           layers=48, vocab=151936, qk_norm=True, default_seq_len=4096,
           moe=MoEConfig(experts=128, experts_per_token=8, expert_ffn=768),
           source=_HF.format("Qwen/Qwen3-30B-A3B") + "; 30.5B total (model card)"),
    # Text decoder only: 16 experts top-1 plus a shared expert in all 48 layers
    # (interleave_moe_layer_step 1), sigmoid router.
    _model("llama4-scout", hidden=5120, heads=40, kv_heads=8, head_dim=128, ffn=16384,
           layers=48, vocab=202048, default_seq_len=8192,
           moe=MoEConfig(experts=16, experts_per_token=1, expert_ffn=8192, shared_ffn=8192,
                         router="sigmoid"),
           source=_HF.format("meta-llama/Llama-4-Scout-17B-16E") + " text_config; 109B "
           "total with the vision encoder (model card)"),
):
    MODELS[_m.name] = _m
_ALIASES = {"fuji-7b": "fuji-7b-v3", "fuji-70b": "fuji-70b-v3", "mixtral": "mixtral-8x7b",
            "llama-4-scout": "llama4-scout"}


def get_model(name: str) -> TransformerConfig:
    """A built-in model by name (``fuji-70b`` is ``fuji-70b-v3``)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; built in: {', '.join([*MODELS, *_ALIASES])}; or load a "
            "Hugging Face config.json with from_hf_config")
    return MODELS[key]


_NOT_MODELLED = ("neuron-remat does not model it, and will not plan it as a dense model: "
                 "measure the real layer with traced_footprint(fn, *args), or check the "
                 "compiled step with fit")
_SSM_TYPES = {"mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba",
              "recurrent_gemma", "rwkv", "falcon_h1", "nemotron_h", "granitemoehybrid", "lfm2"}
_ENC_DEC_TYPES = {"t5", "mt5", "umt5", "bart", "mbart", "whisper", "pegasus", "marian",
                  "led", "longt5", "switch_transformers", "encoder-decoder", "prophetnet"}
_SSM_KEYS = re.compile(r"ssm|mamba|state_size|conv_kernel|time_step|d_state|rnn|recurrent")
_ENC_DEC_KEYS = ("is_encoder_decoder", "encoder_layers", "num_decoder_layers",
                 "decoder_layers", "encoder_attention_heads", "d_model")
_VISION_KEYS = ("vision_config", "vision_tower", "mm_projector_type", "image_token_index",
                "image_token_id", "vision_feature_layer", "audio_config")
_STRUCTURE_KEYS = re.compile(
    r"expert|moe|router|lora_rank|nope|rope_head|v_head_dim|dense_replace|sparse_step|"
    r"mlp_only|topk|n_group|nextn|intermediate_size_mlp")
_GENERIC_KEYS = frozenset((
    "architectures", "model_type", "_name_or_path", "torch_dtype", "dtype",
    "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "use_cache", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "layer_norm_eps",
    "attention_dropout", "attention_bias", "mlp_bias", "hidden_act", "hidden_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "num_hidden_layers", "vocab_size", "pretraining_tp", "hidden_dropout", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "output_attentions",
    "output_hidden_states", "return_dict", "quantization_config", "auto_map"))
_FAMILIES: dict[str, dict[str, Any]] = {
    # model_type: defaults as each family's transformers config class sets them.
    "llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True},
    "gemma": {"tie": True, "act": "gelu_pytorch_tanh"},
    "gemma2": {"tie": True, "act": "gelu_pytorch_tanh", "sandwich_norm": True},
    "gemma3_text": {"tie": True, "act": "gelu_pytorch_tanh", "sandwich_norm": True,
                    "qk_norm": True},
    "mixtral": {"moe": "mixtral"}, "qwen2_moe": {"moe": "qwen2_moe", "qkv_bias": True},
    "qwen3_moe": {"moe": "qwen3_moe", "qk_norm": True},
    "deepseek_v2": {"moe": "deepseek", "mla": True},
    "deepseek_v3": {"moe": "deepseek", "mla": True},
    "llama4_text": {"moe": "llama4"},
    # OLMo 2: q/k RMS norms over the whole projection (not per head) and its two norms
    # after attention and the FFN instead of before: the same norms and bytes as qk_norm on
    # a Llama layer; parameters differ by (heads + kv_heads - 2) x head_dim per layer.
    "olmo2": {"qk_norm": True},
}
# The other spellings transformers' config classes accept for a field the loader reads
# (each class's ``attribute_map``: either key sets the same attribute, and a config.json
# written by transformers may carry either). huggingface/transformers commit
# 008e574391258935f3ecc3035c882e73bbcac419, src/transformers/models/*/configuration_*.py;
# the base PreTrainedConfig's map is empty and the dense families here add none.
_SPELLINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "mixtral": {"num_local_experts": ("num_experts",)},
    "qwen3_moe": {"num_experts": ("num_local_experts",)},
    "deepseek_v2": {"n_routed_experts": ("num_experts",)},
    "deepseek_v3": {"n_routed_experts": ("num_local_experts",)},
}
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu",
                   "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                   "gelu_fast": "gelu_tanh", "gelu_python": "gelu", "relu": "relu"}
_MAX_SIZE = 1 << 31  # no published model comes near; bounds every loop and product
_REQUIRED = object()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Fields:
    """Typed reads of a config.json dict; every error names the key, the file and what
    is valid."""

    def __init__(self, cfg: Mapping[str, Any], source: str,
                 spellings: Mapping[str, tuple[str, ...]] | None = None) -> None:
        self.source = source
        self.cfg = _respell(cfg, spellings or {}, source)

    def _fail(self, key: str, value: Any, valid: str) -> ValueError:
        return ValueError(f"{self.source}: {key}={_short(value)} is not valid; {valid}")

    def int(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        if key not in self.cfg or (self.cfg[key] is None and default is not _REQUIRED):
            if default is _REQUIRED:
                raise ValueError(f"{self.source}: lacks {key} (an integer >= {minimum})")
            return default
        value = self.cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or \
                not minimum <= value < _MAX_SIZE:
            raise self._fail(key, value, f"give an integer from {minimum} to {_MAX_SIZE - 1}"
                             " (a JSON number, not a string or float)")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(key, value, "give true or false (a JSON boolean, not a string)")
        return value

    def str(self, key: str, default: str | None = None) -> str | None:
        value = self.cfg.get(key)
        if value is None:
            return default
        if value is not None and not isinstance(value, str):
            raise self._fail(key, value, "give a string")
        return value

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.cfg.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0 < value < 1e6:
            raise self._fail(key, value, "give a number > 0")
        return float(value)

    def int_list(self, key: str) -> list[int]:
        value = self.cfg.get(key) or []
        if not isinstance(value, list) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < _MAX_SIZE
                for i in value):
            raise self._fail(key, value, "give a list of layer indices")
        return value


def _respell(cfg: Mapping[str, Any], spellings: Mapping[str, tuple[str, ...]],
             source: str) -> Mapping[str, Any]:
    """`cfg` with each field under the key the loader reads, whichever of transformers'
    spellings it was written with; two spellings with different values are an error."""
    out = dict(cfg)
    for key, others in spellings.items():
        given = [(k, cfg[k]) for k in (key, *others) if cfg.get(k) is not None]
        if len({json.dumps(v, sort_keys=True, default=repr) for _, v in given}) > 1:
            shown = ", ".join(f"{k}={_short(v)}" for k, v in given)
            raise ValueError(f"{source}: {shown} are one setting spelled two ways, with "
                             "different values; keep one")
        if given:
            out[key] = given[0][1]
    return out


def _refuse(source: str, what: str) -> ValueError:
    return ValueError(f"{source}: {what}; {_NOT_MODELLED}")


def _check_modelled(cfg: Mapping[str, Any], source: str, model_type: str,
                    text_only: bool) -> Mapping[str, Any] | None:
    """Refuse architectures this package does not model. Returns the text model's config
    when `text_only` picks it out of a multimodal one."""
    if model_type in _SSM_TYPES or any(_SSM_KEYS.search(k) for k in cfg):
        keys = sorted(k for k in cfg if _SSM_KEYS.search(k))
        return _raise(_refuse(source, f"model_type {model_type!r} is a state-space (Mamba/"
                              f"SSM) or recurrent model (keys {keys[:4]})"))
    if model_type in _ENC_DEC_TYPES or cfg.get("is_encoder_decoder") is True or any(
            k in cfg for k in _ENC_DEC_KEYS[1:]):
        return _raise(_refuse(source, f"model_type {model_type!r} is an encoder-decoder model"))
    vision = [k for k in _VISION_KEYS if k in cfg]
    if vision or "text_config" in cfg:
        text = cfg.get("text_config")
        if text_only and isinstance(text, Mapping):
            return text
        what = (f"model_type {model_type!r} has a vision or audio tower ({', '.join(vision)})"
                if vision else f"model_type {model_type!r} nests its model in text_config")
        hint = (" (to plan its text decoder alone: --text-only on the command line, "
                "text_only=True in Python)" if isinstance(text, Mapping) else "")
        return _raise(_refuse(source, what + hint))
    return None


def _raise(err: Exception) -> Any:
    raise err


def _hf_moe(f: _Fields, kind: str, layers: int) -> MoEConfig:
    cap = f.number("capacity_factor")
    if kind == "mixtral":
        return MoEConfig(experts=f.int("num_local_experts"),
                         experts_per_token=f.int("num_experts_per_tok"),
                         expert_ffn=f.int("intermediate_size"), capacity_factor=cap)
    if kind in ("qwen2_moe", "qwen3_moe"):
        step = f.int("decoder_sparse_step", 1)
        only = set(f.int_list("mlp_only_layers"))
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
        shared = f.int("shared_expert_intermediate_size", 0, minimum=0) \
            if kind == "qwen2_moe" else 0
        return MoEConfig(experts=f.int("num_experts"),
                         experts_per_token=f.int("num_experts_per_tok"),
                         expert_ffn=f.int("moe_intermediate_size"), shared_ffn=shared,
                         dense_layers=dense, capacity_factor=cap, shared_gate=shared > 0)
    if kind == "deepseek":
        first = f.int("first_k_dense_replace", 0, minimum=0)
        freq = f.int("moe_layer_freq", 1)
        scoring = f.str("scoring_func", "softmax")
        if scoring not in _ROUTERS:
            raise f._fail("scoring_func", scoring, f"valid: {', '.join(_ROUTERS)}")
        assert scoring is not None
        width = f.int("moe_intermediate_size")
        return MoEConfig(experts=f.int("n_routed_experts"),
                         experts_per_token=f.int("num_experts_per_tok"), expert_ffn=width,
                         shared_ffn=f.int("n_shared_experts", 0, minimum=0) * width,
                         dense_layers=tuple(i for i in range(layers) if i < first or i % freq),
                         capacity_factor=cap, router=scoring,
                         router_bias=f.str("topk_method", "greedy") == "noaux_tc")
    assert kind == "llama4"
    step = f.int("interleave_moe_layer_step", 1)
    moe_layers = set(f.int_list("moe_layers")) if f.cfg.get("moe_layers") is not None \
        else set(range(step - 1, layers, step))
    width = f.int("intermediate_size")
    return MoEConfig(experts=f.int("num_local_experts"),
                     experts_per_token=f.int("num_experts_per_tok"), expert_ffn=width,
                     shared_ffn=width,
                     dense_layers=tuple(i for i in range(layers) if i not in moe_layers),
                     capacity_factor=cap, router="sigmoid")


def from_hf_config(cfg: Mapping[str, Any], *, name: str | None = None,
                   source: str = "config.json", text_only: bool = False,
                   **overrides: Any) -> TransformerConfig:
    """A `TransformerConfig` from a Hugging Face ``config.json`` dict.

    Families read with their own keys and defaults (activation, tied embeddings, norms,
    biases): ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``,
    ``gemma3_text``; mixture of experts ``mixtral``, ``qwen2_moe``, ``qwen3_moe``,
    ``llama4_text``; latent attention and experts ``deepseek_v2``, ``deepseek_v3``. Another
    ``model_type`` is read as a Llama-like dense model only when it has no key outside the
    generic ones. State-space, encoder-decoder and multimodal models are refused (a
    multimodal one's text decoder is planned with ``text_only=True``); so is any key naming
    a structure (experts, latent ranks) the family does not have. Every value is
    type-checked: an error names the key, `source` and what is valid.

    ``config.json`` does not say which attention kernel training uses; like the built-in
    models this assumes a flash-attention kernel (``flash_attention=False`` for plain
    attention). Nor does it give the training sequence length, so plans need an explicit
    `StepShape`.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{source}: holds {_short(cfg)}, not a JSON object of model settings")
    try:
        return _from_hf_config(cfg, name, source, text_only, overrides)
    except ValueError as err:
        text = str(err)
        raise ValueError(text if text.startswith(source) else f"{source}: {text}") from None


def _from_hf_config(cfg: Mapping[str, Any], name: str | None, source: str, text_only: bool,
                    overrides: dict[str, Any]) -> TransformerConfig:
    model_type = _Fields(cfg, source).str("model_type", "") or ""
    f = _Fields(cfg, source, _SPELLINGS.get(model_type))
    text = _check_modelled(cfg, source, model_type, text_only)
    if text is not None:
        return from_hf_config(text, name=name or f.str("_name_or_path"),
                              source=f"{source} text_config", **overrides)
    family = _FAMILIES.get(model_type)
    if family is None:
        unknown = sorted(k for k in cfg if k not in _GENERIC_KEYS)
        if unknown:
            shown = ", ".join(unknown[:6]) + (", ..." if len(unknown) > 6 else "")
            raise _refuse(source, f"model_type {model_type or '(none)'!r} is not a known "
                          f"family and has keys it does not know ({shown}); known families: "
                          f"{', '.join(_FAMILIES)}")
        family = {}
        _warn_once_per_type(model_type, source)
    structural = sorted(k for k in cfg if _STRUCTURE_KEYS.search(k))
    if structural and "moe" not in family and not family.get("mla"):
        raise _refuse(source, f"model_type {model_type!r} is dense, but the config has "
                      f"{', '.join(structural[:4])}")
    layers = f.int("num_hidden_layers")
    act_key = "hidden_activation" if model_type.startswith("gemma") and \
        cfg.get("hidden_activation") is not None else "hidden_act"
    act_name = f.str(act_key, family.get("act", "silu"))
    if act_name not in _HF_ACTIVATIONS:
        raise f._fail(act_key, act_name, f"valid: {', '.join(_HF_ACTIVATIONS)}")
    assert act_name is not None
    mla = None
    if family.get("mla"):
        mla = MLAConfig(kv_lora_rank=f.int("kv_lora_rank"),
                        qk_nope_head_dim=f.int("qk_nope_head_dim"),
                        qk_rope_head_dim=f.int("qk_rope_head_dim"),
                        v_head_dim=f.int("v_head_dim"),
                        q_lora_rank=f.int("q_lora_rank", 0, minimum=0))
    moe = _hf_moe(f, family["moe"], layers) if "moe" in family else None
    ffn_key = "intermediate_size_mlp" if family.get("moe") == "llama4" else "intermediate_size"
    kw: dict[str, Any] = dict(
        hidden=f.int("hidden_size"), heads=f.int("num_attention_heads"),
        kv_heads=f.int("num_key_value_heads", None), head_dim=f.int("head_dim", None),
        ffn=f.int(ffn_key), layers=layers, vocab=f.int("vocab_size"),
        tie_embeddings=f.bool("tie_word_embeddings", family.get("tie", False)),
        activation=_HF_ACTIVATIONS[act_name],
        name=name or f.str("_name_or_path") or model_type or "hf-model",
        source=source, flash_attention=True, moe=moe, mla=mla,
        qkv_bias=f.bool("attention_bias", family.get("qkv_bias", False)),
        qk_norm=family.get("qk_norm", False),
        sandwich_norm=family.get("sandwich_norm", False),
        **_hf_positions(f, layers, model_type),
    )
    if mla is not None:
        kw["head_dim"] = None  # MLA's per-head q/k width is nope + rope
    kw.update(overrides)
    return TransformerConfig(**kw)


_WARNED_TYPES: set[str] = set()


def _warn_once_per_type(model_type: str, source: str) -> None:
    if model_type in _WARNED_TYPES:
        return
    _WARNED_TYPES.add(model_type)
    logger.warning("%s: model_type %r is not a family neuron_remat knows (%s); it is planned "
                   "as a Llama-like dense layer (norms before attention and FFN, no q/k "
                   "norms); if its layer differs, measure it with traced_footprint", source,
                   model_type or "(none)", ", ".join(_FAMILIES))


def _hf_positions(f: _Fields, layers: int, model_type: str) -> dict[str, Any]:
    """max_position_embeddings, and the sliding window where the config turns it on
    (Qwen's ``use_sliding_window``; Gemma's and Qwen2-MoE's ``layer_types``)."""
    out: dict[str, Any] = {"max_positions": f.int("max_position_embeddings", None)}
    window = f.int("sliding_window", None, minimum=0) or None
    if window is not None and f.bool("use_sliding_window", True):
        kinds = f.cfg.get("layer_types")
        count = None
        if isinstance(kinds, list) and all(isinstance(k, str) for k in kinds):
            count = sum(k == "sliding_attention" for k in kinds)
            window = window if count else None
        elif model_type == "gemma2":  # transformers' default: every other layer, from 0
            count = (layers + 1) // 2
        elif model_type == "gemma3_text":  # all but every `sliding_window_pattern`-th
            count = layers - layers // f.int("sliding_window_pattern", 6)
        out.update(sliding_window=window, sliding_layers=count if window else None)
    return out


def shape_notes(config: TransformerConfig, shape: StepShape) -> tuple[str, ...]:
    """What a plan for `shape` must say about sequence lengths the config bounds: a
    `seq_len` past ``max_position_embeddings``, and a sliding window shorter than it (not
    modelled: attention is planned as full causal attention, an upper bound)."""
    notes = []
    seq = shape.seq_len
    if config.max_positions is not None and seq > config.max_positions:
        notes.append(f"seq_len {seq} is past {config.name}'s max_position_embeddings "
                     f"{config.max_positions} ({config.source or 'its config'}): the model "
                     "was not trained on positions that far; planned as asked")
    if config.sliding_window is not None and seq > config.sliding_window:
        which = ("every layer" if config.sliding_layers is None
                 else f"{config.sliding_layers} of {config.layers} layers")
        notes.append(f"sliding_window {config.sliding_window} ({which}) is shorter than "
                     f"seq_len {seq} and is not modelled: attention is planned as full "
                     "causal attention (an upper bound on its memory and FLOPs)")
    return tuple(notes)


def load_hf_config(path: str | os.PathLike[str], *, name: str | None = None,
                   text_only: bool = False, **overrides: Any) -> TransformerConfig:
    """Read a Hugging Face ``config.json`` file (see `from_hf_config`). A missing, empty
    or non-JSON file is a one-line error naming it."""
    where = os.fspath(path)
    if not os.path.exists(where):
        raise ValueError(f"config file {where!r}: no such file; give a config.json path")
    if os.path.isdir(where):
        inner = os.path.join(where, "config.json")
        if not os.path.isfile(inner):
            raise ValueError(f"{where!r} is a directory without a config.json")
        where = inner
    if not os.path.isfile(where):
        raise ValueError(f"config file {where!r} is not a regular file; give a config.json")
    try:
        with open(where, "rb") as fh:
            raw = fh.read(16 << 20)
    except OSError as err:
        raise ValueError(f"config file {where!r} cannot be read: {err.strerror}") from None
    if len(raw) >= 16 << 20:
        raise ValueError(f"config file {where!r} is over 16 MiB: not a config.json")
    if not raw.strip():
        raise ValueError(f"config file {where!r} is empty; expected a Hugging Face "
                         "config.json (a JSON object)")
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"config file {where!r} is not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"config file {where!r} nests JSON too deeply to be a config.json") \
            from None
    except ValueError as err:
        raise ValueError(f"config file {where!r} is not JSON: {err.msg} at line "
                         f"{err.lineno} column {err.colno}") from None  # type: ignore[attr-defined]
    if name is None:
        base = os.path.basename(where)
        name = os.path.basename(os.path.dirname(os.path.abspath(where))) \
            if base == "config.json" else base
    return from_hf_config(cfg, name=name, source=where, text_only=text_only, **overrides)
