"""The one builder the standard operator families share (private)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from qcore.config.dtypes import DTypeConfig, ObservationType
from qcore.config.errors import invalid
from qcore.config.pattern import BackendPatternConfig

DIFFERENT = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
SHARED = ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
NOT_OBSERVED = ObservationType.INPUT_OUTPUT_NOT_OBSERVED

WEIGHT_BIAS_ARGS = {"weight": 1, "bias": 2}
"""Argument positions of weight and bias in F.linear / F.convNd / F.conv_transposeNd."""


def checked_dtype_configs(family: str, dtype_configs: Sequence[DTypeConfig]) -> list[DTypeConfig]:
    """``dtype_configs`` as a list, after checking it is a list of DTypeConfig."""
    if isinstance(dtype_configs, DTypeConfig) or not isinstance(dtype_configs, Iterable):
        raise invalid(f"{family}(dtype_configs)", dtype_configs, "a list of DTypeConfig")
    dtype_configs = list(dtype_configs)
    for index, dtype_config in enumerate(dtype_configs):
        if not isinstance(dtype_config, DTypeConfig):
            raise invalid(f"{family}(dtype_configs)[{index}]", dtype_config, "a DTypeConfig")
    return dtype_configs


def pattern_config(
    pattern: Any,
    dtype_configs: list[DTypeConfig],
    *,
    observation_type: ObservationType = DIFFERENT,
    root: type[nn.Module] | None = None,
    qat: type[nn.Module] | None = None,
    reference: type[nn.Module] | None = None,
    fused: type[nn.Module] | None = None,
    fuser: Callable | None = None,
    input_type_to_index: dict[str, int] | None = None,
    num_tensor_args_to_observation_type: dict[int, ObservationType] | None = None,
) -> BackendPatternConfig:
    """One BackendPatternConfig; unset keywords leave the field at its default."""
    config = (
        BackendPatternConfig(pattern)
        .set_observation_type(observation_type)
        .set_dtype_configs(dtype_configs)
        .set_root_module(root)
        .set_qat_module(qat)
        .set_reference_quantized_module(reference)
        .set_fused_module(fused)
        .set_fuser_method(fuser)
    )
    if input_type_to_index:
        config._set_input_type_to_index(input_type_to_index)
    if num_tensor_args_to_observation_type:
        config._set_num_tensor_args_to_observation_type(num_tensor_args_to_observation_type)
    return config


def op_configs(
    ops: Iterable[Any],
    dtype_configs: list[DTypeConfig],
    observation_type: ObservationType = DIFFERENT,
) -> list[BackendPatternConfig]:
    """A plain config (no module mappings) for each op in ``ops``."""
    return [pattern_config(op, dtype_configs, observation_type=observation_type) for op in ops]
