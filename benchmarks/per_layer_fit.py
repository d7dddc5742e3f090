"""`fit(make_step, *args, per_layer=True)` on the zoo's held-out scanned steps, compiled on
this machine (XLA:CPU), at memory limits between "every tag saved" and no remat.

For each step of tests/cpu/zoo.py named below (scanned stacks, not looked at while
`fit_per_layer` was written; its one constant, `MIX_ATTEMPTS`, was set on the train steps),
the uniform steps "every tag saved" and no remat are compiled here, and the limit is put at
1/4, 1/2 and 3/4 of the way between their compiled bytes. `fit(..., per_layer=True)`
then plans each limit: the uniform search, and a mix of save sets over the layers (no
remat among them) that it confirms by compiling, run by `scan_layers` as one scan per run
of equal policies. Each answer is measured here, independently of `fit`:

* fits: the mixed step (`Plan.layer_policies`) compiled again, ``memory_analysis()``
  bytes against the limit;
* measured margin: XLA's FLOPs (``cost_analysis()``) of the best uniform set's step (the
  plan's `saved_tags`; no remat does not fit, and no tag set recomputes less than every
  tag) minus the mixed step's, over the no-remat step's, in points, each step counted as
  it runs (`zoo.as_run_flops`: XLA:CPU counts a rolled scan's body once, so each
  policy's layer is measured as its uniform step with ``unroll=2`` less rolled);
* predicted margin: the FLOPs the plan says the mix saves (its uniform set's recompute
  less the mix's, all layers; `fit_per_layer` counts them from its rolled compiles) over
  the same no-remat step's FLOPs.

    nice -n 10 python benchmarks/per_layer_fit.py [--steps a,b] [--json out/per_layer_fit.json]

About 70 compiles; every result is cached in out/per_layer_fit_cache.json (delete it to
recompile).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "cpu")]

import jax  # noqa: E402

import _common as C  # noqa: E402
import neuron_remat as nr  # noqa: E402
import zoo  # noqa: E402

STEPS = ("wide-attn-mqa-adafactor", "moe-fused-qkv", "big-state")
FRACTIONS = (0.25, 0.5, 0.75)
CACHE = REPO / "out" / "per_layer_fit_cache.json"
NONE = jax.checkpoint_policies.everything_saveable


def _compile(step: Any, args: Any) -> dict[str, float]:
    c = step.lower(*args).compile()
    return {"bytes": C.compiled_bytes(c), "flops": C.compiled_flops(c)}


def _policy(saved: list[str] | None) -> Any:
    return NONE if saved is None else nr.RegexPolicy(list(saved))


def _key(policy: Any) -> str:
    """A cache key: "none", the saved tags comma-joined, or per layer joined by "|"."""
    if isinstance(policy, (tuple, list)):
        return "|".join(_key(p) for p in policy)
    return "none" if policy is NONE else ",".join(policy.save)


def _describe(policy: Any) -> list[str] | None:
    return list(policy.save) if isinstance(policy, nr.RegexPolicy) else None


class Cache:
    def __init__(self, path: Path = CACHE) -> None:
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {}

    def get(self, key: str, fn: Any) -> Any:
        if key not in self.data:
            start = time.time()
            value = fn()
            if isinstance(value, dict):
                value["seconds"] = round(time.time() - start, 1)
            self.data[key] = value
            self.path.parent.mkdir(exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=1))
        return self.data[key]


def _memo(make_step: Any) -> Any:
    """`make_step` returning one jitted step per policy, so that `fit`'s calls at each
    limit reuse the lowering and the executable compiled for the same policy."""
    seen: dict[str, Any] = {}

    def make(policy: Any) -> Any:
        key = repr(policy)
        if key not in seen:
            seen[key] = make_step(policy)
        return seen[key]

    return make


def run_step(name: str, cache: Cache, say: Any) -> list[dict[str, Any]]:
    spec = zoo.ZOO[name]
    make, twice = _memo(spec.make_step()), _memo(spec.make_step(unroll=2))
    args = spec.abstract_args()
    every = [re.escape(t) for t in spec.tags.values() if t]
    e = cache.get(f"{name}/every", lambda: _compile(make(_policy(every)), args))
    n = cache.get(f"{name}/none", lambda: _compile(make(NONE), args))

    def flops(policy: Any, unroll: int) -> float:
        key = f"{name}/flops/{_key(policy)}/unroll{unroll}"
        step = (make if unroll == 1 else twice)(policy)
        return cache.get(key, lambda: _compile(step, args))["flops"]

    base = zoo.as_run_flops(spec, NONE, flops)
    say(f"{name}: {spec.layers} layers; every tag {e['bytes'] / 2**20:.2f} MiB, "
        f"no remat {n['bytes'] / 2**20:.2f} MiB")
    rows = []
    for frac in FRACTIONS:
        limit = int(e["bytes"] + frac * (n["bytes"] - e["bytes"]))

        def fit_it(limit: int = limit) -> dict[str, Any]:
            dev = nr.parse_device(f"trn2.48xlarge:hbm={limit}B:cores=1", source="benchmark")
            plan = nr.fit(make, *args, device=dev, reserve=0, per_layer=True)
            return {"uniform": list(plan.saved_tags),
                    "uniform_policy": _describe(plan.policy),
                    "layers": [_describe(p) for p in plan.layer_policies or ()],
                    "mix": [["no remat" if not isinstance(m.policy, nr.RegexPolicy)
                             else list(m.tags), m.layers] for m in plan.layer_mix],
                    "predicted_saved_flops": plan.recompute_flops_per_layer
                    * plan.layers_per_core - plan.mixed_recompute_flops,
                    "compiles": plan.compiled.compiles,
                    "fit_bytes": plan.compiled.bytes, "notes": list(plan.notes)}

        f = cache.get(f"{name}/{frac}/fit", fit_it)
        row = {"step": name, "limit": limit, "uniform": f["uniform"], "mix": f["mix"],
               "predicted_margin": 100 * f["predicted_saved_flops"] / base,
               "compiles": f["compiles"]}
        uni = zoo.as_run_flops(spec, _policy(f["uniform_policy"]), flops)
        if f["layers"]:
            per = tuple(_policy(p) for p in f["layers"])
            mix = cache.get(f"{name}/mix/{_key(per)}", lambda per=per: _compile(make(per), args))
            row.update(mixed_bytes=mix["bytes"], fits=mix["bytes"] <= limit,
                       measured_margin=100 * (uni - zoo.as_run_flops(spec, per, flops)) / base)
        else:
            row.update(mixed_bytes=None, fits=None, measured_margin=0.0,
                       note=f["notes"][-1] if f["notes"] else "")
        rows.append(row)
        say(f"  limit {limit / 2**20:.2f} MiB: uniform {len(f['uniform'])} tags; mix "
            f"{f['mix']}: " + (f"{row['mixed_bytes'] / 2**20:.2f} MiB "
                               f"({'fits' if row['fits'] else 'OVER'})" if f["layers"]
                               else "none (" + row["note"] + ")")
            + f"; margin measured {row['measured_margin']:.2f}, predicted "
            f"{row['predicted_margin']:.2f} points of step FLOPs; {f['compiles']} compiles")
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cache", type=Path, default=CACHE,
                    help=f"the cache file (default {CACHE.relative_to(REPO)})")
    opts = ap.parse_args(argv)
    cache = Cache(opts.cache)
    # Compiles repeat across limits (each fit starts with full remat): keep executables.
    jax.config.update("jax_compilation_cache_dir", str(REPO / "out" / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    rows = []
    for name in opts.steps.split(","):
        rows += run_step(name, cache, lambda line: print(line, flush=True))
    mixed = [r for r in rows if r["fits"] is not None]
    worst = max((abs(r["measured_margin"] - r["predicted_margin"]) for r in rows), default=0)
    print(f"{len(mixed)} of {len(rows)} limits got a mix; {sum(bool(r['fits']) for r in mixed)}"
          f" fit; largest |measured - predicted| margin {worst:.2f} points")
    out = {"rows": rows, "worst_margin_error": worst}
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
