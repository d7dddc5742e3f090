"""A plain-JAX decoder layer that emits axlearn- or MaxText-style checkpoint tags.

This is the layer the analytic model in `memory_model` describes: tests, benchmarks and
examples use it to hold the model to what JAX and XLA actually keep and compute. It is
written the way such layers usually are (pre-norm, float32 norm and softmax statistics,
grouped KV heads, gated SiLU or plain GeLU feed-forward), not to flatter the model.

Variants, chosen by the parameters `init_layer` makes:

* separate q/k/v projections (three matmuls, as axlearn's ``GroupedQKVLinear``, which
  axlearn's TRN2 mesh rules swap in);
* ``fused_qkv=True``: one matmul with a ``(hidden, heads + 2 kv_heads, head_dim)`` weight
  whose output is split into q, k and v, each then tagged (axlearn's
  ``FusedGroupedQKVLinear``, the base Fuji layers' default): the three tags share one
  matmul, so saving one of them alone avoids no recompute;
* MaxText naming (``decoder_layer_input``, ``query_proj``, ...) with
  ``TransformerConfig(tags=MAXTEXT_TAGS)``.

`layer` takes the activation first; `layer_params_first` is the same layer called
``f(params, x)``, as most JAX code writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from neuron_remat.models import TransformerConfig

__all__ = ["init_layer", "init_stack", "layer", "layer_params_first", "stack", "tag_names"]

Params = dict[str, jax.Array]

_CLASS = {"input": "TransformerLayer", "q_proj": "MultiheadAttention",
          "k_proj": "MultiheadAttention", "v_proj": "MultiheadAttention",
          "context": "MultiheadAttention", "o_proj": "MultiheadAttention",
          "linear1_0": "TransformerFeedForwardLayer",
          "linear1_1": "TransformerFeedForwardLayer", "linear2": "TransformerFeedForwardLayer"}


def tag_names(config: TransformerConfig) -> dict[str, str]:
    """role -> the full tag this layer emits (with axlearn's class prefix when prefixed)."""
    out = {}
    for role in config.roles:
        name = config.tag(role)
        assert name is not None
        out[role] = f"{_CLASS[role]}.{name}" if config.tags.prefixed else name
    return out


PRESET_ROLES: dict[str, tuple[str, ...]] = {
    "trn2-fuji-70b": ("q_proj", "k_proj", "v_proj", "linear1_0", "linear1_1"),
    "native-attention": ("q_proj", "k_proj", "v_proj", "context", "o_proj"),
    "qkv-proj": ("q_proj", "k_proj", "v_proj"),
    "feed-forward": ("linear1_0", "linear1_1", "linear2"),
    "full": (),
    "none": ("input", "q_proj", "k_proj", "v_proj", "context", "o_proj", "linear1_0",
             "linear1_1", "linear2"),
}
"""The roles of this layer each preset saves, read by hand off the presets' documented
patterns (``.*[kqv]_proj``, ``.*linear1_[01]`` and so on; README's preset list), so that a
test's expectation does not come from the policy under test."""


def init_layer(key: jax.Array, config: TransformerConfig, dtype: Any = jnp.float32, *,
               fused_qkv: bool = False) -> Params:
    """Parameters of one layer; ``fused_qkv=True`` gives one ``wqkv`` weight instead of
    ``wq``, ``wk`` and ``wv`` (the layer then computes q, k and v with one matmul)."""
    assert config.kv_heads is not None and config.head_dim is not None
    h, a, kv, d, f = config.hidden, config.heads, config.kv_heads, config.head_dim, config.ffn
    ks = jax.random.split(key, 7)

    def w(k: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return (jax.random.normal(k, shape, jnp.float32) / fan_in**0.5).astype(dtype)

    p = {"norm1": jnp.ones((h,), dtype), "norm2": jnp.ones((h,), dtype),
         "wq": w(ks[0], (h, a, d), h), "wk": w(ks[1], (h, kv, d), h),
         "wv": w(ks[2], (h, kv, d), h), "wo": w(ks[3], (a, d, h), a * d),
         "w1_0": w(ks[4], (h, f), h), "w2": w(ks[6], (f, h), f)}
    if config.gated_ffn:
        p["w1_1"] = w(ks[5], (h, f), h)
    if fused_qkv:
        p["wqkv"] = jnp.concatenate([p.pop("wq"), p.pop("wk"), p.pop("wv")], axis=1)
    if config.norm == "layer":
        p["norm1_bias"] = jnp.zeros((h,), dtype)
        p["norm2_bias"] = jnp.zeros((h,), dtype)
    return p


def init_stack(key: jax.Array, config: TransformerConfig, layers: int | None = None,
               dtype: Any = jnp.float32, *, fused_qkv: bool = False) -> Params:
    """Parameters of `layers` layers stacked on a leading axis (for `lax.scan`)."""
    keys = jax.random.split(key, layers or config.layers)
    return jax.vmap(lambda k: init_layer(k, config, dtype, fused_qkv=fused_qkv))(keys)


def _norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, kind: str) -> jax.Array:
    xf = x.astype(jnp.float32)
    if kind == "layer":
        xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(var + 1e-6) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def layer(x: jax.Array, p: Params, config: TransformerConfig) -> jax.Array:
    """One decoder layer: ``x`` is (batch, seq, hidden)."""
    if config.flash_attention:
        raise NotImplementedError(
            "the reference layer computes attention in full; use flash_attention=False")
    assert config.kv_heads is not None and config.head_dim is not None
    names = tag_names(config)

    def tag(v: jax.Array, role: str) -> jax.Array:
        return checkpoint_name(v, names[role]) if role in names else v

    b, s, _ = x.shape
    kv, d = config.kv_heads, config.head_dim
    group = config.heads // kv
    x = tag(x, "input")
    n1 = _norm(x, p["norm1"], p.get("norm1_bias"), config.norm)
    if "wqkv" in p:  # one matmul, three tagged slices
        qkv = jnp.einsum("bsh,hnd->bsnd", n1, p["wqkv"])
        q, k, v = jnp.split(qkv, [config.heads, config.heads + kv], axis=2)
        q, k, v = tag(q, "q_proj"), tag(k, "k_proj"), tag(v, "v_proj")
    else:
        q = tag(jnp.einsum("bsh,hnd->bsnd", n1, p["wq"]), "q_proj")
        k = tag(jnp.einsum("bsh,hnd->bsnd", n1, p["wk"]), "k_proj")
        v = tag(jnp.einsum("bsh,hnd->bsnd", n1, p["wv"]), "v_proj")
    qg = q.reshape(b, s, kv, group, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k) * (d**-0.5)
    if config.causal:
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    ctx = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, config.heads, d)
    ctx = tag(ctx, "context")
    o = tag(jnp.einsum("bsnd,ndh->bsh", ctx, p["wo"]), "o_proj")
    x1 = x + o
    n2 = _norm(x1, p["norm2"], p.get("norm2_bias"), config.norm)
    a = tag(n2 @ p["w1_0"], "linear1_0")
    act = jax.nn.silu if config.activation == "silu" else jax.nn.gelu
    if config.gated_ffn:
        g = act(a) * tag(n2 @ p["w1_1"], "linear1_1")
    else:
        g = act(a)
    y = tag(g @ p["w2"], "linear2")
    return x1 + y


def layer_params_first(p: Params, x: jax.Array, config: TransformerConfig) -> jax.Array:
    """`layer` called ``f(params, x)``."""
    return layer(x, p, config)


def stack(x: jax.Array, params: Params, config: TransformerConfig, *,
          policy: Callable[..., Any] | None | str = "none", scan: bool = True,
          prevent_cse: bool | None = None) -> jax.Array:
    """Apply the stacked layers in `params`, each under ``jax.checkpoint(policy)``.

    ``policy="none"`` means no remat at all; None means full remat. With ``scan=True``
    the layers run in ``lax.scan`` (one compiled body, the carry kept per layer);
    otherwise they are unrolled. `prevent_cse` defaults to True unrolled, False in scan
    (as axlearn and MaxText choose).
    """
    def body(h: jax.Array, p: Params) -> jax.Array:
        return layer(h, p, config)

    if policy != "none":
        cse = (not scan) if prevent_cse is None else prevent_cse
        body = jax.checkpoint(body, policy=policy, prevent_cse=cse)  # type: ignore[arg-type]
    if scan:
        out, _ = jax.lax.scan(lambda h, p: (body(h, p), None), x, params)
        return out
    n = jax.tree.leaves(params)[0].shape[0]
    for i in range(n):
        x = body(x, jax.tree.map(lambda a, i=i: a[i], params))
    return x
