"""How much of the compiled bytes no per-tag model explains: the floor under `fit`'s misses.

Reads the brute force `fit_sweep.py` cached (``OUT/fit_brute/<step>.json``, every subset of
a step's tags compiled; nothing is compiled here) and, per step:

1. fits ``bytes(S) = c + a x kept(S) + b x read(S) + one effect per saved tag`` (bytes as the
   backend stores them, as `fit` counts them) by least squares over every compiled save
   set, and prints the spread (standard deviation) and
   the largest of what is left, as a share of full remat's bytes: XLA's packing of that
   particular set, which no model of tags alone can learn. Beside it, what two richer
   shapes leave, fitted to every set (so with more freedom than `fit` ever has): one
   effect per pair of tags more, and the largest of `REGIMES` such additive models (a
   program's peak is the largest of the live bytes at each of its points, and saving a tag
   can move the peak to another point);
2. at each swept size where `fit` (from ``OUT/fit_sweep.json``, with memory figures and
   with the compile as the oracle) is more than 2 points from the best compiled set that
   fits, the sets that would have been within 2 points, each predicted from every *other*
   compiled set by each shape (one effect per tag, per pair, the largest of 3 additive
   models; that set left out), and at how many such sizes some such set is predicted
   within the limit;
3. how well one effect per tag, and one per pair, fitted to 6, 12 or 24 compiled sets
   (`learning_curve`), predict the others: what a search with that many compiles could
   learn of each shape.

A set that even every other compile predicts over the limit can only be found by luck or
by compiling most sets; `fit` has at most a handful of compiles to learn a shape from.
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


def _by_model(a: Any, coefs: Sequence[Any]) -> Any:
    """Each additive model's prediction of each row of `a`, one model per last-axis entry
    (the largest is ``.max(-1)``)."""
    import numpy as np  # noqa: PLC0415

    return np.stack([a @ c for c in coefs], -1)


def max_of_linear_fit(a: Any, y: Any, k: int, trials: int = 30, seed: int = 0) -> list[Any]:
    """The coefficients of `k` least-squares fits over the columns of `a` whose largest
    best follows `y`: each set is given to the fit that predicts it highest, each fit
    refitted on its sets, until nothing moves (a local optimum; the best of `trials`
    random starts). A fit left with fewer sets than columns restarts from the one fit over
    all, perturbed, and is dropped at the end (so fewer than `k` may come back)."""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    whole = np.linalg.lstsq(a, y, rcond=None)[0]
    jitter = float(y.std()) or 1.0
    best, best_sd = None, np.inf
    for _ in range(trials):
        owner = rng.integers(0, k, len(y))
        for _ in range(100):
            coefs = [np.linalg.lstsq(a[owner == i], y[owner == i], rcond=None)[0]
                     if (owner == i).sum() >= a.shape[1]
                     else whole + rng.normal(0, jitter, a.shape[1]) for i in range(k)]
            moved = _by_model(a, coefs).argmax(-1)
            if (moved == owner).all():
                break
            owner = moved
        # a model counts only where the sets it owns determine it: one that owns fewer
        # sets than it has coefficients could predict anything at a set left out
        kept = [c for i, c in enumerate(coefs) if (owner == i).sum() >= a.shape[1]] or [whole]
        sd = float((y - _by_model(a, kept).max(-1)).std())
        if sd < best_sd:
            best, best_sd = kept, sd
    assert best is not None
    return best


def max_of_linear(a: Any, y: Any, k: int, trials: int = 30, seed: int = 0) -> Any:
    """What is left of `y` by the largest of `k` additive models (`max_of_linear_fit`)."""
    return y - _by_model(a, max_of_linear_fit(a, y, k, trials, seed)).max(-1)


def predicted_from_the_others(shape: str, a: Any, y: Any, i: int) -> float:
    """Row `i`'s bytes as `shape` predicts them when fitted to every other row of `a`
    (`y`): "tags" one effect per tag (`a` as `_design` builds it), "pairs" (`a` as
    `pairwise` widens it), or "max_of_K" (`a`: the intercept and tag columns)."""
    import numpy as np  # noqa: PLC0415

    keep = np.arange(len(y)) != i
    if shape.startswith("max_of_"):
        coefs = max_of_linear_fit(a[keep], y[keep], int(shape.rsplit("_", 1)[1]))
        return float(_by_model(a[i], coefs).max(-1))
    return float(a[i] @ np.linalg.lstsq(a[keep], y[keep], rcond=None)[0])


LEARN_FROM = (6, 12, 24)
"""The numbers of compiled sets each shape is fitted to in `learning_curve`."""
DRAWS = 20
"""Random draws of those sets per number."""


def learning_curve(designs: dict[str, Any], y: Any, always: Sequence[int], full: float,
                   seed: int = 0) -> dict[str, dict[int, float]]:
    """How well each shape predicts the sets it was not fitted to, from few compiles: for
    each n in `LEARN_FROM` below the table's size, `DRAWS` times, fit each design to the
    rows in `always` (full remat and every tag, which `fit` compiles first) and n - 2 more
    drawn at random, and take the root-mean-square error on the other rows as a share of
    `full`; the median over the draws. Least squares (the least-norm solution where the
    rows are fewer than the coefficients). (The largest of K additive models is left out:
    from a few sets its fit is a local optimum that moves with the draw.)"""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    rest = [i for i in range(len(y)) if i not in always]
    out: dict[str, dict[int, float]] = {shape: {} for shape in designs}
    for n in LEARN_FROM:
        if n >= len(y) - 2:
            continue
        errs: dict[str, list[float]] = {shape: [] for shape in designs}
        for _ in range(DRAWS):
            pick = [*always, *rng.choice(rest, n - len(always), replace=False)]
            test = np.setdiff1d(np.arange(len(y)), pick)
            for shape, d in designs.items():
                pred = d[test] @ np.linalg.lstsq(d[pick], y[pick], rcond=None)[0]
                errs[shape].append(float(np.sqrt(np.mean((pred - y[test]) ** 2))) / full)
        for shape, e in errs.items():
            out[shape][n] = float(np.median(e))
    return out


def _design(cands: Sequence[Any], tags: Sequence[str]) -> Any:
    import numpy as np  # noqa: PLC0415

    return np.column_stack([np.ones(len(cands)), [c.stored for c in cands],
                            [c.read for c in cands],
                            np.array([[t in c.saved for t in tags] for c in cands], float)])


def step_report(name: str, spec: Any, out: Path, sweep: dict[str, Any] | None) -> dict[str, Any]:
    """The report for one zoo step, from `fit_sweep.py`'s cached brute force and sweep."""
    import importlib  # noqa: PLC0415

    import fit_sweep as S  # noqa: PLC0415

    F = importlib.import_module("neuron_remat._fit")
    SG = importlib.import_module("neuron_remat._step")
    graph = F.step_graph(spec.make_step(), *spec.abstract_args())
    pool = SG._pool(graph, None)[:min(S.MAX_TAGS, spec.extra.get("brute_tags", S.MAX_TAGS))]
    brute = S.Brute(spec, pool, out / "fit_brute" / f"{name}.json")
    k = brute.complete_prefix()
    if k < 1:
        return {"skipped": "no complete brute force cached"}
    pool = pool[:k]
    brute = S.Brute(spec, pool, brute.path)
    modes = ((sweep or {}).get(name) or {}).get("modes", {})
    return analyse(graph, pool, brute.get, modes, S.flops_share(graph, spec))


def maxtext_report(out: Path) -> tuple[str, dict[str, Any]]:
    """`step_report` for MaxText's real step (its name, its report), from `maxtext_fit.py`'s
    JSON (its brute force and both sweeps); run with the MaxText environment's python
    (.ci/maxtext_env.sh)."""
    import importlib  # noqa: PLC0415

    sys.path.insert(0, str(C.REPO / "tests" / "cpu"))
    import fit_sweep as S  # noqa: PLC0415
    import maxtext_zoo as mz  # noqa: PLC0415

    why = mz.available()
    if why is not None:
        raise SystemExit(f"packing: --maxtext: {why}; build the environment with "
                         ".ci/maxtext_env.sh and run this script with its python")
    path = out / "maxtext_fit.json"
    if not path.exists():
        raise SystemExit(f"packing: --maxtext: no {path}; run benchmarks/maxtext_fit.py "
                         "with the same --out first")
    F = importlib.import_module("neuron_remat._fit")
    name, spec = next(iter(mz.STEPS.items()))
    steps = json.loads(path.read_text())["steps"]
    if name not in steps:
        raise SystemExit(f"packing: --maxtext: {path} has no {name} (it has "
                         f"{', '.join(steps) or 'no step'}); run benchmarks/maxtext_fit.py "
                         f"--steps {name} with the same --out first")
    step = steps[name]
    graph = F.step_graph(spec.make_step(), *spec.abstract_args())
    sets = step["sets"]
    return name, analyse(graph, step["tags"], lambda saved: sets[S._key(saved)],
                         step["modes"], S.flops_share(graph, spec))


def analyse(graph: Any, pool: Sequence[str], row_of: Any, modes: dict[str, Any],
            share: float) -> dict[str, Any]:
    """The report for one step: `row_of(saved)` is a compiled set's brute-force row (bytes,
    flops; None: no remat), `modes` the sweep's rows by mode, `share` one compiled FLOP as
    a share of the no-remat step's (`fit_sweep.flops_share`)."""
    import importlib  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    SR = importlib.import_module("neuron_remat._search")
    cands = [c for c in SR._candidates(graph, pool) if c.saved is not None]
    y = np.array([row_of(c.saved)["bytes"] for c in cands], float)
    a = _design(cands, pool)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    left = y - a @ coef
    full = float(row_of(())["bytes"])
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
    # the candidates come least recompute first: every tag saved, then the others
    full_i, every_i = next(i for i, c in enumerate(cands) if not c.saved), 0
    result["learned"] = learning_curve(
        {"tags": a, "pairs": wide}, y, (full_i, every_i), full)
    f0 = row_of(None)["flops"]
    points = {c.saved: 100 * share * (row_of(c.saved)["flops"] - f0) for c in cands}
    designs = {"tags": a, "pairs": wide, f"max_of_{REGIMES[-1]}": tagged}
    memo: dict[tuple[str, int], float] = {}
    for mode in ("memory_analysis", "oracle"):
        for row in modes.get(mode, {}).get("rows", []):
            if (row.get("gap") or 0.0) <= 0.02:
                continue
            limit = row["hbm"]
            fitting = [c for c in cands if row_of(c.saved)["bytes"] <= limit]
            best = min(points[c.saved] for c in fitting)
            margin = limit - min(row_of(c.saved)["bytes"] for c in fitting
                                 if points[c.saved] == best)
            near = []
            for c in (c for c in fitting if points[c.saved] <= best + 2):
                i = cands.index(c)
                for shape, d in designs.items():
                    if (shape, i) not in memo:
                        memo[shape, i] = predicted_from_the_others(shape, d, y, i)
                alone = {}
                for t in c.saved:  # each tag of the set saved alone, as "tags" sees it
                    j = next(j for j, o in enumerate(cands) if o.saved == (t,))
                    if ("tags", j) not in memo:
                        memo["tags", j] = predicted_from_the_others("tags", a, y, j)
                    alone[t] = float(y[j] - memo["tags", j])
                near.append({"saved": list(c.saved), "points": points[c.saved],
                             "compiled": float(y[i]),
                             "predicted_from_the_others": {
                                 shape: memo[shape, i] for shape in designs},
                             "alone_above_tags": alone})
            result["misses"].append({"mode": mode, "hbm": limit, "gap": 100 * row["gap"],
                                     "best_margin_share": margin / full, "within_2": near})
    result["misses_found_by"] = {
        shape: sum(any(n["predicted_from_the_others"][shape] <= m["hbm"]
                       for n in m["within_2"]) for m in result["misses"])
        for shape in designs}
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = C.parser(__doc__.splitlines()[0], NAME)
    p.add_argument("--steps", default=None, help="comma-separated zoo steps (default all)")
    p.add_argument("--maxtext", action="store_true",
                   help="MaxText's real step instead of the zoo, from OUT/maxtext_fit.json "
                        "(the MaxText environment's python)")
    args = p.parse_args(argv)
    if args.maxtext and args.steps is not None:
        p.error(f"--steps {args.steps} with --maxtext: the zoo's steps or MaxText's, not both")
    say = C.Printer(args.quiet)
    import fit_sweep as S  # noqa: PLC0415

    zoo = S._zoo()
    names = list(zoo.ZOO) if args.steps is None else args.steps.split(",")
    for name in names:
        if name not in zoo.ZOO:
            raise SystemExit(f"packing: --steps {name}: no such step; known: "
                             f"{', '.join(zoo.ZOO)}")
    path = args.out / "fit_sweep.json"
    sweep = json.loads(path.read_text())["steps"] if path.exists() else None
    reports = iter([maxtext_report(args.out)] if args.maxtext else (
        (name, step_report(name, zoo.ZOO[name], args.out, sweep)) for name in names))
    result: dict[str, Any] = {"steps": {}}
    lines = []
    for name, r in reports:
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
        lines.append("  learned from n compiles, error on the other sets (RMS, median of "
                     f"{DRAWS} draws): " + "; ".join(
                         f"{shape.replace('_', ' ')} " + ", ".join(
                             f"n={n}: {100 * v:.2f}%" for n, v in curve.items())
                         for shape, curve in r["learned"].items() if curve))
        for m in r["misses"]:
            lines.append(f"  {m['mode']}: fit misses by {m['gap']:.2f} pt at "
                         f"{m['hbm'] / MiB:.2f} MiB (the best set fits by "
                         f"{100 * m['best_margin_share']:.2f}% of full remat's bytes); within "
                         "2 pt of the best, compiled and as each shape fitted to every other "
                         "set predicts it (MiB):")
            for n in m["within_2"]:
                lines.append(f"    {','.join(n['saved'])} ({n['points']:.2f}%): "
                             f"{n['compiled'] / MiB:.3f}; " + ", ".join(
                                 f"{shape.replace('_', ' ')} {v / MiB:.3f}"
                                 + ("" if v <= m["hbm"] else " (over)")
                                 for shape, v in n["predicted_from_the_others"].items()))
                if len(n["saved"]) > 1:
                    lines.append("      compiled above what one effect per tag predicts from "
                                 "every other set: " + ", ".join(
                                     f"{t} alone {v / MiB:+.2f}"
                                     for t, v in n["alone_above_tags"].items())
                                 + f", together {(n['compiled'] - n['predicted_from_the_others']['tags']) / MiB:+.2f} MiB")
        if r["misses"]:
            lines.append(f"  of {len(r['misses'])} misses over 2 pt, some set within 2 pt "
                         "is predicted within the limit from every other set by: " + ", ".join(
                             f"{shape.replace('_', ' ')} at {k}"
                             for shape, k in r["misses_found_by"].items()))
    if sweep is None and not args.maxtext:
        lines.append(f"(no {path}: run benchmarks/fit_sweep.py first for the misses)")
    return C.finish(args, NAME, result, "\n".join(lines), say)


if __name__ == "__main__":
    main()
