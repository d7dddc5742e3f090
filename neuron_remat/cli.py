"""``neuron-remat``: detect the device, plan a remat policy, audit one, list presets."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

# JAX-free modules only: `--help`, `detect` and `models` never load JAX (4-5 s). The
# commands that trace, plan or build policies import what they need when they run.
from . import device as dev
from . import memory_model as mm
from . import models
from ._format import describe_device
from .device.parsing import _ASCII_SPACE

if TYPE_CHECKING:
    from . import planner

__all__ = ["main"]


# With --json, stdout holds the JSON document alone: what the user's code prints while a
# command imports, traces and compiles it (MaxText prints diagnostics; a compiler run as a
# subprocess may too) goes to stderr, and the JSON is written once the command is done.
_JSON_PENDING: list[list[str] | None] = [None]


def _print_json(obj: Any) -> None:
    text = json.dumps(obj, indent=2, default=str)
    pending = _JSON_PENDING[0]
    if pending is None:
        print(text)
    else:
        pending.append(text)


@contextlib.contextmanager
def _stdout_to_stderr() -> Any:
    """Python's stdout and file descriptor 1 (C code, subprocesses) both to stderr while a
    command runs; restored after."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 to move: Python's stdout alone
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


# --------------------------------------------------------------------------------------
# Input validation: every flag is checked where it enters, and a bad one is one line
# naming the value, the flag and what is valid (exit 2).
# --------------------------------------------------------------------------------------

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
_MAX_COUNT = models._MAX_SIZE


class UsageError(ValueError):
    """Bad input on the command line."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised (one line, exit 2, JSON under --json) rather than
    printed after the usage text."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def _count(low: int = 1, *, allow: tuple[int, ...] = (), high: int = _MAX_COUNT,
           what: str = "count") -> Any:
    """An argparse type: an integer in ``low..high`` (or one of `allow`), ASCII digits."""

    def parse(text: str) -> int:
        raw = text.strip(_ASCII_SPACE)  # ASCII spaces only, as the digits
        body = raw[1:] if raw.startswith("-") else raw
        valid = f"an integer from {low} to {high}" + "".join(f" or {a}" for a in allow)
        if not (body.isascii() and body.isdigit()):
            raise argparse.ArgumentTypeError(f"{dev._show(text)} is not {what}; valid: {valid}")
        if len(body) > 12:
            raise argparse.ArgumentTypeError(f"{dev._show(text)} is out of range; valid: {valid}")
        n = int(raw)
        if n not in allow and not low <= n <= high:
            raise argparse.ArgumentTypeError(f"{n} is out of range; valid: {valid}")
        return n

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def _optimizer(text: str) -> str | float:
    if text in models._OPTIMIZERS:
        return text
    valid = (f"{', '.join(models._OPTIMIZERS)}, or optimizer-state bytes per parameter "
             f"(a number from 0 to {models._MAX_OPT_BYTES})")
    try:
        value = float(text) if text.strip().isascii() and len(text) <= 32 else None
    except ValueError:
        value = None
    if value is None or not 0 <= value <= models._MAX_OPT_BYTES:  # NaN fails both
        raise argparse.ArgumentTypeError(f"{dev._show(text)} is not an optimizer; valid: "
                                         f"{valid}")
    return value


def _reserve(text: str) -> float | int:
    """A fraction of HBM in [0, 1) or a size with a unit."""
    try:
        value = float(text) if text.strip().isascii() and len(text) <= 32 else None
    except ValueError:
        value = None
    if value is not None:
        if not 0 <= value < 1:  # NaN and inf fail too
            raise argparse.ArgumentTypeError(
                f"{dev._show(text)} is not a fraction of HBM below 1 (0.1) nor a size with a "
                "unit (2GiB)")
        return value
    try:
        return dev.parse_bytes(text, what="size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err}; or a fraction of HBM below 1 (0.1)") from None


def _candidates(text: str) -> list[str]:
    items = [c.strip() for c in text.split(",")]
    if not text.strip() or any(not c for c in items):
        raise argparse.ArgumentTypeError(
            f"{dev._show(text)} has an empty entry; give comma-separated tags or roles "
            "(q_proj,k_proj)")
    return items


# --------------------------------------------------------------------------------------
# detect
# --------------------------------------------------------------------------------------


def _cmd_detect(args: argparse.Namespace) -> int:
    spec = dev.detect(refresh=True)
    if args.json:
        _print_json(spec.to_dict())
        return 0
    print(describe_device(spec))
    print("evidence (* decided):")
    for e in spec.evidence:
        print(f"  {e}")
    return 0


# --------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------


def _device_for_plan(text: str) -> tuple[dev.DeviceSpec, str | None]:
    if text == "detected":
        spec, note = dev.detect(), None
    elif text == "auto":
        spec = dev.detect()
        if spec.is_neuron:
            return spec, None
        sim = dev.parse_device("trn2.48xlarge", source="simulated")  # same env handling
        return sim, (f"no Neuron device here ({spec.family}): planning for a simulated "
                     "trn2.48xlarge; pass --device to choose another")
    else:
        spec, note = dev.parse_device(text, source="command line"), None
    if not spec.is_neuron:
        what = "a CPU has" if spec.family == "cpu" else f"a {spec.family} device has"
        raise UsageError(
            f"--device {text}: {what} no HBM to plan for (found {spec.family}); give a Neuron "
            "device, e.g. trn2.48xlarge or trn2:hbm=16GiB, or leave --device at auto")
    return spec, note


def _model(text: str, text_only: bool = False) -> models.TransformerConfig:
    """A built-in model name or a config.json path; file problems name the file. Anything
    shaped like a path is a config.json, so a missing one is reported as missing, not as an
    unknown model name."""
    if os.path.exists(text) or text.lower().endswith(".json") or os.sep in text or "/" in text:
        try:
            return models.load_hf_config(text, text_only=text_only)
        except (ValueError, TypeError) as err:
            raise UsageError(f"--model: {err}") from None
    if text_only:
        raise UsageError(f"--text-only applies to a multimodal config.json; {text!r} is a "
                         "built-in model (text only already)")
    return models.get_model(text)


_OBJECTIVES = ("time", "flops")
"""What `plan --objective` takes: the planner's `OBJECTIVES` (named here: the parser
imports no JAX)."""


def _max_sets(text: str) -> int | None:
    """An argparse type for --max-sets: a positive integer, or 'none' (no bound)."""
    if text.strip().lower() == "none":
        return None
    try:
        return _count(what="a number of save sets")(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err}, or none (no bound)") from None


def _plan_inputs(args: argparse.Namespace) -> tuple[Any, ...]:
    config = _model(args.model, getattr(args, "text_only", False))
    changes: dict[str, Any] = {}
    if args.flash_attention is not None:
        changes["flash_attention"] = args.flash_attention
    if args.tags == "maxtext":
        changes["tags"] = models.MAXTEXT_TAGS
    if changes:
        config = dataclasses.replace(config, **changes)
    seq = args.seq_len if args.seq_len is not None else config.default_seq_len
    if seq is None:
        raise UsageError(f"{config.name} has no default sequence length; pass --seq-len")
    if args.microbatches is not None and args.pp == 1:
        raise UsageError(f"--microbatches {args.microbatches} applies to a pipeline, but "
                         "--pp is 1; give --pp N (N > 1) or drop --microbatches")
    if args.schedule is not None and args.pp == 1:
        raise UsageError(f"--schedule {args.schedule} applies to a pipeline, but --pp is 1; "
                         "give --pp N (N > 1) or drop --schedule")
    shape = models.StepShape(seq_len=seq, micro_batch=args.micro_batch,
                             activation_dtype=args.activation_dtype,
                             param_dtype=args.param_dtype, optimizer=args.optimizer)
    seq_par = args.tp > 1 if args.sequence_parallel is None else args.sequence_parallel
    par = models.Parallelism(tp=args.tp, sequence_parallel=seq_par, fsdp=args.fsdp,
                             dp=args.dp, pp=args.pp, schedule=args.schedule or "1f1b",
                             microbatches=args.microbatches, zero1=args.zero1,
                             hosts=args.hosts, ep=args.ep)
    device, note = _device_for_plan(args.device)
    reserve: float | int | None = args.reserve
    candidates = args.candidates
    return config, shape, par, device, note, reserve, candidates


_PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _check_plot_path(path: str) -> None:
    """Refuse a --plot path that cannot be written, before planning (so that `--json`
    prints one document): a name without a picture's extension, a missing or read-only
    folder, or a file that cannot be opened for writing there."""
    if not path.strip():
        raise UsageError("--plot '': give a file name ending in one of "
                         f"{', '.join(_PLOT_FORMATS)}")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.splitext(path)[1].lower() not in _PLOT_FORMATS:
        raise UsageError(f"--plot {path!r}: the name must end in one of "
                         f"{', '.join(_PLOT_FORMATS)}")
    if not os.path.isdir(folder):
        raise UsageError(f"--plot {path!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"--plot {path!r}: folder {folder!r} is not writable")
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as err:
        raise UsageError(f"--plot {path!r}: cannot write it ({err.strerror or err})"
                         ) from None
    if not existed:
        os.remove(path)  # only the check made it


def _print_plan_json(chosen: planner.Plan, note: str | None, **extra: Any) -> None:
    """A plan as JSON, with the device note and any command-specific fields."""
    out = chosen.to_dict()
    if note:
        out["note"] = note
    out.update(extra)
    _print_json(out)


def _no_fit(err: planner.NoFitError, as_json: bool) -> int:
    """Report that nothing fits (exit 1: the input was valid, the answer is no)."""
    if as_json:
        _print_json({"error": str(err)})
    else:
        print(f"error: {err}", file=sys.stderr)
    return 1


def _cmd_plan(args: argparse.Namespace) -> int:
    from . import planner  # noqa: PLC0415 - policies load JAX: only when planning

    if args.plot is not None:
        _check_plot_path(args.plot)
    if args.max_sets != 2 and not args.per_layer:
        raise UsageError(f"--max-sets {args.max_sets if args.max_sets is not None else 'none'}"
                         " applies to a per-layer plan; add --per-layer or drop --max-sets")
    config, shape, par, device, note, reserve, candidates = _plan_inputs(args)
    try:
        chosen = planner.plan(device, config, shape, par, candidates, reserve=reserve,
                              objective=args.objective, per_layer=args.per_layer,
                              max_sets=args.max_sets)
    except planner.NoFitError as err:
        return _no_fit(err, args.json)
    if args.json:
        _print_plan_json(chosen, note, maxtext_overrides=_maxtext(chosen),
                         per_layer=args.per_layer,
                         max_sets=args.max_sets if args.per_layer else None,
                         paste=dict(zip(("where", "line"), chosen.paste())))
    else:
        if note:
            print(f"note: {note}")
        print(f"{config.name}: seq {shape.seq_len} x micro-batch {shape.micro_batch}, "
              f"tp={chosen.parallelism.tp} fsdp={chosen.parallelism.fsdp} "  # type: ignore[union-attr]
              f"dp={chosen.parallelism.dp} pp={chosen.parallelism.pp} on "  # type: ignore[union-attr]
              f"{describe_device(device)}; objective: {chosen.objective}"
              + (f"; per layer (at most "
                 f"{args.max_sets if args.max_sets is not None else 'any number of'} sets)"
                 if args.per_layer else ""))
        print(chosen.table())
    if args.plot is not None:
        return _plot(chosen, config, shape, args.plot)
    return 0


def _maxtext(chosen: planner.Plan) -> dict[str, str] | None:
    if chosen.config is None or models.host_of(chosen.config.tags) != "maxtext":
        return None
    from .adapters import maxtext  # noqa: PLC0415

    return maxtext.overrides_for(chosen)


def _plot(chosen: planner.Plan, config: models.TransformerConfig, shape: models.StepShape,
          path: str) -> int:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("error: --plot needs matplotlib, which is not installed "
              "(pip install matplotlib); the plan above is complete without it",
              file=sys.stderr)
        return 1
    bud = chosen.budget
    assert bud is not None and chosen.config is not None
    fp = mm.layer_footprint(chosen.config, shape, chosen.parallelism)
    scale = chosen.layers_per_core * chosen.inflight
    bars = {
        "full remat": fp.evaluate(())[0] * scale,
        "plan": chosen.activation_bytes,
        "save every tag": fp.evaluate([t for t in fp if not fp[t].always_kept])[0] * scale,
    }
    gib = float(dev.GiB)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    parts = [("parameters", bud.state.params_bytes, "#4c72b0"),
             ("gradients", bud.state.grads_bytes, "#55a868"),
             ("optimizer", bud.state.optimizer_bytes, "#8172b2"),
             ("reserve", bud.reserve_bytes, "#937860"),
             ("workspace", bud.workspace_bytes, "#da8bc3")]
    names = list(bars)
    bottom = [0.0] * len(names)
    for label, value, color in parts:
        ax.bar(names, [value / gib] * len(names), bottom=bottom, label=label, color=color)
        bottom = [b + value / gib for b in bottom]
    ax.bar(names, [v / gib for v in bars.values()], bottom=bottom, label="kept activations",
           color="#c44e52")
    ax.axhline(bud.hbm_bytes / gib, color="black", linestyle="--",
               label=f"HBM per core ({bud.hbm_bytes / gib:.3g} GiB)")
    ax.set_ylabel("GiB per core")
    ax.set_title(f"{config.name}, seq {shape.seq_len}: memory per core")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------
# audit, presets
# --------------------------------------------------------------------------------------


def _load_factory(spec: str) -> Any:
    """``MODULE:FUNCTION`` -> (fn, args); whatever goes wrong is the user's, in one line."""
    module, sep, attr = spec.partition(":")
    if not sep or not module.strip() or not attr.strip():
        raise UsageError(f"{spec!r} is not MODULE:FUNCTION (e.g. mypkg.layers:make_layer)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001  the user's module, failing as it will
        raise UsageError(f"target {spec!r}: cannot import {module!r} "
                         f"({type(err).__name__}: {err})") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"target {spec!r}: {getattr(obj, '__name__', obj)!s} has no "
                             f"attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"target {spec!r} is a {type(obj).__name__}, not a function "
                         "returning (fn, args)")
    try:
        made = obj()
    except Exception as err:  # noqa: BLE001
        raise UsageError(f"target {spec}() raised {type(err).__name__}: {err}") from err
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise UsageError(f"target {spec}() must return (fn, args); got "
                         f"{type(made).__name__}")
    fn, fargs = made
    if isinstance(fargs, (dict, str, bytes)) or hasattr(fargs, "keys"):
        raise UsageError(f"target {spec}() returned args of type {type(fargs).__name__}; "
                         "give a tuple of the positional arguments")
    try:
        return fn, tuple(fargs)
    except TypeError:
        raise UsageError(f"target {spec}() returned args of type {type(fargs).__name__}; "
                         "give a tuple") from None


def _cmd_audit(args: argparse.Namespace) -> int:
    from . import policies  # noqa: PLC0415 - JAX: only for the commands that trace
    from ._audit import LayerError, audit as run_audit  # noqa: PLC0415
    from ._jaxpr import AmbiguousInputError  # noqa: PLC0415

    if args.policy and (args.save or args.offload):
        raise UsageError("give --policy or --save/--offload, not both")
    for flag, given in (("--offload-dst", args.offload_dst is not None),
                        ("--allow-offload-on-neuron", args.allow_offload_on_neuron)):
        if given and not args.offload:
            raise UsageError(f"{flag} applies to offloaded tags; add --offload PATTERN or "
                             f"drop {flag}")
    if args.policy:
        policy = policies.preset(args.policy)
    else:
        policy = policies.RegexPolicy(args.save or (), args.offload or (),
                                      offload_src="device" if args.offload else None,
                                      offload_dst=(args.offload_dst or "pinned_host")
                                      if args.offload else None,
                                      allow_offload_on_neuron=args.allow_offload_on_neuron)
    fn, fargs = _load_factory(args.target)
    try:
        report = run_audit(fn, *fargs, policy=policy,
                           activation_argnums=args.activation_argnums)
    except LayerError as err:  # the user's function failed to trace (a bug of ours is not)
        raise UsageError(f"auditing {args.target}: {err}") from err
    except AmbiguousInputError as err:
        raise UsageError(f"auditing {args.target}: {err} (from the shell: "
                         "--activation-argnums I)") from err
    if args.json:
        _print_json(report.to_dict())
    else:
        print(report.table())
    return 2 if (args.strict and report.dead_patterns) else 0


def _band(text: str) -> float:
    """fit's --band: a finite share in [0, 1]."""
    try:
        value = float(text) if text.strip().isascii() and len(text) <= 32 else None
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 1:  # NaN and inf fail too
        raise argparse.ArgumentTypeError(
            f"{dev._show(text)} is not a share of full remat's bytes in [0, 1] (0.02)")
    return value


def _cmd_fit(args: argparse.Namespace) -> int:
    from . import planner  # noqa: PLC0415
    from ._fit import fit, fit_preview, fit_table  # noqa: PLC0415 - traces and compiles
    from ._compile import CompileFailedError  # noqa: PLC0415
    from ._step import StepTraceError  # noqa: PLC0415

    options: dict[str, Any] = {}
    if args.resume is not None:  # before anything is printed: a bad file is one line
        options["resume"] = _read_plan(args.resume)
    make_step, fargs = _load_factory(args.target)
    device, note = _device_for_plan(args.device)
    if note:
        print(f"note: {note}", file=sys.stderr)
    reserve: float | int | None = args.reserve
    if args.candidates:
        options["candidates"] = args.candidates
    if args.max_compiles is not None:
        options["max_compiles"] = args.max_compiles
    if args.band is not None:
        options["band"] = args.band
    if args.dry_run:
        print("dry run: compiling full remat only ...", file=sys.stderr, flush=True)
        try:
            preview = fit_preview(make_step, *fargs, device=device, reserve=reserve,
                                  **options)
        except (StepTraceError, CompileFailedError) as err:  # the user's step, not ours
            raise UsageError(f"fit target {args.target!r}: {err}") from err
        if args.json:
            _print_json({**preview.to_dict(), **({"note": note} if note else {})})
        else:
            print(f"{args.target} on {device.describe()}")
            print(preview.table())
        return 0
    options["progress"] = lambda line: print(line, file=sys.stderr, flush=True)
    try:
        chosen = fit(make_step, *fargs, device=device, reserve=reserve, **options)
    except planner.NoFitError as err:
        return _no_fit(err, args.json)
    except (StepTraceError, CompileFailedError) as err:  # the user's step, not ours
        raise UsageError(f"fit target {args.target!r}: {err}") from err
    if args.json:
        _print_plan_json(chosen, note)
    else:
        print(f"{args.target} on {device.describe()}")
        print(fit_table(chosen))
    return 0


def _read_plan(path: str) -> dict[str, Any]:
    """The JSON plan at `path` (``neuron-remat fit --json`` printed it), for ``--resume``."""
    import json  # noqa: PLC0415

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise UsageError(f"--resume {path}: cannot read it ({err.strerror})") from None
    except ValueError as err:
        raise UsageError(f"--resume {path}: not JSON ({err}); give the file neuron-remat "
                         "fit --json printed") from None
    if not isinstance(data, dict) or not isinstance(data.get("compiled"), dict):
        raise UsageError(f"--resume {path}: no fit plan in it (no \"compiled\" object); give "
                         "the file neuron-remat fit --json printed")
    return data


def _cmd_presets(args: argparse.Namespace) -> int:
    from . import policies  # noqa: PLC0415

    rows = [{"name": p.name, "save": list(p.policy.save), "offload": list(p.policy.offload),
             "reason": p.reason} for p in policies.PRESETS.values()]
    if args.json:
        _print_json(rows)
        return 0
    for r in rows:
        print(f"{r['name']}:")
        print(f"  save:   {' | '.join(r['save']) or '(nothing)'}")
        print(f"  reason: {r['reason']}")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    rows = [{"name": m.name, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads,
             "ffn": m.ffn, "layers": m.layers, "vocab": m.vocab,
             "params": m.param_count(), "flash_attention": m.flash_attention,
             "default_seq_len": m.default_seq_len, "source": m.source}
            for m in models.MODELS.values()]
    aliases: dict[str, list[str]] = {}
    for alias, name in models._ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    for r in rows:
        r["aliases"] = aliases.get(r["name"], [])
    if args.json:
        _print_json(rows)
        return 0
    labels = [r["name"] + (f" (also {', '.join(r['aliases'])})" if r["aliases"] else "")
              for r in rows]
    width = max(map(len, labels))
    for label, r in zip(labels, rows):
        print(f"{label:{width}s} {r['params'] / 1e9:7.2f}B params  h={r['hidden']} "
              f"heads={r['heads']}/{r['kv_heads']} ffn={r['ffn']} L={r['layers']}  "
              f"[{r['source']}]")
    return 0


# --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="neuron-remat",
        description="Pick the JAX remat (checkpoint) policy that fits Trainium HBM at the "
                    "least recompute.")
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("detect", help="show the detected device and the evidence")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(run=_cmd_detect)

    pl = sub.add_parser("plan", help="plan the tags to save for a model on a device")
    pl.add_argument("--model", default="fuji-70b",
                    help="built-in model name or a Hugging Face config.json path "
                         "(default fuji-70b; see 'neuron-remat models')")
    pl.add_argument("--text-only", action="store_true",
                    help="plan a multimodal config.json's text decoder (its text_config)")
    pl.add_argument("--device", default="auto",
                    help="instance type or family with options (trn2.48xlarge, "
                         "trn2:lnc=1:hbm=8GiB), 'detected', or 'auto' (detected if Neuron, "
                         "else a simulated trn2.48xlarge; the default)")
    pl.add_argument("--seq-len", type=_count(what="a sequence length"),
                    help="sequence length (default: the model's)")
    pl.add_argument("--micro-batch", type=_count(what="a micro-batch size"), default=1,
                    help="sequences per replica")
    pl.add_argument("--tp", type=_count(what="a degree"), default=4, help="tensor-parallel degree (default 4: "
                    "one TRN2 chip at LNC=2, as axlearn's mesh rules)")
    sp = pl.add_mutually_exclusive_group()
    sp.add_argument("--sequence-parallel", dest="sequence_parallel", action="store_true",
                    default=None, help="split norms and residuals over the sequence across "
                    "the tp group (the default when tp > 1, as axlearn's TRN2 rules do)")
    sp.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    pl.add_argument("--fsdp", type=_count(allow=(-1,), what="a degree"), default=-1,
                    help="FSDP degree; -1 fills the rest")
    pl.add_argument("--dp", type=_count(what="a degree"), default=1)
    pl.add_argument("--pp", type=_count(what="a degree"), default=1)
    pl.add_argument("--ep", type=_count(what="a degree"), default=1,
                    help="expert-parallel degree (MoE models), out of the fsdp x dp cores")
    pl.add_argument("--schedule", choices=["1f1b", "gpipe"],
                    help="pipeline schedule (default 1f1b; needs --pp > 1)")
    pl.add_argument("--microbatches", type=_count(what="a micro-batch count"),
                    help="micro-batches per step of a pipeline (needs --pp > 1)")
    pl.add_argument("--zero1", action="store_true", help="shard optimizer state over dp")
    pl.add_argument("--hosts", type=_count(what="a host count"), default=1,
                    help="instances in the job")
    pl.add_argument("--activation-dtype", default="bfloat16", choices=models._FLOAT_DTYPES)
    pl.add_argument("--param-dtype", default="float32", choices=models._FLOAT_DTYPES)
    pl.add_argument("--optimizer", default="adamw", type=_optimizer,
                    help="adamw, sgd, or optimizer-state bytes per parameter")
    pl.add_argument("--reserve", type=_reserve, help="HBM held back: a fraction (0.1) or a size (2GiB)")
    fa = pl.add_mutually_exclusive_group()
    fa.add_argument("--flash-attention", dest="flash_attention", action="store_true",
                    default=None)
    fa.add_argument("--no-flash-attention", dest="flash_attention", action="store_false")
    pl.add_argument("--tags", choices=["axlearn", "maxtext"], default="axlearn",
                    help="tag vocabulary of the host library")
    pl.add_argument("--candidates", type=_candidates, help="comma-separated tags or roles to consider")
    pl.add_argument("--objective", choices=_OBJECTIVES,
                    help="what the plan minimises: recompute time (roofline over the "
                         "device's engine rates; the default on TRN2, whose rates are known) "
                         "or FLOPs (the default elsewhere)")
    pl.add_argument("--per-layer", action="store_true",
                    help="also plan the optimal mix of save sets over the layers")
    pl.add_argument("--max-sets", type=_max_sets, default=2, metavar="N",
                    help="with --per-layer: at most N distinct save sets in the mix "
                         "(default 2: a scanned stack runs as two scans), or 'none' for "
                         "no bound")
    pl.add_argument("--plot", metavar="PNG", help="draw the per-core memory stack")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.set_defaults(run=_cmd_plan)

    a = sub.add_parser("audit", help="show what a policy keeps for your function")
    a.add_argument("target", help="MODULE:FUNCTION, a zero-argument factory returning "
                                  "(fn, args)")
    a.add_argument("--policy", metavar="PRESET",
                   help="a preset (`neuron-remat presets` lists them)")
    a.add_argument("--save", nargs="+", metavar="PATTERN", help="save patterns")
    a.add_argument("--offload", nargs="+", metavar="PATTERN", help="offload patterns")
    a.add_argument("--offload-dst", choices=["pinned_host", "unpinned_host"],
                   help="memory kind for offloaded tags (default pinned_host; needs "
                        "--offload)")
    a.add_argument("--allow-offload-on-neuron", action="store_true",
                   help="offload even on a Neuron device (not documented by its compiler)")
    a.add_argument("--activation-argnums", nargs="+", metavar="I",
                   type=_count(0, what="an argument position"),
                   help="the positions of the layer input among the target's args (when "
                        "several match the output)")
    a.add_argument("--strict", action="store_true", help="exit 2 on dead patterns")
    a.add_argument("--json", action="store_true", help="print JSON")
    a.set_defaults(run=_cmd_audit)

    ft = sub.add_parser("fit", help="plan against the compiled training step")
    ft.add_argument("target", help="MODULE:FUNCTION, a zero-argument factory returning "
                                   "(make_step, args): make_step(policy) builds the step")
    ft.add_argument("--device", default="auto",
                    help="as for 'plan' (default auto: detected if Neuron, else a simulated "
                         "trn2.48xlarge)")
    ft.add_argument("--reserve", type=_reserve,
                    help="HBM held back: a fraction (0.1) or a size (2GiB); default: the "
                         "Neuron runtime's share only")
    ft.add_argument("--candidates", type=_candidates, help="comma-separated tags to consider")
    ft.add_argument("--max-compiles", type=_count(3, what="a compile budget"),
                    help="compile budget, a hard cap (at least 3; by default 6 up to 8 "
                         "tags, and with the compile as the oracle 2 + ceil(log2(frontier - "
                         "1)), one more per tag where full remat is close to the limit)")
    ft.add_argument("--band", type=_band,
                    help="a prediction's uncertainty before any compile has missed, as a "
                         "share of full remat's bytes (default 0.02)")
    ft.add_argument("--resume", metavar="PLAN_JSON",
                    help="the file an earlier 'fit --json' of this target at this device and "
                         "reserve printed: its compiles are read back, not compiled again "
                         "(they count against --max-compiles)")
    ft.add_argument("--dry-run", action="store_true",
                    help="compile full remat only; list the save sets fit would choose "
                         "among, with their predicted bytes")
    ft.add_argument("--json", action="store_true", help="print JSON")
    ft.set_defaults(run=_cmd_fit)

    pr = sub.add_parser("presets", help="list the named policies")
    pr.add_argument("--json", action="store_true", help="print JSON")
    pr.set_defaults(run=_cmd_presets)

    mo = sub.add_parser("models", help="list the built-in model descriptions")
    mo.add_argument("--json", action="store_true", help="print JSON")
    mo.set_defaults(run=_cmd_models)
    return p


# What bad input raises; anything else escaping a command is a bug in neuron_remat.
_INPUT_ERRORS = (ValueError, TypeError, OSError, ImportError, re.error)


def _fail(message: str, as_json: bool) -> None:
    line = " ".join(str(message).split())  # one line, whatever the message held
    if as_json:
        _print_json({"error": line})
    else:
        print(f"error: {line}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI. Exit codes: 0 done, 1 no plan fits (plan) or dead patterns (audit
    --strict: 2), 2 bad input (one line, never a traceback), 3 an internal error (a bug;
    ``-v`` prints its traceback), 130 interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # "--reserve -3GiB": argparse would read the value as an option and say only "expected
    # one argument"; joined, the reserve's own check names the value
    argv = [f"{a}={argv[i + 1]}" if a == "--reserve" and i + 1 < len(argv)
            and argv[i + 1].startswith("-") and not argv[i + 1].startswith("--") else a
            for i, a in enumerate(argv)
            if not (i > 0 and argv[i - 1] == "--reserve" and a.startswith("-")
                    and not a.startswith("--"))]
    # --json or an abbreviation argparse takes for it (no other option starts with --j),
    # so that an error found while parsing is JSON too
    as_json = any(len(a) > 3 and "--json".startswith(a) for a in argv)
    verbose = "-v" in argv or "--verbose" in argv
    try:
        args = _parser().parse_args(argv)
    except UsageError as err:
        _fail(str(err), as_json)
        return EXIT_BAD_INPUT
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    as_json = bool(getattr(args, "json", as_json))  # as argparse read it (--js too)
    _JSON_PENDING[0] = [] if as_json else None
    try:
        with _stdout_to_stderr() if as_json else contextlib.nullcontext():
            return int(args.run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except _INPUT_ERRORS as err:
        if verbose:
            traceback.print_exc()
        if isinstance(err, re.error):
            shown = f"invalid regular expression {err.pattern!r}: {err.msg}"
        elif isinstance(err, ValueError):
            shown = str(err)
        else:
            shown = f"{type(err).__name__}: {err}"
        _fail(shown or type(err).__name__, as_json)
        return EXIT_BAD_INPUT
    except Exception as err:  # noqa: BLE001  a bug: say so in one line, never hide it
        if verbose:
            traceback.print_exc()
        _fail(f"internal error in neuron_remat ({type(err).__name__}: {err}); this is a "
              "bug, please report it with the output of the same command run with -v",
              as_json)
        return EXIT_INTERNAL
    finally:
        pending, _JSON_PENDING[0] = _JSON_PENDING[0], None
        for text in pending or ():
            print(text)
