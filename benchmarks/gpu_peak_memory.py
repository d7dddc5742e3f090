"""Real accelerator peak memory under each policy, next to the planner's byte predictions.

Optional, for a machine with a CUDA GPU; never needed for CI. On the frontier's layer
stack, for every hand-written policy and the planner's choice at each budget, one fresh
process per (policy, layer count) runs the compiled gradient step once and reads
``jax.devices()[0].memory_stats()["peak_bytes_in_use"]`` (a process-lifetime high-water
mark, hence one process each), minus the bytes in use before the step (parameters and
input). Over two layer counts the slope per layer, less the gradient bytes per layer (the
step returns one gradient per parameter), is what each layer keeps for the backward; it is
printed beside JAX's saved-residual bytes and the analytic prediction, together with the
slope of XLA's own ``temp_size_in_bytes`` on the GPU.

Without a GPU it says so and exits with status 0. ``--dtype bfloat16`` measures 16-bit
activations (the GPU stores them natively, unlike the CPU backend).
"""

from __future__ import annotations

import json
import os

# The parent only predicts; keep JAX from reserving most of the GPU for it (and for each
# worker, which measures what the step itself allocates).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

NAME = "gpu_peak_memory"


def gpu_devices() -> list[Any]:
    import jax  # noqa: PLC0415

    try:
        return list(jax.devices("gpu"))
    except RuntimeError:
        return []


def memory_stats(device: Any) -> dict[str, int]:
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        raise RuntimeError(f"{device} reports no peak_bytes_in_use in memory_stats()")
    return stats


def _rows(bench: Any, budgets: int) -> list[Any]:
    import frontier as fr  # noqa: PLC0415

    return fr.hand_written(bench) + fr.planner_rows(bench, fr.budgets(bench, budgets), None)


def _bench(size: str, layers: Sequence[int], dtype: str, device: Any = None) -> Any:
    import frontier as fr  # noqa: PLC0415

    return fr.Bench(C.SIZES[size], layers, {}, dtype=dtype, device=device)


def worker(size: str, layers: int, dtype: str, budgets: int, name: str) -> dict[str, Any]:
    """Run one policy's gradient step once in this (fresh) process and report its peak."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import reference as ref  # noqa: PLC0415

    device = gpu_devices()[0]
    bench = _bench(size, (layers,), dtype, device)
    row = next(r for r in _rows(bench, budgets) if r.name == name)
    params, x = bench.stack_params[layers], bench.x
    config = bench.config

    def loss(p: Any, x: Any) -> Any:
        y = ref.stack(x, p, config, policy=row.policy, scan=True)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss))
    exe = step.lower(params, x).compile()
    jax.block_until_ready((params, x))
    before = memory_stats(device)["bytes_in_use"]
    grads = exe(params, x)
    jax.block_until_ready(grads)
    stats = memory_stats(device)
    return {"name": name, "layers": layers, "before_bytes": before,
            "peak_bytes": stats["peak_bytes_in_use"],
            "step_peak_bytes": stats["peak_bytes_in_use"] - before,
            "temp_bytes": exe.memory_analysis().temp_size_in_bytes,
            "grad_bytes": sum(g.size * g.dtype.itemsize for g in jax.tree.leaves(grads))}


def measure(args: Any, say: C.Printer) -> dict[str, Any]:
    layers = tuple(int(v) for v in args.layers.split(","))
    bench = _bench(args.size, layers, args.dtype)
    rows = _rows(bench, args.budgets)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = []
    for row in rows:
        runs = {}
        for n in layers:
            cmd = [sys.executable, __file__, "--worker", row.name, "--size", args.size,
                   "--dtype", args.dtype, "--budgets", str(args.budgets), "--layers", str(n)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            if proc.returncode:
                raise RuntimeError(f"worker for {row.name!r} failed:\n{proc.stderr[-2000:]}")
            runs[n] = json.loads(proc.stdout.strip().splitlines()[-1])
        a, b = layers[0], layers[-1]
        grads_per_layer = (runs[b]["grad_bytes"] - runs[a]["grad_bytes"]) / (b - a)
        peak_slope = (runs[b]["step_peak_bytes"] - runs[a]["step_peak_bytes"]) / (b - a)
        temp_slope = (runs[b]["temp_bytes"] - runs[a]["temp_bytes"]) / (b - a)
        saved = bench.residuals(row.policy).bytes
        out.append({"name": row.name, "group": row.group,
                    "predicted_bytes": row.predicted_bytes, "saved_residual_bytes": saved,
                    "peak_per_layer_bytes": peak_slope - grads_per_layer,
                    "peak_slope_bytes": peak_slope, "grad_bytes_per_layer": grads_per_layer,
                    "temp_slope_bytes": temp_slope, "runs": runs})
        say(f"  {row.name}: {C.kib(peak_slope - grads_per_layer)} KiB/layer at peak")
    return {"device": str(gpu_devices()[0]), "size": C.SIZES[args.size].to_dict(),
            "dtype": args.dtype, "layers": list(layers), "policies": out}


def report(res: dict[str, Any]) -> str:
    rows = [(r["name"], C.kib(r["predicted_bytes"]), C.kib(r["saved_residual_bytes"]),
             C.kib(r["peak_per_layer_bytes"]), C.kib(r["temp_slope_bytes"]),
             f"{r['peak_per_layer_bytes'] / r['predicted_bytes']:.3f}")
            for r in res["policies"]]
    return (f"GPU peak memory per layer ({res['device']}, {res['dtype']}, layers "
            f"{res['layers']})\n" + C.table(rows, (
                "policy", "predicted KiB", "saved residuals KiB", "peak slope - grads KiB",
                "XLA temp slope KiB", "peak/predicted")))


def build_parser() -> Any:
    p = C.parser(__doc__.splitlines()[0], NAME)
    p.add_argument("--size", choices=sorted(C.SIZES), default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--layers", default="4,8")
    p.add_argument("--budgets", type=int, default=8)
    p.add_argument("--worker", default=None, help=argparse_hidden())
    return p


def argparse_hidden() -> str:
    import argparse  # noqa: PLC0415

    return argparse.SUPPRESS


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.size is None:
        args.size = "small" if args.small else "default"
    if args.worker is not None:
        res = worker(args.size, int(args.layers), args.dtype, args.budgets, args.worker)
        print(json.dumps(res))
        return res
    say = C.Printer(args.quiet)
    if not gpu_devices():
        import jax  # noqa: PLC0415

        msg = (f"no CUDA GPU here (JAX backend: {jax.default_backend()}); this benchmark "
               "measures accelerator peak memory and needs one. Nothing to do.")
        say(msg)
        res = {"skipped": True, "reason": msg}
        C.write_json(C.json_path(args, NAME), res)
        return res
    t0 = time.perf_counter()
    res = measure(args, say) | {"skipped": False}
    res["seconds"] = time.perf_counter() - t0
    return C.finish(args, NAME, res, report(res), say)


if __name__ == "__main__":
    main()
    sys.exit(0)
