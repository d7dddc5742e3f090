"""axlearn: a mesh-rule modifier that plans ``remat_spec`` from the trainer config, and
``RematSpec`` helpers for configs built by hand.

axlearn applies a mesh rule at launch (``select_mesh_config``), after the config function
ran: the TRN2 rule in ``fuji.py`` sets the mesh, swaps in ``StackedTransformerLayer`` and
``GroupedQKVLinear`` and, for 70B, sets its own ``remat_spec``. A plan made before that
sees the wrong stack, the wrong QKV linear and is then overwritten. So the plan is made by
a ``ConfigModifier`` that goes last in the rule's ``ChainConfigModifier``::

    from neuron_remat.adapters.axlearn import remat_plan_modifier

    ChainConfigModifier.default_config().set(config_modifiers=[
        MeshShapeModifier.default_config().set(mesh_shape=mesh_shape_from_axes(fsdp=-1, model=4)),
        *trn2_config.module_modifications,
        *trn2_config.partition_spec_modifications,
        remat_plan_modifier(),  # last: sees the final stack, QKV linear and mesh
    ])

It reads the layer, the batch, the sequence length, the dtypes and the mesh from the
config (`describe_trainer`), detects the device (or takes ``instance_type``), plans, and
sets ``model.decoder.transformer.layer.remat_spec`` as axlearn's golden configs spell it:
``RematSpec(prevent_cse=<stacked?>, policy=config_for_function(
axlearn.common.utils.save_and_offload_only_these_names_regex).set(...))``. Pipelined
stacks have their own checkpointing and are left alone; off Neuron the config is left as
it is. The paths and class names it reads follow apple/axlearn at commit
34aed43c1b6e581c4753d06d7cbeedd5010ef26b.

axlearn is imported only when a function here builds axlearn objects: `remat_plan_modifier`
(and the ``RematPlanModifier`` class, built on first use), `remat_spec` and `modify`.
`plan_trainer` and `describe_trainer` work on any object with axlearn's attribute paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import planner
from ..device import DeviceSpec, detect, from_instance_type
from .. import multihost, plugin
from ..multihost import PolicyMismatchError
from ..plugin import resolve_policy
from .. import policies
from ..policies import RegexPolicy
from ._axlearn_config import (STACK_PATH, ConfigReadError, TrainerDescription,
                              describe_trainer, stack_kind)

__all__ = ["AXLEARN_COMMIT", "LAYER_PATH", "POLICY_FN", "REMAT3_POLICY_FN", "ConfigReadError",
           "RematSettings",
           "TrainerDescription", "TrainerPlan", "apply_per_layer", "describe_trainer", "modify",
           "plan_trainer",
           "remat_plan_modifier", "remat_settings", "remat_spec", "stack_kind"]

logger = logging.getLogger(__name__)

AXLEARN_COMMIT = "34aed43c1b6e581c4753d06d7cbeedd5010ef26b"
"""The apple/axlearn commit whose config paths, class names and tag names this follows."""
LAYER_PATH = f"{STACK_PATH}.layer"
POLICY_FN = "axlearn.common.utils.save_and_offload_only_these_names_regex"
REMAT3_POLICY_FN = "neuron_remat.policies.save_and_offload_only_these_names_regex"
"""Under ``jax_remat3`` on a JAX whose remat3 ignores closures (0.10;
`policies.remat3_ignores_closures`) the spec names this function instead: same keywords,
but it returns a `RegexPolicy`, which that remat honours. axlearn's own returns a closure,
which it would silently treat as full remat. JAX 0.12's remat3 calls closures, and axlearn's
own function stands."""
_NEED_AXLEARN = (
    "neuron_remat.adapters.axlearn.{what} needs axlearn, which is not importable here "
    "({err}); install it from git next to a JAX it supports, e.g. "
    "`pip install 'axlearn @ git+https://github.com/apple/axlearn'` (the 2024 PyPI release "
    "pins JAX 0.4.21 and predates the TRN2 mesh rules)")


@dataclass(frozen=True)
class RematSettings:
    """What goes into ``layer.remat_spec``: ``RematSpec(prevent_cse=..., policy=
    config_for_function(<policy_fn>).set(**policy_kwargs))``."""

    prevent_cse: bool
    policy_kwargs: dict[str, Any] = field(hash=False)
    policy_fn: str = POLICY_FN
    layer_path: str = LAYER_PATH

    def to_dict(self) -> dict[str, Any]:
        return {"layer_path": self.layer_path, "prevent_cse": self.prevent_cse,
                "policy": {"fn": self.policy_fn, **self.policy_kwargs}}


def _policy_fn(axlearn_fn: Any) -> Any:
    """The function the spec's policy config calls: axlearn's own, as its golden configs
    spell it, except under ``jax_remat3`` (see `REMAT3_POLICY_FN`), which is logged once."""
    global _REMAT3_LOGGED
    if not policies.remat3_ignores_closures():
        return axlearn_fn
    if not _REMAT3_LOGGED:
        _REMAT3_LOGGED = True
        logger.warning(
            "neuron_remat: jax_remat3 is on, and JAX's new remat treats the closure axlearn's "
            "save_and_offload_only_these_names_regex returns as full remat; the remat_spec "
            "names %s (the same keywords) instead", REMAT3_POLICY_FN)
    return policies.save_and_offload_only_these_names_regex


_REMAT3_LOGGED = False


def _settings(policy: RegexPolicy, prevent_cse: bool, layer_path: str = LAYER_PATH
              ) -> RematSettings:
    return RematSettings(
        prevent_cse=prevent_cse, layer_path=layer_path,
        policy_fn=REMAT3_POLICY_FN if policies.remat3_ignores_closures() else POLICY_FN,
        policy_kwargs={"names_which_can_be_saved": policy.save_regex,
                       "names_which_can_be_offloaded": policy.offload_regex,
                       "offload_src": policy.offload_src, "offload_dst": policy.offload_dst})


def remat_settings(stack_class: Any, **context: Any) -> RematSettings | None:
    """The settings for the policy the ``jax_remat_policy`` providers resolve for
    `context`, or None when none answered, the stack is pipelined, or the answer is not a
    `RegexPolicy` (another provider's; one warning, a TypeError under
    ``NEURON_REMAT_STRICT``): the config's own remat_spec then stands."""
    kind = stack_kind(stack_class)
    if kind == "pipelined":
        return None
    choice = resolve_policy(stack=kind, **context)
    if choice.provider is None or choice.policy is None:
        return None
    policy = choice.policy
    if not isinstance(policy, RegexPolicy):
        # another provider's answer that axlearn's regex closure cannot express: not one
        # this host can use, so the config's own spec stands (raised under strict)
        shown = multihost.describe_policy(policy)[:200]
        text = (f"provider {choice.provider!r} answered {shown}, not a RegexPolicy; "
                "axlearn's remat_spec takes a regex of names")
        if plugin._flag(plugin.STRICT_ENV):  # noqa: SLF001
            raise TypeError(text)
        plugin._warn_once(("axlearn regex", choice.provider),  # noqa: SLF001
                          "neuron_remat: %s; remat_spec left as it is", text)
        return None
    return _settings(policy, choice.prevent_cse)


def _axlearn(what: str) -> tuple[Any, Any, Any, Any, Any]:
    """(ConfigModifier, config_class, config_for_function, RematSpec,
    save_and_offload_only_these_names_regex) from the importable axlearn."""
    try:
        from axlearn.common.base_layer import RematSpec  # noqa: PLC0415
        from axlearn.common.config import (  # noqa: PLC0415
            ConfigModifier, config_class, config_for_function)
        from axlearn.common.utils import save_and_offload_only_these_names_regex  # noqa: PLC0415
    except ImportError as err:
        raise ImportError(_NEED_AXLEARN.format(what=what, err=err)) from err
    return (ConfigModifier, config_class, config_for_function, RematSpec,
            save_and_offload_only_these_names_regex)


def _build_spec(settings: RematSettings, what: str) -> Any:
    _, _, config_for_function, remat_spec_cls, policy_fn = _axlearn(what)
    return remat_spec_cls(prevent_cse=settings.prevent_cse,
                          policy=config_for_function(_policy_fn(policy_fn)).set(
                              **settings.policy_kwargs))


def remat_spec(stack_class: Any, **context: Any) -> Any:
    """An axlearn ``RematSpec`` for the resolved policy, or None (see `remat_settings`)."""
    settings = remat_settings(stack_class, **context)
    if settings is None:
        return None
    return _build_spec(settings, "remat_spec")


# --------------------------------------------------------------------------------------
# Planning from the trainer config.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerPlan:
    """A plan for an axlearn trainer config: what was read, what was chosen, and the
    ``remat_spec`` settings that carry it."""

    description: TrainerDescription
    plan: planner.Plan
    settings: RematSettings

    def summary(self) -> str:
        p, d = self.plan, self.description
        return (f"{d.config.name} ({d.stack_class}, tp={d.parallelism.tp} fsdp="
                f"{d.parallelism.fsdp} dp={d.parallelism.dp}, micro-batch {d.shape.micro_batch}"
                f" x {d.shape.seq_len}): saves {list(p.saved_tags) or 'nothing'}, keeps "
                f"{p.kept_bytes_per_layer / 2**20:.1f} MiB/layer of "
                f"{p.budget_bytes_per_layer / 2**20:.1f} MiB, recompute "
                f"{100 * p.overhead:.2f}% of a step, prevent_cse={self.settings.prevent_cse}")


def _process_count() -> int:
    import jax  # noqa: PLC0415  at launch JAX is initialised already

    return jax.process_count()


def _device(device: DeviceSpec | None, instance_type: str | None) -> DeviceSpec:
    if device is not None and instance_type is not None:
        raise ValueError("give device= or instance_type=, not both")
    if device is not None:
        return device
    if instance_type is not None:
        return from_instance_type(instance_type)
    return detect()


def _get(cfg: Any, path: str) -> Any:
    node = cfg
    for i, key in enumerate(path.split(".")):
        try:
            node = getattr(node, key)
        except AttributeError:
            raise ConfigReadError(f"trainer config has no "
                                  f"{'.'.join(path.split('.')[:i + 1])}") from None
    return node


def plan_trainer(trainer_cfg: Any, *, device: DeviceSpec | None = None,
                 instance_type: str | None = None, hosts: int | None = None,
                 reserve: float | int | None = None,
                 stack_path: str = STACK_PATH) -> TrainerPlan | None:
    """Plan the layer of an axlearn trainer config, read whole from the config.

    The device is `device`, or the instance `instance_type` (``"trn2.48xlarge"``), or
    detected. `hosts` is the number of processes (default: JAX's process count), which
    with the device's cores fills a ``-1`` mesh axis. Returns None off Neuron and for
    pipelined stacks. Raises `ConfigReadError` for a field it cannot read (naming its
    path), `NoFitError` when even full recompute does not fit, and ValueError when a
    pattern of the plan matches none of the names the layer emits.
    """
    dev = _device(device, instance_type)
    if not dev.is_neuron:
        logger.info("neuron_remat: %s is not a Neuron device; remat_spec left as it is",
                    dev.family)
        return None
    kind = stack_kind(_get(trainer_cfg, stack_path).klass)
    if kind == "pipelined":
        logger.info("neuron_remat: %s is pipelined and checkpoints itself; left alone",
                    stack_path)
        return None
    if hosts is not None and (isinstance(hosts, bool) or not isinstance(hosts, int)
                              or hosts < 1):
        raise ValueError(f"hosts={hosts!r}: give the number of processes, a positive integer")
    desc = describe_trainer(trainer_cfg, device=dev, hosts=hosts or _process_count(),
                            stack_path=stack_path)
    try:
        chosen = planner.plan(dev, desc.config, desc.shape, desc.parallelism, reserve=reserve)
    except planner.NoFitError as err:
        raise planner.NoFitError(f"{err} {_axlearn_knobs(trainer_cfg, desc)}") from None
    planner.refuse_dead_patterns(chosen.policy, desc.emitted, host=f"{desc.layer_path}")
    return TrainerPlan(desc, chosen, _settings(chosen.policy, kind == "stacked",
                                               desc.layer_path))


def _axlearn_knobs(trainer_cfg: Any, desc: TrainerDescription) -> str:
    """What to change in the trainer config, in axlearn's terms, when nothing fits."""
    c, p, shape = desc.config, desc.parallelism, desc.shape
    attn = f"{desc.layer_path}.self_attention.attention"
    knobs = []
    if not c.flash_attention:
        knobs.append(f"use flash attention: {attn} is {c.name.split()[1]}; set it to "
                     "FlashAttention (the fuji '-flash' configs), which on Neuron runs the NKI "
                     "kernel and holds no seq x seq scores")
    batch = getattr(getattr(getattr(trainer_cfg, "input", None), "input_dispatcher", None),
                    "global_logical_batch_size", None)
    knobs.append(
        f"lower the micro-batch (now {shape.micro_batch} x {shape.seq_len} tokens per replica): "
        f"a smaller input.input_dispatcher.global_logical_batch_size (now {batch}), or "
        "gradient accumulation (a GradientAccumulationModifier with grad_acc_steps=N in the "
        "mesh rule)")
    knobs.append(
        f"change the mesh in the mesh rule's MeshShapeModifier (now model={p.tp} fsdp={p.fsdp}"
        f" data={p.dp} over {p.hosts} host(s)): more hosts (fsdp=-1 grows with them), or "
        f"model={2 * p.tp} where it divides num_heads={c.heads}")
    return "In axlearn's terms: " + "; ".join(knobs) + "."


# --------------------------------------------------------------------------------------
# The ConfigModifier, built on first use.
# --------------------------------------------------------------------------------------

_CLASSES: dict[tuple[Any, ...], type] = {}


def _modifier_class() -> type:
    parts = _axlearn("remat_plan_modifier")
    cls = _CLASSES.get(parts)
    if cls is None:
        cls = _CLASSES[parts] = _define_modifier(*parts)
    return cls


def _define_modifier(config_modifier: Any, config_class: Any, config_for_function: Any,
                     remat_spec_cls: Any, policy_fn: Any) -> type:
    class RematPlanModifier(config_modifier):  # type: ignore[misc, valid-type]
        """Plans ``remat_spec`` for the layer of the trainer config it is given (see
        `neuron_remat.adapters.axlearn`). Put it last in a mesh rule."""

        @config_class
        class Config(config_modifier.Config):  # type: ignore[misc, name-defined]
            """Configures RematPlanModifier.

            Attributes:
                instance_type: plan for this instance (``"trn2.48xlarge"``) rather than
                    the detected device.
                hosts: processes in the job; None takes JAX's process count.
                reserve: HBM held back, a fraction (float) or bytes (int); None: 10% plus
                    the Neuron runtime's share.
                strict: raise when the plan cannot be made (an unreadable field, no fit);
                    False logs one warning and leaves remat_spec as it is; None (the
                    default) follows ``NEURON_REMAT_STRICT`` (off unless set).
                stack_path: the transformer stack in the trainer config.
            """

            instance_type: str | None = None
            hosts: int | None = None
            reserve: float | None = None
            strict: bool | None = None
            stack_path: str = STACK_PATH

        def __call__(self, cfg: Any) -> Any:
            c = self.config
            result = None
            if plugin._flag(plugin.DISABLE_ENV):  # noqa: SLF001 - the plugin's own switch
                logger.info("neuron_remat: %s is set; remat_spec left as it is",
                            plugin.DISABLE_ENV)
            else:
                strict = (plugin._flag(plugin.STRICT_ENV)  # noqa: SLF001
                          if c.strict is None else c.strict)
                try:
                    result = plan_trainer(cfg, instance_type=c.instance_type, hosts=c.hosts,
                                          reserve=c.reserve, stack_path=c.stack_path)
                except Exception as err:
                    if strict:
                        raise
                    plugin._warn_once(  # noqa: SLF001 - one warning per cause, as the plugin's
                        ("axlearn modifier", type(err).__name__, str(err)),
                        "neuron_remat: no remat plan (%s: %s); remat_spec left as it is",
                        type(err).__name__, err)
            # every process must leave the stack the same way: planned alike, or all left
            # (a process where the plugin is off leaves it, and says so to the others)
            multihost.agree(None if result is None else result.plan.policy,
                            None if result is None else result.settings.prevent_cse,
                            what=f"{c.stack_path} (remat_plan_modifier)",
                            context={"stack_path": c.stack_path,
                                     "instance_type": c.instance_type})
            self.last_plan = result
            if result is None:
                return cfg
            layer = _get(cfg, result.settings.layer_path)
            if getattr(layer, "remat_spec", None) is not None:
                logger.info("neuron_remat: replacing %s.remat_spec set earlier",
                            result.settings.layer_path)
            s = result.settings
            layer.remat_spec = remat_spec_cls(
                prevent_cse=s.prevent_cse, policy=config_for_function(
                    _policy_fn(policy_fn)).set(**s.policy_kwargs))
            logger.info("neuron_remat: %s", result.summary())
            return cfg

    RematPlanModifier.__module__ = __name__
    RematPlanModifier.__qualname__ = "RematPlanModifier"
    return RematPlanModifier


def remat_plan_modifier(**options: Any) -> Any:
    """The config of a ``RematPlanModifier``: an axlearn ``ConfigModifier`` that plans
    ``remat_spec`` from the trainer config it is applied to. Put it LAST in a mesh rule's
    ``ChainConfigModifier``. `options` are its config fields: ``instance_type``,
    ``hosts``, ``reserve``, ``strict`` (default None: ``NEURON_REMAT_STRICT``, off unless
    set), ``stack_path``. Raises ImportError
    when axlearn is not importable."""
    return _modifier_class().default_config().set(**options)


def __getattr__(name: str) -> Any:
    if name == "RematPlanModifier":
        return _modifier_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------
# By hand.
# --------------------------------------------------------------------------------------


def modify(trainer_cfg: Any, *, spec_factory: Callable[..., Any] | None = None,
           **context: Any) -> Any:
    """Set ``model.decoder.transformer.layer.remat_spec`` from the policy the providers
    resolve, for configs built by hand. Call it AFTER the mesh rules (in a launcher, after
    ``select_mesh_config``): it reads the final stack class, and a rule applied later
    would overwrite the spec; in a mesh rule use `remat_plan_modifier` instead.

    Without ``model=`` in `context`, the model, step and split are read from the config
    (`describe_trainer`; ``device=`` and ``hosts=`` may be given, else detected and JAX's
    process count) and the emitted tag names are passed as ``tags``. The config is returned
    unchanged when the stack is pipelined, the device is not Neuron (when reading), no
    provider answered, ``NEURON_REMAT_DISABLE`` is set, or the device or the config cannot
    be read (one warning; raised under ``NEURON_REMAT_STRICT``).
    `spec_factory(stack_class, **context)` defaults to `remat_spec`."""
    spec = None
    if not plugin._flag(plugin.DISABLE_ENV):  # noqa: SLF001 - the plugin's own switch
        token = plugin._CALLER_AGREES.set(True)  # noqa: SLF001 - agreed below, once
        try:
            spec = _modified_spec(trainer_cfg, spec_factory, context)
        finally:
            plugin._CALLER_AGREES.reset(token)  # noqa: SLF001
    # every process must leave the stack the same way, whichever way each got there (the
    # plugin off, the config unreadable, no provider answering, or a spec): checked on
    # what is left in the config
    multihost.agree(None if spec is None else spec, None, what=f"{STACK_PATH} (modify)",
                    context={"stack_path": STACK_PATH})
    if spec is not None:
        _get(trainer_cfg, STACK_PATH).layer.remat_spec = spec
    return trainer_cfg


def _modified_spec(trainer_cfg: Any, spec_factory: Callable[..., Any] | None,
                   context: dict[str, Any]) -> Any:
    """`modify`'s spec for the stack, or None to leave it (after one warning when it could
    not decide; raised under ``NEURON_REMAT_STRICT``)."""
    try:
        stack = _get(trainer_cfg, STACK_PATH)
        if "model" not in context:
            device = context.pop("device", None) or detect()
            hosts = context.pop("hosts", None)
            if not device.is_neuron or stack_kind(stack.klass) == "pipelined":
                return None
            desc = describe_trainer(trainer_cfg, device=device,
                                    hosts=hosts or _process_count())
            context = {"model": desc.config, "shape": desc.shape,
                       "parallelism": desc.parallelism, "tags": list(desc.emitted),
                       "device": device, **context}
        if isinstance(stack.layer, (list, tuple)):
            raise ConfigReadError(f"{STACK_PATH}.layer is a list of {len(stack.layer)} layer "
                                  "configs (apply_per_layer's); modify sets one remat_spec")
        return (spec_factory or remat_spec)(stack.klass, **context)
    except PolicyMismatchError:
        raise
    except Exception as err:
        if plugin._flag(plugin.STRICT_ENV):  # noqa: SLF001
            raise
        plugin._warn_once(  # noqa: SLF001
            ("axlearn modify", type(err).__name__, str(err)),
            "neuron_remat: no remat plan for the trainer config (%s: %s); remat_spec left "
            "as it is", type(err).__name__, err)
        return None


# --------------------------------------------------------------------------------------
# Per-layer plans (`plan(..., per_layer=True)`).
# --------------------------------------------------------------------------------------


def apply_per_layer(trainer_cfg: Any, *, device: DeviceSpec | None = None,
                    instance_type: str | None = None, hosts: int | None = None,
                    reserve: float | int | None = None, stack_path: str = STACK_PATH,
                    max_sets: int | None = 2) -> planner.Plan | None:
    """Plan the trainer config's layer per layer and write the plan where the stack allows.

    A ``StackedTransformerLayer`` (unrolled; the TRN2 rule's stack) takes a list of layer
    configs, one per layer: when the per-layer plan mixes save sets, its ``layer`` becomes
    that list, each a clone of the layer config with its own ``remat_spec``. A
    ``RepeatedTransformerLayer`` (one ``lax.scan`` body) keeps one ``remat_spec``: the best
    uniform set's. Call it after the mesh rules, as `modify`. Returns the plan, or None
    where `plan_trainer` leaves the config alone (off Neuron, pipelined stacks).
    """
    dev = _device(device, instance_type)
    if not dev.is_neuron:
        logger.info("neuron_remat: %s is not a Neuron device; remat_spec left as it is",
                    dev.family)
        return None
    stack = _get(trainer_cfg, stack_path)
    kind = stack_kind(stack.klass)
    if kind == "pipelined":
        return None
    desc = describe_trainer(trainer_cfg, device=dev, hosts=hosts or _process_count(),
                            stack_path=stack_path)
    chosen = planner.plan(dev, desc.config, desc.shape, desc.parallelism, reserve=reserve,
                          per_layer=True, max_sets=max_sets)
    for policy in set(chosen.layer_policies or ()) | {chosen.policy}:
        planner.refuse_dead_patterns(policy, desc.emitted, host=f"{desc.layer_path}")
    layer = stack.layer
    if isinstance(layer, (list, tuple)):
        raise ConfigReadError(f"{stack_path}.layer is already a list of {len(layer)} layer "
                              "configs; apply_per_layer expects one layer config")

    def spec(policy: RegexPolicy) -> Any:
        return _build_spec(_settings(policy, kind == "stacked", desc.layer_path),
                           "apply_per_layer")

    if kind == "stacked" and chosen.layer_policies is not None:
        n = int(_get(trainer_cfg, f"{stack_path}.num_layers"))
        if n != len(chosen.layer_policies):
            raise ConfigReadError(f"{stack_path}.num_layers is {n}, the plan has "
                                  f"{len(chosen.layer_policies)} layers per core")
        specs = {p: spec(p) for p in set(chosen.layer_policies)}
        stack.layer = [layer.clone(remat_spec=specs[p]) for p in chosen.layer_policies]
    else:
        layer.remat_spec = spec(chosen.policy)
    logger.info("neuron_remat: per-layer plan for %s: %s", stack_path, "; ".join(
        f"{m.layers} x {list(m.tags)}" for m in chosen.layer_mix))
    return chosen
