"""Uniting pattern configs from several sources into one BackendConfig.

Used twice, by one rule: when several plugins serve one backend name, and for
``"native"``, the union of every installed backend.

The rule, per pattern:

* dtype configs are united: every source's configs, in source order, each
  kept once;
* every other field (observation type, root/QAT/reference/fused module, fuser
  method, getters, input maps) comes from the *first* source that configures
  the pattern. Sources are ordered by backend name, then distribution name.
  A later source that sets the field to something else is a
  :class:`Conflict`: recorded on the result and shown by ``qcore show``,
  never dropped silently. A field the first source leaves unset is taken
  from the next source that sets it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from qcore.config import BackendConfig, BackendPatternConfig
from qcore.config.pattern import format_pattern

__all__ = ["Conflict", "unite"]

_UNITED_FIELDS = (
    "observation_type",
    "root_module",
    "qat_module",
    "reference_quantized_module",
    "fused_module",
    "fuser_method",
    "_root_node_getter",
    "_extra_inputs_getter",
    "_num_tensor_args_to_observation_type",
    "_input_type_to_index",
)

_UNSET = (None, {})


@dataclass(frozen=True)
class Conflict:
    """Two sources disagree on a non-dtype field of one pattern."""

    pattern: str
    field: str
    kept_source: str
    kept_value: Any
    ignored_source: str
    ignored_value: Any

    def __str__(self) -> str:
        return (
            f"{self.pattern}: {self.field.lstrip('_')} is {_name(self.kept_value)} from "
            f"{self.kept_source}; {self.ignored_source}'s {_name(self.ignored_value)} ignored"
        )


def _name(value: Any) -> str:
    return getattr(value, "__qualname__", None) or repr(value)


def unite(
    name: str, sources: Sequence[tuple[str, Iterable[BackendPatternConfig]]]
) -> tuple[BackendConfig, list[Conflict]]:
    """Unite ``(source_label, pattern_configs)`` pairs, given in priority order.

    Returns a new BackendConfig (the sources' objects are never modified) and
    the conflicts found.
    """
    merged: dict[Any, tuple[str, BackendPatternConfig]] = {}
    conflicts: list[Conflict] = []
    for source, configs in sources:
        for config in configs:
            key = config.pattern_complex_format
            if key not in merged:
                fresh = copy.copy(config)
                fresh.dtype_configs = list(config.dtype_configs)
                merged[key] = (source, fresh)
                continue
            first_source, kept = merged[key]
            for dtype_config in config.dtype_configs:
                if dtype_config not in kept.dtype_configs:
                    kept.dtype_configs.append(dtype_config)
            for field_name in _UNITED_FIELDS:
                theirs = getattr(config, field_name)
                ours = getattr(kept, field_name)
                if theirs == ours or theirs in _UNSET:
                    continue
                if ours in _UNSET:
                    setattr(kept, field_name, theirs)
                else:
                    conflicts.append(
                        Conflict(
                            format_pattern(key), field_name, first_source, ours, source, theirs
                        )
                    )
    result = BackendConfig(name)
    for _, config in merged.values():
        result.set_backend_pattern_config(config)
    return result, conflicts
