"""How `plan()` and `audit()` time grows with layer count, and `plan()` with tag count.

* `plan()` for Fuji-70B geometry with ``TransformerConfig.layers`` set to 8, 32, 80, 160
  (on 32 simulated trn2.48xlarge hosts, so 160 layers still fit; tp=4 with sequence
  parallelism, fsdp over the rest, seq 8192). The planner works on one layer's graph, so
  its time should not depend on the layer count.
* `audit()` of a stack of N tiny reference layers (hidden 32, 2 heads over 1 KV head, ffn
  64, seq 16), unrolled (one Python-level layer per layer: the trace grows with N) and in
  ``lax.scan`` (one body: it should not), under axlearn's TRN2 preset.
* `plan_footprint(..., budget_bytes=...)` on a synthetic additive footprint of 4..24 tags
  (random bytes and FLOP/byte, budget 40% of all bytes, three seeds per count): every
  subset is enumerated up to 12 tags, branch and bound beyond. Each answer is checked
  against a brute-force optimum (numpy, up to 20 tags).

* `traced_footprint()` and `plan()` on it for traced layers with 9 tags (one reference
  layer with fused q/k/v, the default benchmark size) and 16 tags (two reference layers in
  one function, the second with its own tag names; its two dead ``linear2`` tags left out):
  the footprint (JVP trace and graph), the first `plan()` on it and warm `plan()` calls.
  Targets: footprint under 3 s at 9 tags and 10 s at 16, plan under 50 ms at 9 tags.

Growth is fitted as ``time ~ N**k`` (log-log least squares) and, for tags, also as a
factor per added tag.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import _common as C  # noqa: E402

NAME = "scaling"
TINY = C.Size(hidden=32, heads=2, kv_heads=1, ffn=64, seq=16, batch=1)


def plan_vs_layers(layers: Sequence[int], repeat: int) -> list[dict[str, Any]]:
    import neuron_remat as nr  # noqa: PLC0415

    device = nr.from_instance_type("trn2.48xlarge")
    par = nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=32)
    shape = nr.StepShape(seq_len=8192)
    out = []
    for n in layers:
        config = dataclasses.replace(nr.get_model("fuji-70b"), layers=n)
        p = nr.plan(device, config, shape, par)
        seconds = C.median_time(lambda c=config: nr.plan(device, c, shape, par), repeat)
        out.append({"layers": n, "ms": 1e3 * seconds, "saved_tags": list(p.saved_tags),
                    "budget_bytes_per_layer": p.budget_bytes_per_layer})
    return out


def audit_vs_layers(layers: Sequence[int], repeat: int) -> list[dict[str, Any]]:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import neuron_remat as nr  # noqa: PLC0415
    import reference as ref  # noqa: PLC0415

    config = TINY.config(max(layers))
    shapes = jax.eval_shape(lambda k: ref.init_layer(k, config), jax.random.PRNGKey(0))
    x = jnp.zeros((TINY.batch, TINY.seq, TINY.hidden), jnp.float32)
    policy = nr.preset("trn2-fuji-70b")
    # Warm JAX's per-primitive caches once so the first size is not charged for them.
    warm = jax.tree.map(lambda s: jnp.zeros((2, *s.shape), s.dtype), shapes)
    nr.audit(lambda x, p: ref.stack(x, p, config, policy="none", scan=False), x, warm,
             policy=policy)
    out = []
    for n in layers:
        params = jax.tree.map(lambda s, n=n: jnp.zeros((n, *s.shape), s.dtype), shapes)
        row: dict[str, Any] = {"layers": n}
        for scan in (False, True):
            def fn(x: Any, p: Any, scan: bool = scan) -> Any:
                return ref.stack(x, p, config, policy="none", scan=scan)

            times, report = [], None
            for _ in range(repeat):
                t = time.perf_counter()
                report = nr.audit(fn, x, params, policy=policy)
                times.append(time.perf_counter() - t)
            assert report is not None
            key = "scan" if scan else "unrolled"
            row[f"{key}_s"] = statistics.median(times)
            row[f"{key}_saved_bytes"] = report.saved_bytes
        out.append(row)
    return out


def _synthetic(tags: int, seed: int) -> tuple[dict[str, Any], int, np.ndarray, np.ndarray]:
    import neuron_remat as nr  # noqa: PLC0415

    rng = np.random.default_rng(1000 * tags + seed)
    nbytes = rng.integers(1 << 20, 100 << 20, tags)
    flops = nbytes * rng.uniform(16, 4096, tags)
    fp = {f"tag{i:02d}": nr.TagCost(bytes=int(nbytes[i]), recompute_flops=float(flops[i]))
          for i in range(tags)}
    return fp, int(0.4 * nbytes.sum()), nbytes, flops


def _brute_force(nbytes: np.ndarray, flops: np.ndarray, budget: int) -> float:
    """Least recompute (sum of the flops not saved) over every subset that fits."""
    n = len(nbytes)
    masks = (np.arange(1 << n)[:, None] >> np.arange(n)) & 1
    kept = masks @ nbytes
    saved = masks @ flops
    return float(flops.sum() - saved[kept <= budget].max())


def plan_vs_tags(counts: Sequence[int], repeat: int, check_up_to: int) -> list[dict[str, Any]]:
    import neuron_remat as nr  # noqa: PLC0415

    out = []
    for tags in counts:
        times, gaps = [], []
        for seed in range(3):
            fp, budget, nbytes, flops = _synthetic(tags, seed)
            p = nr.plan_footprint(footprint=fp, budget_bytes=budget)
            times.append(C.median_time(
                lambda fp=fp, b=budget: nr.plan_footprint(footprint=fp, budget_bytes=b), repeat))
            if tags <= check_up_to:
                best = _brute_force(nbytes, flops, budget)
                gaps.append((p.recompute_flops_per_layer - best) / max(best, 1.0))
        out.append({"tags": tags, "method": "enumeration" if tags <= 12 else "branch and bound",
                    "ms": 1e3 * statistics.median(times), "ms_per_seed": [1e3 * t for t in times],
                    "checked": bool(gaps),
                    "max_relative_gap_to_brute_force": max(gaps) if gaps else None})
    return out


def _traced_layer(tags: int, size: C.Size) -> tuple[Any, tuple[Any, ...], list[str] | None]:
    """(fn, args, tag subset) of a traced layer with 9 or 16 tags."""
    import jax  # noqa: PLC0415

    import reference as ref  # noqa: PLC0415

    config = size.config(2)
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda k: ref.init_layer(k, config, fused_qkv=True),
                            jax.random.PRNGKey(0))
    p1 = jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.05).astype(np.float32),
                      shapes)
    x = (rng.standard_normal((size.batch, size.seq, size.hidden))).astype(np.float32)
    if tags == 9:
        return (lambda p, x: ref.layer_params_first(p, x, config)), (p1, x), None
    names = {f: getattr(config.tags, f) for f in
             ("input", "q_proj", "k_proj", "v_proj", "context", "o_proj", "linear1_0",
              "linear1_1", "linear2")}
    second = dataclasses.replace(config, tags=dataclasses.replace(
        config.tags, vocabulary="second", **{k: f"{v}_b" for k, v in names.items()}))
    p2 = jax.tree.map(lambda a: a * 0.5, p1)

    def two(params: Any, x: Any) -> Any:
        return ref.layer(ref.layer(x, params[0], config), params[1], second)

    keep = list(ref.tag_names(config).values()) + list(ref.tag_names(second).values())
    keep = [t for t in keep if not t.endswith(("linear2", "linear2_b"))]
    assert len(keep) == 16, keep
    return two, ((p1, p2), x), keep


def traced_speed(sizes: Sequence[tuple[int, C.Size]], repeat: int) -> list[dict[str, Any]]:
    import neuron_remat as nr  # noqa: PLC0415

    out = []
    for tags, size in sizes:
        fn, args, keep = _traced_layer(tags, size)
        nr.traced_footprint(fn, *args, tags=keep)  # warm JAX's tracing caches
        times, fp = [], None
        for _ in range(repeat):
            t = time.perf_counter()
            fp = nr.traced_footprint(fn, *args, tags=keep)
            times.append(time.perf_counter() - t)
        assert fp is not None and len(fp) == tags
        low, _ = fp.evaluate(())
        high, _ = fp.evaluate(list(fp))
        budget = (low + high) // 2
        t = time.perf_counter()
        p = nr.plan_footprint(footprint=fp, budget_bytes=budget, min_flops_per_byte=0)
        first = time.perf_counter() - t
        warm = C.median_time(lambda: nr.plan_footprint(footprint=fp, budget_bytes=budget,
                                             min_flops_per_byte=0), repeat)
        out.append({"tags": tags, "size": size.to_dict(), "ops": len(fp.graph.ops),
                    "footprint_s": statistics.median(times), "plan_first_ms": 1e3 * first,
                    "plan_warm_ms": 1e3 * warm, "saved_tags": list(p.saved_tags),
                    "groups": [g.label for g in fp.groups]})
    return out


def fits(res: dict[str, Any]) -> dict[str, Any]:
    pl, au, tg = res["plan_layers"], res["audit_layers"], res["plan_tags"]
    enum = [r for r in tg if r["method"] == "enumeration"]
    bnb = [r for r in tg if r["method"] != "enumeration"]
    return {
        "plan_vs_layers_exponent": C.fit_power([r["layers"] for r in pl], [r["ms"] for r in pl]),
        "audit_unrolled_vs_layers_exponent": C.fit_power([r["layers"] for r in au],
                                                         [r["unrolled_s"] for r in au]),
        "audit_scan_vs_layers_exponent": C.fit_power([r["layers"] for r in au],
                                                     [r["scan_s"] for r in au]),
        "enumeration_factor_per_tag": C.fit_exponential([r["tags"] for r in enum],
                                                        [r["ms"] for r in enum]),
        "branch_and_bound_factor_per_tag": C.fit_exponential([r["tags"] for r in bnb],
                                                             [r["ms"] for r in bnb]),
        "branch_and_bound_exponent": C.fit_power([r["tags"] for r in bnb],
                                                 [r["ms"] for r in bnb]),
    }


def report(res: dict[str, Any]) -> str:
    f = res["fits"]
    lines = [
        "plan() vs layers (Fuji-70B geometry, 32 x trn2.48xlarge)",
        C.table([(r["layers"], f"{r['ms']:.2f}", ",".join(r["saved_tags"]))
                 for r in res["plan_layers"]], ("layers", "ms", "saved")),
        f"growth: time ~ layers^{f['plan_vs_layers_exponent']:.2f}",
        "",
        f"audit() vs layers (tiny reference layer h={TINY.hidden}, trn2-fuji-70b preset)",
        C.table([(r["layers"], f"{r['unrolled_s']:.2f}", f"{r['scan_s']:.2f}",
                  C.kib(r["unrolled_saved_bytes"])) for r in res["audit_layers"]],
                ("layers", "unrolled s", "scan s", "saved KiB")),
        f"growth: unrolled ~ layers^{f['audit_unrolled_vs_layers_exponent']:.2f}, "
        f"scan ~ layers^{f['audit_scan_vs_layers_exponent']:.2f}",
        "",
        "plan_footprint(...) vs candidate tags (synthetic additive footprint, median of 3 seeds)",
        C.table([(r["tags"], r["method"], f"{r['ms']:.3f}",
                  "-" if r["max_relative_gap_to_brute_force"] is None
                  else f"{r['max_relative_gap_to_brute_force']:.1e}")
                 for r in res["plan_tags"]],
                ("tags", "method", "ms", "gap to brute force")),
        f"growth: enumeration x{f['enumeration_factor_per_tag']:.2f} per tag; branch and bound "
        f"x{f['branch_and_bound_factor_per_tag']:.2f} per tag (~ tags^"
        f"{f['branch_and_bound_exponent']:.2f})",
        "",
        "traced_footprint() and plan() on it (joint, exact; targets: footprint < 3 s at 9 "
        "tags, < 10 s at 16; plan < 50 ms at 9 tags)",
        C.table([(r["tags"], f"h={r['size']['hidden']} seq={r['size']['seq']}", r["ops"],
                  f"{r['footprint_s']:.3f}", f"{r['plan_first_ms']:.1f}",
                  f"{r['plan_warm_ms']:.2f}") for r in res["traced"]],
                ("tags", "layer", "graph ops", "footprint s", "first plan ms",
                 "warm plan ms")),
    ]
    return "\n".join(lines)


def build_parser() -> Any:
    p = C.parser(__doc__.splitlines()[0], NAME)
    p.add_argument("--max-audit-layers", type=int, default=160,
                   help="cap on the audited stack (default 160)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    say = C.Printer(args.quiet)
    t0 = time.perf_counter()
    size = C.SIZES["small" if args.small else "default"]
    if args.small:
        layers, audit_layers, tags = (8, 32, 80, 160), (2, 4), (4, 8, 12, 14, 18)
        reps, audit_reps, check = 5, 1, 14
    else:
        layers, tags = (8, 32, 80, 160), tuple(range(4, 25, 2)) + (13,)
        audit_layers = tuple(n for n in (8, 32, 80, 160) if n <= args.max_audit_layers)
        reps, audit_reps, check = 20, 1, 20
    res: dict[str, Any] = {
        "plan_layers": plan_vs_layers(layers, reps),
        "audit_layers": audit_vs_layers(audit_layers, audit_reps),
        "plan_tags": plan_vs_tags(sorted(tags), reps if args.small else 5, check),
        "audit_layer_size": TINY.to_dict(),
        "traced": traced_speed([(9, size), (16, size)], 1 if args.small else 3),
    }
    res["fits"] = fits(res)
    res["seconds"] = time.perf_counter() - t0
    return C.finish(args, NAME, res, report(res), say)


if __name__ == "__main__":
    main()
