"""The FX reference form speaks torch.ops.quantized_decomposed (issue 15 §1).

``convert_to_reference_fx`` gives the ecosystem's quantize/dequantize ops, as
torchao's PT2E graphs and qcore's own PT2E reference form do, so torch.export,
Inductor's int8 passes and ONNX's QDQ export read it; ``convert_fx`` still lowers
from qcore.ops, bit-exact with fbgemm.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from backends import backend_params, installed
from torch import nn

import qcore
from qcore import ops
from qcore.demo import _mapping
from qcore.engine.convert import convert_to_reference
from qcore.examples import ZOO
from qcore.examples._common import EVAL_SEED

qd = torch.ops.quantized_decomposed
QCORE_OPS = {
    ops.quantize_per_tensor,
    ops.dequantize_per_tensor,
    ops.quantize_per_channel,
    ops.dequantize_per_channel,
    ops.fake_quantize_dynamic,
}


def _prepared(name: str, backend: str):
    entry = ZOO[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        prepared = qcore.prepare_fx(
            entry.make_model(), _mapping(backend, entry), entry.example_inputs(), backend
        )
    with torch.no_grad():
        for batch in entry.calibration_data(2):
            prepared(*batch)
    return prepared, entry


def _targets(gm) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86", "qnnpack")))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_reference_form_uses_the_decomposed_ops(name, backend):
    prepared, entry = _prepared(name, backend)
    reference = qcore.convert_to_reference_fx(prepared)
    targets = _targets(reference)
    assert not targets & QCORE_OPS, sorted(map(str, targets & QCORE_OPS))
    quantizes = {qd.quantize_per_tensor.default, qd.quantize_per_tensor.tensor}
    assert targets & quantizes, sorted(map(str, targets))
    # as accurate as the lowering's own form (qcore.ops, which the kernels match)
    own = convert_to_reference(prepared)
    model = entry.make_model()
    (inputs,) = entry.calibration_data(1, seed=EVAL_SEED)
    with torch.no_grad():
        expected = model(*inputs)
        decomposed_db, own_db = _sqnr(expected, reference(*inputs)), _sqnr(expected, own(*inputs))
    assert decomposed_db > own_db - 0.5, (name, decomposed_db, own_db)


def _sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (expected - actual).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(expected.norm().item() / noise)


class ConvLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


def _conv_linear_reference():
    torch.manual_seed(0)
    model = ConvLinear().eval()
    x = torch.randn(2, 3, 6, 6)
    backends = [name for name in ("x86", "fbgemm", "qnnpack") if installed(name)]
    if not backends:
        pytest.skip("needs a first-party backend plugin")
    prepared = qcore.prepare_fx(model, None, (x,), backends[0])
    with torch.no_grad():
        prepared(x)
        prepared(torch.randn(2, 3, 6, 6))
    return qcore.convert_to_reference_fx(prepared), x


def test_reference_form_exports_and_reloads():
    import io

    reference, x = _conv_linear_reference()
    exported = torch.export.export(reference, (x,))
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    targets = {str(n.target) for n in loaded.graph.nodes if n.op == "call_function"}
    assert "quantized_decomposed.quantize_per_tensor.default" in targets, sorted(targets)
    with torch.no_grad():
        assert torch.equal(loaded.module()(x), reference(x))


def test_compiled_reference_form_matches_eager():
    reference, x = _conv_linear_reference()
    with torch.no_grad():
        eager = reference(x)
        compiled = torch.compile(reference)(x)
    quantizes = reference.graph.find_nodes(
        op="call_function", target=qd.quantize_per_tensor.default
    )
    step = float(quantizes[-1].args[1])
    assert (compiled - eager).abs().max().item() <= step * (1 + 1e-4)
