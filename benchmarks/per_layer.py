"""Per-layer plans against uniform ones, compiled on this machine (XLA:CPU).

An 8-layer scanned decoder (hidden 128, batch 4 x 256 tokens) (`reference.layer` (tests/cpu/reference.py), grouped-KV attention, SwiGLU)
is compiled with `neuron_remat.scan_layers`:

1. k of 8 layers with no remat and the rest saving every tag, k = 0, 2, 4, 6, 8: the
   compiled step's bytes (``memory_analysis``) against k;
2. uniform plans (full remat, every tag) and the per-layer plan (at most two sets: two
   scans; the cost of a second scan measured and reserved) at memory limits between
   them: the limit comes from the compiled uniform steps (the intercept of compiled bytes
   against the traced kept bytes), the plan from ``plan_footprint(..., per_layer=True)``;
   each mixed step is compiled for its bytes (rolled scans) and FLOPs (``unroll=True``:
   XLA:CPU counts a rolled scan's body once). Reported: whether it fits, its measured
   recompute against the best uniform set that fits, and the predicted margin.

    python benchmarks/per_layer.py [--json out/per_layer.json]

Results are cached in out/per_layer_cache.json (delete it to recompile).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cpu"))  # reference

import _common as C  # noqa: E402
import neuron_remat as nr  # noqa: E402
import reference as ref  # noqa: E402

CFG = nr.TransformerConfig(hidden=128, heads=4, kv_heads=2, ffn=384, layers=8, vocab=64,
                           name="per-layer-decoder", flash_attention=False)
BATCH, SEQ = 4, 256
CACHE = Path(__file__).resolve().parents[1] / "out" / "per_layer_cache.json"


def layer(h, p):
    return ref.layer(h, p, CFG)


def args():
    params = ref.init_stack(jax.random.PRNGKey(0), CFG)
    pa = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    return pa, jax.ShapeDtypeStruct((BATCH, SEQ, CFG.hidden), jnp.float32)


def compile_step(policies, unroll=False):
    pa, x = args()

    def loss(params, x):
        return jnp.sum(nr.scan_layers(layer, params, x, policies, unroll=unroll) ** 2)

    c = jax.jit(jax.grad(loss)).lower(pa, x).compile()
    m = C.memory_row(c)
    return {"bytes": m["bytes"], "temp": m["temp_size_in_bytes"], "flops": C.compiled_flops(c)}


def cached(key, fn, cache):
    if key not in cache:
        t = time.time()
        cache[key] = fn()
        cache[key]["seconds"] = time.time() - t
        CACHE.parent.mkdir(exist_ok=True)
        CACHE.write_text(json.dumps(cache, indent=1))
    return cache[key]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    opts = ap.parse_args()
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    names = ref.tag_names(CFG)
    tags = [v for k, v in names.items() if k != "input"]
    every = nr.RegexPolicy([t.replace(".", r"\.") for t in tags])
    full = nr.RegexPolicy([])
    L = CFG.layers
    out: dict = {"model": CFG.name, "batch": BATCH, "seq": SEQ, "layers": L}

    # 1. linearity: k layers no remat, the rest every tag.
    lin = []
    for k in (0, 2, 4, 6, 8):
        r = cached(f"mix-none-{k}", lambda k=k: compile_step(["none"] * k + [every] * (L - k)),
                   cache)
        lin.append((k, r["bytes"]))
        print(f"{k} of {L} layers no remat, rest every tag: {r['bytes'] / 2**20:.2f} MiB")
    out["linearity"] = lin

    # 2. per-layer plans between full remat and every tag.
    x1 = jax.ShapeDtypeStruct((BATCH, SEQ, CFG.hidden), jnp.float32)
    p1 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), args()[0])
    fp = nr.traced_footprint(layer, x1, p1)
    uni = {}
    for label, pol in (("full", full), ("every", every)):
        mem = cached(f"uniform-{label}", lambda pol=pol: compile_step(pol), cache)
        fl = cached(f"uniform-{label}-flops", lambda pol=pol: compile_step(pol, True), cache)
        uni[label] = {"bytes": mem["bytes"], "flops": fl["flops"]}
    base = cached("uniform-none-flops", lambda: compile_step("none", True), cache)["flops"]
    kept_full = fp.evaluate(())[0]
    kept_every = fp.evaluate([t for t in fp if not fp[t].always_kept])[0]
    slope = (uni["every"]["bytes"] - uni["full"]["bytes"]) / (L * (kept_every - kept_full))
    fixed = uni["full"]["bytes"] - slope * L * kept_full
    print(f"compiled bytes = {fixed / 2**20:.2f} MiB + {slope:.3f} x traced kept bytes")
    # What running the stack as two scans costs by itself: the same save set in both runs
    # (the second policy names one more pattern, which matches no tag).
    alt = nr.RegexPolicy([*every.save, "no_such_tag"])
    split = cached("split-every", lambda: compile_step([every] * (L // 2) + [alt] * (L // 2)),
                   cache)["bytes"] - uni["every"]["bytes"]
    print(f"two scans instead of one: {split / 2**20:+.2f} MiB")
    out["split_overhead_bytes"] = split
    rows = []
    for frac in (0.25, 0.5, 0.75):
        limit = uni["full"]["bytes"] + frac * (uni["every"]["bytes"] - uni["full"]["bytes"])
        budget = int((limit - fixed - max(split, 0)) / slope / L)
        try:
            plan = nr.plan_footprint(footprint=fp, budget_bytes=budget, layers=L, per_layer=True,
                           objective="flops")
        except nr.NoFitError:
            print(f"limit {limit / 2**20:.2f} MiB: nothing fits once the second scan's "
                  "cost is reserved")
            continue
        pols = plan.layer_policies or plan.policy
        key = "plan-" + "|".join(",".join(m.tags) + f"x{m.layers}" for m in plan.layer_mix)
        mem = cached(key, lambda pols=pols: compile_step(pols), cache)
        fl = cached(key + "-flops", lambda pols=pols: compile_step(pols, True), cache)
        uni_fl = cached("uniform-" + ",".join(plan.saved_tags) + "-flops",
                        lambda: compile_step(plan.policy, True), cache)["flops"]
        uni_mem = cached("uniform-" + ",".join(plan.saved_tags),
                         lambda: compile_step(plan.policy), cache)["bytes"]
        step = base
        measured = (uni_fl - fl["flops"]) / step
        predicted = (plan.recompute_flops_per_layer * L - plan.mixed_recompute_flops) / step
        row = {"limit": limit, "budget_per_layer": budget,
               "mix": [[list(m.tags), m.layers] for m in plan.layer_mix],
               "mixed_bytes": mem["bytes"], "fits": mem["bytes"] <= limit,
               "uniform_tags": list(plan.saved_tags), "uniform_bytes": uni_mem,
               "uniform_overhead": (uni_fl - base) / step,
               "mixed_overhead": (fl["flops"] - base) / step,
               "measured_margin": measured, "predicted_margin": predicted}
        rows.append(row)
        print(f"limit {limit / 2**20:.2f} MiB: uniform {list(plan.saved_tags)} "
              f"{uni_mem / 2**20:.2f} MiB {100 * row['uniform_overhead']:.2f}%; mix "
              f"{row['mix']} {mem['bytes'] / 2**20:.2f} MiB ({'fits' if row['fits'] else 'OVER'})"
              f" {100 * row['mixed_overhead']:.2f}%; margin measured "
              f"{100 * measured:.2f} predicted {100 * predicted:.2f} points of step FLOPs")
    out["plans"] = rows
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
