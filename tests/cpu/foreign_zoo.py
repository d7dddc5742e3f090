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

Tag names follow each library's idiom and differ from zoo.py's (GPT-2 checkpoint paths,
dotted module paths, ``Class.attr``).

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
                apply_updates: Callable[[Any, Any], Any] = optax.apply_updates) -> Any:
    """The jitted next-token step every model here trains with: ``state = (params,
    opt_state)`` and ``tokens`` [batch, seq + 1] in, the updated state and the loss out;
    `logits(params, tokens[:, :-1])` is the model. `donate` donates the state."""

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(
            logits(params, tokens[:, :-1]), tokens[:, 1:]).mean()

    def train_step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
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
        q, k, v = jnp.split(qkv, 3, axis=-1)
        q, k, v = (a.reshape(b, t, c.n_head, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd))
        causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
        att = jnp.where(causal, att, jnp.finfo(att.dtype).min)
        att = checkpoint_name(jax.nn.softmax(att, axis=-1), "h/attn/attn_weights")
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        y = checkpoint_name(y, "h/attn/merged_heads")
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
        x = jax.vmap(self.embed)(tokens)
        dyn, static = eqx.partition(self.layers, eqx.is_array)

        @functools.partial(jax.checkpoint, policy=policy)
        def run_layer(h: jax.Array, layer_dyn: Any) -> jax.Array:
            return eqx.combine(layer_dyn, static)(h)

        x, _ = jax.lax.scan(lambda h, p: (run_layer(h, p), None), x, dyn)
        x = jax.vmap(self.norm)(x)
        return jax.vmap(self.lm_head)(x).astype(jnp.float32)


@dataclass(frozen=True)
class EqxLlamaStep(_Step):
    """Equinox LLaMA (filter_vmap-stacked layers, lax.scan over jax.checkpoint), bf16,
    Adafactor, donated state."""

    cfg: LlamaConfig = LlamaConfig()

    def _tx(self) -> optax.GradientTransformation:
        return optax.adafactor(1e-3)

    def _static(self) -> Any:
        model = eqx.filter_eval_shape(Llama, self.cfg, jax.random.PRNGKey(0))
        return eqx.partition(model, eqx.is_array)[1]

    def abstract_args(self) -> tuple[Any, Any]:
        c, tx = self.cfg, self._tx()

        def state() -> Any:
            params, _ = eqx.partition(Llama(c, jax.random.PRNGKey(0)), eqx.is_array)
            return params, tx.init(params)

        return (jax.eval_shape(state),
                jax.ShapeDtypeStruct((c.batch, c.seq + 1), jnp.int32))

    def make_step(self) -> Callable[[Any], Any]:
        tx, static = self._tx(), self._static()

        def make(policy: Any) -> Any:
            def logits(params: Any, x: jax.Array) -> jax.Array:
                model = eqx.combine(params, static)
                return jax.vmap(lambda t: model(t, policy))(x)

            return _train_step(logits, tx, donate=True, apply_updates=eqx.apply_updates)

        return make


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


STEPS: dict[str, Any] = {s.name: s for s in [
    LinenGPT2Step(
        "linen-gpt2",
        note="Flax linen GPT-2: nn.scan(nn.remat(Block)) x4, hidden 128, 4 heads, fused "
             "c_attn with bias, GELU MLP 4x, learned positions, tied embedding, f32, "
             "optax.adamw, donated; 6 tags named as GPT-2 checkpoint paths"),
    EqxLlamaStep(
        "eqx-llama",
        note="Equinox LLaMA: filter_vmap-stacked layers, lax.scan over jax.checkpoint x4, "
             "hidden 128, GQA 8:2, interleaved rotary before the tags, SwiGLU 352, bf16 "
             "params and activations, optax.adafactor, donated; 7 tags"),
    NnxParallelStep(
        "nnx-parallel",
        note="Flax nnx parallel blocks: nnx.scan(nnx.remat) x6, hidden 96, 6 query heads "
             "over one K/V head (MQA), ALiBi, squared-ReLU MLP 4x, f32, optax.sgd "
             "momentum, not donated; 6 tags"),
]}
"""The foreign steps, by name (all held-out)."""
