"""The chip's own kernels on the tutorial's model: used, and exact to one step."""

import torch
from torch import nn

import qcore
from qcore_tutorialchip.kernels import IntegerConv2d, IntegerLinear


class TutorialModel(nn.Module):
    """Seed 002's model: linear, conv-relu (fused by the chip's rule), sigmoid."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 3)
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.relu = nn.ReLU()
        self.sigmoid = nn.Sigmoid()

    def forward(self, x):
        return self.sigmoid(self.relu(self.conv(self.linear(x))))


def quantized():
    torch.manual_seed(0)
    model = TutorialModel().eval()
    calibration = [(torch.randn(4, 3, 10, 10),) for _ in range(4)]
    mapping = qcore.get_default_qconfig_mapping("tutorialchip")
    prepared = qcore.prepare_fx(model, mapping, calibration[0], backend="tutorialchip")
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    return model, prepared, calibration[0]


def test_linear_and_conv_relu_run_on_the_chips_kernels():
    _, prepared, _ = quantized()
    converted = qcore.convert_fx(prepared)
    modules = dict(converted.named_modules())
    assert type(modules["linear"]) is IntegerLinear
    assert type(modules["conv"]) is IntegerConv2d
    report = qcore.explain(converted)
    assert {e.node: e.kernel for e in report.quantized} == {
        "linear": "tutorialchip.linear",
        "conv": "tutorialchip.conv2d_relu",  # conv and relu, fused at prepare
    }
    # The chip has no sigmoid: it stays float, and explain says so.
    assert "no pattern" in report["sigmoid"].reason


def test_integer_kernels_agree_with_the_reference_form_within_one_step():
    model, prepared, inputs = quantized()
    converted = qcore.convert_fx(prepared)
    reference = qcore.convert_to_reference_fx(prepared)
    # Compare before the float sigmoid, where the conv-relu's int8 output is.
    converted.sigmoid = nn.Identity()
    reference.sigmoid = nn.Identity()
    with torch.no_grad():
        actual, expected = converted(*inputs), reference(*inputs)
    step = converted.get_submodule("conv").scale
    assert (actual - expected).abs().max().item() <= step * (1 + 1e-4)  # + float rounding
    # And quantization is real: the float model differs by more than rounding noise.
    model.sigmoid = nn.Identity()
    with torch.no_grad():
        assert (model(*inputs) - actual).abs().max().item() > step / 4


def test_the_chips_constraint_is_enforced():
    """Seed 002's faulty setup: torch.ao's default eps (2**-23 < 2**-12) quantizes nothing."""
    torch.manual_seed(0)
    model = TutorialModel().eval()
    x = (torch.randn(4, 3, 10, 10),)
    fbgemm_defaults = qcore.get_default_qconfig_mapping("fbgemm")
    prepared = qcore.prepare_fx(model, fbgemm_defaults, x, backend="tutorialchip")
    report = qcore.explain(prepared)
    assert not report.quantized
    assert "scale_min_lower_bound" in report["linear"].reason
