"""Read what a plan needs from an axlearn trainer config, without importing axlearn.

The reader walks the config by attribute, as axlearn's own ``get_recursively`` does, and
knows axlearn's classes by name (and by the names in their MRO, so subclasses count). The
attribute paths and class names follow apple/axlearn at commit
34aed43c1b6e581c4753d06d7cbeedd5010ef26b (July 2026):

* ``axlearn/experiments/text/gpt/common.py``: ``get_trainer_config_fn`` (``train_dtype``,
  ``input.input_dispatcher.global_logical_batch_size``, ``mesh_shape``,
  ``mesh_axis_names``), ``model_config`` (``model.decoder.dim``, ``vocab_size``,
  ``transformer.num_layers``, ``transformer.layer``), ``scaled_hidden_dim`` (``scale_fn``);
* ``axlearn/experiments/text/gpt/fuji.py``: ``model_config`` (attention class,
  ``RoFormerQKVLinear`` wrapping a fused or grouped QKV linear, ``("nn.silu", "linear")``,
  ``RMSNorm``, ``lm_head`` None when shared) and the TRN2 mesh rules;
* ``axlearn/common/attention.py``: the QKV linear classes, ``per_head_dim`` (``hidden_dim or
  query_dim`` over ``num_heads``), ``TransformerFeedForwardLayer`` (``hidden_dim`` int or
  function config, ``activation`` str or pair), ``_remat_name`` prefixes.

Every value read is recorded with its path, and a missing or unreadable one is a
`ConfigReadError` naming that path.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import models
from ..device import DeviceSpec

__all__ = ["STACK_PATH", "ConfigReadError", "TrainerDescription", "describe_trainer",
           "stack_kind"]

STACK_PATH = "model.decoder.transformer"

_FLASH = ("FlashAttention",)
_NATIVE = ("MultiheadAttention", "GroupedQueryAttention")
# QKV linear class -> (fused, has num_kv_heads)
_QKV = {"FusedGroupedQKVLinear": (True, True), "FusedQKVLinear": (True, False),
        "GroupedQKVLinear": (False, True), "QKVLinear": (False, False)}
_QKV_WRAPPERS = ("RoFormerQKVLinear",)
_NORMS = {"RMSNorm": "rms", "LayerNorm": "layer"}
# The dense feed-forward the model describes; axlearn's mixture of experts
# (mixture_of_experts.py's TransformerFeedForwardMoE) is another class, with its own tags.
_FFN = ("TransformerFeedForwardLayer",)
# axlearn's mesh axis names (common.py MESH_AXIS_NAMES) -> what they split.
_AXES = {"pipeline": "pp", "data": "dp", "expert": "dp", "fsdp": "fsdp", "model": "tp",
         "seq": "seq"}


class ConfigReadError(ValueError):
    """A field the plan needs is missing or holds something the model cannot describe."""


def stack_kind(stack_class: Any) -> str:
    """``stacked``, ``repeated`` or ``pipelined`` for an axlearn stack class (or its name)."""
    if isinstance(stack_class, str):
        names = [stack_class.rsplit(".", 1)[-1]]
    else:
        names = [c.__name__ for c in getattr(stack_class, "__mro__", (stack_class,))]
    for kind, marker in (("pipelined", "PipelinedTransformerLayer"),
                         ("repeated", "RepeatedTransformerLayer"),
                         ("stacked", "StackedTransformerLayer")):
        if marker in names:
            return kind
    raise ValueError(f"{names[0]!r} is not an axlearn transformer stack; valid: "
                     "StackedTransformerLayer, RepeatedTransformerLayer, "
                     "PipelinedTransformerLayer or a subclass")


@dataclass(frozen=True)
class TrainerDescription:
    """What an axlearn trainer config says about one decoder layer and the step.

    Attributes:
        config, shape, parallelism: the layer, the per-replica step and the split, as the
            planner takes them (`parallelism` has every ``-1`` axis filled).
        stack_kind: ``stacked``, ``repeated`` or ``pipelined`` (from the final stack class).
        stack_class: the stack class's name.
        layer_path: where ``remat_spec`` goes (``model.decoder.transformer.layer``).
        emitted: the checkpoint names this layer emits on a Neuron device, as axlearn's
            ``_remat_name`` spells them (``FlashAttention.q_proj``, ...).
        sources: each value read and the config path it came from.
    """

    config: models.TransformerConfig
    shape: models.StepShape
    parallelism: models.Parallelism
    stack_kind: str
    stack_class: str
    layer_path: str
    emitted: tuple[str, ...]
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)


class _Reader:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.sources: dict[str, str] = {}

    def get(self, path: str, *, optional: bool = False, default: Any = None) -> Any:
        node = self.root
        walked = []
        for key in path.split("."):
            walked.append(key)
            try:
                node = getattr(node, key)
            except (AttributeError, KeyError):
                if optional:
                    return default
                raise ConfigReadError(
                    f"trainer config has no {'.'.join(walked)} (needed: {path})") from None
        if type(node).__name__ == "RequiredFieldValue":
            if optional:
                return default
            raise ConfigReadError(f"trainer config field {path} is not set (REQUIRED)")
        return node

    def integer(self, path: str, what: str, value: Any = None) -> int:
        value = self.get(path) if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigReadError(f"{path} = {value!r}: {what} must be a positive integer")
        self.sources[what] = path
        return int(value)


def _class_names(cfg: Any, path: str) -> list[str]:
    klass = getattr(cfg, "klass", None)
    if not isinstance(klass, type):
        raise ConfigReadError(f"{path}.klass = {klass!r}: expected a layer class")
    return [c.__name__ for c in klass.__mro__]


def _dtype(value: Any, path: str) -> str:
    try:
        name = np.dtype(value).name
    except TypeError:
        name = str(value).rsplit(".", 1)[-1]
    try:
        models.dtype_bytes(name)
    except ValueError as err:
        raise ConfigReadError(f"{path} = {value!r}: {err}") from None
    return name


def _mesh(r: _Reader) -> tuple[tuple[int, ...], tuple[str, ...]]:
    shape = r.get("mesh_shape")
    names = r.get("mesh_axis_names")
    if shape is None:
        raise ConfigReadError("mesh_shape is None: apply the mesh rules first (put the modifier "
                              "last in the mesh rule's ChainConfigModifier)")
    if hasattr(shape, "ici_mesh_shape"):  # HybridMeshShape: ici x dcn per axis
        ici, dcn = shape.ici_mesh_shape, shape.dcn_mesh_shape
        if -1 in ici or (-1 in dcn and list(dcn).count(-1) > 1):
            raise ConfigReadError(f"mesh_shape = {shape!r}: a -1 in ici_mesh_shape is not "
                                  "supported; give the ici shape in full")
        shape = tuple(-1 if b == -1 else a * b for a, b in zip(ici, dcn))
    try:
        shape, names = tuple(int(s) for s in shape), tuple(str(n) for n in names)
    except (TypeError, ValueError):
        raise ConfigReadError(f"mesh_shape = {shape!r} / mesh_axis_names = {names!r}: expected "
                              "a tuple of ints and a tuple of axis names") from None
    if len(shape) != len(names):
        raise ConfigReadError(f"mesh_shape {shape} and mesh_axis_names {names} differ in length")
    r.sources["mesh"] = "mesh_shape, mesh_axis_names"
    return shape, names


def _parallelism(r: _Reader, device: DeviceSpec, hosts: int, sequence_parallel: bool
                 ) -> models.Parallelism:
    shape, names = _mesh(r)
    total = device.cores * hosts
    if list(shape).count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ConfigReadError(f"mesh_shape = {shape}: at most one -1 and positive sizes")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if total % known:
            raise ConfigReadError(
                f"mesh_shape = {shape}: the fixed axes ({known}) do not divide the job's "
                f"{total} cores ({device.cores} x {hosts} hosts)")
        shape = tuple(total // known if s == -1 else s for s in shape)
    degrees = {"pp": 1, "dp": 1, "fsdp": 1, "tp": 1, "seq": 1}
    for name, size in zip(names, shape):
        if name not in _AXES:
            if size != 1:
                raise ConfigReadError(f"mesh axis {name!r} (size {size}) is not known; known: "
                                      f"{', '.join(_AXES)}")
            continue
        degrees[_AXES[name]] *= size
    if degrees.pop("seq") != 1:
        raise ConfigReadError(f"mesh_shape = {shape}: a 'seq' axis > 1 (context parallelism) "
                              "is not modelled")
    return models.Parallelism(sequence_parallel=sequence_parallel and degrees["tp"] > 1,
                              hosts=hosts, **degrees)


def _sequence_parallel(r: _Reader, layer_path: str) -> bool:
    """TRN2's mesh rule shards the norms' inputs over ``model`` along the sequence."""
    path = f"{layer_path}.self_attention.norm.input_partition_spec"
    spec = r.get(path, optional=True)
    if spec is None:
        return False
    try:
        entries = list(spec)
    except TypeError:
        return False
    seq = entries[1] if len(entries) > 1 else None
    found = seq == "model" or (isinstance(seq, (tuple, list)) and "model" in seq)
    if found:
        r.sources["sequence_parallel"] = path
    return found


def _ffn_dim(r: _Reader, ff_path: str, dim: int) -> int:
    path = f"{ff_path}.hidden_dim"
    value = r.get(path)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return r.integer(path, "ffn", value)
    if hasattr(value, "instantiate") and hasattr(value, "set"):
        try:  # axlearn instantiates hidden_dim.set(input_dim=...) (TransformerFeedForwardLayer)
            out = copy.deepcopy(value).set(input_dim=dim).instantiate()
        except Exception as err:  # noqa: BLE001
            raise ConfigReadError(f"{path} = {value!r} could not be evaluated for input_dim="
                                  f"{dim}: {err}") from None
        return r.integer(path, "ffn", out)
    raise ConfigReadError(f"{path} = {value!r}: expected an int or a function config")


def _activation(r: _Reader, ff_path: str) -> tuple[bool, str]:
    path = f"{ff_path}.activation"
    value = r.get(path)
    gated = isinstance(value, (tuple, list))
    if gated and len(value) != 2:
        raise ConfigReadError(f"{path} = {value!r}: a gated activation is a pair")
    first = str(value[0] if gated else value).lower()
    if "silu" in first or "swish" in first:
        act = "silu"
    elif "gelu" in first:
        act = "gelu"
    else:
        raise ConfigReadError(f"{path} = {value!r}: the model knows silu/swish and gelu "
                              "activations")
    r.sources["activation"] = path
    return gated, act


def _norm(r: _Reader, layer_path: str) -> str:
    kinds = set()
    for block in ("self_attention", "feed_forward"):
        path = f"{layer_path}.{block}.norm"
        names = _class_names(r.get(path), path)
        kind = next((_NORMS[n] for n in names if n in _NORMS), None)
        if kind is None:
            raise ConfigReadError(f"{path}.klass is {names[0]}; the model knows "
                                  f"{', '.join(_NORMS)}")
        structure = r.get(f"{layer_path}.{block}.structure", optional=True, default="prenorm")
        if structure != "prenorm":
            raise ConfigReadError(f"{layer_path}.{block}.structure = {structure!r}: the model "
                                  "describes pre-norm layers only")
        kinds.add(kind)
    if len(kinds) != 1:
        raise ConfigReadError(f"{layer_path}: the two norms differ ({sorted(kinds)})")
    r.sources["norm"] = f"{layer_path}.self_attention.norm.klass"
    return kinds.pop()


def _qkv(r: _Reader, attn_path: str, heads: int) -> tuple[bool, int, str]:
    path = f"{attn_path}.input_linear"
    cfg = r.get(path)
    names = _class_names(cfg, path)
    if any(n in _QKV_WRAPPERS for n in names):
        path = f"{path}.input_linear"
        cfg = r.get(path)
        names = _class_names(cfg, path)
    kind = next((n for n in names if n in _QKV), None)
    if kind is None:
        raise ConfigReadError(f"{path}.klass is {names[0]}; the model knows "
                              f"{', '.join(_QKV)} (optionally inside RoFormerQKVLinear)")
    fused, grouped = _QKV[kind]
    kv = r.integer(f"{path}.num_kv_heads", "kv_heads") if grouped else heads
    r.sources["qkv_linear"] = f"{path}.klass"
    return fused, kv, names[0]


def describe_trainer(trainer_cfg: Any, *, device: DeviceSpec, hosts: int = 1,
                     stack_path: str = STACK_PATH) -> TrainerDescription:
    """Read the layer, the step and the split from `trainer_cfg` (after its mesh rules).

    `device` is one process's device and `hosts` the number of processes: together they
    fill a ``-1`` mesh axis, as axlearn's ``infer_mesh_shape`` does from the device count.
    Raises `ConfigReadError` naming the config path of anything missing or unreadable.
    """
    r = _Reader(trainer_cfg)
    stack = r.get(stack_path)
    stack_names = _class_names(stack, stack_path)
    kind = stack_kind(stack.klass)
    layer_path = f"{stack_path}.layer"
    layer = r.get(layer_path)
    if isinstance(layer, (list, tuple)):
        raise ConfigReadError(f"{layer_path} is a list of {len(layer)} layer configs; the model "
                              "describes stacks of one layer kind")
    layer_cls = _class_names(layer, layer_path)[0]
    dim = r.integer("model.decoder.dim", "hidden")
    vocab = r.integer("model.decoder.vocab_size", "vocab")
    layers = r.integer(f"{stack_path}.num_layers", "layers")
    attn_path = f"{layer_path}.self_attention.attention"
    attn = r.get(attn_path)
    attn_names = _class_names(attn, attn_path)
    flash = any(n in _FLASH for n in attn_names)
    if not flash and not any(n in _NATIVE for n in attn_names):
        raise ConfigReadError(f"{attn_path}.klass is {attn_names[0]}; the model knows "
                              f"{', '.join(_FLASH + _NATIVE)} and subclasses")
    heads = r.integer(f"{attn_path}.num_heads", "heads")
    attn_dim = r.get(f"{attn_path}.hidden_dim", optional=True) or dim
    if attn_dim % heads:
        raise ConfigReadError(f"{attn_path}.num_heads = {heads} does not divide the attention "
                              f"dim {attn_dim}")
    fused, kv, _ = _qkv(r, attn_path, heads)
    causal = bool(r.get(f"{attn_path}.causal", optional=True)
                  or r.get(f"{attn_path}.mask", optional=True) is not None)
    ff_path = f"{layer_path}.feed_forward"
    ffn_names = _class_names(r.get(ff_path), ff_path)
    if not any(n in _FFN for n in ffn_names):
        raise ConfigReadError(f"{ff_path}.klass is {ffn_names[0]}; the model knows "
                              f"{', '.join(_FFN)} and subclasses (a dense feed-forward, not "
                              "a mixture of experts)")
    ffn = _ffn_dim(r, ff_path, dim)
    gated, act = _activation(r, ff_path)
    norm = _norm(r, layer_path)
    tied = r.get("model.decoder.lm_head", optional=True) is None
    seq = r.integer("input.source.max_sequence_length", "seq_len")
    act_dtype = _dtype(r.get("train_dtype"), "train_dtype")
    param_dtype = _dtype(r.get("model.dtype"), "model.dtype")
    config = models.TransformerConfig(
        hidden=dim, heads=heads, ffn=ffn, layers=layers, vocab=vocab, kv_heads=kv,
        head_dim=attn_dim // heads, gated_ffn=gated, flash_attention=flash, norm=norm,
        activation=act, causal=causal, tie_embeddings=tied, fused_qkv=fused,
        tags=models.host_tags(models.AXLEARN_TAGS, device), default_seq_len=seq,
        name=f"axlearn {attn_names[0]} {dim}x{layers}", source="axlearn trainer config")
    par = _parallelism(r, device, hosts, _sequence_parallel(r, layer_path))
    micro = _micro_batch(r, par)
    shape = models.StepShape(seq_len=seq, micro_batch=micro, activation_dtype=act_dtype,
                             param_dtype=param_dtype)
    prefixes = {"input": layer_cls, "linear1_0": ffn_names[0], "linear1_1": ffn_names[0],
                "linear2": ffn_names[0]}
    emitted = tuple(f"{prefixes.get(role, attn_names[0])}.{config.tag(role)}"
                    for role in config.roles)
    return TrainerDescription(config=config, shape=shape, parallelism=par, stack_kind=kind,
                              stack_class=stack_names[0], layer_path=layer_path,
                              emitted=emitted, sources=dict(r.sources))


def _micro_batch(r: _Reader, par: models.Parallelism) -> int:
    path = "input.input_dispatcher.global_logical_batch_size"
    batch = r.get(path, optional=True)
    if batch is None:
        path = "input.batcher.global_batch_size"
        batch = r.get(path, optional=True)
    if batch is None:
        raise ConfigReadError("trainer config has no input.input_dispatcher."
                              "global_logical_batch_size (nor input.batcher.global_batch_size)")
    batch = r.integer(path, "global_batch", batch)
    steps = 1
    acc = r.get("learner.forward_fn_transformation", optional=True)
    if acc is not None and "minibatch" in getattr(getattr(acc, "fn", None), "__name__", ""):
        steps = r.integer("learner.forward_fn_transformation.steps", "grad_acc_steps")
    replicas = par.dp * par.fsdp * steps
    if batch % replicas:
        raise ConfigReadError(
            f"{path} = {batch} is not divisible by dp x fsdp x gradient-accumulation steps "
            f"= {par.dp} x {par.fsdp} x {steps}")
    return batch // replicas
