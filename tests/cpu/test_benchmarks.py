"""Smoke test: every benchmark script runs at its smallest size and writes sane results.

`benchmarks/run_all.py --small` runs once (in this process, so JAX starts once); the tests
then read each script's JSON. Nothing here asserts a timing: timings are printed by the
scripts, and only their presence and sign are checked.
"""

import contextlib
import itertools
import json
import math
import sys
from pathlib import Path

import pytest

# The tests that read run_all.py --small's results are slow (minutes on 2 cores: every tag
# subset compiled); `python -m pytest tests -m slow` runs them.

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@contextlib.contextmanager
def benchmarks_on_path():
    """benchmarks/ on sys.path for the block: its scripts import each other by name, some
    lazily (inside main)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield
    finally:
        sys.path.remove(str(BENCHMARKS))


def five_tags():
    """Tags a-e, and every subset of them as rows of [1, one 0/1 column per tag]: full
    remat first, every tag last."""
    import numpy as np

    tags = ["a", "b", "c", "d", "e"]
    sets = [s for r in range(6) for s in itertools.combinations(tags, r)]
    return tags, np.array([[1.0] + [float(t in s) for t in tags] for s in sets])


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    with benchmarks_on_path():
        import run_all

        folder = tmp_path_factory.mktemp("bench")
        run_all.main(["--small", "--quiet", "--out", str(folder)])
    return folder


def load(folder, name):
    return json.loads((folder / f"{name}.json").read_text())


@pytest.mark.slow
def test_every_part_wrote_its_json(out):
    for name in ("frontier", "accuracy", "overheads", "scaling", "gpu_peak_memory", "summary"):
        assert (out / f"{name}.json").is_file(), name
    summary = load(out, "summary")
    assert summary["small"] is True
    assert summary["seconds"]["total"] > 0
    assert summary["failures"] == []


@pytest.mark.slow
def test_fit_sweep_small_meets_done_when(out):
    """benchmarks/fit_sweep.py --small --bare-oracle (run by run_all): two zoo steps (one
    train, one held-out), 3 tags, 11 sizes, three modes (memory figures, the compile as the
    oracle with and without the out-of-memory error's byte figure), against the compiled
    brute force (the expected values: XLA's figures for every save set, not fit's model)."""
    result = load(out, "fit_sweep")
    assert set(result["steps"]) == {"gqa4-adamw", "wide-attn-mqa-adafactor"}
    assert {k.split("/")[0] for k in result["done_when"]} == {
        "memory_analysis", "oracle", "oracle_bare"}
    for key, d in result["done_when"].items():
        assert d["passed"], (key, d)
    for st in result["steps"].values():
        assert set(st["modes"]) == {"memory_analysis", "oracle", "oracle_bare"}
        # the trace's ranking with every set's bytes known: at every size (from the
        # smallest compiled set up, something fits), a gap in points
        assert st["trace_ranking"]["sizes"] == 11 and st["trace_ranking"]["gap_max"] >= 0
        for m in st["modes"].values():
            assert m["summary"]["sizes"] == 11 and m["summary"]["reported"] == 0
            # every plan says why its search stopped (CompiledFit.stop, read by the sweep)
            plans = [r for r in m["rows"] if r["outcome"] == "plan"]
            assert plans and all(r["stop"] for r in plans)
            # each compile of a save set the search made with a model: its chance, and
            # whether it fit; no more of them than the compiles
            for r in m["rows"]:
                assert len(r["chances"]) <= r["compiles"], r
                assert all(0.0 <= p <= 1.0 and isinstance(f, bool) for p, f in r["chances"])
    for mode, bins in result["calibration"].items():  # every chance recorded, binned once
        assert sum(b["compiles"] for b in bins) == sum(
            len(r["chances"]) for st in result["steps"].values()
            for r in st["modes"][mode]["rows"]), mode


@pytest.mark.slow
def test_frontier_planner_is_optimal_and_beats_hand_written(out):
    fr = load(out, "frontier")
    assert fr["dtype"] == "float32" and fr["backend"] == "cpu"
    # The optimum is a brute force: every subset's program compiled, also with --small.
    assert fr["exhaustive"] == "all"
    assert all(s["flops"] is not None for s in fr["subsets"])
    assert len(fr["budgets"]) >= 3
    for e in fr["budgets"]:
        planner, optimum = e["planner"], e["optimum"]
        assert planner["fits"] and planner["saved_bytes"] <= e["budget_bytes"]
        assert optimum is not None
        assert planner["overhead"] <= optimum["overhead"] + fr["tie"], e
        best = e["best_hand_written"]
        if best is not None:
            assert best["saved_bytes"] <= e["budget_bytes"]
            assert planner["overhead"] <= best["overhead"] + fr["tie"], e
    # The budgets span full remat to saving every tag, so overhead falls along them.
    overheads = [e["planner"]["overhead"] for e in fr["budgets"]]
    assert all(b <= a + fr["tie"] for a, b in zip(overheads, overheads[1:])), overheads
    assert overheads[0] > 0.05 and overheads[-1] < overheads[0]
    assert fr["codegen_check"]["same"]
    assert fr["flops_layer_count_spread"] < 1e-9  # a scan body is counted once


@pytest.mark.slow
def test_frontier_policies_are_measured(out):
    fr = load(out, "frontier")
    by_name = {r["name"]: r for r in fr["policies"]}
    for name in ("no remat", "full remat (nothing_saveable)", "dots_saveable",
                 "dots_with_no_batch_dims_saveable", "preset trn2-fuji-70b",
                 "maxtext minimal", "maxtext save_qkv_proj", "maxtext save_dot_except_mlp"):
        assert name in by_name, name
    assert by_name["no remat"]["overhead"] == 0.0
    full = by_name["full remat (nothing_saveable)"]
    assert full["overhead"] > by_name["preset trn2-fuji-70b"]["overhead"] > 0
    assert by_name["preset full"]["flops"] == full["flops"]
    # The analytic bytes are JAX's saved-residual bytes exactly, for every name policy.
    for r in fr["policies"]:
        if r["group"] in ("preset", "maxtext", "planner", "jax"):
            assert r["predicted_bytes"] == r["saved_bytes"], r["name"]
        assert r["temp_slope_bytes"] > 0
    assert len(fr["subsets"]) == 256
    assert all(s["predicted_bytes"] == s["saved_bytes"] for s in fr["subsets"])
    # --small reads its programs from the committed table where this compiler wrote it:
    # then three are compiled again here and held to it (a difference stops the run), and
    # the code generation check compiles one more with XLA's default options
    assert fr["codegen_check"]["same"]
    with benchmarks_on_path():
        import fit_sweep
        import frontier

        if fit_sweep.written_here(frontier.PROGRAMS_SMALL) is not None:
            # the table's keys are this compiler's lowered texts: all served, none compiled
            assert fr["programs"]["served"] > 250 and fr["programs"]["compiled"] == 0
    if fr.get("programs", {}).get("served"):
        assert fr["programs"]["checked_here"] == 3
    png = (out / "frontier.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


@pytest.mark.slow
def test_frontier_fused_layer_is_planned_from_its_trace(out):
    fr = load(out, "frontier")
    fz = fr["fused"]
    assert all(s["predicted_bytes"] == s["saved_bytes"] for s in fz["subsets"])
    assert len(fz["subsets"]) == 256
    for e in fz["budgets"]:
        assert e["planner"]["saved_bytes"] <= e["budget_bytes"]
        assert e["planner"]["overhead"] <= e["optimum"]["overhead"] + fr["tie"], e
    regexes = {a["regex"]: a for a in fz["against_regexes"]}
    assert set(regexes) == {"axlearn TRN2 regex", "axlearn default regex"}
    for a in regexes.values():  # at each regex's own byte budget, no worse than it
        assert a["planner_saved_bytes"] <= a["budget_bytes"]
        assert a["planner_overhead"] <= a["regex_overhead"] + fr["tie"], a
    assert [g["label"] for g in fz["groups"]] == ["q_proj+k_proj+v_proj: one fused matmul"]
    assert fz["footprint_seconds"] > 0 and fz["plan_ms_median"] > 0


@pytest.mark.slow
def test_accuracy_ratios(out):
    acc = load(out, "accuracy")
    assert acc["subsets_bytes_ratio"]["max_abs_error"] == 0
    assert acc["subsets_compiled"] > 0
    by_name = {r["name"]: r for r in acc["policies"]}
    full = by_name["full remat (nothing_saveable)"]
    assert full["bytes_ratio"] == 1.0
    assert abs(full["flops_ratio"] - 1) < 0.02
    assert 0.9 < acc["step_flops"]["ratio"] < 1.1
    assert by_name["no remat"]["flops_ratio"] is None  # nothing recomputed


@pytest.mark.slow
def test_overheads_are_positive_numbers(out):
    ov = load(out, "overheads")
    imp = ov["import"]
    assert imp["neuron_remat_ms"] > 0 and imp["bytecode_cached"]["jax_ms"] > 0
    assert not imp["bytecode_cached"]["backends_started_at_import"]
    assert imp["modules"] == ["neuron_remat"]  # the package loads its modules on first use
    for label in ("default", "override", "use_jax=False"):
        d = ov["detect"][label]
        assert d["first_call_fresh_process_ms"] > 0 and d["warm_us"] > 0
    assert ov["detect"]["override"]["source"] == "override"
    assert ov["plan"]["median_ms"] > 0 and ov["plan"]["saved_tags"]
    for t in ov["trace"]:
        assert t["regex_ms"] > 0 and t["jax_ms"] > 0 and math.isfinite(t["overhead"])
    assert ov["policy_calls"]["calls_per_trace_32_unrolled"]["name"] > 0


@pytest.mark.slow
def test_scaling_tables_and_exact_planner(out):
    sc = load(out, "scaling")
    assert [r["layers"] for r in sc["plan_layers"]] == [8, 32, 80, 160]
    assert all(r["ms"] > 0 for r in sc["plan_layers"])
    assert all(r["unrolled_s"] > 0 and r["scan_s"] > 0 for r in sc["audit_layers"])
    methods = {r["method"] for r in sc["plan_tags"]}
    assert methods == {"enumeration", "branch and bound"}
    checked = [r for r in sc["plan_tags"] if r["checked"]]
    assert any(r["method"] == "branch and bound" for r in checked)
    for r in checked:  # the planner's answer is the brute-force optimum
        assert r["max_relative_gap_to_brute_force"] <= 1e-9, r
    for value in sc["fits"].values():
        assert math.isfinite(value)
    traced = {r["tags"]: r for r in sc["traced"]}
    assert set(traced) == {9, 16}
    assert all(r["footprint_s"] > 0 and r["plan_first_ms"] > 0 for r in traced.values())
    assert len(traced[16]["groups"]) == 2  # each layer's fused q/k/v


@pytest.mark.slow
def test_gpu_script_skips_cleanly_without_a_gpu(out):
    gpu = load(out, "gpu_peak_memory")
    if gpu["skipped"]:
        assert "no CUDA GPU" in gpu["reason"]
    else:
        assert gpu["policies"]


def test_run_all_counts_a_missing_comparison_as_a_failure():
    with benchmarks_on_path():
        import run_all
    entry = {"budget_bytes": 1, "planner": {"overhead": 0.1}, "optimum": {"overhead": 0.1},
             "best_hand_written": None, "planner_minus_optimum": 0.0}
    frontier = {"tie": 1e-6, "budgets": [entry], "fused": {"against_regexes": [
        {"regex": "r", "planner_overhead": 0.1, "regex_overhead": 0.2}]}}
    good = run_all.headline({"frontier": frontier}) | {"tie": 1e-6}
    assert run_all.failures(good, ["frontier"]) == []
    for broken in ({k: v for k, v in entry.items() if k != "planner_minus_optimum"},
                   {k: v for k, v in entry.items() if k != "planner"},
                   entry | {"planner_minus_optimum": 0.01}):
        bad = run_all.headline({"frontier": frontier | {"budgets": [entry, broken]}})
        assert run_all.failures(bad | {"tie": 1e-6}, ["frontier"]), broken
    assert run_all.failures({}, ["frontier"])  # nothing measured at all
    assert run_all.failures({"fit_sweep": {"always_fits": True}}, ["fit_sweep"]) == [
        "fit_sweep: fit_sweep.refuses_only_when_nothing_fits is None"]


@pytest.mark.parametrize("argv, says", [
    (["--steps", "nope"], "--steps 'nope': nope: not a scanned zoo step"),
    (["--steps", "unrolled-gqa2"], "not a scanned zoo step"),
    (["--fractions", "0.3,x"], "--fractions '0.3,x'"),
    (["--fractions", "2"], "each in [0, 1.05]"),
    (["--iters", "0"], "--iters 0: must be at least 1"),
    (["--reuse", "/nonexistent/gpu_fit.json"], "--reuse /nonexistent/gpu_fit.json: cannot use"),
])
def test_gpu_fit_names_a_bad_option_in_one_line(argv, says, capsys, tmp_path):
    """benchmarks/gpu_fit.py: bad options end in argparse's one-line error (exit 2), before
    JAX looks for a GPU; with none here it skips (status 0) instead of measuring."""
    with benchmarks_on_path():
        import gpu_fit
    with pytest.raises(SystemExit) as exit_:
        gpu_fit.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and "Traceback" not in "\n".join(err), err
    skipped = gpu_fit.main(["--quiet", "--out", str(tmp_path)])
    import jax

    if not [d for d in jax.devices() if d.platform == "gpu"]:
        assert skipped == {"skipped": "no GPU"}


@pytest.mark.parametrize("value", ["2", "x", "-1"])
def test_fit_sweep_names_a_bad_budget_in_one_line(value, capsys):
    """benchmarks/fit_sweep.py --max-compiles: argparse's one-line error (exit 2) naming the
    value and what is valid (as ``neuron-remat fit --max-compiles`` says it), before anything
    is traced."""
    with benchmarks_on_path():
        import fit_sweep
    with pytest.raises(SystemExit) as exit_:
        fit_sweep.main(["--max-compiles", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error: argument --max-compiles: " in err[-1], err
    assert value in err[-1] and "valid: an integer from 3 to " in err[-1], err


def test_fit_sweep_counts_why_fit_stopped_where_it_missed_by_over_2_points():
    """The sweep's stop reasons: only rows more than 2 points off count, by the reason
    without its figures; a row that stated no reason counts as '?'."""
    with benchmarks_on_path():
        import fit_sweep
    rows = [{"gap": 0.0, "stop": "the budget of 6 compiles is spent"},
            {"gap": 0.02, "stop": "the budget of 6 compiles is spent"},  # exactly 2: not over
            {"gap": 0.03, "stop": "the budget of 6 compiles is spent"},
            {"gap": 0.05, "stop": "no set ... is plausibly within the limit (uncertainty 1 MiB)"},
            {"gap": 0.04, "stop": "no set ... is plausibly within the limit (uncertainty 2 MiB)"},
            {"gap": None, "outcome": "refused"}, {"gap": 0.021}]
    assert fit_sweep.stop_reasons(rows) == {
        "the budget of 6 compiles is spent": 1,
        "no set ... is plausibly within the limit": 2, "?": 1}
    assert fit_sweep.why_stopped(rows) == (
        "4 sizes over 2 points; fit stopped: the budget of 6 compiles is spent (1); "
        "no set ... is plausibly within the limit (2); ? (1)")
    assert fit_sweep.why_stopped(rows[:2]) == ""


def test_fit_sweep_counts_the_plans_that_say_a_better_set_may_fit_by_hand():
    """`flagged`, by hand: five plans (gaps 0, 0.3, 1, 3 and 0.4 points; the second, third
    and fourth flagged), one refusal (not a plan). Misses over 0.5 points: the 1 and 3, both
    flagged; over 2: the 3, flagged; the unflagged plans (0 and 0.4) are both within 0.5.
    Run again: the 0.3 stays, the 1 becomes 0 (better), the 3 becomes 4 (worse): over 0.5
    points 2 -> 1, over 2 points 1 -> 1; those second fits made 2, 0 and 3 compiles (the
    rest read back by resume): 5 in all, 1.67 a plan."""
    with benchmarks_on_path():
        import fit_sweep

    def plan(gap, again=None, made=0):
        row = {"outcome": "plan", "gap": gap / 100, "unexplored": int(again is not None)}
        if again is not None:
            row["retry"] = {"outcome": "plan", "fits": True, "gap": again / 100,
                            "compiles": made, "reused": 6}
        return row

    rows = [plan(0), plan(0.3, 0.3, 2), plan(1, 0), plan(3, 4, 3), plan(0.4),
            {"outcome": "refused", "gap": None}]
    got = fit_sweep.flagged(rows)
    assert got == {"plans": 5, "flagged": 3, "unflagged_within_0_5": 2, "misses_0_5": 2,
                   "flagged_misses_0_5": 2, "misses_2": 1, "flagged_misses_2": 1,
                   "retried": 3, "retried_misses_0_5": 1, "retried_misses_2": 1,
                   "retried_better": 1, "retried_worse": 1, "retried_new_compiles": 5,
                   "retried_all_fit": True}
    assert fit_sweep.flagged_text(got) == (
        "3 of 5 plans flagged; of the misses over 0.5 points 2 of 2 flagged, over 2 points 1 "
        "of 1; unflagged plans within 0.5 points: 2 of 2; run again as advised: misses over "
        "0.5 points among the flagged 2 -> 1, over 2 points 1 -> 1 (1 better, 1 worse; 5 "
        "compiles made, 1.67 a plan, the rest read back by resume)")
    once = [{k: v for k, v in r.items() if k != "retry"} for r in rows]  # no --retry
    assert "retried" not in fit_sweep.flagged(once)


def test_fit_sweep_trace_ranking_by_hand():
    """What the trace's ranking alone costs, by hand: three sets in the search's order
    (least recompute by the trace first), their compiled bytes and FLOPs. At 10 bytes only
    `c` fits (gap 0); at 20, `b` and `c`: the trace ranks `b` first but `c` compiles 30
    FLOPs fewer (gap 30 x 0.001 = 3 points); at 30 all three, `a` first and fewest (0);
    at 5 nothing fits (not counted)."""
    with benchmarks_on_path():
        import fit_sweep

    from neuron_remat._search import _Candidate  # noqa: PLC0415

    cands = [_Candidate(("a",), 0, 0, 1), _Candidate(("b",), 0, 0, 2),
             _Candidate(("c",), 0, 0, 3)]
    table = {("a",): {"bytes": 30, "flops": 100}, ("b",): {"bytes": 20, "flops": 150},
             ("c",): {"bytes": 10, "flops": 120}}
    got = fit_sweep.trace_ranking(cands, table.__getitem__, [5, 10, 20, 30], 0.001)
    assert got["sizes"] == 3 and got["over_2"] == 1
    assert got["share_gap_le_0_5"] == pytest.approx(2 / 3)
    assert got["gap_max"] == pytest.approx(0.03)
    assert fit_sweep.trace_ranking_text(got) == (
        "67% of 3 sizes within 0.5 points, 1 over 2, 3.00 at most")
    assert fit_sweep.trace_ranking(cands, table.__getitem__, [5], 0.001)["gap_max"] is None


def test_fit_sweep_calibration_bins_the_search_chances_by_hand():
    """The sweep's calibration table: per bin of the chance the search gave a set, the
    compiles, their mean chance and the share that fit (by hand: 0.1 and 0.15, one of two
    fit; 0.3, none; 0.95 and 1.0, both, the last bin closed at 1)."""
    with benchmarks_on_path():
        import fit_sweep
    rows = [{"chances": [[0.1, True], [0.3, False]]}, {"chances": []},
            {"chances": [[0.15, False], [1.0, True], [0.95, True]]}, {}]
    got = [(b["low"], b["high"], b["compiles"], round(b["chance"], 6), b["fit"])
           for b in fit_sweep.calibration(rows)]
    assert got == [(0.05, 0.2, 2, 0.125, 0.5), (0.2, 0.4, 1, 0.3, 0.0),
                   (0.95, 1.0, 2, 0.975, 1.0)]
    assert fit_sweep.calibration([]) == []


def test_flops_share_counts_each_scan_body_once_as_xla_does():
    """Two scans of 3 checkpointed layers (an encoder and a decoder): XLA:CPU counts each
    scan body once, so a compiled FLOP difference is one layer of each, and the step's is
    3 times that, not 6: full remat's compiled difference to no remat, so scaled, is the
    recompute the trace counts over all 6 layers."""
    import types

    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    from neuron_remat._step import step_graph

    def make(policy):
        def layer(x, w):
            return x + jnp.tanh(checkpoint_name(x @ w, "h")) @ w

        def stack(x, ws):
            body = jax.checkpoint(layer, policy=policy)
            return jax.lax.scan(lambda c, w: (body(c, w), None), x, ws)[0]

        return jax.jit(jax.grad(lambda ws, x: jnp.sum(stack(stack(x, ws[0]), ws[1]))))

    args = ((jnp.ones((3, 64, 64)), jnp.ones((3, 64, 64))), jnp.ones((32, 64)))
    flops = [make(p).lower(*args).compile().cost_analysis()["flops"]
             for p in (jax.checkpoint_policies.nothing_saveable,
                       jax.checkpoint_policies.everything_saveable)]
    with benchmarks_on_path():
        import fit_sweep
    graph = step_graph(make, *args)
    share = fit_sweep.flops_share(graph, types.SimpleNamespace(scan=True))
    assert share * (flops[0] - flops[1]) == pytest.approx(
        graph.recompute_flops(()) / graph.no_remat_flops, rel=0.05)


def test_packing_richer_shapes_recover_what_they_are_made_of():
    """benchmarks/packing.py's richer shapes, on tables built from them: bytes that are the
    largest of two additive models (a peak that moves between two program points), and
    bytes with one effect for a pair of tags. Each shape leaves nothing of its own table,
    where one effect per tag leaves a spread."""
    import numpy as np

    with benchmarks_on_path():
        import packing
    tags, x = five_tags()
    rng = np.random.default_rng(1)
    one, two = rng.uniform(0, 4, 6) * 2**20, rng.uniform(0, 4, 6) * 2**20
    # the second point wins only where its tags add enough: at 8 of the 32 sets, more
    # than its 6 coefficients (with 2, as at 3 MiB less, it is not determined)
    two[0] = one[0] - 2**20
    peak = np.maximum(x @ one, x @ two)
    additive = peak - x @ np.linalg.lstsq(x, peak, rcond=None)[0]
    assert additive.std() > 0.05 * 2**20
    assert np.abs(packing.max_of_linear(x, peak, 2)).max() < 1.0  # bytes
    paired = x @ one + 2**20 * x[:, 1] * x[:, 3]  # a and c together: 1 MiB more
    assert np.abs(paired - x @ np.linalg.lstsq(x, paired, rcond=None)[0]).max() > 2**18
    wide = packing.pairwise(x, tags)
    assert wide.shape[1] == 6 + 10
    assert np.abs(paired - wide @ np.linalg.lstsq(wide, paired, rcond=None)[0]).max() < 1.0


def test_packing_predicts_a_left_out_set_from_the_others_only():
    """benchmarks/packing.py's leave-one-out prediction, on an additive table where one
    set's figure is moved by 1 MiB: every shape, fitted to the other sets, predicts the
    table's own value there (independent arithmetic), so the set's moved figure never
    reaches its prediction."""
    import numpy as np

    with benchmarks_on_path():
        import packing
    tags, x = five_tags()
    additive = x @ (np.random.default_rng(2).uniform(0, 4, 6) * 2**20)
    designs = {"tags": x, "pairs": packing.pairwise(x, tags), "max_of_2": x, "max_of_3": x}
    for i in (0, 7, 31):
        y = additive.copy()
        y[i] -= 2**20
        for shape, design in designs.items():
            got = packing.predicted_from_the_others(shape, design, y, i)
            assert abs(got - additive[i]) < 1.0, (shape, i, got - additive[i])


def test_packing_learning_curve_tells_a_shape_that_fits_from_one_that_does_not():
    """benchmarks/packing.py's learning curve on a table with one effect for a pair of tags
    (a and c together: 1 MiB more): from 24 compiled sets one effect per pair predicts the
    other sets exactly, where one effect per tag is off by about its spread over the whole
    table (computed here directly)."""
    import numpy as np

    with benchmarks_on_path():
        import packing
    tags, x = five_tags()
    paired = x @ (np.random.default_rng(1).uniform(0, 4, 6) * 2**20) + 2**20 * x[:, 1] * x[:, 3]
    curve = packing.learning_curve({"tags": x, "pairs": packing.pairwise(x, tags)}, paired,
                                   (0, len(x) - 1), 2**20)
    assert set(curve["pairs"]) == {6, 12, 24}
    assert curve["pairs"][24] < 1e-9
    additive_left = paired - x @ np.linalg.lstsq(x, paired, rcond=None)[0]
    assert curve["tags"][24] > 0.5 * additive_left.std() / 2**20


def test_packing_maxtext_without_its_inputs_says_so_in_one_line(tmp_path):
    """benchmarks/packing.py --maxtext where MaxText is not importable (this Python), or
    where maxtext_fit.py has not written its JSON in --out: one line naming what is
    missing and how to get it, no traceback."""
    with benchmarks_on_path(), pytest.raises(SystemExit) as exit_:
        import packing

        packing.main(["--maxtext", "--quiet", "--out", str(tmp_path)])
    message = str(exit_.value.code)
    assert message.startswith("packing: --maxtext: ") and "\n" not in message, message
    assert ".ci/maxtext_env.sh" in message or "maxtext_fit.py" in message, message


@pytest.mark.parametrize("argv, says", [
    ([], "axlearn_fit: axlearn does not import here"),
    (["--steps", "fuji"], "--steps: no step 'fuji'"),
    (["--tags", "9"], "--tags: 9 is out of range"),
])
def test_axlearn_fit_bad_input_is_one_line(argv, says, tmp_path, capsys):
    """benchmarks/axlearn_fit.py where axlearn does not import (this Python), or with a
    step or tag count it does not have: one line naming it and what is valid, no
    traceback. (Where axlearn imports, the first case runs the sweep: skipped.)"""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import axlearn_zoo

    if not argv and axlearn_zoo.available() is None:
        pytest.skip("axlearn imports here: the sweep would run")
    with benchmarks_on_path(), pytest.raises(SystemExit) as exit_:
        import axlearn_fit

        axlearn_fit.main([*argv, "--quiet", "--out", str(tmp_path)])
    message = str(exit_.value.code) if exit_.value.code != 2 else \
        capsys.readouterr().err.strip().splitlines()[-1]
    assert says in message and "\n" not in message, message
