"""Shared pieces of the benchmark scripts: layer sizes, argument parsing, tables, JSON.

The scripts in this folder are run as ``python benchmarks/<name>.py``; each also has a
``main(argv) -> dict`` that `run_all` and the smoke test call in-process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "out"
# The plain-JAX reference layers are test fixtures (tests/cpu/reference*.py), not part of
# the package: the benchmarks import them from there.
FIXTURES = REPO / "tests" / "cpu"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))


@dataclass(frozen=True)
class Size:
    """A reference decoder layer and the micro-batch it runs on (float32 throughout: the
    CPU backend stores bfloat16 as float32, so only float32 measures what a device keeps)."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    batch: int

    def config(self, layers: int = 8) -> Any:
        import neuron_remat as nr  # noqa: PLC0415

        return nr.TransformerConfig(hidden=self.hidden, heads=self.heads,
                                    kv_heads=self.kv_heads, ffn=self.ffn, layers=layers,
                                    vocab=1024, flash_attention=False, name="bench-layer")

    def shape(self) -> Any:
        import neuron_remat as nr  # noqa: PLC0415

        return nr.StepShape(seq_len=self.seq, micro_batch=self.batch,
                            activation_dtype="float32")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


SIZES = {
    # GQA (8 query heads over 2 KV heads), gated SiLU FFN: compiles in about a second.
    "default": Size(hidden=256, heads=8, kv_heads=2, ffn=704, seq=128, batch=2),
    # For the smoke test.
    "small": Size(hidden=64, heads=4, kv_heads=2, ffn=176, seq=32, batch=1),
}


def parser(description: str, name: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--small", action="store_true",
                   help="smallest sizes and fewest repetitions (the smoke test)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"folder for JSON and PNG output (default {DEFAULT_OUT})")
    p.add_argument("--json", type=Path, default=None,
                   help=f"where to write the JSON (default OUT/{name}.json)")
    p.add_argument("--quiet", action="store_true", help="print nothing")
    return p


def host_devices(n: int) -> None:
    """Before JAX's backend starts (importing JAX does not start it): XLA:CPU makes `n`
    devices (a step laid out over several). One line when XLA_FLAGS says another count."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        if f"xla_force_host_platform_device_count={n}" not in flags:
            raise SystemExit(f"--host-devices {n}: XLA_FLAGS already sets another device "
                             f"count ({flags!r})")
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def prepare_compiles() -> None:
    """Before JAX starts: XLA:CPU's LLVM optimisation off unless XLA_FLAGS sets it (memory and
    cost analysis are the same either way, compiles cheaper), and this checkout's
    neuron_remat first on sys.path."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0 "
                                   "--xla_llvm_disable_expensive_passes=true").strip()
    if str(REPO) not in sys.path[:1]:
        sys.path.insert(0, str(REPO))  # this checkout's neuron_remat


MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                 "alias_size_in_bytes")


def memory_row(compiled: Any) -> dict[str, int]:
    """A compiled step's ``memory_analysis()`` fields (`MEMORY_FIELDS`), read once, and
    its bytes as XLA counts them: arguments + outputs + temporaries - donated (aliased)
    buffers."""
    m = compiled.memory_analysis()
    row = {f: int(getattr(m, f)) for f in MEMORY_FIELDS}
    row["bytes"] = (row["argument_size_in_bytes"] + row["output_size_in_bytes"]
                    + row["temp_size_in_bytes"] - row["alias_size_in_bytes"])
    return row


def program_key(text: str, options: dict[str, Any] | None = None) -> str:
    """A compiled program's key in a committed table: the SHA-256 of its lowered text (and
    of the compile options, where given)."""
    import hashlib  # noqa: PLC0415

    if options is not None:
        text += json.dumps(options, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def compiled_bytes(compiled: Any) -> int:
    """A compiled step's bytes as XLA counts them (`memory_row`)."""
    return memory_row(compiled)["bytes"]


def compiled_transcendentals(compiled: Any) -> float:
    """A compiled step's transcendental operations (``cost_analysis()``, counted apart from
    its flops); 0 where the backend gives none."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) and cost else cost) or {}
    return float(cost.get("transcendentals", 0.0))


def compiled_flops(compiled: Any, missing: float | None = None) -> float:
    """A compiled step's FLOPs (``cost_analysis()``: a dict, or a list of one on older
    JAX). Where the backend gives none: `missing` when given (gpu_fit records nan), else
    a ValueError, so that no reference table holds a FLOP count nobody measured."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) and cost else cost) or {}
    if "flops" in cost:
        return float(cost["flops"])
    if missing is None:
        raise ValueError("cost_analysis() gives no 'flops' for this compile")
    return missing


def json_path(args: argparse.Namespace, name: str) -> Path:
    return args.json if args.json is not None else args.out / f"{name}.json"


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    return path


def finish(args: argparse.Namespace, name: str, result: dict[str, Any], text: str,
           say: Callable[[str], None]) -> dict[str, Any]:
    """Print a script's report, write its JSON and say where."""
    say(text)
    say(f"wrote {write_json(json_path(args, name), result)}")
    return result


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    raise TypeError(f"not JSON serialisable: {obj!r}")


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells[1:])
    return "\n".join(out)


def kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def median_time(fn: Callable[[], Any], repeat: int, warmup: int = 1) -> float:
    """Median wall-clock seconds of `fn()` over `repeat` calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def fit_power(xs: Iterable[float], ys: Iterable[float]) -> float:
    """Least-squares exponent k of ``y = c * x**k`` (log-log slope)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    return _slope(pts)


def fit_exponential(xs: Iterable[float], ys: Iterable[float]) -> float:
    """Least-squares growth factor g of ``y = c * g**x`` (per unit of x)."""
    pts = [(float(x), math.log(y)) for x, y in zip(xs, ys) if y > 0]
    return math.exp(_slope(pts))


def _slope(pts: list[tuple[float, float]]) -> float:
    if len(pts) < 2:
        return float("nan")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else float("nan")


class Printer:
    """`print` unless --quiet."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, *parts: Any) -> None:
        if not self.quiet:
            print(*parts, flush=True)
