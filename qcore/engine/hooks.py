"""Forward hooks on the user's modules, which a quantized model runs only in part.

torch.fx calls a module it traces through with its hooks, and records what
they compute into the graph; anything else a hook does (storing an output for
feature extraction, printing) happens once, while tracing. A leaf layer's hooks
run while calibrating, but convert replaces a quantized layer by a kernel that has
none, and the model's own hooks are not the traced graph's. torch.ao drops them
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


def warn_of_hooks(hooked: dict[str, list[str]], leaves: set[str]) -> None:
    """One QCoreWarning naming every hooked module, if any: the model's own and
    those of ``leaves`` (the modules the traced graph calls) are not run by the
    quantized model; those it traced through ran once, into the graph. Modules
    inside a leaf run as the leaf does and are not named."""

    def inside_a_leaf(name: str) -> bool:
        return any(name.startswith(leaf + ".") for leaf in leaves)

    def listed(names: list[str]) -> str:
        return "; ".join(
            f"{name!r} ({', '.join(hooked[name])})"
            if name
            else f"the model itself ({', '.join(hooked[name])})"
            for name in names
        )

    dropped = [name for name in hooked if name == "" or name in leaves]
    traced = [name for name in hooked if name not in dropped and not inside_a_leaf(name)]
    parts = []
    if dropped:
        parts.append(
            f"the quantized model will not run these forward hooks: {listed(dropped)} "
            "(convert replaces a quantized layer by a kernel without hooks, and the model's "
            "own hooks are not the traced graph's; a layer's hooks still run while calibrating)"
        )
    if traced:
        parts.append(
            f"these forward hooks were traced into the graph: {listed(traced)} (what they "
            "return is kept; anything else they do, such as storing an output, happened "
            "once, while tracing)"
        )
    if parts:
        warnings.warn(
            f"prepare: {'. And '.join(parts)}. Move what a hook computes into forward, or "
            "remove the hooks before quantizing.",
            QCoreWarning,
            stacklevel=caller_stacklevel(),
        )
