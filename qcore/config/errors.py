"""Errors raised by the config layer.

Every message names the field, the value received and what was expected, so a
user reading a traceback from a config file knows which line to fix.
"""

from __future__ import annotations

import contextlib
import math
import os
import reprlib
import sys
from typing import Any, NoReturn


class ConfigError(ValueError):
    """A config field holds a value of the wrong type or out of range."""


class DuplicatePatternError(ConfigError):
    """A BackendConfig was given a second config for a pattern it already has."""


_CONTAINERS = (list, tuple, dict, set, frozenset)
_SHORT = reprlib.Repr()
_SHORT.maxlevel = 3
_SHORT.maxstring = _SHORT.maxother = 40


def describe(value: Any) -> str:
    """A short, unambiguous rendering of ``value`` for error messages."""
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"function {getattr(value, '__module__', '?')}.{value.__qualname__}"
    if isinstance(value, int) and value.bit_length() > 256:
        # Its digits would be cut off anyway, and past sys.get_int_max_str_digits
        # repr raises: say how big it is instead.
        digits = int(value.bit_length() * math.log10(2)) + 1
        kind = "a negative" if value < 0 else "an"
        return f"{kind} integer of about {digits} digits (int)"
    try:
        # A container's repr would walk all of it (a JSON array may be long or deep);
        # reprlib stops after a few items and levels.
        text = _SHORT.repr(value) if isinstance(value, _CONTAINERS) else repr(value)
    except Exception as error:  # the message must not fail while reporting a value
        text = f"<unprintable: {type(error).__name__}>"
    if len(text) > 80:
        text = text[:77] + "..."
    if type(value).__module__.startswith("torchao."):
        # torchao's PT2E classes (Quantizer, QuantizationSpec) carry qcore's names too
        return f"{text} (torchao's {type(value).__name__})"
    if type(value).__module__.startswith("torch.ao."):
        # same class names as qcore's: "got DTypeConfig; expected a DTypeConfig" misleads
        return (
            f"{text} (torch.ao's {type(value).__name__}: qcore.config.torch_ao converts "
            "torch.ao's configs, from_torch_ao for a whole BackendConfig)"
        )
    return f"{text} ({type(value).__name__})"


def invalid(field: str, value: Any, expected: str) -> ConfigError:
    """Build the standard error: ``field: got <value>; expected <expected>``."""
    return ConfigError(f"{field}: got {describe(value)}; expected {expected}")


def relocate(error: ConfigError, path: str, owner: str | None = None) -> ConfigError:
    """``error`` as seen from the document that holds the failing object.

    Its message is prefixed with ``path`` (``configs[3].dtype_configs[0]``); a
    leading ``owner.`` (``DTypeWithConstraints.``) becomes ``path.``, so the
    message names the field where it sits in the document. The error's class is
    kept (a DuplicatePatternError stays one).
    """
    message = str(error)
    if owner is not None and message.startswith(owner + "."):
        message = path + message[len(owner) :]
    elif owner is not None and message.startswith(owner + ":"):
        message = path + message[len(owner) :]
    else:
        message = f"{path}: {message}"
    return type(error)(message)


class QCoreWarning(UserWarning):
    """qcore's own warnings: few, grouped, each saying what to do."""


def caller_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` that points at the first frame outside
    qcore: the user's prepare_fx, convert_fx or quantize call, not qcore's internals
    (nor the contextlib frames of the context managers qcore wraps them in)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and _is_internal(os.path.abspath(frame.f_code.co_filename), package):
        frame, level = frame.f_back, level + 1
    return level


def _is_internal(filename: str, package: str) -> bool:
    return filename.startswith(package) or filename == contextlib.__file__


# Built-in exception types rebuilt from their message alone, nothing else lost (an
# OSError's errno would be, a KeyError's str quotes its message).
_REBUILT_FROM_MESSAGE = (
    RuntimeError,
    ValueError,
    TypeError,
    IndexError,
    LookupError,
    NotImplementedError,
)


def _rebuilt_from_message(error: BaseException) -> bool:
    mro = type(error).__mro__
    builtin = next(cls for cls in mro if cls.__module__ == "builtins")
    subclasses = [cls for cls in mro if cls.__module__ != "builtins"]
    return builtin in _REBUILT_FROM_MESSAGE and not any(
        name in vars(cls) for cls in subclasses for name in ("__init__", "__new__", "__str__")
    )


def raise_prefixed(error: Exception, prefix: str) -> NoReturn:
    """Raise ``error`` saying where it happened: its message prefixed ``prefix: ``, its
    type, attributes and traceback kept; a type that cannot be rebuilt from its message
    is raised as it is, with ``prefix`` as a note."""
    if not _rebuilt_from_message(error):
        error.add_note(f"{prefix}: raised this")
        raise error
    located = type(error)(f"{prefix}: {error}")
    located.__dict__.update(error.__dict__)
    raise located.with_traceback(error.__traceback__) from error.__cause__
