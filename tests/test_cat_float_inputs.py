"""``torch.cat`` shares one observer across its inputs and its output, as torch.ao
FX does.

Inputs no quantized op produces (float ops' outputs, pieces of a graph input) had
an observer each: every input was rounded to its own scale and then again to the
output's, 1-2.2 dB below torch.ao on every backend (cat of two ``cumsum``s: 31.1 dB
against float, torch.ao 32.2). Inputs quantized ops produce (two convs) kept their
producers' observers and were requantized in the cat: 0.4-1.0 dB below torch.ao.
"""

from __future__ import annotations

import copy

import pytest
import torch
from backends import backend_params
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
from zoo.baseline import backend_config, quantized_engine

import qcore


class Chunks(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = torch.chunk(x, 2, 1)
        return torch.cat([second, first], 1)


class FloatInputs(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.cumsum(1), x.cumsum(-1)], 1)


class ConvChunks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = torch.chunk(self.conv(x), 2, 1)
        return torch.cat([second, first], 1)


class TwoConvs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(8, 8, 3, padding=1)
        with torch.no_grad():
            self.b.weight.mul_(0.6)  # ranges apart: one scale for both costs something

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], 1)


def _sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    return (10 * torch.log10(expected.pow(2).sum() / (expected - actual).pow(2).sum())).item()


@pytest.mark.parametrize("model_class", [Chunks, FloatInputs, ConvChunks, TwoConvs])
@pytest.mark.parametrize("backend", backend_params())
def test_cat_of_float_inputs_rounds_once_as_torch_ao(model_class, backend):
    torch.manual_seed(0)
    model = model_class().eval()
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(4, 8, 8, 8, generator=generator) * 2 for _ in range(5)]
    calibration, held_out = data[:4], data[4]
    mapping = get_default_qconfig_mapping(backend)
    prepared = qcore.prepare_fx(copy.deepcopy(model), mapping, (data[0],), backend=backend)
    config = backend_config(backend)
    with quantized_engine("qnnpack" if backend == "qnnpack" else "fbgemm"):
        theirs = prepare_fx(copy.deepcopy(model), mapping, (data[0],), backend_config=config)
        for batch in calibration:
            prepared(batch)
            theirs(batch)
        peer_model = convert_fx(theirs, backend_config=config)
        expected = model(held_out)
        peer = _sqnr(expected, peer_model(held_out))
    ours = _sqnr(expected, qcore.convert_fx(prepared)(held_out))
    assert ours >= peer - 0.1, (ours, peer)


class TwoActivatedBranches(torch.nn.Module):
    """MobileNet's two-branch block: conv -> relu6 twice, concatenated. torch.ao swaps
    the observer after each relu6 for the cat's, and each conv keeps observing its
    own pre-activation range."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.relu_a, self.relu_b = torch.nn.ReLU6(), torch.nn.ReLU6()
        with torch.no_grad():
            self.b.weight.mul_(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.relu_a(self.a(x)), self.relu_b(self.b(x))], 1)


# qnnpack's relu6 misreads torch.ao's channels-last conv outputs (test_clamp_engines)
@pytest.mark.parametrize("backend", [b for b in backend_params() if "qnnpack" not in str(b)])
def test_cat_of_activated_convs_is_torch_aos_model_exactly(backend):
    torch.manual_seed(0)
    model = TwoActivatedBranches().eval()
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(4, 8, 8, 8, generator=generator) * 2 for _ in range(5)]
    mapping = get_default_qconfig_mapping(backend)
    prepared = qcore.prepare_fx(copy.deepcopy(model), mapping, (data[0],), backend=backend)
    config = backend_config(backend)
    with quantized_engine("fbgemm"):
        theirs = prepare_fx(copy.deepcopy(model), mapping, (data[0],), backend_config=config)
        for batch in data[:4]:
            prepared(batch)
            theirs(batch)
        peer_model = convert_fx(theirs, backend_config=config)
        expected = peer_model(data[4])
    ours = qcore.convert_fx(prepared)
    for name in ("a", "b"):  # each conv's output qparams: its own range, as torch.ao's
        theirs_conv, our_conv = peer_model.get_submodule(name), ours.get_submodule(name)
        assert (our_conv.scale, our_conv.zero_point) == (
            theirs_conv.scale,
            theirs_conv.zero_point,
        ), name
    assert torch.equal(ours(data[4]), expected.dequantize() if expected.is_quantized else expected)
