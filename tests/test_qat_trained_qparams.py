"""convert gives the model QAT trained: the qparams each fake quant applied (issue 13).

torch's FusedMovingAvgObsFakeQuantize (torch.ao's default QAT weights, torchao's
XNNPACKQuantizer QAT config) computes its scale and zero point inside its fused
kernel, up to 0.4% off its own calculate_qparams(). convert read the latter, so one
trained weight in five landed on another integer than the one trained with, and the
converted model was not the fake-quant model (44.6 dB on a two-layer model, torch.ao's
convert the same). It now reads the buffers the forward used: the reference form is
the fake-quant model in eval.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from backends import installed
from torch import nn

import qcore

requires_qnnpack = pytest.mark.skipif(not installed("qnnpack"), reason="needs qnnpack")


class ConvLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(8, 3, 16, 16, generator=generator) for _ in range(6)]


def _train(prepared: torch.nn.Module, batches: list[torch.Tensor]) -> None:
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.05)
    for x in batches:
        optimizer.zero_grad()
        prepared(x).pow(2).mean().backward()
        optimizer.step()


def _sqnr(expected: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (expected - actual).pow(2).mean()
    return float("inf") if noise == 0 else (10 * torch.log10(expected.pow(2).mean() / noise)).item()


@requires_qnnpack
def test_fx_convert_reads_the_scale_torch_aos_fused_fake_quant_trained_with():
    import torch.ao.quantization as tq

    torch.manual_seed(0)
    batches = _batches()
    mapping = tq.get_default_qat_qconfig_mapping("qnnpack")
    prepared = qcore.prepare_qat_fx(ConvLinear().train(), mapping, (batches[0],), backend="qnnpack")
    fake_quant = prepared.conv.weight_fake_quant
    assert type(fake_quant).__name__ == "FusedMovingAvgObsFakeQuantize"
    _train(prepared, batches[:5])
    prepared.eval()
    prepared.apply(tq.disable_observer)
    # the case this is about: the buffer differs from what calculate_qparams says
    assert not torch.equal(fake_quant.scale, fake_quant.calculate_qparams()[0])

    reference = qcore.convert_to_reference_fx(prepared)
    with torch.no_grad():
        trained, converted = prepared(batches[5]), reference(batches[5])
    assert _sqnr(trained, converted) > 80, _sqnr(trained, converted)
    weight_scale = reference.conv.weight_qparams["weight"].scale
    torch.testing.assert_close(weight_scale.reshape(-1), fake_quant.scale.reshape(-1))


def test_pt2e_convert_reads_the_scale_torchaos_qat_config_trained_with():
    xnnpack = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")
    from torchao.quantization.pt2e import disable_observer

    torch.manual_seed(0)
    batches = _batches()
    quantizer = xnnpack.XNNPACKQuantizer().set_global(
        xnnpack.get_symmetric_quantization_config(is_qat=True)
    )
    exported = torch.export.export(ConvLinear().train(), (batches[0],)).module()
    prepared = qcore.prepare_qat_pt2e(exported, quantizer)
    _train(prepared, batches[:5])
    qcore.pt2e.move_exported_model_to_eval(prepared)
    prepared.apply(disable_observer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = qcore.convert_pt2e(copy.deepcopy(prepared), lower=False)
    with torch.no_grad():
        trained, converted = prepared(batches[5]), reference(batches[5])
    assert _sqnr(trained, converted) > 80, _sqnr(trained, converted)


@requires_qnnpack
def test_a_fake_quant_calibrated_with_fake_quantization_off_gives_its_observers_qparams():
    """The fused fake quant writes its buffers only while it fake-quantizes: one used
    as an observer (disable_fake_quant, calibrate, convert) still has scale 1."""
    import torch.ao.quantization as tq

    torch.manual_seed(0)
    batches = _batches()
    model = ConvLinear().eval()
    mapping = tq.get_default_qat_qconfig_mapping("qnnpack")
    prepared = qcore.prepare_qat_fx(
        copy.deepcopy(model).train(), mapping, (batches[0],), backend="qnnpack"
    )
    prepared.apply(tq.disable_fake_quant)
    with torch.no_grad():
        for x in batches[:5]:
            prepared(x)
    assert prepared.conv.weight_fake_quant.scale.item() == 1.0  # never written
    reference = qcore.convert_to_reference_fx(prepared.eval())
    with torch.no_grad():
        assert _sqnr(model(batches[5]), reference(batches[5])) > 30
