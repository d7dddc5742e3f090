"""The README's tables of `fit`'s sweeps, read for the tests that hold them to a sweep of the
committed compile tables (benchmarks/brute_force/): test_fit_tables.py, and
test_maxtext_real.py in MaxText's environment (test helpers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fit_sweep as FS  # noqa: E402

README = ROOT / "README.md"
TABLES = FS.TABLES
BARE_HEADER = "| step | oracle (figures) | oracle_bare |"
"""The table of the oracle without figures beside the oracle with them, every step swept."""


def rows(header: str, nth: int = 0) -> dict[str, list[str]]:
    """The rows of the README's `nth` table (from 0) under `header`, by their first cell:
    their cells."""
    lines = README.read_text().splitlines()
    at = [i for i, line in enumerate(lines) if line == header][nth]
    out = {}
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = cells
    return out


def cell(summary: dict[str, Any]) -> str:
    """A mode's cell as the README writes it from a sweep's summary: share of sizes within
    0.5 points / largest gap, refusals while some set fits, share within the compile cap."""
    gap = summary["gap_max"] or 0.0
    return (f"{100 * summary['share_gap_le_0_5']:.0f}% / "
            + ("0" if gap == 0 else f"{100 * gap:.2f}")
            + f", {summary['refusals_while_some_fits']}, "
            f"{100 * summary['share_within_cap']:.0f}%")


def table(name: str) -> dict[str, Any]:
    """A step's committed compile table."""
    return json.loads((TABLES / f"{name}.json").read_text())


def why_not_this_compiler(name: str) -> str | None:
    """Why this environment cannot use `name`'s table (None: it can): another JAX, jaxlib
    or version of the step's libraries may give other programs or lay memory out otherwise,
    and the sweep would compile the brute force again (fit_sweep.compiled_with)."""
    made, here = table(name)["compiled_with"], FS.compiled_with()
    differ = [f"{k} {made.get(k)} here {here.get(k)}" for k in ("jax", "jaxlib", "libraries")
              if made.get(k) != here.get(k)]
    if differ:
        return f"the committed table of {name} was compiled with " + "; ".join(differ)
    return None


def require(name: str) -> None:
    """Skip the calling test (pytest) where `name`'s table is not committed or this
    environment cannot use it (`why_not_this_compiler`)."""
    import pytest

    if not (TABLES / f"{name}.json").exists():
        pytest.skip(f"benchmarks/brute_force/{name}.json is not committed yet")
    why = why_not_this_compiler(name)
    if why is not None:
        pytest.skip(why)


def sweep(script: str, args: list[str], name: str, out: Path) -> dict[str, Any]:
    """Run `benchmarks/<script>` with `args` (and ``--quiet --out``/``--json`` in `out`'s
    folder) in a process of its own, XLA's flags those `name`'s table was compiled with
    (less the device count, which ``--host-devices`` sets); its JSON."""
    flags = [f for f in table(name)["compiled_with"]["xla_flags"].split()
             if "device_count" not in f]
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args,
                          "--quiet", "--out", str(out.parent), "--json", str(out)],
                         env={**os.environ, "XLA_FLAGS": " ".join(flags),
                              "PYTHONPATH": str(ROOT)},
                         cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())


def swept_bare_row(script: str, name: str, extra: list[str], folder: Path) -> dict[str, Any]:
    """Sweep one host step from its committed table (`script`: maxtext_fit.py or
    axlearn_fit.py, with ``--bare-oracle`` and `extra`), skipping (pytest) where the table
    is not committed or this environment cannot use it; assert its row of the README's
    table of the oracle without figures; its modes (each mode's summary and rows)."""
    require(name)
    result = sweep(script, ["--bare-oracle", *extra, "--steps", name], name,
                   folder / "sweep.json")
    modes = result["steps"][name]["modes"]
    assert rows(BARE_HEADER)[name] == [
        name, cell(modes["oracle"]["summary"]), cell(modes["oracle_bare"]["summary"])]
    return modes
