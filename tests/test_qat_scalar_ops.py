"""QAT with a Python-number add or product (``x + 3``, ``x * 0.5``).

In post-training quantization ``x + c`` shares ``x``'s observer, which sees both
tensors. A QAT fake quant shared that way tracks neither range (its moving
average starts on ``x`` and hardly moves), so training ran against a clipped
``x + 3`` and the converted model kept the clip: 3-13 dB against float, where
torch.ao's add_scalar kernel, which ignores the shared qparams, gave 36.9.
The result now has a fake quant of its own: the fake-quantized model and the
converted one both follow float.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.ao.quantization as tq
from backends import backend_params
from torch import nn
from torch.ao.quantization.quantize_fx import convert_fx, prepare_qat_fx
from zoo.baseline import backend_config, quantized_engine

import qcore


class AddBeforeLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x + 3))


class AddAfterSigmoid(nn.Module):  # sigmoid's fixed qparams cannot hold x + 3
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.sigmoid(self.fc(x)) + 3)


class HalfBetweenLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc1(x) * 0.5)


def _sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    return (10 * torch.log10(expected.pow(2).sum() / (expected - actual).pow(2).sum())).item()


def _trained(prepare, model, mapping_backend, **kwargs):
    data = [torch.randn(64, 16, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    mapping = tq.get_default_qat_qconfig_mapping(mapping_backend)
    prepared = prepare(copy.deepcopy(model), mapping, (data[0],), **kwargs)
    for batch in data:
        prepared(batch)
    return prepared.eval(), torch.randn(512, 16, generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("model_class", [AddBeforeLinear, AddAfterSigmoid, HalfBetweenLinears])
@pytest.mark.parametrize("backend", backend_params(("qnnpack", "fbgemm", "x86")))
def test_a_scalar_ops_result_gets_its_own_fake_quant(model_class, backend):
    torch.manual_seed(0)
    model = model_class().train()
    prepared, x = _trained(qcore.prepare_qat_fx, model, backend, backend=backend)
    with torch.no_grad():
        expected = model.eval()(x)
        fake_quantized = prepared(x)
        converted = qcore.convert_fx(prepared)(x)
    # no clipping (7-bit activations on fbgemm and x86): training's model and the converted one
    assert _sqnr(expected, fake_quantized) >= 27
    assert _sqnr(expected, converted) >= 27

    with quantized_engine("qnnpack" if backend == "qnnpack" else "fbgemm"):
        config = backend_config(backend)
        theirs, _ = _trained(prepare_qat_fx, model.train(), backend, backend_config=config)
        with torch.no_grad():
            peer = convert_fx(theirs, backend_config=config)(x)
    assert _sqnr(expected, converted) >= _sqnr(expected, peer) - 0.5
