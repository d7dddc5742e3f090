"""Planner accuracy: the analytic model (`layer_graph`) against what JAX and XLA measure.

For every policy of the frontier run (and every compiled tag subset): predicted saved bytes
per layer over JAX's saved-residual bytes, predicted recompute FLOPs over compiled
``flops(policy) - flops(no remat)``, and the compiled temp-bytes slope per layer over the
saved bytes. JAX's ``dots_saveable`` policies are predicted with
``graph.evaluate(lambda v: v.dot)`` and ``... v.dot and not v.batch_dot``; planner rows use
the planner's own figures (for the traced planner, the traced footprint's additive sums).

The frontier's fused q/k/v layer is planned from its traced footprint alone: its predicted
bytes and recompute FLOPs (the traced graph, evaluated jointly) are compared the same way,
per policy and over its compiled subsets.

Reads a frontier JSON (``--from out/frontier.json``) or runs the frontier measurement.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

NAME = "accuracy"


def _ratio(pred: float, meas: float) -> float | None:
    return pred / meas if meas else None


def analyse(frontier: dict[str, Any]) -> dict[str, Any]:
    """Ratios per policy and their spread over the compiled subsets."""
    rows = []
    for r in frontier["policies"]:
        rows.append({
            "name": r["name"], "group": r["group"],
            "saved_bytes": r["saved_bytes"], "predicted_bytes": r["predicted_bytes"],
            "bytes_ratio": _ratio(r["predicted_bytes"], r["saved_bytes"]),
            "recompute_flops": r["recompute_flops"],
            "predicted_recompute_flops": r["predicted_recompute_flops"],
            "flops_ratio": _ratio(r["predicted_recompute_flops"], r["recompute_flops"]),
            "flops_error_of_step": (r["predicted_recompute_flops"] - r["recompute_flops"])
            / frontier["no_remat_flops"],
            "temp_slope_bytes": r["temp_slope_bytes"],
            "temp_slope_ratio": _ratio(r["temp_slope_bytes"], r["saved_bytes"]),
        })
    subs = frontier["subsets"]
    b_ratios = [s["predicted_bytes"] / s["saved_bytes"] for s in subs]
    f_errors = [abs(s["predicted_recompute_flops"] - s["recompute_flops"])
                / frontier["no_remat_flops"] for s in subs if s["recompute_flops"] is not None]
    f_ratios = [s["predicted_recompute_flops"] / s["recompute_flops"] for s in subs
                if s["recompute_flops"]]
    hand = [r for r in rows if r["group"] not in ("planner", "planner-traced")]
    checkpointed = [r for r in rows if r["flops_ratio"] is not None]

    def spread(values: Sequence[float]) -> dict[str, float] | None:
        if not values:
            return None
        return {"min": min(values), "median": statistics.median(values), "max": max(values),
                "max_abs_error": max(abs(v - 1) for v in values)}

    base = frontier["no_remat_flops"]
    step_pred = 3 * frontier["forward_flops_predicted"]
    fused = None
    if frontier.get("fused"):
        fz = frontier["fused"]
        measured = [r for r in fz["policies"] + fz["subsets"]
                    if r["recompute_flops"] is not None and r["tags"] is not None]
        fused = {
            "rows": [{"name": r["name"], "predicted_bytes": r["predicted_bytes"],
                      "saved_bytes": r["saved_bytes"],
                      "predicted_recompute_flops": r["predicted_recompute_flops"],
                      "recompute_flops": r["recompute_flops"],
                      "flops_ratio": _ratio(r["predicted_recompute_flops"],
                                            r["recompute_flops"])}
                     for r in fz["policies"]],
            "subsets": len(fz["subsets"]),
            "subsets_exact_bytes": sum(1 for x in fz["subsets"]
                                       if x["predicted_bytes"] == x["saved_bytes"]),
            "compiled": len(measured),
            "flops_ratio": spread([r["predicted_recompute_flops"] / r["recompute_flops"]
                                   for r in measured if r["recompute_flops"]]),
            "max_flops_error_of_step": max(
                (abs(r["predicted_recompute_flops"] - r["recompute_flops"])
                 / fz["no_remat_flops"] for r in measured), default=None),
        }
    return {
        "fused": fused,
        "size": frontier["size"], "policies": rows,
        "subsets_bytes_ratio": spread(b_ratios),
        "subsets_flops_ratio": spread(f_ratios), "subsets_compiled": len(f_ratios),
        "subsets_max_flops_error_of_step": max(f_errors, default=None),
        "subsets_exact_bytes": sum(1 for s in subs if s["predicted_bytes"] == s["saved_bytes"]),
        "subsets": len(subs),
        "policies_flops_ratio": spread([r["flops_ratio"] for r in checkpointed]),
        "hand_written_bytes_ratio": spread([r["bytes_ratio"] for r in hand]),
        "temp_slope_ratio": spread([r["temp_slope_ratio"] for r in rows
                                    if r["temp_slope_ratio"] is not None]),
        "step_flops": {"predicted_3x_forward": step_pred, "compiled_no_remat": base,
                       "ratio": step_pred / base},
    }


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def report(acc: dict[str, Any]) -> str:
    lines = ["Planner accuracy (predicted / measured, per layer)",
             C.table([(r["name"], C.kib(r["saved_bytes"]), _r(r["bytes_ratio"]),
                       f"{r['recompute_flops'] / 1e6:,.2f}", _r(r["flops_ratio"]),
                       f"{100 * r['flops_error_of_step']:+.3f}",
                       _r(r["temp_slope_ratio"])) for r in acc["policies"]],
                     ("policy", "saved KiB", "bytes pred/meas", "recompute MFLOP",
                      "FLOPs pred/meas", "error % of step", "temp slope/saved"))]
    sb, sf = acc["subsets_bytes_ratio"], acc["subsets_flops_ratio"]
    lines.append("")
    lines.append(f"all {acc['subsets']} tag subsets: predicted bytes exact for "
                 f"{acc['subsets_exact_bytes']} (ratio {sb['min']:.4f}..{sb['max']:.4f})")
    if sf:
        lines.append(f"{acc['subsets_compiled']} compiled subsets: recompute FLOPs pred/meas "
                     f"{sf['min']:.4f}..{sf['max']:.4f} (median {sf['median']:.4f}); error at "
                     f"most {100 * acc['subsets_max_flops_error_of_step']:.3f}% of the step")
    ts = acc["temp_slope_ratio"]
    lines.append(f"compiled temp slope / saved bytes: {ts['min']:.4f}..{ts['max']:.4f} "
                 f"(median {ts['median']:.4f})")
    fz = acc.get("fused")
    if fz:
        lines += ["", "Fused q/k/v layer, traced footprint (predicted / measured, per layer)",
                  C.table([(r["name"], C.kib(r["saved_bytes"]),
                            _r(r["predicted_bytes"] / r["saved_bytes"]),
                            f"{r['recompute_flops'] / 1e6:,.3f}", _r(r["flops_ratio"]))
                           for r in fz["rows"]],
                          ("policy", "saved KiB", "bytes pred/meas", "recompute MFLOP",
                           "FLOPs pred/meas")),
                  f"all {fz['subsets']} tag subsets: predicted bytes exact for "
                  f"{fz['subsets_exact_bytes']}"]
        if fz["flops_ratio"]:
            fr_ = fz["flops_ratio"]
            lines.append(f"{fz['compiled']} compiled policies and subsets: recompute FLOPs "
                         f"pred/meas {fr_['min']:.4f}..{fr_['max']:.4f} (median "
                         f"{fr_['median']:.4f}); error at most "
                         f"{100 * fz['max_flops_error_of_step']:.3f}% of the step")
    st = acc["step_flops"]
    lines.append(f"no-remat step: 3 x predicted forward {st['predicted_3x_forward'] / 1e6:,.1f} "
                 f"MFLOP vs compiled {st['compiled_no_remat'] / 1e6:,.1f} MFLOP "
                 f"(ratio {st['ratio']:.4f})")
    return "\n".join(lines)


def build_parser() -> Any:
    p = C.parser(__doc__.splitlines()[0], NAME)
    p.add_argument("--from", dest="source", type=Path, default=None,
                   help="a frontier JSON to analyse (default: run the frontier measurement)")
    return p


def main(argv: Sequence[str] | None = None, frontier: dict[str, Any] | None = None
         ) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    say = C.Printer(args.quiet)
    if frontier is None:
        if args.source is not None:
            frontier = json.loads(args.source.read_text())
        else:
            import frontier as fr  # noqa: PLC0415

            fargs = ["--quiet", "--out", str(args.out)] + (["--small"] if args.small else [])
            frontier = fr.main(fargs)
    acc = analyse(frontier)
    return C.finish(args, NAME, acc, report(acc), say)


if __name__ == "__main__":
    main()
