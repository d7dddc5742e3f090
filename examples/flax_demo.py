"""End-to-end demonstration: a Flax linen decoder whose blocks get their remat policy from
neuron_remat, trained on the CPU against a simulated, scaled-down Trainium2 core.

Run it with the default simulated device (one TRN2 core with 40 MiB of HBM) or any other::

    python examples/flax_demo.py [--steps N] [--unrolled]
    NEURON_REMAT_DEVICE=trn2.48xlarge:hbm=48MiB:cores=1 python examples/flax_demo.py

The block mirrors `reference.layer` (tests/cpu/reference.py) op for op (pre-norm RMSNorm in float32,
grouped-KV causal attention with a float32 softmax, gated SiLU feed-forward), with the same
parameter shapes and the same axlearn tags, so the analytic plan's predictions describe
this model. The block class is wrapped with ``neuron_remat.adapters.flax.remat(Block,
stack=..., layer="decoder.block", model=CONFIG, shape=SHAPE, parallelism=Parallelism())``;
its policy is resolved when the training step is first traced.

For each of three variants, no remat / full remat / the resolved policy, `main` prints the
compiled training step's ``memory_analysis()`` (temp + arguments + outputs - aliased), its
``cost_analysis()["flops"]``, the loss over a few SGD steps, and the planner's budget.

Why the blocks run in ``nn.scan`` (``stack="repeated"``) and not unrolled
(``stack="stacked"``), measured with jax 0.10.2 on XLA:CPU:

* Unrolled, ``prevent_cse=True`` does keep XLA from merging the recomputation back into
  the forward (FLOPs: no remat 6.79 G, full remat 8.58 G, the plan 7.97 G), but no
  ``optimization_barrier`` is left in XLA:CPU's optimised module, and its schedule holds
  every block's recomputed activations at once: full remat compiles to 89 MiB against
  no remat's 95 MiB (XLA's live-range dump shows all eight blocks' rematerialised
  ``seq x seq`` probabilities live together at the peak). So unrolled, the CPU
  executable does not show what remat saves (``--unrolled`` prints those figures).
* In ``nn.scan`` each block's backward recomputes inside its own loop iteration, so only
  the residuals the policy saves are stacked across layers: no remat 110 MiB, full remat
  29 MiB, the plan 34 MiB. Inside scan CSE cannot merge the recomputation into the
  forward, hence ``prevent_cse=False`` (what the adapter picks for ``repeated``).
* XLA's cost analysis counts a while loop's body once, not once per iteration, so with
  scan the compiled FLOPs hold the blocks' work for one layer (plus the embedding, head
  and loss): the difference between two variants is one layer's recompute, which is
  what the planner's ``recompute_flops_per_layer`` predicts.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import neuron_remat as nr
from neuron_remat.adapters.flax import remat as nr_remat

# The tag names of the tests' reference layer (tests/cpu/reference.py, a test fixture).
_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "cpu")
if _FIXTURES not in sys.path:
    sys.path.insert(0, _FIXTURES)
from reference import tag_names  # noqa: E402

__all__ = [
    "CONFIG",
    "DEFAULT_DEVICE",
    "LAYER_NAME",
    "PARALLELISM",
    "SHAPE",
    "Block",
    "Decoder",
    "Demo",
    "MemoryFigures",
    "Run",
    "block_class",
    "build",
    "compiled_step",
    "compiled_step_memory",
    "cross_entropy",
    "initial_params",
    "main",
    "remat_context",
    "resolved_choice",
    "run",
    "step_flops",
    "train",
]

Mode = Literal["none", "full", "resolved"]
MODES: tuple[Mode, ...] = ("none", "full", "resolved")
Params = Any

# --------------------------------------------------------------------------------------
# Demo sizes. Chosen so that, on a single simulated TRN2 core with 40 MiB of HBM, the
# model state (params + grads, plain SGD) is ~13 MiB, one block without remat keeps
# ~13 MiB (its 2 x 4 x 256 x 256 float32 attention probabilities and their softmax pieces
# dominate), and each tag only 128-768 KiB: eight blocks without remat compile to ~110 MiB,
# full remat to ~29 MiB, and the planner's per-layer budget (1.21 MiB) falls between "save
# nothing" (0.25 MiB, the block input) and "save every useful tag" (2.75 MiB).
# --------------------------------------------------------------------------------------

CONFIG = nr.TransformerConfig(
    hidden=128, heads=4, kv_heads=2, ffn=384, layers=8, vocab=512, flash_attention=False,
    name="flax-demo")
"""The demo decoder, as the planner sees it (what ``model=`` tells the provider)."""

SHAPE = nr.StepShape(seq_len=256, micro_batch=2, activation_dtype="float32",
                     param_dtype="float32", optimizer="sgd")
"""One training step: (micro_batch, seq_len) tokens, float32 throughout, plain SGD."""

PARALLELISM = nr.Parallelism()
"""One CPU device: every parallel degree is 1 (and the simulated device has one core)."""

DEFAULT_DEVICE = "trn2.48xlarge:hbm=40MiB:cores=1"
"""The simulated device `main` uses when ``NEURON_REMAT_DEVICE`` is not set."""

LAYER_NAME = "decoder.block"
SCAN = True
"""Run the blocks in ``nn.scan`` (``stack="repeated"``); see the module docstring."""
LEARNING_RATE = 0.5

# --------------------------------------------------------------------------------------
# The model.
# --------------------------------------------------------------------------------------


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm computed in float32, as `reference._norm` (tests/cpu/reference.py) does."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return (xf * jax.lax.rsqrt(var + 1e-6) * scale.astype(jnp.float32)).astype(x.dtype)


def _normal(fan_in: int) -> Callable[[jax.Array, Sequence[int], Any], jax.Array]:
    def init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        return (jax.random.normal(key, tuple(shape), jnp.float32) / fan_in**0.5).astype(dtype)
    return init


class Block(nn.Module):
    """One pre-norm decoder block: the math of `reference.layer` (tests/cpu/reference.py), with the
    same parameter shapes and the same ``checkpoint_name`` tags (axlearn's names)."""

    config: nr.TransformerConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        assert cfg.kv_heads is not None and cfg.head_dim is not None
        h, a, kv, d, f = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn
        names = tag_names(cfg)
        ones = nn.initializers.ones
        norm1 = self.param("norm1", ones, (h,), self.dtype)
        norm2 = self.param("norm2", ones, (h,), self.dtype)
        wq = self.param("wq", _normal(h), (h, a, d), self.dtype)
        wk = self.param("wk", _normal(h), (h, kv, d), self.dtype)
        wv = self.param("wv", _normal(h), (h, kv, d), self.dtype)
        wo = self.param("wo", _normal(a * d), (a, d, h), self.dtype)
        w1_0 = self.param("w1_0", _normal(h), (h, f), self.dtype)
        w1_1 = self.param("w1_1", _normal(h), (h, f), self.dtype)
        w2 = self.param("w2", _normal(f), (f, h), self.dtype)

        b, s, _ = x.shape
        group = a // kv
        x = checkpoint_name(x, names["input"])
        n1 = _rms_norm(x, norm1)
        q = checkpoint_name(jnp.einsum("bsh,hnd->bsnd", n1, wq), names["q_proj"])
        k = checkpoint_name(jnp.einsum("bsh,hnd->bsnd", n1, wk), names["k_proj"])
        v = checkpoint_name(jnp.einsum("bsh,hnd->bsnd", n1, wv), names["v_proj"])
        qg = q.reshape(b, s, kv, group, d)
        scores = jnp.einsum("bskgd,btkd->bkgst", qg, k) * (d**-0.5)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        ctx = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, a, d)
        ctx = checkpoint_name(ctx, names["context"])
        o = checkpoint_name(jnp.einsum("bsnd,ndh->bsh", ctx, wo), names["o_proj"])
        x1 = x + o
        n2 = _rms_norm(x1, norm2)
        gate = checkpoint_name(n2 @ w1_0, names["linear1_0"])
        up = checkpoint_name(n2 @ w1_1, names["linear1_1"])
        y = checkpoint_name((jax.nn.silu(gate) * up) @ w2, names["linear2"])
        return x1 + y


class _ScanStep(nn.Module):
    """`block` as an ``nn.scan`` body: ``(carry, _) -> (block(carry), None)``."""

    config: nr.TransformerConfig
    block: Any = Block

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return self.block(self.config, name="block")(x), None


class Decoder(nn.Module):
    """Token embedding, `config.layers` blocks of `block` (a `Block` class, plain or
    remat-wrapped), a final float32 RMSNorm and an untied LM head. Returns float32
    logits of shape (batch, seq, vocab).

    ``scan=True`` runs the blocks in ``nn.scan`` (parameters stacked on a leading layer
    axis, as `reference.stack` (tests/cpu/reference.py) lays them out); ``scan=False`` unrolls them.
    """

    config: nr.TransformerConfig
    block: Any = Block
    scan: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        embed = self.param("embed", _normal(1), (cfg.vocab, cfg.hidden), jnp.float32)
        x = jnp.take(embed, tokens, axis=0)
        if self.scan:
            layers = nn.scan(_ScanStep, variable_axes={"params": 0},
                             split_rngs={"params": True}, length=cfg.layers)
            x, _ = layers(cfg, self.block, name="layers")(x, None)
        else:
            for i in range(cfg.layers):
                x = self.block(cfg, name=f"block_{i}")(x)
        scale = self.param("final_norm", nn.initializers.ones, (cfg.hidden,), jnp.float32)
        x = _rms_norm(x, scale)
        head = self.param("lm_head", _normal(cfg.hidden), (cfg.hidden, cfg.vocab),
                          jnp.float32)
        return (x @ head).astype(jnp.float32)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# --------------------------------------------------------------------------------------
# Building the three variants.
# --------------------------------------------------------------------------------------


def remat_context(config: nr.TransformerConfig = CONFIG, shape: nr.StepShape = SHAPE,
                  parallelism: nr.Parallelism = PARALLELISM, *, scan: bool = SCAN
                  ) -> dict[str, Any]:
    """The context the demo tells the provider about its blocks."""
    return {"stack": "repeated" if scan else "stacked", "layer": LAYER_NAME,
            "model": config, "shape": shape, "parallelism": parallelism}


def block_class(mode: Mode, *, default: Any = None, config: nr.TransformerConfig = CONFIG,
                shape: nr.StepShape = SHAPE, scan: bool = SCAN) -> Any:
    """The block class for a variant.

    ``none``: the plain `Block` (no ``jax.checkpoint``); ``full``: ``nn.remat`` with no
    saveable names (recompute the whole block); ``resolved``: neuron_remat's adapter, whose
    policy the providers choose on first trace, `default` standing when none answers.
    ``prevent_cse`` is what the adapter uses for the stack kind: False in scan, True
    unrolled.
    """
    if mode == "none":
        return Block
    if mode == "full":
        return nn.remat(Block, prevent_cse=not scan, policy=None)
    if mode == "resolved":
        return nr_remat(Block, default=default, **remat_context(config, shape, scan=scan))
    raise ValueError(f"mode={mode!r}; valid: {', '.join(MODES)}")


def resolved_choice(*, default: Any = None, config: nr.TransformerConfig = CONFIG,
                    shape: nr.StepShape = SHAPE, scan: bool = SCAN) -> nr.RematChoice:
    """What the adapter resolves to for the demo's context (the provider caches it per
    context, so this is the very answer the traced blocks use)."""
    return nr.resolve_policy(default=default, **remat_context(config, shape, scan=scan))


@dataclass(frozen=True)
class Demo:
    """One built variant: the model, its initial parameters and one fixed batch."""

    mode: str
    model: Decoder
    params: Params
    tokens: jax.Array  # (micro_batch, seq_len + 1): inputs and shifted targets

    def loss(self, params: Params, tokens: jax.Array) -> jax.Array:
        logits = self.model.apply({"params": params}, tokens[:, :-1])
        return cross_entropy(logits, tokens[:, 1:])

    def step(self, params: Params, tokens: jax.Array) -> tuple[Params, jax.Array]:
        """One plain-SGD step: the new parameters and the loss before the update."""
        loss, grads = jax.value_and_grad(self.loss)(params, tokens)
        new = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
        return new, loss

    def compile(self) -> Any:
        """The training step, compiled ahead of time (``jax.stages.Compiled``).

        Parameters are donated, as a training loop would: XLA writes the update in place
        and reports those bytes as aliased.
        """
        return jax.jit(self.step, donate_argnums=(0,)).lower(self.params,
                                                             self.tokens).compile()


@functools.lru_cache(maxsize=8)
def initial_params(config: nr.TransformerConfig = CONFIG, shape: nr.StepShape = SHAPE,
                   scan: bool = SCAN, seed: int = 0) -> tuple[Params, jax.Array]:
    """Initial parameters and a fixed random batch of shape (micro_batch, seq_len + 1).

    Every variant has the same parameter tree (the remat wrappers add no scope), so they
    are initialised once, from the plain model, under ``jax.jit``; callers must not donate
    them (`train_compiled` copies them first)."""
    model = Decoder(config, Block, scan=scan)
    k_params, k_tokens = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k_tokens, (shape.micro_batch, shape.seq_len + 1), 0,
                                config.vocab, dtype=jnp.int32)
    params = jax.jit(model.init)(k_params, tokens[:, :-1])["params"]
    return params, tokens


def build(mode: Mode, *, default: Any = None, config: nr.TransformerConfig = CONFIG,
          shape: nr.StepShape = SHAPE, scan: bool = SCAN, seed: int = 0) -> Demo:
    """Build a variant with the shared initial parameters and batch (`initial_params`).

    Nothing here consults the remat policy: the adapter resolves it when the training
    step is first traced (`Demo.compile`, or the first call of a jitted step)."""
    model = Decoder(config, block_class(mode, default=default, config=config, shape=shape,
                                        scan=scan), scan=scan)
    params, tokens = initial_params(config, shape, scan, seed)
    return Demo(mode, model, params, tokens)


@dataclass(frozen=True)
class MemoryFigures:
    """A compiled step's ``memory_analysis()``, in bytes.

    ``total = temp + arguments + outputs - aliased``: what the executable holds at its
    peak (XLA's temp allocation is already packed by liveness), donated inputs that the
    outputs reuse counted once. Generated code is left out.
    """

    temp: int
    arguments: int
    outputs: int
    aliased: int

    @property
    def total(self) -> int:
        return self.temp + self.arguments + self.outputs - self.aliased

    @classmethod
    def of(cls, compiled: Any) -> MemoryFigures:
        m = compiled.memory_analysis()
        return cls(int(m.temp_size_in_bytes), int(m.argument_size_in_bytes),
                   int(m.output_size_in_bytes), int(m.alias_size_in_bytes))


def step_flops(compiled: Any) -> float:
    """XLA's FLOP count for a compiled step (``cost_analysis()["flops"]``)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX returned one dict per device
        cost = cost[0]
    return float(cost["flops"])


@dataclass(frozen=True)
class Run:
    """One variant compiled once and trained with that executable."""

    mode: str
    memory: MemoryFigures
    flops: float
    losses: tuple[float, ...]


def train_compiled(demo: Demo, compiled: Any, steps: int) -> list[float]:
    """The loss at each of `steps` SGD steps of `compiled` on the demo's fixed batch (from
    a copy of the initial parameters, which the step donates)."""
    params = jax.tree.map(jnp.copy, demo.params)
    losses = []
    for _ in range(steps):
        params, loss = compiled(params, demo.tokens)
        losses.append(float(loss))
    return losses


def run(mode: Mode, steps: int = 4, *, default: Any = None, scan: bool = SCAN,
        seed: int = 0) -> Run:
    """Build, compile once, read the memory and FLOPs, and train `steps` steps."""
    demo = build(mode, default=default, scan=scan, seed=seed)
    compiled = demo.compile()
    return Run(mode, MemoryFigures.of(compiled), step_flops(compiled),
               tuple(train_compiled(demo, compiled, steps)))


def train(mode: Mode, steps: int = 4, *, default: Any = None, scan: bool = SCAN,
          seed: int = 0) -> list[float]:
    """The loss trajectory of `steps` SGD steps on one fixed random batch."""
    return list(run(mode, steps, default=default, scan=scan, seed=seed).losses)


def compiled_step(mode: Mode, *, default: Any = None, scan: bool = SCAN, seed: int = 0
                  ) -> Any:
    """The compiled training step of a variant."""
    return build(mode, default=default, scan=scan, seed=seed).compile()


def compiled_step_memory(mode: Mode, *, default: Any = None, scan: bool = SCAN
                         ) -> MemoryFigures:
    """`MemoryFigures` of a variant's compiled training step."""
    return MemoryFigures.of(compiled_step(mode, default=default, scan=scan))


# --------------------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:7.2f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan, then memory, FLOPs and losses of the three variants."""
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="SGD steps per variant")
    parser.add_argument("--unrolled", action="store_true",
                        help="unroll the blocks (stack=stacked) instead of nn.scan")
    args = parser.parse_args(argv)
    scan = not args.unrolled
    os.environ.setdefault("NEURON_REMAT_DEVICE", DEFAULT_DEVICE)
    device = nr.detect()
    print(f"device: {device.describe()}")
    print(f"model: {CONFIG.name}: hidden={CONFIG.hidden} heads={CONFIG.heads} "
          f"kv_heads={CONFIG.kv_heads} ffn={CONFIG.ffn} layers={CONFIG.layers} "
          f"vocab={CONFIG.vocab}; {SHAPE}; blocks "
          f"{'in nn.scan (stack=repeated)' if scan else 'unrolled (stack=stacked)'}\n")
    choice = resolved_choice(scan=scan)
    hbm = device.hbm_bytes_per_core or None
    if choice.plan is not None:
        print(choice.plan.table())
        plan = choice.plan
        b = plan.budget
        assert b is not None
        # The plan's own figures: its policy's workspace and the per-layer budget that
        # leaves (the table's memory line), not the budget before a policy was chosen.
        room = b.hbm_bytes - b.state.total_bytes - b.reserve_bytes - plan.workspace_bytes
        print(f"\nbudget: HBM {_mib(b.hbm_bytes)} - state {_mib(b.state.total_bytes)} - "
              f"reserve {_mib(b.reserve_bytes)} - workspace {_mib(plan.workspace_bytes)} = "
              f"{_mib(room)} for {plan.layers_per_core} layers "
              f"({_mib(plan.budget_bytes_per_layer)} each); predicted peak "
              f"{_mib(plan.predicted_bytes_per_core)}")
    else:
        print(f"no plan ({choice.reason}): policy {choice.policy!r}")
    print("\ncompiled step: total = temp + arguments + outputs - aliased (donated params)")
    print(f"{'variant':9} {'temp':>11} {'arguments':>11} {'outputs':>11} {'aliased':>11} "
          f"{'total':>11}  {'fits':4}  {'GFLOP':>7}  losses")
    for mode in MODES:
        r = run(mode, args.steps, scan=scan)
        m = r.memory
        fits = "-" if hbm is None else ("yes" if m.total <= hbm else "NO")
        print(f"{mode:9} {_mib(m.temp)} {_mib(m.arguments)} {_mib(m.outputs)} "
              f"{_mib(m.aliased)} {_mib(m.total)}  {fits:4}  {r.flops / 1e9:7.4f}  "
              + " ".join(f"{x:.6f}" for x in r.losses))
    print(f"\nresolved: {choice.policy!r} (provider {choice.provider}, "
          f"prevent_cse={choice.prevent_cse}; {choice.reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
