"""What neuron_remat measures on the running JAX and remat implementation: audit bytes,
the traced footprint, and the TRN2 preset's compiled FLOPs against full remat's.

Run it once per JAX version, and with ``JAX_REMAT3=true`` where JAX has remat3; the
figures must not change (tests/cpu/test_jax_versions.py holds them fixed).

    python benchmarks/jax_versions.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from neuron_remat import _trace, models
from neuron_remat import policies as pol
from neuron_remat._audit import audit

# The reference layer is a test fixture (tests/cpu/reference.py).
if str(Path(__file__).resolve().parents[1] / "tests" / "cpu") not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cpu"))
import reference as ref  # noqa: E402

# The layer of tests/cpu/test_policies.py, and the scanned stack of test_memory_model.py
# (XLA counts a scan body once, so the stack's FLOPs are one layer's).
SMALL = models.TransformerConfig(hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, vocab=50,
                                 name="test-layer")
STACK = models.TransformerConfig(hidden=128, heads=8, kv_heads=2, ffn=256, layers=4, vocab=512,
                                 name="test-stack")


def compiled_flops(policy: object, layers: int = 2) -> float:
    params = ref.init_stack(jax.random.PRNGKey(0), STACK, layers)
    x = jnp.ones((2, 64, STACK.hidden))

    def loss(x: jax.Array, p: dict) -> jax.Array:
        return jnp.sum(ref.stack(x, p, STACK, policy=policy, scan=True))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).compile()
    return float(compiled.cost_analysis()["flops"])


def figures() -> dict:
    params = ref.init_layer(jax.random.PRNGKey(0), SMALL)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, SMALL.hidden))

    def layer(x: jax.Array, p: dict) -> jax.Array:
        return ref.layer(x, p, SMALL)

    trn2 = pol.preset("trn2-fuji-70b")
    report = audit(layer, x, params, policy=trn2)
    fp = _trace.traced_footprint(layer, x, params)
    return {
        "jax": jax.__version__, "remat": pol.active_remat(),
        "audit": {"tags": report.saved_tag_bytes, "inputs": report.saved_input_bytes,
                  "other": report.saved_other_bytes,
                  "kept_per_tag": {t.name: t.kept_bytes for t in report.tags if t.kept_bytes},
                  "recomputed_dots": report.recomputed_dots,
                  "full_remat_dots": report.full_remat_dots},
        "footprint": {"always_kept": fp.always_kept_bytes,
                      "always_kept_tags": sorted(k for k, v in fp.items() if v.always_kept),
                      "tag_bytes": {k: v.bytes for k, v in fp.items()},
                      "recompute_flops": {k: v.recompute_flops for k, v in fp.items()},
                      "full_recompute_flops": fp.full_recompute_flops},
        "compiled_flops": {"none": compiled_flops("none"), "full": compiled_flops(None),
                           "trn2": compiled_flops(trn2)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    out = figures()
    if ap.parse_args().json:
        print(json.dumps(out, indent=1, sort_keys=True))
        return
    a, f, c = out["audit"], out["footprint"], out["compiled_flops"]
    print(f"JAX {out['jax']}, {out['remat']}")
    print(f"  audit (trn2 preset): tags {a['tags']} B + inputs {a['inputs']} B + other "
          f"{a['other']} B; dots recomputed {a['recomputed_dots']} of {a['full_remat_dots']}")
    print(f"  footprint: always kept {f['always_kept']} B ({', '.join(f['always_kept_tags'])}),"
          f" tag bytes {sum(f['tag_bytes'].values())} B, full recompute "
          f"{f['full_recompute_flops']:.0f} FLOP")
    print(f"  compiled FLOPs: no remat {c['none'] / 1e6:.2f} M, full remat "
          f"{c['full'] / 1e6:.2f} M, trn2 preset {c['trn2'] / 1e6:.2f} M")


if __name__ == "__main__":
    main()
