"""Ops no model input's values reach stay float (rotary position embeddings).

LLaMA-style decoders compute rotary angles in forward from ``arange`` and an
``inv_freq`` buffer. qcore quantized that ``mul`` (and the ``cat`` after it) to 8
bits: ``inv_freq`` spans 1 to 1e-4, so its low frequencies rounded to 0, and the
angles [0, T) were rounded to steps of T/255 rad. At 256 tokens cos/sin were
noise: -0.5 dB (FX fbgemm/x86), 2.0 dB (qnnpack), below torch.ao's 6-8 dB.
"""

from __future__ import annotations

import pytest
import torch
from backends import backend_params
from torch import nn

import qcore
from qcore.engine.constants import CONSTANT_MATH_REASON


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, -1)
    return torch.cat([-second, first], -1)


class RotaryAttention(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        with torch.no_grad():  # peaked attention: positions decide the output
            self.q.weight.mul_(8)
            self.k.weight.mul_(8)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).float()
        angles = positions[:, None] * self.inv_freq[None, :]
        both = torch.cat([angles, angles], -1)
        cos, sin = both.cos(), both.sin()
        q, k = self.q(x), self.k(x)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        attention = torch.softmax(q @ k.transpose(-1, -2) / x.shape[-1] ** 0.5, -1)
        return attention @ self.v(x)


def _sqnr(expected: torch.Tensor, got: torch.Tensor) -> float:
    return float(10 * torch.log10(expected.pow(2).sum() / (expected - got).pow(2).sum()))


def _data(tokens: int = 256) -> tuple[list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(1, tokens, 32, generator=generator) for _ in range(5)]
    return batches[:4], batches[4]


def _converted(model: nn.Module, backend: str, path: str) -> torch.nn.Module:
    calibration, x = _data()
    if path == "fx":
        mapping = qcore.get_default_qconfig_mapping(backend)
        prepared = qcore.prepare_fx(model, mapping, (x,), backend=backend)
    else:
        prepared = qcore.prepare_pt2e(torch.export.export(model, (x,)).module(), backend)
    for batch in calibration:
        prepared(batch)
    return qcore.convert_fx(prepared) if path == "fx" else qcore.convert_pt2e(prepared)


@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_rotary_angles_stay_float_and_positions_survive(backend, path):
    torch.manual_seed(0)
    model = RotaryAttention().eval()
    converted = _converted(model, backend, path)
    report = qcore.explain(converted)
    constant_math = [e for e in report if e.reason == CONSTANT_MATH_REASON]
    assert constant_math, report.format(verbose=True)
    assert all(e.status.value == "float" for e in constant_math)
    assert any("mul" in e.op for e in constant_math)  # the angles themselves
    _, x = _data()
    assert _sqnr(model(x), converted(x)) > 12  # was -0.5 to 2.0 dB (torch.ao: 6-8)


class LearnedQueries(nn.Module):
    """A parameter through a Linear, then attended by the input: the first Linear
    reads no input, so it stays float; the rest is quantized as before."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(4, 16))
        self.project = nn.Linear(16, 16)
        self.keys = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.queries) @ self.keys(x).transpose(-1, -2)


@pytest.mark.parametrize("backend", backend_params())
def test_an_input_reached_layer_is_still_quantized(backend):
    torch.manual_seed(0)
    model, x = LearnedQueries().eval(), torch.randn(2, 8, 16)
    mapping = qcore.get_default_qconfig_mapping(backend)
    prepared = qcore.prepare_fx(model, mapping, (x,), backend=backend)
    prepared(x)
    report = qcore.explain(qcore.convert_fx(prepared))
    assert report["keys"].status.value == "quantized"
    assert report["project"].status.value == "float"
    assert report["project"].reason == CONSTANT_MATH_REASON
