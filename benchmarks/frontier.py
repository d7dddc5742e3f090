"""The remat frontier: how close the planner's policy is to the best possible, in one run.

On a stack of reference decoder layers (`reference` (tests/cpu/reference.py): GQA, gated SiLU FFN,
axlearn-style tags), for every policy this compiles the gradient step
``jax.jit(jax.grad(loss)).lower(...).compile()`` on the CPU backend and records:

* compiled FLOPs (``cost_analysis()["flops"]``) of a ``lax.scan`` over the layers. XLA's
  cost analysis counts a while-loop body once, so with two or more layers the figure is
  per layer: ``flops(policy) - flops(no remat)`` is the recompute of one layer and
  ``flops(policy) / flops(no remat) - 1`` its recompute overhead;
* the bytes JAX saves for the backward per layer (``saved_residuals`` of one checkpointed
  layer, activations only: parameter arguments are left out);
* compiled temp bytes (``memory_analysis().temp_size_in_bytes``) at several layer counts
  (4, 8, 16), and their least-squares slope per layer: what each extra layer keeps alive
  in the compiled program (buffer packing makes it differ from the saved bytes for a few
  policies).

Policies: no remat, full remat, JAX's ``dots_saveable`` and
``dots_with_no_batch_dims_saveable``, every `neuron_remat.PRESETS` entry (axlearn's TRN2
choice ``trn2-fuji-70b`` among them), MaxText's named policies written as save sets of
axlearn tags, and the planner's choice (`plan_footprint(layer_footprint(...), ...)`) at several
per-layer budgets from full remat up to saving every tag. The same planner on a
`traced_footprint` (the graph of the traced layer, evaluated jointly) is shown beside it.

The fused q/k/v variant (axlearn's ``FusedGroupedQKVLinear``, the base Fuji layers: one
matmul, three tagged slices) runs the same way with the traced footprint as the planner's
only model: no remat, full remat, axlearn's TRN2 regex ``.*[kqv]_proj|.*linear1_[01]`` and
its default regex ``.*([qkvo]_proj|context)`` as hand-written rows, the planner at the same
budgets and at each regex's own byte budget, and the optimum over the tag subsets. The
footprint and plan timings are printed with it.

For each budget it reports the planner's overhead, the best overhead of any listed
hand-written policy whose measured saved bytes fit, and the exhaustive optimum over every
subset of the layer's 8 non-input tags: the saved bytes of all 256 subsets are measured
with ``saved_residuals``; subsets that save the same residuals compile to the same program,
so each distinct program (128 here) is compiled once (``--exhaustive all``, the default,
also with ``--small``). ``--exhaustive top`` compiles only the `--top` best subsets per
budget by the analytic model: that is no optimum (the model picks the candidates), so the
results then carry ``best_of_top`` instead of ``optimum`` and no planner-vs-optimum claim.
With ``--small`` (the smoke run) the programs' figures are read from a committed table
(`PROGRAMS_SMALL`, keyed by each lowered program's text) where this compiler wrote it,
and three of them are compiled again and held to it; ``--no-tables`` compiles them all.

Nothing here is executed, so code generation is made cheap: the CPU backend's legacy
(non-MLIR) fusion emitters at LLVM -O0 (``xla_cpu_use_fusion_emitters=False``,
``xla_backend_optimization_level=0``), five times faster to compile. The HLO passes that
decide FLOPs and buffer assignment run as usual; every run recompiles one policy with the
default options and records that both analyses agree (``codegen_check``); ``--default-codegen``
uses the default options throughout.

Ties: subsets the analytic model prices the same (``k_proj`` vs ``v_proj``, ``q_proj`` vs
``k_proj`` + ``v_proj`` of equal size) differ in compiled FLOPs by a few scalar FLOPs of XLA
bookkeeping, so "the planner matches the optimum" is judged to `TIE` (a fraction of the
no-remat step, ~1e-6: a dozen FLOPs of 10^7).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.ad_checkpoint import saved_residuals  # noqa: E402

import _common as C  # noqa: E402
import neuron_remat as nr  # noqa: E402
import reference as ref  # noqa: E402
from neuron_remat.graph import LayerGraph, Value  # noqa: E402
from neuron_remat.memory_model import layer_graph  # noqa: E402

NAME = "frontier"
NO_REMAT = "none"  # `reference.stack`'s marker for "no jax.checkpoint at all"
TIE = 1e-6
FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}

# MaxText's named policies (MaxText/layers/decoders.py) as save sets of tag roles; MaxText's
# mlpwi_0/mlpwi_1/mlpwo/out_proj are axlearn's linear1_0/linear1_1/linear2/o_proj.
MAXTEXT = {
    "minimal": ("q_proj", "k_proj", "v_proj", "o_proj", "linear1_0", "linear1_1", "linear2"),
    "minimal_with_context": ("q_proj", "k_proj", "v_proj", "context", "o_proj", "linear1_0",
                             "linear1_1", "linear2"),
    "save_dot_with_context_except_mlp": ("q_proj", "k_proj", "v_proj", "context", "o_proj"),
    "save_dot_except_mlpwi": ("q_proj", "k_proj", "v_proj", "o_proj", "linear2"),
    "save_dot_except_mlp": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "save_qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "save_out_proj": ("o_proj",),
}


@dataclass(frozen=True)
class Residuals:
    """What JAX saves for one layer's backward under a policy."""

    signature: tuple[Any, ...]  # identifies the compiled program (see `Bench.residuals`)
    bytes: int  # activations: tags, the layer input, unnamed intermediates
    param_bytes: int  # parameter arguments (model state, not counted)


@dataclass(frozen=True)
class Compiled:
    flops: float
    temp_bytes: int
    seconds: float


@dataclass
class Row:
    """One policy, what the analytic model predicts for it, and what was measured."""

    name: str
    group: str  # baseline, jax, preset, maxtext, planner, planner-traced
    policy: Any
    predicted_bytes: int
    predicted_flops: float
    roles: tuple[str, ...] | None = None  # tag roles saved (name policies)
    budget: int | None = None  # planner rows: the per-layer budget it was given
    residuals: Residuals | None = None
    compiled: dict[int, Compiled] = field(default_factory=dict)

    def flops(self, layers: int) -> float:
        return self.compiled[layers].flops


def compile_lowered(lowered: Any, options: dict[str, Any], t0: float) -> Compiled:
    """XLA's FLOPs and temp bytes of `lowered` compiled with `options`; its compile time
    counted from `t0` (the lowering's start)."""
    exe = lowered.compile(options) if options else lowered.compile()
    seconds = time.perf_counter() - t0
    cost = exe.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
        cost = cost[0]
    return Compiled(float(cost["flops"]), int(exe.memory_analysis().temp_size_in_bytes),
                    seconds)


PROGRAMS_SMALL = C.REPO / "benchmarks" / "brute_force" / "frontier-small.json"
"""``--small``'s compiles, committed (``--write-programs`` writes them): the smoke run in
CI reads its 277 programs from here where the same compiler made them, instead of
compiling each (191 s -> 75 s for the whole script on 2 cores)."""


class ProgramTable:
    """XLA's figures of compiled programs, by the SHA-256 of the lowered program's text and
    the compile options, with the compiler that made them (`fit_sweep.compiled_with`). A
    program is served only where this compiler is that one; a changed layer lowers to
    another text, so it is compiled, never served a stale row."""

    def __init__(self, path: Path, read: bool = True) -> None:
        import fit_sweep  # noqa: PLC0415  (compiled_with, written_here)

        self.path, self.here = path, fit_sweep.compiled_with()
        self.served = self.added = self.checked = 0
        data = fit_sweep.written_here(path) if read else None
        self.rows: dict[str, list[float]] = {} if data is None else data["programs"]

    @staticmethod
    def _key(lowered: Any, options: dict[str, Any]) -> str:
        return C.program_key(lowered.as_text(), options)

    def row(self, lowered: Any, options: dict[str, Any]) -> Compiled | None:
        """The table's figures of `lowered` compiled with `options`; None where it has
        none."""
        row = self.rows.get(self._key(lowered, options))
        return None if row is None else Compiled(float(row[0]), int(row[1]), float(row[2]))

    def get(self, lowered: Any, options: dict[str, Any]) -> Compiled | None:
        """`row`, counted as served."""
        out = self.row(lowered, options)
        self.served += out is not None
        return out

    def put(self, lowered: Any, options: dict[str, Any], c: Compiled) -> None:
        self.rows[self._key(lowered, options)] = [c.flops, c.temp_bytes, c.seconds]
        self.added += 1

    def write(self) -> Path:
        return C.write_json(self.path, {"compiled_with": self.here,
                                        "programs": dict(sorted(self.rows.items()))})

    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "served": self.served, "compiled": self.added,
                "checked_here": self.checked}


class Bench:
    """The layer stack, and cached measurements: one compile per distinct program."""

    def __init__(self, size: C.Size, layers: Sequence[int], compile_options: dict[str, Any],
                 dtype: str = "float32", device: Any = None, fused_qkv: bool = False) -> None:
        # Arrays are committed to `device` (the CPU unless told), so programs compile for
        # it even where another backend is the default.
        self.device = device if device is not None else jax.devices("cpu")[0]
        self.size = size
        self.layers = tuple(layers)
        self.config = size.config(max(self.layers))
        self.shape = dataclasses.replace(size.shape(), activation_dtype=dtype)
        self.dtype = jnp.dtype(dtype)
        self.graph: LayerGraph = layer_graph(self.config, self.shape)
        self.footprint = nr.layer_footprint(self.config, self.shape)
        self.tags = ref.tag_names(self.config)  # role -> the tag the layer emits
        self.roles = tuple(r for r in self.tags if r != "input")
        # Nothing is executed, so values do not matter: fill the reference layer's shapes
        # with numpy noise (eager jax.random would compile a dozen small programs).
        rng = np.random.default_rng(0)
        shapes = jax.eval_shape(
            lambda k: ref.init_layer(k, self.config, self.dtype, fused_qkv=fused_qkv),
            jax.random.PRNGKey(0))

        def fill(shape: tuple[int, ...]) -> jax.Array:
            host = (rng.standard_normal(shape, np.float32) * 0.05).astype(self.dtype)
            return jax.device_put(host, self.device)

        self.x = fill((size.batch, size.seq, size.hidden))
        self.layer_params = jax.tree.map(lambda s: fill(s.shape), shapes)
        self.stack_params = {n: jax.tree.map(lambda s, n=n: fill((n, *s.shape)), shapes)
                             for n in self.layers}
        self.compile_options = compile_options
        self._residuals: dict[Any, Residuals] = {}
        self._compiled: dict[tuple[Any, int], Compiled] = {}
        self.compile_seconds = 0.0
        self.programs: ProgramTable | None = None  # compiles served by lowered text

    def layer_fn(self, x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        return ref.layer(x, p, self.config)

    def residuals(self, policy: Any) -> Residuals:
        """Activation residuals of one layer under `policy`, from ``saved_residuals``.

        The signature is the sorted list of (aval, provenance) of every activation
        residual: two policies that save the same residuals differ only in the policy
        function, so they compile to the same program (checked: a `RegexPolicy` and
        ``save_only_these_names`` with the same tags, and a set with and without
        ``linear2``, give identical FLOPs and temp bytes).
        """
        if policy in self._residuals:
            return self._residuals[policy]
        plain = isinstance(policy, str)
        fn = self.layer_fn if plain else jax.checkpoint(self.layer_fn, policy=policy,
                                                         prevent_cse=False)
        entries, act, par = [], 0, 0
        for aval, src in saved_residuals(fn, self.x, self.layer_params):
            nbytes = int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
            if src.startswith("from the argument p"):
                par += nbytes
                continue
            act += nbytes
            entries.append((aval.str_short(), src))
        res = Residuals(("no-remat" if plain else "checkpoint", *sorted(entries)), act, par)
        self._residuals[policy] = res
        return res

    def compile(self, policy: Any, layers: int, options: dict[str, Any] | None = None
                ) -> Compiled:
        """Compiled FLOPs and temp bytes of the gradient step over `layers` scanned layers.

        Cached per distinct program; `options` (XLA compile options other than the bench's)
        bypass the cache."""
        key = (self.residuals(policy).signature, layers)
        if options is None and key in self._compiled:
            return self._compiled[key]
        t = time.perf_counter()
        lowered = self._lower(policy, layers)
        opts = self.compile_options if options is None else options
        served = None if self.programs is None or options is not None else \
            self.programs.get(lowered, opts)
        if served is not None:
            out = served
        else:
            out = compile_lowered(lowered, opts, t)
            if self.programs is not None and options is None:
                self.programs.put(lowered, opts, out)
        self.compile_seconds += out.seconds
        if options is None:
            self._compiled[key] = out
        return out

    def check_programs(self, policy: Any, layers: int) -> None:
        """Compile `policy`'s program here and hold the table's row to it (SystemExit on
        a difference: the table is not this compiler's)."""
        if self.programs is None:
            return
        lowered = self._lower(policy, layers)
        row = self.programs.row(lowered, self.compile_options)
        if row is None:
            return
        real = compile_lowered(lowered, self.compile_options, time.perf_counter())
        self.programs.checked += 1
        if (real.flops, real.temp_bytes) != (row.flops, row.temp_bytes):
            raise SystemExit(f"{self.programs.path}: a program compiles here to "
                             f"{real.flops} FLOPs, {real.temp_bytes} temp bytes, the table "
                             f"says {row.flops}, {row.temp_bytes}: write it again "
                             "(--write-programs) or run with --no-tables")

    def _lower(self, policy: Any, layers: int) -> Any:
        """The gradient step over `layers` scanned layers under `policy`, lowered."""
        config = self.config

        def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
            return jnp.mean(ref.stack(x, p, config, policy=policy, scan=True) ** 2)

        return jax.jit(jax.grad(loss)).lower(self.stack_params[layers], self.x)

    def cached(self, policy: Any, layers: int) -> Compiled | None:
        return self._compiled.get((self.residuals(policy).signature, layers))

    @property
    def programs_compiled(self) -> int:
        return len(self._compiled)

    # Analytic predictions -------------------------------------------------------------

    def predict_roles(self, roles: Sequence[str]) -> tuple[int, float]:
        ev = self.graph.evaluate_roles(roles)
        return ev.kept_bytes, float(ev.recompute_flops)

    def predict(self, saved: Callable[[Value], bool]) -> tuple[int, float]:
        ev = self.graph.evaluate(saved)
        return ev.kept_bytes, float(ev.recompute_flops)

    def names_policy(self, roles: Sequence[str]) -> Any:
        return jax.checkpoint_policies.save_only_these_names(*(self.tags[r] for r in roles))

    def regex_roles(self, policy: nr.RegexPolicy) -> tuple[str, ...]:
        return tuple(r for r in self.roles if policy.action(self.tags[r]) == "save")


# --------------------------------------------------------------------------------------
# The policies.
# --------------------------------------------------------------------------------------


def hand_written(bench: Bench) -> list[Row]:
    """Every hand-written policy: baselines, JAX's, the presets, MaxText's."""
    cp = jax.checkpoint_policies
    rows = [
        Row("no remat", "baseline", NO_REMAT, bench.graph.no_remat_bytes(), 0.0),
        Row("full remat (nothing_saveable)", "baseline", cp.nothing_saveable,
            *bench.predict(lambda v: False), roles=()),
        Row("dots_saveable", "jax", cp.dots_saveable, *bench.predict(lambda v: v.dot)),
        Row("dots_with_no_batch_dims_saveable", "jax", cp.dots_with_no_batch_dims_saveable,
            *bench.predict(lambda v: v.dot and not v.batch_dot)),
    ]
    for name, preset in nr.PRESETS.items():
        roles = bench.regex_roles(preset.policy)
        rows.append(Row(f"preset {name}", "preset", preset.policy,
                        *bench.predict_roles(roles), roles=roles))
    for name, roles in MAXTEXT.items():
        rows.append(Row(f"maxtext {name}", "maxtext", bench.names_policy(roles),
                        *bench.predict_roles(roles), roles=roles))
    return rows


def budgets(bench: Bench, count: int) -> list[int]:
    """`count` per-layer budgets, evenly spaced from what full remat keeps to what saving
    every tag keeps (analytic figures)."""
    low, _ = bench.predict_roles(())
    high, _ = bench.predict_roles(bench.roles)
    return sorted({int(round(b)) for b in np.linspace(low, high, count)})


def planner_rows(bench: Bench, budget_list: Sequence[int], traced: nr.Footprint | None
                 ) -> list[Row]:
    """The planner's choice at each budget (analytic footprint, and traced if given)."""
    rows = []
    for group, fp in (("planner", bench.footprint), ("planner-traced", traced)):
        if fp is None:
            continue
        for b in budget_list:
            p = nr.plan_footprint(footprint=fp, budget_bytes=b)
            roles = bench.regex_roles(p.policy)
            label = "planner" if group == "planner" else "planner (traced)"
            rows.append(Row(f"{label} @ {C.kib(b)} KiB", group, p.policy,
                            p.kept_bytes_per_layer, p.recompute_flops_per_layer,
                            roles=roles, budget=b))
    return rows


# --------------------------------------------------------------------------------------
# Measurement.
# --------------------------------------------------------------------------------------


@dataclass
class Subset:
    roles: tuple[str, ...]
    policy: Any
    residuals: Residuals
    predicted_bytes: int
    predicted_flops: float


def subsets(bench: Bench) -> list[Subset]:
    """Every subset of the non-input tags, with measured saved bytes (no compile)."""
    out = []
    for r in range(len(bench.roles) + 1):
        for roles in itertools.combinations(bench.roles, r):
            policy = bench.names_policy(roles)
            out.append(Subset(roles, policy, bench.residuals(policy),
                              *bench.predict_roles(roles)))
    return out


def compile_subsets(bench: Bench, subs: list[Subset], budget_list: Sequence[int],
                    mode: str, top: int) -> None:
    """Compile the subsets' programs: all distinct ones, or the `top` best per budget by
    the analytic model among those whose measured bytes fit."""
    layers = bench.layers[0]
    if mode == "all":
        todo = subs
    else:
        todo, seen = [], set()
        for b in budget_list:
            fit = sorted((s for s in subs if s.residuals.bytes <= b),
                         key=lambda s: (s.predicted_flops, s.residuals.bytes))
            picked = []
            for s in fit:
                if s.residuals.signature not in {p.residuals.signature for p in picked}:
                    picked.append(s)
                if len(picked) == top:
                    break
            for s in picked:
                if s.residuals.signature not in seen:
                    seen.add(s.residuals.signature)
                    todo.append(s)
    for s in todo:
        bench.compile(s.policy, layers)


def measure(args: Any, say: C.Printer) -> dict[str, Any]:
    size = C.SIZES["small" if args.small else "default"]
    layers = tuple(int(v) for v in args.layers.split(","))
    if len(layers) < 2 or min(layers) < 2:
        raise SystemExit("--layers needs two or more layer counts, each >= 2")
    t0 = time.perf_counter()
    bench = Bench(size, layers, {} if args.default_codegen else FAST_CODEGEN)
    bench.programs = programs_of(args)
    say(f"layer: hidden {size.hidden}, heads {size.heads} (kv {size.kv_heads}), ffn "
        f"{size.ffn}, seq {size.seq}, micro-batch {size.batch}, float32; scan over "
        f"{list(layers)} layers")
    budget_list = budgets(bench, args.budgets)
    traced = None
    if not args.no_traced:
        traced = nr.traced_footprint(bench.layer_fn, bench.x, bench.layer_params)
    rows = hand_written(bench) + planner_rows(bench, budget_list, traced)
    for row in rows:
        row.residuals = bench.residuals(row.policy)
        for n in layers:
            row.compiled[n] = bench.compile(row.policy, n)
    named_programs = bench.programs_compiled
    subs = subsets(bench)
    t_sub = time.perf_counter()
    compile_subsets(bench, subs, budget_list, args.exhaustive, args.top)
    say(f"compiled {named_programs} programs for the named policies and "
        f"{bench.programs_compiled - named_programs} more for the subsets "
        f"({time.perf_counter() - t_sub:.0f} s)")
    check = codegen_check(bench, rows)
    for row in rows[:3]:  # served rows held to this compiler: no remat, full, dots
        bench.check_programs(row.policy, layers[0])
    out = summarise(bench, rows, subs, budget_list, args, time.perf_counter() - t0) | {
        "codegen_check": check}
    if not args.no_fused:
        t_fused = time.perf_counter()
        out["fused"] = measure_fused(size, layers[0], bench.compile_options, args,
                                     bench.programs)
        say(f"fused q/k/v variant measured ({time.perf_counter() - t_fused:.0f} s)")
    if bench.programs is not None:
        out["programs"] = bench.programs.summary()
        say(f"{bench.programs.served} programs served from {bench.programs.path} "
            f"({bench.programs.checked} of them compiled again here and equal), "
            f"{bench.programs.added} compiled")
        if args.write_programs:
            say(f"wrote {bench.programs.write()}")
    return out


def programs_of(args: Any) -> ProgramTable | None:
    """The table of compiled programs the run reads (``--small``: `PROGRAMS_SMALL`, unless
    ``--no-tables``) or writes (``--write-programs``)."""
    if args.write_programs:
        if args.write_programs == PROGRAMS_SMALL and not args.small:
            raise SystemExit(f"--write-programs: {PROGRAMS_SMALL} holds --small's programs; "
                             "give another path for these sizes")
        return ProgramTable(args.write_programs, read=False)
    if args.small and not args.no_tables:
        return ProgramTable(PROGRAMS_SMALL)
    return None


AXLEARN_TRN2 = r".*[kqv]_proj|.*linear1_[01]"
AXLEARN_DEFAULT = r".*([qkvo]_proj|context)"


def measure_fused(size: C.Size, layers: int, options: dict[str, Any], args: Any,
                  programs: ProgramTable | None = None) -> dict[str, Any]:
    """The fused q/k/v layer, planned from its traced footprint (see the module docstring)."""
    bench = Bench(size, (layers,), options, fused_qkv=True)
    bench.programs = programs
    t = time.perf_counter()
    fp = nr.traced_footprint(bench.layer_fn, bench.x, bench.layer_params)
    footprint_s = time.perf_counter() - t
    tags = [t for t in fp if not fp[t].always_kept]
    cp = jax.checkpoint_policies
    hand: list[tuple[str, Any, tuple[str, ...] | None]] = [
        ("no remat", NO_REMAT, None), ("full remat", cp.nothing_saveable, ())]
    for name, regex in (("axlearn TRN2 regex", AXLEARN_TRN2),
                        ("axlearn default regex", AXLEARN_DEFAULT)):
        policy = nr.RegexPolicy([regex])
        hand.append((name, policy, tuple(t for t in tags if policy.action(t) == "save")))
    low, _ = fp.evaluate(())
    high, _ = fp.evaluate(tags)
    budget_list = sorted({int(round(b)) for b in np.linspace(low, high, args.budgets)})
    specials = {name: fp.evaluate(saved)[0] for name, _, saved in hand[2:]}
    plans, plan_ms = [], []
    for b in sorted(set(budget_list) | set(specials.values())):
        t = time.perf_counter()
        p = nr.plan_footprint(footprint=fp, budget_bytes=b)
        plan_ms.append(1e3 * (time.perf_counter() - t))
        plans.append((b, p))
    rows = []

    def row(name: str, group: str, policy: Any, saved: tuple[str, ...] | None,
            budget: int | None = None) -> dict[str, Any]:
        res = bench.residuals(policy)
        if saved is None:
            pred = (fp.no_remat_bytes, 0.0)
        else:
            pred = fp.evaluate(saved)
        return {"name": name, "group": group, "tags": None if saved is None else list(saved),
                "budget_bytes": budget, "saved_bytes": res.bytes, "predicted_bytes": pred[0],
                "predicted_recompute_flops": pred[1],
                "flops": bench.compile(policy, layers).flops}

    for name, policy, saved in hand:
        rows.append(row(name, "hand", policy, saved))
    for b, p in plans:
        rows.append(row(f"planner @ {C.kib(b)} KiB", "planner", p.policy, p.saved_tags, b))
    base = rows[0]["flops"]
    for r in rows:
        r["recompute_flops"] = r["flops"] - base
        r["overhead"] = _overhead(r["flops"], base)
    subs = []
    for n in range(len(tags) + 1):
        for saved in itertools.combinations(tags, n):
            policy = jax.checkpoint_policies.save_only_these_names(*saved)
            pb, pf = fp.evaluate(saved)
            subs.append({"tags": list(saved), "policy": policy, "predicted_bytes": pb,
                         "predicted_recompute_flops": pf,
                         "saved_bytes": bench.residuals(policy).bytes})
    for b in budget_list + list(specials.values()):
        fit = sorted((s for s in subs if s["saved_bytes"] <= b),
                     key=lambda s: (s["predicted_recompute_flops"], s["saved_bytes"]))
        for s in fit if args.exhaustive == "all" else fit[:args.top]:
            bench.compile(s["policy"], layers)
    for s in subs:
        c = bench.cached(s.pop("policy"), layers)
        s["recompute_flops"] = None if c is None else c.flops - base
        s["overhead"] = None if c is None else _overhead(c.flops, base)
    per_budget = []
    for b in budget_list:
        mine = next(r for r in rows if r["group"] == "planner" and r["budget_bytes"] == b)
        cands = [s for s in subs if s["overhead"] is not None and s["saved_bytes"] <= b]
        opt = min(cands, key=lambda s: (s["overhead"], s["saved_bytes"]))
        fit = [r for r in rows if r["group"] == "hand" and r["saved_bytes"] <= b]
        best = min(fit, key=lambda r: (r["overhead"], r["saved_bytes"]), default=None)
        best_subset = {k: opt[k] for k in ("tags", "saved_bytes", "overhead")}
        entry = {
            "budget_bytes": b, "planner": {k: mine[k] for k in ("tags", "saved_bytes",
                                                                 "overhead")},
            "optimum": best_subset if args.exhaustive == "all" else None,
            "best_hand_written": None if best is None else {
                k: best[k] for k in ("name", "saved_bytes", "overhead")}}
        if args.exhaustive == "all":
            entry["planner_minus_optimum"] = mine["overhead"] - opt["overhead"]
        else:
            entry["best_of_top"] = best_subset
        per_budget.append(entry)
    against = []
    for name, b in specials.items():
        regex = next(r for r in rows if r["name"] == name)
        mine = next(r for r in rows if r["group"] == "planner" and r["budget_bytes"] == b)
        against.append({"regex": name, "budget_bytes": b, "regex_overhead": regex["overhead"],
                        "planner_tags": mine["tags"], "planner_overhead": mine["overhead"],
                        "planner_saved_bytes": mine["saved_bytes"]})
    return {
        "footprint_seconds": footprint_s, "plan_ms": plan_ms,
        "plan_ms_median": float(np.median(plan_ms)),
        "tags": list(fp), "groups": [dataclasses.asdict(g) | {"label": g.label}
                                     for g in fp.groups],
        "per_tag": {t: {"bytes": c.bytes, "recompute_flops": c.recompute_flops}
                    for t, c in fp.items()},
        "no_remat_flops": base, "policies": rows, "subsets": subs, "budgets": per_budget,
        "against_regexes": against,
    }


def codegen_check(bench: Bench, rows: list[Row]) -> dict[str, Any]:
    """Recompile axlearn's TRN2 preset with XLA's default options: same FLOPs and temp
    bytes as the cheap code generation used throughout?"""
    row = next(r for r in rows if r.name == "preset trn2-fuji-70b")
    n = bench.layers[0]
    fast = row.compiled[n]
    default = bench.compile(row.policy, n, options={})
    return {"policy": row.name, "layers": n, "options": bench.compile_options,
            "same": (fast.flops, fast.temp_bytes) == (default.flops, default.temp_bytes),
            "fast": [fast.flops, fast.temp_bytes, fast.seconds],
            "default": [default.flops, default.temp_bytes, default.seconds]}


def _overhead(flops: float, base: float) -> float:
    return flops / base - 1.0


def summarise(bench: Bench, rows: list[Row], subs: list[Subset], budget_list: Sequence[int],
              args: Any, seconds: float) -> dict[str, Any]:
    n0, n1 = bench.layers[0], bench.layers[-1]
    base = next(r for r in rows if isinstance(r.policy, str))
    base_flops = base.flops(n0)

    def row_dict(r: Row) -> dict[str, Any]:
        assert r.residuals is not None
        temps = {n: r.compiled[n].temp_bytes for n in bench.layers}
        slope = _fit_slope(list(temps), list(temps.values()))
        steps = [(a, b) for a, b in zip(bench.layers, bench.layers[1:])]
        slopes = {f"{a}-{b}": (temps[b] - temps[a]) / (b - a) for a, b in steps}
        flops = r.flops(n0)
        return {
            "name": r.name, "group": r.group, "budget_bytes": r.budget,
            "roles": list(r.roles) if r.roles is not None else None,
            "tags": [bench.tags[x] for x in r.roles] if r.roles is not None else None,
            "saved_bytes": r.residuals.bytes,
            "param_residual_bytes": r.residuals.param_bytes,
            "predicted_bytes": r.predicted_bytes,
            "flops": flops,
            "flops_by_layers": {n: r.compiled[n].flops for n in bench.layers},
            "recompute_flops": flops - base_flops,
            "predicted_recompute_flops": r.predicted_flops,
            "overhead": _overhead(flops, base_flops),
            "temp_bytes": temps,
            "temp_slope_bytes": slope,
            "temp_slopes_bytes": slopes,
            "compile_seconds": r.compiled[n0].seconds,
        }

    out_rows = [row_dict(r) for r in rows]
    out_subs = []
    for s in subs:
        c = bench.cached(s.policy, n0)
        out_subs.append({
            "roles": list(s.roles), "saved_bytes": s.residuals.bytes,
            "predicted_bytes": s.predicted_bytes,
            "predicted_recompute_flops": s.predicted_flops,
            "flops": c.flops if c else None,
            "recompute_flops": c.flops - base_flops if c else None,
            "overhead": _overhead(c.flops, base_flops) if c else None,
        })
    hand = [r for r in out_rows if r["group"] not in ("planner", "planner-traced")]
    per_budget = []
    for b in budget_list:
        entry: dict[str, Any] = {"budget_bytes": b}
        for group in ("planner", "planner-traced"):
            mine = next((r for r in out_rows if r["group"] == group and r["budget_bytes"] == b),
                        None)
            if mine is not None:
                entry[group] = {"roles": mine["roles"], "saved_bytes": mine["saved_bytes"],
                                "fits": mine["saved_bytes"] <= b, "overhead": mine["overhead"],
                                "predicted_bytes": mine["predicted_bytes"]}
        fit = [r for r in hand if r["saved_bytes"] <= b]
        best = min(fit, key=lambda r: (r["overhead"], r["saved_bytes"]), default=None)
        entry["best_hand_written"] = None if best is None else {
            "name": best["name"], "overhead": best["overhead"],
            "saved_bytes": best["saved_bytes"]}
        entry["hand_written_that_fit"] = [r["name"] for r in fit]
        cands = [s for s in out_subs if s["flops"] is not None and s["saved_bytes"] <= b]
        opt = min(cands, key=lambda s: (s["flops"], s["saved_bytes"]), default=None)
        best_subset = None if opt is None else {
            "roles": opt["roles"], "overhead": opt["overhead"],
            "saved_bytes": opt["saved_bytes"]}
        exhaustive = args.exhaustive == "all"
        entry["optimum"] = best_subset if exhaustive else None
        if not exhaustive:
            entry["best_of_top"] = best_subset
        entry["subsets_that_fit"] = sum(1 for s in out_subs if s["saved_bytes"] <= b)
        entry["subsets_compiled_that_fit"] = len(cands)
        if "planner" in entry and opt is not None and exhaustive:
            entry["planner_minus_optimum"] = entry["planner"]["overhead"] - opt["overhead"]
        if "planner" in entry and best is not None:
            entry["planner_minus_best_hand_written"] = (entry["planner"]["overhead"]
                                                        - best["overhead"])
        per_budget.append(entry)
    spread = max(abs(r["flops_by_layers"][n1] / r["flops_by_layers"][n0] - 1)
                 for r in out_rows)
    return {
        "size": bench.size.to_dict(), "layers": list(bench.layers),
        "dtype": "float32", "backend": jax.default_backend(), "jax": jax.__version__,
        "compile_options": bench.compile_options, "tie": TIE,
        "exhaustive": args.exhaustive if args.exhaustive == "all" else f"top-{args.top}",
        "no_remat_flops": base_flops,
        "forward_flops_predicted": bench.footprint.forward_flops,
        "flops_layer_count_spread": spread,
        "policies": out_rows, "subsets": out_subs, "budgets": per_budget,
        "programs_compiled": bench.programs_compiled,
        "compile_seconds": bench.compile_seconds, "seconds": seconds,
    }


def _fit_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


# --------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------

_SHORT = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "context": "ctx", "o_proj": "o",
          "linear1_0": "l1_0", "linear1_1": "l1_1", "linear2": "l2"}


def short(roles: Sequence[str] | None) -> str:
    if roles is None:
        return "-"
    return ",".join(_SHORT.get(r, r) for r in roles) or "(none)"


def report(res: dict[str, Any]) -> str:
    n0, n1 = res["layers"][0], res["layers"][-1]
    lines = [
        f"Policies (per layer; FLOPs from a scan of {n0} layers, temp slope: least squares "
        f"over {res['layers']} layers; no-remat step {res['no_remat_flops'] / 1e6:,.1f} MFLOP)",
        C.table([(r["name"], short(r["roles"]), C.kib(r["saved_bytes"]),
                  C.kib(r["temp_slope_bytes"]), f"{r['recompute_flops'] / 1e6:,.1f}",
                  C.pct(r["overhead"])) for r in res["policies"]],
                ("policy", "saves", "saved KiB", "temp KiB/layer", "recompute MFLOP",
                 "overhead")),
        "",
        (f"Budgets (per layer; optimum: every one of the {len(res['subsets'])} tag subsets "
         "compiled, one program each)" if res["exhaustive"] == "all" else
         f"Budgets (per layer; NOT an optimum: the best of the model's {res['exhaustive']} "
         "candidates per budget)"),
    ]
    rows = []
    for e in res["budgets"]:
        p, opt, hw = e.get("planner"), e["optimum"] or e.get("best_of_top"), \
            e["best_hand_written"]
        pt = e.get("planner-traced")
        rows.append((
            C.kib(e["budget_bytes"]),
            short(p["roles"]) if p else "-", C.pct(p["overhead"]) if p else "-",
            C.pct(pt["overhead"]) if pt else "-",
            short(opt["roles"]) if opt else "-", C.pct(opt["overhead"]) if opt else "-",
            f"{hw['name']}" if hw else "-", C.pct(hw["overhead"]) if hw else "-",
            f"{100 * e['planner_minus_optimum']:+.3f}" if "planner_minus_optimum" in e else "-",
        ))
    lines.append(C.table(rows, ("budget KiB", "planner saves", "planner", "traced",
                                "optimum saves", "optimum", "best hand-written", "its",
                                "planner-opt pp")))
    worse_opt = [e for e in res["budgets"] if e.get("planner_minus_optimum", 0) > TIE]
    worse_hw = [e for e in res["budgets"] if e.get("planner_minus_best_hand_written", 0) > TIE]
    misfit = [e for e in res["budgets"] if e.get("planner") and not e["planner"]["fits"]]
    max_gap = max((e.get("planner_minus_optimum", 0.0) for e in res["budgets"]), default=0.0)
    lines += [
        "",
        f"planner worse than the optimum at {len(worse_opt)} of {len(res['budgets'])} "
        f"budgets, worse than the best hand-written policy that fits at {len(worse_hw)}, "
        f"over budget (measured) at {len(misfit)} (ties: within {TIE:g} of the step); "
        f"largest gap to the optimum {max_gap:+.2g} of the step",
        f"compiled {res['programs_compiled']} programs in {res['compile_seconds']:.0f} s "
        + (f"(with the fused run's, {res['programs']['served']} read from the committed "
           "table, at the compile times it recorded) " if res.get("programs", {}).get(
               "served") else "")
        + f"({res['seconds']:.0f} s in all); FLOPs at {n0} vs {n1} layers differ by at most "
        f"{100 * res['flops_layer_count_spread']:.3f}%; default code generation "
        f"{'agrees' if res['codegen_check']['same'] else 'DISAGREES'} "
        f"({res['codegen_check']['policy']})",
    ]
    return "\n".join(lines)


def _short_tags(tags: Sequence[str] | None) -> str:
    return short(None if tags is None else [t.rsplit(".", 1)[-1] for t in tags])


def report_fused(res: dict[str, Any]) -> str:
    lines = [
        "Fused q/k/v layer (one matmul, three tags), planned from its traced footprint "
        "(predicted vs compiled, per layer)",
        C.table([(r["name"], _short_tags(r["tags"]), C.kib(r["predicted_bytes"]),
                  C.kib(r["saved_bytes"]), f"{r['predicted_recompute_flops'] / 1e6:,.2f}",
                  f"{r['recompute_flops'] / 1e6:,.2f}", C.pct(r["overhead"]))
                 for r in res["policies"]],
                ("policy", "saves", "pred KiB", "saved KiB", "pred MFLOP", "recompute MFLOP",
                 "overhead")),
        "",
        C.table([(C.kib(e["budget_bytes"]), _short_tags(e["planner"]["tags"]),
                  C.pct(e["planner"]["overhead"]),
                  _short_tags((e["optimum"] or e["best_of_top"])["tags"]),
                  C.pct((e["optimum"] or e["best_of_top"])["overhead"]),
                  e["best_hand_written"]["name"] if e["best_hand_written"] else "-",
                  C.pct(e["best_hand_written"]["overhead"]) if e["best_hand_written"] else "-")
                 for e in res["budgets"]],
                ("budget KiB", "planner saves", "planner", "optimum saves", "optimum",
                 "best hand-written", "its")),
    ]
    for a in res["against_regexes"]:
        lines.append(f"at the {a['regex']}'s {C.kib(a['budget_bytes'])} KiB: regex "
                     f"{C.pct(a['regex_overhead'])}, planner {C.pct(a['planner_overhead'])} "
                     f"saving {_short_tags(a['planner_tags'])}")
    lines.append("groups: " + ("; ".join(g["label"] for g in res["groups"]) or "none"))
    lines.append(f"traced footprint {res['footprint_seconds']:.3f} s; plan median "
                 f"{res['plan_ms_median']:.2f} ms (first {res['plan_ms'][0]:.2f} ms)")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> Path:
    """Saved bytes per layer against recompute overhead."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(10, 6.5))
    subs = [s for s in res["subsets"] if s["overhead"] is not None]
    ax.scatter([s["saved_bytes"] / 1024 for s in subs], [100 * s["overhead"] for s in subs],
               s=12, color="0.75", label=f"tag subsets ({len(subs)} compiled)", zorder=1)
    # The measured Pareto frontier of the subsets.
    pts = sorted((s["saved_bytes"], s["overhead"]) for s in subs)
    front, best = [], math.inf
    for b, o in pts:
        if o < best - 1e-12:
            front.append((b, o))
            best = o
    if front:
        xs, ys = zip(*front)
        ax.step([x / 1024 for x in xs], [100 * y for y in ys], where="post", color="0.35",
                lw=1, label=("optimum (measured frontier)" if res["exhaustive"] == "all"
                             else "best compiled subsets (not exhaustive)"), zorder=2)
    colors = {"baseline": "black", "jax": "tab:blue", "preset": "tab:green",
              "maxtext": "tab:purple"}
    hand = [r for r in res["policies"] if r["group"] in colors]
    xmax = 1.45 * max(e["budget_bytes"] for e in res["budgets"]) / 1024
    # One label per cluster of coinciding points (same bytes, overhead within 0.1 pp).
    clusters: list[list[dict[str, Any]]] = []
    for r in sorted(hand, key=lambda r: (r["saved_bytes"], r["overhead"])):
        for c in clusters:
            if c[0]["saved_bytes"] == r["saved_bytes"] and \
                    abs(c[0]["overhead"] - r["overhead"]) < 1e-3:
                c.append(r)
                break
        else:
            clusters.append([r])
    for c in clusters:
        x, y = c[0]["saved_bytes"] / 1024, 100 * c[0]["overhead"]
        label = " / ".join(r["name"] for r in c)
        marker = "o"
        if x > xmax:  # off the axis (no remat, dots_saveable): draw at the edge
            label += f" ({x:,.0f} KiB)"
            x, marker = xmax * 0.985, ">"
        for r in c:
            ax.scatter([min(r["saved_bytes"] / 1024, x)], [100 * r["overhead"]],
                       marker=marker, s=36, zorder=4, color=colors[r["group"]],
                       edgecolor="white", linewidth=0.5)
        if marker == ">":  # clipped: label below, to the left
            offset, ha = (-6, -11), "right"
        elif x > 0.8 * xmax:  # near the right edge: label above, to the left
            offset, ha = (-6, 5), "right"
        else:
            offset, ha = (6, 2), "left"
        ax.annotate(label, (x, y), textcoords="offset points", fontsize=6.5, zorder=5,
                    xytext=offset, ha=ha)
    for group, style in (("planner", dict(color="tab:red", marker="X", ms=9, lw=1.5)),
                         ("planner-traced", dict(color="tab:orange", marker="o", ms=6,
                                                 lw=0, mfc="none"))):
        mine = [e[group] for e in res["budgets"] if e.get(group)]
        if mine:
            ax.plot([m["saved_bytes"] / 1024 for m in mine], [100 * m["overhead"] for m in mine],
                    label={"planner": "planner (analytic model)",
                           "planner-traced": "planner (traced footprint)"}[group],
                    zorder=6, **style)
    for e in res["budgets"]:
        ax.axvline(e["budget_bytes"] / 1024, color="tab:red", lw=0.5, ls=":", zorder=0)
    for label, colour in (("no remat / baseline", "black"), ("JAX policies", "tab:blue"),
                          ("neuron_remat presets", "tab:green"), ("MaxText", "tab:purple")):
        ax.scatter([], [], color=colour, label=label)
    ax.set_xlabel("saved bytes per layer (KiB, measured by saved_residuals; dotted: budgets)")
    ax.set_ylabel("recompute overhead (% of no-remat step FLOPs, compiled)")
    size = res["size"]
    ax.set_title(f"Remat frontier: reference layer h={size['hidden']}, heads={size['heads']}"
                 f"/{size['kv_heads']}, ffn={size['ffn']}, seq={size['seq']}, "
                 f"b={size['batch']}, float32")
    ax.set_xlim(0, xmax)
    ax.legend(fontsize=7.5, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def build_parser() -> Any:
    p = C.parser(__doc__.splitlines()[0], NAME)
    p.add_argument("--layers", default=None,
                   help="layer counts to compile, comma-separated (the first gives FLOPs; "
                        "all give the least-squares temp-bytes slope); default 4,8,16, "
                        "with --small 2,4")
    p.add_argument("--budgets", type=int, default=None,
                   help="how many per-layer budgets (default 8; --small 5)")
    p.add_argument("--exhaustive", choices=("all", "top"), default="all",
                   help="compile every distinct subset program (default: the optimum is a "
                        "brute force), or only the --top best per budget by the model "
                        "(faster; then no optimum is claimed)")
    p.add_argument("--top", type=int, default=3,
                   help="with --exhaustive top: subsets compiled per budget (default 3)")
    p.add_argument("--no-traced", action="store_true",
                   help="skip the planner on a traced footprint")
    p.add_argument("--no-fused", action="store_true",
                   help="skip the fused q/k/v variant")
    p.add_argument("--default-codegen", action="store_true",
                   help="compile with XLA's default CPU code generation (slower, same figures)")
    p.add_argument("--png", type=Path, default=None, help="plot (default OUT/frontier.png)")
    p.add_argument("--no-tables", action="store_true",
                   help="with --small: compile every program here instead of reading the "
                        "committed benchmarks/brute_force/frontier-small.json")
    p.add_argument("--write-programs", type=Path, nargs="?", const=PROGRAMS_SMALL,
                   default=None, help="compile every program and write their figures to "
                   "this file (with --small: the committed table)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.layers is None:
        args.layers = "2,4" if args.small else "4,8,16"
    if args.budgets is None:
        args.budgets = 5 if args.small else 8
    say = C.Printer(args.quiet)
    res = measure(args, say)
    say(report(res))
    if "fused" in res:
        say("")
        say(report_fused(res["fused"]))
    json_file = C.write_json(C.json_path(args, NAME), res)
    png = plot(res, args.png or args.out / f"{NAME}.png")
    say(f"wrote {json_file} and {png}")
    res["files"] = [str(json_file), str(png)]
    return res


if __name__ == "__main__":
    main()
