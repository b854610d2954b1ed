"""An op with fixed qparams (sigmoid, hardsigmoid, tanh, softmax) whose input nothing
quantized feeds.

The fixed qparams are the op's *output's* (sigmoid: scale 1/256, zero point 0, so
[0, 1)). torch.ao FX quantizes such an input with them too, clipping every
negative value to 0: ``sigmoid(fc(x).cumsum(1))`` (cumsum stays float) gave 10.8 dB
against float on torch.ao and qcore, a standalone module then sigmoid 16.0 on
qcore. The input is now observed from its values; an input a quantized op
produces still reads that op's observer (tests/test_user_model_defects.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from backends import backend_params
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.fx.custom_config import PrepareCustomConfig

import qcore


def _sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    return (10 * torch.log10(expected.pow(2).sum() / (expected - actual).pow(2).sum())).item()


def _data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(16, 16, generator=generator) for _ in range(4)]


class AfterFloatOp(nn.Module):
    def __init__(self, activation) -> None:
        super().__init__()
        self.fc, self.activation = nn.Linear(16, 8), activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.fc(x).cumsum(1))  # no backend quantizes cumsum


class OnTheInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


class AfterStandalone(nn.Module):
    def __init__(self, activation) -> None:
        super().__init__()
        self.head, self.activation = nn.Linear(16, 8), activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.head(x))


ACTIVATIONS = {
    "sigmoid": torch.sigmoid,
    "hardsigmoid": nn.functional.hardsigmoid,
    "tanh": torch.tanh,
}


def _quantized(model, backend, custom_config=None):
    data = _data()
    prepared = qcore.prepare_fx(
        copy.deepcopy(model),
        get_default_qconfig_mapping(backend),
        (data[0],),
        prepare_custom_config=custom_config,
        backend=backend,
    )
    for batch in data:
        prepared(batch)
    return qcore.convert_fx(prepared), data[0]


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("backend", backend_params())
def test_after_a_float_op(name, backend):
    torch.manual_seed(0)
    model = AfterFloatOp(ACTIVATIONS[name]).eval()
    quantized, x = _quantized(model, backend)
    assert _sqnr(model(x), quantized(x)) >= 30
    assert ".cumsum()" in {entry.op for entry in qcore.explain(quantized).float}


@pytest.mark.parametrize("backend", backend_params())
def test_on_a_graph_input(backend):
    quantized, x = _quantized(OnTheInput().eval(), backend)
    assert _sqnr(torch.sigmoid(x), quantized(x)) >= 30  # x is randn: half of it negative


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("backend", backend_params())
def test_after_a_standalone_module(name, backend):
    torch.manual_seed(0)
    model = AfterStandalone(ACTIVATIONS[name]).eval()
    x = _data()[0]
    config = PrepareCustomConfig().set_standalone_module_name(
        "head", None, (x,), PrepareCustomConfig(), None
    )
    quantized, x = _quantized(model, backend, config)
    assert _sqnr(model(x), quantized(x)) >= 30
