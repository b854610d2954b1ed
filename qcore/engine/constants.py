"""Observers of constants (a functional op's weight) see their value before convert.

A weight passed to ``F.linear``/``F.conv2d`` is a ``get_attr`` node observed like
any input, so it is only seen when the model runs. Dynamic quantization needs
no calibration run: torch.ao observes such weights at convert, and so does qcore.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from qcore.engine.observe import OBSERVER_PREFIX

__all__ = ["observe_constants", "unobserved"]


def unobserved(observer: torch.nn.Module) -> bool:
    """Whether a min/max observer has seen no value yet."""
    low = getattr(observer, "min_val", None)
    return isinstance(low, torch.Tensor) and (low.numel() == 0 or bool(torch.isinf(low).any()))


def observe_constants(gm: GraphModule) -> None:
    """Show each observer of a ``get_attr`` constant its value, if it saw nothing yet."""
    for node in gm.graph.nodes:
        if node.op != "call_module" or not str(node.target).startswith(OBSERVER_PREFIX):
            continue
        source = node.args[0] if node.args else None
        if getattr(source, "op", None) != "get_attr":
            continue
        observer = gm.get_submodule(node.target)
        if unobserved(observer):
            with torch.no_grad():
                observer(_constant(gm, source.target))


def _constant(gm: GraphModule, target: str) -> torch.Tensor:
    owner_name, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    return getattr(owner, name).detach()
