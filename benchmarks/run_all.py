"""Run every benchmark with one command: ``python benchmarks/run_all.py [--small]``.

Runs, in one process, the frontier (`frontier.py`), the planner's accuracy on the same
measurements (`accuracy.py`), the package's overheads (`overheads.py`), how planning and
auditing scale (`scaling.py`), `fit` against brute force on compiled steps
(`fit_sweep.py`) and, where a CUDA GPU is present, real peak memory
(`gpu_peak_memory.py`, skipped with a message otherwise). Each writes its JSON (and the
frontier its PNG) under ``--out`` (default ``out/``); ``summary.json`` collects the headline
figures and how long each part took.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # for the GPU part

import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

NAME = "summary"


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The figures worth quoting, from each part's results."""
    out: dict[str, Any] = {}
    fr = results.get("frontier")
    if fr:
        out["frontier"] = [{
            "budget_bytes": e["budget_bytes"],
            "planner_overhead": (e.get("planner") or {}).get("overhead"),
            "optimum_overhead": (e.get("optimum") or {}).get("overhead"),
            "best_hand_written": e.get("best_hand_written"),
        } for e in fr["budgets"]]
        # A budget without its comparison is a failure, not a pass: the planner must be
        # there and within TIE of the exhaustive optimum (absent when not exhaustive).
        out["planner_matches_optimum"] = bool(fr["budgets"]) and all(
            "planner_minus_optimum" in e and e["planner_minus_optimum"] <= fr["tie"]
            for e in fr["budgets"])
        # No hand-written policy fitting a budget leaves nothing to compare there.
        out["planner_never_worse_than_hand_written"] = bool(fr["budgets"]) and all(
            "planner" in e and (e.get("best_hand_written") is None
                                or e["planner_minus_best_hand_written"] <= fr["tie"])
            for e in fr["budgets"])
        if fr.get("fused"):
            out["fused_against_regexes"] = fr["fused"]["against_regexes"]
    acc = results.get("accuracy")
    if acc:
        out["accuracy"] = {"subsets_bytes_ratio": acc["subsets_bytes_ratio"],
                           "subsets_flops_ratio": acc["subsets_flops_ratio"],
                           "temp_slope_ratio": acc["temp_slope_ratio"]}
    ov = results.get("overheads")
    if ov:
        out["overheads"] = {
            "import_ms": ov["import"]["neuron_remat_ms"],
            "plan_70b_ms": ov["plan"]["median_ms"],
            "detect_first_call_ms": ov["detect"]["default"]["first_call_fresh_process_ms"],
            "regex_trace_overhead": ov["trace"][0]["overhead"],
            "over_target": [t["what"] for t in ov.get("targets", []) if not t["met"]]}
    sc = results.get("scaling")
    if sc:
        out["scaling"] = sc["fits"]
        out["traced_speed"] = sc.get("traced")
    fs = results.get("fit_sweep")
    if fs:
        out["fit_sweep"] = {"always_fits": fs["fit_always_fits"],
                            "refuses_only_when_nothing_fits":
                                fs["fit_refuses_only_when_nothing_fits"],
                            "max_gap": fs["fit_max_gap"]}
    gpu = results.get("gpu_peak_memory")
    if gpu is not None:
        out["gpu_skipped"] = gpu.get("skipped", False)
    return out


def failures(summary: dict[str, Any], ran: Sequence[str]) -> list[str]:
    """What the run does not show: each claim that failed, or whose figure is missing (a
    missing figure is a failure, never a pass)."""
    out = []
    checks = {"frontier": ("planner_matches_optimum", "planner_never_worse_than_hand_written"),
              "fit_sweep": ("fit_sweep.always_fits", "fit_sweep.refuses_only_when_nothing_fits")}
    for part, keys in checks.items():
        if part not in ran:
            continue
        for key in keys:
            value: Any = summary
            for k in key.split("."):
                value = value.get(k) if isinstance(value, dict) else None
            if value is not True:
                out.append(f"{part}: {key} is {value!r}")
    if "frontier" in ran:
        against = summary.get("fused_against_regexes")
        if not against:
            out.append("frontier: the fused layer's comparison with the regexes is missing")
        for a in against or ():
            if not a["planner_overhead"] <= a["regex_overhead"] + summary["tie"]:
                out.append(f"frontier: planner worse than the {a['regex']} at its budget")
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = C.parser(__doc__.splitlines()[0], NAME)
    p.add_argument("--skip", default="", help="comma-separated parts to skip "
                   "(frontier, accuracy, overheads, scaling, fit_sweep, gpu_peak_memory)")
    args = p.parse_args(argv)
    import accuracy  # noqa: PLC0415
    import fit_sweep  # noqa: PLC0415
    import frontier  # noqa: PLC0415
    import gpu_peak_memory  # noqa: PLC0415
    import overheads  # noqa: PLC0415
    import scaling  # noqa: PLC0415

    say = C.Printer(args.quiet)
    skip = {s for s in args.skip.split(",") if s}
    common = ["--out", str(args.out)] + (["--small"] if args.small else []) + \
        (["--quiet"] if args.quiet else [])
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    t_all = time.perf_counter()
    parts = [("frontier", lambda: frontier.main(common)),
             ("accuracy", lambda: accuracy.main(common, frontier=results.get("frontier"))),
             ("overheads", lambda: overheads.main(common)),
             ("scaling", lambda: scaling.main(common)),
             ("fit_sweep", lambda: fit_sweep.main([*common, "--bare-oracle"])),
             ("gpu_peak_memory", lambda: gpu_peak_memory.main(common))]
    for name, run in parts:
        if name in skip or (name == "accuracy" and "frontier" in skip):
            continue
        say(f"\n=== {name} ===")
        t = time.perf_counter()
        results[name] = run()
        seconds[name] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t_all
    summary = {"small": args.small, "seconds": seconds, **headline(results)}
    if results.get("frontier"):
        summary["tie"] = results["frontier"]["tie"]
    summary["failures"] = failures(summary, list(results))
    path = C.write_json(C.json_path(args, NAME), summary)
    say("\n" + C.table([(k, f"{v:.1f} s") for k, v in seconds.items()], ("part", "time")))
    for line in summary["failures"]:
        print(f"FAILED {line}", file=sys.stderr)
    say(f"wrote {path}")
    return summary


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
