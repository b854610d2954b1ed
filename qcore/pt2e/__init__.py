"""The PT2E front door: quantize torch.export graphs with a Quantizer or a backend name.

>>> exported = torch.export.export(model.eval(), example_inputs).module()
>>> prepared = qcore.prepare_pt2e(exported, "x86")
>>> for batch in calibration_data:
...     prepared(*batch)
>>> converted = qcore.convert_pt2e(prepared)
>>> print(qcore.explain(converted))

Or in one call, optionally keeping the fewest conv/linear modules float that meet
an accuracy budget (as ``qcore.quantize`` does on the FX path):

>>> quantized = qcore.quantize_pt2e(exported, "x86", calibration_data,
...                                 accuracy_budget=qcore.MinSQNR(db=30.0))

A Quantizer object, qcore's or torchao's, may stand in place of the backend name.
A Quantizer of one's own explains an op it leaves in float by setting
``node.meta[REASON_KEY]`` to the reason; ``qcore.explain`` shows it. Its
``transform_for_annotation`` may call :func:`canonicalize` to see string-padded
convs and ``addmm`` linears as the default conv and ``aten.linear`` (qcore's own
quantizers do; a Quantizer written for the exported graph as is does not).
"""

from qcore.pt2e.backend_quantizer import REASON_KEY, BackendQuantizer
from qcore.pt2e.canonical import canonicalize
from qcore.pt2e.convert import convert_pt2e
from qcore.pt2e.graph import AnnotationError
from qcore.pt2e.prepare import prepare_pt2e, prepare_qat_pt2e
from qcore.pt2e.quantize import quantize_pt2e
from qcore.pt2e.train_eval import move_exported_model_to_eval, move_exported_model_to_train

__all__ = [
    "AnnotationError",
    "BackendQuantizer",
    "REASON_KEY",
    "canonicalize",
    "convert_pt2e",
    "move_exported_model_to_eval",
    "move_exported_model_to_train",
    "prepare_pt2e",
    "prepare_qat_pt2e",
    "quantize_pt2e",
]
