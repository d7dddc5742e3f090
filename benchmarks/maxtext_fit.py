"""`fit` on MaxText 0.2.5's real training step, against the compiled brute force.

Runs where MaxText imports (Python >= 3.12; build the environment with
.ci/maxtext_env.sh, then ``/work/venvs/mt312/bin/python benchmarks/maxtext_fit.py``). The
step is tests/cpu/maxtext_zoo.py's: MaxText's own ``train_step`` (``models.Transformer``,
llama2 block, scanned layers, MaxText's cross entropy, AdamW, donated state) on a tiny
config, its remat policy set through neuron_remat's MaxText adapter. It is a held-out step:
nothing in `fit` was tuned on it.

1. the brute force: every subset of the `MAX_TAGS` (``--tags``) most useful tags MaxText emits, and no
   remat, compiled on XLA:CPU once (``--xla_backend_optimization_level=0``, as
   benchmarks/fit_sweep.py) and cached by save set in ``OUT/maxtext_brute/<step>.json``
   (delete it to recompile);
2. HBM sizes every 1% of the range from the smallest compiled step to 5% above no remat,
   one simulated core, no reserve; `fit` at each, its compiles served from the cache
   (counted all the same), with ``memory_analysis`` read and with the compile failure as
   the oracle (simulated, tests/cpu/zoo.py's `OomOracleSimulation`), and with
   ``--bare-oracle`` with that oracle's errors giving no byte figure;
3. per mode: whether each plan fits, the gap in points of step FLOPs to the best compiled
   set that fits, the gap distribution, refusals while some set fits, the compiles.

``--small``: three tags, ten sizes. ``--spare``: as benchmarks/axlearn_fit.py's.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

NAME = "maxtext_fit"
MiB = 1 << 20
MAX_TAGS = 6
"""Tags in the brute force (2**6 sets and no remat, each compiled once)."""
BINS = ((0.0, "0"), (0.005, "<=0.5"), (0.01, "<=1"), (0.02, "<=2"), (float("inf"), ">2"))


def _gap_bins(gaps: Sequence[float]) -> dict[str, int]:
    out = {label: 0 for _, label in BINS}
    for g in gaps:
        for edge, label in BINS:
            if g <= edge + 1e-12:
                out[label] += 1
                break
    return out


def real_step_parser(description: str, name: str) -> Any:
    """The options of a sweep of a host library's real step: `_common.parser`'s, and
    ``--brute-only``, ``--tags``, ``--steps``, ``--max-compiles`` (fit_sweep.py's)."""
    import fit_sweep as FS  # noqa: PLC0415

    p = C.parser(description, name)
    p.add_argument("--brute-only", action="store_true", help="fill the cache and stop")
    p.add_argument("--tags", type=FS.tag_count, default=MAX_TAGS,
                   help=f"tags in the brute force (default {MAX_TAGS}, at most "
                        f"{FS.MAX_TAGS}; --small: 3)")
    p.add_argument("--steps", default=None,
                   help="comma-separated steps of the host's zoo module (default all)")
    p.add_argument("--max-compiles", type=FS.compile_budget, default=None, metavar="N",
                   help="give fit this compile budget (max_compiles=N, at least 3) instead "
                        "of its own, as fit_sweep.py's option")
    p.add_argument("--spare", action="store_true",
                   help="the brute force also covers each tag outside fit's pool (cached "
                        "apart), and fit runs without candidates, compiling those tags")
    p.add_argument("--host-devices", type=FS.device_count, default=None, metavar="N",
                   help="XLA:CPU makes N devices, for the zoo module's SHARDED steps (8)")
    p.add_argument("--bare-oracle", action="store_true", help=FS.BARE_HELP)
    p.add_argument("--retry", type=FS.retry_count, default=None, metavar="K",
                   help=FS.RETRY_HELP)
    p.add_argument("--publish", action="store_true", help=FS.PUBLISH_HELP)
    p.add_argument("--no-tables", action="store_true", help=FS.NO_TABLES_HELP)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = real_step_parser(__doc__.splitlines()[0], NAME).parse_args(argv)
    say = C.Printer(args.quiet)
    if args.host_devices:
        C.host_devices(args.host_devices)
    C.prepare_compiles()
    sys.path.insert(0, str(C.REPO / "tests" / "cpu"))
    import maxtext_zoo as mz  # noqa: PLC0415

    why = mz.available()
    if why is not None:
        raise SystemExit(f"maxtext_fit: {why}; build the environment with "
                         ".ci/maxtext_env.sh and run this script with its python")
    F = importlib.import_module("neuron_remat._fit")
    logging.getLogger("neuron_remat.fit").setLevel(logging.ERROR)
    max_tags, n_sizes = (3, 10) if args.small else (args.tags, 100)
    result: dict[str, Any] = {"maxtext": mz.MAXTEXT_VERSION, "max_tags": max_tags,
                              "max_compiles": args.max_compiles, "steps": {}}
    lines: list[str] = []
    steps = {**mz.STEPS, **mz.SHARDED}
    names = list(mz.STEPS) if args.steps is None else args.steps.split(",")
    unknown = [n for n in names if n not in steps]
    if unknown:
        raise SystemExit(f"maxtext_fit: --steps: no step {unknown[0]!r} in "
                         f"tests/cpu/maxtext_zoo.py; valid: {', '.join(steps)}")
    for name in names:
        spec = steps[name]
        graph = F.step_graph(spec.make_step(), *spec.abstract_args())
        step, more = sweep_real_step(name, spec, graph, "MaxText", mz.MAXTEXT_VERSION,
                                     args.out / "maxtext_brute", max_tags, n_sizes,
                                     args.max_compiles, args.brute_only, say, args.spare,
                                     args.bare_oracle, args.publish, not args.no_tables,
                                     args.retry)
        lines += more
        if step is not None:
            result["steps"][name] = step
    return C.finish(args, NAME, result, "\n".join(lines), say)


def sweep_real_step(name: str, spec: Any, graph: Any, host: str, version: str,
                    brute_dir: Path, max_tags: int, n_sizes: int, max_compiles: int | None,
                    brute_only: bool, say: Any, spare: bool = False, bare: bool = False,
                    publish: bool = False, tables: bool = True, retry: int | None = None
                    ) -> tuple[dict[str, Any] | None, list[str]]:
    """One step of a host library's real code (MaxText's, axlearn's; `graph` its
    `step_graph`): the brute force over its `max_tags` most useful tags, cached in
    `brute_dir`, then `fit` at `n_sizes` + 1 sizes in both modes (fit_sweep's sweep; with
    `bare`, ``--bare-oracle``'s, in three). Its JSON (None with `brute_only`) and its report
    lines. With `spare`, the brute force also covers every tag outside the pool
    (``<step>+spare.json``; the pool must be whole) and `fit` runs without ``candidates``,
    so that it can compile those tags (`_Search.spare`). With `publish`, the filled cache
    becomes the step's committed table (``--publish``, `fit_sweep.Brute.publish`); without
    `tables` the cache does not start from one (``--no-tables``). With `retry`, fit_sweep's
    ``--retry``."""
    import fit_sweep as FS  # noqa: PLC0415
    import zoo  # noqa: PLC0415

    F = importlib.import_module("neuron_remat._fit")
    SG = importlib.import_module("neuron_remat._step")
    SR = importlib.import_module("neuron_remat._search")
    pool = own = SG._pool(graph, None)[:max_tags]  # noqa: SLF001
    path = brute_dir / f"{name}.json"
    if spare:
        pool, path = FS.with_spare(name, graph, pool), brute_dir / f"{name}+spare.json"
    say(f"{name}: {host} emits {', '.join(graph.tags)}; brute force over {', '.join(pool)}")
    brute = FS.Brute(spec, pool, path, tables)
    if brute.seeded:
        say(f"{name}: {brute.seeded} compiled sets from its committed table")
    seconds = brute.fill(say)
    if publish:
        say(brute.publish())
    if brute_only:
        return None, []
    full, none = brute.get(())["bytes"], brute.get(None)["bytes"]
    smallest = min(brute.get(s)["bytes"] for s in brute.sets())
    step: dict[str, Any] = {"note": getattr(spec, "note", ""), "tags": list(pool),
                            "emitted": list(graph.tags), "brute_seconds": seconds,
                            "full_remat_bytes": full, "no_remat_bytes": none,
                            "smallest_bytes": smallest,
                            "sets": {FS._key(s): brute.get(s) for s in brute.sets()},  # noqa: SLF001
                            "modes": {}}
    sizes = FS._sizes(brute, n_sizes)  # noqa: SLF001
    n_front = len(SR._frontier(SR._candidates(graph, own)))  # noqa: SLF001 - fit's pool
    step["trace_ranking"] = FS.step_trace_ranking(brute, graph, sizes)
    lines = [f"{name} ({host} {version}): full remat {full / MiB:.2f} MiB, no remat "
             f"{none / MiB:.2f} MiB, smallest set {smallest / MiB:.2f} MiB; {len(sizes)} "
             f"sizes, tags {', '.join(pool)}",
             "  ranked by the trace, every set's compiled bytes known (the ranking alone): "
             + FS.trace_ranking_text(step["trace_ranking"])]
    for mode in FS.modes(bare):
        rows = FS.sweep_step(brute, mode, sizes, graph, F, zoo, max_compiles, spare, retry)
        summary = FS._summary(rows, n_front, mode != "memory_analysis")  # noqa: SLF001
        gaps = [r["gap"] for r in rows if r.get("gap") is not None]
        summary["gap_bins"] = _gap_bins(gaps)
        step["modes"][mode] = {"summary": summary, "rows": rows}
        lines += _report(mode, summary, rows)
        if why := FS.why_stopped(rows):
            lines.append(f"  {why}")
        summary["flagged"] = FS.flagged(rows)
        lines.append("  the plans that say a better set may fit: "
                     + FS.flagged_text(summary["flagged"]))
        lines.append("  the search's chances (compiles, mean chance given, share that fit): "
                     + FS.calibration_text(FS.calibration(rows)))
    return step, lines


def _report(mode: str, s: dict[str, Any], rows: Sequence[dict[str, Any]]) -> list[str]:
    pt = (lambda g: "-" if g is None else f"{100 * g:.2f}")
    out = [f"  fit with {mode}: {s['plans']} plans over {s['sizes']} sizes, every plan fits: "
           f"{'yes' if s['all_fit'] else 'NO'}, plans state their compile: "
           f"{'yes' if s['states_truth'] else 'NO'}, refusals while some set fits: "
           f"{s['refusals_while_some_fits']}, compiles median {s['compiles_median']:g} "
           f"max {s['compiles_max']} (cap {s['compile_cap']:.3g}, within it at "
           f"{100 * s['share_within_cap']:.0f}% of sizes)",
           "  gap to the best compiled set that fits (points of step FLOPs): median "
           f"{pt(s['gap_median'])}, p95 {pt(s['gap_p95'])}, max {pt(s['gap_max'])}; sizes "
           "by gap: " + ", ".join(f"{k}: {v}" for k, v in s["gap_bins"].items())]
    bad = [r for r in rows if r["outcome"] != "plan" or not r["fits"]
           or (r["gap"] or 0.0) > 0.005 + 1e-12]
    if bad:
        table = [(f"{r['hbm'] / MiB:.2f}", r["outcome"],
                  "-" if r.get("saved") is None else (",".join(r["saved"]) or "nothing"),
                  pt(r.get("overhead")), pt(r["best_overhead"]),
                  ("nothing fits" if r["best_overhead"] is None else "no remat")
                  if r["best"] is None else (",".join(r["best"]) or "nothing"),
                  r["compiles"]) for r in bad]
        out.append("  sizes where fit is off by more than 0.5 points, or refused:")
        out += ["    " + ln for ln in C.table(table, (
            "HBM MiB", "outcome", "plan saves", "plan %", "best %", "best saves",
            "compiles")).splitlines()]
    return out


if __name__ == "__main__":
    main()
