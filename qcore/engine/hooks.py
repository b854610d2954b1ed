"""Forward hooks on the user's modules, which a quantized model does not run.

torch.fx traces through a module's ``forward`` without its hooks, and convert
replaces a quantized layer by a kernel that has none: a hook that changes
values (input scaling, an adapter) runs during calibration on a leaf layer and
never after, and a traced module's hook never runs at all. torch.ao drops them
silently; qcore names them, once, at prepare.
"""

from __future__ import annotations

import warnings

import torch

from qcore.config.errors import QCoreWarning, caller_stacklevel

__all__ = ["hooked_modules", "warn_of_hooks"]


def hooked_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """``{module name: kinds of forward hooks it has}`` ("" is the model itself)."""
    found: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        kinds = [
            kind
            for kind, hooks in (
                ("forward pre-hook", module._forward_pre_hooks),
                ("forward hook", module._forward_hooks),
            )
            if hooks
        ]
        if kinds:
            found[name] = kinds
    return found


def warn_of_hooks(hooked: dict[str, list[str]]) -> None:
    """One QCoreWarning naming every hooked module, if any."""
    if not hooked:
        return
    listed = "; ".join(
        f"{name!r} ({', '.join(kinds)})" if name else f"the model itself ({', '.join(kinds)})"
        for name, kinds in hooked.items()
    )
    warnings.warn(
        f"prepare: the quantized model will not run these forward hooks: {listed}. "
        "Tracing goes through a module's forward without its hooks, and convert replaces "
        "a quantized layer by a kernel without them (a leaf layer's hooks still run while "
        "calibrating). Move what a hook computes into forward, or remove the hooks "
        "before quantizing.",
        QCoreWarning,
        stacklevel=caller_stacklevel(),
    )
