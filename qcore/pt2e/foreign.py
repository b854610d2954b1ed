"""torchao Quantizers on qcore's PT2E path, duck-typed (torchao is never imported here).

A torchao ``Quantizer`` (XNNPACKQuantizer, X86InductorQuantizer,
ComposableQuantizer, EmbeddingQuantizer, a user's own subclass) writes torchao's
QuantizationAnnotation and spec objects into ``node.meta["quantization_annotation"]``.
:class:`ForeignQuantizer` runs it as torchao's prepare does
(``transform_for_annotation``, ``annotate``, ``validate``, then the observer
callback); :func:`translate_annotation` turns what it wrote into qcore's frozen
spec classes, so the observers are inserted by the engine both front doors
share. :func:`observer_like_torchao` builds each group's observer the way
torchao does: the spec's constructor called with every setting of the spec.

Example::

    >>> from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer
    >>> prepared = qcore.prepare_pt2e(exported, XNNPACKQuantizer().set_global(config))
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from qcore.quantizer.quantizer import Quantizer
from qcore.quantizer.spec import (
    DerivedQuantizationSpec,
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    QuantizationSpecBase,
    SharedQuantizationSpec,
)

__all__ = [
    "ForeignQuantizer",
    "TensorKwargError",
    "check_no_tensor_kwargs",
    "is_foreign_quantizer",
    "observer_like_torchao",
    "translate_annotation",
]


class TensorKwargError(ValueError, AssertionError):
    """An annotated op takes a tensor as a keyword argument, which annotations cannot
    cover (torchao raises AssertionError here, so this is one too)."""


def is_foreign_quantizer(obj: Any) -> bool:
    """A quantizer object that is not qcore's: anything with an ``annotate`` method."""
    return not isinstance(obj, (str, Quantizer)) and callable(getattr(obj, "annotate", None))


def _returned(result: Any, model: GraphModule) -> GraphModule:
    # torchao's prepare ignores what annotate returns (many quantizers return None)
    return result if isinstance(result, GraphModule) else model


class ForeignQuantizer(Quantizer):
    """A torchao Quantizer (or any object with torchao's Quantizer methods) as a
    qcore Quantizer. Its annotations are torchao's; read them with
    :func:`translate_annotation`."""

    full_range = False  # torchao quantizes within the spec's own range

    def __init__(self, quantizer: Any) -> None:
        self.quantizer = quantizer
        self.name = type(quantizer).__name__

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        transform = getattr(self.quantizer, "transform_for_annotation", None)
        if transform is None:
            return model
        result = transform(model)
        if not isinstance(result, GraphModule):
            raise TypeError(
                f"{self.name}.transform_for_annotation returned {type(result).__name__}; "
                "expected the (transformed) torch.fx.GraphModule"
            )
        return result

    def annotate(self, model: GraphModule) -> GraphModule:
        return _returned(self.quantizer.annotate(model), model)

    def validate(self, model: GraphModule) -> None:
        validate = getattr(self.quantizer, "validate", None)
        if validate is not None:
            validate(model)

    def prepare_obs_or_fq_callback(self, model: GraphModule, edge_or_node_to_obs_or_fq) -> None:
        callback = getattr(self.quantizer, "prepare_obs_or_fq_callback", None)
        if callback is not None:
            callback(model, edge_or_node_to_obs_or_fq)


def _spec(spec: Any, memo: dict[int, Any]) -> QuantizationSpecBase | None:
    """qcore's spec for a torchao spec (told apart by their fields, as torchao's
    four classes have qcore's field names)."""
    if spec is None or isinstance(spec, QuantizationSpecBase):
        return spec
    if id(spec) in memo:  # one instance annotated in many places stays one spec
        return memo[id(spec)][1]
    if hasattr(spec, "edge_or_node"):
        ours: QuantizationSpecBase = SharedQuantizationSpec(spec.edge_or_node)
    elif hasattr(spec, "derive_qparams_fn"):
        ours = DerivedQuantizationSpec(
            derived_from=list(spec.derived_from),
            derive_qparams_fn=spec.derive_qparams_fn,
            dtype=spec.dtype,
            quant_min=spec.quant_min,
            quant_max=spec.quant_max,
            qscheme=spec.qscheme,
            ch_axis=spec.ch_axis,
            is_dynamic=bool(getattr(spec, "is_dynamic", False)),
        )
    elif hasattr(spec, "observer_or_fake_quant_ctr"):
        ours = QuantizationSpec(
            dtype=spec.dtype,
            observer_or_fake_quant_ctr=spec.observer_or_fake_quant_ctr,
            quant_min=spec.quant_min,
            quant_max=spec.quant_max,
            qscheme=spec.qscheme,
            ch_axis=spec.ch_axis,
            is_dynamic=bool(spec.is_dynamic),
        )
    elif hasattr(spec, "scale") and hasattr(spec, "zero_point"):
        ours = FixedQParamsQuantizationSpec(
            dtype=spec.dtype,
            scale=float(spec.scale),
            zero_point=int(spec.zero_point),
            quant_min=spec.quant_min,
            quant_max=spec.quant_max,
            qscheme=spec.qscheme,
            is_dynamic=bool(getattr(spec, "is_dynamic", False)),
        )
    else:
        raise TypeError(
            f"quantization spec: got {type(spec).__name__}; expected a QuantizationSpec, "
            "SharedQuantizationSpec, FixedQParamsQuantizationSpec or DerivedQuantizationSpec"
        )
    memo[id(spec)] = (spec, ours)  # keeps ``spec`` alive so its id is not reused
    return ours


def translate_annotation(annotation: Any, memo: dict[int, Any]) -> QuantizationAnnotation:
    """qcore's QuantizationAnnotation for torchao's (``memo`` maps spec ids across nodes)."""
    inputs = getattr(annotation, "input_qspec_map", None)
    if not isinstance(inputs, dict):
        raise TypeError(
            f"annotation: got {type(annotation).__name__}; expected a QuantizationAnnotation "
            "(with an input_qspec_map dict)"
        )
    return QuantizationAnnotation(
        input_qspec_map={arg: _spec(spec, memo) for arg, spec in inputs.items()},
        output_qspec=_spec(getattr(annotation, "output_qspec", None), memo),
        allow_implicit_sharing=bool(getattr(annotation, "allow_implicit_sharing", True)),
        _annotated=bool(getattr(annotation, "_annotated", False)),
    )


def check_no_tensor_kwargs(annotations: dict[Node, QuantizationAnnotation]) -> None:
    """A tensor passed by keyword to an annotated op would silently stay float."""

    def check(node: Node, name: str, value: Any) -> None:
        if isinstance(value, Node):
            raise TensorKwargError(
                f"node {node.name!r}: keyword argument {name!r} is a tensor ({value.name!r}); "
                "annotations cover positional inputs only, so it would stay in float"
            )
        if isinstance(value, (list, tuple)):
            for item in value:
                check(node, name, item)
        elif isinstance(value, dict):
            for item in value.values():
                check(node, name, item)

    for node in annotations:
        for name, value in node.kwargs.items():
            check(node, name, value)


def _observer_class(ctr: Any) -> Any:
    """The class a constructor builds, through with_args/functools.partial wrappers."""
    seen = 0
    while not isinstance(ctr, type) and seen < 8:
        inner = getattr(ctr, "p", None)  # torchao's and torch.ao's PartialWrapper
        ctr = getattr(inner if inner is not None else ctr, "func", None)
        seen += 1
    return ctr


def observer_like_torchao(spec: QuantizationSpecBase, is_qat: bool) -> torch.nn.Module:
    """The observer torchao's prepare builds for ``spec``: the spec's constructor with
    dtype, range, qscheme and is_dynamic (``ch_axis`` only for per-channel classes,
    which alone take it); fixed qparams as a FixedQParams observer (a fake-quant for QAT)."""
    if isinstance(spec, FixedQParamsQuantizationSpec):
        from qcore.observers import FixedQParamsFakeQuantize, FixedQParamsObserver

        kwargs = {
            "scale": spec.scale,
            "zero_point": spec.zero_point,
            "dtype": spec.dtype,
            "qscheme": spec.qscheme or torch.per_tensor_affine,
        }
        if spec.quant_min is not None:
            kwargs.update(quant_min=spec.quant_min, quant_max=spec.quant_max)
        if is_qat:
            return FixedQParamsFakeQuantize(observer=FixedQParamsObserver.with_args(**kwargs))
        return FixedQParamsObserver(**kwargs)
    if not isinstance(spec, QuantizationSpec):
        raise TypeError(f"cannot build an observer for {type(spec).__name__}")
    kwargs = {
        "dtype": spec.dtype,
        "quant_min": spec.quant_min,
        "quant_max": spec.quant_max,
        "qscheme": spec.qscheme,
        "is_dynamic": spec.is_dynamic,
    }
    if "PerChannel" in getattr(_observer_class(spec.observer_or_fake_quant_ctr), "__name__", ""):
        kwargs["ch_axis"] = spec.ch_axis
    return spec.observer_or_fake_quant_ctr(**kwargs)
