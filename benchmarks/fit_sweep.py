"""`fit` against brute force on the compiled step, with the analytic `plan` beside it.

The step is examples/fit_demo.py's decoder (scanned GQA/SwiGLU layers, AdamW inside the
jitted step, donated state) in its `SMALL` variant: eight layers, six tags, so all 64 save
sets (and no remat) are compiled on XLA:CPU once (the brute force). Then, at HBM sizes
spread from where nothing fits to where no remat does, for one simulated core with no
reserve:

* `fit`: its save set, its compiled bytes (``argument + output + temp - alias``), its
  recompute overhead (recompute FLOPs over the no-remat step's), the optimum's (the least
  compiled FLOPs among the save sets whose compiled bytes fit), the gap in points of step
  FLOPs (XLA counts the scan body once, so a compiled FLOP difference is one layer's:
  times the layer count), and the number of compiles;
* the analytic `plan` for the same model (`TransformerConfig` + `StepShape`), whose set is
  looked up in the brute force: its gap to the optimum, or how far over HBM it compiles,
  or that it refused.

It also measures the analytic model's error against every compiled program: compiled bytes
minus (state + kept activations of every layer + workspace), with the old constant
workspace (one no-remat layer or the logits) and with the per-policy one
(`memory_model.backward_working_set`), and times `fit` on the demo's default decoder
(`fit_demo.CONFIG`, eight tags) at one size (target: under 30 s).

``--small``: three tags (8 save sets), four sizes, no demo timing.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

NAME = "fit_sweep"
MiB = 1 << 20


def _measure(step: Any, args: Sequence[Any]) -> dict[str, float]:
    c = step.lower(*args).compile()
    m = c.memory_analysis()
    return {"bytes": m.argument_size_in_bytes + m.output_size_in_bytes
            + m.temp_size_in_bytes - m.alias_size_in_bytes,
            "flops": float(c.cost_analysis()["flops"])}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = C.parser(__doc__.splitlines()[0], NAME).parse_args(argv)
    say = C.Printer(args.quiet)
    import jax  # noqa: PLC0415
    from jax._src.ad_checkpoint import save_only_these_names  # noqa: PLC0415

    import neuron_remat as nr  # noqa: PLC0415
    from neuron_remat import memory_model as mm  # noqa: PLC0415

    F = importlib.import_module("neuron_remat.fit")
    sys.path.insert(0, str(C.REPO))
    from examples import fit_demo  # noqa: PLC0415

    config = fit_demo.SMALL
    if args.small:
        config = dataclasses.replace(config, layers=4, tags=dataclasses.replace(
            config.tags, k_proj=None, context=None, linear1_1=None))
    make_step = fit_demo.make_step_factory(config)
    step_args = fit_demo.abstract_args(config)
    graph = F.step_graph(make_step, *step_args)
    layers = graph.count

    t0 = time.perf_counter()
    brute: dict[tuple[str, ...] | None, dict[str, float]] = {
        None: _measure(make_step(jax.checkpoint_policies.everything_saveable), step_args)}
    for r in range(len(graph.tags) + 1):
        for subset in itertools.combinations(graph.tags, r):
            brute[subset] = _measure(make_step(save_only_these_names(*subset)), step_args)
    brute_s = time.perf_counter() - t0
    step_flops = graph.no_remat_flops

    def overhead(key: tuple[str, ...] | None) -> float:
        return layers * (brute[key]["flops"] - brute[None]["flops"]) / step_flops

    def canon(tags: Sequence[str]) -> tuple[str, ...]:
        return tuple(t for t in graph.tags if t in tags)

    subsets = sorted(v["bytes"] for k, v in brute.items() if k is not None)
    everything = brute[tuple(graph.tags)]["bytes"]
    lo = subsets[0]
    fractions = (0.05, 0.35, 0.65, 0.95) if args.small else (
        0.02, 0.12, 0.24, 0.36, 0.48, 0.6, 0.72, 0.84, 0.96)
    sizes = [lo - MiB] + [int(lo + (everything - lo) * f) for f in fractions] + (
        [] if args.small else [(everything + brute[None]["bytes"]) // 2,
                               brute[None]["bytes"] + MiB])

    shape = nr.StepShape(seq_len=fit_demo.SEQ, micro_batch=fit_demo.BATCH,
                         activation_dtype="float32", param_dtype="float32", optimizer="adamw")
    rows, entries = [], []
    for hbm in sizes:
        device = nr.parse_device(f"trn2.48xlarge:hbm={hbm}B:cores=1", source="benchmark")
        fits = [(v["flops"], -1 if k is None else len(k), k) for k, v in brute.items()
                if v["bytes"] <= hbm]
        best = min(fits, key=lambda f: (f[0], f[1])) if fits else None
        t = time.perf_counter()
        try:
            plan = nr.fit(make_step, *step_args, device=device, reserve=0)
        except nr.NoFitError:
            plan = None
        seconds = time.perf_counter() - t
        e: dict[str, Any] = {"hbm_bytes": hbm, "fit_seconds": seconds,
                             "optimum": None if best is None else {
                                 "saved": best[2], "overhead": overhead(best[2]),
                                 "bytes": brute[best[2]]["bytes"]}}
        if plan is not None:
            rec = plan.compiled
            key = None if rec.no_remat else canon(plan.saved_tags)
            e["fit"] = {"saved": key, "bytes": rec.bytes, "overhead": overhead(key),
                        "compiles": rec.compiles, "fits": rec.bytes <= hbm,
                        "gap": overhead(key) - overhead(best[2]) if best else None}
        else:
            e["fit"] = None
        try:
            ana = nr.plan(device, config, shape, nr.Parallelism(), reserve=0)
            akey = canon(ana.saved_tags)
            e["analytic"] = {"saved": akey, "bytes": brute[akey]["bytes"],
                             "fits": brute[akey]["bytes"] <= hbm, "overhead": overhead(akey),
                             "gap": (overhead(akey) - overhead(best[2]))
                             if best and brute[akey]["bytes"] <= hbm else None}
        except nr.NoFitError:
            e["analytic"] = None
        entries.append(e)

        def show(key: Any) -> str:
            return "no remat" if key is None else (",".join(key) or "nothing")

        f, a = e["fit"], e["analytic"]
        rows.append((
            f"{hbm / MiB:.1f}",
            "NoFitError" if f is None else show(f["saved"]),
            "-" if f is None else f"{f['bytes'] / MiB:.2f}",
            "-" if f is None else C.pct(f["overhead"]),
            "-" if best is None else C.pct(overhead(best[2])),
            "-" if f is None or f["gap"] is None else f"{100 * f['gap']:.2f}",
            "-" if f is None else f["compiles"],
            ("refused" if best is not None else "refused (right)") if a is None
            else (f"{100 * a['gap']:.2f}" if a["fits"]
                  else f"over by {(a['bytes'] - hbm) / MiB:.2f} MiB"),
            f"{seconds:.1f}"))
    table = C.table(rows, ("HBM MiB", "fit's set", "compiled MiB", "overhead", "optimum",
                           "gap pts", "compiles", "analytic gap pts", "fit s"))

    # The analytic model against every compiled program.
    par = nr.Parallelism()
    state = mm.model_state_bytes(config, shape, par).total_bytes
    lgraph = mm.layer_graph(config, shape, par)
    head = mm.head_bytes(config, shape, par)
    role_of = {config.tag(r): r for r in config.roles}
    old_ws = max(lgraph.no_remat_bytes(), head)
    errors: dict[str, list[float]] = {"constant": [], "per_policy": []}
    for key, v in brute.items():
        if key is None:
            continue
        roles = [role_of[t] for t in key]
        kept = lgraph.evaluate_roles(roles).kept_bytes * config.layers
        new_ws = max(mm.backward_working_set(lgraph, roles), head)
        errors["constant"].append((v["bytes"] - state - kept - old_ws) / MiB)
        errors["per_policy"].append((v["bytes"] - state - kept - new_ws) / MiB)
    fixed = {k: statistics.mean(x) for k, x in errors.items()}
    spread = {k: max(x) - min(x) for k, x in errors.items()}
    ws_table = C.table([(k, f"{min(x):.2f}", f"{max(x):.2f}", f"{fixed[k]:.2f}",
                         f"{spread[k]:.2f}") for k, x in errors.items()],
                       ("analytic workspace", "min miss MiB", "max miss MiB", "mean", "spread"))

    demo: dict[str, Any] | None = None
    if not args.small:
        dstep, dargs = fit_demo.factory()
        dev = nr.parse_device("trn2.48xlarge:hbm=32MiB:cores=1", source="benchmark")
        t = time.perf_counter()
        dplan = nr.fit(dstep, *dargs, device=dev, reserve=0)
        demo = {"seconds": time.perf_counter() - t, "compiles": dplan.compiled.compiles,
                "tags": len(F.step_graph(dstep, *dargs).tags), "saved": dplan.saved_tags,
                "bytes": dplan.compiled.bytes}

    gaps = [e["fit"]["gap"] for e in entries if e["fit"] and e["fit"]["gap"] is not None]
    result = {
        "config": dataclasses.asdict(config), "layers": layers, "tags": list(graph.tags),
        "brute_force_compiles": len(brute), "brute_force_seconds": brute_s,
        "step_flops": step_flops, "entries": entries,
        "fit_always_fits": all(e["fit"] is None or e["fit"]["fits"] for e in entries),
        "fit_refuses_only_when_nothing_fits": all(
            (e["fit"] is None) == (e["optimum"] is None) for e in entries),
        "fit_max_gap": max(gaps, default=0.0),
        "analytic_workspace_miss_mib": {k: {"min": min(x), "max": max(x), "mean": fixed[k],
                                            "spread": spread[k]} for k, x in errors.items()},
        "demo_fit": demo,
    }
    text = "\n".join([
        f"fit vs brute force ({len(brute)} compiles, {brute_s:.0f} s) on {config.name}: "
        f"{layers} scanned layers, tags {', '.join(graph.tags)}; one core, no reserve",
        table, "",
        "gap pts: points of step FLOPs above the best compiled save set that fits.",
        "analytic gap: the same for the analytic plan's set, compiled (or how far over).", "",
        f"analytic model vs the {len(brute) - 1} compiled save sets (compiled - state - kept - workspace):",
        ws_table] + ([] if demo is None else [
            "", f"fit on the demo decoder ({demo['tags']} tags, 32 MiB): {demo['seconds']:.1f} s"
            f", {demo['compiles']} compiles, saves {', '.join(demo['saved']) or 'nothing'}"]))
    return C.finish(args, NAME, result, text, say)


if __name__ == "__main__":
    main()
