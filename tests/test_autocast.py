"""A converted model run under ``torch.autocast("cpu", torch.bfloat16)``.

Autocast makes the float ops between int8 kernels (a matmul left float, say)
return bfloat16, and torch.quantize_per_tensor, the next kernel's input, takes
float32 only: the lowered PT2E model failed on every backend ("Quantize only works
on Float Tensor, got BFloat16"), where torchao's converted model runs. torch's own
int8 matmul fails the same way inside. (torch.ao's converted FX models fail under
autocast too; qcore's FX graphs stay as torch.ao's.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backends import backend_params
from test_vendor_constraints import sqnr

import qcore


class MatmulBetweenLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.b(y @ y.transpose(-1, -2) @ y)


def _converted(path: str, backend: str, model: torch.nn.Module, x: torch.Tensor):
    if path == "pt2e":
        exported = torch.export.export(model, (x,)).module()
        prepared = qcore.prepare_pt2e(exported, backend)
    else:
        prepared = qcore.prepare_fx(model, None, (x,), backend=backend)
    with torch.no_grad():
        prepared(x)
    return qcore.convert_pt2e(prepared) if path == "pt2e" else qcore.convert_fx(prepared)


@pytest.mark.parametrize("path", ["pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_a_converted_model_runs_under_autocast(path, backend):
    model, x = MatmulBetweenLinears().eval(), torch.randn(2, 8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = _converted(path, backend, model, x)
    with torch.no_grad():
        expected, plain = model(x), converted(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # and prints nothing
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = converted(x)
    # bfloat16 float ops between the int8 kernels: measured within 0.5 dB of float32
    assert sqnr(expected, autocast.float()) > sqnr(expected, plain) - 1.0
