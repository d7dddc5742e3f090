"""What one decoder layer looks like, as far as activation memory is concerned:
`TransformerConfig`, composed of its family extras: `MoEConfig` (mixture-of-experts
feed-forward blocks), `MLAConfig` (multi-head latent attention), `LayerDetails` (biases and
extra norms some families have, which change parameter counts only) and `ContextLimits`
(what a ``config.json`` says of sequence lengths)."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

from .tags import _ALL_ROLES, AXLEARN_TAGS, ROLES, TagNames

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
class LayerDetails:
    """Per-family details of a layer that change its parameter count (and so the model
    state), not the activations planned.

    Attributes:
        qkv_bias: biases on the q, k and v projections (Qwen2, Qwen2.5, Qwen2-MoE).
        qk_norm: RMS norms on q and k per head (Qwen3, Gemma 3, OLMo 2).
        sandwich_norm: norms after attention and the feed-forward block too (Gemma 2/3).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False

    def __post_init__(self) -> None:
        for key in ("qkv_bias", "qk_norm", "sandwich_norm"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"layer details: {key}={getattr(self, key)!r} must be True "
                                 "or False")


@dataclass(frozen=True)
class ContextLimits:
    """What a ``config.json`` says of sequence lengths (None: not said). Not modelled, but
    `shape_notes` tells a plan when its ``seq_len`` goes past them.

    Attributes:
        max_positions: ``max_position_embeddings``.
        sliding_window: the window of the sliding-window attention layers.
        sliding_layers: how many layers use it (None: all of them).
    """

    max_positions: int | None = None
    sliding_window: int | None = None
    sliding_layers: int | None = None

    def __post_init__(self) -> None:
        for key in ("max_positions", "sliding_window", "sliding_layers"):
            if getattr(self, key) is not None:
                _positive("context limits", **{key: getattr(self, key)})


_FLAT_EXTRAS = {"qkv_bias": "details", "qk_norm": "details", "sandwich_norm": "details",
                "max_positions": "limits", "sliding_window": "limits",
                "sliding_layers": "limits"}
"""`TransformerConfig` keywords kept from before the extras were composed: each sets that
field of its group (``TransformerConfig(qk_norm=True)`` is
``TransformerConfig(details=LayerDetails(qk_norm=True))``) and reads back as a property."""


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer, as far as activation memory is concerned.

    `kv_heads` defaults to `heads` (multi-head attention) and `head_dim` to
    ``hidden // heads``. `flash_attention` means the attention kernel keeps no
    ``seq x seq`` probabilities: its backward recomputes them from q, k, v, its output and
    the float32 log-sum-exp. `fused_qkv` means one matmul produces q, k and v together
    (axlearn's ``FusedQKVLinear``/``FusedGroupedQKVLinear``), which are then sliced out and
    tagged: saving one slice avoids no matmul, saving all three avoids it.

    Family extras are composed, not flattened: `moe` (None: a dense feed-forward block),
    `mla` (None: grouped-query attention), `details` and `limits`. The keywords
    ``qkv_bias``, ``qk_norm``, ``sandwich_norm``, ``max_positions``, ``sliding_window`` and
    ``sliding_layers`` are still accepted and read, as shorthands for their group's field.
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
    # The family extras.
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    details: LayerDetails = LayerDetails()
    limits: ContextLimits = ContextLimits()

    def __post_init__(self) -> None:
        _positive(f"model {self.name!r}", hidden=self.hidden, heads=self.heads)
        for key, kind in (("moe", MoEConfig), ("mla", MLAConfig), ("details", LayerDetails),
                          ("limits", ContextLimits)):
            value = getattr(self, key)
            if not (isinstance(value, kind) or (value is None and key in ("moe", "mla"))):
                raise ValueError(f"model {self.name!r}: {key}={value!r} is not a "
                                 f"{kind.__name__}")
        for key in ("kv_heads", "head_dim"):
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

    # The flat spellings of the extras (see `_FLAT_EXTRAS`).
    qkv_bias = property(lambda self: self.details.qkv_bias, doc="`LayerDetails.qkv_bias`")
    qk_norm = property(lambda self: self.details.qk_norm, doc="`LayerDetails.qk_norm`")
    sandwich_norm = property(lambda self: self.details.sandwich_norm,
                             doc="`LayerDetails.sandwich_norm`")
    max_positions = property(lambda self: self.limits.max_positions,
                             doc="`ContextLimits.max_positions`")
    sliding_window = property(lambda self: self.limits.sliding_window,
                              doc="`ContextLimits.sliding_window`")
    sliding_layers = property(lambda self: self.limits.sliding_layers,
                              doc="`ContextLimits.sliding_layers`")

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
        if self.details.qkv_bias:
            attn += d * (self.heads + 2 * self.kv_heads)
        if self.details.qk_norm:
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
        norms = (4 if self.details.sandwich_norm else 2) * self.hidden * (
            1 if self.norm == "rms" else 2)
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


def _accept_flat_extras(init: Any) -> Any:
    """Wrap the generated ``__init__`` so that the flat keywords of `_FLAT_EXTRAS` build
    (or update) the group they belong to."""

    @functools.wraps(init)
    def __init__(self: TransformerConfig, *args: Any, **kw: Any) -> None:
        groups: dict[str, dict[str, Any]] = {}
        for key in [k for k in kw if k in _FLAT_EXTRAS]:
            groups.setdefault(_FLAT_EXTRAS[key], {})[key] = kw.pop(key)
        for group, values in groups.items():
            base = kw.get(group, LayerDetails() if group == "details" else ContextLimits())
            try:
                kw[group] = dataclasses.replace(base, **values)
            except (ValueError, TypeError) as err:
                raise ValueError(f"model {kw.get('name', 'custom')!r}: {err}") from None
        init(self, *args, **kw)

    return __init__


TransformerConfig.__init__ = (  # type: ignore[method-assign]
    _accept_flat_extras(TransformerConfig.__init__))
