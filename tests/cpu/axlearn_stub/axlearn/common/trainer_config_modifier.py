"""Stand-in for axlearn.common.trainer_config_modifier (34aed43c): ChainConfigModifier
(applies its modifiers in order), MeshShapeModifier, RematSpecModifier (sets
``<path>.remat_spec``), PartitionSpecModifier, and ModuleConfigModifier, which replaces the
config at ``target_config`` with ``modification`` after copying into it every field both
share except ``klass`` (its ``_merge_configs``)."""

from __future__ import annotations

from typing import Any

from axlearn.common.config import (REQUIRED, ConfigModifier, Required, config_class,
                                   maybe_instantiate)


class ChainConfigModifier(ConfigModifier):
    @config_class
    class Config(ConfigModifier.Config):
        config_modifiers: Required[Any] = REQUIRED

    def __call__(self, cfg: Any) -> Any:
        for modifier in self.config.config_modifiers:
            cfg = maybe_instantiate(modifier)(cfg)
        return cfg


class MeshShapeModifier(ConfigModifier):
    @config_class
    class Config(ConfigModifier.Config):
        mesh_shape: Required[Any] = REQUIRED

    def __call__(self, cfg: Any) -> Any:
        cfg.mesh_shape = self.config.mesh_shape
        return cfg


class RematSpecModifier(ConfigModifier):
    @config_class
    class Config(ConfigModifier.Config):
        remat_policies: Required[Any] = REQUIRED

    def __call__(self, cfg: Any) -> Any:
        for path, spec in self.config.remat_policies.items():
            cfg.set_recursively(path.split(".") + ["remat_spec"], value=spec)
        return cfg


class PartitionSpecModifier(ConfigModifier):
    @config_class
    class Config(ConfigModifier.Config):
        partition_specs: Required[Any] = REQUIRED

    def __call__(self, cfg: Any) -> Any:
        for path, specs in self.config.partition_specs.items():
            for name, spec in specs.items():
                cfg.set_recursively(path.split(".") + [name], value=spec)
        return cfg


class ModuleConfigModifier(ConfigModifier):
    @config_class
    class Config(ConfigModifier.Config):
        target_config: Required[str] = REQUIRED
        modification: Required[Any] = REQUIRED

    def __call__(self, cfg: Any) -> Any:
        path = self.config.target_config.split(".")
        found = cfg.get_recursively(path)
        new = self.config.modification
        for key in new.keys():
            if key != "klass" and key in found.keys():
                setattr(new, key, getattr(found, key))
        cfg.set_recursively(path, value=new)
        return cfg
