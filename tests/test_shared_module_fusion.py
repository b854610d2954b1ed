"""A module called at two places, one of them part of a fusion pattern.

Fusion replaces the pattern's root module under its name. Where that module is
called elsewhere too, every other call would run the fused module: a BatchNorm
folded into a conv whose other call has none, a relu after a call that has none,
or (onednn's conv-add) a call one input short. torch.ao FX does the first two
silently (6-8 dB against float on the models below, where 32-40 dB is the 8-bit
error) and the PT2E path of torchao refuses them or, on Linear -> BatchNorm1d, is
3.7 dB. qcore leaves such a root unfused: each call is quantized as what it is.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping

import qcore

#: Far below 8-bit quantization error on these models (32-43 dB), far above what the
#: fused-everywhere model gives (6-8 dB).
MIN_SQNR_DB = 25.0


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(reference.pow(2).sum().item() / noise)


class SharedConv(nn.Module):
    def __init__(self, tail: str) -> None:
        super().__init__()
        self.tail = tail
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        if self.tail == "relu":
            y = F.relu(y)
        elif self.tail == "bn":
            y = self.bn(y)
        # "add": conv(x) + conv(x), onednn's conv-add pattern on one of the calls
        return y + self.conv(x)


class SharedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.linear(x)) + self.linear(x)


def _model(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.weight.data.uniform_(0.5, 2.0)
    return model.eval()


def _data(shape: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("backend", backend_params(("x86", "fbgemm", "qnnpack", "onednn")))
@pytest.mark.parametrize("tail", ["relu", "bn", "add"])
def test_fx_a_shared_root_module_is_not_fused_into_its_other_call(backend, tail):
    model, data = _model(SharedConv(tail)), _data((2, 4, 8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's observers in the mapping
        prepared = qcore.prepare_fx(
            model, get_default_qconfig_mapping(backend), (data[0],), backend=backend
        )
    assert type(prepared.conv) is nn.Conv2d  # both calls run the user's conv
    with torch.no_grad():
        for batch in data:
            prepared(batch)
        for convert in (qcore.convert_to_reference_fx, qcore.convert_fx):
            assert sqnr(model(data[0]), convert(prepared)(data[0])) > MIN_SQNR_DB


@pytest.mark.parametrize("backend", backend_params(("x86", "qnnpack")))
@pytest.mark.parametrize("make, shape", [
    (lambda: SharedConv("bn"), (2, 4, 8, 8)),
    (lambda: SharedConv("relu"), (2, 4, 8, 8)),
    (SharedLinear, (4, 8)),
])  # fmt: skip
def test_pt2e_a_shared_weight_is_folded_into_one_call_only(backend, make, shape):
    model, data = _model(make()), _data(shape)
    exported = torch.export.export(model, (data[0],)).module()
    prepared = qcore.prepare_pt2e(exported, backend)
    with torch.no_grad():
        for batch in data:
            prepared(batch)
        for lower in (False, True):
            converted = qcore.convert_pt2e(prepared, lower=lower)
            assert sqnr(model(data[0]), converted(data[0])) > MIN_SQNR_DB
