"""The committed compile tables (benchmarks/brute_force/) and the README's figures of `fit`
drawn from them.

Each table holds XLA:CPU's memory and cost figures for every save set of a step, compiled
by `benchmarks/fit_sweep.py` (or `maxtext_fit.py`, `axlearn_fit.py`) and committed with
the JAX that compiled it. One test checks that every zoo step has its table; one compiles a
few sets again and holds them to their rows (the expected value is XLA's, now); one sweeps
`fit` over the tables as the README says it was swept and holds the README's tables of the
zoo, the foreign steps and the sharded steps (and their rows of the table of the oracle
without figures) to what the sweep gives, so that a change to the search that moves one of
those figures cannot land without the README saying so. The last two skip, with the reason,
where this JAX or jaxlib is not the one that compiled the tables (another XLA may lay
memory out otherwise, and the sweep would recompile for hours). They are marked slow. One
more runs `fit` at one size from a table under two BLAS kernels and holds the plans equal:
the tables' figures must not depend on the machine that sweeps them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fit_sweep as FS  # noqa: E402
import readme_tables as R  # noqa: E402
import zoo  # noqa: E402

ZOO_HEADER = "| step | split | tags | no remat / full | memory_analysis | oracle |"


def _committed(name: str) -> dict:
    """`name`'s table, which must be committed (a zoo step's README table needs it)."""
    assert (R.TABLES / f"{name}.json").exists(), f"benchmarks/brute_force/{name}.json is missing"
    return R.table(name)


def test_every_zoo_step_has_a_table_over_its_pool():
    """Each one-device zoo step has its table, covering every subset of its tags and no
    remat, in the order the sweep keys them: the README's zoo table can be swept on a
    fresh clone."""
    for name in zoo.ZOO:
        t = _committed(name)
        n = len(t["tags"])
        assert len(t["sets"]) == 2 ** n + 1, (name, len(t["sets"]))
        assert FS.NO_REMAT in t["sets"] and "" in t["sets"]
        assert set(t["compiled_with"]) >= {"jax", "jaxlib", "backend", "xla_flags", "libraries"}


@pytest.mark.slow
@pytest.mark.parametrize("name,saved", [("long-seq", ()), ("long-seq", ("attn_ctx",)),
                                        ("moe8-rope-sgd", ("gate_logits", "experts_up"))])
def test_a_table_is_what_xla_compiles_here(name, saved):
    """A set's row of the table equals XLA's figures for it compiled now, in a process of
    its own with the table's XLA flags (the compile is the expected value; a table compiled
    by another XLA fails here)."""
    table = _committed(name)
    R.require(name)
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}, "
            f"{str(Path(__file__).resolve().parent)!r}]\n"
            "import json, zoo, _common as C\n"
            "from jax._src.ad_checkpoint import save_only_these_names\n"
            f"spec = zoo.ZOO[{name!r}]\n"
            f"c = spec.make_step()(save_only_these_names(*{saved!r}))"
            ".lower(*spec.abstract_args()).compile()\n"
            "print(json.dumps({**C.memory_row(c), 'flops': C.compiled_flops(c)}))\n")
    env = {**os.environ, "XLA_FLAGS": table["compiled_with"]["xla_flags"]}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    row = table["sets"][",".join(saved)]
    assert got == {k: row[k] for k in got}, (got, row)


def _openblas_kernels() -> bool:
    """Whether numpy's BLAS is OpenBLAS built for every x86 kernel (DYNAMIC_ARCH: the
    kernel is chosen at start, and OPENBLAS_CORETYPE overrides the choice) and this CPU
    runs both kernels `test_the_search_decides_the_same_on_every_blas_kernel` forces."""
    import numpy as np

    try:
        config = np.show_config(mode="dicts")
    except TypeError:  # numpy < 1.26
        return False
    blas = json.dumps(config.get("Build Dependencies", {}).get("blas", {})).lower()
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "openblas" in blas and "dynamic_arch" in blas and "avx2" in flags


@pytest.mark.skipif(not _openblas_kernels(), reason="numpy's BLAS is not OpenBLAS with "
                    "DYNAMIC_ARCH on an x86 CPU with AVX2: no second kernel to force")
def test_the_search_decides_the_same_on_every_blas_kernel():
    """`fit` plans alike whichever BLAS kernels the CPU selects. gqa4-adamw at one size,
    the compile as the oracle (its committed table serving the compiles), in two processes
    of their own, one with OpenBLAS's Haswell kernels and one with its Sandybridge ones:
    the same plan in the same compiles. Before the search rounded its chances
    (`_search.CHANCE_DIGITS`), two sets the trace cannot tell apart tied there up to the
    last bits of the linear algebra, and the kernels broke the tie two ways (one plan
    saved key_proj, context, out_proj and mlpwi_0, the other mlpwi_0 and mlpwi_1)."""
    name, hbm = "gqa4-adamw", 17854063
    R.require(name)
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}, "
            f"{str(Path(__file__).resolve().parent)!r}]\n"
            "import importlib, json, _common as C\n"
            "C.prepare_compiles()\n"
            "import fit_sweep as FS, zoo\n"
            "F = importlib.import_module('neuron_remat._fit')\n"
            "SG = importlib.import_module('neuron_remat._step')\n"
            f"spec = zoo.ZOO[{name!r}]\n"
            "graph = F.step_graph(spec.make_step(), *spec.abstract_args())\n"
            "pool = SG._pool(graph, None)[:FS.MAX_TAGS]\n"
            f"brute = FS.Brute(spec, pool, FS.TABLES / {name + '.json'!r})\n"
            f"rows = FS.sweep_step(brute, 'oracle', [{hbm}], graph, F, zoo)\n"
            "print(json.dumps([rows[0]['saved'], rows[0]['compiles']]))\n")
    got = []
    for kernel in ("Haswell", "Sandybridge"):
        env = {**os.environ, "OPENBLAS_CORETYPE": kernel,
               "XLA_FLAGS": _committed(name)["compiled_with"]["xla_flags"]}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
        got.append(json.loads(run.stdout.strip().splitlines()[-1]))
    assert got[0] == got[1], got


SHARDED_HEADER = ("| step | memory_analysis | oracle | before: memory_analysis | "
                  "before: oracle |")
SHARDED = ["big-state-fsdp8", "wide-ffn-sgd-bf16-fsdp8", "long-seq-fsdp8",
           "moe-fused-qkv-fsdp8", "big-state-dp8", "wide-ffn-sgd-bf16-dp8",
           "big-state-dp4tp2", "wide-ffn-sgd-bf16-dp4tp2", "long-seq-dp4tp2",
           "moe8-rope-sgd-fsdp8", "rope-gqa2-bf16-fsdp8"]


FOREIGN = ["linen-gpt2", "eqx-llama", "nnx-parallel", "haiku-free-mixer", "linen-encdec",
           "linen-convnext", "linen-resnet", "eqx-mamba2", "eqx-llama-accum4",
           "linen-gpt2-nested"]  # foreign_zoo.STEPS (imports flax)


def _zoo_row(name: str, st: dict) -> list[str]:
    """A row of the README's zoo tables: step, split, tags, no remat over full remat, then
    the two modes' cells."""
    return [name, st["split"], str(len(st["tags"])),
            f"{st['no_remat_bytes'] / st['full_remat_bytes']:.2f}x",
            R.cell(st["modes"]["memory_analysis"]["summary"]),
            R.cell(st["modes"]["oracle"]["summary"])]


def _modes_row(name: str, st: dict) -> list[str]:
    """The first three cells of a row of the README's tables by mode alone: step, then the
    two modes' cells (the sharded table's other two are the code before the count per
    core, on the same tables)."""
    return [name, R.cell(st["modes"]["memory_analysis"]["summary"]),
            R.cell(st["modes"]["oracle"]["summary"])]


# The README's tables of `fit`: (header, which of the tables under it from 0, fit_sweep.py's
# extra arguments, the steps in the table's order, a row as the sweep gives it, whether the
# table of the oracle without figures holds these steps as swept: not with --spare).
README_TABLES = {
    "zoo": (ZOO_HEADER, 0, [], list(zoo.ZOO), _zoo_row, True),
    "foreign": (ZOO_HEADER, 1, ["--steps-module", "tests.cpu.foreign_zoo"], FOREIGN,
                _zoo_row, True),
    "spare": ("| step | memory_analysis | oracle |", 0,
              ["--steps-module", "tests.cpu.foreign_zoo", "--spare"], FOREIGN, _modes_row,
              False),
    "sharded": (SHARDED_HEADER, 0, ["--steps-module", "tests.cpu.sharded_zoo",
                                    "--host-devices", "8"], SHARDED, _modes_row, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("which", list(README_TABLES))
def test_a_readme_table_is_the_sweep_of_the_committed_tables(which, tmp_path):
    """`python benchmarks/fit_sweep.py --cached-only` with the table's arguments (and
    ``--bare-oracle`` where the table of the oracle without figures holds its steps) on a
    fresh cache, filled from the committed tables only, gives the README's table cell by
    cell, and those steps' rows of the table of the oracle without figures."""
    header, nth, extra, steps, row_of, bare = README_TABLES[which]
    rows = R.rows(header, nth)
    assert list(rows) == steps, list(rows)
    suffix = "+spare" if "--spare" in extra else ""
    for name in steps:
        _committed(name + suffix)
        R.require(name + suffix)
    result = R.sweep("fit_sweep.py", ["--cached-only", *(["--bare-oracle"] if bare else []),
                                      *extra, "--steps", ",".join(steps)], steps[0] + suffix,
                     tmp_path / "sweep.json")
    for name, cells in rows.items():
        got = row_of(name, result["steps"][name])
        assert got == cells[:len(got)], (name, got, cells)
    if not bare:
        return
    bare_rows = R.rows(R.BARE_HEADER)  # the oracle without figures, every step in one table
    for name in steps:
        modes = result["steps"][name]["modes"]
        got = [name, R.cell(modes["oracle"]["summary"]), R.cell(modes["oracle_bare"]["summary"])]
        assert got == bare_rows[name], (name, got, bare_rows[name])
