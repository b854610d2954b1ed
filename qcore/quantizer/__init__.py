"""Layer 2, quantizer: the annotation API both front doors produce."""

from qcore.observers import ObserverOrFakeQuantize
from qcore.quantizer.embedding import EmbeddingQuantizer
from qcore.quantizer.quantizer import (
    ANNOTATION_KEY,
    AnnotationChange,
    ComposableQuantizer,
    QuantizationConfig,
    Quantizer,
)
from qcore.quantizer.spec import (
    DerivedQuantizationSpec,
    EdgeOrNode,
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    QuantizationSpecBase,
    SharedQuantizationSpec,
)

__all__ = [
    "ANNOTATION_KEY",
    "AnnotationChange",
    "ComposableQuantizer",
    "DerivedQuantizationSpec",
    "EdgeOrNode",
    "EmbeddingQuantizer",
    "FixedQParamsQuantizationSpec",
    "ObserverOrFakeQuantize",
    "QuantizationAnnotation",
    "QuantizationConfig",
    "QuantizationSpec",
    "QuantizationSpecBase",
    "Quantizer",
    "SharedQuantizationSpec",
]
