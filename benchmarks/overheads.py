"""The package's own overheads: import, device detection, planning, and policy tracing.

* ``import neuron_remat`` beyond ``import jax``: timed inside fresh interpreters (one per
  repetition), as the difference of two ``perf_counter`` readings around the import, after
  ``import jax``. Also checks that the import starts no JAX backend. Target < 50 ms.
* ``detect()``: the first call in a fresh interpreter (starts JAX's CPU backend, as step 2
  of detection asks JAX), a cold re-detection in the same process (``refresh=True``) and a
  warm (cached) call; also the first call with ``NEURON_REMAT_DEVICE=trn2.48xlarge`` and with
  ``use_jax=False``.
* ``plan()`` for Fuji-70B (80 layers) on 8 simulated trn2.48xlarge hosts, tp=4 with sequence
  parallelism, fsdp over the rest, seq 8192. Target < 50 ms.
* Trace time of ``jax.make_jaxpr(jax.grad(loss))`` over an *unrolled* 32-layer reference
  stack (``prevent_cse=True``) and a scanned one, under a `RegexPolicy` and under
  ``jax.checkpoint_policies.save_only_these_names`` with the same literal tag names
  (axlearn's TRN2 set). Repetitions interleave the two (alternating which goes first), each
  with fresh closures and fresh policy objects so no trace cache is shared; the overhead is
  the median of per-pair ratios. JAX caches the partial evaluation of identical layers, so
  a policy is consulted about 150 times per trace whatever the layer count; the per-call
  cost of each policy is timed too, which bounds the overhead independently of timing
  noise. Target < 2%.

Every figure is a median over repetitions within one run.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

NAME = "overheads"

_NEURON_ENV = ("NEURON_REMAT_DEVICE", "NEURON_REMAT_DISABLE", "NEURON_REMAT_STRICT",
               "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES")

_IMPORT = r"""
import json, sys, time
t0 = time.perf_counter()
import jax
t1 = time.perf_counter()
import neuron_remat
t2 = time.perf_counter()
from jax._src import xla_bridge
print(json.dumps({"jax_s": t1 - t0, "neuron_remat_s": t2 - t1,
                  "backends_started": bool(getattr(xla_bridge, "_backends", {})),
                  "modules": sorted(m for m in sys.modules if m.startswith("neuron_remat"))}))
"""

_DETECT = r"""
import json, os, sys, time
import neuron_remat as nr
kw = json.loads(sys.argv[1])
t0 = time.perf_counter()
spec = nr.detect(**kw)
t1 = time.perf_counter()
nr.detect(refresh=True, **kw)
t2 = time.perf_counter()
warm = []
for _ in range(200):
    t = time.perf_counter(); nr.detect(**kw); warm.append(time.perf_counter() - t)
warm.sort()
print(json.dumps({"first_s": t1 - t0, "refresh_s": t2 - t1, "warm_s": warm[len(warm) // 2],
                  "device": spec.describe(), "source": spec.source}))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _NEURON_ENV}
    env.update(extra)
    return env


def _run_json(code: str, *argv: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         env=env or _clean_env(), check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def import_overhead(repeat: int) -> dict[str, Any]:
    """Median import time in fresh interpreters, with and without a bytecode cache.

    Installed packages import from ``.pyc`` files; a process run with
    ``PYTHONDONTWRITEBYTECODE=1`` (as some sandboxes and containers are) recompiles every
    source file on every import. The cached case writes its ``.pyc`` files under a
    temporary ``PYTHONPYCACHEPREFIX`` (never into the package), after one warm-up run."""
    out: dict[str, Any] = {"repeat": repeat}
    with tempfile.TemporaryDirectory(prefix="nr-pycache-") as prefix:
        cached_env = _clean_env(PYTHONPYCACHEPREFIX=prefix)
        cached_env.pop("PYTHONDONTWRITEBYTECODE", None)
        _run_json(_IMPORT, env=cached_env)  # writes the cache
        for label, env in (("bytecode_cached", cached_env),
                           ("as_run", _clean_env())):
            runs = [_run_json(_IMPORT, env=env) for _ in range(repeat)]
            out[label] = {
                "neuron_remat_ms": 1e3 * statistics.median(r["neuron_remat_s"] for r in runs),
                "neuron_remat_ms_all": [1e3 * r["neuron_remat_s"] for r in runs],
                "jax_ms": 1e3 * statistics.median(r["jax_s"] for r in runs),
                "backends_started_at_import": any(r["backends_started"] for r in runs)}
            out["modules"] = runs[0]["modules"]
    out["as_run"]["PYTHONDONTWRITEBYTECODE"] = os.environ.get("PYTHONDONTWRITEBYTECODE")
    out["neuron_remat_ms"] = out["bytecode_cached"]["neuron_remat_ms"]
    return out


def import_breakdown() -> list[dict[str, Any]]:
    """``python -X importtime``: microseconds per module imported by ``import neuron_remat``
    after ``import jax`` (self and cumulative), largest cumulative first."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c",
                          "import jax; import sys; sys.stderr.write('@@MARK\\n'); "
                          "import neuron_remat"],
                         capture_output=True, text=True, env=_clean_env(), check=True,
                         timeout=300)
    after = out.stderr.split("@@MARK", 1)[-1]
    rows = []
    for line in after.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if m:
            rows.append({"module": m.group(4), "self_us": int(m.group(1)),
                         "cumulative_us": int(m.group(2))})
    rows.sort(key=lambda r: -r["cumulative_us"])
    return rows[:12]


def detect_overhead(repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {"repeat": repeat}
    for label, kw, env in (("default", {}, _clean_env()),
                           ("override", {}, _clean_env(NEURON_REMAT_DEVICE="trn2.48xlarge")),
                           ("use_jax=False", {"use_jax": False}, _clean_env())):
        runs = [_run_json(_DETECT, json.dumps(kw), env=env) for _ in range(repeat)]
        out[label] = {
            "first_call_fresh_process_ms": 1e3 * statistics.median(r["first_s"] for r in runs),
            "cold_refresh_ms": 1e3 * statistics.median(r["refresh_s"] for r in runs),
            "warm_us": 1e6 * statistics.median(r["warm_s"] for r in runs),
            "device": runs[0]["device"], "source": runs[0]["source"]}
    return out


def plan_overhead(repeat: int) -> dict[str, Any]:
    import neuron_remat as nr  # noqa: PLC0415

    def once() -> Any:
        return nr.plan(nr.from_instance_type("trn2.48xlarge"), nr.get_model("fuji-70b"),
                       nr.StepShape(seq_len=8192),
                       nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=8))

    t = time.perf_counter()
    p = once()
    first = time.perf_counter() - t
    return {"repeat": repeat, "first_ms": 1e3 * first,
            "median_ms": 1e3 * C.median_time(once, repeat, warmup=0),
            "saved_tags": list(p.saved_tags), "overhead": p.overhead}


def trace_overhead(layers: int, repeat: int, scan: bool) -> dict[str, Any]:
    """Median trace time under each policy, interleaved, fresh closures each time."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import neuron_remat as nr  # noqa: PLC0415
    import reference as ref  # noqa: PLC0415

    size = C.SIZES["small"]
    config = size.config(layers)
    names = ref.tag_names(config)
    literal = [names[r] for r in ("q_proj", "k_proj", "v_proj", "linear1_0", "linear1_1")]
    shapes = jax.eval_shape(lambda k: ref.init_layer(k, config), jax.random.PRNGKey(0))
    params = jax.tree.map(lambda s: jnp.zeros((layers, *s.shape), s.dtype), shapes)
    x = jnp.zeros((size.batch, size.seq, size.hidden), jnp.float32)
    make = {
        "regex": lambda: nr.RegexPolicy([re.escape(n) for n in literal]),
        "jax": lambda: jax.checkpoint_policies.save_only_these_names(*literal),
    }

    def trace(kind: str) -> float:
        policy = make[kind]()

        def loss(p: Any, x: Any) -> Any:  # a fresh closure: nothing cached across calls
            return jnp.mean(ref.stack(x, p, config, policy=policy, scan=scan) ** 2)

        t = time.perf_counter()
        jax.make_jaxpr(jax.grad(loss))(params, x)
        return time.perf_counter() - t

    trace("regex"), trace("jax")  # warm up JAX itself
    times: dict[str, list[float]] = {"regex": [], "jax": []}
    ratios = []
    for i in range(repeat):
        order = ("regex", "jax") if i % 2 == 0 else ("jax", "regex")
        pair = {k: trace(k) for k in order}
        for k, v in pair.items():
            times[k].append(v)
        ratios.append(pair["regex"] / pair["jax"])
    return {"layers": layers, "scan": scan, "repeat": repeat,
            "regex_ms": 1e3 * statistics.median(times["regex"]),
            "jax_ms": 1e3 * statistics.median(times["jax"]),
            "overhead": statistics.median(ratios) - 1.0,
            "overhead_of_medians": statistics.median(times["regex"])
            / statistics.median(times["jax"]) - 1.0,
            "pair_ratios": ratios}


def policy_call_cost() -> dict[str, Any]:
    """Per-call cost of each policy, and how often a trace consults it."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax._src.ad_checkpoint import name_p  # noqa: PLC0415

    import neuron_remat as nr  # noqa: PLC0415
    import reference as ref  # noqa: PLC0415

    size = C.SIZES["small"]
    config = size.config(4)
    names = ref.tag_names(config)
    literal = [names[r] for r in ("q_proj", "k_proj", "v_proj", "linear1_0", "linear1_1")]
    regex = nr.RegexPolicy([re.escape(n) for n in literal])
    plain = jax.checkpoint_policies.save_only_these_names(*literal)
    dot = jax.lax.dot_general_p
    out: dict[str, Any] = {}
    n = 20000
    for label, pol in (("regex", regex), ("jax", plain)):
        saved = timeit.timeit(lambda: pol(name_p, name=literal[0]), number=n) / n
        other = timeit.timeit(lambda: pol(dot), number=n) / n
        out[label] = {"name_call_ns": 1e9 * saved, "other_call_ns": 1e9 * other}
    # How many calls one trace makes (the counting wrapper delegates to the JAX policy).
    calls = {"name": 0, "other": 0}

    def counting(prim: Any, *a: Any, **k: Any) -> Any:
        calls["name" if prim is name_p else "other"] += 1
        return plain(prim, *a, **k)

    shapes = jax.eval_shape(lambda k: ref.init_layer(k, config), jax.random.PRNGKey(0))
    params = jax.tree.map(lambda s: jnp.zeros((32, *s.shape), s.dtype), shapes)
    x = jnp.zeros((size.batch, size.seq, size.hidden), jnp.float32)
    jax.make_jaxpr(jax.grad(lambda p, x: jnp.mean(
        ref.stack(x, p, size.config(32), policy=counting, scan=False) ** 2)))(params, x)
    out["calls_per_trace_32_unrolled"] = dict(calls)
    extra = sum(calls[k] * (out["regex"][f"{k}_call_ns"] - out["jax"][f"{k}_call_ns"])
                for k in ("name", "other"))
    out["extra_us_per_trace"] = extra / 1e3
    return out


def build_parser() -> Any:
    p = C.parser(__doc__.splitlines()[0], NAME)
    p.add_argument("--repeat", type=int, default=None,
                   help="repetitions (default: 5 fresh interpreters, 15 trace pairs; --small: "
                        "1 and 3)")
    p.add_argument("--layers", type=int, default=None,
                   help="layers of the traced stack (default 32; --small 8)")
    return p


# Targets: (row label prefix, limit, unit). A figure over its limit is flagged in the table
# and listed under "targets" in the JSON, so a regression cannot pass as a plain number.
IMPORT_TARGET_MS = 50.0
PLAN_TARGET_MS = 50.0
TRACE_TARGET = 0.02  # unrolled stacks; a scanned stack is traced once whatever the policy


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Every figure that has a target: its value, the limit, and whether it meets it."""
    rows = [("import neuron_remat (beyond import jax), .pyc cached",
             res["import"]["bytecode_cached"]["neuron_remat_ms"], IMPORT_TARGET_MS, "ms"),
            ("plan() fuji-70b, 80 layers, 8 x trn2.48xlarge", res["plan"]["median_ms"],
             PLAN_TARGET_MS, "ms")]
    for t in res["trace"]:
        if not t["scan"]:
            rows.append((f"RegexPolicy trace overhead, {t['layers']} layers unrolled",
                         t["overhead"], TRACE_TARGET, "ratio"))
    return [{"what": what, "value": value, "target": limit, "unit": unit,
             "met": bool(value < limit)} for what, value, limit, unit in rows]


def _verdict(checks: dict[str, dict[str, Any]], what: str) -> str:
    check = checks.get(what)
    if check is None:
        return ""
    return "ok" if check["met"] else "OVER TARGET"


def report(res: dict[str, Any]) -> str:
    imp, det, pl = res["import"], res["detect"], res["plan"]
    cached, as_run = imp["bytecode_cached"], imp["as_run"]
    checks = {c["what"]: c for c in res["targets"]}
    first = "import neuron_remat (beyond import jax), .pyc cached"
    rows = [
        (first, f"{cached['neuron_remat_ms']:.1f} ms", f"< {IMPORT_TARGET_MS:g} ms",
         _verdict(checks, first),
         f"import jax itself {cached['jax_ms']:.0f} ms; starts a backend: "
         f"{cached['backends_started_at_import']}"),
        ("import neuron_remat (beyond import jax), as run", f"{as_run['neuron_remat_ms']:.1f} ms",
         "", "", f"PYTHONDONTWRITEBYTECODE={as_run['PYTHONDONTWRITEBYTECODE']}; import jax "
                 f"{as_run['jax_ms']:.0f} ms"),
    ]
    for label, d in ((k, det[k]) for k in ("default", "override", "use_jax=False")):
        rows.append((f"detect() first call, fresh process [{label}]",
                     f"{d['first_call_fresh_process_ms']:.1f} ms", "", "", d["device"]))
        rows.append((f"detect(refresh=True) cold [{label}]", f"{d['cold_refresh_ms']:.2f} ms",
                     "", "", ""))
        rows.append((f"detect() warm [{label}]", f"{d['warm_us']:.1f} us", "", "", ""))
    what = "plan() fuji-70b, 80 layers, 8 x trn2.48xlarge"
    rows.append((what, f"{pl['median_ms']:.2f} ms", f"< {PLAN_TARGET_MS:g} ms",
                 _verdict(checks, what), f"first call {pl['first_ms']:.1f} ms"))
    for t in res["trace"]:
        kind = "scanned" if t["scan"] else "unrolled"
        what = f"RegexPolicy trace overhead, {t['layers']} layers {kind}"
        rows.append((what, f"{100 * t['overhead']:+.2f}%",
                     f"< {100 * TRACE_TARGET:g}%" if not t["scan"] else "",
                     _verdict(checks, what),
                     f"make_jaxpr(grad): {t['regex_ms']:.0f} vs {t['jax_ms']:.0f} ms, "
                     f"{t['repeat']} pairs"))
    pc = res["policy_calls"]
    calls = pc["calls_per_trace_32_unrolled"]
    rows.append(("policy call cost: RegexPolicy vs save_only_these_names",
                 f"{pc['extra_us_per_trace']:+.1f} us/trace", "", "",
                 f"name {pc['regex']['name_call_ns']:.0f} vs {pc['jax']['name_call_ns']:.0f} ns,"
                 f" other {pc['regex']['other_call_ns']:.0f} vs "
                 f"{pc['jax']['other_call_ns']:.0f} ns; {calls['name']} + {calls['other']} "
                 "calls per trace"))
    lines = ["Overheads (medians)",
             C.table(rows, ("what", "time", "target", "meets", "note"))]
    missed = [c for c in res["targets"] if not c["met"]]
    if missed:
        lines.append(f"{len(missed)} figure(s) OVER TARGET: "
                     + "; ".join(c["what"] for c in missed))
    else:
        lines.append("every figure with a target meets it")
    if not res["import_breakdown"]:
        return "\n".join(lines)
    lines += ["", "import neuron_remat after import jax, by module (python -X importtime, one "
              "run, as run):"]
    lines.append(C.table([(r["module"], f"{r['self_us'] / 1e3:.1f}",
                           f"{r['cumulative_us'] / 1e3:.1f}") for r in res["import_breakdown"]],
                         ("module", "self ms", "cumulative ms")))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    say = C.Printer(args.quiet)
    sub_repeat = args.repeat or (1 if args.small else 5)
    pairs = args.repeat or (3 if args.small else 15)
    layers = args.layers or (8 if args.small else 32)
    t0 = time.perf_counter()
    res = {
        "import": import_overhead(sub_repeat),
        "import_breakdown": [] if args.small else import_breakdown(),
        "detect": detect_overhead(sub_repeat),
        "plan": plan_overhead(20 if args.small else 200),
        "trace": [trace_overhead(layers, pairs, scan=False),
                  trace_overhead(layers, pairs, scan=True)],
        "policy_calls": policy_call_cost(),
    }
    res["targets"] = targets(res)
    res["seconds"] = time.perf_counter() - t0
    return C.finish(args, NAME, res, report(res), say)


if __name__ == "__main__":
    main()
