"""One training step as a data-parallel replica sees it (`StepShape`), and how the job is
split over cores (`Parallelism`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from ..device import DeviceSpec
from .config import TransformerConfig, _positive, dtype_bytes

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
                    f"fsdp=-1: tp*dp*pp={rest} (tp={self.tp}, dp={self.dp}, pp={self.pp}) "
                    f"does not divide the {total} cores ({device.cores} x {self.hosts} "  # type: ignore[union-attr]
                    f"hosts); valid products: {_divisors(total)}")
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
                f"sequence_parallel needs seq_len={shape.seq_len} divisible by tp={self.tp}; "
                "choose such a tp or turn sequence parallelism off (sequence_parallel=False, "
                "--no-sequence-parallel)")
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


def shape_notes(config: TransformerConfig, shape: StepShape) -> tuple[str, ...]:
    """What a plan for `shape` must say about sequence lengths the config bounds: a
    `seq_len` past ``max_position_embeddings``, and a sliding window shorter than it (not
    modelled: attention is planned as full causal attention, an upper bound)."""
    notes = []
    seq = shape.seq_len
    if config.limits.max_positions is not None and seq > config.limits.max_positions:
        notes.append(f"seq_len {seq} is past {config.name}'s max_position_embeddings "
                     f"{config.limits.max_positions} ({config.source or 'its config'}): the model "
                     "was not trained on positions that far; planned as asked")
    if config.limits.sliding_window is not None and seq > config.limits.sliding_window:
        which = ("every layer" if config.limits.sliding_layers is None
                 else f"{config.limits.sliding_layers} of {config.layers} layers")
        notes.append(f"sliding_window {config.limits.sliding_window} ({which}) is shorter than "
                     f"seq_len {seq} and is not modelled: attention is planned as full "
                     "causal attention (an upper bound on its memory and FLOPs)")
    return tuple(notes)
