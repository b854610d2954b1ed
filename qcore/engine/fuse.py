"""Fusion: replace module sequences with the fused modules a backend asks for.

A BackendPatternConfig with a ``fuser_method`` is a fusion rule. Every match
is handed to the fuser as module instances (a functional or method relu
becomes ``nn.ReLU()`` first): in forward order for a pattern set with
``set_pattern``, in the pattern's nested order for a complex-format one,
where another function or method is passed as itself and a ``MatchAllNode``
position as ``MatchAllNode`` (torch.ao's convention). The fused module takes
the root module's name (the first module, or the config's ``root_node_getter``'s).

A rule with an ``extra_inputs_getter`` (torch.ao's ``conv -> add(other)``)
fuses an op with another input: the getter returns those input nodes, which
become extra arguments of the fused module's call, placed where the pattern's
output was (the extra inputs may be computed after the root op). An extra input
that broadcasts to the output is left out: the kernels sum into an accumulator
of the output's shape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from qcore.config import BackendConfig
from qcore.config.errors import ConfigError, describe
from qcore.engine.match import (
    MatchAllNode,
    call_config_hook,
    config_owner,
    extra_inputs_of,
    find_matches,
    is_match_all,
)
from qcore.engine.trace import delete_unused_submodules

__all__ = ["fuse_graph", "fusion_rules"]

_AS_MODULE: dict[Any, Callable[[], torch.nn.Module]] = {
    F.relu: torch.nn.ReLU,
    torch.relu: torch.nn.ReLU,
    "relu": torch.nn.ReLU,
}


def fusion_rules(backend_config: BackendConfig, is_qat: bool = False) -> list:
    """The configs that fuse; for QAT, without those folding a BatchNorm their
    pattern holds (their fuser says ``trains_batchnorm = False``): QAT trains it,
    so the other patterns take the chain (conv + BatchNorm, the add alone)."""
    return [
        config
        for config in backend_config.configs
        if config.fuser_method is not None and not (is_qat and _folds_batchnorm(config))
    ]


def _folds_batchnorm(config: Any) -> bool:
    if getattr(config.fuser_method, "trains_batchnorm", True) is not False:
        return False
    stack = [config.pattern if config.pattern is not None else config.pattern_complex_format]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):
            stack.extend(item)
        elif isinstance(item, type) and issubclass(item, torch.nn.modules.batchnorm._BatchNorm):
            return True
    return False


def _as_module(node: Node, modules: dict[str, torch.nn.Module]) -> torch.nn.Module | None:
    """The module a node calls; a functional relu becomes an nn.ReLU in its caller's mode."""
    if node.op == "call_module":
        return modules[node.target]
    make = _AS_MODULE.get(node.target)
    if make is None:
        return None
    return make().train(modules[""].training)


def _nested_modules(nested: Any, pattern: Any, modules: dict[str, torch.nn.Module]) -> Any:
    """The fuser's arguments for a complex-format match, in the pattern's shape."""
    if isinstance(pattern, tuple):
        return tuple(
            _nested_modules(item, sub, modules) for item, sub in zip(nested, pattern, strict=True)
        )
    if is_match_all(pattern):
        return MatchAllNode
    module = _as_module(nested, modules)
    return module if module is not None else nested.target


def _same_shape(extra: Any, output: Node) -> bool:
    """Whether an extra input of a fusion (the other operand of ``conv -> add``) has the
    fused output's shape as the probe recorded them, or either is unknown. The fused
    kernels sum into an accumulator of their output's shape: an operand that
    broadcasts (a per-channel parameter, a pooled ``(N, C, 1, 1)`` tensor) stays a
    separate add."""
    shapes = [
        getattr(getattr(n, "meta", {}).get("tensor_meta"), "shape", None) for n in (extra, output)
    ]
    return None in shapes or shapes[0] == shapes[1]


def _cannot_fold(parts: Any, is_qat: bool) -> bool:
    """Whether a match holds a BatchNorm that no fusion can take: one without running
    statistics normalizes every batch by its own, which no folded weight (nor a QAT
    ConvBn, which trains against the running ones) computes; one without affine
    parameters has no weight for a QAT ConvBn to scale by. Such a chain stays unfused,
    as PT2E leaves it: the conv or linear is quantized alone, the BatchNorm after it
    is what it is (torch.ao's fusers fail on it: an AssertionError naming running_mean)."""
    if isinstance(parts, (tuple, list)):
        return any(_cannot_fold(part, is_qat) for part in parts)
    if not isinstance(parts, torch.nn.modules.batchnorm._BatchNorm):
        return False
    return not parts.track_running_stats or (is_qat and not parts.affine)


def _set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


def _delete_module(root: torch.nn.Module, name: str) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    if attr in parent._modules:
        del parent._modules[attr]


def fuse_graph(
    gm: GraphModule, backend_config: BackendConfig, is_qat: bool, on_fused: Callable | None = None
) -> int:
    """Fuse in place; ``on_fused(new_node, old_nodes)`` is told of each fusion.
    Returns the number of fusions."""
    rules = fusion_rules(backend_config, is_qat)
    if not rules:
        return 0
    modules = dict(gm.named_modules(remove_duplicate=False))
    matches = {id(m): m for m in find_matches(list(gm.graph.nodes), rules, modules).values()}
    calls = Counter(node.target for node in gm.graph.nodes if node.op == "call_module")
    count = 0
    fused_away: set[str] = set()
    for match in matches.values():
        if len(match.nodes) < 2:
            continue
        root = match.root if match.config._root_node_getter is not None else match.nodes[-1]
        if root.op != "call_module" or calls[root.target] > 1:
            # The fused module replaces the root module under its name, so every
            # other call of that module would run the fusion too (a BatchNorm
            # folded in, a relu, an add short of an input): such a root stays unfused.
            continue
        getter = match.config._extra_inputs_getter
        extra_inputs = extra_inputs_of(match.config, match.nested) if getter is not None else []
        if not all(_same_shape(extra, match.output) for extra in extra_inputs):
            continue
        if match.config.pattern is not None:
            parts = [_as_module(node, modules) for node in reversed(match.nodes)]
            if any(part is None for part in parts):
                continue
        else:
            pattern = match.config.pattern_complex_format
            parts = list(_nested_modules(match.nested, pattern, modules))
        if _cannot_fold(parts, is_qat):
            continue
        fuser = match.config.fuser_method
        fused = call_config_hook(match.config, "fuser_method", fuser, is_qat, *parts)
        if not isinstance(fused, torch.nn.Module):
            raise ConfigError(
                f"{config_owner(match.config)}.fuser_method {describe(fuser)} returned "
                f"{describe(fused)}; expected the "
                "fused module (fuser_method(is_qat, *modules) -> nn.Module)"
            )
        # a fused module made new (ConvReLU2d) starts in training mode; it takes the
        # mode of the module it replaces, and its children keep their own
        fused.training = modules[root.target].training if root.op == "call_module" else gm.training
        _set_module(gm, root.target, fused)
        if extra_inputs:
            root.args = (*root.args, *extra_inputs)
            match.output.prepend(root)  # after the extra inputs, before any use
        # The root node becomes the fused module's node: it keeps its name,
        # which is the name explain and the user know it by.
        match.output.replace_all_uses_with(root)
        for key in ("tensor_meta", "type"):  # what the probe recorded: the chain's output
            if key in match.output.meta:
                root.meta[key] = match.output.meta[key]
        for node in match.nodes:
            if node is not root:
                if node.op == "call_module":
                    fused_away.add(node.target)
                gm.graph.erase_node(node)
        if on_fused is not None:
            on_fused(root, match.nodes)
        count += 1
    if count:
        # The fused module holds the fused-away instances (bn, relu) as its
        # children; delete_all_unused_submodules sees each instance once, under
        # the fused module's name, and would leave their old names behind.
        called = {node.target for node in gm.graph.nodes if node.op == "call_module"}
        for target in sorted(fused_away - called):
            _delete_module(gm, target)
        delete_unused_submodules(gm)
        gm.recompile()
    return count
