"""One compile of a training step: what the backend says about one save set.

`_compile` lowers and AOT-compiles a step (``jit(step).lower(*args).compile()``) and reads
``memory_analysis()`` (argument + output + temp - alias) and ``cost_analysis()``. A
backend without memory figures (it raises, returns None, or reports nothing) gives
``bytes=None``; a compile that fails for want of device memory (`out_of_memory`: XLA's
``RESOURCE_EXHAUSTED``, neuronx-cc's NCC_EOOM001/NCC_EOOM002) gives ``oom=True`` and the
largest byte figure its message names. `Probe` is a compile as `fit` reports it; `_policy`
is the JAX policy of a save set, what is compiled and what a plan carries.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from ._format import first_line
from ._jaxpr import _aval_bytes
from .policies import RegexPolicy


@dataclass(frozen=True)
class Probe:
    """One compile of the training step (`fit`): what XLA allocated and computed.

    `bytes` is ``argument + output + temp - alias`` from ``memory_analysis()`` (-1 when the
    backend reports none: then the compile is the oracle, `out_of_memory` its answer);
    `saved` is None for no remat. `predicted_bytes` is what the fitted model said before
    this compile (None for the probes it was fitted on). `fixed_bytes` (arguments + outputs
    - donated, from the lowering) and `transcendentals` (``cost_analysis()``'s count) are
    what a later `fit` resuming this one reads back; `reused` marks a probe taken from
    such an earlier fit (``fit(resume=...)``): nothing was compiled for it, `seconds` 0."""

    label: str
    saved: tuple[str, ...] | None
    bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    flops: float
    seconds: float
    predicted_bytes: int | None = None
    out_of_memory: bool = False  # the compile failed for want of device memory
    reported_bytes: int | None = None  # the byte figure that failure gave, if any
    fixed_bytes: int | None = None
    transcendentals: float = 0.0
    reused: bool = False


def probe_of(label: str, saved: tuple[str, ...] | None, r: _Compiled,
             predicted: int | None = None, reused: bool = False) -> Probe:
    """Compile `r` of save set `saved` as `fit` reports it (`reused`: read back from an
    earlier fit, 0 seconds)."""
    return Probe(label, saved, r.bytes if r.bytes is not None else -1, r.argument, r.output,
                 r.temp, r.alias, r.flops, 0.0 if reused else r.seconds, predicted,
                 out_of_memory=r.oom, reported_bytes=r.reported, fixed_bytes=r.fixed,
                 transcendentals=r.transcendentals, reused=reused)


class CompileFailedError(ValueError):
    """A compile of the user's step failed, for a reason other than device memory: the
    step's error, not neuron_remat's (the cause is chained)."""


def compile_named(build: Callable[[], Any], args: Sequence[Any], what: str) -> _Compiled:
    """`_compile` of ``build()`` (the step for one policy); any failure but running out
    of memory is a `CompileFailedError` naming `what` (the compile's number and set)."""
    try:
        return _compile(build(), args)
    except Exception as err:  # noqa: BLE001  the user's step, failing as it will
        raise CompileFailedError(f"{what} failed with {type(err).__name__}: "
                                 f"{first_line(err)}") from err


def _jitted(step: Any) -> Any:
    return step if hasattr(step, "lower") else jax.jit(step)


@dataclass(frozen=True)
class _Compiled:
    """One compile. `bytes` is None when the backend cannot report memory (then the
    compile itself is the oracle: `oom` says whether it ran out)."""

    bytes: int | None
    argument: int
    output: int
    temp: int
    alias: int
    flops: float
    seconds: float
    oom: bool = False
    reported: int | None = None  # the largest byte figure an out-of-memory error gave
    fixed: int | None = None  # arguments + outputs - donated (from the lowering)
    transcendentals: float = 0.0  # cost_analysis()'s count, apart from its flops

    def over(self, limit: int) -> bool:
        return self.oom or (self.bytes is not None and self.bytes > limit)


OOM_SIGNALS = ("RESOURCE_EXHAUSTED", "NCC_EOOM001", "NCC_EOOM002",
               "exceeds the high-bandwidth memory")
"""What a compile failure says when the program does not fit the device: XLA's status
code, and neuronx-cc's out-of-memory errors."""

_UNITS = {"b": 1, "bytes": 1, "byte": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def out_of_memory(err: BaseException) -> tuple[bool, int | None]:
    """Whether a compile error says the program does not fit device memory, and the
    largest byte figure the message gives (None when it gives none)."""
    import re  # noqa: PLC0415

    text = f"{type(err).__name__}: {err}"
    if not any(s.lower() in text.lower() for s in OOM_SIGNALS):
        return False, None
    figures = [float(n.replace(",", "")) * _UNITS[u.lower()] for n, u in re.findall(
        r"(\d[\d,]*(?:\.\d+)?)\s*(bytes|byte|[KMGT]i?B|B)\b", text, flags=re.I)]
    return True, (int(max(figures)) if figures else None)


def _fixed_bytes(lowered: Any, args: Sequence[Any], compiled: Any = None) -> int | None:
    """Arguments + outputs - donated arguments: what the step holds whatever the policy,
    donated state counted once; per core where the arguments are sharded (the compiled
    program's input shardings, else the arguments' own; the outputs beyond the donated
    state, a loss and metrics, count whole)."""
    try:
        infos = jax.tree.leaves(lowered.args_info)
        outs = jax.tree.leaves(lowered.out_info)
        sizes = [_aval_bytes(i._aval) for i in infos]  # noqa: SLF001
        donated = sum(b for b, i in zip(sizes, infos) if i.donated)
        out = sum(_aval_bytes(o) for o in outs)
    except Exception:  # noqa: BLE001 - a wrapper without the lowering's metadata
        return None
    extra = out - min(donated, out)
    shardings = _input_shardings(compiled, args, len(infos))
    if shardings is not None:
        sizes = [_piece(b, s, i._aval) for b, s, i in zip(sizes, shardings, infos)]  # noqa: SLF001
    return sum(sizes) + extra


def _input_shardings(compiled: Any, args: Sequence[Any], n: int) -> list[Any] | None:
    """One sharding (or None) per argument leaf: the compiled program's, else the
    arguments' own; None when neither lines up with the `n` leaves."""
    try:
        found = jax.tree.leaves(compiled.input_shardings)
        if len(found) == n:
            return found
    except Exception:  # noqa: BLE001 - not compiled, or a wrapper without them
        pass
    leaves = jax.tree.leaves(args)
    return [getattr(a, "sharding", None) for a in leaves] if len(leaves) == n else None


def _piece(nbytes: int, sharding: Any, aval: Any) -> int:
    """What one core holds of an argument of `nbytes` laid out by `sharding`."""
    n = pieces(sharding, tuple(aval.shape))
    return nbytes if n is None else -(-nbytes // n)


def pieces(sharding: Any, shape: tuple[int, ...]) -> int | None:
    """Into how many pieces `sharding` splits a value of `shape` (1: replicated); None for
    no sharding, one that cannot say (unspecified, a pytree prefix), or an empty value."""
    try:
        piece = math.prod(sharding.shard_shape(shape))
    except Exception:  # noqa: BLE001 - no sharding, or not one of JAX's
        return None
    whole = math.prod(shape)
    return whole // piece if whole and piece else None


def _figures(mem: Any, fields: Sequence[str]) -> tuple[int, ...] | None:
    """`fields` of a ``memory_analysis()`` result as ints; None when it has none, or one of
    them is missing, None, not a number, not finite or negative (a backend's way of
    reporting nothing)."""
    if mem is None:
        return None
    out = []
    for f in fields:
        v = getattr(mem, f, None)
        try:
            v = float(v)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        if not math.isfinite(v) or v < 0:
            return None
        out.append(int(v))
    return tuple(out)


def _unwrapped(compiled: Any) -> Any:
    """JAX's compiled executable inside a wrapper's: ``eqx.filter_jit(f).lower(...)
    .compile()`` is Equinox's `Compiled`, holding JAX's in `.compiled` (without
    ``memory_analysis()`` of its own, it read as a backend with no figures)."""
    for _ in range(3):
        if hasattr(compiled, "memory_analysis") or not hasattr(compiled, "compiled"):
            break
        compiled = compiled.compiled
    return compiled


def _compile(step: Any, args: Sequence[Any]) -> _Compiled:
    start = time.perf_counter()
    lowered = _jitted(step).lower(*args)
    try:
        compiled = lowered.compile()
    except Exception as err:
        oom, figure = out_of_memory(err)
        if not oom:
            raise
        return _Compiled(None, 0, 0, 0, 0, float("nan"), time.perf_counter() - start,
                         oom=True, reported=figure, fixed=_fixed_bytes(lowered, args))
    seconds = time.perf_counter() - start
    compiled = _unwrapped(compiled)
    fixed = _fixed_bytes(lowered, args, compiled)
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes")
    try:
        mem = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - any backend's way of saying "not here"
        mem = None
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float(cost.get("flops", float("nan"))) if cost else float("nan")
        trans = float(cost.get("transcendentals", 0.0)) if cost else 0.0
    except Exception:  # noqa: BLE001
        flops, trans = float("nan"), 0.0
    figures = _figures(mem, fields)
    if figures is None or sum(figures[:3]) <= 0:  # no figures, or none worth the name
        return _Compiled(None, 0, 0, 0, 0, flops, seconds, fixed=fixed, transcendentals=trans)
    arg, out, temp, alias = figures
    return _Compiled(arg + out + temp - alias, arg, out, temp, alias, flops, seconds,
                     fixed=fixed, transcendentals=trans)


def _policy(saved: tuple[str, ...] | None) -> Any:
    """The JAX policy of a save set: what `fit` compiles and what the plan carries."""
    import re  # noqa: PLC0415

    if saved is None:
        return jax.checkpoint_policies.everything_saveable
    return RegexPolicy([re.escape(t) for t in saved])
