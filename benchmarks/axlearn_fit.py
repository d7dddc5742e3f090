"""`fit` on a training step of axlearn's real layers, against the compiled brute force.

Runs where axlearn imports (Python 3.12, JAX 0.8.3, axlearn at commit
34aed43c1b6e581c4753d06d7cbeedd5010ef26b installed with ``pip install --no-deps -e``; README,
"The tests on a real axlearn"; ``axlearn.common`` needs no TensorFlow), as
``PYTHONPATH=. /work/venvs/ax312/bin/python benchmarks/axlearn_fit.py``. The steps are
tests/cpu/axlearn_zoo.py's: axlearn's own ``causal_lm.Model`` as Fuji configures it
(``RepeatedTransformerLayer`` of ``TransformerLayer``s: RMSNorm, GQA through
``FusedGroupedQKVLinear``, SwiGLU; untied ``LmHead``; axlearn's cross entropy), bf16 forward
over f32 weights, optax AdamW, donated state, the policy in the layer's ``RematSpec``. They
are held out: nothing in `fit` was tuned on them. Everything else is
benchmarks/maxtext_fit.py's, imported (its gap bins and report) with
benchmarks/fit_sweep.py's brute force and sweep:

1. the brute force: every subset of the `MAX_TAGS` (``--tags``, at most 8) most useful tags
   axlearn emits, and no remat, compiled on XLA:CPU once (``--xla_backend_optimization_level=0``)
   and cached by save set in ``OUT/axlearn_brute/<step>.json`` (delete it to recompile);
2. HBM sizes every 1% of the range from the smallest compiled step to 5% above no remat,
   one simulated core, no reserve; `fit` at each, its compiles served from the cache
   (counted all the same), with ``memory_analysis`` read and with the compile failure as
   the oracle (simulated, tests/cpu/zoo.py's `OomOracleSimulation`);
3. per mode: whether each plan fits, the gap in points of step FLOPs to the best compiled
   set that fits, the gap distribution, refusals while some set fits, the compiles.

A step `fit` cannot read (its trace raises, e.g. an equation neuron_remat does not follow)
is reported with the error and skipped. ``--small``: three tags, ten sizes; ``--steps``:
only these steps.
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
import maxtext_fit as MF  # noqa: E402

NAME = "axlearn_fit"
MiB = 1 << 20
MAX_TAGS = MF.MAX_TAGS
"""Tags in the brute force (2**6 sets and no remat, each compiled once), as maxtext_fit."""


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = C.parser(__doc__.splitlines()[0], NAME)
    p.add_argument("--brute-only", action="store_true", help="fill the cache and stop")
    import fit_sweep as FS  # noqa: PLC0415

    p.add_argument("--tags", type=FS.tag_count, default=MAX_TAGS,
                   help=f"tags in the brute force (default {MAX_TAGS}, at most "
                        f"{FS.MAX_TAGS}; --small: 3)")
    p.add_argument("--steps", nargs="+", default=None, metavar="NAME",
                   help="only these steps of tests/cpu/axlearn_zoo.py (default: all)")
    p.add_argument("--max-compiles", type=FS.compile_budget, default=None, metavar="N",
                   help="give fit this compile budget (max_compiles=N, at least 3) instead "
                        "of its own, as fit_sweep.py's option")
    args = p.parse_args(argv)
    sys.path.insert(0, str(C.REPO / "tests" / "cpu"))
    import axlearn_zoo as az  # noqa: PLC0415

    unknown = [n for n in args.steps or () if n not in az.STEPS]
    if unknown:
        p.error(f"--steps: no step {unknown[0]!r} in tests/cpu/axlearn_zoo.py; valid: "
                f"{', '.join(az.STEPS)}")
    C.prepare_compiles()  # before axlearn imports JAX
    why = az.available()
    if why is not None:
        raise SystemExit(f"axlearn_fit: {why}; install axlearn (README, 'The tests on a real "
                         "axlearn') and run this script with that python")
    say = C.Printer(args.quiet)
    import zoo  # noqa: PLC0415

    F = importlib.import_module("neuron_remat._fit")
    logging.getLogger("neuron_remat.fit").setLevel(logging.ERROR)
    max_tags, n_sizes = (3, 10) if args.small else (args.tags, 100)
    steps = az.STEPS if args.steps is None else {n: az.STEPS[n] for n in args.steps}
    result: dict[str, Any] = {"axlearn_commit": az.AXLEARN_COMMIT, "max_tags": max_tags,
                              "max_compiles": args.max_compiles, "steps": {}}
    lines: list[str] = []
    for name, spec in steps.items():
        make_step, step_args = spec.make_step(), spec.abstract_args()
        try:
            graph = F.step_graph(make_step, *step_args)
        except Exception as err:  # noqa: BLE001 - reported, the other steps still run
            error = f"{type(err).__name__}: {err}"
            say(f"{name}: fit cannot read the step: {error}")
            result["steps"][name] = {"note": spec.note, "fit_error": error}
            lines.append(f"{name} (axlearn {az.AXLEARN_COMMIT[:8]}): fit cannot read the "
                         f"step: {error}")
            continue
        pool = F._pool(graph, None)[:max_tags]  # noqa: SLF001
        say(f"{name}: axlearn emits {', '.join(graph.tags)}; brute force over "
            f"{', '.join(pool)}")
        brute = FS.Brute(spec, pool, args.out / "axlearn_brute" / f"{name}.json")
        seconds = brute.fill(say)
        if args.brute_only:
            continue
        full, none = brute.get(())["bytes"], brute.get(None)["bytes"]
        smallest = min(brute.get(s)["bytes"] for s in brute.sets())
        step: dict[str, Any] = {"note": spec.note, "tags": list(pool),
                                "emitted": list(graph.tags),
                                "brute_seconds": seconds, "full_remat_bytes": full,
                                "no_remat_bytes": none, "smallest_bytes": smallest,
                                "sets": {FS._key(s): brute.get(s) for s in brute.sets()},  # noqa: SLF001
                                "modes": {}}
        sizes = FS._sizes(brute, n_sizes)  # noqa: SLF001
        n_front = len(F._frontier(F._candidates(graph, pool)))  # noqa: SLF001
        lines.append(f"{name} (axlearn {az.AXLEARN_COMMIT[:8]}): full remat "
                     f"{full / MiB:.2f} MiB, no remat {none / MiB:.2f} MiB, smallest set "
                     f"{smallest / MiB:.2f} MiB; {len(sizes)} sizes, tags {', '.join(pool)}")
        for mode in ("memory_analysis", "oracle"):
            rows = FS.sweep_step(brute, mode, sizes, graph, F, zoo, args.max_compiles)
            summary = FS._summary(rows, n_front, mode == "oracle")  # noqa: SLF001
            gaps = [r["gap"] for r in rows if r.get("gap") is not None]
            summary["gap_bins"] = MF._gap_bins(gaps)  # noqa: SLF001
            step["modes"][mode] = {"summary": summary, "rows": rows}
            lines += MF._report(mode, summary, rows)  # noqa: SLF001
            if stopped := FS.why_stopped(rows):
                lines.append(f"  {stopped}")
        result["steps"][name] = step
    return C.finish(args, NAME, result, "\n".join(lines), say)


if __name__ == "__main__":
    main()
