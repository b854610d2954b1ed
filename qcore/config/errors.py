"""Errors raised by the config layer.

Every message names the field, the value received and what was expected, so a
user reading a traceback from a config file knows which line to fix.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config field holds a value of the wrong type or out of range."""


class DuplicatePatternError(ConfigError):
    """A BackendConfig was given a second config for a pattern it already has."""


def describe(value: Any) -> str:
    """A short, unambiguous rendering of ``value`` for error messages."""
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"function {getattr(value, '__module__', '?')}.{value.__qualname__}"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def invalid(field: str, value: Any, expected: str) -> ConfigError:
    """Build the standard error: ``field: got <value>; expected <expected>``."""
    return ConfigError(f"{field}: got {describe(value)}; expected {expected}")


class QCoreWarning(UserWarning):
    """qcore's own warnings: few, grouped, each saying what to do."""
