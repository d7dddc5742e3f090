"""`fit` against the compiled brute force on a zoo of training steps it was not written on.

The zoo is tests/cpu/zoo.py: scanned and unrolled stacks, float32 and bfloat16, AdamW, SGD
and Adafactor, a wide FFN beside narrow attention and the reverse, GQA ratios from MHA to
MQA, a fused QKV, a MoE feed-forward, no remat from about 1.1x to 3.2x full remat. Steps
marked ``train`` are the ones `fit`'s search constants were tuned on; ``held-out`` steps
were not looked at while tuning, and are reported apart.

For each step:

1. the brute force: every subset of (at most) `MAX_TAGS` useful tags (4 for the unrolled step), and no remat,
   compiled on XLA:CPU once and cached by save set in ``OUT/fit_brute/<step>.json``, a
   cache that starts from the step's committed table (`TABLES`) where the same compiler
   made it (the compile is deterministic; delete the file and pass ``--no-tables`` to
   recompile). The brute force is compiled
   with ``--xla_backend_optimization_level=0`` (LLVM's work only: buffer assignment and
   ``memory_analysis()`` came out the same on the two sets of gqa4-adamw checked);
2. a sweep of HBM sizes every 1% of the range from the smallest compiled step to 5% above
   no remat, one simulated core, no reserve. At each size `fit` runs with its compiles
   served from that cache (counted as compiles all the same), in two modes:
   ``memory_analysis`` (the compiled bytes are read) and ``oracle`` (zoo's
   `OomOracleSimulation`: the compile fails with RESOURCE_EXHAUSTED over the limit,
   giving the program's bytes, and ``memory_analysis()`` raises), and with
   ``--bare-oracle`` a third, ``oracle_bare`` (the same but the error gives no figure);
3. per step and mode: whether each plan fits, the gap in points of step FLOPs to the best
   compiled set that fits (XLA counts a scan body once: a FLOP difference times the layer
   count), refusals while some set fits, and the compiles; then the issue's "done when"
   figures, checked.

``--spare``: the brute force also covers each tag outside `fit`'s pool, and `fit` runs
without ``candidates`` (it compiles those tags where full remat does not fit or fits
tightly, and before a refusal). ``--small``: two steps, three tags, ten sizes.
``--max-compiles N``: `fit` gets that budget instead of its own (its ``max_compiles=``), to
tell a miss the budget causes from one its model causes (the search stops with compiles
left: the best set is not plausible to it). ``--bare-oracle``: a third mode, ``oracle_bare``,
whose simulated out-of-memory errors give no byte figure (a neuronx-cc NCC_EOOM002 may say
only that the program does not fit), so that each compile says only whether it fits;
reported beside the others, its compiles held to the oracle's cap. ``--retry K``: where a
plan says a better set may fit (`CompiledFit.unexplored`: sets not compiled that recompute
less, each at least `PLAUSIBLE` likely to fit by the search's model), `fit` runs again with
``max_compiles`` as many more than it made as it left such sets, up to K (with K = 3, as
its note advises); the report says how well the flag marks the misses (in every run) and
what running again gained (with ``--retry``).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

NAME = "fit_sweep"
MiB = 1 << 20
MAX_TAGS = 8
"""Tags per step in the brute force (at most 2**8 sets, each compiled once and cached)."""
NO_REMAT = "__no_remat__"
MODES = ("memory_analysis", "oracle")
"""The modes every sweep runs: the compiled bytes read, and the compile as the oracle (its
out-of-memory errors give the program's bytes)."""
BARE = "oracle_bare"
"""``--bare-oracle``'s mode: the compile as the oracle, its errors without byte figures."""
BARE_HELP = ("also sweep with the compile as an oracle whose out-of-memory errors give no "
             "byte figure (mode oracle_bare: neuronx-cc's NCC_EOOM002 may say only that "
             "the program does not fit)")


def _zoo() -> Any:
    sys.path.insert(0, str(C.REPO / "tests" / "cpu"))
    import zoo  # noqa: PLC0415

    return zoo


def _extra_steps(modules: Sequence[str]) -> dict[str, Any]:
    """The steps of each ``--steps-module``: an importable module (``tests.cpu.maxtext_zoo``
    from the checkout's root) whose ``STEPS`` maps a name to an object with the zoo's
    `Spec` protocol (tests/cpu/zoo.py). One line naming the module when it cannot be
    imported or has no ``STEPS``."""
    if str(C.REPO) not in sys.path:
        sys.path.insert(0, str(C.REPO))
    steps: dict[str, Any] = {}
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a host library missing on this Python
            raise SystemExit(f"fit_sweep: --steps-module {name}: cannot import it "
                             f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
        found = getattr(mod, "STEPS", None)
        if not isinstance(found, dict) or not found:
            raise SystemExit(f"fit_sweep: --steps-module {name}: it has no STEPS dict of "
                             "name -> step (the zoo's Spec protocol, tests/cpu/zoo.py)")
        steps.update(found)
    return steps


def _key(saved: Sequence[str] | None) -> str:
    return NO_REMAT if saved is None else ",".join(saved)


def _saved_of(policy: Any, tags: Sequence[str]) -> tuple[str, ...] | None:
    """The save set a policy `fit` (or the brute force) compiles stands for."""
    import jax  # noqa: PLC0415

    if policy is jax.checkpoint_policies.everything_saveable:
        return None
    if hasattr(policy, "saves"):
        return tuple(t for t in tags if policy.saves(t))
    return tuple(t for t in tags if t in policy.names)


TABLES = C.REPO / "benchmarks" / "brute_force"
"""The compiled brute force, committed: per step the file `Brute.fill` writes (every save
set's memory and cost figures), with the JAX that compiled it (`compiled_with`). A step's
cache in ``OUT`` starts from its table where this JAX, jaxlib, backend, XLA flags and
libraries (`LIBRARIES`) are those (``--no-tables``: it does not), so that
``--cached-only`` reproduces the figures on a fresh clone, where compiling them takes
hours (measured on 2 shared cores: gqa4-adamw's 257 sets in 13 minutes,
rope-gqa2-bf16-fsdp8's 129 over 8 devices in about 20). XLA:CPU compiles
deterministically: gqa4-adamw's 257 compiles on a new machine equalled, byte for byte, the
table compiled on another (tests/cpu/data/gqa4-adamw-compiles.json). ``--publish`` writes
the tables."""


LIBRARIES = ("optax", "flax", "equinox", "maxtext", "axlearn")
"""The libraries the steps are written with (those installed): a table's programs are
theirs too."""


def compiled_with() -> dict[str, Any]:
    """What a table's figures depend on: JAX and jaxlib, the backend, XLA's flags
    (`_common.prepare_compiles` and ``--host-devices`` set them), and the versions of the
    `LIBRARIES` installed."""
    from importlib import metadata  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jaxlib  # noqa: PLC0415

    libraries = {}
    for name in LIBRARIES:
        try:
            libraries[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "libraries": libraries}


def _same_compiler(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two tables' figures come from the same compiler and programs (JAX, jaxlib,
    backend, the libraries' versions, and XLA's flags as a set: their order does not
    matter)."""
    return all(a.get(k) == b.get(k) for k in ("jax", "jaxlib", "backend", "libraries")) \
        and set(a.get("xla_flags", "").split()) == set(b.get("xla_flags", "").split())


def written_here(path: Path) -> dict[str, Any] | None:
    """The JSON file at `path` (a committed table: its figures and the `compiled_with` that
    made them) where it exists and this compiler wrote it; None otherwise, and the caller
    compiles instead."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return data if _same_compiler(data["compiled_with"], compiled_with()) else None


class Brute:
    """The cached compiles of one step, by save set (`tags` order): the cache in ``OUT``,
    and what the committed table (`TABLES`) holds beyond it where the same compiler made
    it (unless `tables` is False)."""

    def __init__(self, spec: Any, tags: Sequence[str], path: Path, tables: bool = True
                 ) -> None:
        self.spec, self.tags, self.path = spec, tuple(tags), path
        self.table: dict[str, dict[str, float]] = {}
        self.file_tags = list(self.tags)
        self.compiled_with: dict[str, Any] | None = None
        self.seeded = 0  # sets taken from the committed table
        data = self._read(path)
        if data is not None:
            self.table, self.file_tags = data["sets"], list(data["tags"])
            self.compiled_with = data.get("compiled_with")
        seed = self._read(TABLES / path.name) if tables else None
        if seed is not None and seed.get("compiled_with") is not None \
                and (data is None or list(seed["tags"]) == self.file_tags):
            here = self.compiled_with or compiled_with()
            if _same_compiler(seed["compiled_with"], here):
                more = {k: v for k, v in seed["sets"].items() if k not in self.table}
                self.table = {**self.table, **more}
                self.file_tags = list(seed["tags"])
                self.seeded, self.compiled_with = len(more), here

    def _read(self, path: Path) -> dict[str, Any] | None:
        """A cache or table at `path` that serves these tags: one over more tags serves any
        of them in the same order (its keys list a set's tags in that order), a prefix or
        the tags left once `_pool` drops one. None when there is none."""
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        cached = list(data.get("tags", []))
        at = [cached.index(t) for t in self.tags if t in cached]
        return data if len(at) == len(self.tags) and at == sorted(at) else None

    def sets(self) -> list[tuple[str, ...] | None]:
        """No remat, then every subset in binary counting order: the first 2**k subsets
        are every subset of the first k tags, so a cache cut short serves a prefix."""
        out: list[tuple[str, ...] | None] = [None]
        for mask in range(1 << len(self.tags)):
            out.append(tuple(t for i, t in enumerate(self.tags) if mask >> i & 1))
        return out

    def complete_prefix(self) -> int:
        """How many of the leading tags the cache covers completely (every subset, and no
        remat); -1 when not even full remat and no remat are there."""
        if _key(None) not in self.table:
            return -1
        k = -1
        for mask in range(1 << len(self.tags)):
            if _key(tuple(t for i, t in enumerate(self.tags) if mask >> i & 1)) \
                    not in self.table:
                break
            if ((mask + 1) & mask) == 0:  # every subset of the first bit_length(mask+1)-1 tags
                k = (mask + 1).bit_length() - 1
        return k

    def fill(self, say: Any) -> float:
        """Compile what the cache lacks; seconds spent."""
        import jax  # noqa: PLC0415
        from jax._src.ad_checkpoint import save_only_these_names  # noqa: PLC0415

        make_step, args = self.spec.make_step(), self.spec.abstract_args()
        t0 = time.perf_counter()
        todo = [s for s in self.sets() if _key(s) not in self.table]
        if todo:
            self.compiled_with = self.compiled_with or compiled_with()
            self.path.parent.mkdir(parents=True, exist_ok=True)
        for i, saved in enumerate(todo):
            policy = (jax.checkpoint_policies.everything_saveable if saved is None
                      else save_only_these_names(*saved))
            row = compiled_row(make_step(policy).lower(*args).compile())
            self.table[_key(saved)] = row
            self._write(self.path)
            say(f"  {self.spec.name}: compiled {i + 1}/{len(todo)} "
                f"({_key(saved) or 'nothing'}): {row['bytes'] / MiB:.2f} MiB")
        return time.perf_counter() - t0

    def _write(self, path: Path) -> None:
        path.write_text(json.dumps({"step": self.spec.name, "tags": self.file_tags,
                                    "compiled_with": self.compiled_with,
                                    "sets": self.table}, indent=0))

    def publish(self) -> str:
        """Write the cache as the step's committed table (`TABLES`); one line saying what.
        A cache written before caches named their compiler, or before they named the
        libraries, is taken to be this environment's."""
        if self.compiled_with is None or "libraries" not in self.compiled_with:
            self.compiled_with = compiled_with()
        TABLES.mkdir(parents=True, exist_ok=True)
        self._write(TABLES / self.path.name)
        return (f"  {self.spec.name}: {len(self.table)} compiled sets written to "
                f"{TABLES / self.path.name} (JAX {self.compiled_with['jax']})")

    def get(self, saved: Sequence[str] | None) -> dict[str, float]:
        return self.table[_key(saved)]


# --------------------------------------------------------------------------------------
# Steps whose compiles come from the cache.
# --------------------------------------------------------------------------------------


def compiled_row(compiled: Any) -> dict[str, Any]:
    """A compiled step's figures as the tables keep them: `memory_row`'s fields, then its
    FLOPs and transcendentals (what `_CachedCompiled` serves back)."""
    return {**C.memory_row(compiled), "flops": C.compiled_flops(compiled),
            "transcendentals": C.compiled_transcendentals(compiled)}


class _CachedCompiled:
    def __init__(self, row: dict[str, float]) -> None:
        self._row = row

    def memory_analysis(self) -> Any:
        import types  # noqa: PLC0415

        return types.SimpleNamespace(**{f: int(self._row[f]) for f in C.MEMORY_FIELDS})

    def cost_analysis(self) -> dict[str, float]:
        # transcendentals where the cache has them (rows cached before it kept them: none,
        # and fit's final choice among compiled sets then reads the flops alone)
        return {k: self._row[k] for k in ("flops", "transcendentals") if k in self._row}


class _CachedLowered:
    def __init__(self, row: dict[str, float], counter: list[int]) -> None:
        self._row, self._counter = row, counter

    def compile(self) -> _CachedCompiled:
        self._counter[0] += 1
        return _CachedCompiled(self._row)


class CachedStep:
    """A jitted step whose ``lower(*args).compile()`` is served from the brute force.
    Calling it builds and calls the real step (`step()`), only then: a host's step
    (MaxText's) takes seconds to build, and a sweep asks for thousands."""

    def __init__(self, step: Callable[[], Any], row: dict[str, float],
                 counter: list[int]) -> None:
        self._step, self._row, self._counter = step, row, counter
        self._built: Any = None

    def __call__(self, *args: Any) -> Any:
        if self._built is None:
            self._built = self._step()
        return self._built(*args)

    def lower(self, *args: Any) -> _CachedLowered:
        return _CachedLowered(self._row, self._counter)


def cached_make_step(brute: Brute, counter: list[int]) -> Any:
    make_step = brute.spec.make_step()

    def make(policy: Any) -> CachedStep:
        saved = _saved_of(policy, brute.tags)
        return CachedStep(lambda: make_step(policy), brute.get(saved), counter)

    return make


# --------------------------------------------------------------------------------------
# The sweep.
# --------------------------------------------------------------------------------------


def _best(brute: Brute, limit: int) -> tuple[float, tuple[str, ...] | None] | None:
    fits = [(row["flops"], s) for s in brute.sets()
            if (row := brute.get(s))["bytes"] <= limit]
    return min(fits, key=lambda f: (f[0], -1 if f[1] is None else len(f[1]))) if fits else None


def sweep_step(brute: Brute, mode: str, sizes: Sequence[int], graph: Any,
               F: Any, zoo: Any, max_compiles: int | None = None,
               own_pool: bool = False, retry: int | None = None) -> list[dict[str, Any]]:
    """`fit` at each of `sizes` in `mode`, its compiles served from `brute`; with
    `max_compiles`, that budget is fit's (``max_compiles=``) instead of its own. `fit` is
    given the brute force's tags as ``candidates``; with `own_pool`, none (it picks its own
    pool, and may compile the tags outside it: `brute` must cover both). With `retry`,
    where a plan says a better set may fit (`CompiledFit.unexplored`), `fit` runs again
    with ``max_compiles`` as many more than it made as it left such sets, up to `retry`,
    resuming the first plan (with 3, as its note advises; the row's ``retry``, whose
    ``compiles`` counts the compiles it made and ``reused`` those read back)."""
    counter = [0]
    make = cached_make_step(brute, counter)
    real_step_graph, real_candidates = F.step_graph, F._candidates  # noqa: SLF001
    memo: dict[Any, list[Any]] = {}

    def candidates(g: Any, tags: Sequence[str], no_remat: bool = True) -> list[Any]:
        # The same graph at every size: its save sets' figures are worked out once (they
        # were most of a cached sweep's time), not once per size.
        if g is not graph:
            return real_candidates(g, tags, no_remat)
        key = (tuple(tags), no_remat)
        if key not in memo:
            memo[key] = real_candidates(g, tags, no_remat)
        return list(memo[key])

    # Each compile of a save set the search made with a model: the chance it gave the set
    # to fit, read before the compile as the search reads it (reading it changes nothing:
    # the same sweep, key for key), and whether it did (`calibration`).
    search_cls = F._Search  # noqa: SLF001
    real_measure, chances = search_cls._measure, []  # noqa: SLF001

    def measure(search: Any, c: Any) -> Any:
        p = search.chance(c) if search.model is not None and c.saved else None
        got = real_measure(search, c)
        if p is not None:
            chances.append([p, not got.over(search.limit)])
        return got

    F.step_graph = lambda make_step, *args: graph  # traced once per step, not per size
    F._candidates = candidates  # noqa: SLF001
    search_cls._measure = measure  # noqa: SLF001
    try:
        return _sweep(brute, mode, sizes, graph, zoo, counter, make, max_compiles, own_pool,
                      chances, retry)
    finally:
        F.step_graph, F._candidates = real_step_graph, real_candidates  # noqa: SLF001
        search_cls._measure = real_measure  # noqa: SLF001


def _sweep(brute: Brute, mode: str, sizes: Sequence[int], graph: Any, zoo: Any,
           counter: list[int], make: Any, max_compiles: int | None,
           own_pool: bool = False, chances: list[list[Any]] | None = None,
           retry: int | None = None) -> list[dict[str, Any]]:
    import neuron_remat as nr  # noqa: PLC0415

    share = flops_share(graph, brute.spec)
    flops0 = brute.get(None)["flops"]
    budget = {} if max_compiles is None else {"max_compiles": max_compiles}
    args = brute.spec.abstract_args()  # shapes only: one build serves every size
    rows = []
    chances = [] if chances is None else chances
    for hbm in sizes:
        counter[0] = 0
        del chances[:]
        device = nr.parse_device(f"trn2.48xlarge:hbm={hbm}B:cores=1", source="fit_sweep")
        ms = make if mode == "memory_analysis" else zoo.oracle_make_step(
            make, hbm, figures=mode != BARE)
        best = _best(brute, hbm)
        row: dict[str, Any] = {"hbm": hbm, "best": None if best is None else
                               (None if best[1] is None else list(best[1])),
                               "best_overhead": None if best is None else
                               share * (best[0] - flops0)}

        made: list[Any] = []  # the plan, for the retry's resume

        def planned(**options: Any) -> dict[str, Any]:
            counter[0] = 0
            try:
                plan = nr.fit(ms, *args, device=device, reserve=0,
                              candidates=None if own_pool else list(brute.tags),
                              progress=lambda line: None, **options)
                made.append(plan)
            except nr.NoFitError:
                return {"outcome": "refused", "compiles": counter[0], "fits": None,
                        "gap": None}
            except ValueError as err:
                return {"outcome": "reported", "compiles": counter[0], "fits": None,
                        "gap": None, "why": str(err)[:200]}
            rec = plan.compiled
            key = None if rec.no_remat else tuple(t for t in brute.tags
                                                   if t in plan.saved_tags)
            truth = brute.get(key)
            return {"outcome": "plan", "saved": None if key is None else list(key),
                    "compiles": counter[0], "fits": truth["bytes"] <= hbm,
                    "states_truth": (rec.flops == truth["flops"]
                                     and (not rec.measured or rec.bytes == truth["bytes"])),
                    "noticed": any("does not follow" in n for n in plan.notes),
                    "stop": rec.stop or None, "unexplored": rec.unexplored,
                    "reused": rec.reused,
                    "overhead": share * (truth["flops"] - flops0),
                    "gap": None if best is None else share * (truth["flops"] - best[0])}

        row.update(planned(**budget))
        row["chances"] = [list(c) for c in chances]
        if retry and row.get("unexplored"):
            row["retry"] = planned(max_compiles=row["compiles"] + min(row["unexplored"], retry),
                                   resume=made[0])
        rows.append(row)
    return rows


def flagged(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How well the plans' flag (`CompiledFit.unexplored` > 0: a better set may fit) marks
    the misses: the plans, those flagged, the misses over 0.5 and 2 points and those among
    them flagged, and the unflagged plans within 0.5 points; with ``--retry``, the flagged
    plans' misses after `fit` ran again with the budget its note advises, and how many
    came out better and worse."""
    plans = [r for r in rows if r["outcome"] == "plan" and r.get("gap") is not None]
    marked = [r for r in plans if r.get("unexplored")]
    out = {"plans": len(plans), "flagged": len(marked),
           "unflagged_within_0_5": sum(r["gap"] <= 0.005 + 1e-12 for r in plans
                                       if not r.get("unexplored"))}
    for name, bar in (("0_5", 0.005), ("2", 0.02)):
        out[f"misses_{name}"] = sum(r["gap"] > bar + 1e-12 for r in plans)
        out[f"flagged_misses_{name}"] = sum(r["gap"] > bar + 1e-12 for r in marked)
    again = [(r["gap"], r["retry"]) for r in marked if "retry" in r]
    if again:
        gaps = [(g, t.get("gap")) for g, t in again]
        out.update(retried=len(again),
                   retried_misses_0_5=sum(g is None or g > 0.005 + 1e-12 for _, g in gaps),
                   retried_misses_2=sum(g is None or g > 0.02 + 1e-12 for _, g in gaps),
                   retried_better=sum(g is not None and g < a - 1e-12 for a, g in gaps),
                   retried_worse=sum(g is None or g > a + 1e-12 for a, g in gaps),
                   retried_new_compiles=sum(t["compiles"] for _, t in again),
                   retried_all_fit=all(t["outcome"] == "plan" and t["fits"] for _, t in again))
    return out


def flagged_text(f: dict[str, Any]) -> str:
    """`flagged`'s figures, as a line."""
    text = (f"{f['flagged']} of {f['plans']} plans flagged; of the misses over 0.5 points "
            f"{f['flagged_misses_0_5']} of {f['misses_0_5']} flagged, over 2 points "
            f"{f['flagged_misses_2']} of {f['misses_2']}; unflagged plans within 0.5 points: "
            f"{f['unflagged_within_0_5']} of {f['plans'] - f['flagged']}")
    if "retried" in f:
        text += (f"; run again as advised: misses over 0.5 points among the flagged "
                 f"{f['flagged_misses_0_5']} -> {f['retried_misses_0_5']}, over 2 points "
                 f"{f['flagged_misses_2']} -> {f['retried_misses_2']} ({f['retried_better']} "
                 f"better, {f['retried_worse']} worse; {f['retried_new_compiles']} compiles "
                 f"made, {f['retried_new_compiles'] / f['retried']:.2f} a plan, the rest read "
                 "back by resume"
                 + ("" if f["retried_all_fit"] else ", NOT every plan fits") + ")")
    return text


def calibration_text(bins: Sequence[dict[str, Any]]) -> str:
    """`calibration`'s bins on one line: per bin, its compiles, mean chance and share that
    fit."""
    cells = [f"[{b['low']:g}, {b['high']:g}{']' if b['high'] == 1 else ')'}: "
             f"{b['compiles']}, {b['chance']:.2f}, {b['fit']:.2f}" for b in bins]
    return "; ".join(cells) if cells else "none"


CALIBRATION_BINS = (0.0, 0.05, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0)
"""The bins of `calibration`: chances the search gave, from the first edge up to (not
including) the next; the last bin includes 1."""


def calibration(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """How often the save sets the search compiled fit, against the chance it gave them
    (each row's ``chances``: [chance, fit] per compile with a model), per bin of
    `CALIBRATION_BINS`: the compiles, their mean chance and the share that fit. A search
    whose chances are right has the two equal in every bin."""
    pairs = [c for r in rows for c in r.get("chances", ())]
    out = []
    for i, (lo, hi) in enumerate(zip(CALIBRATION_BINS, CALIBRATION_BINS[1:])):
        last = i == len(CALIBRATION_BINS) - 2
        got = [(p, f) for p, f in pairs if lo <= p < hi or (last and p == hi)]
        if got:
            out.append({"low": lo, "high": hi, "compiles": len(got),
                        "chance": sum(p for p, _ in got) / len(got),
                        "fit": sum(bool(f) for _, f in got) / len(got)})
    return out


def trace_ranking(cands: Sequence[Any], get: Callable[[Any], dict[str, float]],
                  sizes: Sequence[int], share: float) -> dict[str, Any]:
    """What the trace's ranking alone costs, apart from the search's model of the bytes: at
    each of `sizes`, of the save sets (`cands`, `_search._Candidate`s; no remat's `saved`
    None) whose compiled bytes (`get(saved)`, a brute-force row) are within it, the one the
    trace ranks first (`_search._order`: least recompute FLOPs as the trace counts them),
    against the best by the compiled FLOPs (`_best`'s), in points of the no-remat step's
    FLOPs (`share`: `flops_share`). A search that knew every set's bytes and compiled none
    would miss by this; `fit` compiles its plan and the sets beside it, and takes the one
    whose compile counts fewest FLOPs (`_fit._fewest_ops`), so it can do better.

    Returns the sizes where some set fits (``sizes``), the share within 0.5 points, the
    sizes over 2 points and the largest gap (None where nothing fits anywhere)."""
    gaps = []
    for hbm in sizes:
        fits = [c for c in cands if get(c.saved)["bytes"] <= hbm]
        if not fits:
            continue
        first = fits[0]  # `cands` are in the search's order
        best = min(get(c.saved)["flops"] for c in fits)
        gaps.append(share * (get(first.saved)["flops"] - best))
    return {"sizes": len(gaps),
            "share_gap_le_0_5": (sum(g <= 0.005 + 1e-12 for g in gaps) / len(gaps)
                                 if gaps else None),
            "over_2": sum(g > 0.02 + 1e-12 for g in gaps),
            "gap_max": max(gaps) if gaps else None}


def step_trace_ranking(brute: Brute, graph: Any, sizes: Sequence[int]) -> dict[str, Any]:
    """`trace_ranking` of a swept step: every save set of `brute`'s tags as the search
    orders them (`_search._candidates`), against `brute`'s compiles at `sizes`."""
    SR = importlib.import_module("neuron_remat._search")
    return trace_ranking(SR._candidates(graph, brute.tags), brute.get, sizes,  # noqa: SLF001
                         flops_share(graph, brute.spec))


def trace_ranking_text(t: dict[str, Any]) -> str:
    """`trace_ranking` on one line."""
    if t["gap_max"] is None:
        return "no size has a set that fits"
    return (f"{100 * t['share_gap_le_0_5']:.0f}% of {t['sizes']} sizes within 0.5 points, "
            f"{t['over_2']} over 2, {100 * t['gap_max']:.2f} at most")


def flops_share(graph: Any, spec: Any) -> float:
    """One FLOP of a compiled step's cost analysis as a share of the no-remat step's FLOPs
    (as the trace counts them): XLA:CPU counts a scan body once, so a FLOP difference
    there is one layer's per scan, times the layers of a scan (two scans of 3 layers, an
    encoder and a decoder: times 3, not 6; scans of unequal lengths: their mean); an
    unrolled stack's, every layer's."""
    per = graph.count / len(graph.layers) if getattr(spec, "scan", True) else 1
    return per / graph.no_remat_flops


def _sizes(brute: Brute, n: int) -> list[int]:
    lo = min(brute.get(s)["bytes"] for s in brute.sets())
    hi = 1.05 * brute.get(None)["bytes"]
    return [int(lo + (hi - lo) * k / n) for k in range(n + 1)]


def _summary(rows: Sequence[dict[str, Any]], n_frontier: int, oracle: bool) -> dict[str, Any]:
    planned = [r for r in rows if r["outcome"] == "plan"]
    gaps = [r["gap"] for r in planned if r["gap"] is not None]
    fitting = [r for r in rows if r["best"] is not None or r.get("best_overhead") is not None]
    refusals = sum(1 for r in rows if r["outcome"] == "refused" and r["best_overhead"] is not None)
    compiles = [r["compiles"] for r in rows]
    cap = (math.log2(max(n_frontier, 1)) + 3) if oracle else 6
    return {
        "sizes": len(rows),
        "plans": len(planned),
        "all_fit": all(r["fits"] for r in planned),
        "states_truth": all(r["states_truth"] for r in planned),
        "gap_median": statistics.median(gaps) if gaps else None,
        "gap_p95": sorted(gaps)[max(0, math.ceil(0.95 * len(gaps)) - 1)] if gaps else None,
        "gap_max": max(gaps) if gaps else None,
        "share_gap_le_0_5": (sum(g <= 0.005 + 1e-12 for g in gaps) / len(gaps)) if gaps else None,
        "refusals_while_some_fits": refusals,
        "sizes_where_some_fits": len(fitting),
        "compiles_max": max(compiles) if compiles else 0,
        "compiles_median": statistics.median(compiles) if compiles else 0,
        "compile_cap": cap,
        "share_within_cap": sum(c <= cap for c in compiles) / len(compiles) if compiles else 0,
        "reported": sum(1 for r in rows if r["outcome"] == "reported"),
        "noticed": sum(1 for r in planned if r.get("noticed")),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = C.parser(__doc__.splitlines()[0], NAME)
    p.add_argument("--brute-only", action="store_true", help="fill the cache and stop")
    p.add_argument("--publish", action="store_true", help=PUBLISH_HELP)
    p.add_argument("--no-tables", action="store_true", help=NO_TABLES_HELP)
    p.add_argument("--cached-only", action="store_true",
                   help="compile nothing: sweep each step over the leading tags its cache "
                        "covers completely (a brute force cut short)")
    p.add_argument("--steps", default=None, help="comma-separated zoo steps (default all)")
    p.add_argument("--max-compiles", type=compile_budget, default=None, metavar="N",
                   help="give fit this compile budget (max_compiles=N, at least 3) instead "
                        "of its own: whether a miss is the budget's or the model's (the "
                        "'<=cap' column still counts the issue's cap)")
    p.add_argument("--spare", action="store_true",
                   help="the brute force also covers each tag outside fit's pool (cached as "
                        "<step>+spare.json; the pool must be whole) and fit runs without "
                        "candidates, its compiles of those tags on")
    p.add_argument("--steps-module", action="append", default=[], metavar="MODULE",
                   help="also sweep the steps of MODULE.STEPS (a dict name -> step with the "
                        "zoo's Spec protocol, e.g. tests.cpu.maxtext_zoo); repeatable")
    p.add_argument("--host-devices", type=device_count, default=None, metavar="N",
                   help="XLA:CPU makes N devices (XLA_FLAGS' "
                        "--xla_force_host_platform_device_count, set before JAX starts): "
                        "for steps laid out over several, e.g. tests.cpu.sharded_zoo's")
    p.add_argument("--bare-oracle", action="store_true", help=BARE_HELP)
    p.add_argument("--retry", type=retry_count, default=None, metavar="K", help=RETRY_HELP)
    args = p.parse_args(argv)
    say = C.Printer(args.quiet)
    if args.host_devices:
        C.host_devices(args.host_devices)
    C.prepare_compiles()
    import neuron_remat as nr  # noqa: PLC0415, F401

    F = importlib.import_module("neuron_remat._fit")
    SG = importlib.import_module("neuron_remat._step")
    SR = importlib.import_module("neuron_remat._search")
    import logging  # noqa: PLC0415

    logging.getLogger("neuron_remat.fit").setLevel(logging.ERROR)  # one note per fit
    zoo = _zoo()
    specs = {**zoo.ZOO, **_extra_steps(args.steps_module)}
    names = list(specs) if args.steps is None else args.steps.split(",")
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise SystemExit(f"fit_sweep: --steps {','.join(unknown)}: no such step; known: "
                         f"{', '.join(specs)}")
    max_tags, n_sizes = (3, 10) if args.small else (MAX_TAGS, 100)
    if args.small and args.steps is None:
        names = ["gqa4-adamw", "wide-attn-mqa-adafactor"]
    result: dict[str, Any] = {"steps": {}, "max_tags": max_tags,
                              "max_compiles": args.max_compiles}
    lines: list[str] = []
    for name in names:
        spec = specs[name]
        make_step, step_args = spec.make_step(), spec.abstract_args()
        graph = F.step_graph(make_step, *step_args)
        pool = own = SG._pool(graph, None)[:min(max_tags,
                                                spec.extra.get("brute_tags", max_tags))]
        path = args.out / "fit_brute" / f"{name}.json"
        if args.spare:
            pool, path = with_spare(name, graph, pool), path.with_name(f"{name}+spare.json")
        brute = Brute(spec, pool, path, not args.no_tables)
        say(f"{name} ({spec.split}): tags {', '.join(pool)}"
            + (f"; {brute.seeded} compiled sets from its committed table" if brute.seeded
               else ""))
        if args.cached_only:
            k = brute.complete_prefix()
            if k < 1:
                say(f"{name}: skipped (its cache covers no tag completely)")
                continue
            if k < len(pool):
                pool = pool[:k]
                brute = Brute(spec, pool, brute.path, not args.no_tables)
                say(f"{name}: the cache covers the first {k} tags completely; sweeping those")
            seconds = 0.0
        else:
            seconds = brute.fill(say)
        if args.publish:
            say(brute.publish())
        if args.brute_only:
            continue
        step = {"split": spec.split, "tags": list(pool), "brute_seconds": seconds,
                "full_remat_bytes": brute.get(())["bytes"],
                "no_remat_bytes": brute.get(None)["bytes"], "modes": {}}
        sizes = _sizes(brute, n_sizes)
        n_front = len(SR._frontier(SR._candidates(graph, own)))  # fit's pool
        step["trace_ranking"] = step_trace_ranking(brute, graph, sizes)
        for mode in modes(args.bare_oracle):
            rows = sweep_step(brute, mode, sizes, graph, F, zoo, args.max_compiles,
                              args.spare, args.retry)
            step["modes"][mode] = {"summary": _summary(rows, n_front,
                                                       mode != "memory_analysis"),
                                   "rows": rows}
        result["steps"][name] = step
    if not args.brute_only:
        result["done_when"] = _done_when(result)
        result["flagged"] = {mode: flagged(_mode_rows(result, mode))
                             for mode in _modes_of(result)}
        result["calibration"] = {mode: calibration(_mode_rows(result, mode))
                                 for mode in _modes_of(result)}
        lines = _report(result)
        result["fit_always_fits"] = all(
            m["summary"]["all_fit"] for st in result["steps"].values()
            for m in st["modes"].values())
        result["fit_refuses_only_when_nothing_fits"] = all(
            m["summary"]["refusals_while_some_fits"] == 0 for st in result["steps"].values()
            for m in st["modes"].values())
        result["fit_max_gap"] = max((m["summary"]["gap_max"] or 0.0)
                                    for st in result["steps"].values()
                                    for m in st["modes"].values()) if result["steps"] else 0.0
    text = "\n".join(lines)
    return C.finish(args, NAME, result, text, say)


PUBLISH_HELP = ("write each step's cache, once filled, as its committed table "
                "(benchmarks/brute_force/<step>.json, with the JAX that compiled it), from "
                "which a fresh clone's cache starts")


RETRY_HELP = ("where a plan says a better set may fit (its unexplored sets), run fit again "
              "with max_compiles as many more than it made as it left such sets, up to K (3: "
              "as its note advises), resuming the first plan (its compiles read back), and "
              "report both and the compiles the second made")


def retry_count(text: str) -> int:
    """``--retry``: an int of at least 1, checked as `compile_budget` checks its own."""
    from neuron_remat.cli import _count  # noqa: PLC0415

    return _count(1, what="a number of compiles")(text)


NO_TABLES_HELP = ("start no cache from the committed tables: compile what the cache in "
                  "--out lacks (to check a table against this compiler)")


def modes(bare: bool) -> tuple[str, ...]:
    """The modes a sweep runs: `MODES`, and with `bare` (``--bare-oracle``) `BARE`."""
    return (*MODES, BARE) if bare else MODES


def _mode_rows(result: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """Every step's rows of `result` swept in `mode`."""
    return [r for st in result["steps"].values() for r in st["modes"][mode]["rows"]]


def _modes_of(result: dict[str, Any]) -> tuple[str, ...]:
    """The modes the steps of `result` were swept in (`modes`' order)."""
    seen = {m for st in result["steps"].values() for m in st["modes"]}
    return tuple(m for m in (*MODES, BARE) if m in seen or m in MODES)


def _mode_label(mode: str) -> str:
    return {"memory_analysis": "compiled bytes read",
            "oracle": "compile failures as the oracle, simulated",
            BARE: "compile failures as the oracle without byte figures, simulated"}[mode]


def with_spare(name: str, graph: Any, pool: Sequence[str]) -> tuple[str, ...]:
    """``--spare``: `pool` (`fit`'s whole pool) and then each tag outside it that `fit`
    compiles alone (`_fit._spare`); one line naming the step when `pool` is cut short."""
    F = importlib.import_module("neuron_remat._fit")
    SG = importlib.import_module("neuron_remat._step")
    whole = SG._pool(graph, None)  # noqa: SLF001
    if len(pool) < len(whole):
        raise SystemExit(f"{name}: --spare needs the whole pool in the brute force "
                         f"({len(whole)} tags, not {len(pool)})")
    return (*pool, *(c.saved[0] for c in F._spare(graph, pool)))  # noqa: SLF001


def compile_budget(text: str) -> int:
    """``--max-compiles``: an int of at least 3 (full remat, every tag, one more), checked
    as ``neuron-remat fit --max-compiles`` checks it."""
    from neuron_remat.cli import _count  # noqa: PLC0415

    return _count(3, what="a compile budget")(text)


def device_count(text: str) -> int:
    """``--host-devices``: an int of at least 1, checked as the CLI checks its counts."""
    from neuron_remat.cli import _count  # noqa: PLC0415

    return _count(1, what="a device count")(text)


def tag_count(text: str) -> int:
    """``--tags``: how many tags a brute force covers, 1 to `MAX_TAGS` (2**8 sets at most),
    checked as the CLI checks its counts."""
    from neuron_remat.cli import _count  # noqa: PLC0415

    return _count(1, high=MAX_TAGS, what="a tag count")(text)


def stop_reasons(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Why `fit` stopped at the sizes where it missed by more than 2 points (the reason's
    figures left out), and how often: a spent budget, or a model that found nothing
    better plausible with compiles left."""
    why: dict[str, int] = {}
    for r in rows:
        if (r.get("gap") or 0.0) > 0.02 + 1e-12:
            reason = (r.get("stop") or "?").split(" (")[0]
            why[reason] = why.get(reason, 0) + 1
    return why


def why_stopped(rows: Sequence[dict[str, Any]]) -> str:
    """`stop_reasons` as one line ('' when no size missed by more than 2 points)."""
    why = stop_reasons(rows)
    return (f"{sum(why.values())} sizes over 2 points; fit stopped: "
            + "; ".join(f"{k} ({v})" for k, v in why.items())) if why else ""


def _why_misses(result: dict[str, Any], mode: str) -> list[str]:
    return [f"  {name}: {line}" for name, st in result["steps"].items()
            if (line := why_stopped(st["modes"][mode]["rows"]))]


def _done_when(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's "done when", per mode and split: every plan fits; the gap is at most
    0.5 points at >= 95% of each step's sizes and never over 2; no refusal while some set fits; at
    most 6 compiles (oracle: log2(frontier) + 3) at >= 90% of sizes; each plan states
    its own compile's figures. A split with no step swept fails (nothing was shown)."""
    out: dict[str, Any] = {}
    for mode in _modes_of(result):
        for split in ("train", "held-out"):
            rows = [r for st in result["steps"].values() if st["split"] == split
                    for r in st["modes"][mode]["rows"]]
            sums = [st["modes"][mode]["summary"] for st in result["steps"].values()
                    if st["split"] == split]
            gaps = [r["gap"] for r in rows if r.get("gap") is not None]
            share = sum(g <= 0.005 + 1e-12 for g in gaps) / len(gaps) if gaps else 1.0
            checks = {
                "some step was swept": bool(sums),
                "every plan fits": all(s["all_fit"] for s in sums),
                "gap <= 0.5 pt at >= 95% of sizes, on every step": all(
                    (s["share_gap_le_0_5"] is None or s["share_gap_le_0_5"] >= 0.95)
                    for s in sums),
                "gap never > 2 pt": all((g <= 0.02 + 1e-12) for g in gaps),
                "no refusal while some set fits": all(s["refusals_while_some_fits"] == 0
                                                      for s in sums),
                "compiles within the cap at >= 90% of sizes": all(
                    s["share_within_cap"] >= 0.9 for s in sums),
                "plans state their policy's compile": all(s["states_truth"] for s in sums),
            }
            out[f"{mode}/{split}"] = {"share_gap_le_0_5": share,
                                      "gap_max": max(gaps) if gaps else None,
                                      "checks": checks, "passed": all(checks.values())}
    return out


def _by_mode(title: str, figures: dict[str, Any], text: Callable[[Any], str]) -> list[str]:
    """A section of the report: `title`, a line per mode of `figures` (`text` of its
    figures), and a blank line."""
    return [title, *(f"  {mode}: {text(f)}" for mode, f in figures.items()), ""]


def _report(result: dict[str, Any]) -> list[str]:
    lines = [] if result.get("max_compiles") is None else [
        f"fit's budget: max_compiles={result['max_compiles']} (not its own; the <=cap column "
        "counts the issue's cap)", ""]
    for mode in _modes_of(result):
        rows = []
        for name, st in result["steps"].items():
            s = st["modes"][mode]["summary"]
            rows.append((name, st["split"], s["sizes"], s["plans"], s["reported"],
                         "yes" if s["all_fit"] else "NO",
                         "-" if s["gap_median"] is None else f"{100 * s['gap_median']:.2f}",
                         "-" if s["gap_p95"] is None else f"{100 * s['gap_p95']:.2f}",
                         "-" if s["gap_max"] is None else f"{100 * s['gap_max']:.2f}",
                         "-" if s["share_gap_le_0_5"] is None
                         else f"{100 * s['share_gap_le_0_5']:.0f}%",
                         s["refusals_while_some_fits"], f"{s['compiles_median']:g}",
                         s["compiles_max"], f"{s['compile_cap']:.3g}",
                         f"{100 * s['share_within_cap']:.0f}%", s["noticed"]))
        lines.append(f"fit with {mode} ({_mode_label(mode)}):")
        lines.append(C.table(rows, ("step", "split", "sizes", "plans", "reported", "fit",
                                    "gap med", "gap p95", "gap max", "gap<=0.5",
                                    "refusals", "compiles med", "max", "cap", "<=cap",
                                    "noticed")))
        lines += _why_misses(result, mode)
        lines.append("")
    lines.append("ranked by the trace, every set's compiled bytes known (what the "
                 "ranking alone costs, apart from the model of the bytes):")
    for name, st in result["steps"].items():
        lines.append(f"  {name}: {trace_ranking_text(st['trace_ranking'])}")
    lines.append("")
    lines += _by_mode("the plans that say a better set may fit (every step, by mode):",
                      result["flagged"], flagged_text)
    lines += _by_mode("the search's chances against the compiles (every step, by mode): "
                      "compiles, mean chance given, share that fit", result["calibration"],
                      calibration_text)
    lines.append("done when (gap in points of the no-remat step's FLOPs):")
    for key, d in result["done_when"].items():
        bad = [k for k, v in d["checks"].items() if not v]
        lines.append(f"  {key}: {'PASS' if d['passed'] else 'FAIL: ' + '; '.join(bad)} "
                     f"(gap <= 0.5 pt at {100 * d['share_gap_le_0_5']:.0f}% of sizes, max "
                     + ("-" if d["gap_max"] is None else f"{100 * d['gap_max']:.2f}") + " pt)")
    return lines


if __name__ == "__main__":
    main()
