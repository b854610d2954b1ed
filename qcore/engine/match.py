"""Matching BackendConfig patterns (complex format) against torch.fx nodes.

A pattern in complex format is an op, or ``(op, arg0_pattern, arg1_pattern, ...)``:
the node matching ``op`` must have ``args[i]`` matching ``argi_pattern``. An op is
a module class (matched by exact type, as torch.ao does), a function (by
identity) or a method name. ``MatchAllNode`` (qcore's, or torch.ao's) matches
any argument without consuming it. Nodes inside a multi-node match other than
its output must have no other users, or the pattern would change what they
compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node
from torch.nn.utils.parametrize import type_before_parametrizations

from qcore.config import BackendPatternConfig
from qcore.config.errors import ConfigError, describe
from qcore.config.pattern import MatchAllNode

__all__ = ["Match", "MatchAllNode", "find_matches", "is_match_all", "match_pattern", "node_op"]


def is_match_all(op: Any) -> bool:
    return op is MatchAllNode or getattr(op, "__name__", None) == "MatchAllNode"


def node_op(node: Node, modules: Mapping[str, torch.nn.Module]) -> Any:
    """What a node runs: the module's class, the function, or the method name."""
    if node.op == "call_module":
        return type_before_parametrizations(modules[node.target])
    if node.op in ("call_function", "call_method"):
        return node.target
    return None


def _op_matches(node: Node, op: Any, modules: Mapping[str, torch.nn.Module]) -> bool:
    if isinstance(op, type) and issubclass(op, torch.nn.Module):
        return node.op == "call_module" and type_before_parametrizations(modules[node.target]) is op
    if isinstance(op, str):
        return node.op == "call_method" and node.target == op
    return node.op == "call_function" and node.target is op


def match_pattern(
    node: Any, pattern: Any, modules: Mapping[str, torch.nn.Module], *, is_output: bool = True
) -> Any | None:
    """The nested match (Nodes in the pattern's shape), or None.

    ``MatchAllNode`` positions hold the argument itself.
    """
    op, arg_patterns = (pattern[0], pattern[1:]) if isinstance(pattern, tuple) else (pattern, ())
    if is_match_all(op):
        return node
    if not isinstance(node, Node) or not _op_matches(node, op, modules):
        return None
    if not is_output and len(node.users) > 1:
        return None
    if not arg_patterns:
        return node
    if len(node.args) < len(arg_patterns):
        return None
    matched = [node]
    for arg, arg_pattern in zip(node.args, arg_patterns, strict=False):
        sub = match_pattern(arg, arg_pattern, modules, is_output=False)
        if sub is None:
            return None
        matched.append(sub)
    return tuple(matched)


def _flatten(nested: Any, pattern: Any) -> list[Node]:
    """Nodes of a nested match, MatchAllNode positions left out."""
    if isinstance(pattern, tuple):
        if is_match_all(pattern[0]):
            return []
        nodes = [nested[0]]
        for sub, sub_pattern in zip(nested[1:], pattern[1:], strict=True):
            nodes += _flatten(sub, sub_pattern)
        return nodes
    return [] if is_match_all(pattern) else [nested]


def _default_root(nested: Any) -> Node:
    while isinstance(nested, tuple):
        nested = nested[-1]
    return nested


@dataclass
class Match:
    """One occurrence of a pattern: its nodes, its root and its output node."""

    config: BackendPatternConfig
    nested: Any
    nodes: list[Node]
    root: Node
    output: Node
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def node_set(self) -> set[Node]:
        return set(self.nodes)


def _pattern_size(pattern: Any) -> int:
    if isinstance(pattern, tuple):
        return 1 + sum(_pattern_size(sub) for sub in pattern[1:])
    return 0 if is_match_all(pattern) else 1


class _Candidates:
    """The configs whose pattern could end at a node, by the node's op, in the
    configs' order: a large graph tries a few patterns per node, not all of them."""

    def __init__(self, ordered: list[BackendPatternConfig]) -> None:
        self.by_op: dict[tuple[str, Any], list[tuple[int, BackendPatternConfig]]] = {}
        self.any_op: list[tuple[int, BackendPatternConfig]] = []
        for index, config in enumerate(ordered):
            pattern = config.pattern_complex_format
            op = pattern[0] if isinstance(pattern, tuple) else pattern
            key = _op_key(op)
            bucket = self.any_op if key is None else self.by_op.setdefault(key, [])
            bucket.append((index, config))
        self._merged: dict[tuple[str, Any], list[BackendPatternConfig]] = {}

    def for_node(
        self, node: Node, modules: Mapping[str, torch.nn.Module]
    ) -> list[BackendPatternConfig]:
        if node.op == "call_module":
            key: tuple[str, Any] = (
                "call_module",
                type_before_parametrizations(modules[node.target]),
            )
        else:
            key = (node.op, node.target)
        merged = self._merged.get(key)
        if merged is None:
            merged = [c for _, c in sorted(self.by_op.get(key, []) + self.any_op, key=_first)]
            self._merged[key] = merged
        return merged


def _first(item: tuple[int, Any]) -> int:
    return item[0]


def _op_key(op: Any) -> tuple[str, Any] | None:
    """The (node.op, what identifies it) a pattern's output op matches; None for an
    op matching any node (MatchAllNode)."""
    if is_match_all(op):
        return None
    if isinstance(op, type) and issubclass(op, torch.nn.Module):
        return ("call_module", op)
    if isinstance(op, str):
        return ("call_method", op)
    return ("call_function", op)


def find_matches(
    nodes: list[Node],
    configs: list[BackendPatternConfig],
    modules: Mapping[str, torch.nn.Module],
) -> dict[Node, Match]:
    """Match every node at most once, larger patterns first, from the graph's
    end to its start (as torch.ao does). Returns node -> its Match."""
    ordered = sorted(configs, key=lambda c: -_pattern_size(c.pattern_complex_format))
    candidates = _Candidates(ordered)
    matched: dict[Node, Match] = {}
    for node in reversed(nodes):
        if node in matched or node.op not in ("call_module", "call_function", "call_method"):
            continue
        for config in candidates.for_node(node, modules):
            pattern = config.pattern_complex_format
            nested = match_pattern(node, pattern, modules)
            if nested is None:
                continue
            flat = _flatten(nested, pattern)
            if any(n in matched for n in flat):
                continue
            if config._extra_inputs_getter is not None and not all(
                isinstance(extra, Node) for extra in extra_inputs_of(config, nested)
            ):
                continue  # `conv(x) + 3` is no conv-add: its residual must be a graph value
            getter = config._root_node_getter
            if getter is None:
                root = _default_root(nested)
            else:
                root = call_config_hook(config, "root_node_getter", getter, nested)
                if root not in flat:
                    raise ConfigError(
                        f"{config_owner(config)}.root_node_getter returned {describe(root)}; "
                        f"expected one of the nodes the pattern matched ({[n.name for n in flat]})"
                    )
            found = Match(config, nested, flat, root, node)
            for n in flat:
                matched[n] = found
            break
    return matched


def config_owner(config: Any) -> str:
    """How errors name a BackendPatternConfig: by its pattern, in the order the user
    wrote it (the complex format is reversed)."""
    return f"BackendPatternConfig({config.describe_pattern()})"


def call_config_hook(config: Any, field: str, function: Any, *args: Any) -> Any:
    """Call a BackendPatternConfig's ``field`` (a fuser method, a getter) on a match;
    what it raises becomes a ConfigError naming the config and the field."""
    try:
        return function(*args)
    except Exception as error:
        if type(error).__module__.startswith("qcore."):
            raise  # qcore's own fusers explain themselves (FusionError)
        raise ConfigError(
            f"{config_owner(config)}.{field} {describe(function)} raised "
            f"{type(error).__name__}: {error}"
        ) from error


def extra_inputs_of(config: Any, nested: Any) -> list[Any]:
    """What the config's extra_inputs_getter returns for a match, as a list."""
    extra = call_config_hook(config, "extra_inputs_getter", config._extra_inputs_getter, nested)
    if not isinstance(extra, (list, tuple)):
        raise ConfigError(
            f"{config_owner(config)}.extra_inputs_getter returned {describe(extra)}; expected a "
            "list of the pattern's extra inputs (nodes), empty if none"
        )
    return list(extra)
