"""EmbeddingQuantizer: weight-only int8 embeddings, as torchao's.

Each ``aten.embedding``'s weight is quantized per row to uint8 with float scale
and zero point (``per_channel_affine_float_qparams``, torchao's and torch.ao's
embedding recipe); the lookup's output stays float. Compose it with a quantizer
for the rest of the model, as torchao's tutorials do::

    >>> from qcore.quantizer import ComposableQuantizer, EmbeddingQuantizer
    >>> quantizer = ComposableQuantizer([EmbeddingQuantizer(), my_quantizer])
    >>> prepared = qcore.prepare_pt2e(exported, quantizer)
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from qcore.observers import PerChannelMinMaxObserver
from qcore.quantizer.quantizer import ANNOTATION_KEY, Quantizer
from qcore.quantizer.spec import QuantizationAnnotation, QuantizationSpec

__all__ = ["EMBEDDING_WEIGHT", "EmbeddingQuantizer"]

EMBEDDING_WEIGHT = QuantizationSpec(
    dtype=torch.uint8,
    qscheme=torch.per_channel_affine_float_qparams,
    ch_axis=0,
    observer_or_fake_quant_ctr=PerChannelMinMaxObserver.with_args(eps=2**-12),
)


class EmbeddingQuantizer(Quantizer):
    """Annotates every ``aten.embedding``'s weight with :data:`EMBEDDING_WEIGHT`."""

    def annotate(self, model: GraphModule) -> GraphModule:
        for node in model.graph.find_nodes(
            op="call_function", target=torch.ops.aten.embedding.default
        ):
            node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
                input_qspec_map={node.args[0]: EMBEDDING_WEIGHT}, _annotated=True
            )
        return model

    def validate(self, model: GraphModule) -> None:
        pass
