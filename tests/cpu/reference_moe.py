"""Plain-JAX decoder layers with a mixture-of-experts feed-forward block and multi-head
latent attention, tagged in axlearn's or MaxText's vocabulary.

They are what `neuron_remat.moe` describes analytically; tests hold that model to what
JAX keeps (``saved_residuals``) and what XLA computes (``cost_analysis``). Written as such
layers usually are:

* routing: a linear router, softmax (or sigmoid) scores in float32, ``lax.top_k``; every
  expert has a buffer of ``capacity`` rows (``MoEConfig.capacity``) filled in token order,
  overflowing tokens dropped (GShard / axlearn style dispatch, by gather rather than a
  one-hot einsum); the expert outputs are gathered back and combined with the top-k
  weights;
* shared experts: a dense feed-forward block on every token, added to the routed output;
* MLA: optional low-rank query with an RMS norm, a joint key-value latent whose main part
  is RMS-normed and up-projected to per-head keys and values, one RoPE key shared by all
  heads (RoPE itself is left out here, as in `reference` (tests/cpu/reference.py): a few elementwise
  operations per element).

MaxText names a routed expert's values twice (``moe_mlpwi_0`` inside ``mlpwi_0``, ``moe_mlpwo``
inside ``mlpwo``: `TagNames.aliases`); this layer does the same, so a policy naming either
keeps them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from neuron_remat.models import TransformerConfig
from reference import _norm

__all__ = ["init_layer", "init_stack", "layer", "stack", "tag_names"]

Params = dict[str, jax.Array]

_CLASS = {"input": "TransformerLayer", "gate_weights": "TopKGating",
          "gate_assignment": "TopKGating", "moe_linear1_0": "TransformerFeedForwardMoE",
          "moe_linear1_1": "TransformerFeedForwardMoE", "moe_linear2": "TransformerFeedForwardMoE",
          "linear1_0": "TransformerFeedForwardLayer", "linear1_1": "TransformerFeedForwardLayer",
          "linear2": "TransformerFeedForwardLayer"}
_ATTENTION = "MultiheadLatentAttention"


def tag_names(config: TransformerConfig, kind: str = "moe") -> dict[str, tuple[str, ...]]:
    """role -> the full tags a `kind` layer gives that value, outermost last (an alias
    first, as MaxText nests them)."""
    out: dict[str, tuple[str, ...]] = {}
    cls = dict(_CLASS)
    attention = _ATTENTION if config.mla is not None else "MultiheadAttention"
    aliases = dict(config.tags.aliases)
    for role in config.kind_roles(kind):
        name = config.tag(role)
        assert name is not None
        names = ((aliases[role],) if role in aliases else ()) + (name,)
        if config.tags.prefixed:
            names = tuple(f"{cls.get(role, attention)}.{n}" for n in names)
        out[role] = names
    return out


def _w(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype: Any) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) / fan_in**0.5).astype(dtype)


def init_layer(key: jax.Array, config: TransformerConfig, kind: str = "moe",
               dtype: Any = jnp.float32) -> Params:
    assert config.kv_heads is not None and config.head_dim is not None
    h, a = config.hidden, config.heads
    ks = iter(jax.random.split(key, 16))
    p: Params = {"norm1": jnp.ones((h,), dtype), "norm2": jnp.ones((h,), dtype)}
    m = config.mla
    if m is not None:
        if m.q_lora_rank:
            p["wq_a"] = _w(next(ks), (h, m.q_lora_rank), h, dtype)
            p["q_norm"] = jnp.ones((m.q_lora_rank,), dtype)
            p["wq_b"] = _w(next(ks), (m.q_lora_rank, a, m.qk_head_dim), m.q_lora_rank, dtype)
        else:
            p["wq"] = _w(next(ks), (h, a, m.qk_head_dim), h, dtype)
        p["wkv_a"] = _w(next(ks), (h, m.kv_lora_rank + m.qk_rope_head_dim), h, dtype)
        p["kv_norm"] = jnp.ones((m.kv_lora_rank,), dtype)
        p["wkv_b"] = _w(next(ks), (m.kv_lora_rank, a, m.qk_nope_head_dim + m.v_head_dim),
                        m.kv_lora_rank, dtype)
        p["wo"] = _w(next(ks), (a, m.v_head_dim, h), a * m.v_head_dim, dtype)
    else:
        kv, d = config.kv_heads, config.head_dim
        p.update(wq=_w(next(ks), (h, a, d), h, dtype), wk=_w(next(ks), (h, kv, d), h, dtype),
                 wv=_w(next(ks), (h, kv, d), h, dtype), wo=_w(next(ks), (a, d, h), a * d, dtype))

    def ffn(prefix: str, width: int) -> None:
        p[f"{prefix}w1_0"] = _w(next(ks), (h, width), h, dtype)
        if config.gated_ffn:
            p[f"{prefix}w1_1"] = _w(next(ks), (h, width), h, dtype)
        p[f"{prefix}w2"] = _w(next(ks), (width, h), width, dtype)

    moe = config.moe
    if kind == "dense" or moe is None:
        ffn("", config.ffn)
        return p
    e, f = moe.experts, moe.expert_ffn
    p["router"] = _w(next(ks), (h, e), h, dtype)
    p["e1_0"] = _w(next(ks), (e, h, f), h, dtype)
    if config.gated_ffn:
        p["e1_1"] = _w(next(ks), (e, h, f), h, dtype)
    p["e2"] = _w(next(ks), (e, f, h), f, dtype)
    if moe.shared_ffn:
        ffn("shared_", moe.shared_ffn)
    return p


def init_stack(key: jax.Array, config: TransformerConfig, layers: int, kind: str = "moe",
               dtype: Any = jnp.float32) -> Params:
    keys = jax.random.split(key, layers)
    return jax.vmap(lambda k: init_layer(k, config, kind, dtype))(keys)


_ACT: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu, "gelu": lambda v: jax.nn.gelu(v, approximate=False),
    "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True), "relu": jax.nn.relu}


def layer(x: jax.Array, p: Params, config: TransformerConfig, kind: str = "moe") -> jax.Array:
    """One decoder layer of `kind` (``"moe"`` or ``"dense"`` feed-forward); ``x`` is
    (batch, seq, hidden). Attention is computed in full (no flash kernel)."""
    if config.flash_attention:
        raise NotImplementedError(
            "the reference layer computes attention in full; use flash_attention=False")
    names = tag_names(config, kind)

    def tag(v: jax.Array, role: str) -> jax.Array:
        for name in names.get(role, ()):
            v = checkpoint_name(v, name)
        return v

    b, s, h = x.shape
    x = tag(x, "input")
    n1 = _norm(x, p["norm1"], None, config.norm)
    q, k, v = (_mla_qkv if config.mla is not None else _gqa_qkv)(n1, p, config, tag)
    kvh, group, dqk = k.shape[2], config.heads // k.shape[2], q.shape[-1]
    qg = q.reshape(b, s, kvh, group, dqk)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k) * (dqk**-0.5)
    if config.causal:
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    ctx = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, config.heads, v.shape[-1])
    ctx = tag(ctx, "context")
    o = tag(jnp.einsum("bsnd,ndh->bsh", ctx, p["wo"]), "o_proj")
    x1 = x + o
    n2 = _norm(x1, p["norm2"], None, config.norm).reshape(b * s, h)
    if kind == "dense" or config.moe is None:
        y = _dense_ffn(n2, p, config, tag, "")
    else:
        y = _moe_ffn(n2, p, config, tag)
        if config.moe.shared_ffn:
            y = y + _dense_ffn(n2, p, config, tag, "shared_")
    return x1 + y.reshape(b, s, h)


def _gqa_qkv(n1: jax.Array, p: Params, config: TransformerConfig,
             tag: Callable[..., jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = tag(jnp.einsum("bsh,hnd->bsnd", n1, p["wq"]), "q_proj")
    k = tag(jnp.einsum("bsh,hnd->bsnd", n1, p["wk"]), "k_proj")
    v = tag(jnp.einsum("bsh,hnd->bsnd", n1, p["wv"]), "v_proj")
    return q, k, v


def _mla_qkv(n1: jax.Array, p: Params, config: TransformerConfig,
             tag: Callable[..., jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    m = config.mla
    assert m is not None
    b, s, _ = n1.shape
    if m.q_lora_rank:
        qa = tag(n1 @ p["wq_a"], "q_a")
        qn = tag(_norm(qa, p["q_norm"], None, "rms"), "q_a_norm")
        q = jnp.einsum("bsr,rnd->bsnd", qn, p["wq_b"])
    else:
        q = jnp.einsum("bsh,hnd->bsnd", n1, p["wq"])
    q = tag(q, "q_proj")
    kva = tag(n1 @ p["wkv_a"], "kv_a")
    latent, k_rope = kva[..., :m.kv_lora_rank], kva[..., m.kv_lora_rank:]
    latent = tag(_norm(latent, p["kv_norm"], None, "rms"), "kv_a_norm")
    kv = jnp.einsum("bsc,cnd->bsnd", latent, p["wkv_b"])
    k_nope, v = kv[..., :m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim:]
    k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (b, s, config.heads, m.qk_rope_head_dim))
    k = tag(jnp.concatenate([k_nope, k_rope], axis=-1), "k_proj")
    return q, k, tag(v, "v_proj")


def _dense_ffn(n2: jax.Array, p: Params, config: TransformerConfig,
               tag: Callable[..., jax.Array], prefix: str) -> jax.Array:
    act = _ACT[config.activation]
    a = tag(n2 @ p[f"{prefix}w1_0"], "linear1_0")
    g = act(a) * tag(n2 @ p[f"{prefix}w1_1"], "linear1_1") if config.gated_ffn else act(a)
    return tag(g @ p[f"{prefix}w2"], "linear2")


def _moe_ffn(xt: jax.Array, p: Params, config: TransformerConfig,
             tag: Callable[..., jax.Array]) -> jax.Array:
    moe = config.moe
    assert moe is not None
    t, h = xt.shape
    e, k = moe.experts, moe.experts_per_token
    cap = moe.capacity(t)
    logits = (xt @ p["router"]).astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if moe.router == "softmax" \
        else jax.nn.sigmoid(logits)
    weights, experts = jax.lax.top_k(scores, k)
    weights = tag(weights, "gate_weights")
    experts = tag(experts, "gate_assignment")
    # Position of each (token, choice) in its expert's buffer, in token order.
    flat = experts.reshape(-1)
    onehot = (flat[:, None] == jnp.arange(e)[None, :]).astype(jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    slot = jnp.where(position < cap, flat * cap + position, e * cap)  # e * cap: dropped
    token = jnp.arange(t * k, dtype=jnp.int32) // k
    source = jnp.full((e * cap + 1,), t, jnp.int32).at[slot].set(token)[:e * cap]
    padded = jnp.concatenate([xt, jnp.zeros((1, h), xt.dtype)])
    xs = padded[source].reshape(e, cap, h)
    act = _ACT[config.activation]
    a = tag(jnp.einsum("ech,ehf->ecf", xs, p["e1_0"]), "moe_linear1_0")
    if config.gated_ffn:
        mid = act(a) * tag(jnp.einsum("ech,ehf->ecf", xs, p["e1_1"]), "moe_linear1_1")
    else:
        mid = act(a)
    ys = tag(jnp.einsum("ecf,efh->ech", mid, p["e2"]), "moe_linear2")
    out = jnp.concatenate([ys.reshape(e * cap, h), jnp.zeros((1, h), ys.dtype)])
    picked = out[slot].reshape(t, k, h)
    return jnp.einsum("tk,tkh->th", weights.astype(xt.dtype), picked)


def stack(x: jax.Array, params: Params, config: TransformerConfig, kind: str = "moe", *,
          policy: Callable[..., Any] | None | str = "none", scan: bool = True) -> jax.Array:
    """Apply the stacked `kind` layers in `params`, each under ``jax.checkpoint(policy)``
    (``"none"``: no remat; None: full remat), in ``lax.scan`` or unrolled."""
    def body(hid: jax.Array, p: Params) -> jax.Array:
        return layer(hid, p, config, kind)

    if policy != "none":
        body = jax.checkpoint(body, policy=policy, prevent_cse=not scan)  # type: ignore[arg-type]
    if scan:
        out, _ = jax.lax.scan(lambda hid, p: (body(hid, p), None), x, params)
        return out
    for i in range(jax.tree.leaves(params)[0].shape[0]):
        x = body(x, jax.tree.map(lambda a, i=i: a[i], params))
    return x
