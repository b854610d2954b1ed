"""BackendConfig: the set of patterns a backend can quantize, keyed by pattern."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qcore.config.dtypes import holds_torch_ao
from qcore.config.errors import ConfigError, DuplicatePatternError, invalid, relocate
from qcore.config.pattern import BackendPatternConfig, Pattern, format_pattern

__all__ = ["BackendConfig"]


class BackendConfig:
    """Everything a backend supports, one BackendPatternConfig per pattern.

    Setting a second config for a pattern already present raises
    :class:`~qcore.config.errors.DuplicatePatternError`; pass ``replace=True``
    to replace it on purpose.

    Example (the BackendConfig tutorial, step 4)::

        >>> backend_config = (BackendConfig("my_backend")
        ...     .set_backend_pattern_config(linear_config)
        ...     .set_backend_pattern_config(conv_relu_config)
        ...     .set_backend_pattern_config(fused_conv_relu_config))
    """

    def __init__(self, name: str = "") -> None:
        self.name = ""
        self._pattern_complex_format_to_config: dict[Pattern, BackendPatternConfig] = {}
        self.set_name(name)

    def __repr__(self) -> str:
        return f"BackendConfig(name={self.name!r}, patterns={len(self)})"

    def __len__(self) -> int:
        return len(self._pattern_complex_format_to_config)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BackendConfig)
            and self.name == other.name
            and self._pattern_complex_format_to_config == other._pattern_complex_format_to_config
        )

    __hash__ = None  # mutable builder

    def set_name(self, name: str) -> BackendConfig:
        """Set the backend's name."""
        if not isinstance(name, str):
            raise invalid("BackendConfig.name", name, "a str")
        self.name = name
        return self

    def set_backend_pattern_config(
        self, config: BackendPatternConfig, *, replace: bool = False
    ) -> BackendConfig:
        """Add the config for one pattern.

        A pattern already present is an error unless ``replace=True``.
        """
        if not isinstance(config, BackendPatternConfig):
            raise invalid("BackendConfig.configs[]", config, "a BackendPatternConfig")
        key = config.pattern_complex_format
        if key in self._pattern_complex_format_to_config and not replace:
            raise DuplicatePatternError(
                f"BackendConfig {self.name!r}: got pattern {config.describe_pattern()}, which "
                "is already configured; expected each pattern once (pass replace=True to "
                "replace it)"
            )
        self._pattern_complex_format_to_config[key] = config
        return self

    def set_backend_pattern_configs(
        self, configs: Iterable[BackendPatternConfig], *, replace: bool = False
    ) -> BackendConfig:
        """Add several pattern configs; see :meth:`set_backend_pattern_config`.

        All or none: a config that is refused leaves the BackendConfig as it was.
        """
        if isinstance(configs, BackendPatternConfig) or not hasattr(configs, "__iter__"):
            raise invalid("BackendConfig.configs", configs, "a list of BackendPatternConfig")
        before = self._pattern_complex_format_to_config
        self._pattern_complex_format_to_config = dict(before)
        try:
            for index, config in enumerate(configs):
                try:
                    self.set_backend_pattern_config(config, replace=replace)
                except ConfigError as error:
                    raise relocate(
                        error, f"BackendConfig.configs[{index}]", "BackendConfig.configs[]"
                    ) from None
        except BaseException:
            self._pattern_complex_format_to_config = before
            raise
        return self

    @property
    def configs(self) -> list[BackendPatternConfig]:
        """The pattern configs, in the order they were set."""
        return list(self._pattern_complex_format_to_config.values())

    def get(self, pattern_complex_format: Pattern) -> BackendPatternConfig | None:
        """The config stored for a pattern (in complex format), or None."""
        return self._pattern_complex_format_to_config.get(pattern_complex_format)

    def patterns(self) -> list[str]:
        """Readable names of the configured patterns, in order."""
        return [format_pattern(key) for key in self._pattern_complex_format_to_config]

    @classmethod
    def from_dict(cls, backend_config_dict: dict[str, Any]) -> BackendConfig:
        """Build from ``{"name": str, "configs": [BackendPatternConfig or dict, ...]}``."""
        if not isinstance(backend_config_dict, dict):
            raise invalid("BackendConfig", backend_config_dict, "a dict")
        if holds_torch_ao(backend_config_dict):  # torch.ao's own to_dict() output
            from qcore.config.torch_ao import from_torch_ao_dict

            return from_torch_ao_dict("BackendConfig", backend_config_dict)
        unknown = set(backend_config_dict) - {"name", "configs"}
        if unknown:
            raise invalid(
                "BackendConfig",
                sorted(unknown, key=repr)[0],  # keys of mixed types do not sort by value
                "one of the keys ['configs', 'name']",
            )
        config = cls(backend_config_dict.get("name", ""))
        items = backend_config_dict.get("configs", [])
        if not isinstance(items, (list, tuple)):
            raise invalid("BackendConfig.configs", items, "a list of BackendPatternConfig or dicts")
        for index, item in enumerate(items):
            path = f"BackendConfig.configs[{index}]"
            if not isinstance(item, (dict, BackendPatternConfig)):
                raise invalid(path, item, "a BackendPatternConfig or a dict")
            # Errors name the item's place in the dict, not just the setter's field.
            try:
                if isinstance(item, dict):
                    item = BackendPatternConfig.from_dict(item)
                config.set_backend_pattern_config(item)
            except ConfigError as error:
                raise relocate(error, path, "BackendPatternConfig") from None
        return config

    def to_dict(self) -> dict[str, Any]:
        """The dict form read by :meth:`from_dict`."""
        return {"name": self.name, "configs": [config.to_dict() for config in self.configs]}
