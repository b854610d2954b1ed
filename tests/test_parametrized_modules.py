"""Layers whose weight is a parametrization (weight_norm, spectral_norm, orthogonal:
``torch.nn.utils.parametrize``) are quantized as torch.ao quantizes them.

Their class is torch's injected ``ParametrizedLinear``; pattern matching compared
classes exactly and left them float ("no pattern matches ParametrizedLinear"),
where torch.ao matches the class before parametrization. Convert quantizes the
weight's present value. The user's model keeps its parametrizations: torch's
removal deletes a property from the class, which a deep copy shares.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params
from torch import nn
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
from torch.nn.utils import parametrizations, parametrize
from zoo.baseline import backend_config, default_qconfig_mapping, quantized_engine, sqnr

import qcore


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(F.relu(self.conv(x)).mean(-1))))


def _parametrized(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = Net().eval()
    if kind == "weight_norm over dim 2":  # wav2vec2's positional conv
        parametrizations.weight_norm(model.conv, dim=2)
    else:
        for layer in (model.conv, model.fc1):
            getattr(parametrizations, kind)(layer)
    return model


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize(
    "kind", ["weight_norm", "spectral_norm", "orthogonal", "weight_norm over dim 2"]
)
def test_parametrized_layers_are_quantized_as_torch_ao_quantizes_them(kind, backend):
    model = _parametrized(kind)
    generator = torch.Generator().manual_seed(1)
    calibration = [torch.randn(8, 8, 10, generator=generator) for _ in range(4)]
    held_out = torch.randn(32, 8, 10, generator=generator)
    with torch.no_grad():
        expected = model(held_out)

    quantized = qcore.quantize(model, (calibration[0][:2],), calibration, backend=backend)
    statuses = {entry.node: entry.status.value for entry in qcore.explain(quantized).entries}
    assert statuses["conv"] == statuses["fc1"] == "quantized", qcore.explain(quantized)

    theirs = prepare_fx(
        copy.deepcopy(model),
        default_qconfig_mapping(backend),
        (calibration[0][:2],),
        backend_config=backend_config(backend),
    )
    with quantized_engine(backend), torch.no_grad():
        for batch in calibration:
            theirs(batch)
        peer = sqnr(expected, convert_fx(theirs)(held_out))
    assert sqnr(expected, quantized(held_out)) >= peer - 0.5

    # the user's model is as it was: parametrized, same outputs
    assert parametrize.is_parametrized(model.conv)
    with torch.no_grad():
        torch.testing.assert_close(model(held_out), expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params())
def test_a_qconfig_for_the_layer_class_covers_its_parametrized_layers(backend):
    model = _parametrized("weight_norm")
    mapping = qcore.get_default_qconfig_mapping(backend).set_object_type(nn.Linear, None)
    x = torch.randn(4, 8, 10)
    prepared = qcore.prepare_fx(model, mapping, (x,), backend=backend)
    prepared(x)
    statuses = {e.node: e.status.value for e in qcore.explain(qcore.convert_fx(prepared)).entries}
    assert statuses["fc1"] == statuses["fc2"] == "float"
    assert statuses["conv"] == "quantized"
