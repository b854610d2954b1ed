"""The bundled models in PT2E reference form, for the export tests (torch.export, ONNX).

Each (model, backend) is prepared and calibrated once per test process: the
torch.export and ONNX tests of one environment share them.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers quantized_decomposed)

import qcore
from qcore.examples import EVAL_SEED, ZOO, export_batch_free

qd = torch.ops.quantized_decomposed
QUANTIZE_PER_TENSOR = (qd.quantize_per_tensor.default, qd.quantize_per_tensor.tensor)
QUANTIZES = (*QUANTIZE_PER_TENSOR, qd.quantize_per_channel.default)


@dataclass(frozen=True)
class Case:
    name: str
    backend: str
    float_model: torch.nn.Module
    reference: torch.fx.GraphModule  # qcore.convert_pt2e(prepared, lower=False)
    inputs: tuple  # held-out data (EVAL_SEED), a batch of the calibration size

    def last_step(self) -> float:
        """The scale of the graph's last activation quantization: the output's step."""
        quantizes = [
            n
            for n in self.reference.graph.nodes
            if n.op == "call_function" and n.target in QUANTIZE_PER_TENSOR
        ]
        return float(quantizes[-1].args[1])


@functools.cache
def _exported(name: str) -> tuple[torch.nn.Module, torch.fx.GraphModule]:
    """The float model and its export: prepare_pt2e copies it, so backends share it."""
    entry = ZOO[name]
    float_model = entry.make_model()
    return float_model, export_batch_free(float_model, entry.calibration_data(1)[0])


@functools.cache
def reference_case(name: str, backend: str) -> Case:
    entry = ZOO[name]
    batches = entry.calibration_data(2)
    float_model, exported = _exported(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        prepared = qcore.prepare_pt2e(exported, backend)
        with torch.no_grad():
            for batch in batches:
                prepared(*batch)
        reference = qcore.convert_pt2e(prepared, lower=False)
    (inputs,) = entry.calibration_data(1, seed=EVAL_SEED)
    return Case(name, backend, float_model, reference, inputs)


def export_free_batch(model: torch.nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    """torch.export with dimension 0 (the batch) left free, as the model was prepared."""
    free_batch = tuple({0: torch.export.Dim.AUTO} for _ in inputs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The tensor attributes", UserWarning)  # nn.LSTM
        return torch.export.export(model, inputs, dynamic_shapes=free_batch)


def sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (expected - actual).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(expected.norm().item() / noise)
