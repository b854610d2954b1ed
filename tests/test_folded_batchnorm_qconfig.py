"""A BatchNorm folded into its layer does not decide the layer's QConfig.

qcore's own default mapping gives fbgemm's and x86's ConvTranspose a per-tensor
weight QConfig and BatchNorm the global one; prepare saw "different QConfigs" on
the fused pair and left ConvTranspose + BatchNorm in float, silently, where
torch.ao (which compares only what stays a fused module) folds and quantizes it.
"""

from __future__ import annotations

import pytest
import torch
from backends import backend_params
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping as ao_mapping
from torch.ao.quantization.quantize_fx import convert_fx as ao_convert
from torch.ao.quantization.quantize_fx import prepare_fx as ao_prepare

import qcore

LAYERS = {
    1: (nn.ConvTranspose1d, nn.BatchNorm1d),
    2: (nn.ConvTranspose2d, nn.BatchNorm2d),
    3: (nn.ConvTranspose3d, nn.BatchNorm3d),
}


def _sqnr(expected: torch.Tensor, got: torch.Tensor) -> float:
    return float(10 * torch.log10(expected.pow(2).sum() / (expected - got).pow(2).sum()))


def _model_and_batches(dims: int, relu: bool = False):
    torch.manual_seed(0)
    conv, norm = LAYERS[dims]
    layers = [conv(4, 8, 3, stride=2), norm(8)] + ([nn.ReLU()] if relu else [])
    model = nn.Sequential(*layers).eval()
    with torch.no_grad():  # statistics that make the fold matter
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    shape = (2, 4) + (6,) * dims
    return model, [torch.randn(shape) for _ in range(4)], torch.randn(shape)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv_transpose_and_batchnorm_are_quantized_with_the_default_mapping(backend, dims):
    model, calibration, x = _model_and_batches(dims)
    mapping = qcore.get_default_qconfig_mapping(backend)
    prepared = qcore.prepare_fx(model, mapping, (x,), backend=backend)
    for batch in calibration:
        prepared(batch)
    converted = qcore.convert_fx(prepared)
    (entry,) = [e for e in qcore.explain(converted) if e.status.value != "-"]
    # qnnpack's int8 ConvTranspose3d rounds apart from the reference: its own reason
    lowered = backend != "qnnpack" or dims < 3
    assert entry.status.value == ("quantized" if lowered else "reference"), entry
    assert _sqnr(model(x), converted(x)) > 25
    if backend == "fbgemm":  # torch.ao's own transposed-conv numbers are fbgemm's
        peer = ao_prepare(model, ao_mapping(backend), (x,))
        for batch in calibration:
            peer(batch)
        peer = ao_convert(peer)
        assert _sqnr(model(x), converted(x)) >= _sqnr(model(x), peer(x)) - 0.5


@pytest.mark.parametrize("backend", backend_params())
def test_a_batchnorm_of_its_own_qconfig_folds_into_conv_relu(backend):
    """conv -> bn -> relu: the bn, set to None by name, is folded and gone; the
    ConvReLU takes conv's and relu's (equal) QConfig, as in torch.ao."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    x = torch.randn(2, 3, 10, 10)
    mapping = qcore.get_default_qconfig_mapping(backend).set_module_name("1", None)
    prepared = qcore.prepare_fx(model, mapping, (x,), backend=backend)
    prepared(x)
    converted = qcore.convert_fx(prepared)
    quantized = [e.node for e in qcore.explain(converted) if e.status.value == "quantized"]
    assert "_0" in quantized, qcore.explain(converted)
    assert _sqnr(model(x), converted(x)) > 25
