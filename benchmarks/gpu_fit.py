"""`fit` on a real accelerator: does the plan's step fit when it runs, and what does its
recompute cost in time?

Optional, for a machine with a CUDA GPU; never needed for CI (elsewhere it says so and
exits with status 0). The steps are tests/cpu/zoo.py's scanned ones, made larger
(``--batch-scale``, ``--width-scale``: hidden, FFN and head widths) so that a step's time
is more than kernel launches. For each step:

1. one process compiles full remat and no remat on the GPU (``memory_analysis()``:
   argument + output + temp - alias), which bound the HBM sizes: each ``--fractions``
   share of the way from the one to the other;
2. one process per size runs ``neuron_remat.fit`` against XLA:GPU (at most ``--jobs`` at
   once: compiling is CPU work), a simulated one-core device of that HBM, no reserve;
3. one fresh process per plan (several at once: each has its own allocator) compiles
   ``Plan.policy``'s save set itself, allocates the real state and batch, runs the step
   once and reads ``memory_stats()["peak_bytes_in_use"]`` (a process-lifetime high-water
   mark: the state, the batch and the step's own buffers, but also whatever the compile's
   autotuning held, which is kept apart as ``init_peak_bytes``: a row whose peak is no
   more than that says "compile" instead of a verdict; hence a process each);
4. one process per step, one at a time, times ``--iters`` steps (the median, after two
   warm-up steps)
   of full remat, no remat and each plan, the state fed back as the step donates it.

``--small`` (the smoke test): gqa4-adamw unscaled, one size, three timed steps.

Printed per plan: the HBM size, the save set, the bytes the plan states, the bytes its
policy compiles to here, the measured peak and whether it is within the size; the recompute
as points of step FLOPs (fit's traced count) beside the measured step time over no
remat's. The time figures are this GPU's: on Trainium the engines differ
(README, "Recompute time as the objective").

    python benchmarks/gpu_fit.py [--steps a,b] [--fractions 0.3,0.7] [--out out]
    python benchmarks/gpu_fit.py --reuse out/gpu_fit.json   # time those plans again (the
                                       # file's scales; its other steps kept as they were)
    python benchmarks/gpu_fit.py --steps gqa4-adamw --repeat 3 --json out/gpu_fit_repeat.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# The parent only orchestrates; each worker measures what its own step allocates.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

NAME = "gpu_fit"
MiB = 1 << 20
NAN = float("nan")  # a FLOP count the backend did not give
STEPS = ("gqa4-adamw", "wide-ffn-sgd-bf16", "long-seq", "wide-attn-mqa-adafactor",
         "moe-fused-qkv", "big-state")
"""The zoo's scanned steps (the unrolled one is about XLA:CPU's scheduling)."""


def _zoo() -> Any:
    for path in (C.REPO, C.REPO / "tests" / "cpu"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import zoo  # noqa: PLC0415

    return zoo


def _spec(name: str, batch_scale: int, width_scale: int) -> Any:
    s = _zoo().ZOO[name]
    return dataclasses.replace(s, batch=s.batch * batch_scale, hidden=s.hidden * width_scale,
                               ffn=s.ffn * width_scale, head_dim=s.head_dim * width_scale)


def _policy(saved: Sequence[str] | None) -> Any:
    import jax  # noqa: PLC0415

    if saved is None:
        return jax.checkpoint_policies.everything_saveable
    return jax.checkpoint_policies.save_only_these_names(*saved)


# ---- workers (one fresh process each) -------------------------------------------------


def work_range(spec: Any) -> dict[str, Any]:
    """Full remat's and no remat's compiled bytes."""
    make, args = spec.make_step(), spec.abstract_args()
    return {s: C.compiled_bytes(make(_policy(saved)).lower(*args).compile())
            for s, saved in (("full", ()), ("none", None))}


def work_fit(spec: Any, hbm: int) -> dict[str, Any]:
    """`fit` at `hbm` bytes; the plan's save set and stated figures."""
    import neuron_remat as nr  # noqa: PLC0415

    device = nr.parse_device(f"trn2.48xlarge:hbm={hbm}B:cores=1", source="gpu_fit")
    lines: list[str] = []
    t0 = time.perf_counter()
    try:
        plan = nr.fit(spec.make_step(), *spec.abstract_args(), device=device, reserve=0,
                      progress=lines.append)
    except (nr.NoFitError, ValueError) as err:
        return {"hbm": hbm, "outcome": type(err).__name__, "why": str(err).splitlines()[0],
                "log": lines, "seconds": time.perf_counter() - t0}
    rec = plan.compiled
    return {"hbm": hbm, "outcome": "plan", "saved": None if rec.no_remat
            else list(plan.saved_tags), "stated_bytes": rec.bytes, "stated_flops": rec.flops,
            "overhead": rec.overhead, "compiles": rec.compiles, "log": lines,
            "seconds": time.perf_counter() - t0}


def work_compile(spec: Any) -> dict[str, Any]:
    """Every tag saved, compiled: its bytes and FLOPs (does a compile repeat?)."""
    saved = tuple(sorted({t for t in spec.tags.values() if t}))
    exe = spec.make_step()(_policy(saved)).lower(*spec.abstract_args()).compile()
    return {"bytes": C.compiled_bytes(exe), "flops": C.compiled_flops(exe, missing=NAN)}


def work_peak(spec: Any, saved: Sequence[str] | None) -> dict[str, Any]:
    """Compile the step for `saved` and run it once on real arrays: its peak bytes."""
    import jax  # noqa: PLC0415

    dev = jax.devices()[0]
    exe = spec.make_step()(_policy(saved)).lower(*spec.abstract_args()).compile()
    state, tokens = _arrays(spec)
    stats = dev.memory_stats() or {}
    before, init_peak = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
    state, loss = exe(state, tokens)
    jax.block_until_ready((state, loss))
    return {"saved": None if saved is None else list(saved),
            "compiled_bytes": C.compiled_bytes(exe), "flops": C.compiled_flops(exe, missing=NAN),
            "before_bytes": before,
            "init_peak_bytes": init_peak,
            "peak_bytes": (dev.memory_stats() or {}).get("peak_bytes_in_use"),
            "loss": float(loss), "device": str(dev)}


def work_time(spec: Any, sets: Sequence[Sequence[str] | None], iters: int) -> list[float]:
    """The median step time of each save set (None: no remat), one after the other."""
    import jax  # noqa: PLC0415

    out = []
    for saved in sets:
        exe = spec.make_step()(_policy(saved)).lower(*spec.abstract_args()).compile()
        held = list(_arrays(spec))  # [state, tokens]: the step donates the state

        def step() -> None:
            held[0], loss = exe(*held)  # noqa: B023 - called within this iteration
            jax.block_until_ready((held[0], loss))

        out.append(C.median_time(step, iters, warmup=2))
    return out


def _arrays(spec: Any) -> tuple[Any, Any]:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    params = spec.init(jax.random.PRNGKey(0))
    state = (params, spec.optimizer_fn().init(params))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (spec.batch, spec.seq + 1), 0,
                                spec.vocab, jnp.int32)
    return jax.block_until_ready((state, tokens))


def _worker(argv: Sequence[str]) -> None:
    kind, name, bs, ws, payload = argv[:5]
    spec = _spec(name, int(bs), int(ws))
    data = json.loads(payload)
    if kind == "range":
        out = work_range(spec)
    elif kind == "fit":
        out = work_fit(spec, int(data))
    elif kind == "compile":
        out = work_compile(spec)
    elif kind == "peak":
        out = work_peak(spec, data)
    else:
        out = {"seconds": work_time(spec, data["sets"], int(data["iters"]))}
    print(json.dumps(out))


# ---- the parent -----------------------------------------------------------------------


def _call(kind: str, name: str, args: Any, payload: Any) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", kind, name, str(args.batch_scale),
           str(args.width_scale), json.dumps(payload)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=args.worker_timeout,
                              env=dict(os.environ, PYTHONPATH=str(C.REPO)))
    except subprocess.TimeoutExpired:
        return {"error": f"{kind} {name}: timed out after {args.worker_timeout} s "
                         "(--worker-timeout)"}
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": f"{kind} {name} {payload}: exit {proc.returncode}: "
                         + " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(args: Any, say: Any) -> dict[str, Any]:
    steps = [s for s in args.steps.split(",") if s]
    t_end = time.monotonic() + (args.deadline or 1e9)
    fracs = [float(f) for f in args.fractions.split(",") if f]
    pool = ThreadPoolExecutor(max_workers=args.jobs)
    if args.repeat:  # every tag saved, compiled alone in a fresh process, `repeat` times
        return {"repeat": {s: [_call("compile", s, args, 0) for _ in range(args.repeat)]
                           for s in steps}}
    if args.reuse is not None:  # the plans (and their peaks) of an earlier run: time them
        old = args.reuse_data
        args.batch_scale, args.width_scale = old["batch_scale"], old["width_scale"]
        out = old["steps"]  # every step of the file; the chosen ones timed again
        _time(out, [s for s in steps if s in out], args, t_end, say)
        return {"batch_scale": args.batch_scale, "width_scale": args.width_scale,
                "iters": args.iters, "steps": out, "reused": str(args.reuse)}
    ranges = dict(zip(steps, pool.map(lambda s: _call("range", s, args, 0), steps)))
    jobs = []
    for s in steps:
        r = ranges[s]
        if "error" in r:
            say(f"  {s}: {r['error']}")
            continue
        say(f"  {s}: full remat {r['full'] / MiB:.1f} MiB, no remat {r['none'] / MiB:.1f} MiB")
        jobs += [(s, int(r["full"] + f * (r["none"] - r["full"]))) for f in fracs]
    fits = list(pool.map(lambda j: _call("fit", j[0], args, j[1]), jobs))
    out: dict[str, Any] = {s: {"range": ranges[s], "plans": [], "base": {}} for s in steps}
    for (s, hbm), f in zip(jobs, fits):
        f.setdefault("hbm", hbm)
        say(f"  {s} at {hbm / MiB:.1f} MiB: "
            + (f.get("error") or f"{f['outcome']} {f.get('saved')} ({f['seconds']:.0f} s)"))
        out[s]["plans"].append(f)
    planned = [(s, f) for s in steps for f in out[s]["plans"] if f.get("outcome") == "plan"]
    # peaks: a fresh process per plan (each its own allocator), several at once
    for (_, f), r in zip(planned, pool.map(
            lambda sf: _call("peak", sf[0], args, sf[1]["saved"]), planned)):
        f["run"] = r
    _time(out, steps, args, t_end, say)
    return {"batch_scale": args.batch_scale, "width_scale": args.width_scale,
            "iters": args.iters, "steps": out}


def _time(out: dict[str, Any], steps: Sequence[str], args: Any, t_end: float,
          say: Any) -> None:
    """Time full remat, no remat and each plan: one process per step, one at a time."""
    for s in steps:
        if "error" in out[s]["range"] or time.monotonic() > t_end:
            continue
        plans = [f for f in out[s]["plans"] if f.get("outcome") == "plan"]
        got = _call("time", s, args, {"sets": [(), None] + [f["saved"] for f in plans],
                                      "iters": args.iters})
        if "error" in got:
            say(f"  {s}: {got['error']}")
            continue
        secs = got["seconds"]
        out[s]["base"] = {"full": secs[0], "none": secs[1]}
        for f, t in zip(plans, secs[2:]):
            f["step_seconds"] = t
        say(f"  {s}: timed")


def report(res: dict[str, Any]) -> str:
    if "repeat" in res:
        return "every tag saved, compiled alone in fresh processes, one after another\n" + \
            C.table([(s, *(f"{r.get('bytes', 0) / MiB:.2f} MiB {r.get('flops', 0) / 1e9:.2f} "
                           "GFLOP" if "error" not in r else r["error"][:40] for r in rs))
                     for s, rs in res["repeat"].items()],
                    ("step", *(f"compile {i + 1}" for i in range(len(
                        next(iter(res["repeat"].values()), []))))))
    rows = []
    for s, d in res["steps"].items():
        t0 = d["base"].get("none")
        for f in d["plans"]:
            r = f.get("run", {})
            if f.get("outcome") != "plan" or "error" in r:
                why = r.get("error") or f.get("error") or f"{f.get('outcome')}: {f.get('why')}"
                rows.append((s, f"{f['hbm'] / MiB:.1f}", why[:60], *["-"] * 7))
                continue
            peak, t = r.get("peak_bytes"), f.get("step_seconds")
            scratch = peak is not None and peak <= (r.get("init_peak_bytes") or 0)
            rows.append((
                s, f"{f['hbm'] / MiB:.1f}",
                "no remat" if f["saved"] is None else ",".join(f["saved"]) or "full remat",
                f"{f['stated_bytes'] / MiB:.1f}", f"{r['compiled_bytes'] / MiB:.1f}",
                "-" if peak is None else f"{peak / MiB:.1f}",
                "-" if peak is None else "compile" if scratch else (
                    "yes" if peak <= f["hbm"] else "NO"),
                C.pct(f["overhead"]),
                "-" if not (t0 and t) else C.pct(t / t0 - 1),
                "-" if not t else f"{1e3 * t:.2f}"))
    text = C.table(rows, ("step", "HBM MiB", "plan", "stated MiB", "compiled MiB",
                          "peak MiB", "peak fits", "recompute (FLOPs)",
                          "time over no remat", "step ms"))
    base = [(s, *(f"{1e3 * d['base'][k]:.2f}" if k in d["base"] else "-"
                  for k in ("full", "none")),
             *(f"{d['range'][k] / MiB:.1f}" if k in d["range"] else "-"
               for k in ("full", "none")))
            for s, d in res["steps"].items()]
    return (f"fit against XLA:GPU (zoo steps, batch x{res['batch_scale']}, widths "
            f"x{res['width_scale']}; median of {res['iters']} steps)\n" + text + "\n\n"
            + C.table(base, ("step", "full remat ms", "no remat ms", "full remat MiB",
                             "no remat MiB")))


def _check(p: Any, args: Any) -> None:
    """One line naming the bad value (argparse's error, exit 2) for bad options."""
    zoo = _zoo()
    steps = [s for s in args.steps.split(",") if s]
    bad = [s for s in steps if s not in zoo.ZOO or not zoo.ZOO[s].scan]
    if bad or not steps:
        p.error(f"--steps {args.steps!r}: {', '.join(bad) or 'none given'}: not a scanned zoo "
                f"step; valid: {', '.join(STEPS)}")
    try:
        fracs = [float(f) for f in args.fractions.split(",") if f]
    except ValueError:
        fracs = []
    if not fracs or not all(0 <= f <= 1.05 for f in fracs):
        p.error(f"--fractions {args.fractions!r}: give comma-separated shares of the way "
                "from full remat's bytes to no remat's, each in [0, 1.05]")
    for name in ("batch_scale", "width_scale", "iters", "jobs", "worker_timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    args.reuse_data = None
    if args.reuse is not None:
        try:
            data = json.loads(args.reuse.read_text())
            if not isinstance(data.get("steps"), dict) or "batch_scale" not in data:
                raise ValueError("no plans in it (a --repeat run, or a skipped one?)")
        except (OSError, ValueError) as err:
            p.error(f"--reuse {args.reuse}: cannot use it: {err}")
        args.reuse_data = data


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = C.parser(__doc__.split("\n")[0], NAME)
    p.add_argument("--steps", default=",".join(STEPS))
    p.add_argument("--fractions", default="0.3,0.7",
                   help="HBM sizes: shares of the way from full remat's bytes to no remat's")
    p.add_argument("--batch-scale", type=int, default=16)
    p.add_argument("--width-scale", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--jobs", type=int, default=8, help="fit processes at once")
    p.add_argument("--worker-timeout", type=int, default=400)
    p.add_argument("--reuse", type=Path, default=None, metavar="JSON",
                   help="an earlier run's JSON: time its plans again (no fit, no peaks)")
    p.add_argument("--repeat", type=int, default=0, metavar="N",
                   help="only compile each step's every-tag set N times, one fresh process "
                        "after another (does a compile repeat?)")
    p.add_argument("--deadline", type=float, default=0,
                   help="seconds after which no more steps are timed (0: none)")
    p.add_argument("--any-backend", action="store_true",
                   help="run where no GPU is (to try the script; the figures mean little)")
    args = p.parse_args(argv)
    if args.small:
        args.steps, args.fractions, args.batch_scale, args.width_scale, args.iters = (
            "gqa4-adamw", "0.5", 1, 1, 3)
    _check(p, args)
    say = C.Printer(args.quiet)
    import jax  # noqa: PLC0415

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus and not args.any_backend:
        say("gpu_fit: no CUDA GPU here; nothing measured")
        return {"skipped": "no GPU"}
    result = measure(args, say)
    result["device"] = str(gpus[0]) if gpus else str(jax.devices()[0])
    result["jax"] = jax.__version__
    return C.finish(args, NAME, result, report(result), say)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
    else:
        main()
