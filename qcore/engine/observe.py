"""Observer insertion from annotations: the part both front doors share.

Every annotated node output and input edge is an *observation point*. Points
that must share qparams are united (union-find, with torchao's semantics):
explicitly through SharedQuantizationSpec; implicitly when an edge's spec is
the same quantization as its producer's output or another edge from that
producer (they carry one tensor). Each group gets one observer; the graph calls
it after the producer, an edge of another group chained after the producer's
output observer, as torchao's and torch.ao's prepare do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from qcore.config.errors import describe
from qcore.observers.substitute import fast_constructor
from qcore.quantizer.spec import (
    DerivedQuantizationSpec,
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    QuantizationSpecBase,
    SharedQuantizationSpec,
)

__all__ = [
    "DerivedObserver",
    "ObserverPlan",
    "SharingError",
    "insert_observers",
    "name_observers_per_call",
    "OBSERVER_PREFIX",
]

OBSERVER_PREFIX = "activation_post_process_"

Point = Node | tuple[Node, Node]


class SharingError(ValueError):
    """Points that must share one observer disagree on dtype or range."""


class DerivedObserver(torch.nn.Module):
    """Observes nothing; its qparams are derived from other observers at convert."""

    def __init__(self, spec: DerivedQuantizationSpec, sources: list[str]) -> None:
        super().__init__()
        # Not the spec: its derived_from holds nodes of the annotated graph, which
        # every copy of the prepared model (convert's among them) would copy too.
        self.derive_qparams_fn = spec.derive_qparams_fn
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
        return self.derive_qparams_fn(observers)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The derived qparams, for a derivation that reads this observer in turn
        (``x * 0.5`` of a derived ``x``): the sources are held since insertion."""
        return self.derive_qparams_fn(self.source_observers)


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


def _make_observer(spec: QuantizationSpecBase, make_fixed: Callable, where: str) -> torch.nn.Module:
    if isinstance(spec, FixedQParamsQuantizationSpec):
        return make_fixed(spec)
    if not isinstance(spec, QuantizationSpec):  # an annotation changed after it was built
        raise TypeError(
            f"the annotation of the {where}: got {describe(spec)}; expected a QuantizationSpec, "
            "SharedQuantizationSpec, FixedQParamsQuantizationSpec or DerivedQuantizationSpec"
        )
    observer = _build(spec)
    if not (isinstance(observer, torch.nn.Module) and hasattr(observer, "calculate_qparams")):
        raise TypeError(
            f"the annotation of the {where}: its observer_or_fake_quant_ctr "
            f"{describe(spec.observer_or_fake_quant_ctr)} made {describe(observer)}; expected "
            "an observer or fake quant (a module with calculate_qparams, such as MinMaxObserver)"
        )
    return observer


def _build(spec: QuantizationSpec) -> Any:
    kwargs: dict[str, Any] = {"dtype": spec.dtype}
    if spec.quant_min is not None:
        kwargs.update(quant_min=spec.quant_min, quant_max=spec.quant_max)
    if spec.qscheme is not None:
        kwargs["qscheme"] = spec.qscheme
    if spec.ch_axis is not None and _builds_per_channel(spec.observer_or_fake_quant_ctr):
        # torchao passes ch_axis only to per-channel observers: a per-tensor
        # weight spec may name one (the tutorial's: ch_axis=0)
        kwargs["ch_axis"] = spec.ch_axis
    if spec.is_dynamic:
        kwargs["is_dynamic"] = True
    # torch.ao's HistogramObserver (a porting user's mapping) is built as qcore's:
    # same arguments and qparams, a vectorized search (qcore.observers.substitute)
    ctr = fast_constructor(spec.observer_or_fake_quant_ctr)
    try:
        return ctr(**kwargs)
    except TypeError:
        # A constructor whose arguments are already bound (with_args) or that
        # takes fewer keywords: it knows its own settings, which must be the spec's.
        observer = ctr()
    _check_matches_spec(observer, spec)
    return observer


def _builds_per_channel(ctr: Any) -> bool:
    """Whether ``ctr`` builds a per-channel observer, or a fake quant around one:
    torchao's test, on the name of the class built."""
    partial = getattr(ctr, "p", ctr)  # with_args' wrapper holds a functools.partial
    observer = (getattr(partial, "keywords", None) or {}).get("observer")
    return any("PerChannel" in _built_class_name(c) for c in (ctr, observer) if c is not None)


def _built_class_name(ctr: Any) -> str:
    partial = getattr(ctr, "p", ctr)
    return getattr(getattr(partial, "func", partial), "__name__", "")


def _check_matches_spec(observer: Any, spec: QuantizationSpec) -> None:
    """A constructor that would not take the spec's settings must have built them:
    otherwise the spec's dtype or range was silently lost."""
    for field_name in ("dtype", "qscheme", "quant_min", "quant_max"):
        wanted = getattr(spec, field_name)
        built = getattr(observer, field_name, wanted)
        if wanted is not None and built != wanted:
            raise TypeError(
                f"QuantizationSpec.{field_name} is {wanted}, but its observer_or_fake_quant_ctr "
                f"{describe(spec.observer_or_fake_quant_ctr)} would not take the spec's "
                f"settings as keywords and built {field_name}={built}; bind them with "
                "with_args(...) or accept dtype, qscheme, quant_min and quant_max"
            )


# What makes two specs describe the same quantization (torchao's implicit-sharing
# test): these attributes, equal where both specs have them, absent from both otherwise.
_SHARING_ATTRS = (
    "dtype",
    "is_dynamic",
    "quant_min",
    "quant_max",
    "qscheme",
    "ch_axis",
    "scale",
    "zero_point",
)
_ABSENT = object()


def _comparable(spec: QuantizationSpecBase) -> tuple:
    return (
        getattr(spec, "dtype", None),
        getattr(spec, "quant_min", None),
        getattr(spec, "quant_max", None),
        getattr(spec, "is_dynamic", False),
    )


def _same_quantization(a: Any, b: Any) -> bool:
    """Whether tensors annotated with ``a`` and ``b`` can share one observer.

    A spec that leaves its range to the observer (quant_min unset, as the specs
    compiled from a QConfig do) is the same only with the same constructor:
    ``reduce_range`` lives there.
    """
    if a is None or b is None:
        return False
    for attr in _SHARING_ATTRS:
        if getattr(a, attr, _ABSENT) != getattr(b, attr, _ABSENT):
            return False
    if isinstance(a, QuantizationSpec) and a.quant_min is None:
        return isinstance(b, QuantizationSpec) and (
            a.observer_or_fake_quant_ctr == b.observer_or_fake_quant_ctr
        )
    return True


class _Sharing:
    """Union-find over observation points, as torchao's prepare builds it.

    Union is directional (the child's root points at the parent's root) except
    where the parent's root already shares with the child's root: pointing back
    would close a cycle, so the edge is reversed.
    """

    def __init__(self, specs: dict[Point, QuantizationSpecBase]) -> None:
        self.specs = specs
        self.parent: dict[Point, Point] = {point: point for point in specs}

    def find(self, point: Point) -> Point:
        root = point
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[point] != root:  # path compression
            self.parent[point], point = root, self.parent[point]
        return root

    def union(self, parent: Point, child: Point) -> None:
        root_parent, root_child = self.find(parent), self.find(child)
        if root_parent == root_child:
            return
        spec = self.specs[root_parent]
        if isinstance(spec, SharedQuantizationSpec) and spec.edge_or_node == root_child:
            self.parent[root_parent] = root_child
        else:
            self.parent[root_child] = root_parent

    def resolve(self, spec: Any) -> Any:
        """The spec a SharedQuantizationSpec chain ends at (None for a cycle)."""
        seen: set[Point] = set()
        while isinstance(spec, SharedQuantizationSpec):
            root = self.find(spec.edge_or_node)
            if root in seen:
                return None
            seen.add(root)
            spec = self.specs[root]
        return spec


def _group(
    specs: dict[Point, QuantizationSpecBase], annotations: dict[Node, QuantizationAnnotation]
) -> dict[Point, list[Point]]:
    """Sharing groups (root -> members, in annotation order).

    Explicit sharing (SharedQuantizationSpec) unites a point with its target.
    Implicit sharing unites an input edge with the producer's other annotated
    edges and with the producer's output when their specs resolve to the same
    quantization (they carry one tensor), unless the consumer's annotation sets
    ``allow_implicit_sharing=False``. Edges are united with other users first,
    then with the producer: the other order can close a cycle.
    """
    sharing = _Sharing(specs)
    for point, spec in specs.items():
        if isinstance(point, tuple):
            producer, consumer = point
            if annotations[consumer].allow_implicit_sharing:
                mine = sharing.resolve(spec)
                others = [(producer, user) for user in producer.users if user is not consumer]
                for other in [*others, producer]:
                    if other in specs and _same_quantization(sharing.resolve(specs[other]), mine):
                        sharing.union(other, point)
        if isinstance(spec, SharedQuantizationSpec):
            sharing.union(spec.edge_or_node, point)
    members: dict[Point, list[Point]] = {}
    for point in specs:
        members.setdefault(sharing.find(point), []).append(point)
    return members


def insert_observers(
    gm: GraphModule,
    annotations: dict[Node, QuantizationAnnotation],
    make_fixed: Callable[[FixedQParamsQuantizationSpec], torch.nn.Module],
    order: Iterable[Node] | None = None,
    *,
    make_observer: Callable[[QuantizationSpecBase], torch.nn.Module] | None = None,
    observe_edge: Callable[[Node, Node], bool] | None = None,
    observe_output: Callable[[Node], bool] | None = None,
    before_rewire: Callable[[ObserverPlan], None] | None = None,
    recompile: bool = True,
) -> ObserverPlan:
    """Insert one observer per sharing group; returns which observer serves which point.

    ``make_observer`` builds a group's observer from its spec (default: the
    spec's constructor with the spec's settings; ``make_fixed`` for fixed
    qparams). ``observe_edge(producer, consumer)`` and ``observe_output(node)``
    may leave a point's observer out of the graph (it still decides sharing):
    the PT2E path leaves out the destination of an in-place op on a buffer, and
    outputs that are not tensors. ``before_rewire(plan)`` runs once the observers
    are attributes of ``gm`` and before the graph calls them (a quantizer's
    callback may replace them there, as torchao's prepare lets it). ``recompile=False``
    leaves regenerating ``gm``'s code to a caller that rewrites the graph again.
    """
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

    for point, spec in specs.items():
        if isinstance(spec, SharedQuantizationSpec) and spec.edge_or_node not in specs:
            raise ValueError(
                f"SharedQuantizationSpec on the {_describe_point(point)} refers to the "
                f"{_describe_point(spec.edge_or_node)}, which has no annotation"
            )
    members = _group(specs, annotations)

    plan = ObserverPlan()
    derived: list[tuple[str, DerivedQuantizationSpec]] = []
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
        elif make_observer is not None:
            observer = make_observer(spec)
        else:
            observer = _make_observer(spec, make_fixed, _describe_point(first))
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
    for name, _ in derived:  # every derived observer exists now: link their sources
        observer = gm.get_submodule(name)
        # A plain list, not submodules: the observers stay owned by the graph module.
        observer.__dict__["source_observers"] = [gm.get_submodule(n) for n in observer.sources]

    if before_rewire is not None:
        before_rewire(plan)
    _rewire(gm, plan, observe_edge, observe_output)
    if recompile:
        gm.recompile()
    return plan


def _rewire(
    gm: GraphModule,
    plan: ObserverPlan,
    observe_edge: Callable[[Node, Node], bool] | None,
    observe_output: Callable[[Node], bool] | None,
) -> None:
    """Put the observers in the graph, node by node in graph order (as torchao does).

    A node's output observer feeds every user. An input edge whose group differs
    from its producer's output observer gets its own call, chained after that
    observer (the consumer sees the value quantized twice, as in torchao and
    torch.ao); users sharing an edge observer share one call.
    """
    graph = gm.graph
    names = set(plan.points_of_observer)

    def is_observer(node: Any) -> bool:
        return isinstance(node, Node) and node.op == "call_module" and node.target in names

    def call(name: str, after: Node) -> Node:
        with graph.inserting_after(after):
            observer = graph.call_module(name, (after,))
        if "val" in after.meta:  # graph passes (and torchao's tests) expect meta everywhere
            observer.meta["val"] = after.meta["val"]
        return observer

    edges: dict[Node, dict[Node, str]] = {}
    for point, name in plan.observer_of_point.items():
        if isinstance(point, tuple):
            edges.setdefault(point[1], {})[point[0]] = name

    for node in list(graph.nodes):
        own = edges.get(node)
        if own:

            def observed(arg: Node, node: Node = node, own: dict = own) -> Node:
                producer = arg
                while is_observer(producer):
                    producer = producer.args[0]
                name = own.get(producer)
                if name is None or (observe_edge is not None and not observe_edge(producer, node)):
                    return arg
                if plan.observer_of_point.get(producer) == name:
                    return arg  # the producer's output observer is this edge's too
                for user in arg.users:
                    if is_observer(user) and user.target == name:
                        return user
                return call(name, arg)

            node.args = map_arg(node.args, observed)
            node.kwargs = map_arg(node.kwargs, observed)
        name = plan.observer_of_point.get(node)
        if name is not None and (observe_output is None or observe_output(node)):
            observer = call(name, node)
            for user in list(node.users):
                if user is not observer:
                    user.replace_input_with(node, observer)


def name_observers_per_call(gm: GraphModule, names: Iterable[str]) -> tuple[str, ...]:
    """Give each observer call its own attribute name, numbered in graph order, as
    torch.ao FX does: a shared observer is one instance under several names
    (``activation_post_process_0`` and ``_1`` for a pool's input and output), so a
    user's code that reads ``prepared.activation_post_process_N`` ports unchanged.
    Returns every observer name in use."""
    old_names = sorted(set(names))
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target in old_names]
    instances = {name: gm.get_submodule(name) for name in old_names}
    for name in old_names:
        delattr(gm, name)
    new_names = [f"{OBSERVER_PREFIX}{index}" for index in range(len(calls))]
    first_name: dict[str, str] = {}  # old name -> its first new name
    for node, new_name in zip(calls, new_names, strict=True):
        setattr(gm, new_name, instances[node.target])
        first_name.setdefault(node.target, new_name)
        node.target = new_name
    for name in old_names:  # an observer no call uses (a derived one's source) is kept
        if name not in first_name:
            first_name[name] = f"{OBSERVER_PREFIX}{len(new_names)}"
            new_names.append(first_name[name])
            setattr(gm, first_name[name], instances[name])
    for observer in instances.values():
        if isinstance(observer, DerivedObserver):
            observer.sources = [first_name[source] for source in observer.sources]
    gm.recompile()
    return tuple(new_names)
