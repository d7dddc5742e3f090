"""`neuron_remat.fit` on a training step of our own: a scanned decoder (grouped-KV causal
attention, SwiGLU feed-forward, `reference.layer` (tests/cpu/reference.py)), the embedding and head,
cross-entropy, and AdamW inside the jitted step with the state donated.

    python examples/fit_demo.py [--hbm 32MiB] [--json] [--max-compiles N] [--again]
    neuron-remat fit examples.fit_demo:factory        # the same step from the CLI

`fit` traces the step once, compiles a few probe policies on this machine's backend
(XLA:CPU here), learns what the compiler allocates beyond the kept residuals, and returns
the save set with the least recompute whose compiled step fits one simulated TRN2 core
with ``--hbm`` of memory (no reserve: the compiled figure is the whole step). The table
lists each compile, then the plan. With ``--again``, where the plan says a better set may
fit (`CompiledFit.unexplored`), `fit` runs again with the budget its note advises, resuming
the first plan: its compiles are read back, not made again.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The decoder layer is the tests' plain-JAX reference layer (tests/cpu/reference.py; a test
# fixture, not part of the installed package).
if str(Path(__file__).resolve().parents[1] / "tests" / "cpu") not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cpu"))

import neuron_remat as nr  # noqa: E402
import reference  # noqa: E402

__all__ = ["CONFIG", "SMALL", "abstract_args", "factory", "main", "make_step_factory",
           "small_factory"]

CONFIG = nr.TransformerConfig(hidden=128, heads=4, kv_heads=2, ffn=384, layers=4, vocab=512,
                              name="fit-demo")
"""Four scanned layers, eight tags (q, k, v, context, o, both SwiGLU inputs, the FFN
output) besides the layer input."""
SMALL = nr.TransformerConfig(
    hidden=128, heads=4, kv_heads=2, ffn=384, layers=8, vocab=512, name="fit-small",
    tags=nr.TagNames(vocabulary="fit", input=None, v_proj=None, linear2=None,
                     prefixed=False))
"""Eight layers and six tags (q_proj, k_proj, context, o_proj, linear1_0, linear1_1): 64
subsets, few enough to compile every one (the tests' brute force)."""
BATCH, SEQ = 2, 256
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.1


def _params(config: nr.TransformerConfig) -> dict[str, Any]:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    h, v = config.hidden, config.vocab
    return {"layers": reference.init_stack(k1, config),
            "embed": jax.random.normal(k2, (v, h), jnp.float32) * 0.02,
            "head": jax.random.normal(k3, (h, v), jnp.float32) / h**0.5}


def abstract_args(config: nr.TransformerConfig = CONFIG, batch: int = BATCH,
                  seq: int = SEQ) -> tuple[Any, Any]:
    """(state, tokens) as ShapeDtypeStructs: params, AdamW moments and the step count."""
    params = jax.eval_shape(lambda: _params(config))
    state = {"params": params, "mu": params, "nu": params,
             "count": jax.ShapeDtypeStruct((), jnp.int32)}
    return state, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)


def make_step_factory(config: nr.TransformerConfig = CONFIG) -> Callable[[Any], Any]:
    """``make_step(policy)``: the jitted AdamW training step whose layers are
    ``jax.checkpoint(policy=policy)`` inside ``lax.scan``; the state is donated."""

    def make_step(policy: Any) -> Any:
        def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            x = params["embed"][inputs]
            x = reference.stack(x, params["layers"], config, policy=policy, scan=True)
            logits = (x @ params["head"]).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

        def step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens)
            count = state["count"] + 1
            b1, b2 = BETAS
            mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["mu"], grads)
            nu = jax.tree.map(lambda n, g: b2 * n + (1 - b2) * g * g, state["nu"], grads)
            c1 = 1 - b1 ** count.astype(jnp.float32)
            c2 = 1 - b2 ** count.astype(jnp.float32)
            params = jax.tree.map(
                lambda p, m, n: p - LR * ((m / c1) / (jnp.sqrt(n / c2) + EPS)
                                          + WEIGHT_DECAY * p),
                state["params"], mu, nu)
            return {"params": params, "mu": mu, "nu": nu, "count": count}, loss

        return jax.jit(step, donate_argnums=0)

    return make_step


def factory() -> tuple[Callable[[Any], Any], tuple[Any, ...]]:
    """For ``neuron-remat fit examples.fit_demo:factory``: (make_step, args)."""
    return make_step_factory(CONFIG), abstract_args(CONFIG)


def small_factory() -> tuple[Callable[[Any], Any], tuple[Any, ...]]:
    """The tests' variant (`SMALL`): ``neuron-remat fit examples.fit_demo:small_factory``."""
    return make_step_factory(SMALL), abstract_args(SMALL)


def main(argv: Sequence[str] | None = None) -> nr.Plan:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hbm", default="32MiB", help="HBM of the simulated core (default "
                   "32MiB: between full remat, 29 MiB, and every tag saved, 35 MiB)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--max-compiles", type=int, default=None,
                   help="fit's compile budget (a hard cap; default: fit's own)")
    p.add_argument("--again", action="store_true",
                   help="where the plan says a better set may fit, fit again as its note "
                        "advises: resuming it, with Plan.compiled.advised_max_compiles")
    args = p.parse_args(argv)
    hbm = nr.device.parse_bytes(args.hbm, what="--hbm")
    device = nr.parse_device(f"trn2.48xlarge:hbm={hbm}B:cores=1", source="fit_demo")
    make_step, step_args = factory()
    start = time.perf_counter()
    try:
        plan = nr.fit(make_step, *step_args, device=device, reserve=0,
                      **({} if args.max_compiles is None else {"max_compiles": args.max_compiles}))
    except ValueError as err:  # a budget under 3, or no set fits --hbm: one line
        raise SystemExit(f"fit_demo: {err}") from None
    advised = plan.compiled.advised_max_compiles  # type: ignore[union-attr]
    if args.again and advised is not None:  # only the compiles it did not make are made
        plan = nr.fit(make_step, *step_args, device=device, reserve=0, max_compiles=advised,
                      resume=plan)
    seconds = time.perf_counter() - start
    if args.json:
        import json  # noqa: PLC0415

        print(json.dumps(plan.to_dict(), indent=2, default=str))
    else:
        print(nr.fit_table(plan))
        print(f"fit took {seconds:.1f} s ({plan.compiled.compiles} compiles)")  # type: ignore[union-attr]
    return plan


if __name__ == "__main__":
    main()
