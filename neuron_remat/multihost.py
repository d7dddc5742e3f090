"""Every process of a multi-host job must resolve the same remat policy.

SPMD runs one program on every process; a host whose policy differs (a different
``NEURON_RT_VISIBLE_CORES``, a provider that failed there and fell back to the default)
compiles a different program, and the job then hangs in a collective or computes garbage.
So when JAX runs more than one process, each resolution is checked: every process
publishes a fingerprint of what it resolved through the key-value store of JAX's
distributed runtime (the one ``jax.distributed.initialize()`` starts; it needs no
devices and no collectives, so it works on CPU hosts too), reads the others' under a
timeout, and raises `PolicyMismatchError` naming the processes that differ.

This is a correctness error: it is raised whether or not ``NEURON_REMAT_STRICT`` is set.
A disagreement is reported as soon as every process has published: a different policy at
once, a different question (another layer, or the same layer with another shape, so the
other process never publishes the key this one waits for) once both have waited on each
other for `STABLE_S` (read from each process's log of what it published). Only a process
that publishes nothing within ``NEURON_REMAT_AGREEMENT_TIMEOUT`` seconds (default 300) is
reported as silent, an error rather than a hang.

In a single process, or before ``jax.distributed.initialize()``, nothing is exchanged
and no JAX backend is started.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from ._format import first_line

__all__ = [
    "AGREEMENT_TIMEOUT_ENV",
    "PolicyMismatchError",
    "agree",
    "describe_policy",
    "fingerprint",
]

logger = logging.getLogger(__name__)

AGREEMENT_TIMEOUT_ENV = "NEURON_REMAT_AGREEMENT_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
_KEY_PREFIX = "neuron_remat/remat_policy"
# The environment a process's answer depends on, shown (not compared) when processes differ.
_SHOWN_ENV = ("NEURON_REMAT_DEVICE", "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VISIBLE_CORES",
              "NEURON_RT_NUM_CORES", "NEURON_REMAT_DISABLE", "NEURON_REMAT_STRICT")


class PolicyMismatchError(RuntimeError):
    """Processes of one multi-host job resolved different remat policies (or one of them
    never resolved it)."""


# --------------------------------------------------------------------------------------
# Fingerprints: the same on every process for the same policy (no addresses, no
# hash-randomised set order).
# --------------------------------------------------------------------------------------

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")


def _stable(value: Any, depth: int = 0) -> str:
    """A description of `value` that two processes agree on when the values are equal."""
    if depth > 8:
        return "..."
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_stable(v, depth + 1) for v in value)) + "}"
    if isinstance(value, Mapping):
        items = sorted((_stable(k, depth + 1), _stable(v, depth + 1)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_stable(v, depth + 1) for v in value) + ")"
    if isinstance(value, (str, int, float, bool, type(None), bytes)):
        return repr(value)
    canonical = getattr(value, "canonical", None)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and callable(canonical):
        # An order-free form (RegexPolicy: policies equal as sets of patterns).
        return f"{type(value).__qualname__}{_stable(canonical(), depth + 1)}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={_stable(getattr(value, f.name), depth + 1)}"
                           for f in dataclasses.fields(value) if f.compare)
        return f"{type(value).__qualname__}({fields})"
    if isinstance(value, functools.partial):
        return (f"partial({_stable(value.func, depth + 1)}, {_stable(value.args, depth + 1)}, "
                f"{_stable(value.keywords, depth + 1)})")
    resolve = getattr(value, "resolve", None)
    if callable(resolve) and type(value).__name__ == "DeferredPolicy":
        return _stable(resolve().policy, depth + 1)
    qualname = getattr(value, "__qualname__", None)
    if qualname is not None and callable(value):
        # A function: its name, and what its closure holds (JAX's policy factories, e.g.
        # save_only_these_names, return closures over the names).
        cells = getattr(value, "__closure__", None) or ()
        held = []
        for cell in cells:
            try:
                held.append(_stable(cell.cell_contents, depth + 1))
            except ValueError:  # an empty cell
                held.append("<empty>")
        inner = f"[{', '.join(held)}]" if held else ""
        return f"{getattr(value, '__module__', '?')}.{qualname}{inner}"
    try:
        shown = repr(value)
    except Exception:  # noqa: BLE001  a broken __repr__ must not break resolution
        shown = "<unrepresentable>"
    return _ADDRESS.sub("", f"{type(value).__qualname__}:{shown}")


def describe_policy(policy: Any, prevent_cse: bool | None = None) -> str:
    """A readable, process-independent description of a remat policy."""
    text = "no policy (jax.checkpoint's default: save nothing)" if policy is None else \
        _stable(policy)
    return text if prevent_cse is None else f"{text}, prevent_cse={bool(prevent_cse)}"


def _sha(text: str, n: int) -> str:
    import hashlib  # noqa: PLC0415  (OpenSSL: only for multi-process jobs)

    return hashlib.sha256(text.encode()).hexdigest()[:n]


def fingerprint(policy: Any, prevent_cse: bool | None = None) -> str:
    """A short hash of `describe_policy`: equal on every process for the same policy."""
    return _sha(describe_policy(policy, prevent_cse), 16)


# --------------------------------------------------------------------------------------
# The exchange.
# --------------------------------------------------------------------------------------


def _distributed() -> tuple[int, int, Any] | None:
    """(process id, process count, key-value client) when this process is one of several
    started by ``jax.distributed.initialize()``; None otherwise. Starts no backend."""
    if "jax" not in sys.modules:
        return None
    from ._jax_compat import distributed_state  # noqa: PLC0415  imports JAX, loaded above

    state = distributed_state()
    if state is None:
        return None
    count = getattr(state, "num_processes", 1) or 1
    client = getattr(state, "client", None)
    if count <= 1 or client is None:
        return None
    return int(state.process_id), int(count), client


def _timeout_s() -> float:
    raw = os.environ.get(AGREEMENT_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw) if raw.isascii() and len(raw) <= 32 else math.nan
    except ValueError:
        value = math.nan
    if not 0 < value <= 86400:
        raise ValueError(f"{AGREEMENT_TIMEOUT_ENV}={raw!r} is not a timeout; valid: seconds "
                         "above 0 and at most 86400")
    return value


_LOCK = threading.Lock()
_AGREED: set[tuple[str, str]] = set()  # (context key, fingerprint) checked with every process
_ROUNDS: dict[str, int] = {}  # exchanges per context key so far
_CONTEXT_LOCKS: dict[str, threading.Lock] = {}
_PUBLISHED: set[str] = set()  # the exchange keys this process has published
_SEQUENCE = [0]  # this process's publications so far (its log's next index)
_POLL_S = 0.1
STABLE_S = 1.0
"""How long two processes must each wait, still, on an exchange the other never published
before that is reported as a mismatch (a thread of either may yet publish it)."""


def agree(policy: Any, prevent_cse: bool | None, *, what: str,
          context: Mapping[str, Any] | None = None,
          timeout_s: float | None = None) -> None:
    """Check that every process of this multi-host job resolved the same `policy` for the
    same `context`; raise `PolicyMismatchError` naming the processes that differ.

    A no-op in a single process. Each (context, policy) pair is exchanged once per
    process; later calls are a set lookup.

    Each process publishes its answer under a key made from `what` and `context`, and
    logs the key. A process whose policy differs is reported as soon as its answer is read.
    A process that was asked something else (another layer, or the same layer in another
    context: e.g. another shape) never publishes the key this one waits for; that is seen
    in its log, and reported as a mismatch naming both questions once both processes have
    waited on each other for `STABLE_S` (about a second). Only a process that publishes
    nothing new within the timeout is reported as silent.

    Args:
        policy, prevent_cse: what this process resolved.
        what: the layer or call site, for the error message.
        context: what the resolution was asked (the same on every process of an SPMD
            program); it keys the exchange.
        timeout_s: how long to wait for the others (default: the
            ``NEURON_REMAT_AGREEMENT_TIMEOUT`` variable, else 300 s).
    """
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(
            timeout_s, (int, float)) or not 0 < timeout_s <= 86400):  # NaN fails too
        raise ValueError(f"agree: timeout_s={timeout_s!r:.40} is not a timeout; valid: "
                         "seconds above 0 and at most 86400")
    dist = _distributed()
    if dist is None:
        return
    me, count, client = dist
    asked = _stable(dict(context or {}))
    ctx = _sha(f"{what}|{asked}", 24)
    fp = fingerprint(policy, prevent_cse)
    with _LOCK:
        if (ctx, fp) in _AGREED:
            return
        ctx_lock = _CONTEXT_LOCKS.setdefault(ctx, threading.Lock())
    with ctx_lock:  # one exchange per context at a time; other contexts go on
        with _LOCK:
            if (ctx, fp) in _AGREED:
                return
            round_ = _ROUNDS.get(ctx, 0)
            _ROUNDS[ctx] = round_ + 1
        wait = _timeout_s() if timeout_s is None else timeout_s
        described = describe_policy(policy, prevent_cse)
        env = " ".join(f"{k}={os.environ[k]}" for k in _SHOWN_ENV if k in os.environ)
        mine = f"{fp}\n{_one_line(described)[:1500]}\n{_one_line(env)[:500]}"
        base = f"{_KEY_PREFIX}/{ctx}/{round_}"
        entry = json.dumps({"key": base, "site": what[:300], "context": asked[:1000]})
        try:
            client.key_value_set(f"{base}/{me}", mine)
            with _LOCK:
                _PUBLISHED.add(base)
                seq = _SEQUENCE[0]
                _SEQUENCE[0] += 1
            client.key_value_set(f"{_KEY_PREFIX}/log/{me}/{seq:08d}", entry)
        except Exception as err:  # noqa: BLE001  the distributed runtime is gone
            raise PolicyMismatchError(
                f"neuron_remat: process {me} could not publish its remat policy for {what} "
                f"to JAX's distributed runtime ({type(err).__name__}: "
                f"{first_line(err)})") from None
        answers = {me: mine}
        deadline = time.monotonic() + wait
        for other in range(count):
            if other != me:
                answers[other] = _read(client, f"{base}/{other}", other, count, me, what,
                                       asked, wait, deadline)
        _compare(answers, what, me)
        with _LOCK:
            _AGREED.add((ctx, fp))


def _read(client: Any, key: str, other: int, count: int, me: int, what: str, asked: str,
          wait: float, deadline: float) -> str:
    """Process `other`'s answer under `key`: waits in short slices, and between them reads
    `other`'s log to tell a process asked something else from a silent one."""
    seen: tuple[Any, ...] | None = None
    since = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            return client.blocking_key_value_get(key, max(1, int(min(left, _POLL_S) * 1000)))
        except Exception as err:  # noqa: BLE001  not there yet (or the runtime failed)
            last = err
        now = time.monotonic()
        if now >= deadline:
            raise PolicyMismatchError(
                f"neuron_remat: process {other} of {count} did not publish its remat "
                f"policy for {what} within {wait:g} s (this is process {me}), nor was it "
                "seen resolving anything else; every process must resolve the same layers "
                f"in an SPMD program. Raise {AGREEMENT_TIMEOUT_ENV} if it is only slow. "
                f"({type(last).__name__}: {first_line(last)})") from None
        elsewhere = _elsewhere(client, other)
        if elsewhere != seen:
            seen, since = elsewhere, now
        elif elsewhere and now - since >= STABLE_S:
            raise PolicyMismatchError(_asked_otherwise(other, me, what, asked, elsewhere))


def _elsewhere(client: Any, other: int) -> tuple[tuple[str, str, str], ...]:
    """The exchanges process `other` has published and this process has not: what it
    waits for in vain unless this process is yet to ask the same."""
    try:
        listed = client.key_value_dir_get(f"{_KEY_PREFIX}/log/{other}/")
    except Exception:  # noqa: BLE001  an older runtime without directories: wait it out
        return ()
    with _LOCK:
        published = set(_PUBLISHED)
    out = []
    for _key, value in sorted(listed):
        try:
            entry = json.loads(value)
        except (TypeError, ValueError):
            continue
        if isinstance(entry, dict) and entry.get("key") not in published:
            out.append((str(entry.get("key")), str(entry.get("site")),
                        str(entry.get("context"))))
    return tuple(out)


def _asked_otherwise(other: int, me: int, what: str, asked: str,
                     elsewhere: tuple[tuple[str, str, str], ...]) -> str:
    _key, site, context = elsewhere[-1]
    if site == what:
        diff = f"the same {what} with another context: {_one_line(context)[:600]} (process " \
               f"{other}) against {_one_line(asked)[:600]} (process {me})"
    else:
        diff = f"{_one_line(site)[:200]} (process {other}) where process {me} resolved {what}"
    return (f"neuron_remat: the processes of this job asked for different remat policies, so "
            f"they would compile different programs: {diff}. Every process must resolve the "
            "same layers with the same model, shape and parallelism in an SPMD program.")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _compare(answers: Mapping[int, str], what: str, me: int) -> None:
    groups: dict[str, list[int]] = {}
    shown: dict[str, tuple[str, str]] = {}
    envs: dict[int, str] = {}
    for proc in sorted(answers):
        fp, _, rest = answers[proc].partition("\n")
        described, _, env = rest.partition("\n")
        groups.setdefault(fp, []).append(proc)
        shown.setdefault(fp, (described, env))
        envs[proc] = env
    if len(groups) == 1:
        return
    parts = []
    for fp, procs in sorted(groups.items(), key=lambda item: item[1]):
        described, _ = shown[fp]
        names = _ranges(procs)
        env_by = sorted({envs[p] for p in procs})
        env_text = "; ".join(e or "no NEURON_* variables" for e in env_by)
        parts.append(f"process{'es' if len(procs) > 1 else ''} {names}: {described} "
                     f"[{env_text}]")
    raise PolicyMismatchError(
        f"neuron_remat: the processes of this job resolved different remat policies for "
        f"{what}, so they would compile different programs: {' | '.join(parts)}. Give every "
        f"process the same device, NEURON_* environment, model and shape (seen from "
        f"process {me}).")


def _ranges(procs: list[int]) -> str:
    out, start = [], procs[0]
    for a, b in zip(procs, procs[1:] + [None]):
        if b is None or b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)
