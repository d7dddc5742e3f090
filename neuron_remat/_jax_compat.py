"""Every JAX name outside JAX's public API that neuron_remat relies on, in one place.

Tested with JAX 0.7.2, 0.8.3, 0.10.2 and 0.12.0.1 (CI runs the trace, policy and plugin tests
on each, and under ``JAX_REMAT3=true``), and 0.11.1 (MaxText's real step,
``tests/cpu/test_maxtext_real.py``). Each name below says why no public one serves, and what happens
on a JAX without it. Public names are used wherever JAX has one:
``jax.checkpoint_policies.save_only_these_names`` (not ``jax._src.ad_checkpoint``),
``jax.extend.core`` for jaxpr types, ``jax.dtypes`` for dtype tests.

Private names:

* ``jax._src.ad_checkpoint.name_p``: the primitive ``checkpoint_name`` binds. Needed to
  recognise a tag in a jaxpr and to ask a policy about a tag (``policy(name_p, name=t)``).
  Present in every tested version.
* ``jax._src.ad_checkpoint.CheckpointName``: the tag under JAX's new remat
  (``jax_remat3``, JAX >= 0.10); None before.
* ``jax._src.ad_checkpoint.RematTraced``: a ``jax.checkpoint`` call under ``jax_remat3``
  (in the ``_prim`` parameter of its equation; ``remat2`` is the original's); None before.
* ``jax._src.ad_checkpoint.saved_residuals``: JAX's own residual listing, which tests use as
  ground truth (the package reads residuals from the traced VJP's structure instead).
* ``jax._src.ad_checkpoint.SaveOnlyTheseNames``, ``SaveAnyNamesButThese``,
  ``DotsSaveable``: the policy classes of JAX >= 0.9 (policies are plain functions before);
  None where absent.
* ``jax._src.ad_checkpoint.CheckpointName.remat``: its signature says whether this JAX's
  remat3 asks any callable policy (``remat3_rule_params``); empty where absent.
* ``jax._src.config.remat3``: the context manager behind ``jax_remat3`` (``remat3_off``);
  a no-op on versions without the flag.
* ``jax.stages.Traced._params``: a traced jit call's parameters, whose ``in_shardings`` are
  the jit's own (`jit_in_shardings`); no public name gives them before a compile. Present
  in 0.7.2 and 0.10.2 (read by `_step.step_graph`); where absent, none (the arguments' own
  shardings still count).
* ``jax._src.distributed.global_state``: the process id, count and key-value client of
  ``jax.distributed.initialize`` (``distributed_state``; stable from JAX 0.4). Imported on
  call only, so that the multi-host agreement never imports JAX itself.
"""

from __future__ import annotations

from typing import Any

import contextlib
import inspect

import jax
from jax._src import ad_checkpoint as _ad_checkpoint  # private: see the module docstring
from jax.extend import core as jex_core

__all__ = ["CHECKPOINT_NAME", "JIT_COPIES_OPERAND_RESIDUALS", "REMAT_TRACED", "ClosedJaxpr",
           "Jaxpr", "Literal", "NAME_PRIMITIVE", "Var",
           "distributed_state", "everything_saveable", "is_name_primitive", "name_p",
           "nothing_saveable", "policy_class", "remat3_off", "remat3_on", "remat3_rule_params",
           "save_only_these_names", "saved_residuals", "scan_counts", "shard_map"]

name_p: Any = _ad_checkpoint.name_p
NAME_PRIMITIVE = str(name_p)
CHECKPOINT_NAME: Any = getattr(_ad_checkpoint, "CheckpointName", None)  # JAX >= 0.10
REMAT_TRACED: Any = getattr(_ad_checkpoint, "RematTraced", None)  # JAX >= 0.10
saved_residuals: Any = _ad_checkpoint.saved_residuals

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Literal = jex_core.Literal
Var = jex_core.Var

save_only_these_names = jax.checkpoint_policies.save_only_these_names  # public
everything_saveable = jax.checkpoint_policies.everything_saveable  # public
nothing_saveable = jax.checkpoint_policies.nothing_saveable  # public

# jax.shard_map is public from JAX 0.7; the experimental module before (and a deprecated
# alias after). Only tests and examples call it; the package recognises its primitive by name.
shard_map: Any = getattr(jax, "shard_map", None)


# JAX < 0.9: a jit's remat partial evaluation (``pe.closed_call_partial_eval_custom_rule``)
# returns each known operand its staged half reads as a new output of its known half: a
# residual of its own, beside the operand itself where the backward also reads that outside
# the jit. Later versions forward such an operand instead (``disallow_input_fwds``).
_JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])
JIT_COPIES_OPERAND_RESIDUALS = _JAX_VERSION < (0, 9)


def is_name_primitive(prim: Any) -> bool:
    """Whether `prim` is the primitive ``checkpoint_name`` binds."""
    return prim is name_p or str(prim) == NAME_PRIMITIVE


def policy_class(name: str) -> Any:
    """A policy class of JAX >= 0.9 (``"SaveOnlyTheseNames"``, ...), or None."""
    return getattr(_ad_checkpoint, name, None)


def remat3_rule_params() -> list[str]:
    """The parameter names of the tag primitive's remat3 rule; [] where this JAX has none."""
    try:
        return list(inspect.signature(CHECKPOINT_NAME.remat).parameters)
    except (AttributeError, TypeError, ValueError):
        return []


def remat3_on() -> bool:
    """Whether JAX's new remat implementation is on (``jax_remat3``, JAX >= 0.10)."""
    return bool(getattr(jax.config, "jax_remat3", False))


def remat3_off() -> Any:
    """A context with ``jax_remat3`` off (a no-op on JAX versions without the flag)."""
    from jax._src import config as jax_config  # noqa: PLC0415  private: see the docstring

    state = getattr(jax_config, "remat3", None)
    return state(False) if state is not None else contextlib.nullcontext()


def jit_in_shardings(traced: Any) -> tuple[Any, ...]:
    """The ``in_shardings`` a jit was given, one per input of `traced` (``jit(f).trace``'s
    result); () where this JAX does not keep them there."""
    params = getattr(traced, "_params", None)
    found = params.get("in_shardings", ()) if isinstance(params, dict) else ()
    return tuple(found) if isinstance(found, (tuple, list)) else ()


def distributed_state() -> Any:
    """``jax.distributed``'s global state object (process_id, num_processes, client), or None
    where this JAX has no such module."""
    try:
        from jax._src import distributed  # noqa: PLC0415  private: see the docstring
    except ImportError:
        return None
    return getattr(distributed, "global_state", None)


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """(consts, carry) leading operands of a ``scan`` equation. JAX <= 0.10 records them as
    ``num_consts`` and ``num_carry``; JAX 0.11 and 0.12 record a flat tree ``ft_in`` of
    (consts, carry, xs) instead, whose first two parts are counted: a tuple of three flat
    trees (``elts``), or, where JAX's scan rules rebuilt it, one pytree whose three children
    they are (``jax._src.flattree``, private: reached only through the equation's own
    parameter)."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    try:
        ft = params["ft_in"]
        elts = getattr(ft, "elts", None)
        if elts is not None:
            consts, carry = elts[:2]
            return len(consts.vals), len(carry.vals)
        consts, carry, _ = jax.tree_util.treedef_children(ft.tree)
        return consts.num_leaves, carry.num_leaves
    except (KeyError, AttributeError, ValueError, TypeError) as err:
        raise TypeError(f"a scan equation with parameters {sorted(params)}: neither "
                        "num_consts/num_carry nor ft_in (JAX 0.7-0.12 spell them so)") from err
