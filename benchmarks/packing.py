"""How much of the compiled bytes no per-tag model explains: the floor under `fit`'s misses.

Reads the brute force `fit_sweep.py` cached (``OUT/fit_brute/<step>.json``, every subset of
a step's tags compiled; nothing is compiled here) and, per step:

1. fits ``bytes(S) = c + a x kept(S) + b x read(S) + one effect per saved tag`` by least
   squares over every compiled save set, and prints the spread (standard deviation) and
   the largest of what is left, as a share of full remat's bytes: XLA's packing of that
   particular set, which no model of tags alone can learn. Beside it, what two richer
   shapes leave, fitted to every set (so with more freedom than `fit` ever has): one
   effect per pair of tags more, and the largest of `REGIMES` such additive models (a
   program's peak is the largest of the live bytes at each of its points, and saving a tag
   can move the peak to another point);
2. at each swept size where `fit` (from ``OUT/fit_sweep.json``) is more than 2 points from
   the best compiled set that fits, the sets that would have been within 2 points, each
   predicted from every *other* compiled set (the same least squares, that set left out),
   and how many spreads over the limit that prediction is.

A set that even every other compile predicts well over the limit can only be found by luck
or by compiling most sets.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

NAME = "packing"
MiB = 1 << 20


REGIMES = (2, 3)
"""The numbers of additive models whose largest is fitted (`max_of_linear`)."""


def pairwise(a: Any, tags: Sequence[str]) -> Any:
    """`a` (`_design`'s columns, the tags last) with one column per pair of tags."""
    import numpy as np  # noqa: PLC0415

    x = a[:, a.shape[1] - len(tags):]
    pairs = [x[:, i] * x[:, j] for i in range(len(tags)) for j in range(i + 1, len(tags))]
    return np.column_stack([a, *pairs]) if pairs else a


def max_of_linear(a: Any, y: Any, k: int, trials: int = 30, seed: int = 0) -> Any:
    """What is left of `y` by the largest of `k` least-squares fits over the columns of
    `a`: each set is given to the fit that predicts it highest, each fit refitted on its
    sets, until nothing moves (a local optimum; the best of `trials` random starts). A fit
    left with fewer sets than columns restarts from the one fit over all, perturbed."""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    whole = np.linalg.lstsq(a, y, rcond=None)[0]
    jitter = float(y.std()) or 1.0
    best = None
    for _ in range(trials):
        owner = rng.integers(0, k, len(y))
        for _ in range(100):
            coefs = [np.linalg.lstsq(a[owner == i], y[owner == i], rcond=None)[0]
                     if (owner == i).sum() >= a.shape[1]
                     else whole + rng.normal(0, jitter, a.shape[1]) for i in range(k)]
            pred = np.stack([a @ c for c in coefs], 1)
            moved = pred.argmax(1)
            if (moved == owner).all():
                break
            owner = moved
        left = y - pred.max(1)
        if best is None or left.std() < best.std():
            best = left
    return best


def _design(cands: Sequence[Any], tags: Sequence[str]) -> Any:
    import numpy as np  # noqa: PLC0415

    return np.column_stack([np.ones(len(cands)), [c.kept for c in cands],
                            [c.read for c in cands],
                            np.array([[t in c.saved for t in tags] for c in cands], float)])


def step_report(name: str, spec: Any, out: Path, sweep: dict[str, Any] | None) -> dict[str, Any]:
    import importlib  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    import fit_sweep as S  # noqa: PLC0415

    F = importlib.import_module("neuron_remat._fit")
    graph = F.step_graph(spec.make_step(), *spec.abstract_args())
    pool = F._pool(graph, None)[:min(S.MAX_TAGS, spec.extra.get("brute_tags", S.MAX_TAGS))]
    brute = S.Brute(spec, pool, out / "fit_brute" / f"{name}.json")
    k = brute.complete_prefix()
    if k < 1:
        return {"skipped": "no complete brute force cached"}
    pool = pool[:k]
    brute = S.Brute(spec, pool, brute.path)
    cands = [c for c in F._candidates(graph, pool) if c.saved is not None]
    y = np.array([brute.get(c.saved)["bytes"] for c in cands], float)
    a = _design(cands, pool)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    left = y - a @ coef
    full = float(brute.get(())["bytes"])
    result: dict[str, Any] = {"tags": list(pool), "sets": len(cands),
                              "spread_share": float(left.std() / full),
                              "largest_share": float(np.abs(left).max() / full),
                              "misses": []}
    wide = pairwise(a, pool)
    shapes = {"pairs": y - wide @ np.linalg.lstsq(wide, y, rcond=None)[0]}
    tagged = a[:, [0, *range(a.shape[1] - len(pool), a.shape[1])]]  # intercept, tags
    shapes.update({f"max_of_{k}": max_of_linear(tagged, y, k) for k in REGIMES})
    result["richer"] = {n: {"spread_share": float(r.std() / full),
                            "largest_share": float(np.abs(r).max() / full)}
                        for n, r in shapes.items()}
    rows = ((sweep or {}).get(name) or {}).get("modes", {}).get("memory_analysis", {}).get(
        "rows", [])
    per = graph.count if getattr(spec, "scan", True) else 1
    base, f0 = graph.no_remat_flops, brute.get(None)["flops"]
    points = {c.saved: 100 * per * (brute.get(c.saved)["flops"] - f0) / base for c in cands}
    for row in rows:
        if (row.get("gap") or 0.0) <= 0.02:
            continue
        limit = row["hbm"]
        fitting = [c for c in cands if brute.get(c.saved)["bytes"] <= limit]
        best = min(points[c.saved] for c in fitting)
        near = []
        for c in (c for c in fitting if points[c.saved] <= best + 2):
            i = cands.index(c)
            keep = np.ones(len(cands), bool)
            keep[i] = False
            cf, *_ = np.linalg.lstsq(a[keep], y[keep], rcond=None)
            spread = float((y[keep] - a[keep] @ cf).std())
            predicted = float(a[i] @ cf)
            near.append({"saved": list(c.saved), "points": points[c.saved],
                         "compiled": float(y[i]), "predicted_from_the_others": predicted,
                         "spreads_over_the_limit": (predicted - limit) / spread})
        result["misses"].append({"hbm": limit, "gap": 100 * row["gap"], "within_2": near})
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = C.parser(__doc__.splitlines()[0], NAME)
    p.add_argument("--steps", default=None, help="comma-separated zoo steps (default all)")
    args = p.parse_args(argv)
    say = C.Printer(args.quiet)
    import fit_sweep as S  # noqa: PLC0415

    zoo = S._zoo()
    names = list(zoo.ZOO) if args.steps is None else args.steps.split(",")
    path = args.out / "fit_sweep.json"
    sweep = json.loads(path.read_text())["steps"] if path.exists() else None
    result: dict[str, Any] = {"steps": {}}
    lines = []
    for name in names:
        if name not in zoo.ZOO:
            raise SystemExit(f"packing: --steps {name}: no such step; known: "
                             f"{', '.join(zoo.ZOO)}")
        r = step_report(name, zoo.ZOO[name], args.out, sweep)
        result["steps"][name] = r
        if "skipped" in r:
            lines.append(f"{name}: skipped ({r['skipped']})")
            continue
        lines.append(f"{name}: {r['sets']} sets, {len(r['tags'])} tags: left by one effect "
                     f"per tag: spread {100 * r['spread_share']:.2f}%, largest "
                     f"{100 * r['largest_share']:.2f}% of full remat's bytes")
        lines.append("  left by richer shapes (spread / largest): " + "; ".join(
            f"{n.replace('_', ' ')}: {100 * v['spread_share']:.2f}% / "
            f"{100 * v['largest_share']:.2f}%" for n, v in r["richer"].items()))
        for m in r["misses"]:
            lines.append(f"  fit misses by {m['gap']:.2f} pt at {m['hbm'] / MiB:.2f} MiB; "
                         "within 2 pt of the best:")
            for n in m["within_2"]:
                lines.append(f"    {','.join(n['saved'])}: {n['points']:.2f}%, compiled "
                             f"{n['compiled'] / MiB:.3f} MiB, predicted from the others "
                             f"{n['predicted_from_the_others'] / MiB:.3f} "
                             f"({n['spreads_over_the_limit']:+.1f} spreads over the limit)")
    if sweep is None:
        lines.append(f"(no {path}: run benchmarks/fit_sweep.py first for the misses)")
    return C.finish(args, NAME, result, "\n".join(lines), say)


if __name__ == "__main__":
    main()
