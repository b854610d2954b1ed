"""torch.ao's custom configs, read into one frozen description.

``prepare_custom_config``, ``convert_custom_config`` and ``fuse_custom_config``
come as torch.ao's ``PrepareCustomConfig``/``ConvertCustomConfig``/
``FuseCustomConfig`` objects or as their legacy dict forms. Every setting is
read: the ones the engine honours are kept, the others raise an error naming
the setting, so nothing a porting user wrote is silently dropped.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from qcore.config.errors import QCoreWarning, caller_stacklevel, describe

__all__ = [
    "CustomConfig",
    "Standalone",
    "UnsupportedSetting",
    "as_custom_config",
    "copy_preserved",
    "warn_unmatched_names",
]


class UnsupportedSetting(ValueError):
    """A custom-config setting qcore does not honour (it is refused, never dropped)."""


@dataclass(frozen=True)
class Standalone:
    """A standalone module's own settings (torch.ao's StandaloneModuleConfigEntry).

    It is prepared and converted as a model of its own; ``None`` takes the
    parent's (its QConfig there, its example inputs, no custom config, its backend).
    """

    qconfig_mapping: Any = None
    example_inputs: Any = None
    prepare_custom_config: Any = None
    backend_config: Any = None


@dataclass(frozen=True)
class CustomConfig:
    """The custom-config settings the engine honours (torch.ao's meanings).

    ``float_to_observed``/``observed_to_quantized``: custom module classes, swapped
    at prepare (``Observed.from_float``) and at convert (``Quantized.from_observed``).
    ``input_quantized_indexes``/``output_quantized_indexes``: graph inputs that
    arrive, and outputs that leave, as torch quantized tensors.
    ``standalone_names``/``standalone_classes``: submodules prepared and converted
    as models of their own (see ``qcore.engine.standalone``).
    """

    non_traceable_module_names: tuple[str, ...] = ()
    non_traceable_module_classes: tuple[type, ...] = ()
    preserved_attributes: tuple[str, ...] = ()
    float_to_observed: dict[type, type] = field(default_factory=dict)
    observed_to_quantized: dict[type, type] = field(default_factory=dict)
    input_quantized_indexes: tuple[int, ...] = ()
    output_quantized_indexes: tuple[int, ...] = ()
    standalone_names: dict[str, Standalone] = field(default_factory=dict)
    standalone_classes: dict[type, Standalone] = field(default_factory=dict)

    @property
    def leaf_names(self) -> tuple[str, ...]:
        """Module names traced as leaves: the non-traceable and standalone ones."""
        return self.non_traceable_module_names + tuple(self.standalone_names)

    @property
    def leaf_classes(self) -> tuple[type, ...]:
        """Classes traced as leaves: the non-traceable, custom and standalone ones."""
        return (
            self.non_traceable_module_classes
            + tuple(self.float_to_observed)
            + tuple(self.standalone_classes)
        )

    def standalone_for(self, name: str, module: torch.nn.Module) -> Standalone | None:
        """The standalone settings of the submodule ``name``, by name first (torch.ao's order)."""
        if name in self.standalone_names:
            return self.standalone_names[name]
        return self.standalone_classes.get(type(module))


# torch.ao's legacy dict keys -> the PrepareCustomConfig attribute they fill.
_PREPARE_DICT_KEYS = {
    "standalone_module_name": "standalone_module_names",
    "standalone_module_class": "standalone_module_classes",
    "float_to_observed_custom_module_class": "float_to_observed_mapping",
    "non_traceable_module_name": "non_traceable_module_names",
    "non_traceable_module_class": "non_traceable_module_classes",
    "input_quantized_idxs": "input_quantized_indexes",
    "output_quantized_idxs": "output_quantized_indexes",
    "preserved_attributes": "preserved_attributes",
}
_CONVERT_DICT_KEYS = {
    "observed_to_quantized_custom_module_class": "observed_to_quantized_mapping",
    "preserved_attributes": "preserved_attributes",
}
_ATTRIBUTES = set(_PREPARE_DICT_KEYS.values()) | set(_CONVERT_DICT_KEYS.values())


def _from_dict(config: dict, where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings by attribute, and the dict key each came from (errors name the key
    the user wrote)."""
    keys = {**_PREPARE_DICT_KEYS, **_CONVERT_DICT_KEYS}
    settings, written_as = {}, {}
    for key, value in config.items():
        if key not in keys:
            raise UnsupportedSetting(
                f"{where}[{key!r}]: unknown setting; expected one of {sorted(keys)}"
            )
        settings[keys[key]] = value
        written_as[keys[key]] = key
    return settings, written_as


def _from_object(config: Any) -> dict[str, Any]:
    return {name: getattr(config, name) for name in _ATTRIBUTES if hasattr(config, name)}


def _collection(value: Any, where: str, expected: str) -> tuple:
    """``value`` as a tuple; a string would be split into letters, a dict into its keys,
    so both are refused, as is a lone item."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise TypeError(f"{where}: got {describe(value)}; expected {expected}")
    return tuple(value)


_QUANT_TYPES = ("static", "dynamic", "qat")


def _class_mapping(value: Any, where: str) -> dict[type, type]:
    """torch.ao keys custom module classes by quant type (static, dynamic, qat); the
    classes say which is which (an observed class, a float one), so they are merged."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{where}: got {describe(value)}; expected a dict")
    mapping: dict[type, type] = {}
    for quant_type, classes in value.items():
        name = getattr(quant_type, "name", quant_type)
        if str(name).lower() not in _QUANT_TYPES and classes:
            raise UnsupportedSetting(
                f"{where}: custom module classes for quant type {name!r} are not supported; "
                f"expected one of {list(_QUANT_TYPES)}"
            )
        if not isinstance(classes, dict):
            raise TypeError(
                f"{where}[{name!r}]: got {describe(classes)}; expected a dict of classes "
                "({float class: observed class} or {observed class: quantized class})"
            )
        for source, target in classes.items():
            for cls in (source, target):
                if not isinstance(cls, type):
                    raise TypeError(f"{where}: got {describe(cls)}; expected a class")
            mapping[source] = target
    return mapping


def _indexes(value: Any, where: str) -> tuple[int, ...]:
    found = _collection(value, where, "a list of non-negative int indexes")
    for index in found:
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise TypeError(f"{where}: got {describe(index)}; expected non-negative int indexes")
    return found


def _names(value: Any, where: str) -> tuple[str, ...]:
    found = _collection(value, where, "a list of names")
    for name in found:
        if not isinstance(name, str):
            raise TypeError(f"{where}: got {describe(name)}; expected names (str)")
    return found


def as_custom_config(config: Any, where: str = "prepare_custom_config") -> CustomConfig:
    """Accept None, a torch.ao custom config object, its legacy dict, or a CustomConfig."""
    if config is None:
        return CustomConfig()
    if isinstance(config, CustomConfig):
        return config
    written_as: dict[str, str] = {}
    if isinstance(config, dict):
        settings, written_as = _from_dict(config, where)
    elif any(hasattr(config, name) for name in _ATTRIBUTES):
        settings = _from_object(config)
    else:
        raise TypeError(
            f"{where}: got {describe(config)}; expected None, a torch.ao PrepareCustomConfig/"
            "ConvertCustomConfig/FuseCustomConfig or its dict form"
        )

    def field(attribute: str) -> str:
        return f"{where}.{written_as.get(attribute, attribute)}"

    classes = _collection(
        settings.get("non_traceable_module_classes"),
        field("non_traceable_module_classes"),
        "a list of torch.nn.Module subclasses",
    )
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(
                f"{field('non_traceable_module_classes')}: got {describe(cls)}; expected "
                "torch.nn.Module subclasses"
            )
    return CustomConfig(
        non_traceable_module_names=_names(
            settings.get("non_traceable_module_names"), field("non_traceable_module_names")
        ),
        non_traceable_module_classes=classes,
        preserved_attributes=_names(
            settings.get("preserved_attributes"), field("preserved_attributes")
        ),
        float_to_observed=_class_mapping(
            settings.get("float_to_observed_mapping"), field("float_to_observed_mapping")
        ),
        observed_to_quantized=_class_mapping(
            settings.get("observed_to_quantized_mapping"),
            field("observed_to_quantized_mapping"),
        ),
        input_quantized_indexes=_indexes(
            settings.get("input_quantized_indexes"), field("input_quantized_indexes")
        ),
        output_quantized_indexes=_indexes(
            settings.get("output_quantized_indexes"), field("output_quantized_indexes")
        ),
        standalone_names=_standalone(
            settings.get("standalone_module_names"), field("standalone_module_names"), str
        ),
        standalone_classes=_standalone(
            settings.get("standalone_module_classes"), field("standalone_module_classes"), type
        ),
    )


def _standalone(value: Any, where: str, key_type: type) -> dict:
    """torch.ao's ``{key: StandaloneModuleConfigEntry}`` or its legacy list of
    ``(key, qconfig_mapping, example_inputs, prepare_custom_config, backend_config)``."""
    if not value:
        return {}
    if isinstance(value, dict):
        entries = {
            key: Standalone(
                entry.qconfig_mapping,
                entry.example_inputs,
                entry.prepare_custom_config,
                entry.backend_config,
            )
            for key, entry in value.items()
        }
    elif isinstance(value, (list, tuple)):
        entries = {}
        for item in value:
            if not isinstance(item, (list, tuple)) or not 1 <= len(item) <= 5:
                raise TypeError(
                    f"{where}: got {describe(item)}; expected (key, qconfig_mapping, "
                    "example_inputs, prepare_custom_config, backend_config)"
                )
            entries[item[0]] = Standalone(*item[1:])
    else:
        raise TypeError(f"{where}: got {describe(value)}; expected a dict or a list of tuples")
    for key in entries:
        valid = isinstance(key, str) if key_type is str else _is_module_class(key)
        if not valid:
            expected = "module names (str)" if key_type is str else "torch.nn.Module subclasses"
            raise TypeError(f"{where}: got {describe(key)}; expected {expected}")
    return entries


def warn_unmatched_names(model: torch.nn.Module, config: CustomConfig) -> None:
    """One warning for the module names ``config`` gives that name no module of
    ``model``: a typo there traces and quantizes, silently, the module the user meant
    to keep untraced or standalone (as a typo in a QConfigMapping's names warns)."""
    names = {name for name, _ in model.named_modules()}
    unmatched = [
        f"non_traceable_module_names {name!r}"
        for name in config.non_traceable_module_names
        if name not in names
    ]
    unmatched += [
        f"standalone_module_names {name!r}" for name in config.standalone_names if name not in names
    ]
    if unmatched:
        warnings.warn(
            f"prepare: prepare_custom_config sets {'; '.join(unmatched)}, which names no "
            "module of the model: no module is left untraced or prepared standalone by it. "
            "Module names are those of model.named_modules().",
            QCoreWarning,
            stacklevel=caller_stacklevel(),
        )


def _is_module_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, torch.nn.Module)


# torch.fx's own key: GraphModule.__deepcopy__ sets the attributes it holds again.
_USER_PRESERVED_ATTRIBUTES = "_user_preserved_attributes"


def copy_preserved(source: torch.nn.Module, target: torch.nn.Module, names: Iterable[str]) -> None:
    """Copy the attributes a custom config names from ``source`` onto ``target``,
    and record them where a deep copy of ``target`` finds them."""
    for name in names:
        if not hasattr(source, name):
            raise AttributeError(
                f"preserved_attributes: the model has no attribute {name!r} to preserve"
            )
        value = getattr(source, name)
        setattr(target, name, value)
        if isinstance(target, torch.fx.GraphModule):
            target.meta.setdefault(_USER_PRESERVED_ATTRIBUTES, {})[name] = value
