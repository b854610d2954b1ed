"""``view`` on the output of an int8 convolution.

torch's int8 convolutions return channels-last tensors, and ``view(n, -1)`` on one
fails: "view size is not compatible with input tensor's size and stride". A model
as plain as ``conv -> view`` or ``conv -> add -> view`` crashed once lowered, on
every backend and both paths, as it does on torch.ao. The lowered graph reshapes
instead: the same view wherever one exists.
"""

from __future__ import annotations

import pytest
import torch
from backends import backend_params

import qcore


class ConvAddView(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.c2 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.head = torch.nn.Linear(4 * 6 * 6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(x)
        flat = y.view(y.size(0), -1)  # straight off a conv
        z = self.c2(x) + y
        return self.head(z.view(z.size(0), -1)) + self.head(flat).view_as(self.head(flat))


def _calibrated(prepared: torch.nn.Module, data: list[torch.Tensor]) -> torch.nn.Module:
    with torch.no_grad():
        for batch in data:
            prepared(batch)
    return prepared


@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params(("fbgemm", "qnnpack", "x86")))
def test_a_view_of_an_int8_conv_output_runs_as_the_reference(backend: str, path: str) -> None:
    model = ConvAddView().eval()
    data = [torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    if path == "fx":
        prepared = _calibrated(qcore.prepare_fx(model, None, (data[0],), backend=backend), data)
        reference = qcore.convert_to_reference_fx(prepared)
        lowered = qcore.convert_fx(prepared)
    else:
        exported = torch.export.export(model, (data[0],)).module()
        prepared = _calibrated(qcore.prepare_pt2e(exported, backend), data)
        reference = qcore.convert_pt2e(prepared, lower=False)
        lowered = qcore.convert_pt2e(prepared)
    assert qcore.explain(lowered).quantized  # the convs run int8: their outputs are channels-last
    with torch.no_grad():
        expected, ours = reference(data[0]), lowered(data[0])
    # kernels round where the reference form does: a step or two of the output
    assert float((ours - expected).abs().max()) < 0.05 * float(expected.abs().max())
