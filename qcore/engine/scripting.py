"""``torch.jit.script`` on a converted model, leaving the model as it was.

qcore's kernels hand TorchScript another module to compile
(``__prepare_scriptable__``: a conv kernel one of its dimensionality, a reference
module its float module), and torch puts what that returns in place of the kernel
in its parent's ``_modules``: scripting the user's converted model would replace its
kernels for good (qcore.save then refuses the scripted forms, explain names modules
that are gone). So a converted graph module's own ``__prepare_scriptable__`` hands
torch a copy of its module tree to rewrite: new module objects holding the same
parameters, buffers and packed weights.

Set on the graph module's own class (torch.fx makes one per instance), as
``refuse_train_eval`` is, so the model still pickles; a deep copy keeps it and
``qcore.load`` sets it again. After ``torch.load`` of a pickled model it is gone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule

__all__ = ["keep_model_when_scripted"]


def keep_model_when_scripted(gm: GraphModule) -> GraphModule:
    """Let ``torch.jit.script(gm)`` (and of each graph module inside it) compile a
    copy of ``gm``'s module tree, never changing ``gm``. Returns ``gm``.

    Example::

        >>> converted = keep_model_when_scripted(converted)
        >>> scripted = torch.jit.script(converted)   # converted keeps its kernels
    """
    for module in gm.modules():
        cls = type(module)
        # only the class torch.fx made for this one instance, never one others share
        if isinstance(module, GraphModule) and cls.__qualname__.endswith(".GraphModuleImpl"):
            cls.__prepare_scriptable__ = _scripting_copy
            # torch's deep copy builds the copy's own class, then runs this initializer
            # (the hook torch's _LazyGraphModule overrides): the copy keeps the guard
            cls._deepcopy_init = _deepcopy_init
    return gm


def _scripting_copy(self: GraphModule) -> torch.nn.Module:
    """What torch.jit.script compiles and rewrites in place of ``self``."""
    return _copy_modules(self, {})


def _deepcopy_init(self: GraphModule) -> Any:
    base_init = super(type(self), self)._deepcopy_init()  # GraphModule's, or a subclass's

    def init(copy: GraphModule, root: torch.nn.Module, graph: torch.fx.Graph) -> None:
        base_init(copy, root, graph)
        keep_model_when_scripted(copy)

    return init


def _copy_modules(module: torch.nn.Module, memo: dict[int, torch.nn.Module]) -> torch.nn.Module:
    """A new object of ``module``'s class with its attributes (the same values: no
    tensor or packed weight is copied) and a new ``_modules`` of copies of its
    children. Leaves are copied too: scripting writes ``__overloads__`` into every
    module it compiles.

    Not ``copy.copy``: a graph module's ``__copy__`` builds a new GraphModule on the
    same Graph, which re-owns the graph (and a user's module may not take ``__init__``
    twice). A module shared under two names stays one (``memo``).
    """
    if isinstance(module, torch.jit.ScriptModule):
        return module  # compiled already: torch takes it as it is
    found = memo.get(id(module))
    if found is not None:
        return found
    clone = object.__new__(type(module))  # the same class: a graph module's forward
    memo[id(module)] = clone
    clone.__dict__.update(module.__dict__)
    clone.__dict__["_modules"] = {
        name: None if child is None else _copy_modules(child, memo)
        for name, child in module._modules.items()
    }
    return clone
