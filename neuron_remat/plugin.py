"""The ``jax_remat_policy`` entry-point protocol, neuron_remat's provider for it, and the
plain-JAX adapter.

The protocol, for host libraries (no import of neuron_remat needed)::

    from importlib.metadata import entry_points

    def remat_policy(default, **context):
        for ep in sorted(entry_points(group="jax_remat_policy"), key=lambda e: e.name):
            answer = ep.load()(default=default, **context)
            if answer is not None:
                return answer      # a policy, or an object with .policy and .prevent_cse
        return default

A provider is any callable taking keyword context and returning None ("no opinion") or an
answer. The keys a host may pass: ``layer`` (its path or name), ``stack`` (``stacked``:
unrolled layers, ``repeated``: layers inside ``lax.scan``, ``pipelined``), ``default`` (its
own policy), and what it knows of the model: ``model`` (a `TransformerConfig`, a built-in
name or a Hugging Face ``config.json`` dict), ``tags`` (the names it emits), ``shape``
(`StepShape` or a dict of its fields), ``parallelism`` (`Parallelism` or a dict). Providers
ignore keys they do not know. Sorting by name keeps every process of a multi-host job on
the same answer.

neuron_remat's provider (`provide`) answers only on a Neuron device (detected, or set by
``NEURON_REMAT_DEVICE``) and never for pipelined stacks; ``NEURON_REMAT_DISABLE=1`` turns
it off. Inside it, a failure logs one warning (once per process per cause, whatever the
number of threads or layers) and returns None, so the host's default stands, unless
``NEURON_REMAT_STRICT=1``.

With more than one JAX process, every resolution is checked across the processes (see
`neuron_remat.multihost`): a process that resolved a different policy is a
`PolicyMismatchError`, strict or not, since the processes would compile different programs.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import numbers
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import models, multihost, planner, policies
from ._jax_compat import is_name_primitive
from .device import _ENV_KEYS as _DEVICE_ENV
from .device import DeviceSpec, as_device, detect
from .multihost import PolicyMismatchError

__all__ = [
    "GROUP",
    "STACK_KINDS",
    "DeferredPolicy",
    "PolicyMismatchError",
    "PROVIDER_NAME",
    "RematChoice",
    "checkpoint",
    "clear_cache",
    "provide",
    "resolve_policy",
]

logger = logging.getLogger(__name__)

GROUP = "jax_remat_policy"
STACK_KINDS = ("stacked", "repeated", "pipelined")
DISABLE_ENV = "NEURON_REMAT_DISABLE"
STRICT_ENV = "NEURON_REMAT_STRICT"
PROVIDER_NAME = "neuron_remat"  # this package's entry-point name (setup.cfg)


_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def _flag(name: str) -> bool:
    """An on/off environment switch. A value that is neither (``2``, ``enabled``) is
    reported once and read as off: the host must not crash over a typo."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        _warn_once(("switch", name, raw), "neuron_remat: %s=%r is not a switch; valid: %s to "
                   "turn it on, %s to turn it off; reading it as off", name, raw[:40],
                   "/".join(_ON), "/".join(v for v in _OFF if v))
    return False


_WARNED: set[tuple[str, ...]] = set()
_WARNED_LOCK = threading.Lock()


def _warn_once(cause: tuple[str, ...], message: str, *args: Any) -> None:
    """Log `message` as a warning the first time this process meets `cause`, and at debug
    level after that, so a host asking from 16 threads or for 80 layers sees it once."""
    with _WARNED_LOCK:
        first = cause not in _WARNED
        _WARNED.add(cause)
    logger.log(logging.WARNING if first else logging.DEBUG, message, *args)


# Set while resolve_policy asks the providers: it checks the final answer across processes,
# so the provider need not check its own as well.
_IN_RESOLVE: contextvars.ContextVar[bool] = contextvars.ContextVar("_in_resolve", default=False)
# Set while a host adapter resolves a policy whose outcome it checks across processes itself
# (axlearn's `modify`: what it leaves in the config, whichever way it got there).
_CALLER_AGREES: contextvars.ContextVar[bool] = contextvars.ContextVar("_caller_agrees",
                                                                      default=False)


@dataclass(frozen=True)
class RematChoice:
    """A resolved policy and the ``prevent_cse`` to use with it; unpacks as
    ``policy, prevent_cse = choice``."""

    policy: Callable[..., Any] | None
    prevent_cse: bool
    provider: str | None = None  # None: nobody answered, the host's default stands
    reason: str = ""
    plan: planner.Plan | None = field(default=None, compare=False, repr=False)

    def __iter__(self) -> Any:
        return iter((self.policy, self.prevent_cse))


def default_prevent_cse(stack: str) -> bool:
    """True for unrolled (stacked) layers, False inside ``lax.scan`` (repeated, pipelined),
    where CSE cannot merge the recomputation into the forward anyway."""
    return stack == "stacked"


def _check_stack(stack: str) -> None:
    if not isinstance(stack, str) or stack not in STACK_KINDS:
        raise ValueError(f"stack={stack!r} is not a stack kind; valid: {', '.join(STACK_KINDS)}")


def _cse(stack: str, prevent_cse: bool | None) -> bool:
    """The ``prevent_cse`` to use: the caller's (a bool, not a truthy string), or the
    stack's usual value."""
    _check_stack(stack)
    if prevent_cse is None:
        return default_prevent_cse(stack)
    if not isinstance(prevent_cse, bool):
        raise ValueError(f"prevent_cse={prevent_cse!r} must be True, False or None (the "
                         "stack's usual value)")
    return prevent_cse


# --------------------------------------------------------------------------------------
# Host side.
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _providers(group: str) -> tuple[tuple[str, Callable[..., Any]], ...]:
    from importlib.metadata import entry_points  # noqa: PLC0415

    found = []
    for ep in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
        try:
            found.append((ep.name, ep.load()))
        except Exception as err:  # noqa: BLE001  a broken provider must not break the host
            if _flag(STRICT_ENV):
                raise
            _warn_once(("load", ep.name, type(err).__name__, str(err)),
                       "remat policy provider %r (%s) failed to load: %s", ep.name, ep.value,
                       err)
    return tuple(found)


def resolve_policy(*, default: Callable[..., Any] | None = None, layer: str | None = None,
                   stack: str = "stacked", prevent_cse: bool | None = None,
                   group: str = GROUP, **context: Any) -> RematChoice:
    """The host side of the protocol: ask every provider in `group`, sorted by name, and
    take the first answer; with none, the host's `default` (and `prevent_cse`, or the
    stack's usual value) stands."""
    cse = _cse(stack, prevent_cse)
    token = _IN_RESOLVE.set(True)
    try:
        choice = _ask_providers(default, layer, stack, cse, group, context)
    finally:
        _IN_RESOLVE.reset(token)
    if not _CALLER_AGREES.get():
        multihost.agree(choice.policy, choice.prevent_cse, what=_site(layer, stack),
                        context={"group": group, "layer": layer, "stack": stack,
                                 "prevent_cse": prevent_cse, "default": default, **context})
    return choice


def _site(layer: str | None, stack: str) -> str:
    return f"layer {layer!r} ({stack})" if layer else f"an unnamed {stack} layer"


def _ask_providers(default: Any, layer: str | None, stack: str, cse: bool, group: str,
                   context: dict[str, Any]) -> RematChoice:
    for name, provider in _providers(group):
        try:
            answer = provider(default=default, layer=layer, stack=stack, **context)
        except PolicyMismatchError:
            raise
        except Exception as err:  # noqa: BLE001
            if _flag(STRICT_ENV):
                raise
            _warn_once(("provider", name, type(err).__name__, str(err)),
                       "remat policy provider %r raised %s: %s; ignoring it", name,
                       type(err).__name__, err)
            continue
        if answer is None:
            continue
        if isinstance(answer, RematChoice):
            choice = dataclasses.replace(answer, provider=answer.provider or name)
        elif hasattr(answer, "policy"):
            choice = RematChoice(answer.policy, bool(getattr(answer, "prevent_cse", cse)), name)
        else:
            choice = RematChoice(answer, cse, name)
        if choice.policy is not None and not callable(choice.policy):
            # not a policy jax.checkpoint can call: skipped like a provider that raised
            text = (f"remat policy provider {name!r} answered {type(choice.policy).__name__} "
                    f"{multihost.describe_policy(choice.policy)[:100]}, not a callable "
                    "policy; ignoring it")
            if _flag(STRICT_ENV):
                raise TypeError(text)
            _warn_once(("provider answer", name, type(choice.policy).__name__), "%s", text)
            continue
        return choice
    return RematChoice(default, cse, None, "no provider answered: the host's default")


# --------------------------------------------------------------------------------------
# neuron_remat's provider.
# --------------------------------------------------------------------------------------


def _freeze(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_freeze(v) for v in obj]
        return tuple(sorted(items, key=repr) if isinstance(obj, (set, frozenset)) else items)
    try:
        hash(obj)
    except TypeError:
        return repr(obj)
    return obj


_LOCK = threading.Lock()
_RESULTS: dict[Any, RematChoice | None] = {}
_PLANNING: dict[Any, threading.Lock] = {}  # one thread plans a context; the rest wait for it


def clear_cache() -> None:
    """Forget resolved answers and the warnings already given (after changing the
    environment in a running process). Layers already wrapped and traced keep the policy
    they resolved."""
    with _LOCK:
        _RESULTS.clear()
        _PLANNING.clear()
    with _WARNED_LOCK:
        _WARNED.clear()
    _providers.cache_clear()
    _per_layer_plan.cache_clear()


def provide(*, default: Any = None, layer: str | None = None, stack: str = "stacked",
            model: Any = None, tags: Any = None, shape: Any = None, parallelism: Any = None,
            device: DeviceSpec | str | None = None, layer_index: int | None = None,
            **unknown: Any) -> RematChoice | None:
    """neuron_remat's ``jax_remat_policy`` provider (registered in setup.cfg).

    Returns None off Neuron, for pipelined stacks, when disabled, or when it cannot
    decide (after one warning); else the planned `RegexPolicy` for the model described,
    or the ``trn2-fuji-70b`` preset when told nothing. With `layer_index` (an unrolled
    stack's layer number, from 0) the plan is per layer (`plan(..., per_layer=True)`) and
    the answer is that layer's policy. `tags` is the host's vocabulary
    (``"axlearn"``, ``"maxtext"`` or a `TagNames`) or the tag names it emits, which the
    answer is then checked against. `device` is a `DeviceSpec` or the string ``--device``
    takes (``"trn2.48xlarge"``); None detects it. Answers are cached per context.

    With several JAX processes the answer (None included) is checked against every other
    process's (`neuron_remat.multihost.agree`) unless `resolve_policy` is asking, which
    checks its final answer itself.
    """
    if _flag(DISABLE_ENV):
        answer = None
    else:
        answer = _provide_cached(layer, stack, model, tags, shape, parallelism, device,
                                 layer_index)
    if not _IN_RESOLVE.get():
        multihost.agree(answer.policy if answer else None,
                        answer.prevent_cse if answer else None, what=_site(layer, stack),
                        context={"provider": PROVIDER_NAME, "layer": layer, "stack": stack,
                                 "model": model, "tags": tags, "shape": shape,
                                 "parallelism": parallelism, "device": device,
                                 "layer_index": layer_index, **unknown})
    return answer


def _provide_cached(layer: str | None, stack: str, model: Any, tags: Any, shape: Any,
                    parallelism: Any, device: DeviceSpec | None,
                    layer_index: int | None = None) -> RematChoice | None:
    try:
        env = tuple(os.environ.get(k) for k in (*_DEVICE_ENV, STRICT_ENV))
        key: Any = (layer, stack, _freeze(model), _freeze(tags), _freeze(shape),
                    _freeze(parallelism), device, env, _freeze(layer_index))
        hash(key)
    except Exception:  # noqa: BLE001  an odd context is planned, just not cached
        return _provide_logged(layer, stack, model, tags, shape, parallelism, device,
                               layer_index)
    with _LOCK:
        if key in _RESULTS:
            return _RESULTS[key]
        planning = _PLANNING.setdefault(key, threading.Lock())
    with planning:  # 16 threads asking at once plan (and warn) once
        with _LOCK:
            if key in _RESULTS:
                return _RESULTS[key]
        answer = _provide_logged(layer, stack, model, tags, shape, parallelism, device,
                                 layer_index)
        with _LOCK:
            _RESULTS[key] = answer
            _PLANNING.pop(key, None)
    return answer


def _provide_logged(layer: str | None, stack: str, model: Any, tags: Any, shape: Any,
                    parallelism: Any, device: DeviceSpec | None,
                    layer_index: int | None = None) -> RematChoice | None:
    try:
        return _provide(layer, stack, model, tags, shape, parallelism, device, layer_index)
    except Exception as err:  # noqa: BLE001
        if _flag(STRICT_ENV):
            raise
        _warn_once(("provide", type(err).__name__,
                    *(err.cause if isinstance(err, _Refusal) else (str(err),))),
                   "neuron_remat could not choose a remat policy for %s (%s: %s); the "
                   "host's default policy stands", layer or "this layer",
                   type(err).__name__, err)
        return None


def _vocabulary(tags: Any) -> tuple[models.TagNames | None, list[str] | None]:
    """(the host's tag vocabulary, the tag names it emits), each when known."""
    if tags is None:
        return None, None
    if isinstance(tags, models.TagNames):
        return tags, None
    if tags in ("axlearn", "maxtext"):
        return {"axlearn": models.AXLEARN_TAGS, "maxtext": models.MAXTEXT_TAGS}[tags], None
    names = [tags] if isinstance(tags, str) else [str(t) for t in tags]
    return None, names


class _Refusal(ValueError):
    """A provider's refusal whose message names per-layer details (the host's tags, the
    layer's number); `cause` is what it is about, so that it is warned of once, not once
    per layer."""

    def __init__(self, message: str, cause: tuple[str, ...]) -> None:
        super().__init__(message)
        self.cause = cause


def _check_names(policy: policies.RegexPolicy, names: list[str] | None) -> None:
    if names is None:
        return
    dead = list(policy.dead_patterns(names))
    if dead:
        raise _Refusal(
            f"patterns {dead} match none of the tags the host emits ({names}); tell the "
            "provider the host's vocabulary (tags='axlearn', 'maxtext' or a TagNames)",
            cause=("dead patterns", *dead))


def _provide(layer: str | None, stack: str, model: Any, tags: Any, shape: Any,
             parallelism: Any, device: DeviceSpec | None,
             layer_index: int | None = None) -> RematChoice | None:
    _check_stack(stack)
    if layer_index is not None and (isinstance(layer_index, bool) or not isinstance(
            layer_index, numbers.Integral) or layer_index < 0):
        raise _Refusal(f"layer_index={layer_index!r}: give the layer's number in its "
                       "stack (an int from 0)", cause=("layer_index", type(layer_index).__name__))
    layer_index = None if layer_index is None else int(layer_index)  # numpy's too
    device = as_device(device, "provide(device=...)") or detect()
    if not device.is_neuron:
        logger.debug("neuron_remat: %s is not a Neuron device; no opinion", device.family)
        return None
    if stack == "pipelined":
        logger.info("neuron_remat: %s is a pipelined stack with its own checkpointing; "
                    "leaving it alone", layer or "layer")
        return None
    cse = default_prevent_cse(stack)
    vocab, names = _vocabulary(tags)
    if model is None:
        policy = policies.trn2_preset(vocab)
        if names is not None and not any(policy.action(t) == "save" for t in names):
            raise _Refusal(f"the trn2-fuji-70b preset matches none of the tags {names}; "
                           "describe the model (model=...) so a policy can be planned",
                           cause=("preset matches no tag",))
        return RematChoice(policy, cse, PROVIDER_NAME,
                           reason="no model described: axlearn's TRN2 preset")
    config = _as_config(model, vocab)
    step = _as_shape(shape, config)
    par = _as_parallelism(parallelism)
    if layer_index is not None:
        return _provide_layer(layer, cse, config, step, par, device, names, layer_index)
    chosen = planner.plan(device, config, step, par)
    _check_names(chosen.policy, names)
    logger.info("neuron_remat: %s on %s saves %s (%.2f%% recompute)", layer or config.name,
                device.describe(), list(chosen.saved_tags) or "nothing", 100 * chosen.overhead)
    return RematChoice(chosen.policy, cse, PROVIDER_NAME, reason=f"planned for {config.name}",
                       plan=chosen)


def _provide_layer(layer: str | None, cse: bool, config: models.TransformerConfig,
                   step: models.StepShape, par: models.Parallelism, device: DeviceSpec,
                   names: list[str] | None, index: int) -> RematChoice:
    """The policy of layer `index` under the per-layer plan (`plan(per_layer=True)`)."""
    chosen = _per_layer_plan(device, config, step, par)
    n = chosen.layers_per_core
    if index >= n:
        raise _Refusal(f"layer_index={index} is past the {n} layers per core of "
                       f"{config.name}", cause=("layer_index past", str(n), config.name))
    policy = chosen.layer_policies[index] if chosen.layer_policies else chosen.policy
    _check_names(policy, names)
    return RematChoice(policy, cse, PROVIDER_NAME,
                       reason=f"planned per layer for {config.name}: layer {index}",
                       plan=chosen)


@functools.lru_cache(maxsize=64)
def _per_layer_plan(device: DeviceSpec, config: models.TransformerConfig,
                    step: models.StepShape, par: models.Parallelism) -> planner.Plan:
    return planner.plan(device, config, step, par, per_layer=True)


def _as_config(model: Any, vocab: models.TagNames | None = None) -> models.TransformerConfig:
    if isinstance(model, models.TransformerConfig):
        config = model
    elif isinstance(model, str):
        config = models.get_model(model)
    elif isinstance(model, Mapping):
        config = models.from_hf_config(model)
    else:
        raise TypeError(f"model={model!r}: give a TransformerConfig, a built-in model name "
                        f"({', '.join(models.MODELS)}) or a config.json dict")
    return config if vocab is None else dataclasses.replace(config, tags=vocab)


def _as_shape(shape: Any, config: models.TransformerConfig) -> models.StepShape:
    if isinstance(shape, models.StepShape):
        return shape
    if shape is None:
        if config.default_seq_len is None:
            raise ValueError(f"shape= not given and {config.name} has no default sequence "
                             "length; pass shape=StepShape(seq_len=..., micro_batch=...)")
        return models.StepShape(seq_len=config.default_seq_len)
    if isinstance(shape, Mapping):
        return models.StepShape(**shape)
    raise TypeError(f"shape={shape!r}: give a StepShape or a dict of its fields")


def _as_parallelism(par: Any) -> models.Parallelism:
    """The host's split, or by default FSDP over every core of every process (JAX's
    process count: the provider runs when JAX is already tracing)."""
    if isinstance(par, models.Parallelism):
        return par
    if par is None:
        import jax  # noqa: PLC0415

        return models.Parallelism(fsdp=-1, hosts=jax.process_count())
    if isinstance(par, Mapping):
        return models.Parallelism(**par)
    raise TypeError(f"parallelism={par!r}: give a Parallelism or a dict of its fields")


# --------------------------------------------------------------------------------------
# Deferred resolution and the plain-JAX adapter.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DeferredPolicy(policies.ResolvingPolicy):
    """A remat policy that resolves itself the first time JAX asks it about a primitive.

    Adapters hand this to ``jax.checkpoint`` so that wrapping a layer at import time does
    not detect the device (and start JAX's backends) before the program has set itself up,
    e.g. before ``jax.distributed.initialize()``. Once resolved it keeps its answer.

    A `policies.ResolvingPolicy`, so JAX's new remat (``jax_remat3``) honours it too: it
    resolves when remat3 first asks about a tag or a matmul.

    Compared by identity: JAX caches remat partial evaluation per (function, policy), and
    two deferred policies with equal context may resolve differently (the environment can
    change between their first traces), so they must not share cache entries.
    """

    context: tuple[tuple[str, Any], ...]
    default: Any = None

    def resolve(self) -> RematChoice:
        choice = self.__dict__.get("_choice")
        if choice is None:
            kwargs = {k: _thaw(v) for k, v in self.context}
            choice = resolve_policy(default=_thaw(self.default), **kwargs)
            object.__setattr__(self, "_choice", choice)
            policies.warn_if_ignored(choice.policy, "neuron_remat's deferred policy",
                                     names_only=True)
            _check_applied_cse(self, choice)
        return choice

    def __call__(self, prim: Any, *args: Any, **params: Any) -> Any:
        choice = self.resolve()
        if choice.policy is None:
            return False  # jax.checkpoint's own default: save nothing
        if choice.plan is not None and is_name_primitive(prim):
            _warn_if_uncounted(choice.plan, params.get("name"))
        return self.answer(choice.policy(prim, *args, **params))


def _warn_if_uncounted(plan: planner.Plan, name: Any) -> None:
    """One warning per tag a layer emits that `plan` does not know (`Plan.counts_tag`): it
    is recomputed and the plan's figures leave it out; where the plan knows none of the
    layer's tags (a layer that names its values otherwise than the model's
    `TransformerConfig.tags`), the layer runs as full remat. JAX asks about tags one by
    one, so there is no point at which all of a layer's are known: each unknown one is
    said as it comes, once per process and vocabulary (every wrapped layer asks, each with
    its own plan). Never raises: it is only a warning."""
    try:
        vocabulary = "" if plan.config is None else plan.config.tags.vocabulary
        cause = ("uncounted", str(name), vocabulary, *(d.tag for d in plan.decisions))
        if not isinstance(name, str) or cause in _WARNED or plan.counts_tag(name):
            return
        known = ", ".join(d.tag for d in plan.decisions) or "none"
        _warn_once(cause, "neuron_remat: the layer tags %r, which the plan does not know "
                   "(it decided on: %s): it is recomputed, and the plan's figures leave it "
                   "out", name, known)
    except Exception as err:  # noqa: BLE001 - a warning must not stop the trace
        logger.debug("neuron_remat: could not check tag %r against the plan: %s", name, err)


class _Held:
    """Carries an unhashable context value through a frozen DeferredPolicy."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held) and _freeze(self.value) == _freeze(other.value)

    def __hash__(self) -> int:
        return hash(_freeze(self.value))


def _thaw(v: Any) -> Any:
    return v.value if isinstance(v, _Held) else v


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return _Held(value)
    return value


def deferred(default: Any = None, **context: Any) -> DeferredPolicy:
    """A `DeferredPolicy` for `context`; unhashable values (dicts) are carried by content."""
    items = tuple((k, _hashable(v)) for k, v in sorted(context.items()))
    return DeferredPolicy(items, _hashable(default))


def remat_args(stack: str, prevent_cse: bool | None, default: Any,
               context: Mapping[str, Any]) -> tuple[bool, DeferredPolicy]:
    """What an adapter that must fix ``prevent_cse`` when it wraps (Flax linen's class
    transform, Equinox's module) passes to its host's remat: the caller's ``prevent_cse``,
    else the stack's usual value, and a `DeferredPolicy` for `context`. A provider's own
    ``prevent_cse`` cannot change it afterwards; when it differs, one warning says so."""
    cse = _cse(stack, prevent_cse)
    policy = deferred(default, stack=stack, **context)
    object.__setattr__(policy, "_applied_cse", cse)
    return cse, policy


def _check_applied_cse(policy: DeferredPolicy, choice: RematChoice) -> None:
    applied = policy.__dict__.get("_applied_cse")
    if applied is None or choice.provider is None or choice.prevent_cse == applied:
        return
    _warn_once(("prevent_cse", choice.provider, str(applied)),
               "remat policy provider %r answered prevent_cse=%s, but this layer was wrapped "
               "with prevent_cse=%s (the caller's or the stack's usual value); pass "
               "prevent_cse=%s to the adapter to follow it", choice.provider,
               choice.prevent_cse, applied, choice.prevent_cse)


class _ResolveOnCall:
    """A checkpointed function built on its first call, once the providers have answered,
    so that it runs with the provider's ``prevent_cse`` (unless the caller gave one)."""

    def __init__(self, fn: Callable[..., Any], build: Callable[[bool, Any], Callable[..., Any]],
                 stack: str, prevent_cse: bool | None, default: Any,
                 context: Mapping[str, Any]) -> None:
        self._cse = None if prevent_cse is None else _cse(stack, prevent_cse)
        _check_stack(stack)
        self._policy = deferred(default, stack=stack, **context)
        self._build = build
        self._built: Callable[..., Any] | None = None
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    @property
    def prevent_cse(self) -> bool:
        """The ``prevent_cse`` it runs with (resolving the policy if not done yet)."""
        return self._cse if self._cse is not None else self._policy.resolve().prevent_cse

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        built = self._built
        if built is None:
            with self._lock:
                if self._built is None:
                    self._built = self._build(self.prevent_cse, self._policy)
                built = self._built
        return built(*args, **kwargs)


def resolve_on_call(fn: Callable[..., Any], build: Callable[[bool, Any], Callable[..., Any]], *,
                    stack: str, prevent_cse: bool | None, default: Any,
                    context: Mapping[str, Any]) -> Callable[..., Any]:
    """`fn`, checkpointed by ``build(prevent_cse, policy)`` on its first call: the policy is
    a `DeferredPolicy` for `context`, and ``prevent_cse`` the caller's, else the one the
    answering provider gave (the stack's usual value when none did)."""
    return _ResolveOnCall(fn, build, stack, prevent_cse, default, context)


def checkpoint(fn: Callable[..., Any], *, default: Any = None, stack: str = "stacked",
               prevent_cse: bool | None = None, static_argnums: int | tuple[int, ...] = (),
               **context: Any) -> Callable[..., Any]:
    """``jax.checkpoint(fn)`` with the policy the providers choose for `context`, or
    `default` when none answers. Both are settled on the first call (when the layer is
    traced): the policy, and ``prevent_cse``, which is the caller's when given, else the
    answering provider's, else the stack's usual value."""
    import jax  # noqa: PLC0415

    return resolve_on_call(
        fn, lambda cse, policy: jax.checkpoint(fn, policy=policy, prevent_cse=cse,
                                               static_argnums=static_argnums),
        stack=stack, prevent_cse=prevent_cse, default=default, context=context)
