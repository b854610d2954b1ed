"""explain's reason for an op left in reference form is the true one.

x86's quantizer (as torchao's) quantizes a conv's output for a ``mul`` and leaves
the ``sigmoid`` reading the same output in float (``y * sigmoid(y)``): no kernel
can give both forms, yet explain said "no kernel for aten.conv2d in backend
'x86'", beside the listed conv kernels. A kernel's documented refusal (a
ValueError) read "ValueError: its output is not quantized".
"""

from __future__ import annotations

import pytest
import torch
from backends import backend_params

import qcore


class Swish(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y * torch.sigmoid(y)


def _lowered(backend: str) -> tuple[torch.fx.GraphModule, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Swish().eval()
    x = torch.randn(2, 3, 16, 16)
    prepared = qcore.prepare_pt2e(torch.export.export(model, (x,)).module(), backend)
    prepared(x)
    return qcore.convert_pt2e(prepared), model, x


@pytest.mark.parametrize("backend", backend_params(("x86",)))
def test_a_conv_read_both_quantized_and_in_float_says_so(backend):
    lowered, model, x = _lowered(backend)
    report = qcore.explain(lowered)
    conv = report["conv2d"]
    assert conv.status.value == "reference"
    assert "no kernel" not in conv.reason
    assert "read both quantized (by mul) and in float (by sigmoid)" in conv.reason
    expected, got = model(x), lowered(x)
    assert 10 * torch.log10(expected.pow(2).sum() / (expected - got).pow(2).sum()) > 30


@pytest.mark.parametrize("backend", backend_params(("x86",)))
def test_a_kernels_refusal_reads_as_its_message(backend):
    lowered, _, _ = _lowered(backend)
    mul = qcore.explain(lowered)["mul"]
    assert mul.status.value == "reference"
    assert mul.reason == "kernel x86.mul: its output is not quantized (left in reference form)"
