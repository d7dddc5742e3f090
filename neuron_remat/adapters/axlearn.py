"""axlearn: ``RematSpec`` settings and a trainer-config modifier for
``model.decoder.transformer.layer``.

axlearn wraps each layer in ``jax.checkpoint`` from its ``remat_spec``
(``RematSpec(prevent_cse, policy)``), with the policy usually
``config_for_function(save_and_offload_only_these_names_regex).set(...)``. These helpers
produce exactly those settings from the resolved plan, so an axlearn trainer config picks
it up without new API. Pipelined stacks have their own checkpointing and are left alone;
``prevent_cse`` follows the final stack class (True for ``StackedTransformerLayer``, False
for ``RepeatedTransformerLayer``), as axlearn's ``build_remat_spec`` does.

axlearn is imported only by `remat_spec` and `modify` when they build axlearn configs.
These helpers resolve the policy when called (detecting the device, which starts JAX's
backends): call them where the trainer config is built, after
``jax.distributed.initialize()`` in a multi-host job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..plugin import resolve_policy
from ..policies import RegexPolicy

__all__ = ["LAYER_PATH", "POLICY_FN", "RematSettings", "modify", "remat_settings",
           "remat_spec", "stack_kind"]

LAYER_PATH = "model.decoder.transformer.layer"
POLICY_FN = "axlearn.common.utils.save_and_offload_only_these_names_regex"


def stack_kind(stack_class: Any) -> str:
    """``stacked``, ``repeated`` or ``pipelined`` for an axlearn stack class (or its name)."""
    if isinstance(stack_class, str):
        names = [stack_class.rsplit(".", 1)[-1]]
    else:
        names = [c.__name__ for c in getattr(stack_class, "__mro__", (stack_class,))]
    for kind, marker in (("pipelined", "PipelinedTransformerLayer"),
                         ("repeated", "RepeatedTransformerLayer"),
                         ("stacked", "StackedTransformerLayer")):
        if marker in names:
            return kind
    raise ValueError(f"{names[0]!r} is not an axlearn transformer stack; valid: "
                     "StackedTransformerLayer, RepeatedTransformerLayer, "
                     "PipelinedTransformerLayer or a subclass")


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


def remat_settings(stack_class: Any, **context: Any) -> RematSettings | None:
    """The settings for the resolved policy, or None when no provider answered (or the
    stack is pipelined): the config's own remat_spec then stands."""
    kind = stack_kind(stack_class)
    if kind == "pipelined":
        return None
    choice = resolve_policy(stack=kind, **context)
    if choice.provider is None or choice.policy is None:
        return None
    policy = choice.policy
    if not isinstance(policy, RegexPolicy):
        raise TypeError(f"axlearn configs need a regex policy; the provider returned {policy!r}")
    return RematSettings(
        prevent_cse=choice.prevent_cse,
        policy_kwargs={"names_which_can_be_saved": policy.save_regex,
                       "names_which_can_be_offloaded": policy.offload_regex,
                       "offload_src": policy.offload_src, "offload_dst": policy.offload_dst})


def remat_spec(stack_class: Any, **context: Any) -> Any:
    """An axlearn ``RematSpec`` for the resolved policy, or None (see `remat_settings`)."""
    settings = remat_settings(stack_class, **context)
    if settings is None:
        return None
    from axlearn.common.base_layer import RematSpec  # noqa: PLC0415
    from axlearn.common.config import config_for_function  # noqa: PLC0415
    from axlearn.common.utils import save_and_offload_only_these_names_regex  # noqa: PLC0415

    return RematSpec(
        prevent_cse=settings.prevent_cse,
        policy=config_for_function(save_and_offload_only_these_names_regex).set(
            **settings.policy_kwargs))


def modify(trainer_cfg: Any, *, spec_factory: Callable[..., Any] | None = None,
           **context: Any) -> Any:
    """Set ``model.decoder.transformer.layer.remat_spec`` from the resolved policy, as
    axlearn's ``RematSpecModifier`` would, reading the stack class from the config (call it
    after the modifiers that swap the stack). The config is returned unchanged when the
    stack is pipelined or no provider answered. `spec_factory(stack_class, **context)`
    defaults to `remat_spec`."""
    transformer = trainer_cfg.model.decoder.transformer
    spec = (spec_factory or remat_spec)(transformer.klass, **context)
    if spec is None:
        return trainer_cfg
    transformer.layer.remat_spec = spec
    return trainer_cfg
