"""What the PT2E path accepts: torch.export graphs and annotations on them.

Every error names the node it is about.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.config.errors import describe
from qcore.engine.observe import SharingError
from qcore.quantizer.quantizer import ANNOTATION_KEY
from qcore.quantizer.spec import (
    DerivedQuantizationSpec,
    QuantizationAnnotation,
    SharedQuantizationSpec,
)

__all__ = [
    "AnnotationError",
    "annotations_of",
    "as_exported_module",
    "carries_values",
    "is_tensor_node",
    "refuse_train_eval",
]


class AnnotationError(ValueError):
    """An annotation refers to something that is not an edge or node of the graph."""


_EXPORT_HINT = "expected the module of torch.export.export(model, example_inputs).module()"


def _is_export_guard(gm: GraphModule, node: Node) -> bool:
    """torch.export's module() checks its input shapes in one call_module node."""
    return type(gm.get_submodule(node.target)).__name__ == "GuardsFn"


def _unlifted_without_value(node: Node) -> bool:
    """Nodes a valid exported module has without meta['val']: ops returning nothing
    (``aten._assert_tensor_metadata``, which run_decompositions leaves) and the
    ``copy_`` that ``ExportedProgram.module()`` writes back into a mutated buffer or
    parameter with."""
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    written_back = node.target is torch.ops.aten.copy_.default and not node.users
    return written_back or (schema is not None and not schema.returns)


def as_exported_module(model: Any, *, require_export: bool = True) -> GraphModule:
    """The GraphModule of an ExportedProgram, or ``model`` if it is one already.

    Raises TypeError for anything else, naming the first node that shows the
    graph was not produced by torch.export. ``require_export=False`` takes any
    GraphModule (a torchao Quantizer's annotations say everything itself, and
    torchao's prepare takes such graphs).
    """
    if isinstance(model, torch.export.ExportedProgram):
        return model.module()
    if not isinstance(model, GraphModule):
        raise TypeError(f"model: got {describe(model)}; {_EXPORT_HINT}")
    if not require_export:
        return model
    for node in model.graph.nodes:
        if node.op == "call_module" and not _is_export_guard(model, node):
            raise TypeError(
                f"model: node {node.name!r} calls module {node.target!r}, which graphs from "
                f"torch.export never do (a torch.fx.symbolic_trace graph?); {_EXPORT_HINT}"
            )
    for node in model.graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            if _unlifted_without_value(node):
                continue
            raise TypeError(
                f"model: node {node.name!r} ({node.op}) has no meta['val'], which "
                f"torch.export records on every node; {_EXPORT_HINT}"
            )
    return model


_TRAIN_EVAL_HINT = (
    "is not supported on a model from torch.export: it would not switch the batch norms "
    "and dropouts the graph runs (their mode is part of the graph). qcore.convert_pt2e "
    "switches them to eval; qcore.pt2e.move_exported_model_to_eval and "
    "move_exported_model_to_train switch them by hand"
)


def _refuse_train(self: Any, mode: bool = True) -> Any:
    raise NotImplementedError(f"Calling train() {_TRAIN_EVAL_HINT}")


def _refuse_eval(self: Any) -> Any:
    raise NotImplementedError(f"Calling eval() {_TRAIN_EVAL_HINT}")


def refuse_train_eval(gm: GraphModule) -> GraphModule:
    """Make ``gm.train()``/``gm.eval()`` raise NotImplementedError, as on the module
    torch.export returns (and torchao's prepared models).

    Set on the graph module's own class (torch.fx makes one per instance), not as
    instance attributes, so the model still pickles; after torch.load, or a deep
    copy, the methods work again (as they do on a deep copy of export's module).
    """
    cls = type(gm)
    if cls is not GraphModule:  # never patch the shared base class
        cls.train = _refuse_train
        cls.eval = _refuse_eval
    return gm


def is_tensor_node(node: Any) -> bool:
    """Whether ``node`` produces one floating-point tensor (something to quantize)."""
    if not isinstance(node, Node):
        return False
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def carries_values(node: Any) -> bool:
    """Whether ``node``'s value is a tensor of any dtype (integer indices too) or a
    tuple or list holding one: not a size or another Python value."""
    if not isinstance(node, Node):
        return False
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return any(isinstance(item, torch.Tensor) for item in value)
    return isinstance(value, torch.Tensor)


def _flat_args(node: Node) -> set[Node]:
    found: set[Node] = set()
    for arg in (*node.args, *node.kwargs.values()):
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        found.update(item for item in items if isinstance(item, Node))
    return found


def _check_point(where: str, point: Any, nodes: set[Node]) -> None:
    if isinstance(point, Node):
        if point not in nodes:
            raise AnnotationError(f"{where} refers to node {point.name!r}, not in this graph")
        return
    producer, consumer = point
    for node in (producer, consumer):
        if node not in nodes:
            raise AnnotationError(f"{where} refers to node {node.name!r}, not in this graph")
    if producer not in _flat_args(consumer):
        raise AnnotationError(
            f"{where} refers to the edge ({producer.name!r}, {consumer.name!r}), but "
            f"{producer.name!r} is not an input of {consumer.name!r}"
        )


def _tensor_dtype(point: Any) -> Any:
    node = point[0] if isinstance(point, tuple) else point
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def _check_spec(where: str, spec: Any, nodes: set[Node], point: Any = None) -> None:
    if isinstance(spec, SharedQuantizationSpec):
        _check_point(f"{where}: SharedQuantizationSpec", spec.edge_or_node, nodes)
        mine, theirs = _tensor_dtype(point), _tensor_dtype(spec.edge_or_node)
        if point is not None and mine is not None and theirs is not None and mine != theirs:
            target = spec.edge_or_node
            name = (
                target.name if isinstance(target, Node) else f"{target[0].name}->{target[1].name}"
            )
            raise SharingError(
                f"{where}: SharedQuantizationSpec shares qparams of a {mine} tensor with "
                f"{name!r}, a {theirs} tensor; sharing needs tensors of one dtype"
            )
    elif isinstance(spec, DerivedQuantizationSpec):
        for index, point in enumerate(spec.derived_from):
            _check_point(f"{where}: DerivedQuantizationSpec.derived_from[{index}]", point, nodes)


def annotations_of(gm: GraphModule, *, foreign: bool = False) -> dict[Node, QuantizationAnnotation]:
    """The annotations on ``gm``'s nodes, each checked against the graph.

    ``foreign=True`` reads torchao's annotation classes too, translated into
    qcore's (the node's meta keeps torchao's objects).
    """
    nodes = set(gm.graph.nodes)
    found: dict[Node, QuantizationAnnotation] = {}
    memo: dict[int, Any] = {}
    for node in gm.graph.nodes:
        annotation = node.meta.get(ANNOTATION_KEY)
        if annotation is None:
            continue
        where = f"annotation of node {node.name!r}"
        if foreign and not isinstance(annotation, QuantizationAnnotation):
            from qcore.pt2e.foreign import translate_annotation

            annotation = translate_annotation(annotation, memo)
        if not isinstance(annotation, QuantizationAnnotation):
            raise AnnotationError(
                f"{where}: got {describe(annotation)}; expected a qcore QuantizationAnnotation"
            )
        inputs = _flat_args(node)
        for arg, spec in annotation.input_qspec_map.items():
            if not isinstance(arg, Node) or arg not in nodes:
                name = arg.name if isinstance(arg, Node) else describe(arg)
                raise AnnotationError(
                    f"{where}: input_qspec_map key {name!r} is not a node of this graph"
                )
            if arg not in inputs:
                raise AnnotationError(
                    f"{where}: input_qspec_map key {arg.name!r} is not an input of "
                    f"{node.name!r} (its inputs: {sorted(n.name for n in inputs)})"
                )
            _check_spec(f"{where}, input {arg.name!r}", spec, nodes, (arg, node))
        _check_spec(f"{where}, output", annotation.output_qspec, nodes, node)
        found[node] = annotation
    return found
