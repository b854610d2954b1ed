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

For ``"native"`` the first-party backends' sources are ``closed``: a pattern one
of them configures takes nothing from any other source (no dtype config, no
field, set or unset there), so what native does with it never depends on which
third-party plugins are installed; what a third party would have added is a
:class:`Conflict` too. The closed sources are united first, in the order given,
then the others; a pattern only the others configure is united from them alone.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Sequence
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
        if self.field == "dtype_configs":
            ignored = ", ".join(map(repr, self.ignored_value))
            return (
                f"{self.pattern}: dtype_configs come from first-party backends only "
                f"(first {self.kept_source}); {self.ignored_source}'s {ignored} ignored"
            )
        return (
            f"{self.pattern}: {self.field.lstrip('_')} is {_name(self.kept_value)} from "
            f"{self.kept_source}; {self.ignored_source}'s {_name(self.ignored_value)} ignored"
        )


def _name(value: Any) -> str:
    return getattr(value, "__qualname__", None) or repr(value)


def unite(
    name: str,
    sources: Sequence[tuple[str, Iterable[BackendPatternConfig]]],
    closed: Collection[str] = (),
) -> tuple[BackendConfig, list[Conflict]]:
    """Unite ``(source_label, pattern_configs)`` pairs, given in priority order.

    ``closed``: the labels of sources whose patterns take nothing from the other
    sources (native's first-party backends). Returns a new BackendConfig (the
    sources' objects are never modified) and the conflicts found.
    """
    merged: dict[Any, tuple[str, BackendPatternConfig]] = {}
    closed_patterns: set[Any] = set()
    conflicts: list[Conflict] = []
    ordered = [s for s in sources if s[0] in closed] + [s for s in sources if s[0] not in closed]
    for source, configs in ordered:
        for config in configs:
            key = config.pattern_complex_format
            if key not in merged:
                fresh = copy.copy(config)
                fresh.dtype_configs = list(config.dtype_configs)
                merged[key] = (source, fresh)
                if source in closed:
                    closed_patterns.add(key)
                continue
            if key in closed_patterns and source not in closed:
                conflicts.extend(_left_out(key, merged[key], source, config))
            else:
                conflicts.extend(_merge(key, merged[key], source, config))
    result = BackendConfig(name)
    for _, config in merged.values():
        result.set_backend_pattern_config(config)
    return result, conflicts


def _merge(
    key: Any, kept_from: tuple[str, BackendPatternConfig], source: str, config: BackendPatternConfig
) -> list[Conflict]:
    """``config``'s dtype configs and the fields ``kept`` leaves unset, added to it;
    the fields both set differently, as conflicts."""
    first_source, kept = kept_from
    for dtype_config in config.dtype_configs:
        if dtype_config not in kept.dtype_configs:
            kept.dtype_configs.append(dtype_config)
    conflicts = []
    for field_name in _UNITED_FIELDS:
        theirs, ours = getattr(config, field_name), getattr(kept, field_name)
        if theirs == ours or theirs in _UNSET:
            continue
        if ours in _UNSET:
            setattr(kept, field_name, theirs)
        else:
            conflicts.append(
                Conflict(format_pattern(key), field_name, first_source, ours, source, theirs)
            )
    return conflicts


def _left_out(
    key: Any, kept_from: tuple[str, BackendPatternConfig], source: str, config: BackendPatternConfig
) -> list[Conflict]:
    """What ``config`` would have added to a closed pattern (``kept``), as conflicts:
    nothing of it is taken."""
    first_source, kept = kept_from
    pattern = format_pattern(key)
    conflicts = []
    extra = tuple(d for d in config.dtype_configs if d not in kept.dtype_configs)
    if extra:
        conflicts.append(
            Conflict(
                pattern, "dtype_configs", first_source, tuple(kept.dtype_configs), source, extra
            )
        )
    for field_name in _UNITED_FIELDS:
        theirs, ours = getattr(config, field_name), getattr(kept, field_name)
        if theirs != ours and theirs not in _UNSET:
            conflicts.append(Conflict(pattern, field_name, first_source, ours, source, theirs))
    return conflicts
