"""A JAX flash-attention reference, and decoder layers built on it, for tests only.

`flash_attention` is a ``jax.custom_vjp`` whose forward keeps what Neuron's flash kernel
keeps for its backward (the output and the float32 log-sum-exp, besides q, k and v) and
whose backward recomputes the probabilities from them, as flash kernels do. It works in
query blocks of `BLOCK` rows; a causal block reads only the keys up to its last row, so
fully masked key blocks are skipped (``(n + 1) / 2n`` of the score matrix for ``n``
blocks), as kernels skip them. The output and the log-sum-exp are tagged ``context`` in
the forward (the tag the analytic model gives them).

`layer` is a pre-norm decoder layer with axlearn-style tags whose pieces vary as hosts
write them: activation dtype, attention core (plain softmax, this flash reference, or this
flash reference called through ``jax.shard_map`` over a batch-sharded mesh), feed-forward
(plain, or chunked over tokens with ``lax.scan``), fused or separate q/k/v projections.
Written for these tests from the flash-attention recurrence (Dao et al. 2022); no code is
copied from a kernel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

BLOCK = 128  # query rows per block (memory_model.FLASH_BLOCK counts the same blocks)


def _forward(q, k, v, causal, block):
    """(out, lse): q (b, s, h, d), k and v (b, s, kv, d); lse (b, kv, h // kv, s) float32."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qg = q.reshape(b, s, kv, g, d)
    outs, lses = [], []
    for start in range(0, s, block):
        stop = min(start + block, s)
        keys = stop if causal else s  # keys past the block's last row are all masked
        sc = jnp.einsum("bskgd,btkd->bkgst", qg[:, start:stop], k[:, :keys]).astype(
            jnp.float32) * (d ** -0.5)
        if causal:
            # iota, not arange: JAX 0.7 hoists an offset arange into a constant it keeps
            rows = jax.lax.broadcasted_iota(jnp.int32, (stop - start, keys), 0) + start
            cols = jax.lax.broadcasted_iota(jnp.int32, (stop - start, keys), 1)
            sc = jnp.where(rows >= cols, sc, -jnp.inf)
        m = jnp.max(sc, axis=-1, keepdims=True)
        e = jnp.exp(sc - m)
        l_ = jnp.sum(e, axis=-1, keepdims=True)
        o = jnp.einsum("bkgst,btkd->bskgd", e.astype(v.dtype), v[:, :keys])
        o = o / jnp.moveaxis(l_, -2, 1).astype(o.dtype)
        outs.append(o)
        lses.append((m + jnp.log(l_))[..., 0])
    out = jnp.concatenate(outs, axis=1).reshape(b, s, h, d)
    return out, jnp.concatenate(lses, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def flash_attention(q, k, v, causal=True, block=BLOCK):
    return _forward(q, k, v, causal, block)[0]


def _fwd(q, k, v, causal, block):
    out, lse = _forward(q, k, v, causal, block)
    out = checkpoint_name(out, "MultiheadAttention.context")
    lse = checkpoint_name(lse, "MultiheadAttention.context")
    return out, (q, k, v, out, lse)


def _bwd(causal, block, res, dout):
    q, k, v, out, lse = res
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qg = q.reshape(b, s, kv, g, d)
    dog = dout.reshape(b, s, kv, g, d)
    og = out.reshape(b, s, kv, g, d)
    sc = jnp.einsum("bskgd,btkd->bkgst", qg, k).astype(jnp.float32) * (d ** -0.5)
    if causal:
        sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -jnp.inf)
    p = jnp.exp(sc - lse[..., None])
    dv = jnp.einsum("bkgst,bskgd->btkd", p.astype(v.dtype), dog)
    dp = jnp.einsum("bskgd,btkd->bkgst", dog, v).astype(jnp.float32)
    delta = jnp.moveaxis(jnp.sum(dog.astype(jnp.float32) * og.astype(jnp.float32), -1),
                         1, -1)
    ds = (p * (dp - delta[..., None]) * (d ** -0.5)).astype(q.dtype)
    dq = jnp.einsum("bkgst,btkd->bskgd", ds, k).reshape(b, s, h, d)
    dk = jnp.einsum("bkgst,bskgd->btkd", ds, qg)
    return dq, dk, dv


flash_attention.defvjp(_fwd, _bwd)


def flash_flops(b: int, s: int, h: int, d: int, causal: bool = True, block: int = BLOCK
                ) -> int:
    """FLOPs of this reference's forward as XLA counts them, by independent arithmetic:
    per score element two matmul multiply-adds (4d) and scale, mask, max, subtract, sum;
    per output element a divide; per row a log-sum-exp add."""
    elems = 0
    for start in range(0, s, block):
        rows = min(start + block, s) - start
        elems += rows * (min(start + block, s) if causal else s)
    per = 4 * d + 4 + (1 if causal else 0)
    return b * h * (elems * per + s * d + s)


# --- layers ---------------------------------------------------------------------------

TAGS = {r: f"{c}.{r}" for c, rs in (("MultiheadAttention", ("q_proj", "k_proj", "v_proj",
                                                          "context", "o_proj")),
                                    ("TransformerFeedForwardLayer", ("linear1_0", "linear1_1",
                                                                     "linear2")))
        for r in rs}


@dataclass(frozen=True)
class Spec:
    """One layer of the test matrix."""

    dtype: str = "float32"
    attention: str = "plain"  # "plain", "flash" or "shard_map"
    devices: int = 1  # mesh size for "shard_map"
    ffn: str = "plain"  # "plain" or "scan" (chunked over tokens)
    fused: bool = False
    params_first: bool = False
    batch: int = 4
    seq: int = 32
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    ffn_dim: int = 64
    chunks: int = 2
    block: int = 16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def label(self) -> str:
        att = self.attention + (f"{self.devices}" if self.attention == "shard_map" else "")
        return (f"{self.dtype}-{att}-ffn_{self.ffn}-{'fused' if self.fused else 'sep'}-"
                f"{'pfirst' if self.params_first else 'xfirst'}")


def init(spec: Spec, key: Any = None) -> dict[str, jax.Array]:
    key = jax.random.PRNGKey(0) if key is None else key
    h, a, kv, d, f = spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.ffn_dim
    ks = jax.random.split(key, 7)
    dt = jnp.dtype(spec.dtype)

    def w(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(dt)

    p = {"norm1": jnp.ones((h,), dt), "norm2": jnp.ones((h,), dt),
         "wo": w(ks[3], (a, d, h), a * d), "w1_0": w(ks[4], (h, f), h),
         "w1_1": w(ks[5], (h, f), h), "w2": w(ks[6], (f, h), f)}
    wq, wk, wv = w(ks[0], (h, a, d), h), w(ks[1], (h, kv, d), h), w(ks[2], (h, kv, d), h)
    if spec.fused:
        p["wqkv"] = jnp.concatenate([wq, wk, wv], axis=1)
    else:
        p.update(wq=wq, wk=wk, wv=wv)
    return p


def make_x(spec: Spec, key: Any = None) -> jax.Array:
    key = jax.random.PRNGKey(1) if key is None else key
    return jax.random.normal(key, (spec.batch, spec.seq, spec.hidden)).astype(spec.dtype)


def _norm(x, scale):
    xf = x.astype(jnp.float32)  # float32 statistics, whatever the activation dtype
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return (xf * jax.lax.rsqrt(var + 1e-6) * scale.astype(jnp.float32)).astype(x.dtype)


def _plain_attention(q, k, v):
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d)
    sc = jnp.einsum("bskgd,btkd->bkgst", qg, k) * (d ** -0.5)
    sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -1e9)
    pr = jax.nn.softmax(sc.astype(jnp.float32), axis=-1).astype(q.dtype)
    ctx = jnp.einsum("bkgst,btkd->bskgd", pr, v).reshape(b, s, h, d)
    return checkpoint_name(ctx, TAGS["context"])


def mesh_of(devices: int) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))


def _shard_map(fn, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map  # noqa: PLC0415  JAX < 0.7

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def layer_fn(spec: Spec, *, unroll: bool = False):
    """The layer of `spec` as ``f(x, params)`` (or ``f(params, x)`` when params_first).
    `unroll` unrolls the feed-forward scan (XLA's CPU cost analysis counts a loop body
    once, so compiled FLOPs are measured unrolled; the traced program is the same scan)."""
    mesh = mesh_of(spec.devices) if spec.attention == "shard_map" else None

    def attention(q, k, v):
        if spec.attention == "plain":
            return _plain_attention(q, k, v)
        core = functools.partial(flash_attention, causal=True, block=spec.block)
        if spec.attention == "flash":
            return core(q, k, v)
        spec4 = P("data", None, None, None)
        return _shard_map(lambda q, k, v: core(q, k, v), mesh, (spec4, spec4, spec4),
                          spec4)(q, k, v)

    def ffn(n2, p):
        def block(c):
            a = checkpoint_name(c @ p["w1_0"], TAGS["linear1_0"])
            gi = checkpoint_name(c @ p["w1_1"], TAGS["linear1_1"])
            return checkpoint_name((jax.nn.silu(a) * gi) @ p["w2"], TAGS["linear2"])

        if spec.ffn == "plain":
            return block(n2)
        b, s, h = n2.shape
        chunks = n2.reshape(spec.chunks, b * s // spec.chunks, h)
        _, ys = jax.lax.scan(lambda c, xc: (c, block(xc)), None, chunks,
                             unroll=spec.chunks if unroll else 1)
        return ys.reshape(b, s, h)

    def layer(x, p):
        n1 = _norm(x, p["norm1"])
        kv = spec.kv_heads
        if "wqkv" in p:
            qkv = jnp.einsum("bsh,hnd->bsnd", n1, p["wqkv"])
            q, k, v = jnp.split(qkv, [spec.heads, spec.heads + kv], axis=2)
        else:
            q = jnp.einsum("bsh,hnd->bsnd", n1, p["wq"])
            k = jnp.einsum("bsh,hnd->bsnd", n1, p["wk"])
            v = jnp.einsum("bsh,hnd->bsnd", n1, p["wv"])
        q, k, v = (checkpoint_name(t, TAGS[r]) for t, r in ((q, "q_proj"), (k, "k_proj"),
                                                           (v, "v_proj")))
        ctx = attention(q, k, v)
        o = checkpoint_name(jnp.einsum("bsnd,ndh->bsh", ctx, p["wo"]), TAGS["o_proj"])
        x1 = x + o
        return x1 + ffn(_norm(x1, p["norm2"]), p)

    if spec.params_first:
        return lambda p, x: layer(x, p)
    return layer


def args_of(spec: Spec) -> tuple[Any, ...]:
    x, p = make_x(spec), init(spec)
    return (p, x) if spec.params_first else (x, p)
