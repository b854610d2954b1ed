"""F.interpolate is lowered to torch's int8 op only in the modes torch has one for.

explain said "quantized, kernel x86.average" for a 1-d nearest, linear, bicubic,
trilinear or antialiased interpolation, and the converted model raised
NotImplementedError (``upsample_nearest1d.out`` on QuantizedCPU); torch.ao's
model fails the same way. Those stay in reference form now, with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params

import qcore


class ConvThenInterpolate(torch.nn.Module):
    def __init__(self, rank: int, **interpolation) -> None:
        super().__init__()
        self.conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[rank - 3](4, 4, 3)
        self.interpolation = interpolation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.conv(x), scale_factor=2, **self.interpolation)


CASES = [  # rank, F.interpolate's arguments, whether torch has an int8 kernel
    (3, {"mode": "nearest"}, False),
    (3, {"mode": "linear"}, False),
    (3, {"mode": "area"}, True),
    (4, {"mode": "nearest"}, True),
    (4, {"mode": "nearest-exact"}, True),
    (4, {"mode": "bilinear"}, True),
    (4, {"mode": "bilinear", "align_corners": True}, True),
    (4, {"mode": "bilinear", "antialias": True}, False),
    (4, {"mode": "bicubic"}, False),
    (5, {"mode": "nearest"}, True),
    (5, {"mode": "trilinear"}, False),
]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize(("rank", "interpolation", "has_int8_kernel"), CASES)
def test_interpolate_runs_int8_only_where_torch_can(backend, rank, interpolation, has_int8_kernel):
    torch.manual_seed(0)
    model = ConvThenInterpolate(rank, **interpolation).eval()
    x = torch.randn((2, 4) + (6,) * (rank - 2))
    mapping = qcore.get_default_qconfig_mapping(backend)
    prepared = qcore.prepare_fx(model, mapping, (x,), backend=backend)
    prepared(x)
    converted = qcore.convert_fx(prepared)
    expected, got = model(x), converted(x)  # ran: no NotImplementedError
    assert 10 * torch.log10(expected.pow(2).sum() / (expected - got).pow(2).sum()) > 25
    entry = qcore.explain(converted)["interpolate"]
    if has_int8_kernel:
        assert entry.status.value == "quantized", entry
    else:
        assert entry.status.value == "reference", entry
        assert "torch has no int8 kernel for" in entry.reason
