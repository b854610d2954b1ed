"""Quantizer: what a backend (or a user) says about a torch.export graph.

A :class:`Quantizer` writes :class:`QuantizationAnnotation` objects into
``node.meta["quantization_annotation"]`` (seed 004); ``qcore.prepare_pt2e``
then inserts observers where they say. :class:`ComposableQuantizer` runs
several quantizers in order and records which one changed whose annotation;
:class:`QuantizationConfig` bundles the specs of one quantization scheme.

Example::

    >>> class AddQuantizer(Quantizer):
    ...     def annotate(self, model):
    ...         for node in model.graph.nodes:
    ...             if node.target is torch.ops.aten.add.Tensor:
    ...                 a, b = node.args
    ...                 node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
    ...                     input_qspec_map={a: act, b: SharedQuantizationSpec((a, node))},
    ...                     output_qspec=act, _annotated=True)
    ...         return model
    >>> prepared = qcore.prepare_pt2e(exported.module(), AddQuantizer())
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule, Node

from qcore.config.errors import QCoreWarning, describe, invalid
from qcore.quantizer.spec import (
    EdgeOrNode,
    QuantizationAnnotation,
    QuantizationSpecBase,
)

__all__ = [
    "ANNOTATION_KEY",
    "AnnotationChange",
    "ComposableQuantizer",
    "QuantizationConfig",
    "Quantizer",
]

ANNOTATION_KEY = "quantization_annotation"


class Quantizer(ABC):
    """Annotates a torch.export graph for quantization.

    ``prepare_pt2e`` calls, in order: :meth:`transform_for_annotation`,
    :meth:`annotate`, :meth:`validate`, then inserts observers, calling
    :meth:`prepare_obs_or_fq_callback` with them before they are put in the graph.
    """

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        """Rewrite the graph before annotation (decompose, fold); default: as is."""
        return model

    @abstractmethod
    def annotate(self, model: GraphModule) -> GraphModule:
        """Write ``node.meta["quantization_annotation"]`` on the nodes to quantize."""

    def validate(self, model: GraphModule) -> None:
        """Raise if the annotated graph is not one this quantizer's backend can run."""
        return None

    def prepare_obs_or_fq_callback(
        self, model: GraphModule, edge_or_node_to_obs_or_fq: dict[EdgeOrNode, Any]
    ) -> None:
        """See, and optionally replace, the observer of each edge or node.

        Points that share qparams map to the same observer instance; to replace
        it, replace it for every point of the group.
        """
        return None


@dataclass(frozen=True)
class AnnotationChange:
    """A later quantizer of a ComposableQuantizer changed an annotation."""

    node: str
    quantizer: str
    """The quantizer that changed it."""
    annotated_by: str
    """The quantizer whose annotation was changed."""

    def __str__(self) -> str:
        return (
            f"{self.quantizer} changed the annotation of node {self.node!r} "
            f"made by {self.annotated_by}"
        )


def _snapshot(annotation: QuantizationAnnotation | None) -> Any:
    if annotation is None:
        return None
    inputs = tuple((arg, id(spec), spec) for arg, spec in annotation.input_qspec_map.items())
    output = annotation.output_qspec
    return (inputs, id(output), output, annotation.allow_implicit_sharing)


def _label(index: int, quantizer: Quantizer) -> str:
    return f"quantizers[{index}] ({type(quantizer).__name__})"


class ComposableQuantizer(Quantizer):
    """Runs ``quantizers`` in order; each sees the annotations of those before it.

    Whenever a quantizer changes an annotation an earlier one wrote, the change
    is recorded in :attr:`changes` and summed up in one warning (or raised, with
    ``strict=True``).

    Example::

        >>> composed = ComposableQuantizer([embedding_quantizer, x86_quantizer])
        >>> prepared = qcore.prepare_pt2e(model, composed)
        >>> composed.changes
        []
    """

    def __init__(self, quantizers: Sequence[Quantizer], *, strict: bool = False) -> None:
        quantizers = list(quantizers)
        for index, quantizer in enumerate(quantizers):
            if not isinstance(quantizer, Quantizer):
                raise invalid(
                    f"quantizers[{index}]",
                    quantizer,
                    "a qcore Quantizer (qcore.quantizer.EmbeddingQuantizer is torchao's "
                    "EmbeddingQuantizer; qcore.prepare_pt2e also takes a torchao Quantizer, "
                    "or torchao's ComposableQuantizer, alone)",
                )
        self.quantizers = quantizers
        self.strict = strict
        self.changes: list[AnnotationChange] = []

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        for quantizer in self.quantizers:
            model = quantizer.transform_for_annotation(model)
        return model

    def annotate(self, model: GraphModule) -> GraphModule:
        self.changes = []
        owner: dict[Node, tuple[str, Any]] = {
            node: ("an earlier pass", _snapshot(node.meta.get(ANNOTATION_KEY)))
            for node in model.graph.nodes
            if node.meta.get(ANNOTATION_KEY) is not None
        }
        for index, quantizer in enumerate(self.quantizers):
            label = _label(index, quantizer)
            model = quantizer.annotate(model)
            for node in model.graph.nodes:
                now = _snapshot(node.meta.get(ANNOTATION_KEY))
                before = owner.get(node)
                if before is not None and before[1] == now:
                    continue
                if before is not None:
                    self.changes.append(AnnotationChange(node.name, label, before[0]))
                if now is not None:
                    owner[node] = (label, now)
        if self.changes:
            message = "; ".join(str(change) for change in self.changes[:5])
            more = f" (and {len(self.changes) - 5} more)" if len(self.changes) > 5 else ""
            if self.strict:
                raise ValueError(f"ComposableQuantizer: {message}{more}")
            warnings.warn(
                f"ComposableQuantizer: {message}{more}; see .changes", QCoreWarning, stacklevel=2
            )
        return model

    def validate(self, model: GraphModule) -> None:
        for quantizer in self.quantizers:
            quantizer.validate(model)

    def prepare_obs_or_fq_callback(
        self, model: GraphModule, edge_or_node_to_obs_or_fq: dict[EdgeOrNode, Any]
    ) -> None:
        for quantizer in self.quantizers:
            quantizer.prepare_obs_or_fq_callback(model, edge_or_node_to_obs_or_fq)


def _check_spec(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, QuantizationSpecBase):
        raise invalid(f"QuantizationConfig.{name}", value, "a QuantizationSpec (any kind) or None")


@dataclass(frozen=True)
class QuantizationConfig:
    """The specs of one scheme: activations in and out, weight, bias.

    ``annotate_op`` writes them on one op, the common case of a quantizer::

        >>> config = QuantizationConfig(act, act, weight=per_channel_int8)
        >>> config.annotate_op(conv_node, activations=[x], weight=w)
    """

    input_activation: QuantizationSpecBase | None
    output_activation: QuantizationSpecBase | None
    weight: QuantizationSpecBase | None = None
    bias: QuantizationSpecBase | None = None
    is_qat: bool = False

    def __post_init__(self) -> None:
        for name in ("input_activation", "output_activation", "weight", "bias"):
            _check_spec(name, getattr(self, name))
        if not isinstance(self.is_qat, bool):
            raise invalid("QuantizationConfig.is_qat", self.is_qat, "a bool")

    def annotate_op(
        self,
        node: Node,
        activations: Sequence[Node] = (),
        weight: Node | None = None,
        bias: Node | None = None,
        *,
        output: bool = True,
    ) -> QuantizationAnnotation:
        """Annotate ``node``'s activation inputs, weight, bias and (optionally) output."""
        if not isinstance(node, Node):
            raise TypeError(f"node: got {describe(node)}; expected a torch.fx.Node")
        qspecs: dict[Node, QuantizationSpecBase | None] = {}
        for arg in activations:
            qspecs[arg] = self.input_activation
        if weight is not None:
            qspecs[weight] = self.weight
        if bias is not None:
            qspecs[bias] = self.bias
        annotation = QuantizationAnnotation(
            input_qspec_map={k: v for k, v in qspecs.items() if v is not None},
            output_qspec=self.output_activation if output else None,
            _annotated=True,
        )
        node.meta[ANNOTATION_KEY] = annotation
        return annotation
