"""Stand-in for axlearn.common.config (apple/axlearn 34aed43c, axlearn/common/config.py).

A small config system written for the tests, with the behaviour neuron_remat relies on:
``@config_class`` classes whose annotated attributes are fields with defaults,
``Configurable.default_config()`` setting ``klass``, ``set`` returning the config, unknown
fields raising AttributeError (axlearn's UnknownFieldError subclasses it), REQUIRED
placeholders, ``config_for_function`` whose fields are the function's parameters,
``instantiate``, ``clone``, ``get_recursively``/``set_recursively``, and ``ConfigModifier``
(``__call__(cfg) -> cfg``). None of axlearn's code is copied here.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, TypeVar, Union

T = TypeVar("T")


class RequiredFieldValue:
    def __repr__(self) -> str:
        return "REQUIRED"

    def __deepcopy__(self, memo: Any) -> RequiredFieldValue:
        return self


REQUIRED = RequiredFieldValue()
Required = Union  # only ever used inside (unevaluated) annotations


class RequiredFieldMissingError(ValueError):
    pass


class ConfigBase:
    """Fields live in ``self._values``; the class keeps their defaults in ``_defaults``."""

    _defaults: dict[str, Any] = {}

    def __init__(self, **kwargs: Any) -> None:
        object.__setattr__(self, "_values", {})
        for name, default in type(self)._defaults.items():
            self._values[name] = copy.deepcopy(default)
        self.set(**kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        values = self.__dict__.get("_values", {})
        if name not in values:
            raise AttributeError(f"{type(self).__name__} has no field {name!r} "
                                 f"(keys are {sorted(values)})")
        return values[name]

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in type(self)._defaults:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        self._values[name] = value

    def set(self, **kwargs: Any) -> Any:
        for key, value in kwargs.items():
            setattr(self, key, value)
        return self

    def keys(self) -> list[str]:
        return sorted(self._values)

    def items(self) -> list[tuple[str, Any]]:
        return [(k, self._values[k]) for k in self.keys()]

    def clone(self, **kwargs: Any) -> Any:
        return copy.deepcopy(self).set(**kwargs)

    def get_recursively(self, path: list[str]) -> Any:
        node: Any = self
        for key in path:
            node = getattr(node, key)
        return node

    def set_recursively(self, path: list[str], *, value: Any) -> None:
        parent = self.get_recursively(path[:-1])
        setattr(parent, path[-1], value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.items())})"


def config_class(cls: type[T]) -> type[T]:
    """Collect the annotated attributes of `cls` and its bases as fields."""
    defaults: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        for name in base.__dict__.get("__annotations__", {}):
            if name.startswith("_"):
                continue
            if name in base.__dict__:
                defaults[name] = base.__dict__[name]
            else:
                defaults.setdefault(name, REQUIRED)
    for name in list(cls.__dict__.get("__annotations__", {})):
        if name in cls.__dict__ and not name.startswith("_"):
            delattr(cls, name)
    cls._defaults = defaults  # type: ignore[attr-defined]
    return cls


class InstantiableConfig(ConfigBase):
    def instantiate(self, **kwargs: Any) -> Any:
        raise NotImplementedError(type(self))


class Configurable:
    @config_class
    class Config(InstantiableConfig):
        klass: type

        def instantiate(self, **kwargs: Any) -> Any:
            missing = [k for k, v in self.items() if isinstance(v, RequiredFieldValue)]
            if missing:
                raise RequiredFieldMissingError(f"{self.klass.__name__}: {missing} not set")
            return self.klass(self, **kwargs)

    @classmethod
    def default_config(cls) -> Any:
        return cls.Config(klass=cls)

    def __init__(self, cfg: Any) -> None:
        self._config = copy.deepcopy(cfg)

    @property
    def config(self) -> Any:
        return copy.deepcopy(self._config)


class FunctionConfigBase(InstantiableConfig):
    _defaults = {"fn": REQUIRED}

    def instantiate(self, **kwargs: Any) -> Any:
        args = {k: v for k, v in self.items() if k != "fn"}
        args.update(kwargs)
        missing = [k for k, v in args.items() if isinstance(v, RequiredFieldValue)]
        if missing:
            raise RequiredFieldMissingError(f"{self.fn.__name__}: {missing} not set")
        return self.fn(**args)


def config_for_function(fn: Any) -> Any:
    params = inspect.signature(fn).parameters
    defaults = {"fn": REQUIRED}
    for name, p in params.items():
        defaults[name] = REQUIRED if p.default is inspect.Parameter.empty else p.default
    cls = type(f"FunctionConfig[{fn.__name__}]", (FunctionConfigBase,), {"_defaults": defaults})
    return cls(fn=fn)


def maybe_instantiate(x: Any) -> Any:
    return x.instantiate() if isinstance(x, InstantiableConfig) else x


class ConfigModifier(Configurable):
    def __call__(self, cfg: Any) -> Any:
        return cfg
