"""Observer insertion from annotations: the part both front doors share.

Every annotated node output and input edge is an *observation point*. Points
that must share qparams are united (union-find): explicitly through
SharedQuantizationSpec, implicitly when an edge's spec equals its producer's
output spec, and when edges from one producer carry equal specs. Each group
gets one observer, inserted once in the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.quantizer.spec import (
    DerivedQuantizationSpec,
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    QuantizationSpecBase,
    SharedQuantizationSpec,
)

__all__ = ["DerivedObserver", "ObserverPlan", "SharingError", "insert_observers", "OBSERVER_PREFIX"]

OBSERVER_PREFIX = "activation_post_process_"

Point = Node | tuple[Node, Node]


class SharingError(ValueError):
    """Points that must share one observer disagree on dtype or range."""


class DerivedObserver(torch.nn.Module):
    """Observes nothing; its qparams are derived from other observers at convert."""

    def __init__(self, spec: DerivedQuantizationSpec, sources: list[str]) -> None:
        super().__init__()
        self.spec = spec
        self.sources = sources
        self.dtype = spec.dtype
        self.quant_min, self.quant_max = spec.quant_min, spec.quant_max
        self.qscheme = spec.qscheme
        self.ch_axis = spec.ch_axis
        self.is_dynamic = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def derive(self, root: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        observers = [root.get_submodule(name) for name in self.sources]
        return self.spec.derive_qparams_fn(observers)


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}

    def find(self, item: Any) -> Any:
        self.parent.setdefault(item, item)
        while self.parent[item] != item:
            self.parent[item] = self.parent[self.parent[item]]
            item = self.parent[item]
        return item

    def union(self, a: Any, b: Any) -> None:
        root_a, root_b = self.find(a), self.find(b)
        if root_a != root_b:
            self.parent[root_b] = root_a


def _describe_point(point: Point) -> str:
    if isinstance(point, tuple):
        return f"input {point[0].name!r} of {point[1].name!r}"
    return f"output of {point.name!r}"


@dataclass
class ObserverPlan:
    """Which observer module serves each point, after insertion."""

    observer_of_point: dict[Point, str] = field(default_factory=dict)
    points_of_observer: dict[str, list[Point]] = field(default_factory=dict)


def _make_observer(spec: QuantizationSpecBase, make_fixed: Callable) -> torch.nn.Module:
    if isinstance(spec, FixedQParamsQuantizationSpec):
        return make_fixed(spec)
    assert isinstance(spec, QuantizationSpec)
    kwargs: dict[str, Any] = {"dtype": spec.dtype}
    if spec.quant_min is not None:
        kwargs.update(quant_min=spec.quant_min, quant_max=spec.quant_max)
    if spec.qscheme is not None:
        kwargs["qscheme"] = spec.qscheme
    if spec.ch_axis is not None:
        kwargs["ch_axis"] = spec.ch_axis
    if spec.is_dynamic:
        kwargs["is_dynamic"] = True
    try:
        return spec.observer_or_fake_quant_ctr(**kwargs)
    except TypeError:
        # A constructor whose arguments are already bound (with_args) or that
        # takes fewer keywords: it knows its own settings.
        return spec.observer_or_fake_quant_ctr()


def _comparable(spec: QuantizationSpecBase) -> tuple:
    return (
        getattr(spec, "dtype", None),
        getattr(spec, "quant_min", None),
        getattr(spec, "quant_max", None),
        getattr(spec, "is_dynamic", False),
    )


def _resolve_shared(spec: Any, specs: dict) -> Any:
    """The spec a SharedQuantizationSpec chain ends at (None for a cycle)."""
    seen = set()
    while isinstance(spec, SharedQuantizationSpec):
        if id(spec) in seen:
            return None
        seen.add(id(spec))
        spec = specs.get(spec.edge_or_node)
    return spec


def insert_observers(
    gm: GraphModule,
    annotations: dict[Node, QuantizationAnnotation],
    make_fixed: Callable[[FixedQParamsQuantizationSpec], torch.nn.Module],
    order: Iterable[Node] | None = None,
) -> ObserverPlan:
    """Insert one observer per sharing group; returns which observer serves which point."""
    specs: dict[Point, QuantizationSpecBase] = {}
    graph_nodes = set(gm.graph.nodes)
    for node, annotation in annotations.items():
        for arg, spec in annotation.input_qspec_map.items():
            if spec is not None:
                if arg not in graph_nodes:
                    raise ValueError(
                        f"annotation of node {node.name!r}: input {arg!r} is not in this graph"
                    )
                specs[(arg, node)] = spec
        if annotation.output_qspec is not None:
            specs[node] = annotation.output_qspec

    groups = _UnionFind()
    for point, spec in specs.items():
        groups.find(point)
        if isinstance(spec, SharedQuantizationSpec):
            target = spec.edge_or_node
            if target not in specs:
                raise ValueError(
                    f"SharedQuantizationSpec on the {_describe_point(point)} refers to the "
                    f"{_describe_point(target)}, which has no annotation"
                )
            groups.union(target, point)
    by_producer: dict[tuple[Node, tuple], Point] = {}
    for point, spec in specs.items():
        # An edge sharing with another point compares by that point's spec
        # (seed 004's cat: the second input, shared with the first, also shares
        # with its own producer, so both producers end up in one group).
        spec = _resolve_shared(spec, specs)
        if not isinstance(point, tuple) or not isinstance(spec, QuantizationSpec):
            continue
        producer = point[0]
        allow = annotations[point[1]].allow_implicit_sharing
        if allow and _resolve_shared(specs.get(producer), specs) == spec:
            groups.union(producer, point)
        elif allow:
            key = (producer, _comparable(spec) + (spec.observer_or_fake_quant_ctr,))
            if key in by_producer:
                groups.union(by_producer[key], point)
            else:
                by_producer[key] = point

    members: dict[Any, list[Point]] = {}
    for point in specs:
        members.setdefault(groups.find(point), []).append(point)

    plan = ObserverPlan()
    derived: list[tuple[str, DerivedQuantizationSpec]] = []
    position = {node: index for index, node in enumerate(order or gm.graph.nodes)}
    for index, group in enumerate(members.values()):
        owners = [p for p in group if not isinstance(specs[p], SharedQuantizationSpec)]
        if not owners:
            raise SharingError(
                "a sharing group refers only to itself: "
                + ", ".join(_describe_point(p) for p in group)
            )
        first = owners[0]
        for other in owners[1:]:
            if _comparable(specs[other]) != _comparable(specs[first]):
                raise SharingError(
                    f"the {_describe_point(first)} and the {_describe_point(other)} must share "
                    f"qparams but are annotated with incompatible specs "
                    f"({_comparable(specs[first])} vs {_comparable(specs[other])}: dtype, "
                    "quant_min, quant_max, is_dynamic)"
                )
        name = f"{OBSERVER_PREFIX}{index}"
        spec = specs[first]
        if isinstance(spec, DerivedQuantizationSpec):
            derived.append((name, spec))
            observer: torch.nn.Module = torch.nn.Identity()  # replaced below
        else:
            observer = _make_observer(spec, make_fixed)
        setattr(gm, name, observer)
        plan.points_of_observer[name] = group
        for point in group:
            plan.observer_of_point[point] = name

    for name, spec in derived:
        sources = []
        for source in spec.derived_from:
            if source not in plan.observer_of_point:
                raise ValueError(
                    f"DerivedQuantizationSpec derives from the {_describe_point(source)}, "
                    "which has no annotation"
                )
            sources.append(plan.observer_of_point[source])
        setattr(gm, name, DerivedObserver(spec, sources))

    _rewire(gm, plan, position)
    gm.recompile()
    return plan


def _rewire(gm: GraphModule, plan: ObserverPlan, position: dict[Node, int]) -> None:
    """Put each observer in the graph: after its producer, feeding the right users."""
    graph = gm.graph
    inserted: dict[tuple[str, Node], Node] = {}

    def observed(name: str, producer: Node) -> Node:
        key = (name, producer)
        if key not in inserted:
            with graph.inserting_after(producer):
                inserted[key] = graph.call_module(name, (producer,))
        return inserted[key]

    edge_users: dict[Node, set[Node]] = {}  # producer -> users with an edge observer
    for point in plan.observer_of_point:
        if isinstance(point, tuple):
            edge_users.setdefault(point[0], set()).add(point[1])
    # Node outputs first: their observer replaces the producer for every user
    # that has no edge observer of its own.
    for point, name in plan.observer_of_point.items():
        if isinstance(point, Node):
            obs_node = observed(name, point)
            for user in list(point.users):
                if user is not obs_node and user not in edge_users.get(point, ()):
                    user.replace_input_with(point, obs_node)
    for point, name in plan.observer_of_point.items():
        if isinstance(point, tuple):
            producer, user = point
            obs_node = observed(name, producer)
            if obs_node is not user:
                user.replace_input_with(producer, obs_node)
