"""axlearn's real layers in a training step, as a held-out step of the zoo (a test fixture).

Needs a real axlearn at commit 34aed43c1b6e581c4753d06d7cbeedd5010ef26b (apple/axlearn,
2026-07-08; Python 3.12, JAX 0.8.3, the packages README "The tests on a real axlearn" lists
without the TensorFlow input stack: ``axlearn.common`` imports without it). Nothing here is
copied from axlearn: the model is axlearn's own ``causal_lm.Model``, configured as Fuji's
``model_config`` configures it (``axlearn/experiments/text/gpt/fuji.py`` lines 1025-1103 and
``axlearn/experiments/text/gpt/common.py`` ``model_config``, lines 209-379; those modules
import seqio, so the few ``set`` calls are repeated here, each cited):

* ``Decoder`` with ``TransformerTextEmbeddings(pos_emb=None)``, an untied ``LmHead``
  (``shared_lm_head=False``, as Fuji's v3 sizes) and a ``RepeatedTransformerLayer`` (a
  ``jax.lax.scan`` over the layers) of ``TransformerLayer``s: prenorm
  ``TransformerAttentionLayer`` with a causal ``GroupedQueryAttention`` whose input linear is
  ``RoFormerQKVLinear(rotary_value=False)`` around ``FusedGroupedQKVLinear(num_kv_heads)``
  (rotary embedding, GQA), prenorm ``TransformerFeedForwardLayer`` with
  ``activation=("nn.silu", "linear")`` (SwiGLU), ``RMSNorm(eps=1e-5, forward_dtype=None)``
  everywhere (``set_norm_recursively``), no biases (``set_bias_recursively(cfg, False)``),
  ``DefaultInitializer`` fan-in normal weights, ``model.dtype`` float32;
* the loss is ``causal_lm.Model``'s own (``Decoder`` logits, axlearn's ``cross_entropy``);
* the step is the shape of ``SpmdTrainer._train_step`` (``axlearn/common/trainer.py`` lines
  1281-1316) without its learner: the parameters cast to ``bfloat16`` for the forward pass
  (Fuji's ``train_dtype = STEP_DTYPE``), the model called under ``functional`` in training
  mode, ``jax.value_and_grad``, then optax AdamW on the float32 parameters; the state
  (parameters, optimizer state) is donated (``jax.jit(step, donate_argnums=(0,))``).

The remat policy goes in the way axlearn's ``build_remat_spec`` (``axlearn/common/
attention.py`` lines 4594-4653) sets it on the ``TransformerLayer`` config inside the stack
(``update_model_remat_config``, common.py 191-206): a ``RematSpec`` whose ``policy`` is a
``config_for_function`` returning the given JAX policy, instantiated by
``BaseLayer._maybe_wrap_with_remat`` (``axlearn/common/base_layer.py`` 531-595), which wraps
``TransformerLayer.forward`` in ``jax.checkpoint`` inside the scan body. ``prevent_cse`` is
what ``build_remat_spec`` gives a ``RepeatedTransformerLayer`` (False: the layer runs in a
scan; True compiles to the same bytes and FLOPs for every save set on XLA:CPU). No remat is ``everything_saveable`` through
the same path. The tags are axlearn's own, ``"<LayerClass>.<name>"`` from
``BaseLayer._remat_name`` (base_layer.py 783-797), e.g. ``GroupedQueryAttention.q_proj``,
``TransformerFeedForwardLayer.linear1_0``.

``axlearn-fuji-moe`` replaces every layer's feed-forward by axlearn's
``TransformerFeedForwardMoE`` routed by ``TopKGating`` (`MOE_SIZES`,
`moe_feed_forward_config`: Envy's ``expert_config``, set as common.py's ``config_sparse``
sets a "sparse" layer, lines 312-318); `moe_layer` is that layer alone.

``axlearn-fuji-ga2`` is ``axlearn-fuji`` over a global batch of 4 x 128 tokens with
axlearn's own gradient accumulation in 2 micro-batches of ``axlearn-fuji``'s 2 x 128
(`_accumulated_value_and_grad`): the trainer's forward function (``SpmdTrainer._train_step``'s
``_forward``, trainer.py 1305-1318, a ``ForwardFn``) decorated by ``with_minibatch_steps(
steps=2, metric_accumulator=MetricAccumulator.default_config())``
(``axlearn/common/gradient_accumulation.py`` 96-351), as the ``Learner``'s
``forward_fn_transformation`` (learner.py 186-191, 211-214), its gradient taken by the
learner's ``_value_and_grad`` (learner.py 710-752). The decorator's ``jax.custom_vjp``
computes the gradient in its forward pass: a ``jax.lax.scan`` over the micro-batches whose
body runs ``jax.value_and_grad`` of the forward function, so each layer's backward runs
twice (once a micro-batch) while one micro-batch's residuals are alive at a time.

`STEPS` follows tests/cpu/zoo.py's `Spec` protocol (name, split, note, extra, scan,
``make_step()`` -> ``policy -> jitted step``, ``abstract_args()``), so
benchmarks/fit_sweep.py's machinery runs on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

AXLEARN_COMMIT = "34aed43c1b6e581c4753d06d7cbeedd5010ef26b"

SIZES: dict[str, Any] = dict(
    num_layers=4, hidden_dim=128, num_heads=4, num_kv_heads=2, ffn_dim=512, vocab_size=256,
    batch=2, seq=128, rope_theta=5e5)
"""A tiny Fuji: 4 scanned layers, hidden 128, GQA 4:2 heads of 32, SwiGLU of 512 (Fuji's
8/3 scaling of 128 rounded up to 256), vocabulary 256, 2 x 128 tokens."""

MOE_SIZES: dict[str, Any] = dict(SIZES, num_experts=4, experts_per_token=2, num_groups=2,
                                 capacity_factor=2.0)
"""`SIZES` with a mixture of 4 experts, top-2 routing, 2 dispatch groups and capacity factor
2: 2 x 128 = 256 tokens, so 128 tokens a group and an expert capacity of 128 x 2 / 4 = 64
(``_compute_expert_capacity``, mixture_of_experts.py 224). 4 experts and top-2 as axlearn's
MoE layer tests (``mixture_of_experts_test.py`` 847-855: ``num_experts=4``,
``TopKGating...set(num_experts_per_token=2)``, SwiGLU); 2 groups and capacity factor 2.0 as
every size of axlearn's MoE experiment, Envy (``axlearn/experiments/text/gpt/envy.py``
148-150, 172-173, 266-267, 348-349). Each expert's SwiGLU hidden dim is the dense layer's
(`SIZES`' ``ffn_dim``): common.py's ``model_config`` gives the MoE ``ffn_dim`` when no
``moe_ffn_dim`` is set (common.py 282-283)."""

MOE_GATINGS = ("TopKGating", "Top2Gating")
"""The routers: axlearn's ``TopKGating`` (top-k with ``jax.lax.top_k``; it tags its outputs
``TopKGating.gate_weights`` and ``TopKGating.gate_assignment``, mixture_of_experts.py
801-802) and ``Top2Gating`` (the ``TransformerFeedForwardMoE.Config`` default, 1485, which
Envy keeps, envy.py 472-479; it tags nothing)."""


def available() -> str | None:
    """None when axlearn's layers import here; else why not (a skip reason)."""
    try:
        import axlearn.common.attention  # noqa: PLC0415, F401
        import axlearn.common.causal_lm  # noqa: PLC0415, F401
    except Exception as err:  # noqa: BLE001 - any reason is a reason to skip
        return f"axlearn does not import here ({type(err).__name__}: {err})"
    return None


def _policy_fn(policy: Any) -> Any:
    """For ``config_for_function``: returns `policy` (the JAX remat policy)."""
    return policy


def model_config(sizes: dict[str, Any], policy: Any, prevent_cse: bool,
                 rope: bool = True, flash: bool = False, moe: str | None = None,
                 trn2: bool = False) -> Any:
    """axlearn's ``causal_lm.Model`` config, as Fuji's ``model_config`` (fuji.py 1064-1103)
    and common.py's ``model_config`` (278-379) build it, `policy` in its ``RematSpec``;
    without `rope`, the attention's input linear is Fuji's ``FusedGroupedQKVLinear`` alone
    (no ``RoFormerQKVLinear`` around it); with `flash`, the attention is axlearn's
    ``FlashAttention`` (Fuji's with ``flash_attention=True``: its kernel through
    ``jax.shard_map``; trace it under `mesh()`); with `moe` (one of `MOE_GATINGS`), every
    layer's feed-forward is axlearn's ``TransformerFeedForwardMoE`` routed by it
    (`moe_feed_forward_config`, `sizes` as `MOE_SIZES`), set as common.py sets a "sparse"
    layer (``config_sparse``, 312-318); with `trn2`, the modules and partition specs of
    Fuji's TRN2 mesh rule (`trn2_modifications`) but the stack, which stays scanned."""
    import jax.numpy as jnp  # noqa: PLC0415
    from axlearn.common import causal_lm  # noqa: PLC0415
    from axlearn.common.attention import (  # noqa: PLC0415
        FusedGroupedQKVLinear,
        GroupedQKVLinear,
        GroupedQueryAttention,
        KVCache,
        RepeatedTransformerLayer,
        RoFormerQKVLinear,
        TransformerLayer,
        set_double_shard_weights_config,
    )
    from axlearn.common.base_layer import RematSpec  # noqa: PLC0415
    from axlearn.common.config import config_for_function  # noqa: PLC0415
    from axlearn.common.decoder import Decoder, LmHead  # noqa: PLC0415
    from axlearn.common.embedding import TransformerTextEmbeddings  # noqa: PLC0415
    from axlearn.common.flash_attention.layer import FlashAttention  # noqa: PLC0415
    from axlearn.common.layers import (  # noqa: PLC0415
        RMSNorm,
        set_bias_recursively,
        set_norm_recursively,
    )
    from axlearn.common.param_init import (  # noqa: PLC0415
        PARAM_REGEXP_WEIGHT,
        DefaultInitializer,
        WeightInitializer,
    )

    s = sizes
    # fuji.py 1064-1083.
    activation_fn = ("nn.silu", "linear")
    atten_cfg = (FlashAttention if flash else GroupedQueryAttention).default_config()
    if flash:  # common.py 93-106 (flash_attention_config): the kernel's shard_map specs
        from jax.sharding import PartitionSpec as P  # noqa: PLC0415

        batch = ("data", "expert", "fsdp")
        atten_cfg.set(mha_dim_to_partition_spec={
            "btnh": P(batch, None, ("seq", "model"), None),
            "bsnh": P(batch, None, ("seq", "model"), None),
            "bnts": P(batch, None, None, None),
        }, output_dim_to_partition_spec={
            "btnh": P(batch, "seq", "model", None),
            "bnts": P(batch, "model", "seq", None),
        })
    # fuji.py 209-217: TRN2 swaps in GroupedQKVLinear (V3, and 70B), keeping the fields the
    # two configs share (ModuleConfigModifier._merge_configs, trainer_config_modifier.py
    # 219-243): num_kv_heads and the projection layer
    atten_input_linear = (GroupedQKVLinear if trn2 else FusedGroupedQKVLinear
                          ).default_config().set(num_kv_heads=s["num_kv_heads"])
    if rope:
        atten_qkv_linear = RoFormerQKVLinear.default_config().set(
            input_linear=atten_input_linear, rotary_value=False)
        atten_qkv_linear.input_linear.layer.param_partition_spec = ("fsdp", "model", None)
        atten_qkv_linear.rope_pos_emb_layer.theta = s["rope_theta"]
    else:  # Fuji's input linear without its RoFormerQKVLinear wrapper: no rotary embedding
        atten_qkv_linear = atten_input_linear
        atten_qkv_linear.layer.param_partition_spec = ("fsdp", "model", None)
    attention_kv_cache = KVCache.default_config().set(cache_dtype=jnp.bfloat16)
    stack_cfg = RepeatedTransformerLayer.default_config()
    # common.py 278-293.
    layer_cfg = TransformerLayer.default_config()
    layer_cfg.self_attention.attention = atten_cfg
    layer_cfg.self_attention.attention.causal = True
    layer_cfg.self_attention.attention.num_heads = s["num_heads"]
    layer_cfg.self_attention.attention.input_linear = atten_qkv_linear
    layer_cfg.self_attention.attention.kv_cache = attention_kv_cache
    layer_cfg.self_attention.structure = "prenorm"
    layer_cfg.self_attention.attention.atten_logit_cap = None
    # update_model_remat_config -> build_remat_spec (attention.py 4641-4653), the policy
    # replaced by the one under test.
    layer_cfg.set(remat_spec=RematSpec(
        prevent_cse=prevent_cse,
        policy=config_for_function(_policy_fn).set(policy=policy)))
    # common.py 295-303.
    set_double_shard_weights_config(
        layer_cfg, batch_axis_names=("data", "expert", "fsdp"),
        fsdp_axis_names=("expert", "fsdp", "seq"), tp_axis_names="model",
        seq_axis_names="seq")
    # common.py 305-310 (config_dense) or 312-318 (config_sparse: the expert config, then
    # the same three; its hidden dim is ``ffn_dim`` when no ``moe_ffn_dim`` is set, 282-283),
    # 331-333.
    lm_layer_cfg = layer_cfg.clone()
    if moe is not None:
        lm_layer_cfg.feed_forward = moe_feed_forward_config(s, moe)
    lm_layer_cfg.feed_forward.activation = activation_fn
    lm_layer_cfg.feed_forward.hidden_dim = s["ffn_dim"]
    lm_layer_cfg.feed_forward.structure = "prenorm"
    transformer_cfg = stack_cfg.set(num_layers=s["num_layers"], layer=lm_layer_cfg)
    # common.py 346-379 (378-379: bias and norm over the whole model, the MoE included).
    decoder_cfg = Decoder.default_config().set(
        transformer=transformer_cfg, attention_mask=None, dim=s["hidden_dim"],
        vocab_size=s["vocab_size"],
        emb=TransformerTextEmbeddings.default_config().set(pos_emb=None),
        lm_head=LmHead.default_config(), dropout_rate=0.0)
    model_param_init = DefaultInitializer.default_config().set(init_by_param_name={
        PARAM_REGEXP_WEIGHT: WeightInitializer.default_config().set(
            fan="fan_in", distribution="normal")})
    cfg = causal_lm.Model.default_config().set(
        decoder=decoder_cfg, param_init=model_param_init, batch_axis_names=None)
    cfg.dtype = jnp.float32
    cfg.decoder.logits_partition_spec = (("data", "expert", "fsdp"), "seq", "model")
    set_bias_recursively(cfg, False)
    set_norm_recursively(cfg, RMSNorm.default_config().set(eps=1e-5, forward_dtype=None))
    if trn2:
        for path, specs in trn2_modifications().items():
            cfg.get_recursively(path.split(".")[1:]).set(**specs)
    return cfg


def trn2_modifications() -> dict[str, dict[str, Any]]:
    """The partition specs Fuji's TRN2 mesh rule sets (fuji.py 219-266, with the LM head's
    for 70B and 8B): the embedding and LM head vocabulary-parallel over ``model``, the norms
    sequence-parallel (input split along the sequence over ``model``), the feed-forward's
    output batch-split only. By config path, as ``PartitionSpecModifier`` takes them."""
    seq_parallel = {"input_partition_spec": (("data", "fsdp"), "model", None),
                    "output_partition_spec": (("data", "fsdp"), None, None)}
    vocab_parallel = ("model", ("expert", "fsdp", "seq"))
    return {
        "model.decoder.emb.token_emb": {
            "param_partition_spec": vocab_parallel,
            "input_partition_spec": (("data", "fsdp"), None),
            "output_partition_spec": (("data", "fsdp"), None, None),
            "embedding_partition_spec": ("model", None)},
        "model.decoder.transformer.layer.self_attention.norm": seq_parallel,
        "model.decoder.transformer.layer.feed_forward.norm": seq_parallel,
        "model.decoder.output_norm": seq_parallel,
        "model.decoder.transformer.layer.feed_forward.linear2": {
            "output_partition_spec": (("data", "fsdp"), None, None)},
        "model.decoder.lm_head": {"param_partition_spec": vocab_parallel},
    }


@dataclass(frozen=True)
class AxlearnSpec:
    """A training step of axlearn's ``causal_lm.Model`` (Fuji's configuration) at `sizes`."""

    name: str
    sizes: dict[str, Any]
    prevent_cse: bool = False
    rope: bool = True
    flash: bool = False
    moe: str | None = None
    split: str = "held-out"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    scan: bool = True
    devices: int = 1
    """The devices of `mesh`; above 1 the batch is split over ``("data", "fsdp")``, as
    axlearn's input partition does, and the process must see that many devices
    (``XLA_FLAGS=--xla_force_host_platform_device_count=8``)."""
    model: int = 1
    """The mesh's ``model`` axis (tensor parallelism), `devices` // `model` along ``fsdp``."""
    trn2: bool = False
    """Fuji's TRN2 layout (`model_config`'s `trn2`), the state split as the parameters'
    partition specs say (as axlearn's trainer lays it out)."""
    minibatch_steps: int = 0
    """Above 0, the step accumulates gradients over that many micro-batches as axlearn's
    ``Learner`` does when its ``forward_fn_transformation`` is ``with_minibatch_steps``
    (`_make`); the batch of `sizes` is the global batch, split among them."""

    def _model(self, policy: Any) -> Any:
        return model_config(self.sizes, policy, self.prevent_cse, self.rope, self.flash,
                            self.moe, self.trn2).set(name="model").instantiate(parent=None)

    def abstract_args(self) -> tuple[Any, Any]:
        """((abstract float32 parameters, abstract AdamW state), abstract input batch)."""
        return _abstract_args(self.name, tuple(sorted(self.sizes.items())),
                              self.prevent_cse, self.rope, self.flash, self.moe, self.devices,
                              self.model, self.trn2)

    def make_step(self) -> Callable[[Any], Any]:
        def make(policy: Any) -> Any:
            return _make(self, policy)

        return make


def mesh(devices: int = 1, model: int = 1) -> Any:
    """A mesh over Fuji's axes, `devices` // `model` along ``fsdp`` and `model` along
    ``model`` (one device by default): axlearn's ``FlashAttention`` reads the mesh its
    kernel's ``shard_map`` runs on from the one in effect, and axlearn's sharding
    constraints apply only under one."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from host_devices import first  # noqa: PLC0415

    return jax.sharding.Mesh(np.array(first(devices, "a mesh of Fuji's axes")).reshape(
        1, 1, devices // model, 1, model),
                             ("data", "expert", "fsdp", "seq", "model"))


def _optimizer() -> Any:
    import optax  # noqa: PLC0415

    return optax.adamw(1e-3, weight_decay=0.1)


@functools.lru_cache(maxsize=None)
def _abstract_args(name: str, sizes: tuple[tuple[str, Any], ...],
                   prevent_cse: bool, rope: bool, flash: bool,
                   moe: str | None, devices: int = 1, tp: int = 1,
                   trn2: bool = False) -> tuple[Any, Any]:
    del name
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    s = dict(sizes)
    model = model_config(s, jax.checkpoint_policies.nothing_saveable, prevent_cse, rope,
                         flash, moe, trn2).set(name="model").instantiate(parent=None)
    tx = _optimizer()

    def state() -> Any:
        params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
        return params, tx.init(params)

    P = jax.sharding.PartitionSpec  # noqa: N806
    split = None if devices == 1 else jax.sharding.NamedSharding(
        mesh(devices, tp), P(("data", "fsdp"), None))
    batch = {k: jax.ShapeDtypeStruct((s["batch"], s["seq"]), jnp.int32, sharding=split)
             for k in ("input_ids", "target_labels")}
    abstract = jax.eval_shape(state)
    if not trn2:
        return abstract, batch
    # the trainer's layout (trainer.py 355-362: the parameters' partition from the model's
    # parameter specs, the learner's state partition from them): each parameter, and
    # AdamW's two moments of it, as its ``mesh_axes`` say; the step count replicated
    specs = jax.tree.map(lambda spec: jax.sharding.NamedSharding(
        mesh(devices, tp), P(*spec.mesh_axes)), model.create_parameter_specs_recursively(),
        is_leaf=lambda x: hasattr(x, "mesh_axes"))
    everywhere = jax.sharding.NamedSharding(mesh(devices, tp), P())

    def laid(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            tree, shardings)

    params, opt = abstract
    adam = opt[0]._replace(mu=laid(opt[0].mu, specs), nu=laid(opt[0].nu, specs),
                           count=laid(opt[0].count, everywhere))
    rest = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=everywhere),
                        opt[1:])
    return (laid(params, specs), (adam, *rest)), batch


def _make(spec: AxlearnSpec, policy: Any) -> Any:
    """The jitted, state-donating step of `spec`'s model with `policy` in its RematSpec
    (traced under `mesh()` where its attention is ``FlashAttention``)."""
    import contextlib  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from axlearn.common import utils  # noqa: PLC0415
    from axlearn.common.module import functional  # noqa: PLC0415

    model = spec._model(policy)  # noqa: SLF001
    tx = _optimizer()

    def loss_fn(params: Any, batch: Any) -> Any:
        # SpmdTrainer._train_step's train_cast (trainer.py 1286-1288, 1306).
        params = utils.cast_floats(params, to_dtype=jnp.bfloat16)
        (loss, _), _ = functional(model, prng_key=jax.random.PRNGKey(1), state=params,
                                  inputs=dict(input_batch=batch), is_training=True)
        return loss

    value_and_grad = (_accumulated_value_and_grad(model, spec.minibatch_steps)
                      if spec.minibatch_steps else jax.value_and_grad(loss_fn))

    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        params, opt = state
        with mesh(spec.devices, spec.model) if spec.flash or spec.devices > 1 \
                else contextlib.nullcontext():
            loss, grads = value_and_grad(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    return jax.jit(step, donate_argnums=(0,))


def _accumulated_value_and_grad(model: Any, steps: int) -> Callable[[Any, Any], Any]:
    """``(params, batch) -> (loss, grads)`` through axlearn's own gradient accumulation, as
    ``SpmdTrainer._train_step`` and ``Learner.forward_and_backward`` run it:

    * the forward function is the trainer's ``_forward`` (trainer.py 1305-1318: a
      ``ForwardFn``, ``fn(*, model_params, inputs) -> ForwardOutputs``; ``ForwardFn`` and
      ``ForwardOutputs`` at update_transformation.py 317-347): the parameters cast to
      bfloat16 (``train_cast``), ``apply_parameter_noise_recursively`` (none configured),
      the model called with ``inputs["forward_key"]`` in training mode; here under
      ``functional`` (module.py 1212) rather than the trainer's ``child_context``, which
      needs the trainer's invocation context around it;
    * ``Learner.Config.forward_fn_transformation`` is ``config_for_function(
      with_minibatch_steps).set(steps=steps, metric_accumulator=MetricAccumulator.
      default_config())``, as learner.py 186-191 suggests, instantiated as ``Learner.
      __init__`` does (``maybe_instantiate``, learner.py 211-214): a ``jax.custom_vjp``
      whose forward scans ``jax.value_and_grad`` of the forward function over the
      micro-batches and sums the gradients (gradient_accumulation.py 96-351; the batch
      split by ``reshape_for_scan``, 175-202, the scan body 241-282, the scan 284-288);
    * the gradient is ``learner._value_and_grad`` of the decorated function (learner.py
      710-752, as ``Learner.forward_and_backward`` calls it, 359-367), every parameter an
      ``OptParam`` with gradients (``should_compute_gradients`` all True);
    * the inputs are the trainer's (trainer.py 1295-1297, 1332-1336): ``input_batch``,
      ``forward_key`` and ``param_noise_key`` split from one key."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from axlearn.common import utils  # noqa: PLC0415
    from axlearn.common.config import config_for_function, maybe_instantiate  # noqa: PLC0415
    from axlearn.common.gradient_accumulation import with_minibatch_steps  # noqa: PLC0415
    from axlearn.common.learner import _value_and_grad  # noqa: PLC0415
    from axlearn.common.metrics import MetricAccumulator  # noqa: PLC0415
    from axlearn.common.module import functional  # noqa: PLC0415
    from axlearn.common.optimizer_base import OptParam  # noqa: PLC0415
    from axlearn.common.update_transformation import ForwardOutputs  # noqa: PLC0415

    def forward(*, model_params: Any, inputs: Any) -> Any:
        # trainer.py 1305-1318 (train_cast as in `_make`'s loss_fn)
        params = utils.cast_floats(model_params, to_dtype=jnp.bfloat16)
        params = model.apply_parameter_noise_recursively(inputs["param_noise_key"], params)
        (loss, aux), collection = functional(
            model, prng_key=inputs["forward_key"], state=params,
            inputs=dict(input_batch=inputs["input_batch"]),
            is_training=True)
        return ForwardOutputs(loss=loss, aux=aux, output_collection=collection)

    accumulate = maybe_instantiate(config_for_function(with_minibatch_steps).set(
        steps=steps, metric_accumulator=MetricAccumulator.default_config()))
    forward_fn = accumulate(forward)

    def value_and_grad(params: Any, batch: Any) -> tuple[Any, Any]:
        # trainer.py 1295-1297: the keys split from the step's key
        _, param_noise_key, forward_key, _ = jax.random.split(jax.random.PRNGKey(1), 4)
        updates = _value_and_grad(
            forward_fn,
            opt_params=jax.tree.map(lambda p: OptParam(value=p, factorization_spec=None,
                                                       weight_decay_scale=1.0), params),
            inputs=dict(input_batch=batch, forward_key=forward_key,
                        param_noise_key=param_noise_key),
            should_compute_gradients=jax.tree.map(lambda _: True, params))
        return updates.forward_pass["default"].outputs.loss, updates.delta_updates

    return value_and_grad


_FUJI = ("axlearn's causal_lm.Model as Fuji configures it (RepeatedTransformerLayer of 4 "
         "TransformerLayers: RMSNorm, GQA 4:2 via FusedGroupedQKVLinear, SwiGLU), untied "
         "LmHead, axlearn's cross entropy, bf16 forward over f32 weights, optax AdamW, "
         "donated state")

STEPS: dict[str, AxlearnSpec] = {s.name: s for s in [
    AxlearnSpec(
        "axlearn-fuji", SIZES, prevent_cse=False, rope=True,
        note=_FUJI + "; RoPE (RoFormerQKVLinear); RematSpec(prevent_cse=False) as "
             "build_remat_spec gives a scanned stack"),
    AxlearnSpec(
        "axlearn-fuji-flash", SIZES, prevent_cse=False, rope=True, flash=True,
        note=_FUJI + "; RoPE; axlearn's FlashAttention (its kernel through jax.shard_map: "
             "on the CPU axlearn's reference kernel, which tags no context) under a "
             "one-device mesh of Fuji's axes"),
    AxlearnSpec(
        "axlearn-fuji-norope", SIZES, prevent_cse=False, rope=False,
        note=_FUJI + "; no RoPE (FusedGroupedQKVLinear alone); RematSpec(prevent_cse=False)"),
    AxlearnSpec(
        "axlearn-fuji-ga2", dict(SIZES, batch=4), prevent_cse=False, rope=True,
        minibatch_steps=2,
        note=_FUJI + "; RoPE; axlearn's gradient accumulation: the trainer's forward "
             "function decorated by with_minibatch_steps(steps=2, MetricAccumulator) as "
             "the Learner's forward_fn_transformation, 4 x 128 tokens in 2 micro-batches "
             "of 2 x 128"),
    AxlearnSpec(
        "axlearn-fuji-moe", MOE_SIZES, prevent_cse=False, rope=True, moe="TopKGating",
        note=_FUJI + "; RoPE; every layer's feed-forward axlearn's TransformerFeedForwardMoE "
             "(TopKGating, 4 SwiGLU experts of 512, top 2, 2 groups, capacity factor 2)"),
]}
"""axlearn's steps, by name. ``axlearn-fuji`` is Fuji's layer as configured (rotary
embedding included: ``rotate_half``'s strided slices, attention.py 1337-1338, are gathers on
JAX 0.8.3, so the layer's backward holds scatter-adds); ``axlearn-fuji-norope`` drops
``RoFormerQKVLinear``, a structurally different attention; ``axlearn-fuji-moe`` is
``axlearn-fuji`` with every layer's feed-forward axlearn's ``TransformerFeedForwardMoE``
(`MOE_SIZES`, routed by ``TopKGating``: `moe_layer_config`'s layer, in the stack);
``axlearn-fuji-ga2`` is ``axlearn-fuji``'s model over twice its batch through axlearn's
gradient accumulation in 2 micro-batches (``with_minibatch_steps``)."""

SHARDED: dict[str, AxlearnSpec] = {s.name: s for s in [
    AxlearnSpec(
        "axlearn-fuji-flash-fsdp8", dict(SIZES, batch=8 * SIZES["batch"]), prevent_cse=False,
        rope=True, flash=True, devices=8,
        note=_FUJI + "; RoPE; axlearn's FlashAttention, its kernel's shard_map over a mesh "
             "of 8 devices along fsdp; the batch x8 split over (data, fsdp), the state "
             "replicated; needs a process that sees 8 devices"),
    AxlearnSpec(
        "axlearn-fuji-trn2-tp4", dict(SIZES, num_heads=8, num_kv_heads=4, batch=4),
        prevent_cse=True, rope=True, flash=True, devices=8, model=4, trn2=True,
        note=_FUJI.replace("GQA 4:2 via FusedGroupedQKVLinear", "GQA 8:4 via "
                           "GroupedQKVLinear") + "; Fuji-70B's TRN2 layout (fuji.py 186-271, "
             "888-920) but the scanned stack: a mesh of 2 along fsdp x 4 along model over 8 "
             "devices, the state split by the parameters' partition specs, sequence-"
             "parallel norms, vocabulary-parallel embedding and head, FlashAttention with "
             "Fuji's kernel specs, RematSpec(prevent_cse=True); 4 x 128 tokens split over "
             "fsdp; needs a process that sees 8 devices"),
]}
"""axlearn's steps over several devices (not in `STEPS`: a process sees its device count
from the start; ``axlearn_fit.py --host-devices 8 --steps axlearn-fuji-flash-fsdp8``).
``axlearn-fuji-trn2-tp4`` is the layout Fuji-70B trains in on TRN2 (tensor parallelism
within a chip, FSDP across), the one departure its scanned stack (the rule's
``StackedTransformerLayer`` is an unrolled loop, whose memory XLA:CPU keeps whatever the
policy)."""


# --------------------------------------------------------------------------------------
# axlearn's mixture-of-experts feed-forward (in axlearn-fuji-moe's layers; one layer alone).
# --------------------------------------------------------------------------------------

def moe_feed_forward_config(sizes: dict[str, Any], gating: str) -> Any:
    """axlearn's ``TransformerFeedForwardMoE`` config routed by `gating` (one of
    `MOE_GATINGS`) at `sizes` (`MOE_SIZES`' keys), as Envy's ``expert_config`` sets it
    (envy.py 472-479); `model_config` puts it in every layer and sets its ``activation``,
    ``hidden_dim`` and ``structure`` as common.py's ``config_sparse`` does (312-318)."""
    from axlearn.common.mixture_of_experts import (  # noqa: PLC0415
        TopKGating,
        TransformerFeedForwardMoE,
    )

    if gating not in MOE_GATINGS:
        raise ValueError(f"gating {gating!r} is not one of {MOE_GATINGS}")
    s = sizes
    # envy.py 467-479: outer_batch from the mesh's data x fsdp axes (get_outer_batch_from_
    # mesh, mixture_of_experts.py 261-305): 1 on one device; the partition specs are left
    # at the class defaults, as maybe_shard does nothing on one device (utils.py 674-678).
    expert_cfg = TransformerFeedForwardMoE.default_config().set(
        outer_batch=1, num_experts=s["num_experts"], input_dim=s["hidden_dim"],
        num_groups=s["num_groups"])
    if gating == "TopKGating":  # mixture_of_experts_test.py 854
        expert_cfg.gating = TopKGating.default_config().set(
            num_experts_per_token=s["experts_per_token"])
    elif s["experts_per_token"] != 2:
        raise ValueError("Top2Gating routes each token to 2 experts")
    expert_cfg.gating.train_capacity_factor = s["capacity_factor"]  # envy.py 479
    return expert_cfg


def moe_layer_config(sizes: dict[str, Any], gating: str, policy: Any = None) -> Any:
    """axlearn's ``TransformerLayer`` as Fuji's stack holds it (`model_config`: RMSNorm,
    causal GQA 4:2 through ``FusedGroupedQKVLinear`` inside ``RoFormerQKVLinear``, no
    biases) with its feed-forward a ``TransformerFeedForwardMoE`` (`moe_feed_forward_config`,
    set as common.py's ``model_config`` sets a "sparse" layer, ``config_sparse``, common.py
    312-318: the ``expert_cfg``, then ``activation`` (SwiGLU, as Envy's, envy.py 491),
    ``hidden_dim`` and ``structure``; bias and norm over the whole model, 378-379, and
    envy.py 454's norm): `model_config`'s ``axlearn-fuji-moe`` layer. With `policy`, the
    layer's ``RematSpec`` holds it (``BaseLayer._maybe_wrap_with_remat`` then wraps
    ``TransformerLayer.forward`` in ``jax.checkpoint``, base_layer.py 585-589;
    ``prevent_cse=False``, what ``build_remat_spec`` gives Envy's
    ``RepeatedTransformerLayer`` stack, attention.py 4649); without, no remat."""
    import jax  # noqa: PLC0415
    from axlearn.common.base_layer import RematSpec  # noqa: PLC0415
    from axlearn.common.config import config_for_function  # noqa: PLC0415

    s = sizes
    layer_cfg = model_config(s, jax.checkpoint_policies.nothing_saveable, prevent_cse=False,
                             rope=True, moe=gating).decoder.transformer.layer.clone()
    layer_cfg.remat_spec = None if policy is None else RematSpec(
        prevent_cse=False, policy=config_for_function(_policy_fn).set(policy=policy))
    return layer_cfg.set(name="layer", input_dim=s["hidden_dim"])


def moe_layer(gating: str, policy: Any = None,
              sizes: dict[str, Any] | None = None) -> tuple[Callable[..., Any], Any, Any]:
    """(layer function of (params, x), bfloat16 parameters, bfloat16 input) of
    `moe_layer_config`'s layer: axlearn's module called under ``functional`` in training
    mode, its output tensor returned. Parameters are axlearn's initialisation
    (``PRNGKey(0)``) cast to bfloat16 as ``SpmdTrainer``'s ``train_cast`` casts them
    (trainer.py 1286-1288); the input is normal noise, so that tokens spread over the
    experts (the kept bytes do not depend on the values)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from axlearn.common.module import functional  # noqa: PLC0415

    s = MOE_SIZES if sizes is None else sizes
    layer = moe_layer_config(s, gating, policy).instantiate(parent=None)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                          layer.initialize_parameters_recursively(jax.random.PRNGKey(0)))
    x = jax.random.normal(jax.random.PRNGKey(2), (s["batch"], s["seq"], s["hidden_dim"]),
                          jnp.bfloat16)

    def fn(params: Any, x: Any) -> Any:
        out, _ = functional(layer, prng_key=jax.random.PRNGKey(1), state=params,
                            inputs=dict(data=x), is_training=True)
        return out.data

    return fn, params, x
