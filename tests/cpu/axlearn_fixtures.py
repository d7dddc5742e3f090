"""Fuji trainer configs as axlearn builds them, on a real axlearn or a stand-in for it.

Current axlearn installs from git and pins JAX 0.8.3 (its 2024 PyPI release pins JAX 0.4.21),
so the default test environment has none. `axlearn_stub/axlearn` is a faithful subset of
apple/axlearn at commit 34aed43c1b6e581c4753d06d7cbeedd5010ef26b (2026-07-08): the module
paths, class names, config fields with their defaults, and the closure
``utils.save_and_offload_only_these_names_regex`` returns, each cited to axlearn's file and
line there. `on_path` puts it on ``sys.path`` so the adapter imports it as ``axlearn``, and
removes it afterwards. Where a real axlearn is importable (`REAL`), the stand-in steps aside
and the same builders and tests run against it (see README, "axlearn").

The builders below follow, at that commit:

* ``axlearn/experiments/text/gpt/fuji.py``: ``get_trainer_kwargs`` (274; 7B: lines 391-418 with
  num_layers=32, hidden_dim=128*32, num_heads=32, shared_lm_head=True; 70B: 658-923 with
  num_layers=80, hidden_dim=128*64, num_heads=64, num_kv_heads=8,
  ffn_dim=scaled_hidden_dim(3.5), shared_lm_head=False, mesh fsdp=-1); ``VOCAB_SIZE`` V3 =
  128*1024, ``MAX_SEQUENCE_LENGTH`` V3 = 8192, ``TOKENS_PER_BATCH`` V3 = 16Mi tokens (so
  2048 sequences); ``model_config`` (1025-1103: ``("nn.silu", "linear")``, ffn 8/3 rounded
  to 256 by default, GroupedQueryAttention + FusedGroupedQKVLinear(num_kv_heads) inside
  RoFormerQKVLinear, or FlashAttention when flash, RMSNorm, RepeatedTransformerLayer);
  ``_generate_trn2_custom_configs`` (186-271: StackedTransformerLayer swap, GroupedQKVLinear
  swap at ``...attention.input_linear.input_linear`` for V3, norm input partition specs
  ``(("data", "fsdp"), "model", None)``); the TRN2 mesh rules
  ``"neuron-(trn2|trn2n).48xlarge-64"`` (7B: 642-656; 70B: 888-920, whose RematSpecModifier
  comes BEFORE the module swaps and saves ``.*[kqv]_proj|.*linear1_[01]``);
  ``make_single_host_config`` (1211-1235: global batch // 128 for V3).
* ``axlearn/experiments/text/gpt/common.py``: ``get_trainer_config_fn`` (681-800:
  ``train_dtype = STEP_DTYPE``, ``input.input_dispatcher.global_logical_batch_size``,
  ``mesh_axis_names = MESH_AXIS_NAMES``); ``model_config`` (``update_model_remat_config``:
  the golden ``remat_spec`` prevent_cse=False, ``.*([qkvo]_proj|context)``, offload_src
  device, offload_dst pinned_host; ``model.dtype`` float32).
* The golden config ``axlearn/experiments/testdata/axlearn.experiments.text.gpt.c4_trainer/
  fuji-70B-v3-flash.txt`` (lines 78, 93, 262-282, 379-528) for the same paths and values.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

STUB = pathlib.Path(__file__).parent / "axlearn_stub"
AXLEARN_COMMIT = "34aed43c1b6e581c4753d06d7cbeedd5010ef26b"
TRN2_SELECTOR = "neuron-trn2.48xlarge-64"


def _real_axlearn() -> bool:
    """Whether an installed axlearn (not the stand-in) is importable."""
    return importlib.util.find_spec("axlearn") is not None


REAL = _real_axlearn()
"""True where a real axlearn is installed: the stand-in then steps aside and the same tests
run against it."""


@contextlib.contextmanager
def on_path() -> Iterator[None]:
    """The stand-in axlearn importable as ``axlearn`` inside the block, gone after it; where
    a real axlearn is installed, that one (left in place)."""
    if REAL:
        yield
        return
    sys.path.insert(0, str(STUB))
    try:
        yield
    finally:
        sys.path.remove(str(STUB))
        for name in [m for m in sys.modules if m == "axlearn" or m.startswith("axlearn.")]:
            del sys.modules[name]


def lm_source(*, vocab_size: int, max_sequence_length: int) -> Any:
    """Stands for the input source Fuji configures (``mixture_train_input_source``, whose
    config carries ``vocab_size`` and ``max_sequence_length``); never instantiated."""
    raise NotImplementedError


def _base(*, size: str, flash: bool) -> Any:
    import jax.numpy as jnp

    from axlearn.common import attention as att
    from axlearn.common.base_layer import RematSpec
    from axlearn.common.causal_lm import Model
    from axlearn.common.config import config_for_function
    from axlearn.common.decoder import LmHead
    from axlearn.common.flash_attention.layer import FlashAttention
    from axlearn.common.input_dispatch import SpmdInputDispatcher
    from axlearn.common.input_tf_data import Input, identity
    from axlearn.common.layers import RMSNorm
    from axlearn.common.trainer import SpmdTrainer
    from axlearn.common.utils import save_and_offload_only_these_names_regex
    from axlearn.experiments.text.gpt import common

    dims = {"7B": dict(layers=32, dim=128 * 32, heads=32, ffn=common.scaled_hidden_dim(8 / 3),
                       shared=True),
            "70B": dict(layers=80, dim=128 * 64, heads=64, ffn=common.scaled_hidden_dim(3.5),
                        shared=False)}[size]
    attention = (FlashAttention.default_config() if flash
                 else att.GroupedQueryAttention.default_config())
    attention.set(causal=True, num_heads=dims["heads"])
    attention.input_linear = att.RoFormerQKVLinear.default_config().set(
        input_linear=att.FusedGroupedQKVLinear.default_config().set(num_kv_heads=8),
        rotary_value=False)
    layer = att.TransformerLayer.default_config()
    layer.self_attention.attention = attention
    layer.self_attention.norm = RMSNorm.default_config().set(eps=1e-5)
    layer.feed_forward.set(norm=RMSNorm.default_config().set(eps=1e-5),
                           activation=("nn.silu", "linear"), hidden_dim=dims["ffn"])
    layer.remat_spec = RematSpec(
        prevent_cse=False,
        policy=config_for_function(save_and_offload_only_these_names_regex).set(
            names_which_can_be_saved=att.RematRegexSavePatterns.NATIVE_ATTENTION.value,
            names_which_can_be_offloaded=None, offload_src="device", offload_dst="pinned_host"))
    stack = att.RepeatedTransformerLayer.default_config().set(num_layers=dims["layers"],
                                                             layer=layer)
    model = Model.default_config().set(dtype=jnp.float32)
    model.decoder.set(dim=dims["dim"], vocab_size=128 * 1024, transformer=stack,
                      output_norm=RMSNorm.default_config(),
                      lm_head=None if dims["shared"] else LmHead.default_config())
    seq_len = 8192
    source = config_for_function(lm_source).set(vocab_size=128 * 1024,
                                                max_sequence_length=seq_len)
    inp = Input.default_config().set(
        is_training=True, source=source, processor=config_for_function(identity),
        input_dispatcher=SpmdInputDispatcher.default_config().set(
            global_logical_batch_size=16 * 1024**2 // seq_len,
            partition_spec=(("data", "expert", "fsdp"),)))
    mesh = common.mesh_shape_from_axes(fsdp=-1) if size == "70B" else \
        common.mesh_shape_from_axes(data=-1, fsdp=8)
    return SpmdTrainer.default_config().set(
        model=model, input=inp, train_dtype=common.STEP_DTYPE, mesh_shape=mesh,
        mesh_axis_names=common.MESH_AXIS_NAMES)


def trn2_rule(size: str, *, plan: Any = None) -> Any:
    """fuji.py's TRN2 ChainConfigModifier for `size`, with `plan` (a modifier config)
    appended last when given."""
    from axlearn.common import attention as att
    from axlearn.common.base_layer import RematSpec
    from axlearn.common.config import config_for_function
    from axlearn.common.trainer_config_modifier import (ChainConfigModifier, MeshShapeModifier,
                                                        ModuleConfigModifier,
                                                        PartitionSpecModifier,
                                                        RematSpecModifier)
    from axlearn.common.utils import save_and_offload_only_these_names_regex
    from axlearn.experiments.text.gpt import common

    seq_parallel = {"input_partition_spec": (("data", "fsdp"), "model", None),
                    "output_partition_spec": (("data", "fsdp"), None, None)}
    layer = "model.decoder.transformer.layer"
    modifiers: list[Any] = [
        MeshShapeModifier.default_config().set(
            mesh_shape=common.mesh_shape_from_axes(fsdp=-1, model=4))]
    if size == "70B":
        modifiers.append(RematSpecModifier.default_config().set(remat_policies={
            layer: RematSpec(prevent_cse=True, policy=config_for_function(
                save_and_offload_only_these_names_regex).set(
                    names_which_can_be_saved="|".join([
                        att.RematRegexSavePatterns.QKV_PROJ.value,
                        att.RematRegexSavePatterns.LINEAR1_X.value]),
                    names_which_can_be_offloaded=None, offload_src=None, offload_dst=None))}))
    modifiers += [
        ModuleConfigModifier.default_config().set(
            target_config="model.decoder.transformer",
            modification=att.StackedTransformerLayer.default_config()),
        ModuleConfigModifier.default_config().set(
            target_config=f"{layer}.self_attention.attention.input_linear.input_linear",
            modification=att.GroupedQKVLinear.default_config()),
        PartitionSpecModifier.default_config().set(partition_specs={
            f"{layer}.self_attention.norm": seq_parallel,
            f"{layer}.feed_forward.norm": seq_parallel}),
    ]
    if plan is not None:
        modifiers.append(plan)
    return ChainConfigModifier.default_config().set(config_modifiers=modifiers)


def fuji(size: str, *, flash: bool = True, plan: Any = None, single_host: bool = False) -> Any:
    """The Fuji-`size`-v3 trainer config (``-flash`` when `flash`), with its TRN2 mesh rule
    (the planning modifier `plan` appended last when given); ``single_host`` divides the
    global batch by 128 as fuji.py's ``-single-host`` variants do."""
    cfg = _base(size=size, flash=flash)
    cfg.mesh_rules = ((r"neuron-(trn2|trn2n).48xlarge-64", trn2_rule(size, plan=plan)),)
    if single_host:
        cfg.input.input_dispatcher.global_logical_batch_size //= 128
    return cfg


def launched(cfg: Any, selector: str = TRN2_SELECTOR) -> Any:
    """`cfg` after axlearn's launcher applied the mesh rule matching `selector`."""
    from axlearn.common.trainer import select_mesh_config

    select_mesh_config(cfg, mesh_selector=selector)
    return cfg
