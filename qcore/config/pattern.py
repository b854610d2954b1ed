"""BackendPatternConfig: how one operator pattern is fused, observed and quantized.

A pattern is one of:

* a module class (``torch.nn.Linear``), a function or builtin (``torch.add``,
  ``operator.add``, ``torch.nn.functional.relu``) or a method name (``"relu"``);
* a 2- or 3-tuple of those, in forward order: ``(nn.Conv2d, nn.ReLU)`` means
  conv, then relu;
* the *complex* (reversed nested tuple) format, set with
  ``_set_pattern_complex_format``: ``(nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))``,
  the last op first, each tuple ``(op, *args)``; any nesting depth.

Both forms are normalised to the complex format, which is the key a
BackendConfig stores a pattern under.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from qcore.config.dtypes import DTypeConfig, ObservationType, holds_torch_ao
from qcore.config.errors import ConfigError, describe, invalid, relocate

__all__ = [
    "BackendPatternConfig",
    "MAX_PATTERN_DEPTH",
    "MatchAllNode",
    "Pattern",
    "to_complex_format",
    "format_pattern",
]

Pattern = Callable | str | tuple


# In a complex-format pattern, any argument matches at a MatchAllNode; a fuser gets
# the class itself there. torch.ao's own class, so that ported configs are equal.
from torch.ao.quantization.utils import MatchAllNode  # noqa: E402

# Real patterns nest three or four deep; the limit keeps every recursive walk
# over a pattern (checking, hashing, printing) far from Python's recursion limit.
MAX_PATTERN_DEPTH = 32


def _check_pattern_item(field_name: str, item: Any, depth: int = 1) -> None:
    if isinstance(item, tuple):
        if depth > MAX_PATTERN_DEPTH:
            raise invalid(
                field_name, item, f"a pattern nested at most {MAX_PATTERN_DEPTH} tuples deep"
            )
        if not item:
            raise invalid(field_name, item, "a non-empty tuple")
        for index, sub in enumerate(item):
            _check_pattern_item(f"{field_name}[{index}]", sub, depth + 1)
    elif isinstance(item, str):
        # A string is the name of a Tensor method; "" or "a b" can never match one.
        if not item.isidentifier():
            raise invalid(field_name, item, "a method name such as 'relu' (a Python identifier)")
    elif (
        not callable(item)
        or isinstance(item, torch.nn.Module)  # an instance never matches a node
        or (isinstance(item, type) and not _matchable_class(item))
    ):
        raise invalid(
            field_name, item, "a module class, a function, a method name (str) or a tuple of those"
        )


def _matchable_class(cls: type) -> bool:
    """A module class (call_module nodes) or MatchAllNode; `int` matches nothing."""
    return issubclass(cls, torch.nn.Module) or cls is MatchAllNode


def _check_simple_pattern(pattern: Any) -> None:
    field_name = "BackendPatternConfig.pattern"
    if isinstance(pattern, tuple):
        if len(pattern) not in (2, 3):
            raise invalid(
                field_name,
                pattern,
                "a single op or a 2- or 3-tuple in forward order "
                "(use _set_pattern_complex_format for anything longer)",
            )
        for index, item in enumerate(pattern):
            if isinstance(item, tuple):
                raise invalid(f"{field_name}[{index}]", item, "a single op, not a tuple")
            _check_pattern_item(f"{field_name}[{index}]", item)
    else:
        _check_pattern_item(field_name, pattern)


def to_complex_format(pattern: Pattern) -> Pattern:
    """Turn a simple forward-order pattern into the reversed nested format.

    ``(a, b)`` becomes ``(b, a)``; ``(a, b, c)`` becomes ``(c, (b, a))``.
    """
    if not isinstance(pattern, tuple):
        return pattern
    if len(pattern) == 2:
        first, second = pattern
        return (second, first)
    if len(pattern) == 3:
        first, second, third = pattern
        return (third, (second, first))
    raise invalid("BackendPatternConfig.pattern", pattern, "a 2- or 3-tuple")


def format_pattern(pattern: Pattern) -> str:
    """A readable rendering: ``(Conv2d, BatchNorm2d, ReLU)``, ``add``, ``"relu"``."""
    if isinstance(pattern, tuple):
        return "(" + ", ".join(format_pattern(item) for item in pattern) + ")"
    if isinstance(pattern, str):
        return repr(pattern)
    return getattr(pattern, "__name__", None) or repr(pattern)


def _check_module_class(field_name: str, value: Any, example: str | None = None) -> None:
    """A module class; with ``example``, one with a ``from_float`` classmethod: the
    QAT and reference modules are built from the float module by ``cls.from_float``
    (qcore's prepare calls the QAT one), so any other class is a mistake found
    only then. Looked up statically: checking runs no code of the class."""
    if value is None:
        return
    if not (isinstance(value, type) and issubclass(value, torch.nn.Module)):
        expected = "a torch.nn.Module subclass" + (f" ({example})" if example else "")
        raise invalid(field_name, value, expected + " or None")
    if example is not None:
        try:
            from_float = inspect.getattr_static(value, "from_float")
        except AttributeError:
            from_float = None
        if not isinstance(from_float, classmethod):
            raise invalid(
                field_name,
                value,
                f"a torch.nn.Module subclass with a from_float classmethod ({example}) or None",
            )


def _check_optional_callable(field_name: str, value: Any) -> None:
    # a module instance is callable, but as a forward: it takes no (is_qat, *modules)
    if value is not None and (not callable(value) or isinstance(value, torch.nn.Module)):
        raise invalid(field_name, value, "a callable or None (a function, not a module instance)")


class BackendPatternConfig:
    """Quantization behaviour for one operator pattern on a backend.

    Example (from the BackendConfig tutorial)::

        >>> linear_config = (BackendPatternConfig()
        ...     .set_pattern(torch.nn.Linear)
        ...     .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        ...     .add_dtype_config(weighted_int8_dtype_config)
        ...     .set_root_module(torch.nn.Linear)
        ...     .set_qat_module(torch.ao.nn.qat.Linear)
        ...     .set_reference_quantized_module(torch.ao.nn.quantized.reference.Linear))
    """

    def __init__(self, pattern: Pattern | None = None) -> None:
        self.pattern: Pattern | None = None
        self.observation_type = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
        self.dtype_configs: list[DTypeConfig] = []
        self.root_module: type[torch.nn.Module] | None = None
        self.qat_module: type[torch.nn.Module] | None = None
        self.reference_quantized_module: type[torch.nn.Module] | None = None
        self.fused_module: type[torch.nn.Module] | None = None
        self.fuser_method: Callable | None = None
        # Advanced settings, underscored as in torch.ao.
        self._root_node_getter: Callable | None = None
        self._extra_inputs_getter: Callable | None = None
        self._num_tensor_args_to_observation_type: dict[int, ObservationType] = {}
        self._input_type_to_index: dict[str, int] = {}
        self._pattern_complex_format: Pattern | None = None
        if pattern is not None:
            self.set_pattern(pattern)

    # -- identity ---------------------------------------------------------

    @property
    def pattern_complex_format(self) -> Pattern:
        """The pattern in reversed nested tuple format: the key a BackendConfig uses."""
        if self._pattern_complex_format is not None:
            return self._pattern_complex_format
        if self.pattern is None:
            raise ConfigError(
                "BackendPatternConfig.pattern: got None; expected a pattern to be set "
                "with set_pattern() or _set_pattern_complex_format()"
            )
        return to_complex_format(self.pattern)

    def describe_pattern(self) -> str:
        if self.pattern is not None:
            return format_pattern(self.pattern)
        if self._pattern_complex_format is not None:
            return "complex " + format_pattern(self._pattern_complex_format)
        return "<no pattern>"

    def __repr__(self) -> str:
        shown = {
            key: value
            for key, value in vars(self).items()
            if value is not None and not (isinstance(value, (list, dict)) and not value)
        }
        return f"BackendPatternConfig({shown})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BackendPatternConfig) and vars(self) == vars(other)

    __hash__ = None  # mutable builder

    # -- setters (all return self) -----------------------------------------

    def set_pattern(self, pattern: Pattern) -> BackendPatternConfig:
        """Set the pattern: an op, or a 2- or 3-tuple of ops in forward order."""
        _check_simple_pattern(pattern)
        if self._pattern_complex_format is not None:
            raise ConfigError(
                f"BackendPatternConfig.pattern: got {format_pattern(pattern)} while "
                "pattern_complex_format is already set to "
                f"{format_pattern(self._pattern_complex_format)}; expected only one of the two"
            )
        self.pattern = pattern
        return self

    def set_observation_type(self, observation_type: ObservationType) -> BackendPatternConfig:
        """How the pattern's input and output are observed (see ObservationType)."""
        if type(observation_type).__name__ == "ObservationType" and not isinstance(
            observation_type, ObservationType
        ):  # torch.ao's enum, as from_dict takes it
            observation_type = ObservationType.__members__.get(
                getattr(observation_type, "name", ""), observation_type
            )
        if not isinstance(observation_type, ObservationType):
            raise invalid(
                "BackendPatternConfig.observation_type",
                observation_type,
                f"one of {[member.name for member in ObservationType]}",
            )
        self.observation_type = observation_type
        return self

    def add_dtype_config(self, dtype_config: DTypeConfig) -> BackendPatternConfig:
        """Add one set of dtypes this pattern supports."""
        if not isinstance(dtype_config, DTypeConfig):
            raise invalid("BackendPatternConfig.dtype_configs[]", dtype_config, "a DTypeConfig")
        self.dtype_configs.append(dtype_config)
        return self

    def set_dtype_configs(self, dtype_configs: list[DTypeConfig]) -> BackendPatternConfig:
        """Replace the supported dtype sets."""
        if isinstance(dtype_configs, DTypeConfig) or not hasattr(dtype_configs, "__iter__"):
            raise invalid(
                "BackendPatternConfig.dtype_configs", dtype_configs, "a list of DTypeConfig"
            )
        dtype_configs = list(dtype_configs)
        for index, dtype_config in enumerate(dtype_configs):
            if not isinstance(dtype_config, DTypeConfig):
                raise invalid(
                    f"BackendPatternConfig.dtype_configs[{index}]", dtype_config, "a DTypeConfig"
                )
        self.dtype_configs = dtype_configs
        return self

    def set_root_module(self, root_module: type[torch.nn.Module] | None) -> BackendPatternConfig:
        """The module class at the root of the pattern (Conv2d for ConvReLU2d)."""
        _check_module_class("BackendPatternConfig.root_module", root_module)
        self.root_module = root_module
        return self

    def set_qat_module(self, qat_module: type[torch.nn.Module] | None) -> BackendPatternConfig:
        """The module class swapped in for QAT (``qat_module.from_float(float_module)``)."""
        _check_module_class(
            "BackendPatternConfig.qat_module",
            qat_module,
            "a QAT module such as torch.ao.nn.qat.Linear",
        )
        self.qat_module = qat_module
        return self

    def set_reference_quantized_module(
        self, reference_quantized_module: type[torch.nn.Module] | None
    ) -> BackendPatternConfig:
        """The reference quantized module the root module becomes at convert
        (``from_float``, as torch.ao's reference modules)."""
        _check_module_class(
            "BackendPatternConfig.reference_quantized_module",
            reference_quantized_module,
            "a reference quantized module such as torch.ao.nn.quantized.reference.Linear",
        )
        self.reference_quantized_module = reference_quantized_module
        return self

    def set_fused_module(self, fused_module: type[torch.nn.Module] | None) -> BackendPatternConfig:
        """The module class the fuser method produces."""
        _check_module_class("BackendPatternConfig.fused_module", fused_module)
        self.fused_module = fused_module
        return self

    def set_fuser_method(self, fuser_method: Callable | None) -> BackendPatternConfig:
        """The function that fuses the pattern: ``fuser_method(is_qat, *modules)``.

        For a simple pattern the modules come in forward order; for a complex
        pattern, in the nested order of the pattern itself.
        """
        _check_optional_callable("BackendPatternConfig.fuser_method", fuser_method)
        self.fuser_method = fuser_method
        return self

    def _set_root_node_getter(self, root_node_getter: Callable | None) -> BackendPatternConfig:
        _check_optional_callable("BackendPatternConfig.root_node_getter", root_node_getter)
        self._root_node_getter = root_node_getter
        return self

    def _set_extra_inputs_getter(
        self, extra_inputs_getter: Callable | None
    ) -> BackendPatternConfig:
        _check_optional_callable("BackendPatternConfig.extra_inputs_getter", extra_inputs_getter)
        self._extra_inputs_getter = extra_inputs_getter
        return self

    def _set_num_tensor_args_to_observation_type(
        self, num_tensor_args_to_observation_type: dict[int, ObservationType]
    ) -> BackendPatternConfig:
        field_name = "BackendPatternConfig.num_tensor_args_to_observation_type"
        if not isinstance(num_tensor_args_to_observation_type, dict):
            raise invalid(field_name, num_tensor_args_to_observation_type, "a dict")
        for count, observation_type in num_tensor_args_to_observation_type.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise invalid(f"{field_name} key", count, "an int >= 0 (number of tensor args)")
            if not isinstance(observation_type, ObservationType):
                raise invalid(f"{field_name}[{count}]", observation_type, "an ObservationType")
        self._num_tensor_args_to_observation_type = dict(num_tensor_args_to_observation_type)
        return self

    def _set_input_type_to_index(self, input_type_to_index: dict[str, int]) -> BackendPatternConfig:
        field_name = "BackendPatternConfig.input_type_to_index"
        if not isinstance(input_type_to_index, dict):
            raise invalid(field_name, input_type_to_index, "a dict")
        for input_type, index in input_type_to_index.items():
            if not isinstance(input_type, str):
                raise invalid(f"{field_name} key", input_type, "a str such as 'weight' or 'bias'")
            if isinstance(index, bool) or not isinstance(index, int):
                raise invalid(f"{field_name}[{input_type!r}]", index, "an int argument index")
        self._input_type_to_index = dict(input_type_to_index)
        return self

    def _set_pattern_complex_format(self, pattern: Pattern) -> BackendPatternConfig:
        """Set the pattern in reversed nested tuple format (nested at most
        MAX_PATTERN_DEPTH tuples deep)."""
        _check_pattern_item("BackendPatternConfig.pattern_complex_format", pattern)
        if self.pattern is not None:
            raise ConfigError(
                f"BackendPatternConfig.pattern_complex_format: got {format_pattern(pattern)} "
                f"while pattern is already set to {format_pattern(self.pattern)}; expected only "
                "one of the two"
            )
        self._pattern_complex_format = pattern
        return self

    # -- dict form ----------------------------------------------------------

    @classmethod
    def from_dict(cls, backend_pattern_config_dict: dict[str, Any]) -> BackendPatternConfig:
        """Build from a dict with the keys of :meth:`to_dict` (all optional but a
        pattern): ``pattern`` or ``pattern_complex_format``, ``observation_type``,
        ``dtype_configs`` (DTypeConfig or dicts), ``root_module``, ``qat_module``,
        ``reference_quantized_module_for_root``, ``fused_module``, ``fuser_method``,
        ``root_node_getter``, ``extra_inputs_getter``,
        ``num_tensor_args_to_observation_type``, ``input_type_to_index``."""
        if not isinstance(backend_pattern_config_dict, dict):
            raise invalid("BackendPatternConfig", backend_pattern_config_dict, "a dict")
        if holds_torch_ao(backend_pattern_config_dict):  # torch.ao's own to_dict() output
            from qcore.config.torch_ao import from_torch_ao_dict

            return from_torch_ao_dict("BackendPatternConfig", backend_pattern_config_dict)
        unknown = set(backend_pattern_config_dict) - set(_DICT_SETTERS) - {"pattern_complex_format"}
        if unknown:
            raise invalid(
                "BackendPatternConfig",
                sorted(unknown, key=repr)[0],  # keys of mixed types do not sort by value
                f"one of the keys {sorted(_DICT_SETTERS) + ['pattern_complex_format']}",
            )
        config = cls()
        for key, setter_name in _DICT_SETTERS.items():
            if key not in backend_pattern_config_dict:
                continue
            value = backend_pattern_config_dict[key]
            if key == "dtype_configs":
                if not isinstance(value, (list, tuple)):
                    raise invalid(
                        "BackendPatternConfig.dtype_configs",
                        value,
                        "a list of DTypeConfig or dicts",
                    )
                value = [_as_dtype_config(index, item) for index, item in enumerate(value)]
            getattr(config, setter_name)(value)
        if "pattern_complex_format" in backend_pattern_config_dict:
            config._set_pattern_complex_format(
                backend_pattern_config_dict["pattern_complex_format"]
            )
        return config

    def to_dict(self) -> dict[str, Any]:
        """The dict form read by :meth:`from_dict`; unset fields are left out."""
        result: dict[str, Any] = {
            "observation_type": self.observation_type,
            "dtype_configs": [dtype_config.to_dict() for dtype_config in self.dtype_configs],
        }
        optional = {
            "pattern": self.pattern,
            "root_module": self.root_module,
            "qat_module": self.qat_module,
            "reference_quantized_module_for_root": self.reference_quantized_module,
            "fused_module": self.fused_module,
            "fuser_method": self.fuser_method,
            "root_node_getter": self._root_node_getter,
            "extra_inputs_getter": self._extra_inputs_getter,
            "num_tensor_args_to_observation_type": self._num_tensor_args_to_observation_type
            or None,
            "input_type_to_index": self._input_type_to_index or None,
            "pattern_complex_format": self._pattern_complex_format,
        }
        result.update({key: value for key, value in optional.items() if value is not None})
        return result


_DICT_SETTERS = {
    "pattern": "set_pattern",
    "observation_type": "set_observation_type",
    "dtype_configs": "set_dtype_configs",
    "root_module": "set_root_module",
    "qat_module": "set_qat_module",
    "reference_quantized_module_for_root": "set_reference_quantized_module",
    "fused_module": "set_fused_module",
    "fuser_method": "set_fuser_method",
    "root_node_getter": "_set_root_node_getter",
    "extra_inputs_getter": "_set_extra_inputs_getter",
    "num_tensor_args_to_observation_type": "_set_num_tensor_args_to_observation_type",
    "input_type_to_index": "_set_input_type_to_index",
}


def _as_dtype_config(index: int, item: Any) -> DTypeConfig:
    if isinstance(item, DTypeConfig):
        return item
    if isinstance(item, dict):
        try:
            return DTypeConfig.from_dict(item)
        except ConfigError as error:
            raise relocate(
                error, f"BackendPatternConfig.dtype_configs[{index}]", "DTypeConfig"
            ) from None
    raise ConfigError(
        f"BackendPatternConfig.dtype_configs[{index}]: got {describe(item)}; "
        "expected a DTypeConfig or a dict"
    )
