"""A zoo of small training steps `fit` was not written against (test fixtures).

Each `Spec` builds ``make_step(policy)`` and the step's abstract arguments: an embedding,
a stack of decoder layers (scanned with ``lax.scan``, or an unrolled Python loop), a final
norm and head, cross-entropy, and an optax optimizer inside the jitted step. The layers
differ in structure (GQA ratios from MHA to MQA, a fused QKV projection, rotary
embedding, a soft-routed MoE feed-forward, a wide FFN beside narrow attention and the
reverse), dtype (float32, bfloat16), optimizer (AdamW, SGD, Adafactor), donation, and in
how large no remat is against full remat (about 1.1x to 4.3x), and in how many useful tags
they have (up to 8).
Tag names differ too (MaxText's, axlearn-like, made up). Every step compiles in a few
seconds on an idle XLA:CPU core (about 3 s; the unrolled and bfloat16 ones up to 12 s).

The protocol benchmarks/fit_sweep.py relies on (a step from elsewhere, e.g. a host
library's real training step, plugs in with ``fit_sweep.py --steps-module MODULE`` when
``MODULE.STEPS`` maps names to objects that have it):

- ``name: str``, ``split: str`` (``"train"`` or ``"held-out"``), ``note: str``;
- ``extra: dict``: ``brute_tags`` (int) caps the tags of the brute force;
- ``scan: bool`` (optional, default True): the layers run in a ``lax.scan``, whose body
  XLA:CPU's ``cost_analysis()`` counts once;
- ``make_step()`` returns ``make_step(policy)``, which returns the jitted training step
  (``.lower(*args).compile()``) whose checkpointed layers use the JAX remat ``policy``;
- ``abstract_args()`` returns that step's arguments as ``jax.ShapeDtypeStruct``s.

`split` says what each step is for: ``"train"`` steps are the ones `fit`'s search constants
(`neuron_remat.fit`) were tuned on; ``"held-out"`` steps were not looked at while tuning
and are what benchmarks/fit_sweep.py reports on separately.

`OomOracleSimulation` is a SIMULATION of a backend without ``memory_analysis()``: it
compiles the real step on XLA:CPU and raises an XLA-style ``RESOURCE_EXHAUSTED`` error when
the compiled bytes exceed a limit, and otherwise returns a compiled object whose
``memory_analysis()`` raises, as the Neuron PJRT plugin may. With ``figures=False`` the
error gives no byte figure (a neuronx-cc ``NCC_EOOM002`` that says only that the program
does not fit): the compile says no more than whether it fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from neuron_remat import scan_layers

MAXTEXT = {"q": "query_proj", "k": "key_proj", "v": "value_proj", "context": "context",
           "out": "out_proj", "ffn0": "mlpwi_0", "ffn1": "mlpwi_1"}


@dataclass(frozen=True)
class Spec:
    """One training step of the zoo. `tags` maps a layer role (q, k, v, qkv, scores,
    context, out, ffn0, ffn1, ffn_out, router, expert_in, moe_out) to its ``checkpoint_name``; a role not
    in it is not tagged."""

    name: str
    split: str  # "train" or "held-out"
    tags: dict[str, str]
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 16
    ffn: int = 256
    experts: int = 0
    fused_qkv: bool = False
    rope: bool = False
    dtype: str = "float32"
    optimizer: str = "adamw"
    scan: bool = True
    donate: bool = True
    batch: int = 2
    seq: int = 64
    vocab: int = 256
    ignores_policy: bool = False
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- parameters ------------------------------------------------------------------

    def _layer_shapes(self) -> dict[str, tuple[int, ...]]:
        d, hd = self.hidden, self.head_dim
        q, kv = self.heads * hd, self.kv_heads * hd
        s: dict[str, tuple[int, ...]] = {"ln1": (d,), "ln2": (d,), "wo": (q, d)}
        if self.fused_qkv:
            s["wqkv"] = (d, q + 2 * kv)
        else:
            s.update(wq=(d, q), wk=(d, kv), wv=(d, kv))
        if self.experts:
            e = self.experts
            s.update(wr=(d, e), w1=(e, d, self.ffn), w2=(e, self.ffn, d))
        else:
            s.update(w1a=(d, self.ffn), w1b=(d, self.ffn), w2=(self.ffn, d))
        return s

    def init(self, key: jax.Array) -> dict[str, Any]:
        dt = jnp.dtype(self.dtype)
        shapes = self._layer_shapes()
        keys = jax.random.split(key, len(shapes) + 2)
        layers = {}
        for k, (n, shape) in zip(keys, sorted(shapes.items())):
            full = (self.layers, *shape)
            if n.startswith("ln"):
                layers[n] = jnp.ones(full, dt)
            else:
                layers[n] = (jax.random.normal(k, full, jnp.float32)
                             / shape[-2] ** 0.5).astype(dt)
        return {"layers": layers,
                "embed": (jax.random.normal(keys[-2], (self.vocab, self.hidden)) * 0.02
                          ).astype(dt),
                "head": (jax.random.normal(keys[-1], (self.hidden, self.vocab))
                         / self.hidden ** 0.5).astype(dt),
                "ln_f": jnp.ones((self.hidden,), dt)}

    def optimizer_fn(self) -> optax.GradientTransformation:
        if self.optimizer == "adamw":
            return optax.adamw(1e-3, weight_decay=0.1)
        if self.optimizer == "sgd":
            return optax.sgd(1e-2)
        if self.optimizer == "adafactor":
            return optax.adafactor(1e-3)
        raise ValueError(f"optimizer {self.optimizer!r}")

    def abstract_args(self) -> tuple[Any, Any]:
        tx = self.optimizer_fn()

        def state() -> Any:
            params = self.init(jax.random.PRNGKey(0))
            return params, tx.init(params)

        return (jax.eval_shape(state),
                jax.ShapeDtypeStruct((self.batch, self.seq + 1), jnp.int32))

    # ---- the step --------------------------------------------------------------------

    def _tag(self, v: jax.Array, role: str) -> jax.Array:
        name = self.tags.get(role)
        return checkpoint_name(v, name) if name else v

    def layer(self, x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        b, s, _ = x.shape
        hd, nh, nk = self.head_dim, self.heads, self.kv_heads
        t = self._tag

        def norm(v: jax.Array, scale: jax.Array) -> jax.Array:
            v32 = v.astype(jnp.float32)
            v32 = v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, -1, keepdims=True) + 1e-6)
            return v32.astype(v.dtype) * scale

        h = norm(x, p["ln1"])
        if self.fused_qkv:
            qkv = t(h @ p["wqkv"], "qkv")
            q, k, v = jnp.split(qkv, [nh * hd, (nh + nk) * hd], axis=-1)
        else:
            q, k, v = (t(h @ p["wq"], "q"), t(h @ p["wk"], "k"), t(h @ p["wv"], "v"))
        q = q.reshape(b, s, nk, nh // nk, hd)
        k, v = k.reshape(b, s, nk, hd), v.reshape(b, s, nk, hd)
        if self.rope:  # rotary embedding after the tagged projections, as MaxText and axlearn
            q, k = _rotary(q, 1), _rotary(k, 1)
        scores = t(jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / hd ** 0.5,
                   "scores")
        mask = jnp.tril(jnp.ones((s, s), bool))
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), -1).astype(x.dtype)
        ctx = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, nh * hd)
        ctx = t(ctx, "context")
        x = x + t(ctx @ p["wo"], "out")
        h = norm(x, p["ln2"])
        if self.experts:
            gate = jax.nn.softmax(t(h @ p["wr"], "router").astype(jnp.float32), -1)
            hid = t(jnp.einsum("bsd,edf->bsef", h, p["w1"]), "expert_in")
            out = jnp.einsum("bsef,efd->bsed", jax.nn.gelu(hid), p["w2"])
            y = t(jnp.einsum("bsed,bse->bsd", out, gate.astype(x.dtype)), "moe_out")
        else:
            a = t(h @ p["w1a"], "ffn0")
            g = t(h @ p["w1b"], "ffn1")
            y = t((jax.nn.silu(a) * g) @ p["w2"], "ffn_out")
        return x + y

    def make_step(self, unroll: int | bool = 1) -> Callable[[Any], Any]:
        """``make(policy)``: the jitted step. `policy` is one JAX policy for every layer,
        or a tuple of one per layer (a per-layer plan's `Plan.layer_policies`), which a
        scanned stack runs with `neuron_remat.scan_layers` (one scan per run of equal
        policies). `unroll` goes to the scans (``True`` lets XLA:CPU's cost analysis count
        every layer, it counts a rolled scan's body once)."""
        tx = self.optimizer_fn()

        def make(policy: Any) -> Any:
            per = tuple(policy) if isinstance(policy, (tuple, list)) else None
            if self.ignores_policy:  # the user's bug: a fixed policy, the argument unused
                policy = jax.checkpoint_policies.nothing_saveable
                per = None
            body = None if per is not None else jax.checkpoint(self.layer, policy=policy)

            def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
                x = params["embed"][tokens[:, :-1]]
                if self.scan and per is not None:
                    x = scan_layers(self.layer, params["layers"], x, per, unroll=unroll,
                                    prevent_cse=True)  # as jax.checkpoint's default below
                elif self.scan:
                    x, _ = jax.lax.scan(lambda h, p: (body(h, p), None), x, params["layers"],
                                        unroll=unroll)
                else:
                    for i in range(self.layers):
                        f = body if per is None else jax.checkpoint(self.layer, policy=per[i])
                        x = f(x, jax.tree.map(lambda a, i=i: a[i], params["layers"]))
                x = x * params["ln_f"]
                logits = (x @ params["head"]).astype(jnp.float32)
                logp = jax.nn.log_softmax(logits)
                return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

            def step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
                params, opt = state
                loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
                updates, opt = tx.update(grads, opt, params)
                return (optax.apply_updates(params, updates), opt), loss

            return jax.jit(step, donate_argnums=(0,) if self.donate else ())

        return make


def _rotary(v: jax.Array, axis: int) -> jax.Array:
    """Rotary position embedding of `v` (positions along `axis`, features on the last
    axis), in the rotate-half form: the features' two halves turn by position x
    10000^(-2i/d)."""
    half = v.shape[-1] // 2
    pos = jnp.arange(v.shape[axis], dtype=jnp.float32)
    angle = pos[:, None] * 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    shape = [1] * v.ndim
    shape[axis], shape[-1] = v.shape[axis], half
    sin = jnp.sin(angle).reshape(shape).astype(v.dtype)
    cos = jnp.cos(angle).reshape(shape).astype(v.dtype)
    a, b = v[..., :half], v[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


ZOO: dict[str, Spec] = {s.name: s for s in [
    # --- train: fit's constants were tuned on these ---
    Spec("gqa4-adamw", "train", MAXTEXT | {"scores": "attn_scores"}, heads=8, kv_heads=2,
         head_dim=16, hidden=128, ffn=256, seq=128,
         note="scanned, f32, GQA 4:1, SwiGLU, AdamW, donated, MaxText tag names: 8 tags"),
    Spec("wide-ffn-sgd-bf16", "train",
         {"q": "q", "k": "k", "v": "v", "context": "ctx", "ffn0": "gate", "ffn1": "up"},
         hidden=64, heads=2, kv_heads=2, head_dim=16, ffn=1024, dtype="bfloat16",
         optimizer="sgd", donate=False, seq=128, extra={"brute_tags": 4},
         note="scanned, bf16, narrow MHA attention (2 heads of 16) beside a 16x FFN, SGD, "
              "not donated"),
    Spec("long-seq", "train",
         {"q": "q_proj", "k": "k_proj", "context": "attn_ctx", "out": "o_proj",
          "ffn0": "w_gate", "ffn_out": "ffn_out"},
         hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, seq=384, vocab=128,
         optimizer="sgd", layers=6,
         note="scanned, f32, long sequence, small state: no remat about 4x full remat"),
    Spec("rope-gqa2-bf16", "train",
         {"q": "query", "k": "key", "v": "value", "context": "attn_context",
          "out": "attn_output", "ffn0": "ffn_gate", "ffn1": "ffn_up", "ffn_out": "ffn_down"},
         hidden=96, heads=6, kv_heads=3, head_dim=16, ffn=192, rope=True,
         dtype="bfloat16", seq=128, extra={"brute_tags": 7},
         note="scanned, bf16, rotary embedding, GQA 2:1, SwiGLU, AdamW, donated: 8 tags"),
    Spec("moe8-rope-sgd", "train",
         {"q": "wq", "k": "wk", "v": "wv", "context": "attn", "router": "gate_logits",
          "expert_in": "experts_up", "moe_out": "experts_out"},
         hidden=64, heads=4, kv_heads=1, head_dim=16, ffn=48, experts=8, rope=True,
         optimizer="sgd", donate=False, seq=80, extra={"brute_tags": 6},
         note="scanned, f32, rotary embedding, MQA, soft-routed MoE of 8 narrow experts, "
              "SGD, not donated"),
    # --- held-out: not looked at while tuning ---
    Spec("wide-attn-mqa-adafactor", "held-out",
         {"q": "attn_q", "k": "attn_k", "v": "attn_v", "context": "attn_o_in",
          "out": "attn_out", "ffn0": "mlp_in", "ffn1": "mlp_gate", "scores": "attn_logits"},
         hidden=64, heads=16, kv_heads=1, head_dim=32, ffn=32, seq=96,
         optimizer="adafactor",
         note="scanned, f32, wide MQA attention (16 heads of 32 over 1 KV head) beside a "
              "narrow FFN, Adafactor, donated: 8 tags"),
    Spec("moe-fused-qkv", "held-out",
         {"qkv": "qkv_proj", "context": "context", "out": "out_proj", "router": "router",
          "expert_in": "expert_hidden", "moe_out": "moe_out"},
         hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, experts=4, fused_qkv=True,
         seq=96,
         note="scanned, f32, fused QKV, soft-routed MoE of 4 experts, AdamW, donated"),
    Spec("big-state", "held-out",
         {"q": "q", "k": "k", "v": "v", "out": "o", "ffn0": "wi0", "ffn1": "wi1"},
         hidden=128, heads=4, kv_heads=4, head_dim=32, ffn=512, seq=64, vocab=2048,
         dtype="bfloat16", layers=6, extra={"brute_tags": 4},
         note="scanned, bf16, MHA, large vocabulary and few tokens: no remat about 1.5x "
              "full remat, AdamW, donated"),
    Spec("unrolled-gqa2", "held-out", MAXTEXT | {"v": None}, heads=4, kv_heads=2,
         scan=False, seq=96, extra={"brute_tags": 4},
         note="an unrolled Python loop of checkpointed layers: XLA:CPU keeps about the "
              "same memory whatever the policy"),
]}
"""The sweep's zoo, by name."""

IGNORES_POLICY = dataclasses.replace(ZOO["gqa4-adamw"], name="ignores-policy", split="test",
                                     ignores_policy=True, layers=2, seq=32)
"""A user's bug, for the tests only: ``make_step`` never passes its policy to
``jax.checkpoint``."""


# --------------------------------------------------------------------------------------
# FLOPs of a scanned step as it runs.
# --------------------------------------------------------------------------------------


def as_run_flops(spec: Spec, policy: Any, flops: Callable[[Any, int], float]) -> float:
    """XLA's FLOPs of ``spec.make_step()(policy)`` as it runs: every layer counted.

    XLA:CPU's ``cost_analysis()`` counts a rolled loop's body once. A scanned step with
    ``unroll=2`` holds two layers in that body, so the uniform step's count with
    ``unroll=2`` less its count rolled is one layer of that policy, in the program that
    runs (unrolling the whole stack is another program: there XLA simplifies across
    layers; moe-fused-qkv's "every tag" costs 8.7 MFLOP per layer more than no remat
    unrolled, 11.5 rolled). `policy` is one policy, or one per layer (`scan_layers` runs
    each run of equal policies as its own scan, each body counted once): the rolled
    step's count plus, per run, its length less one times its policy's layer.
    ``flops(policy, unroll)`` compiles ``spec.make_step(unroll=unroll)(policy)`` and
    returns XLA's count (a caller may cache it). The stack's length must be even."""
    from neuron_remat.stack import policy_runs

    if not spec.scan or spec.layers % 2:
        raise ValueError(f"{spec.name}: as_run_flops needs a scanned stack of even length")
    per = list(policy) if isinstance(policy, (tuple, list)) else [policy] * spec.layers
    total = flops(policy, 1)
    for start, stop, p in policy_runs(per):
        if stop - start > 1:
            total += (stop - start - 1) * (flops(p, 2) - flops(p, 1))
    return total


# --------------------------------------------------------------------------------------
# A SIMULATED backend without memory_analysis(): the compile is the oracle.
# --------------------------------------------------------------------------------------


class SimulatedOutOfMemory(RuntimeError):
    """Raised by `OomOracleSimulation` the way XLA reports running out of device memory."""


class _NoMemoryCompiled:
    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def memory_analysis(self) -> Any:
        raise NotImplementedError("memory_analysis is not implemented (simulated backend)")

    def cost_analysis(self) -> Any:
        return self._compiled.cost_analysis()


class _Lowered:
    def __init__(self, lowered: Any, limit: int, compile_fn: Callable[[Any], Any],
                 figures: bool = True) -> None:
        self._lowered, self._limit, self._compile_fn = lowered, limit, compile_fn
        self._figures = figures

    def compile(self) -> Any:
        compiled = self._compile_fn(self._lowered)
        m = compiled.memory_analysis()
        total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes)
        if total > self._limit:
            raise SimulatedOutOfMemory(
                f"RESOURCE_EXHAUSTED: (simulated) the program needs {total} bytes of device "
                f"memory, over the {self._limit} bytes available" if self._figures else
                "NCC_EOOM002: (simulated) the program does not fit the device's memory")
        return _NoMemoryCompiled(compiled)


class OomOracleSimulation:
    """SIMULATION of a backend whose compiled programs have no ``memory_analysis()`` and
    whose compiler fails with ``RESOURCE_EXHAUSTED`` when the program does not fit
    `limit` bytes. Wraps a jitted step: tracing and calling pass through; ``lower(*args)
    .compile()`` compiles on XLA:CPU and either raises `SimulatedOutOfMemory` or returns an
    object whose ``memory_analysis()`` raises."""

    def __init__(self, step: Any, limit: int,
                 compile_fn: Callable[[Any], Any] = lambda lowered: lowered.compile(),
                 figures: bool = True) -> None:
        self._step, self._limit, self._compile_fn = step, limit, compile_fn
        self._figures = figures  # whether an out-of-memory error gives the bytes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(*args, **kwargs)

    def lower(self, *args: Any) -> _Lowered:
        return _Lowered(self._step.lower(*args), self._limit, self._compile_fn, self._figures)

    def trace(self, *args: Any) -> Any:
        return self._step.trace(*args)


def oracle_make_step(make_step: Callable[[Any], Any], limit: int,
                     figures: bool = True) -> Callable[[Any], Any]:
    """`make_step` whose steps run under `OomOracleSimulation` at `limit` bytes, whose
    out-of-memory errors give the program's bytes (with `figures` False, no figure)."""
    return lambda policy: OomOracleSimulation(make_step(policy), limit, figures=figures)
