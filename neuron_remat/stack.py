"""Run a scanned layer stack with one remat policy per layer.

A per-layer plan (`plan(..., per_layer=True)`, `Plan.layer_policies`) gives each layer its
own policy, but ``lax.scan`` applies one body, and so one ``jax.checkpoint`` policy, to
every layer it scans. `scan_layers` splits the stack into consecutive scans, one per run of
layers with equal policies, so each run keeps what its own policy says. On XLA:CPU the
compiled step's memory then moves by about one layer's difference per layer switched; an
unrolled Python loop of checkpointed layers does not show this (its scheduler keeps a
similar working set whatever the policy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["NO_REMAT", "policy_runs", "scan_layers"]

NO_REMAT = "none"
"""A `scan_layers` policy entry meaning no ``jax.checkpoint`` at all for that layer (as
`reference.stack`'s ``policy="none"``)."""


def policy_runs(policies: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """``(start, stop, policy)`` for each run of consecutive equal policies."""
    runs: list[tuple[int, int, Any]] = []
    for i, p in enumerate(policies):
        if runs and runs[-1][2] == p:
            runs[-1] = (runs[-1][0], i + 1, p)
        else:
            runs.append((i, i + 1, p))
    return runs


def _layer_count(jax: Any, stacked_params: Any) -> int:
    """The stacked layers: every leaf's leading axis, which must agree."""
    counts = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(stacked_params)[0]:
        shape = getattr(leaf, "shape", None)
        name = f"stacked_params{jax.tree_util.keystr(path)}"
        if shape is None or len(shape) == 0:
            what = "no shape" if shape is None else "shape ()"
            raise ValueError(f"scan_layers: {name} is a {type(leaf).__name__} with {what}; "
                             "every leaf needs a leading layer axis (the layers' parameters "
                             "stacked)")
        counts.append((int(shape[0]), name, tuple(shape)))
    n, first, first_shape = counts[0]
    for m, name, shape in counts[1:]:
        if m != n:
            raise ValueError(f"scan_layers: {name} has shape {shape} but {first} has "
                             f"{first_shape}; every leaf needs the same leading layer axis")
    return n


def scan_layers(layer_fn: Callable[[Any, Any], Any], stacked_params: Any, x: Any,
                policies: Sequence[Any] | Any, *, prevent_cse: bool = False,
                unroll: int | bool = 1) -> Any:
    """``x`` through the layers stacked on the leading axis of `stacked_params`, layer i
    under ``jax.checkpoint(layer_fn, policy=policies[i])``: one ``lax.scan`` per run of equal
    policies, in layer order.

    `layer_fn(x, layer_params)` returns the next ``x``. `policies` has one JAX policy per
    layer (a `Plan.layer_policies`), or is a single policy for every layer (one scan).
    `NO_REMAT` (``"none"``) runs a layer without ``jax.checkpoint``. `unroll` is passed
    to each scan (``unroll=True`` lets XLA's cost analysis count every layer's FLOPs; it
    counts a rolled scan's body once)."""
    import jax  # noqa: PLC0415

    leaves = jax.tree_util.tree_leaves(stacked_params)
    if not leaves:
        raise ValueError("stacked_params has no arrays: give the layers' parameters stacked "
                         "on a leading axis")
    n = _layer_count(jax, stacked_params)
    listed = isinstance(policies, (list, tuple)) or (
        hasattr(policies, "shape") and hasattr(policies, "tolist"))  # a numpy object array
    if listed:
        per = list(policies)
        if len(per) != n:
            raise ValueError(f"policies has {len(per)} entries for {n} stacked layers; "
                             "give one policy per layer, or a single policy")
    else:
        per = [policies] * n
    for i, p in enumerate(per):
        if not (p is None or callable(p) or (isinstance(p, str) and p == NO_REMAT)):
            where = f"policies[{i}]" if listed else "policies"
            raise ValueError(f"scan_layers: {where}={p!r} ({type(p).__name__}) is not a remat "
                             f"policy; give a JAX policy (a callable, e.g. a Plan's), None "
                             f"(full remat) or {NO_REMAT!r} (no jax.checkpoint)")

    runs = policy_runs(per)
    sizes = tuple(stop - start for start, stop, _ in runs)
    split = getattr(jax.lax, "split", None)
    if len(runs) == 1:
        pieces = [stacked_params]
    elif split is not None:
        # One split per array: its transpose concatenates the runs' gradients. Slicing
        # would pad each run's gradient to the whole stack and add them (a stack-sized
        # buffer and add per extra run).
        parts = [split(a, sizes, axis=0) for a in leaves]
        treedef = jax.tree_util.tree_structure(stacked_params)
        pieces = [jax.tree_util.tree_unflatten(treedef, [p[i] for p in parts])
                  for i in range(len(runs))]
    else:  # an older JAX without lax.split
        pieces = [jax.tree_util.tree_map(lambda a, s=start, e=stop: a[s:e], stacked_params)
                  for start, stop, _ in runs]
    for (_, _, policy), run in zip(runs, pieces):
        body_fn = layer_fn if isinstance(policy, str) and policy == NO_REMAT else \
            jax.checkpoint(layer_fn, policy=policy, prevent_cse=prevent_cse)

        def body(carry: Any, p: Any, body_fn: Any = body_fn) -> tuple[Any, None]:
            return body_fn(carry, p), None

        x, _ = jax.lax.scan(body, x, run, unroll=unroll)
    return x
