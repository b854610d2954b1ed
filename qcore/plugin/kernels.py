"""The kernel interface plugins implement.

A Kernel names the reference pattern it replaces at convert time. The engine
(``qcore.engine.lower``) asks each kernel of the chosen backend, in order,
whether it can take a matched reference pattern, and if so calls
:meth:`Kernel.lower` to build the replacement module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Kernel:
    """A backend's int8 implementation of one reference pattern.

    ``pattern`` uses the same forms as BackendPatternConfig (a module class,
    a function, or a tuple in forward order); ``engine`` names the packed
    weight format (e.g. ``"fbgemm"``) the kernel runs on, whatever
    ``torch.backends.quantized.engine`` says.

    Example::

        >>> Kernel(name="linear", pattern=torch.nn.Linear, engine="fbgemm",
        ...        lower=lower_linear)
    """

    name: str
    pattern: Any
    engine: str
    lower: Any = field(default=None, compare=False)
    """Callable building the quantized replacement; its signature is fixed by the engine."""

    def __post_init__(self) -> None:
        from qcore.config.errors import invalid

        if not isinstance(self.name, str) or not self.name:
            raise invalid("Kernel.name", self.name, "a non-empty str")
        if not isinstance(self.engine, str) or not self.engine:
            raise invalid("Kernel.engine", self.engine, "a non-empty str such as 'fbgemm'")
        if self.lower is not None and not callable(self.lower):
            raise invalid("Kernel.lower", self.lower, "a callable or None")
