"""Model, step and parallelism descriptions, the built-in models and the Hugging Face
``config.json`` loader.

A `TransformerConfig` says what one decoder layer looks like as far as activation memory
is concerned; `StepShape` is one training step as a data-parallel replica sees it;
`Parallelism` is how the job is split over cores. `TagNames` is what a host library calls
each checkpointed value of a layer.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .device import DeviceSpec

__all__ = [
    "AXLEARN_NEURON_TAGS",
    "AXLEARN_TAGS",
    "MAXTEXT_TAGS",
    "MODELS",
    "ROLES",
    "Parallelism",
    "StepShape",
    "TagNames",
    "TransformerConfig",
    "dtype_bytes",
    "from_hf_config",
    "get_model",
    "host_tags",
]

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "bool": 1,
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

    def name(self, role: str, *, gated: bool = True, flash: bool = False) -> str | None:
        if role not in ROLES:
            raise ValueError(f"unknown tag role {role!r}; valid: {', '.join(ROLES)}")
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
kernel: see `AXLEARN_NEURON_TAGS`)."""

AXLEARN_NEURON_TAGS = TagNames(vocabulary="axlearn-neuron", flash_context=None)
"""What axlearn's layer emits on a Neuron device (apple/axlearn 34aed43c): its
``FlashAttention`` layer hands attention to the NKI kernel
(``flash_attention/neuron_attention.py``, a ``custom_vjp`` with no ``checkpoint_name``) and
does not tag ``context`` (``flash_attention/layer.py`` ``_compute_attention``); only the GPU
and TPU kernels tag ``flash_residuals``. So under any names policy the kernel's forward is
recomputed in the backward. Native attention (``MultiheadAttention``,
``GroupedQueryAttention``) still tags ``context``."""


def host_tags(tags: TagNames, device: DeviceSpec | None) -> TagNames:
    """The vocabulary the host really emits on `device`: axlearn's names on a Neuron device
    are `AXLEARN_NEURON_TAGS` (no flash-attention tag); anything else is returned as is."""
    if device is not None and device.is_neuron and tags == AXLEARN_TAGS:
        return AXLEARN_NEURON_TAGS
    return tags


MAXTEXT_TAGS = TagNames(
    vocabulary="maxtext", input="decoder_layer_input", q_proj="query_proj",
    k_proj="key_proj", v_proj="value_proj", context="attention_out", o_proj="out_proj",
    linear1_0="mlpwi_0", linear1_1="mlpwi_1", linear1_ungated="mlpwi", linear2="mlpwo",
    flash_context="context", prefixed=False,
)
"""MaxText's names (``layers/attentions.py``, ``layers/linears.py``, ``decoders.py``): the
attention output before the output projection is ``attention_out``; ``context`` is the
flash kernels' output and log-sum-exp (cuDNN and TPU splash paths only)."""


# --------------------------------------------------------------------------------------
# Model, step and parallelism descriptions.
# --------------------------------------------------------------------------------------


def _positive(owner: str, **values: Any) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: {key} must be a positive integer, got {value!r}")


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
    activation: Literal["silu", "gelu"] = "silu"
    causal: bool = True
    tie_embeddings: bool = False
    tags: TagNames = AXLEARN_TAGS
    name: str = "custom"
    source: str = ""
    default_seq_len: int | None = None
    fused_qkv: bool = False

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
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
        if self.activation not in ("silu", "gelu"):
            raise ValueError(
                f"model {self.name!r}: activation={self.activation!r}; valid: 'silu', 'gelu'")

    @property
    def roles(self) -> tuple[str, ...]:
        """Tag roles this layer emits."""
        return tuple(r for r in ROLES if (self.gated_ffn or r != "linear1_1")
                     and self.tag(r) is not None)

    def tag(self, role: str) -> str | None:
        """The name the host emits for `role` in this layer (None: not emitted)."""
        return self.tags.name(role, gated=self.gated_ffn, flash=self.flash_attention)

    def pattern(self, role: str) -> str | None:
        return self.tags.pattern(role, gated=self.gated_ffn, flash=self.flash_attention)

    def params_per_layer(self) -> int:
        assert self.kv_heads is not None and self.head_dim is not None
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        ffn = (3 if self.gated_ffn else 2) * self.hidden * self.ffn
        norms = self.hidden * (2 if self.norm == "rms" else 4)
        return attn + ffn + norms

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2) + self.hidden

    def param_count(self) -> int:
        return self.layers * self.params_per_layer() + self.embedding_params()


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

    def __post_init__(self) -> None:
        _integral_to_int(self, ("tp", "fsdp", "dp", "pp", "hosts", "microbatches"))
        _positive("parallelism", tp=self.tp, dp=self.dp, pp=self.pp, hosts=self.hosts)
        if self.fsdp != -1 or isinstance(self.fsdp, bool):
            _positive("parallelism", fsdp=self.fsdp)
        for key in ("tp", "fsdp", "dp", "pp", "hosts", "microbatches"):
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


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 128)


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
_ALIASES = {"fuji-7b": "fuji-7b-v3", "fuji-70b": "fuji-70b-v3"}


def get_model(name: str) -> TransformerConfig:
    """A built-in model by name (``fuji-70b`` is ``fuji-70b-v3``)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; built in: {', '.join([*MODELS, *_ALIASES])}; or load a "
            "Hugging Face config.json with from_hf_config")
    return MODELS[key]


def from_hf_config(cfg: Mapping[str, Any], *, name: str | None = None,
                   **overrides: Any) -> TransformerConfig:
    """A `TransformerConfig` from a Hugging Face style ``config.json`` dict (Llama-like:
    gated SiLU feed-forward, RMS norm). ``config.json`` does not say which attention kernel
    training uses; like the built-in models this assumes a flash-attention kernel, so pass
    ``flash_attention=False`` for plain attention. Nor does it give the training sequence
    length (``max_position_embeddings`` is the longest the model supports), so plans need
    an explicit `StepShape`."""
    required = ("hidden_size", "num_attention_heads", "intermediate_size",
                "num_hidden_layers", "vocab_size")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)} (needs {', '.join(required)})")
    act = str(cfg.get("hidden_act", "silu")).lower()
    kw: dict[str, Any] = dict(
        hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"],
        kv_heads=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
        ffn=cfg["intermediate_size"], layers=cfg["num_hidden_layers"],
        vocab=cfg["vocab_size"], tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        activation="gelu" if act.startswith("gelu") else "silu",
        name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "hf-model"),
        source="config.json", flash_attention=True,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)
