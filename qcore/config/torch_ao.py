"""Conversion between qcore's config classes and torch.ao's.

``from_torch_ao(torch.ao BackendConfig) -> qcore BackendConfig`` and
``to_torch_ao(qcore BackendConfig) -> torch.ao BackendConfig`` carry every
field: the pattern (simple or complex format), observation type, dtype
configs with their constraints, the module mappings, the fuser method and the
advanced underscored settings. Classes and functions are shared, not copied,
so ``from_torch_ao(to_torch_ao(config)) == config``.

torch.ao is imported inside the functions only: importing qcore does not pay
for it.

Example::

    >>> from torch.ao.quantization.backend_config import get_qnnpack_backend_config
    >>> config = from_torch_ao(get_qnnpack_backend_config())
    >>> len(config)
    190
"""

from __future__ import annotations

from typing import Any

from qcore.config.backend import BackendConfig
from qcore.config.dtypes import DTypeConfig, DTypeWithConstraints, ObservationType
from qcore.config.errors import ConfigError, describe
from qcore.config.pattern import BackendPatternConfig

__all__ = [
    "import_torch_ao_backend_config",
    "from_torch_ao",
    "from_torch_ao_dtype_config",
    "from_torch_ao_pattern_config",
    "to_torch_ao",
    "to_torch_ao_dtype_config",
    "to_torch_ao_pattern_config",
]

_CONSTRAINT_FIELDS = (
    "dtype",
    "quant_min_lower_bound",
    "quant_max_upper_bound",
    "scale_min_lower_bound",
    "scale_max_upper_bound",
    "scale_exact_match",
    "zero_point_exact_match",
)
_DTYPE_KINDS = ("input", "output", "weight")
# (qcore attribute / torch.ao attribute, qcore setter, torch.ao setter)
_OPTIONAL_FIELDS = (
    ("root_module", "set_root_module"),
    ("qat_module", "set_qat_module"),
    ("reference_quantized_module", "set_reference_quantized_module"),
    ("fused_module", "set_fused_module"),
    ("fuser_method", "set_fuser_method"),
    ("_root_node_getter", "_set_root_node_getter"),
    ("_extra_inputs_getter", "_set_extra_inputs_getter"),
)


def import_torch_ao_backend_config() -> Any:
    """Import and return ``torch.ao.quantization.backend_config``, with its
    ``utils`` submodule loaded: torch 2.13's ``set_backend_pattern_config``
    (and so ``get_fbgemm_backend_config()``) uses it without importing it.

    Call this before building a torch.ao BackendConfig yourself."""
    import torch.ao.quantization.backend_config as ao_backend_config
    import torch.ao.quantization.backend_config.utils  # noqa: F401

    return ao_backend_config


_ao = import_torch_ao_backend_config


def _check_type(value: Any, cls: type, field: str) -> None:
    if not isinstance(value, cls):
        raise ConfigError(
            f"{field}: got {describe(value)}; expected a {cls.__module__}.{cls.__qualname__}"
        )


# -- torch.ao -> qcore --------------------------------------------------------


def from_torch_ao_dict(kind: str, value: dict) -> Any:
    """``kind``'s ``from_dict`` on a torch.ao ``to_dict()`` result: torch.ao reads
    it, and the object converts (``kind``: BackendConfig, BackendPatternConfig or
    DTypeConfig)."""
    converted = getattr(_ao(), kind).from_dict(value)
    if kind == "BackendConfig":
        return from_torch_ao(converted)
    if kind == "BackendPatternConfig":
        return from_torch_ao_pattern_config(converted)
    return from_torch_ao_dtype_config(converted)


def _observation_type_from_ao(observation_type: Any, field: str) -> ObservationType:
    name = getattr(observation_type, "name", None)
    if name not in ObservationType.__members__:
        raise ConfigError(
            f"{field}: got {describe(observation_type)}; expected a torch.ao ObservationType "
            f"named one of {list(ObservationType.__members__)}"
        )
    return ObservationType[name]


def from_torch_ao_dtype_config(ao_dtype_config: Any) -> DTypeConfig:
    """Convert one torch.ao DTypeConfig (constraints included)."""
    kwargs: dict[str, Any] = {}
    for kind in _DTYPE_KINDS:
        ao_constrained = getattr(ao_dtype_config, f"{kind}_dtype_with_constraints")
        kwargs[f"{kind}_dtype"] = DTypeWithConstraints(
            **{name: getattr(ao_constrained, name) for name in _CONSTRAINT_FIELDS}
        )
    return DTypeConfig(
        **kwargs, bias_dtype=ao_dtype_config.bias_dtype, is_dynamic=ao_dtype_config.is_dynamic
    )


def from_torch_ao_pattern_config(ao_config: Any) -> BackendPatternConfig:
    """Convert one torch.ao BackendPatternConfig, every field included."""
    config = BackendPatternConfig()
    if ao_config.pattern is not None:
        config.set_pattern(ao_config.pattern)
    if ao_config._pattern_complex_format is not None:
        config._set_pattern_complex_format(ao_config._pattern_complex_format)
    config.set_observation_type(
        _observation_type_from_ao(
            ao_config.observation_type, "BackendPatternConfig.observation_type"
        )
    )
    config.set_dtype_configs([from_torch_ao_dtype_config(item) for item in ao_config.dtype_configs])
    for attribute, setter in _OPTIONAL_FIELDS:
        value = getattr(ao_config, attribute)
        if value is not None:
            getattr(config, setter)(value)
    config._set_num_tensor_args_to_observation_type(
        {
            count: _observation_type_from_ao(
                observation_type,
                f"BackendPatternConfig.num_tensor_args_to_observation_type[{count}]",
            )
            for count, observation_type in ao_config._num_tensor_args_to_observation_type.items()
        }
    )
    config._set_input_type_to_index(dict(ao_config._input_type_to_index))
    return config


def from_torch_ao(ao_backend_config: Any) -> BackendConfig:
    """A qcore BackendConfig equal in every field to a torch.ao one.

    Raises a ConfigError naming the pattern and field if a torch.ao value does
    not pass qcore's validation.
    """
    ao = _ao()
    _check_type(ao_backend_config, ao.BackendConfig, "from_torch_ao backend_config")
    config = BackendConfig(ao_backend_config.name)
    for index, ao_config in enumerate(ao_backend_config.configs):
        try:
            config.set_backend_pattern_config(from_torch_ao_pattern_config(ao_config))
        except ConfigError as error:
            raise type(error)(f"{ao_backend_config.name} configs[{index}]: {error}") from None
    return config


# -- qcore -> torch.ao --------------------------------------------------------


def to_torch_ao_dtype_config(dtype_config: DTypeConfig) -> Any:
    """Convert one qcore DTypeConfig to torch.ao's."""
    ao = _ao()
    kwargs: dict[str, Any] = {}
    for kind in _DTYPE_KINDS:
        constrained = getattr(dtype_config, f"{kind}_dtype_with_constraints")
        if constrained.scale_power_of_two:
            raise ConfigError(
                f"{kind}_dtype.scale_power_of_two: got True; expected None: torch.ao's "
                "DTypeWithConstraints has no power-of-two scale constraint, and a torch.ao "
                "config without it would accept scales the backend cannot run"
            )
        kwargs[f"{kind}_dtype"] = ao.DTypeWithConstraints(
            **{name: getattr(constrained, name) for name in _CONSTRAINT_FIELDS}
        )
    return ao.DTypeConfig(
        **kwargs, bias_dtype=dtype_config.bias_dtype, is_dynamic=dtype_config.is_dynamic
    )


def to_torch_ao_pattern_config(config: BackendPatternConfig) -> Any:
    """Convert one qcore BackendPatternConfig to torch.ao's."""
    ao = _ao()
    ao_config = ao.BackendPatternConfig()
    if config.pattern is not None:
        ao_config.set_pattern(config.pattern)
    if config._pattern_complex_format is not None:
        ao_config._set_pattern_complex_format(config._pattern_complex_format)
    ao_config.set_observation_type(ao.ObservationType[config.observation_type.name])
    ao_config.set_dtype_configs([to_torch_ao_dtype_config(item) for item in config.dtype_configs])
    for attribute, setter in _OPTIONAL_FIELDS:
        value = getattr(config, attribute)
        if value is not None:
            getattr(ao_config, setter)(value)
    ao_config._set_num_tensor_args_to_observation_type(
        {
            count: ao.ObservationType[observation_type.name]
            for count, observation_type in config._num_tensor_args_to_observation_type.items()
        }
    )
    ao_config._set_input_type_to_index(dict(config._input_type_to_index))
    return ao_config


def to_torch_ao(config: BackendConfig) -> Any:
    """A torch.ao BackendConfig equal in every field to a qcore one, e.g. to
    compare against torch.ao's prepare_fx/convert_fx."""
    ao = _ao()
    _check_type(config, BackendConfig, "to_torch_ao config")
    ao_backend_config = ao.BackendConfig(config.name)
    for pattern_config in config.configs:
        ao_backend_config.set_backend_pattern_config(to_torch_ao_pattern_config(pattern_config))
    return ao_backend_config


_ao = import_torch_ao_backend_config
