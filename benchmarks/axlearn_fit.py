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
benchmarks/maxtext_fit.py's (`sweep_real_step`: the brute force over the 6, ``--tags``, most
useful tags axlearn emits and no remat, cached by save set in
``OUT/axlearn_brute/<step>.json``; `fit` at 101 sizes in both modes, three with
``--bare-oracle``; the gaps, refusals and compiles).

A step `fit` refuses to read (a ValueError, e.g. an equation neuron_remat does not follow)
is reported with the error, the other steps are swept, and the script then exits non-zero.
``--small``: three tags, ten sizes; ``--steps A,B``: only these steps; ``--spare``: the brute
force also covers each tag outside `fit`'s pool (cached as ``<step>+spare.json``) and `fit`
runs without ``candidates``, compiling those tags where it explores (`_Search.spare`).
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


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = MF.real_step_parser(__doc__.splitlines()[0], NAME)
    args = p.parse_args(argv)
    sys.path.insert(0, str(C.REPO / "tests" / "cpu"))
    import axlearn_zoo as az  # noqa: PLC0415

    known = {**az.STEPS, **az.SHARDED}
    names = list(az.STEPS) if args.steps is None else args.steps.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"--steps: no step {unknown[0]!r} in tests/cpu/axlearn_zoo.py; valid: "
                f"{', '.join(known)}")
    if args.host_devices:
        C.host_devices(args.host_devices)
    C.prepare_compiles()  # before axlearn imports JAX
    why = az.available()
    if why is not None:
        raise SystemExit(f"axlearn_fit: {why}; install axlearn (README, 'The tests on a real "
                         "axlearn') and run this script with that python")
    say = C.Printer(args.quiet)
    F = importlib.import_module("neuron_remat._fit")
    logging.getLogger("neuron_remat.fit").setLevel(logging.ERROR)
    max_tags, n_sizes = (3, 10) if args.small else (args.tags, 100)
    steps = {n: known[n] for n in names}
    result: dict[str, Any] = {"axlearn_commit": az.AXLEARN_COMMIT, "max_tags": max_tags,
                              "max_compiles": args.max_compiles, "steps": {}}
    lines: list[str] = []
    unread = []
    for name, spec in steps.items():
        try:
            graph = F.step_graph(spec.make_step(), *spec.abstract_args())
        except ValueError as err:  # fit's own refusal (UnsupportedPrimitiveError, ...)
            error = f"{type(err).__name__}: {err}"
            result["steps"][name] = {"note": spec.note, "fit_error": error}
            lines.append(f"{name} (axlearn {az.AXLEARN_COMMIT[:8]}): fit cannot read the "
                         f"step: {error}")
            unread.append(name)
            continue
        step, more = MF.sweep_real_step(name, spec, graph, "axlearn", az.AXLEARN_COMMIT[:8],
                                        args.out / "axlearn_brute", max_tags, n_sizes,
                                        args.max_compiles, args.brute_only, say,
                                        args.spare, args.bare_oracle, args.publish,
                                        not args.no_tables, args.retry)
        lines += more
        if step is not None:
            result["steps"][name] = step
    finished = C.finish(args, NAME, result, "\n".join(lines), say)
    if unread:
        raise SystemExit(f"axlearn_fit: fit cannot read {', '.join(unread)} (the report "
                         "says why); the other steps were swept")
    return finished


if __name__ == "__main__":
    main()
