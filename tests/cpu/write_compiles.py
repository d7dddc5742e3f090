"""Write ``tests/cpu/data/<step>-compiles.json``: a step as `fit`'s search sees it, for
tests that run the search without the step's library.

For each save set of the step's committed brute force (``benchmarks/brute_force/<step>.json``)
and no remat: the kept, stored and read bytes and the recompute FLOPs that `fit` reads from
the step's graph (`_search._candidates`), and the compiled bytes the table holds. Run it in
the environment that has the step's library, e.g. MaxText's:

    python tests/cpu/write_compiles.py maxtext-mixtral --module maxtext_zoo

(``--module`` is the module under tests/cpu whose ``STEPS`` holds the step; the number of
tags is the table's.)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", help="the step's name, as its brute-force table names it")
    parser.add_argument("--module", required=True,
                        help="module under tests/cpu whose STEPS holds the step")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(HERE)]
    import _common  # the benchmarks' compile settings, as the table was compiled
    _common.prepare_compiles()
    import jax
    import jaxlib

    import fit_sweep
    fit = importlib.import_module("neuron_remat._fit")
    search = importlib.import_module("neuron_remat._search")
    spec = importlib.import_module(args.module).STEPS[args.step]
    table = json.loads((fit_sweep.TABLES / f"{args.step}.json").read_text())
    graph = fit.step_graph(spec.make_step(), *spec.abstract_args())
    rows = []
    for c in search._candidates(graph, table["tags"]):
        key = fit_sweep._key(None if c.saved is None else
                             [t for t in table["tags"] if t in c.saved])
        rows.append([None if c.saved is None else list(c.saved), c.kept, c.stored, c.read,
                     c.recompute, table["sets"][key]["bytes"]])
    libraries = table["compiled_with"].get("libraries", {})
    head = {"step": f"tests/cpu/{args.module}.py {args.step} ("
                    + ", ".join(f"{k} {v}" for k, v in sorted(libraries.items())) + ")",
            "backend": f"XLA:CPU, jax {jax.__version__}, jaxlib {jaxlib.__version__}",
            "columns": ["saved", "kept", "stored", "read", "recompute_flops",
                        "compiled_bytes"]}
    out = HERE / "data" / f"{args.step}-compiles.json"
    out.write_text("{" + ",".join(f'"{k}":{json.dumps(v)}' for k, v in head.items())
                   + ',"sets":[' + ",\n".join(json.dumps(r, separators=(",", ":"))
                                             for r in rows) + "]}\n")
    print(f"{out}: {len(rows)} sets")
    return 0


if __name__ == "__main__":
    sys.exit(main())
