"""Training steps written independently of tests/cpu/zoo.py, in other libraries' styles
(held-out evidence for `neuron_remat.fit`; a test fixture).

zoo.py's steps share one hand-written ``Spec.layer`` over a dict of stacked arrays. The
steps here are written the way a user of each library would write them, and none of them
was looked at while `fit`'s search constants were tuned:

* ``linen-gpt2`` -- a Flax **linen** GPT-2-style decoder: learned positions, pre-LayerNorm
  (with bias), a fused ``c_attn`` QKV ``nn.Dense`` with bias, multi-head causal attention,
  ``c_proj``, a GELU MLP (4x), tied input/output embedding; the blocks are
  ``nn.scan(nn.remat(Block, policy=policy))`` (parameters stacked on axis 0 by
  ``nn.scan``); float32; ``optax.adamw``; the state (parameters, optimizer state) donated.
* ``linen-gpt2-nested`` -- ``linen-gpt2`` with the attention's heads (scores, softmax,
  weighted sum) under a ``jax.checkpoint`` of their own inside the block's ``nn.remat``, as
  a user checkpoints the costliest part of a layer again: a checkpoint inside a
  checkpointed layer, which recomputes ``h/attn/attn_weights`` a second time in the
  backward.
* ``eqx-llama`` -- an **Equinox** LLaMA-style decoder: ``eqx.nn.RMSNorm``, GQA (8 query
  heads over 2 KV heads), interleaved-pair rotary embedding (GPT-J/LLaMA-reference style,
  not zoo.py's rotate-half) applied *before* the tags, SwiGLU MLP; per-token
  ``eqx.nn.Linear``s under ``jax.vmap`` (equinox's single-example convention, batch
  vmapped outside); layers built with ``eqx.filter_vmap`` over split keys and run with
  ``jax.lax.scan`` over ``jax.checkpoint(..., policy=policy)`` of ``eqx.combine``d
  layers; bfloat16 parameters and activations (float32 softmax and loss); ``optax.adafactor``;
  the array partition of the model (``eqx.partition(model, eqx.is_array)``) and the
  optimizer state are what ``jax.jit`` sees, donated. The attention probabilities are
  tagged after their cast to bfloat16 (``layers.attention.probs``): the float32 softmax
  its backward needs is recomputed anyway, so saving that tag only adds bytes (and, on
  XLA:CPU, convert FLOPs).
* ``nnx-parallel`` -- a Flax **nnx** decoder of GPT-J/PaLM-style *parallel* blocks (one
  LayerNorm feeding attention and MLP side by side, summed into the residual), multi-query
  attention (one K/V head) with an ALiBi bias and no position embedding, a squared-ReLU MLP;
  blocks built with ``nnx.split_rngs`` + ``nnx.vmap`` and run with
  ``nnx.scan(nnx.remat(..., policy=policy))``; float32; ``optax.sgd`` with momentum; the
  step is ``jax.jit`` of ``nnx.merge``/``nnx.split`` around the model's ``nnx.State``;
  *not* donated.
* ``haiku-free-mixer`` -- an **MLP-Mixer** image classifier in pure JAX and optax, with no
  NN library: parameters are a nested dict of float32 master weights (the blocks' leaves
  stacked on axis 0 by ``jax.vmap`` of the block initialiser), cast to bfloat16 inside the
  differentiated function; 4x4 patches flattened and embedded by one matmul, then blocks
  of token mixing (an MLP across the 64 patches, on the transposed LayerNorm output) and
  channel mixing (an MLP across the channels), GELU, each branch scaled per channel by a
  LayerScale before its residual add; global average pooling, a zero-initialised head,
  label-smoothed cross-entropy over integer class labels. The blocks run with
  ``jax.lax.scan`` over ``jax.checkpoint(mixer_block, policy=policy)``; the optimizer is
  ``optax.chain(clip_by_global_norm, lion)`` on a warm-up cosine schedule; the state
  (parameters, optimizer state) donated; the batch is ``(images, labels)``. Each MLP's
  two matmul outputs and its GELU are tagged: the GELUs are elementwise, cheaper to redo
  than to hold, and the LayerScale is what makes a second matmul's output worth keeping
  (its backward needs it).
* ``linen-encdec`` -- a Flax **linen** encoder-decoder in the original Transformer's order
  (post-LayerNorm, ReLU MLP, fixed sinusoidal positions, one embedding shared by source,
  target and the tied output projection): a bidirectional encoder stack and a decoder
  stack of causal self-attention, cross-attention over the encoder's output and the MLP,
  each ``nn.scan(nn.remat(Layer, policy=policy))``, the encoder's output broadcast to every
  decoder layer (``in_axes=nn.broadcast``). One ``MultiHeadAttention`` and one
  ``MlpBlock`` module serve both stacks, so every tag name is shared: the encoder's and
  the decoder's layers differ in kind, and ``attention/key``/``attention/value`` tag the
  decoder's self-attention and its cross-attention (over the source length) alike.
  float32; ``optax.adam`` on the inverse-square-root warm-up; donated; the batch is
  ``(source, target)`` tokens.
* ``linen-convnext`` -- a Flax **linen** ConvNeXt image classifier: a 4x4 patchify
  convolution of stride 4, then ``nn.scan(nn.remat(ConvNeXtBlock, policy=policy))``
  blocks of a depthwise 7x7 convolution (``feature_group_count`` = channels), LayerNorm,
  a pointwise MLP (``nn.Dense`` over the channels, 4x, GELU) and a per-channel
  LayerScale; global average pooling, LayerNorm, a linear head. float32 parameters,
  bfloat16 compute (Flax's ``dtype=``); ``optax.adamw`` on a cosine schedule; donated;
  the batch is ``(images, labels)``.
* ``linen-resnet`` -- a Flax **linen** ResNet stage: a 3x3 convolution stem, then
  ``nn.scan(nn.remat(BasicBlock, policy=policy))`` of identical basic blocks (dense 3x3
  convolutions without bias, GroupNorm, ReLU, the residual), global average pooling, a
  linear head; float32; weight decay and SGD with Nesterov momentum (the classic ResNet
  recipe, as an ``optax.chain``); donated. Dense convolutions are nearly all of its work.
* ``eqx-mamba2`` -- an **Equinox** Mamba-2 language model: pre-RMSNorm layers of one
  input projection (the gate, the convolved stream and the per-head step), a causal
  depthwise convolution over time (``conv_general_dilated`` with the past padded) and SiLU,
  the state-space model in its quadratic "state-space duality" form (per head, decays
  from a cumulative sum of the steps, masked to the past, times C.B, in float32), a skip,
  a gated RMSNorm and the output projection; weights held as arrays, stacked with
  ``eqx.filter_vmap`` and run with ``jax.lax.scan`` over ``jax.checkpoint``; bfloat16;
  the embedding tied; clipped ``optax.adamw``; donated.
* ``eqx-llama-accum4`` -- ``eqx-llama``'s model trained with **gradient accumulation** by
  optax's own ``optax.microbatching.microbatch`` around ``jax.value_and_grad`` (a
  ``lax.fori_loop`` over 4 micro-batches of 2 sequences, each taken from the batch by its
  index; each one's forward and backward inside an iteration; loss and gradients
  averaged), then clipped ``optax.adamw``; donated. It runs each layer's backward 16 times
  but holds one micro-batch's residuals at a time.

Tag names follow each library's idiom and differ from zoo.py's (GPT-2 checkpoint paths,
dotted module paths, ``Class.attr``, a pure-JAX user's ``branch.layer``, slash-separated
module paths).

`STEPS` follows zoo.py's `Spec` protocol (name, split, note, extra, scan, ``make_step()`` ->
``policy -> jitted step``, ``abstract_args()``), so ``benchmarks/fit_sweep.py
--steps-module tests.cpu.foreign_zoo`` sweeps them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

@dataclass(frozen=True)
class _Step:
    """The fields of zoo.py's `Spec` protocol every step here shares (each adds its `cfg`,
    `abstract_args()` and `make_step()`)."""

    name: str
    split: str = "held-out"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    scan: bool = True


def _train_step(logits: Callable[[Any, jax.Array], jax.Array],
                tx: optax.GradientTransformation, *, donate: bool,
                apply_updates: Callable[[Any, Any], Any] = optax.apply_updates,
                value_and_grad: Callable[..., Any] = jax.value_and_grad) -> Any:
    """The jitted next-token step every model here trains with: ``state = (params,
    opt_state)`` and ``tokens`` [batch, seq + 1] in, the updated state and the loss out;
    `logits(params, tokens[:, :-1])` is the model. `donate` donates the state;
    `value_and_grad` as `_update_step`'s."""

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(
            logits(params, tokens[:, :-1]), tokens[:, 1:]).mean()

    return _update_step(loss_fn, tx, donate=donate, apply_updates=apply_updates,
                        batch_is_tuple=False, value_and_grad=value_and_grad)


def _update_step(loss_fn: Callable[..., jax.Array], tx: optax.GradientTransformation, *,
                 donate: bool = True,
                 apply_updates: Callable[[Any, Any], Any] = optax.apply_updates,
                 batch_is_tuple: bool = True,
                 value_and_grad: Callable[..., Any] = jax.value_and_grad) -> Any:
    """The jitted step of `loss_fn(params, *batch)` (or `loss_fn(params, batch)`):
    ``state = (params, opt_state)`` and the batch in, the updated state and the loss out.
    `value_and_grad(loss_fn)` gives the loss and the gradients (a transformation of
    ``jax.value_and_grad``, such as gradient accumulation, may stand in for it)."""

    def train_step(state: Any, batch: Any) -> tuple[Any, jax.Array]:
        params, opt_state = state
        args = batch if batch_is_tuple else (batch,)
        loss, grads = value_and_grad(loss_fn)(params, *args)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (apply_updates(params, updates), opt_state), loss

    return jax.jit(train_step, donate_argnums=0 if donate else ())


# ======================================================================================
# 1. Flax linen GPT-2.
# ======================================================================================

import flax.linen as nn  # noqa: E402


@dataclass(frozen=True)
class GPT2Config:
    vocab: int = 256
    n_ctx: int = 128
    n_embd: int = 128
    n_head: int = 4
    n_layer: int = 4
    batch: int = 2
    # the attention's heads (scores, softmax, weighted sum) under a jax.checkpoint of their
    # own, inside the block's nn.remat (linen-gpt2-nested)
    checkpoint_heads: bool = False


class GPT2Block(nn.Module):
    """One GPT-2 block (pre-LN attention + GELU MLP). Carry-in-carry-out for ``nn.scan``."""

    cfg: GPT2Config

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        c = self.cfg
        b, t, d = x.shape
        hd = d // c.n_head
        h = nn.LayerNorm(epsilon=1e-5, name="ln_1")(x)
        qkv = checkpoint_name(nn.Dense(3 * d, name="c_attn")(h), "h/attn/c_attn")

        def heads(qkv: jax.Array) -> jax.Array:
            q, k, v = jnp.split(qkv, 3, axis=-1)
            q, k, v = (a.reshape(b, t, c.n_head, hd).transpose(0, 2, 1, 3)
                       for a in (q, k, v))
            att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd))
            causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
            att = jnp.where(causal, att, jnp.finfo(att.dtype).min)
            att = checkpoint_name(jax.nn.softmax(att, axis=-1), "h/attn/attn_weights")
            return (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)

        y = checkpoint_name(jax.checkpoint(heads)(qkv) if c.checkpoint_heads else heads(qkv),
                            "h/attn/merged_heads")
        x = x + checkpoint_name(nn.Dense(d, name="c_proj")(y), "h/attn/c_proj")
        h = nn.LayerNorm(epsilon=1e-5, name="ln_2")(x)
        f = checkpoint_name(nn.Dense(4 * d, name="mlp_c_fc")(h), "h/mlp/c_fc")
        f = checkpoint_name(nn.gelu(f, approximate=True), "h/mlp/gelu")
        x = x + nn.Dense(d, name="mlp_c_proj")(f)
        return x, None


class GPT2(nn.Module):
    cfg: GPT2Config
    policy: Callable[..., Any] = jax.checkpoint_policies.nothing_saveable

    @nn.compact
    def __call__(self, idx: jax.Array) -> jax.Array:
        c = self.cfg
        t = idx.shape[1]
        wte = nn.Embed(c.vocab, c.n_embd, embedding_init=nn.initializers.normal(0.02),
                       name="wte")
        wpe = self.param("wpe", nn.initializers.normal(0.01), (c.n_ctx, c.n_embd))
        x = wte(idx) + wpe[:t][None]
        blocks = nn.scan(nn.remat(GPT2Block, policy=self.policy, prevent_cse=False),
                         variable_axes={"params": 0}, split_rngs={"params": True},
                         length=c.n_layer)
        x, _ = blocks(c, name="h")(x, None)
        x = nn.LayerNorm(epsilon=1e-5, name="ln_f")(x)
        return wte.attend(x)  # tied lm_head


@dataclass(frozen=True)
class LinenGPT2Step(_Step):
    """Flax linen GPT-2 (nn.scan over nn.remat blocks), f32, AdamW, donated state."""

    cfg: GPT2Config = GPT2Config()

    def _tx(self) -> optax.GradientTransformation:
        return optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)

    def abstract_args(self) -> tuple[Any, Any]:
        c = self.cfg
        model, tx = GPT2(c), self._tx()

        def state() -> Any:
            params = model.init(jax.random.PRNGKey(0),
                                jnp.zeros((c.batch, c.n_ctx), jnp.int32))["params"]
            return params, tx.init(params)

        return (jax.eval_shape(state),
                jax.ShapeDtypeStruct((c.batch, c.n_ctx + 1), jnp.int32))

    def make_step(self) -> Callable[[Any], Any]:
        tx = self._tx()

        def make(policy: Any) -> Any:
            model = GPT2(self.cfg, policy=policy)
            return _train_step(lambda params, x: model.apply({"params": params}, x), tx,
                               donate=True)

        return make


# ======================================================================================
# 2. Equinox LLaMA.
# ======================================================================================

import equinox as eqx  # noqa: E402


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    dim: int = 128
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn: int = 352  # ~ 8/3 * 128, rounded to 32
    n_layers: int = 4
    seq: int = 128
    batch: int = 2
    rope_theta: float = 10000.0
    dtype: Any = jnp.bfloat16


def _rope_interleaved(x: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding on adjacent feature pairs (x[2i], x[2i+1]); x is (seq, heads, hd)."""
    s, _, hd = x.shape
    freqs = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * freqs[None]  # (s, hd/2)
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    xp = x.astype(jnp.float32).reshape(s, x.shape[1], hd // 2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


class LlamaLayer(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    ffn_norm: eqx.nn.RMSNorm
    w_gate: eqx.nn.Linear
    w_up: eqx.nn.Linear
    w_down: eqx.nn.Linear
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)

    def __init__(self, cfg: LlamaConfig, key: jax.Array) -> None:
        ks = jax.random.split(key, 7)
        d, hd = cfg.dim, cfg.dim // cfg.n_heads
        lin = functools.partial(eqx.nn.Linear, use_bias=False, dtype=cfg.dtype)
        self.attn_norm = eqx.nn.RMSNorm(d, eps=1e-6, use_bias=False, dtype=cfg.dtype)
        self.ffn_norm = eqx.nn.RMSNorm(d, eps=1e-6, use_bias=False, dtype=cfg.dtype)
        self.wq = lin(d, cfg.n_heads * hd, key=ks[0])
        self.wk = lin(d, cfg.n_kv_heads * hd, key=ks[1])
        self.wv = lin(d, cfg.n_kv_heads * hd, key=ks[2])
        self.wo = lin(cfg.n_heads * hd, d, key=ks[3])
        self.w_gate = lin(d, cfg.ffn, key=ks[4])
        self.w_up = lin(d, cfg.ffn, key=ks[5])
        self.w_down = lin(cfg.ffn, d, key=ks[6])
        self.n_heads, self.n_kv_heads, self.rope_theta = (
            cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: (seq, dim), one sequence."""
        s, d = x.shape
        nh, nk = self.n_heads, self.n_kv_heads
        hd = d // nh
        per_tok = jax.vmap
        h = per_tok(self.attn_norm)(x)
        q = per_tok(self.wq)(h).reshape(s, nh, hd)
        k = per_tok(self.wk)(h).reshape(s, nk, hd)
        v = checkpoint_name(per_tok(self.wv)(h).reshape(s, nk, hd), "layers.attention.wv")
        q = checkpoint_name(_rope_interleaved(q, self.rope_theta), "layers.attention.q_rot")
        k = checkpoint_name(_rope_interleaved(k, self.rope_theta), "layers.attention.k_rot")
        k = jnp.repeat(k, nh // nk, axis=1)
        v = jnp.repeat(v, nh // nk, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k,
                            preferred_element_type=jnp.float32) / math.sqrt(hd)
        mask = jnp.tril(jnp.ones((s, s), bool))
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(x.dtype)
        probs = checkpoint_name(probs, "layers.attention.probs")
        out = jnp.einsum("hqk,khd->qhd", probs, v).reshape(s, nh * hd)
        out = checkpoint_name(out, "layers.attention.output")
        x = x + per_tok(self.wo)(out)
        h = per_tok(self.ffn_norm)(x)
        gate = checkpoint_name(per_tok(self.w_gate)(h), "layers.feed_forward.w1")
        up = checkpoint_name(per_tok(self.w_up)(h), "layers.feed_forward.w3")
        y = per_tok(self.w_down)(jax.nn.silu(gate) * up)
        return x + y


def _scan_layers(layers: eqx.Module, x: jax.Array, policy: Any) -> jax.Array:
    """Run `layers` (stacked: every array leaf has a leading layer axis) over `x` with
    ``jax.lax.scan``, each layer ``jax.checkpoint``ed with `policy`: the array partition is
    what the scan slices, the static rest is combined back in each step."""
    dyn, static = eqx.partition(layers, eqx.is_array)

    @functools.partial(jax.checkpoint, policy=policy)
    def run_layer(h: jax.Array, layer_dyn: Any) -> jax.Array:
        return eqx.combine(layer_dyn, static)(h)

    return jax.lax.scan(lambda h, p: (run_layer(h, p), None), x, dyn)[0]


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    layers: LlamaLayer  # stacked: every array leaf has a leading n_layers axis
    norm: eqx.nn.RMSNorm
    lm_head: eqx.nn.Linear

    def __init__(self, cfg: LlamaConfig, key: jax.Array) -> None:
        k_emb, k_layers, k_head = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(cfg.vocab, cfg.dim, dtype=cfg.dtype, key=k_emb)
        make_layer = lambda k: LlamaLayer(cfg, k)  # noqa: E731
        self.layers = eqx.filter_vmap(make_layer)(jax.random.split(k_layers, cfg.n_layers))
        self.norm = eqx.nn.RMSNorm(cfg.dim, eps=1e-6, use_bias=False, dtype=cfg.dtype)
        self.lm_head = eqx.nn.Linear(cfg.dim, cfg.vocab, use_bias=False, dtype=cfg.dtype,
                                     key=k_head)

    def __call__(self, tokens: jax.Array, policy: Any) -> jax.Array:
        """tokens: (seq,) -> logits (seq, vocab) float32."""
        x = _scan_layers(self.layers, jax.vmap(self.embed)(tokens), policy)
        x = jax.vmap(self.norm)(x)
        return jax.vmap(self.lm_head)(x).astype(jnp.float32)


@dataclass(frozen=True)
class _EqxLanguageModelStep(_Step):
    """An Equinox language model's next-token step: the model's array partition and the
    optimizer state are what ``jax.jit`` sees, donated; the model maps one sequence of
    tokens and `policy` to logits, vmapped over the batch. Each adds its `cfg` (with
    ``batch`` and ``seq``), `_model` (the model's class, built as ``_model(cfg, key)``)
    and `_tx()`."""

    _model: Any = None

    def _tx(self) -> optax.GradientTransformation:
        raise NotImplementedError

    def _value_and_grad(self, loss_fn: Callable[..., jax.Array]) -> Any:
        """The loss and gradients of `loss_fn` (`_update_step`'s `value_and_grad`)."""
        return jax.value_and_grad(loss_fn)

    def _static(self) -> Any:
        cfg = self.cfg  # type: ignore[attr-defined]
        model = eqx.filter_eval_shape(self._model, cfg, jax.random.PRNGKey(0))
        return eqx.partition(model, eqx.is_array)[1]

    def abstract_args(self) -> tuple[Any, Any]:
        c, tx = self.cfg, self._tx()  # type: ignore[attr-defined]

        def state() -> Any:
            params, _ = eqx.partition(self._model(c, jax.random.PRNGKey(0)), eqx.is_array)
            return params, tx.init(params)

        return (jax.eval_shape(state),
                jax.ShapeDtypeStruct((c.batch, c.seq + 1), jnp.int32))

    def make_step(self) -> Callable[[Any], Any]:
        tx, static = self._tx(), self._static()

        def make(policy: Any) -> Any:
            def logits(params: Any, x: jax.Array) -> jax.Array:
                model = eqx.combine(params, static)
                return jax.vmap(lambda t: model(t, policy))(x)

            return _train_step(logits, tx, donate=True, apply_updates=eqx.apply_updates,
                               value_and_grad=self._value_and_grad)

        return make


@dataclass(frozen=True)
class EqxLlamaStep(_EqxLanguageModelStep):
    """Equinox LLaMA (filter_vmap-stacked layers, lax.scan over jax.checkpoint), bf16,
    Adafactor, donated state."""

    cfg: LlamaConfig = LlamaConfig()
    _model: Any = Llama

    def _tx(self) -> optax.GradientTransformation:
        return optax.adafactor(1e-3)


@dataclass(frozen=True)
class EqxLlamaAccumStep(EqxLlamaStep):
    """Equinox LLaMA as `EqxLlamaStep`, trained with gradient accumulation by optax's own
    ``optax.microbatching.microbatch`` around ``jax.value_and_grad``: a ``lax.fori_loop``
    over the `microbatches` (each one taken from the batch by its index) runs each one's
    forward and backward and averages the loss and gradients; the mean gradient then goes
    through clipped AdamW. Each micro-batch's residuals are freed before the next one's
    forward."""

    cfg: LlamaConfig = LlamaConfig(batch=8)
    microbatches: int = 4

    def _tx(self) -> optax.GradientTransformation:
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4))

    def _value_and_grad(self, loss_fn: Callable[..., jax.Array]) -> Any:
        from optax import microbatching  # noqa: PLC0415

        return microbatching.microbatch(
            jax.value_and_grad(loss_fn), argnums=1,
            microbatch_size=self.cfg.batch // self.microbatches,
            accumulator=microbatching.AccumulationType.MEAN)


# ======================================================================================
# 3. Flax nnx parallel-block decoder.
# ======================================================================================

from flax import nnx  # noqa: E402


@dataclass(frozen=True)
class ParallelConfig:
    vocab: int = 256
    dim: int = 96
    n_heads: int = 6
    mlp: int = 384
    n_layers: int = 6
    seq: int = 96
    batch: int = 2


def _alibi_slopes(n: int) -> jax.Array:
    start = 2.0 ** (-8.0 / n)
    return jnp.array([start ** (i + 1) for i in range(n)], jnp.float32)


class ParallelBlock(nnx.Module):
    def __init__(self, cfg: ParallelConfig, rngs: nnx.Rngs) -> None:
        d, hd = cfg.dim, cfg.dim // cfg.n_heads
        self.n_heads, self.hd = cfg.n_heads, hd
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.q = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(d, 2 * hd, use_bias=False, rngs=rngs)  # multi-query: one K/V
        self.o = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, cfg.mlp, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        nh, hd = self.n_heads, self.hd
        h = self.ln(x)
        q = checkpoint_name(self.q(h), "ParallelBlock.q").reshape(b, s, nh, hd)
        kv = checkpoint_name(self.kv(h), "ParallelBlock.kv")
        k, v = kv[..., :hd], kv[..., hd:]
        logits = jnp.einsum("bqhd,bkd->bhqk", q, k) / math.sqrt(hd)
        pos = jnp.arange(s)
        alibi = -_alibi_slopes(nh)[:, None, None] * (pos[:, None] - pos[None, :])
        logits = jnp.where(pos[:, None] >= pos[None, :], logits + alibi, -1e9)
        logits = checkpoint_name(logits, "ParallelBlock.attn_logits")
        ctx = jnp.einsum("bhqk,bkd->bqhd", jax.nn.softmax(logits, -1), v).reshape(b, s, d)
        ctx = checkpoint_name(ctx, "ParallelBlock.ctx")
        u = checkpoint_name(self.up(h), "ParallelBlock.up")
        act = checkpoint_name(jnp.square(jax.nn.relu(u)), "ParallelBlock.relu2")
        return x + self.o(ctx) + self.down(act)


class ParallelLM(nnx.Module):
    def __init__(self, cfg: ParallelConfig, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_blocks(r: nnx.Rngs) -> ParallelBlock:
            return ParallelBlock(cfg, r)

        self.blocks = create_blocks(rngs)
        self.ln_f = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.head = nnx.Linear(cfg.dim, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, policy: Any) -> jax.Array:
        x = self.embed(tokens)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat(policy=policy)
        def forward(h: jax.Array, block: ParallelBlock) -> jax.Array:
            return block(h)

        x = forward(x, self.blocks)
        return self.head(self.ln_f(x))


@dataclass(frozen=True)
class NnxParallelStep(_Step):
    """Flax nnx parallel-block MQA decoder (nnx.scan over nnx.remat), f32, SGD+momentum,
    not donated."""

    cfg: ParallelConfig = ParallelConfig()

    def _tx(self) -> optax.GradientTransformation:
        return optax.sgd(1e-2, momentum=0.9)

    def _graphdef(self) -> Any:
        model = nnx.eval_shape(lambda: ParallelLM(self.cfg, nnx.Rngs(0)))
        return nnx.split(model)[0]

    def abstract_args(self) -> tuple[Any, Any]:
        c, tx = self.cfg, self._tx()

        def state() -> Any:
            params = nnx.state(ParallelLM(c, nnx.Rngs(0)))
            return params, tx.init(params)

        return (jax.eval_shape(state),
                jax.ShapeDtypeStruct((c.batch, c.seq + 1), jnp.int32))

    def make_step(self) -> Callable[[Any], Any]:
        tx, graphdef = self._tx(), self._graphdef()

        def make(policy: Any) -> Any:
            return _train_step(lambda params, x: nnx.merge(graphdef, params)(x, policy), tx,
                               donate=False)

        return make


# ======================================================================================
# 4. Pure-JAX MLP-Mixer (no NN library).
# ======================================================================================


@dataclass(frozen=True)
class MixerConfig:
    image: int = 32
    patch: int = 4  # 8 x 8 = 64 patches
    channels: int = 3
    hidden: int = 128  # C
    tokens_mlp: int = 64  # D_S, the token-mixing MLP's width (over the 64 patches)
    channels_mlp: int = 512  # D_C, the channel-mixing MLP's width
    n_blocks: int = 4
    classes: int = 10
    batch: int = 8
    compute_dtype: Any = jnp.bfloat16


def _lecun_normal(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
    return jax.random.normal(key, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)


def init_mixer(cfg: MixerConfig, key: jax.Array) -> dict[str, Any]:
    """float32 master weights as a plain dict; the blocks' leaves stacked on axis 0."""
    n_patches = (cfg.image // cfg.patch) ** 2
    c = cfg.hidden
    k_stem, k_blocks, _ = jax.random.split(key, 3)

    def block(k: jax.Array) -> dict[str, jax.Array]:
        k1, k2, k3, k4 = jax.random.split(k, 4)
        return {"ln1": {"scale": jnp.ones(c), "bias": jnp.zeros(c)},
                "token_mixing": {"w1": _lecun_normal(k1, n_patches, cfg.tokens_mlp),
                                 "b1": jnp.zeros(cfg.tokens_mlp),
                                 "w2": _lecun_normal(k2, cfg.tokens_mlp, n_patches),
                                 "b2": jnp.zeros(n_patches)},
                "ln2": {"scale": jnp.ones(c), "bias": jnp.zeros(c)},
                "channel_mixing": {"w1": _lecun_normal(k3, c, cfg.channels_mlp),
                                   "b1": jnp.zeros(cfg.channels_mlp),
                                   "w2": _lecun_normal(k4, cfg.channels_mlp, c),
                                   "b2": jnp.zeros(c)},
                "ls1": jnp.full(c, 0.1), "ls2": jnp.full(c, 0.1)}  # LayerScale

    return {"stem": {"w": _lecun_normal(k_stem, cfg.patch ** 2 * cfg.channels, c),
                     "b": jnp.zeros(c)},
            "blocks": jax.vmap(block)(jax.random.split(k_blocks, cfg.n_blocks)),
            "pre_head_ln": {"scale": jnp.ones(c), "bias": jnp.zeros(c)},
            "head": {"w": jnp.zeros((c, cfg.classes)), "b": jnp.zeros(cfg.classes)}}


def _layer_norm(x: jax.Array, p: dict[str, jax.Array], eps: float = 1e-6) -> jax.Array:
    """LayerNorm over the last axis, statistics in float32, the result in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"] + p["bias"]).astype(x.dtype)


def mixer_block(x: jax.Array, p: dict[str, Any]) -> jax.Array:
    """One Mixer block: x (batch, patches, channels) in the compute dtype. Each branch's
    output is scaled per channel by a learned LayerScale (ResMLP/CaiT style) before its
    residual add."""
    tm, cm = p["token_mixing"], p["channel_mixing"]
    y = jnp.swapaxes(_layer_norm(x, p["ln1"]), 1, 2)  # (batch, channels, patches)
    h = checkpoint_name(y @ tm["w1"] + tm["b1"], "token_mixing.fc1")
    h = checkpoint_name(jax.nn.gelu(h), "token_mixing.gelu")
    h = checkpoint_name(h @ tm["w2"] + tm["b2"], "token_mixing.fc2")
    x = x + p["ls1"] * jnp.swapaxes(h, 1, 2)
    y = _layer_norm(x, p["ln2"])
    h = checkpoint_name(y @ cm["w1"] + cm["b1"], "channel_mixing.fc1")
    h = checkpoint_name(jax.nn.gelu(h), "channel_mixing.gelu")
    h = checkpoint_name(h @ cm["w2"] + cm["b2"], "channel_mixing.fc2")
    return x + p["ls2"] * h


def mixer_logits(params: dict[str, Any], images: jax.Array, cfg: MixerConfig,
                 policy: Any) -> jax.Array:
    """images (batch, H, W, channels) float32 -> logits (batch, classes) float32. The
    master weights are cast to the compute dtype here, inside the differentiated function,
    so the gradients come back in float32."""
    p = jax.tree.map(lambda w: w.astype(cfg.compute_dtype), params)
    b, g, ps = images.shape[0], cfg.image // cfg.patch, cfg.patch
    x = images.astype(cfg.compute_dtype).reshape(b, g, ps, g, ps, cfg.channels)
    x = x.transpose(0, 1, 3, 2, 4, 5).reshape(b, g * g, ps * ps * cfg.channels)
    x = x @ p["stem"]["w"] + p["stem"]["b"]  # the patch embedding, a strided conv as a matmul
    block = jax.checkpoint(mixer_block, policy=policy)
    x, _ = jax.lax.scan(lambda h, bp: (block(h, bp), None), x, p["blocks"])
    x = _layer_norm(x, p["pre_head_ln"]).mean(axis=1)
    return (x @ p["head"]["w"] + p["head"]["b"]).astype(jnp.float32)


@dataclass(frozen=True)
class MixerStep(_Step):
    """Pure-JAX MLP-Mixer image classifier (lax.scan over jax.checkpoint), bf16 compute
    over f32 master weights, clipped Lion, donated state."""

    cfg: MixerConfig = MixerConfig()

    def _tx(self) -> optax.GradientTransformation:
        schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-4, warmup_steps=500,
                                                      decay_steps=10_000)
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.lion(schedule, b1=0.9, b2=0.99, weight_decay=0.1))

    def abstract_args(self) -> tuple[Any, Any]:
        c, tx = self.cfg, self._tx()

        def state() -> Any:
            params = init_mixer(c, jax.random.PRNGKey(0))
            return params, tx.init(params)

        batch = (jax.ShapeDtypeStruct((c.batch, c.image, c.image, c.channels), jnp.float32),
                 jax.ShapeDtypeStruct((c.batch,), jnp.int32))
        return jax.eval_shape(state), batch

    def make_step(self) -> Callable[[Any], Any]:
        c, tx = self.cfg, self._tx()

        def make(policy: Any) -> Any:
            def loss_fn(params: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
                logits = mixer_logits(params, images, c, policy)
                targets = optax.smooth_labels(jax.nn.one_hot(labels, c.classes), 0.1)
                return optax.softmax_cross_entropy(logits, targets).mean()

            return _update_step(loss_fn, tx)

        return make


# ======================================================================================
# 5. Flax linen encoder-decoder.
# ======================================================================================


@dataclass(frozen=True)
class EncDecConfig:
    vocab: int = 256  # shared by source and target
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 256
    enc_layers: int = 3
    dec_layers: int = 3
    src_len: int = 64
    tgt_len: int = 48
    batch: int = 4
    warmup: int = 4000


def _sinusoid_positions(length: int, d: int) -> jax.Array:
    pos = jnp.arange(length, dtype=jnp.float32)[:, None]
    inv = jnp.exp(-math.log(10000.0) * jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = pos * inv[None]
    return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)  # (length, d)


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention of `x` over `memory` (`x` itself for self-attention);
    the same module, and so the same tag names, serves encoder, decoder and cross
    attention."""

    n_heads: int
    causal: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, memory: jax.Array) -> jax.Array:
        d = x.shape[-1]
        hd = d // self.n_heads
        proj = functools.partial(nn.DenseGeneral, features=(self.n_heads, hd),
                                 use_bias=False)
        q = checkpoint_name(proj(name="query")(x), "attention/query")
        k = checkpoint_name(proj(name="key")(memory), "attention/key")
        v = checkpoint_name(proj(name="value")(memory), "attention/value")
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        if self.causal:
            tq, tk = logits.shape[-2:]
            logits = jnp.where(jnp.tril(jnp.ones((tq, tk), bool)), logits, -1e9)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
        ctx = checkpoint_name(ctx, "attention/context")
        return nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, name="out")(ctx)


class MlpBlock(nn.Module):
    d_ff: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = checkpoint_name(nn.Dense(self.d_ff, name="wi")(x), "mlp/wi")
        h = checkpoint_name(nn.relu(h), "mlp/relu")
        return nn.Dense(x.shape[-1], name="wo")(h)


class EncoderLayer(nn.Module):
    """Post-LN (the original Transformer's order): self-attention, then the ReLU MLP.
    Carry-in-carry-out for ``nn.scan``."""

    cfg: EncDecConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        c = self.cfg
        x = nn.LayerNorm(name="ln_attn")(
            x + MultiHeadAttention(c.n_heads, name="self_attn")(x, x))
        x = nn.LayerNorm(name="ln_mlp")(x + MlpBlock(c.d_ff, name="mlp")(x))
        return x, None


class DecoderLayer(nn.Module):
    """Post-LN: causal self-attention, cross-attention over the encoder's output (broadcast
    to every layer by ``nn.scan``), then the ReLU MLP."""

    cfg: EncDecConfig

    @nn.compact
    def __call__(self, y: jax.Array, encoded: jax.Array) -> tuple[jax.Array, None]:
        c = self.cfg
        y = nn.LayerNorm(name="ln_self")(
            y + MultiHeadAttention(c.n_heads, causal=True, name="self_attn")(y, y))
        y = nn.LayerNorm(name="ln_cross")(
            y + MultiHeadAttention(c.n_heads, name="cross_attn")(y, encoded))
        y = nn.LayerNorm(name="ln_mlp")(y + MlpBlock(c.d_ff, name="mlp")(y))
        return y, None


class EncoderDecoder(nn.Module):
    cfg: EncDecConfig
    policy: Callable[..., Any] = jax.checkpoint_policies.nothing_saveable

    @nn.compact
    def __call__(self, src: jax.Array, tgt: jax.Array) -> jax.Array:
        c = self.cfg
        embed = nn.Embed(c.vocab, c.d_model, name="shared_embedding",
                         embedding_init=nn.initializers.normal(c.d_model ** -0.5))
        pos = _sinusoid_positions(max(c.src_len, c.tgt_len), c.d_model)
        remat = functools.partial(nn.remat, policy=self.policy, prevent_cse=False)
        stack = functools.partial(nn.scan, variable_axes={"params": 0},
                                  split_rngs={"params": True})
        x = embed(src) * math.sqrt(c.d_model) + pos[:src.shape[1]][None]
        x, _ = stack(remat(EncoderLayer), length=c.enc_layers)(c, name="encoder")(x, None)
        y = embed(tgt) * math.sqrt(c.d_model) + pos[:tgt.shape[1]][None]
        decoder = stack(remat(DecoderLayer), in_axes=nn.broadcast, length=c.dec_layers)
        y, _ = decoder(c, name="decoder")(y, x)
        return embed.attend(y)  # tied output projection


@dataclass(frozen=True)
class LinenEncDecStep(_Step):
    """Flax linen encoder-decoder (nn.scan over nn.remat on both stacks), f32, Adam with
    the inverse-square-root warm-up, donated state."""

    cfg: EncDecConfig = EncDecConfig()

    def _tx(self) -> optax.GradientTransformation:
        c = self.cfg

        def noam(step: jax.Array) -> jax.Array:
            step = step + 1.0
            return c.d_model ** -0.5 * jnp.minimum(step ** -0.5, step * c.warmup ** -1.5)

        return optax.adam(noam, b1=0.9, b2=0.98, eps=1e-9)

    def _batch(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        c = self.cfg
        return (jax.ShapeDtypeStruct((c.batch, c.src_len), jnp.int32),
                jax.ShapeDtypeStruct((c.batch, c.tgt_len + 1), jnp.int32))

    def abstract_args(self) -> tuple[Any, Any]:
        c = self.cfg
        model, tx = EncoderDecoder(c), self._tx()

        def state() -> Any:
            src, tgt = (jnp.zeros((c.batch, n), jnp.int32) for n in (c.src_len, c.tgt_len))
            params = model.init(jax.random.PRNGKey(0), src, tgt)["params"]
            return params, tx.init(params)

        return jax.eval_shape(state), self._batch()

    def make_step(self) -> Callable[[Any], Any]:
        tx = self._tx()

        def make(policy: Any) -> Any:
            model = EncoderDecoder(self.cfg, policy=policy)

            def loss_fn(params: Any, src: jax.Array, tgt: jax.Array) -> jax.Array:
                logits = model.apply({"params": params}, src, tgt[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, tgt[:, 1:]).mean()

            return _update_step(loss_fn, tx)

        return make

# ======================================================================================
# 6. Flax linen ConvNeXt.
# ======================================================================================


@dataclass(frozen=True)
class ConvNeXtConfig:
    image: int = 64
    channels: int = 3
    stem: int = 4  # the patchify stem: a 4x4 convolution of stride 4 (a 16 x 16 grid)
    width: int = 64
    kernel: int = 7  # the depthwise convolution's
    expansion: int = 4
    n_blocks: int = 4
    classes: int = 10
    batch: int = 8
    compute_dtype: Any = jnp.bfloat16


class ConvNeXtBlock(nn.Module):
    """One ConvNeXt block on NHWC activations: a depthwise 7x7 convolution, LayerNorm, a
    pointwise MLP (two 1x1 convolutions as ``nn.Dense`` over the channels) with GELU, a
    per-channel LayerScale, the residual. Parameters in float32, compute in `dtype` (Flax's
    mixed precision). Carry-in-carry-out for ``nn.scan``."""

    cfg: ConvNeXtConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        c, dt = self.cfg, self.cfg.compute_dtype
        h = nn.Conv(c.width, (c.kernel, c.kernel), padding="SAME",
                    feature_group_count=c.width, dtype=dt, name="dwconv")(x)
        h = checkpoint_name(h, "block/dwconv")
        h = checkpoint_name(nn.LayerNorm(epsilon=1e-6, dtype=dt, name="norm")(h),
                            "block/norm")
        h = checkpoint_name(nn.Dense(c.expansion * c.width, dtype=dt, name="pwconv1")(h),
                            "block/pwconv1")
        h = checkpoint_name(nn.gelu(h), "block/act")
        h = checkpoint_name(nn.Dense(c.width, dtype=dt, name="pwconv2")(h), "block/pwconv2")
        gamma = self.param("gamma", nn.initializers.constant(1e-6), (c.width,))
        return x + (gamma * h).astype(x.dtype), None


class ConvNeXt(nn.Module):
    cfg: ConvNeXtConfig
    policy: Callable[..., Any] = jax.checkpoint_policies.nothing_saveable

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        c, dt = self.cfg, self.cfg.compute_dtype
        x = nn.Conv(c.width, (c.stem, c.stem), strides=c.stem, padding="VALID", dtype=dt,
                    name="stem")(images)
        x = nn.LayerNorm(epsilon=1e-6, dtype=dt, name="stem_norm")(x)
        blocks = nn.scan(nn.remat(ConvNeXtBlock, policy=self.policy),
                         variable_axes={"params": 0}, split_rngs={"params": True},
                         length=c.n_blocks)
        x, _ = blocks(c, name="blocks")(x, None)
        x = nn.LayerNorm(epsilon=1e-6, dtype=dt, name="head_norm")(x.mean(axis=(1, 2)))
        return nn.Dense(c.classes, dtype=jnp.float32, name="head")(x)


@dataclass(frozen=True)
class _LinenClassifierStep(_Step):
    """A Flax linen image classifier's step: ``(images, labels)`` in, softmax cross-entropy
    over integer labels, the state donated. Each adds its `cfg` (with ``image``,
    ``channels``, ``batch``), `_model(policy)` and `_tx()`."""

    def _model(self, policy: Any = jax.checkpoint_policies.nothing_saveable) -> nn.Module:
        raise NotImplementedError

    def _tx(self) -> optax.GradientTransformation:
        raise NotImplementedError

    def abstract_args(self) -> tuple[Any, Any]:
        c = self.cfg  # type: ignore[attr-defined]
        model, tx = self._model(), self._tx()
        images = jax.ShapeDtypeStruct((c.batch, c.image, c.image, c.channels), jnp.float32)

        def state() -> Any:
            params = model.init(jax.random.PRNGKey(0),
                                jnp.zeros(images.shape, images.dtype))["params"]
            return params, tx.init(params)

        return jax.eval_shape(state), (images, jax.ShapeDtypeStruct((c.batch,), jnp.int32))

    def make_step(self) -> Callable[[Any], Any]:
        tx = self._tx()

        def make(policy: Any) -> Any:
            model = self._model(policy)

            def loss_fn(params: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
                logits = model.apply({"params": params}, images)
                return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

            return _update_step(loss_fn, tx)

        return make


@dataclass(frozen=True)
class LinenConvNeXtStep(_LinenClassifierStep):
    """Flax linen ConvNeXt (nn.scan over nn.remat blocks, depthwise convolutions), bf16
    compute over f32 parameters, AdamW with a cosine schedule, donated state."""

    cfg: ConvNeXtConfig = ConvNeXtConfig()

    def _model(self, policy: Any = jax.checkpoint_policies.nothing_saveable) -> nn.Module:
        return ConvNeXt(self.cfg, policy=policy)

    def _tx(self) -> optax.GradientTransformation:
        return optax.adamw(optax.cosine_decay_schedule(4e-3, 10_000), weight_decay=0.05)


# ======================================================================================
# 7. Flax linen ResNet stage.
# ======================================================================================


@dataclass(frozen=True)
class ResNetConfig:
    image: int = 32
    channels: int = 3
    width: int = 64
    n_blocks: int = 4  # one stage of identical basic blocks, as a scan can run them
    groups: int = 8  # GroupNorm's
    classes: int = 10
    batch: int = 8


class BasicBlock(nn.Module):
    """ResNet's basic block (3x3 convolution, GroupNorm, ReLU, 3x3 convolution, GroupNorm,
    the residual, ReLU) on NHWC float32 activations. Carry-in-carry-out for ``nn.scan``."""

    cfg: ResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        c = self.cfg
        h = checkpoint_name(nn.Conv(c.width, (3, 3), use_bias=False, name="conv1")(x),
                            "stage/conv1")
        h = nn.relu(checkpoint_name(nn.GroupNorm(c.groups, name="norm1")(h), "stage/norm1"))
        h = checkpoint_name(nn.Conv(c.width, (3, 3), use_bias=False, name="conv2")(h),
                            "stage/conv2")
        h = checkpoint_name(nn.GroupNorm(c.groups, name="norm2")(h), "stage/norm2")
        return nn.relu(x + h), None


class ResNetStage(nn.Module):
    cfg: ResNetConfig
    policy: Callable[..., Any] = jax.checkpoint_policies.nothing_saveable

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        c = self.cfg
        x = nn.relu(nn.GroupNorm(c.groups, name="stem_norm")(
            nn.Conv(c.width, (3, 3), use_bias=False, name="stem")(images)))
        blocks = nn.scan(nn.remat(BasicBlock, policy=self.policy),
                         variable_axes={"params": 0}, split_rngs={"params": True},
                         length=c.n_blocks)
        x, _ = blocks(c, name="stage")(x, None)
        return nn.Dense(c.classes, name="head")(x.mean(axis=(1, 2)))


@dataclass(frozen=True)
class LinenResNetStep(_LinenClassifierStep):
    """Flax linen ResNet stage (nn.scan over nn.remat basic blocks, dense 3x3
    convolutions), f32, SGD with Nesterov momentum and weight decay, donated state."""

    cfg: ResNetConfig = ResNetConfig()

    def _model(self, policy: Any = jax.checkpoint_policies.nothing_saveable) -> nn.Module:
        return ResNetStage(self.cfg, policy=policy)

    def _tx(self) -> optax.GradientTransformation:
        return optax.chain(optax.add_decayed_weights(5e-4),
                           optax.sgd(0.1, momentum=0.9, nesterov=True))


# ======================================================================================
# 8. Equinox Mamba-2 (state-space duality).
# ======================================================================================


@dataclass(frozen=True)
class Mamba2Config:
    vocab: int = 256
    dim: int = 128
    expand: int = 2  # inner width = expand x dim
    head_dim: int = 32
    state: int = 16  # N, shared by every head (one group)
    conv: int = 4  # the causal depthwise convolution's width
    n_layers: int = 4
    seq: int = 128
    batch: int = 2
    dtype: Any = jnp.bfloat16


class Mamba2Layer(eqx.Module):
    """One pre-norm Mamba-2 layer on one sequence (seq, dim): an input projection to the
    gate z, the convolved stream (x, B, C) and the per-head step dt; a causal depthwise
    convolution over time with SiLU; the state-space model in its quadratic ("dual") form,
    y_t = sum_{s<=t} exp(sum_{s<r<=t} dt_r A) (C_t . B_s) dt_s x_s + D x_t, per head, in
    float32 (the decays are a cumulative sum, `segsum`); a gated RMSNorm (y * SiLU(z)); the
    output projection. Weights in `dtype`, held as arrays (the decay and skip in float32)."""

    norm: jax.Array
    in_proj: jax.Array
    conv_w: jax.Array
    conv_b: jax.Array
    dt_bias: jax.Array
    a_log: jax.Array
    skip: jax.Array
    out_norm: jax.Array
    out_proj: jax.Array
    cfg: Mamba2Config = eqx.field(static=True)

    def __init__(self, cfg: Mamba2Config, key: jax.Array) -> None:
        inner, heads = cfg.expand * cfg.dim, cfg.expand * cfg.dim // cfg.head_dim
        streams = inner + 2 * cfg.state
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.cfg = cfg
        self.norm = jnp.ones(cfg.dim, cfg.dtype)
        self.in_proj = (jax.random.normal(k1, (cfg.dim, inner + streams + heads))
                        / math.sqrt(cfg.dim)).astype(cfg.dtype)
        self.conv_w = (jax.random.normal(k2, (cfg.conv, 1, streams)) * 0.2).astype(cfg.dtype)
        self.conv_b = jnp.zeros(streams, cfg.dtype)
        self.dt_bias = jnp.log(jnp.expm1(jax.random.uniform(k3, (heads,), minval=1e-3,
                                                              maxval=1e-1)))
        self.a_log = jnp.log(jnp.linspace(1.0, 16.0, heads))
        self.skip = jnp.ones(heads)
        self.out_norm = jnp.ones(inner, cfg.dtype)
        self.out_proj = (jax.random.normal(k4, (inner, cfg.dim)) / math.sqrt(inner)
                         ).astype(cfg.dtype)

    @staticmethod
    def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + 1e-5)
                ).astype(x.dtype) * scale

    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        t, inner = x.shape[0], c.expand * c.dim
        heads = inner // c.head_dim
        zxbcdt = checkpoint_name(self._rms(x, self.norm) @ self.in_proj, "mixer.in_proj")
        z, xbc, dt = jnp.split(zxbcdt, [inner, 2 * inner + 2 * c.state], axis=-1)
        xbc = jax.lax.conv_general_dilated(  # causal: pad the past only
            xbc[None], self.conv_w, (1,), [(c.conv - 1, 0)],
            dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=xbc.shape[-1])[0]
        xbc = checkpoint_name(jax.nn.silu(xbc + self.conv_b), "mixer.conv")
        xs, b, cm = jnp.split(xbc.astype(jnp.float32), [inner, inner + c.state], axis=-1)
        xs = xs.reshape(t, heads, c.head_dim)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias)  # (t, heads)
        decay = jnp.cumsum(dt * -jnp.exp(self.a_log), axis=0)  # (t, heads)
        seg = decay[:, None, :] - decay[None, :, :]  # (t, s, heads)
        causal = jnp.tril(jnp.ones((t, t), bool))[:, :, None]
        weights = jnp.exp(jnp.where(causal, seg, -jnp.inf)) * (cm @ b.T)[:, :, None]
        y = jnp.einsum("tsh,sh,shp->thp", weights, dt, xs) + self.skip[:, None] * xs
        y = checkpoint_name(y.reshape(t, inner).astype(x.dtype), "mixer.ssd")
        y = self._rms(y * jax.nn.silu(z), self.out_norm)
        return x + checkpoint_name(y @ self.out_proj, "mixer.out_proj")


class Mamba2(eqx.Module):
    embed: jax.Array
    layers: Mamba2Layer  # stacked: every array leaf has a leading n_layers axis
    norm: jax.Array

    def __init__(self, cfg: Mamba2Config, key: jax.Array) -> None:
        k_emb, k_layers = jax.random.split(key)
        self.embed = (jax.random.normal(k_emb, (cfg.vocab, cfg.dim)) * 0.02).astype(cfg.dtype)
        make_layer = lambda k: Mamba2Layer(cfg, k)  # noqa: E731
        self.layers = eqx.filter_vmap(make_layer)(jax.random.split(k_layers, cfg.n_layers))
        self.norm = jnp.ones(cfg.dim, cfg.dtype)

    def __call__(self, tokens: jax.Array, policy: Any) -> jax.Array:
        """tokens: (seq,) -> logits (seq, vocab) float32, the embedding tied."""
        x = _scan_layers(self.layers, self.embed[tokens], policy)
        return (Mamba2Layer._rms(x, self.norm) @ self.embed.T).astype(jnp.float32)


@dataclass(frozen=True)
class EqxMamba2Step(_EqxLanguageModelStep):
    """Equinox Mamba-2 (filter_vmap-stacked layers, lax.scan over jax.checkpoint), bf16
    weights and activations with the state-space model in f32, clipped AdamW, donated."""

    cfg: Mamba2Config = Mamba2Config()
    _model: Any = Mamba2

    def _tx(self) -> optax.GradientTransformation:
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3,
                                                                       weight_decay=0.1))


STEPS: dict[str, Any] = {s.name: s for s in [
    LinenGPT2Step(
        "linen-gpt2",
        note="Flax linen GPT-2: nn.scan(nn.remat(Block)) x4, hidden 128, 4 heads, fused "
             "c_attn with bias, GELU MLP 4x, learned positions, tied embedding, f32, "
             "optax.adamw, donated; 6 tags named as GPT-2 checkpoint paths"),
    LinenGPT2Step(
        "linen-gpt2-nested", cfg=GPT2Config(checkpoint_heads=True),
        note="Flax linen GPT-2 as linen-gpt2, the attention's heads (scores, softmax, "
             "weighted sum) under a jax.checkpoint of their own inside the block's nn.remat: "
             "a checkpoint inside a checkpointed layer; 6 tags"),
    EqxLlamaStep(
        "eqx-llama",
        note="Equinox LLaMA: filter_vmap-stacked layers, lax.scan over jax.checkpoint x4, "
             "hidden 128, GQA 8:2, interleaved rotary before the tags, SwiGLU 352, bf16 "
             "params and activations, optax.adafactor, donated; 7 tags"),
    EqxLlamaAccumStep(
        "eqx-llama-accum4",
        note="Equinox LLaMA as eqx-llama, trained with gradient accumulation by "
             "optax.microbatching.microbatch around jax.value_and_grad (a fori_loop over 4 "
             "micro-batches of 2 sequences, each one's forward and backward inside an "
             "iteration, loss and gradients averaged), then clipped optax.adamw; bf16, "
             "donated; 7 tags"),
    NnxParallelStep(
        "nnx-parallel",
        note="Flax nnx parallel blocks: nnx.scan(nnx.remat) x6, hidden 96, 6 query heads "
             "over one K/V head (MQA), ALiBi, squared-ReLU MLP 4x, f32, optax.sgd "
             "momentum, not donated; 6 tags"),
    MixerStep(
        "haiku-free-mixer",
        note="pure JAX + optax MLP-Mixer: lax.scan over jax.checkpoint x4, 64 patches of "
             "4x4, hidden 128, token MLP 64, channel MLP 512, GELU, LayerScale, bf16 "
             "compute over f32 master weights, clip_by_global_norm + optax.lion, "
             "donated; 6 tags"),
    LinenEncDecStep(
        "linen-encdec",
        note="Flax linen encoder-decoder: nn.scan(nn.remat) on a 3-layer encoder and a "
             "3-layer decoder (causal self-attention + cross-attention), hidden 64, 4 "
             "heads, post-LN, ReLU MLP 4x, sinusoidal positions, shared tied embedding, "
             "f32, optax.adam with inverse-sqrt warm-up, donated; 6 tags shared by both "
             "stacks"),
    LinenConvNeXtStep(
        "linen-convnext",
        note="Flax linen ConvNeXt image classifier: 4x4 patchify conv stem, "
             "nn.scan(nn.remat) x4 blocks on a 16x16 grid, depthwise 7x7 conv, LayerNorm, "
             "pointwise MLP 4x (GELU), LayerScale, width 64, bf16 compute over f32 "
             "params, optax.adamw on a cosine schedule, donated; 5 tags"),
    LinenResNetStep(
        "linen-resnet",
        note="Flax linen ResNet stage: 3x3 conv stem, nn.scan(nn.remat) x4 basic blocks "
             "(two dense 3x3 convs, GroupNorm, ReLU) at width 64 on a 32x32 image, f32, "
             "SGD Nesterov momentum + weight decay, donated; 4 tags"),
    EqxMamba2Step(
        "eqx-mamba2",
        note="Equinox Mamba-2: filter_vmap-stacked layers, lax.scan over jax.checkpoint x4, "
             "hidden 128, inner 256 in 8 heads of 32, state 16, causal depthwise conv of "
             "4, the SSD quadratic form (cumsum decays) in f32, gated RMSNorm, bf16, "
             "clipped optax.adamw, donated; 4 tags"),
]}
"""The foreign steps, by name (all held-out)."""
