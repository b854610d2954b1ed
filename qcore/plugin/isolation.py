"""Running a plugin's code so that nothing it raises ends the user's process.

One rule for every place qcore calls into a plugin (imports and hooks in the
registry, a kernel's ``lower`` and its trial run at convert): whatever the
plugin raises is caught and becomes the plugin's failure, ``SystemExit``
included (a vendor runtime calling ``sys.exit`` must not end a user's
convert); ``KeyboardInterrupt`` alone propagates, since the user asked to stop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["call_isolated"]

T = TypeVar("T")


def call_isolated(function: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``(function(), None)``, or ``(None, error)`` where it raised ``error``
    (anything but KeyboardInterrupt, which propagates)."""
    try:
        return function(), None
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # SystemExit too: a plugin never ends the process
        return None, error
