"""MaxText 0.2.5's real training step, as a held-out step of the zoo (a test fixture).

Needs ``maxtext==0.2.5`` and its model dependencies (Python >= 3.12; .ci/maxtext_env.sh
builds that environment). Nothing here is copied from MaxText: the step is MaxText's own
code, called the way its ahead-of-time compile entry point calls it:

* ``maxtext.configs.pyconfig.initialize`` on the ``base.yml`` MaxText ships, with a tiny
  llama2 config (`CONFIG`): ``decoder_block=llama2``, scanned layers, ``dot_product``
  attention, bfloat16 activations over float32 weights, AdamW (``opt_type=adamw``);
* ``maxtext.trainers.pre_train.train_compile.get_shaped_inputs``: the abstract NNX train
  state (``models.Transformer`` + ``nnx.Optimizer``) and batch;
* ``maxtext.utils.maxtext_utils.get_functional_train_with_signature(train.train_step, ...)``:
  the real ``train_step`` (MaxText's ``loss_fn`` with ``max_utils.cross_entropy_with_logits``,
  gradient, ``apply_gradients``, metrics), its shardings and ``donate_argnums=0`` (the
  state is donated), jitted under ``jax.set_mesh`` and the config's logical axis rules, as
  ``train_compile.jit_and_compile`` does, on a 1-device CPU mesh.

The remat policy goes in through neuron_remat's MaxText adapter: the policy is turned into
``remat_policy: custom`` plus one key per tensor (`neuron_remat.adapters.maxtext`), and
MaxText's ``NNXDecoder.get_remat_policy`` builds its own policy from them. MaxText has no
config value for no remat (``remat_policy: none`` gives ``policy=None``, which
``jax.checkpoint`` reads as save nothing), so ``everything_saveable`` alone is injected by
replacing ``NNXDecoder.get_remat_policy`` while the step is traced (`_no_remat`).

`STEPS` follows tests/cpu/zoo.py's `Spec` protocol (name, split, note, extra,
``make_step()`` -> ``policy -> jitted step``, ``abstract_args()``), so
benchmarks/fit_sweep.py's machinery runs on it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

MAXTEXT_VERSION = "0.2.5"

CONFIG: dict[str, Any] = dict(
    run_name="neuron_remat", hardware="cpu", skip_jax_distributed_system=True,
    enable_checkpointing=False, dataset_type="synthetic", decoder_block="llama2",
    scan_layers=True, attention="dot_product", dtype="bfloat16", weight_dtype="float32",
    opt_type="adamw", steps=10, base_emb_dim=128, base_num_query_heads=4,
    base_num_kv_heads=2, head_dim=32, base_mlp_dim=512, base_num_decoder_layers=4,
    vocab_size=512, max_target_length=128, per_device_batch_size=2,
    jax_cache_dir="",  # base.yml turns JAX's persistent compilation cache on (~/jax_cache)
)
"""A tiny llama2: 4 scanned layers, hidden 128, GQA 4:2 heads of 32, SwiGLU of 512,
vocabulary 512, 2 x 128 tokens. No persistent compilation cache: every compile is one."""


def available() -> str | None:
    """None when MaxText imports here; else why not (a skip reason)."""
    try:
        import maxtext  # noqa: PLC0415, F401
        from maxtext.trainers.pre_train import train_compile  # noqa: PLC0415, F401
    except Exception as err:  # noqa: BLE001 - any reason is a reason to skip
        return f"MaxText does not import here ({type(err).__name__}: {err})"
    from maxtext import version  # noqa: PLC0415

    if version.__version__ != MAXTEXT_VERSION:
        return f"MaxText {version.__version__} here, the fixture is for {MAXTEXT_VERSION}"
    return None


def _base_yml() -> str:
    import maxtext.configs.pyconfig as pyconfig  # noqa: PLC0415

    return os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")


@contextlib.contextmanager
def _no_remat() -> Iterator[None]:
    """MaxText's decoder asks ``get_remat_policy()`` for its scan body's policy; answer
    ``everything_saveable`` while the step is traced."""
    import jax  # noqa: PLC0415
    from maxtext.layers import nnx_decoders  # noqa: PLC0415

    cls = nnx_decoders.NNXDecoder
    original = cls.get_remat_policy
    cls.get_remat_policy = lambda self: jax.checkpoint_policies.everything_saveable
    try:
        yield
    finally:
        cls.get_remat_policy = original


@contextlib.contextmanager
def _in_mesh(mesh: Any, rules: Any) -> Iterator[None]:
    """`mesh` (its abstract mesh under a trace, where ``jax.set_mesh`` refuses) and the
    logical axis rules, as ``train_compile.jit_and_compile`` sets them."""
    import jax  # noqa: PLC0415
    from flax.linen.partitioning import axis_rules  # noqa: PLC0415
    from jax._src import core  # noqa: PLC0415

    with contextlib.ExitStack() as stack:
        if core.trace_state_clean():
            stack.enter_context(jax.set_mesh(mesh))
        else:
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        stack.enter_context(axis_rules(rules))
        yield


class MaxTextStep:
    """MaxText's jitted train step: traced, lowered and called inside its mesh (its
    abstract mesh when called under a trace) and logical axis rules (and, for no remat,
    `_no_remat`)."""

    def __init__(self, jitted: Any, mesh: Any, rules: Any, no_remat: bool) -> None:
        self._jitted, self._mesh, self._rules, self._no_remat = jitted, mesh, rules, no_remat

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_in_mesh(self._mesh, self._rules))
            if self._no_remat:
                stack.enter_context(_no_remat())
            yield

    def __call__(self, *args: Any) -> Any:
        with self._context():
            return self._jitted(*args)

    def lower(self, *args: Any) -> Any:
        with self._context():
            return self._jitted.lower(*args)

    def trace(self, *args: Any) -> Any:
        with self._context():
            return self._jitted.trace(*args)


@dataclass(frozen=True)
class MaxTextSpec:
    """MaxText's real training step under `config` (overrides of ``base.yml``)."""

    name: str
    config: dict[str, Any]
    split: str = "held-out"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    scan: bool = True
    layer: tuple[str, str] = ("llama2", "LlamaDecoderLayer")
    """The decoder layer class of `config`'s ``decoder_block``: (module of
    ``maxtext.models``, class), as ``NNXDecoder.get_decoder_layers`` picks it."""
    layer_kwargs: tuple[tuple[str, Any], ...] = ()
    """More arguments of the layer's constructor (Qwen3-Next's ``layer_idx``, which picks
    its attention: linear, a gated delta net, but for every
    ``inhomogeneous_layer_cycle_interval``-th layer; GPT-OSS's ``attention_type``, given by
    its value in MaxText's ``AttentionType``, e.g. ``"local_sliding"``; Llama4's
    ``is_moe_layer`` and ``is_nope_layer``)."""
    devices: int = 1
    """The devices of the step's mesh (the first of ``jax.devices()``; the config's ``ici_*``
    parallelism lays the axes out over them). MaxText's global batch is its
    ``per_device_batch_size`` times the devices JAX sees: a step over 8 devices runs in a
    process that sees 8 (``XLA_FLAGS=--xla_force_host_platform_device_count=8``)."""
    inputs_on_mesh: bool = False
    """`decoder_layer` puts its activations (``x``, segment ids, positions) on the mesh
    (replicated), not on the one device. Llama4's and GPT-OSS's layers constrain their input
    with flax's ``nn.with_logical_constraint`` (a bare ``PartitionSpec``, read against the
    mesh ``jax.set_mesh`` sets): called eagerly on an array of one device, JAX refuses it
    (it needs a ``NamedSharding`` input), and the fallback MaxText 0.2.5 installs in
    ``jax.lax.with_sharding_constraint`` (``integration/tunix/tunix_adapter.py``:
    ``jax.sharding.reshard``) refuses the mesh's ``Auto`` axes. Under a trace both layers
    run on the usual mesh either way. (A mesh of ``Explicit`` axes is no way out: MaxText
    refuses ``shard_mode: explicit`` for both decoder blocks, and with ``shard_mode: auto``
    the attention's ``dot_general`` fails sharding in types on such a mesh.)"""

    # ---- MaxText's pieces --------------------------------------------------------------

    def maxtext_config(self, overrides: tuple[tuple[str, str], ...] = ()) -> Any:
        return _config(self.name, tuple(sorted(self.config.items())), overrides)

    def _built(self, overrides: tuple[tuple[str, str], ...],
               no_remat: bool = False) -> tuple[Any, ...]:
        return _build(self.name, tuple(sorted(self.config.items())), overrides, no_remat,
                      self.devices)

    def abstract_args(self) -> tuple[Any, Any]:
        """(abstract NNX train state, abstract batch), as ``get_shaped_inputs`` gives them."""
        return self._built(_overrides_of(None))[1]

    def make_step(self) -> Callable[[Any], MaxTextStep]:
        import jax  # noqa: PLC0415

        def make(policy: Any) -> MaxTextStep:
            no_remat = policy is jax.checkpoint_policies.everything_saveable
            overrides = _overrides_of(None if no_remat else policy)
            jitted, _, mesh, config = self._built(overrides, no_remat)
            return MaxTextStep(jitted, mesh, config.logical_axis_rules, no_remat)

        return make

    # ---- one decoder layer, for the traced footprint -----------------------------------

    def decoder_layer(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """``(fn, (x, params, segments, positions))``: one of MaxText's decoder layers
        (`layer`, as the scanned stack calls it: training mode, deterministic) on a batch
        of activations `x` in the config's dtype; ``fn`` runs inside the mesh and axis
        rules. The integer segment ids and positions are arguments (not closed over), so
        JAX lists them as arguments, not constants."""
        import importlib  # noqa: PLC0415
        import inspect  # noqa: PLC0415

        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        from flax import nnx  # noqa: PLC0415

        module, name = self.layer
        cls = getattr(importlib.import_module(f"maxtext.models.{module}"), name)
        # some layers take the quantisation config as a required argument (None: none)
        quant = {"quant": None} if "quant" in inspect.signature(cls).parameters else {}
        config = self.maxtext_config()
        mesh = self._built(_overrides_of(None))[2]
        from maxtext.common.common_types import AttentionType  # noqa: PLC0415

        kwargs = {k: AttentionType(v) if k == "attention_type" else v
                  for k, v in self.layer_kwargs}
        with _in_mesh(mesh, config.logical_axis_rules):
            layer = cls(config=config, model_mode="train", mesh=mesh, rngs=nnx.Rngs(0),
                        **quant, **kwargs)
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        b, s = config.micro_batch_size_to_train_on, config.max_target_length
        x = jax.random.normal(jax.random.PRNGKey(1), (b, s, config.emb_dim)).astype(
            jnp.dtype(config.dtype))
        segments = jnp.ones((b, s), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if self.inputs_on_mesh:
            on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            x, segments, positions = jax.device_put((x, segments, positions), on_mesh)

        def fn(x: Any, params: Any, segments: Any, positions: Any) -> Any:
            with _in_mesh(mesh, config.logical_axis_rules):
                out = nnx.merge(graphdef, params, rest)(x, segments, positions, True,
                                                        "train")
            return out[0] if isinstance(out, tuple) else out  # (output, KV cache)

        return fn, (x, params, segments, positions)


def _overrides_of(policy: Any) -> tuple[tuple[str, str], ...]:
    """The adapter's MaxText keys for `policy` (None: full remat, MaxText's default)."""
    if policy is None:
        return (("remat_policy", "full"),)
    from neuron_remat.adapters import maxtext  # noqa: PLC0415

    return tuple(sorted(maxtext._overrides(policy, False).items()))  # noqa: SLF001


@functools.lru_cache(maxsize=None)
def _config(name: str, config: tuple[tuple[str, Any], ...],
            overrides: tuple[tuple[str, str], ...]) -> Any:
    from maxtext.configs import pyconfig  # noqa: PLC0415

    return pyconfig.initialize([None, _base_yml()], **dict(config), **dict(overrides))


@functools.lru_cache(maxsize=8)
def _build(name: str, config: tuple[tuple[str, Any], ...],
           overrides: tuple[tuple[str, str], ...], no_remat: bool,
           n_devices: int = 1) -> tuple[Any, ...]:
    """(jitted step, (abstract state, abstract batch), mesh, MaxText config). `no_remat`
    gets a jitted function of its own: jit's trace cache does not see `_no_remat`. (The
    cache is bounded: 129 cached steps of the MoE config, each with its executable, ran
    the CPU out of memory.)"""
    del no_remat  # only a cache key
    import jax  # noqa: PLC0415
    from flax.linen.partitioning import axis_rules  # noqa: PLC0415
    from jax.sharding import AxisType, Mesh  # noqa: PLC0415
    from maxtext.trainers.pre_train import train, train_compile  # noqa: PLC0415
    from maxtext.utils import maxtext_utils, sharding  # noqa: PLC0415

    cfg = _config(name, config, overrides)
    from host_devices import first  # noqa: PLC0415

    devices = maxtext_utils.create_device_mesh(cfg, first(n_devices, name))
    mesh = Mesh(devices, cfg.mesh_axes, axis_types=(AxisType.Auto,) * len(cfg.mesh_axes))
    (args, _, state_shardings, _, model) = train_compile.get_shaped_inputs(mesh, cfg)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        cfg, state_shardings)
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(
        cfg, state_shardings, params_shardings)
    data_sharding = sharding.get_input_data_sharding(cfg, mesh)
    func, in_shard, out_shard, static, donate = \
        maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sharding, input_shardings, model, cfg, params_shardings)
    with jax.set_mesh(mesh), axis_rules(cfg.logical_axis_rules):
        jitted = jax.jit(func, in_shardings=in_shard, out_shardings=out_shard,
                         static_argnums=static, donate_argnums=donate)
    return jitted, tuple(args), mesh, cfg


MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, base_mlp_dim=256,
                           base_moe_mlp_dim=256, megablox=False, sparse_matmul=True)
"""A tiny routed MoE: 4 experts of 256, top 2, no token dropping; MaxText's sparse path
(tokens sorted by expert, ``jax.lax.ragged_dot``; its default), without the Pallas
megablox kernel (TPU only). MaxText requires ``base_mlp_dim == base_moe_mlp_dim`` for a
model whose every layer is MoE."""

MLA: dict[str, Any] = dict(attention_type="mla", q_lora_rank=0, kv_lora_rank=64,
                           qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                           base_num_kv_heads=4, shared_experts=1, first_num_dense_layers=0)
"""DeepSeek's multi-head latent attention (MLA needs as many KV heads as query heads) and
one shared expert beside the routed ones, every layer MoE."""

QWEN3_NEXT: dict[str, Any] = dict(
    shared_experts=1, inhomogeneous_layer_cycle_interval=4, gdn_conv_kernel_dim=4,
    gdn_key_head_dim=32, gdn_value_head_dim=32, gdn_num_key_heads=2, gdn_num_value_heads=4,
    gdn_chunk_size=32)
"""Qwen3-Next's hybrid stack, tiny: every 4th layer full attention, the others linear
attention by a gated delta net (2 key heads and 4 value heads of 32, a causal convolution
of width 4, chunks of 32 tokens: ``lax.scan`` over the chunks with the recurrent state as
its differentiated carry), a routed MoE with one shared expert."""

GPT_OSS: dict[str, Any] = dict(
    decoder_block="gpt_oss", sliding_window_size=32, attention_sink=True,
    attention_bias=True, mlp_activations=("sigmoid", "linear"), mlp_activations_limit=7.0,
    routed_bias=True, mlp_bias=True, rope_type="yarn", rope_max_timescale=150_000,
    max_position_embeddings=131072, original_max_position_embeddings=4096, rope_factor=32,
    beta_fast=32, beta_slow=1, rope_interleave=False, rope_truncate=False,
    rope_attention_scaling=True, inhomogeneous_layer_cycle_interval=2)
"""GPT-OSS's block (MaxText's gpt-oss-20b.yml), tiny: attention with biases and learned
sinks, its even layers within a sliding window of 32 tokens (of 128), YaRN RoPE; a routed
MoE with biased router and experts, its gated unit clamped at 7 (the gate g and the linear
half h clipped, g * sigmoid(1.702 g) * (h + 1))."""

LLAMA4: dict[str, Any] = dict(
    decoder_block="llama4", mlp_activations=("silu", "linear"), shared_experts=1,
    num_experts_per_tok=1, use_qk_norm=True, nope_layer_interval=4,
    interleave_moe_layer_step=1, inhomogeneous_layer_cycle_interval=4,
    temperature_tuning=True, chunk_attn_window_size=32, rope_type="llama3.1",
    rope_max_timescale=500_000)
"""Llama4's block (MaxText's llama4-17b-16e.yml), tiny: RoPE layers attend within chunks
of 32 tokens (of 128), with an L2 norm on queries and keys, every 4th layer global without
RoPE; every layer a routed MoE, top 1, beside a shared expert."""

STEPS: dict[str, MaxTextSpec] = {s.name: s for s in [
    MaxTextSpec(
        "maxtext-llama2", CONFIG,
        note=f"MaxText {MAXTEXT_VERSION}'s train_step: models.Transformer, llama2 block, 4 "
             "scanned layers, bf16 activations, MaxText's cross entropy, AdamW, donated "
             "state, 1-device CPU mesh"),
    MaxTextSpec(
        "maxtext-llama2-ga2", {**CONFIG, "gradient_accumulation_steps": 2,
                               "per_device_batch_size": 4},
        note=f"MaxText {MAXTEXT_VERSION}'s train_step as maxtext-llama2 with gradient "
             "accumulation over 2 micro-batches of 2 (MaxText's own: a lax.scan over the "
             "micro-batches, each one's forward and backward in one iteration), AdamW, "
             "donated state, 1-device CPU mesh"),
    MaxTextSpec(
        "maxtext-mixtral", {**CONFIG, "decoder_block": "mixtral", **MOE},
        layer=("mixtral", "MixtralDecoderLayer"),
        note=f"MaxText {MAXTEXT_VERSION}'s train_step with the mixtral block: 4 experts, "
             "top 2, sorted tokens and ragged_dot, 4 scanned layers, bf16 activations, "
             "AdamW, donated state, 1-device CPU mesh"),
    MaxTextSpec(
        "maxtext-gpt-oss", {**CONFIG, **MOE, **GPT_OSS, "rope_type": "default"},
        layer=("gpt_oss", "GptOssDecoderLayer"),
        note=f"MaxText {MAXTEXT_VERSION}'s train_step with the gpt_oss block: 4 layers as "
             "2 scanned iterations of a block of 2 (a sliding-window layer, then a global "
             "one), learned attention sinks, biased projections and experts, 4 experts, "
             "top 2, a clamped gate, sorted tokens and ragged_dot, bf16 activations, "
             "AdamW, donated state, 1-device CPU mesh; MaxText's default rotary embedding "
             "(YaRN's, complex-valued, fails in 0.2.5's backward on the CPU: "
             "reduce_precision refuses complex64)"),
    MaxTextSpec(
        "maxtext-deepseek3", {**CONFIG, "decoder_block": "deepseek", **MOE, **MLA,
                              "first_num_dense_layers": 2},
        layer=("deepseek", "DeepSeekMoELayer"),
        note=f"MaxText {MAXTEXT_VERSION}'s train_step with the deepseek block, laid out as "
             "DeepSeek-V3: 2 dense layers, then 2 MoE layers (two scans of different "
             "layers, of equal length: XLA:CPU counts each scan's body once), multi-head "
             "latent attention, 4 routed experts (top 2, sorted tokens and ragged_dot) "
             "beside a shared one, bf16 activations, AdamW, donated state, 1-device CPU "
             "mesh"),
]}
"""MaxText's steps, by name."""

SHARDED: dict[str, MaxTextSpec] = {s.name: s for s in [
    MaxTextSpec(
        "maxtext-llama2-fsdp8", CONFIG, devices=8,
        note=f"MaxText {MAXTEXT_VERSION}'s train_step as maxtext-llama2, over 8 CPU devices: "
             "MaxText's own mesh and rules (fsdp 8: the batch and the state split 8 ways), "
             "per-device batch 2; needs a process that sees 8 devices"),
    MaxTextSpec(
        "maxtext-llama2-fsdp2tp4", {**CONFIG, "ici_fsdp_parallelism": 2,
                                    "ici_tensor_parallelism": 4, "base_num_query_heads": 8,
                                    "base_num_kv_heads": 4, "head_dim": 16}, devices=8,
        note=f"MaxText {MAXTEXT_VERSION}'s train_step as maxtext-llama2 with 8 query heads "
             "over 4 K/V heads of 16, over 8 CPU devices in a TRN2 job's layout: tensor "
             "parallelism 4 (within a chip) x fsdp 2, MaxText's own mesh and rules, "
             "per-device batch 2; needs a process that sees 8 devices"),
]}
"""MaxText's steps over several devices (not in `STEPS`: a process sees its device count
from the start; ``maxtext_fit.py --host-devices 8 --steps maxtext-llama2-fsdp8``).
``maxtext-llama2-fsdp2tp4`` has a TRN2 job's shape: tensor parallelism within a chip, FSDP
across."""

LAYERS: dict[str, MaxTextSpec] = {s.name: s for s in [
    STEPS["maxtext-llama2"],
    MaxTextSpec("maxtext-gemma2", {**CONFIG, "decoder_block": "gemma2"},
                layer=("gemma2", "Gemma2DecoderLayer")),
    STEPS["maxtext-mixtral"],
    MaxTextSpec("maxtext-mixtral-dense",
                {**CONFIG, "decoder_block": "mixtral", **MOE, "sparse_matmul": False},
                layer=("mixtral", "MixtralDecoderLayer")),
    MaxTextSpec("maxtext-deepseek", {**CONFIG, "decoder_block": "deepseek", **MOE, **MLA},
                layer=("deepseek", "DeepSeekMoELayer")),
    MaxTextSpec("maxtext-qwen3-next", {**CONFIG, "decoder_block": "qwen3_next", **MOE,
                                       **QWEN3_NEXT},
                layer=("qwen3", "Qwen3NextDecoderLayer"), layer_kwargs=(("layer_idx", 0),)),
    MaxTextSpec("maxtext-gpt-oss", {**CONFIG, **MOE, **GPT_OSS},
                layer=("gpt_oss", "GptOssDecoderLayer"),
                layer_kwargs=(("attention_type", "local_sliding"),), inputs_on_mesh=True),
    MaxTextSpec("maxtext-llama4", {**CONFIG, **MOE, **LLAMA4},
                layer=("llama4", "Llama4DecoderLayer"),
                layer_kwargs=(("is_moe_layer", True), ("is_nope_layer", False)),
                inputs_on_mesh=True),
]}
"""MaxText decoder layers whose traced footprint is held to JAX's residuals: llama2's;
gemma2's (a local and a global attention sublayer, soft-capped logits); mixtral's MoE on
MaxText's sparse path and on its dense one (``sparse_matmul=False``: every expert on
every token, weighted by the router); DeepSeek's MoE layer with MLA and a shared
expert; Qwen3-Next's linear-attention layer (a gated delta net: a scan with a
differentiated carry inside the layer) with its MoE; GPT-OSS's sliding-window layer
(attention sinks, biased projections and experts, a clamped gate); Llama4's chunked-attention
MoE layer (queries and keys L2-normed, a shared expert beside the routed ones)."""
