"""Values every annotator leaves float (qcore.engine.kept_float).

Ops no model input's values reach stay float (rotary position embeddings).

LLaMA-style decoders compute rotary angles in forward from ``arange`` and an
``inv_freq`` buffer. qcore quantized that ``mul`` (and the ``cat`` after it) to 8
bits: ``inv_freq`` spans 1 to 1e-4, so its low frequencies rounded to 0, and the
angles [0, T) were rounded to steps of T/255 rad. At 256 tokens cos/sin were
noise: -0.5 dB (FX fbgemm/x86), 2.0 dB (qnnpack), below torch.ao's 6-8 dB.

Normalization statistics stay float: RMSNorm written out (LLaMA's) had its
variance rounded to 8 bits, a quiet token's to 0, which rsqrt turned into
1/sqrt(eps): 10.2 dB on fbgemm and x86 (-2.0 dB on that token), as torch.ao's.
"""

from __future__ import annotations

import pytest
import torch
from backends import backend_params
from torch import nn

import qcore
from qcore.engine.kept_float import CONSTANT_MATH_REASON, MASK_REASON, STATISTIC_REASON


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


def _converted(
    model: nn.Module, backend: str, path: str, calibration: list, example: tuple
) -> torch.nn.Module:
    """``model`` through ``path``'s prepare, calibration (batches of positional
    inputs) and convert, for ``backend``."""
    if path == "fx":
        mapping = qcore.get_default_qconfig_mapping(backend)
        prepared = qcore.prepare_fx(model, mapping, example, backend=backend)
    else:
        prepared = qcore.prepare_pt2e(torch.export.export(model, example).module(), backend)
    for batch in calibration:
        prepared(*batch)
    return qcore.convert_fx(prepared) if path == "fx" else qcore.convert_pt2e(prepared)


@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_rotary_angles_stay_float_and_positions_survive(backend, path):
    torch.manual_seed(0)
    model = RotaryAttention().eval()
    calibration, x = _data()
    converted = _converted(model, backend, path, [(b,) for b in calibration], (x,))
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


class RMSNormBlock(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.fc, self.out = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + 1e-6)
        return self.out(self.weight * h)


class LayerNormAsWritten(nn.Module):
    """ConvNeXt's channels-first LayerNorm, then a unit-norm projection (CLIP's)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        mean = y.mean(1, keepdim=True)
        variance = (y - mean).pow(2).mean(1, keepdim=True)
        y = (y - mean) / torch.sqrt(variance + 1e-6)
        z = self.fc(y.mean((2, 3)))
        return z / z.norm(dim=-1, keepdim=True)


def _quiet_token_batches() -> tuple[list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 16, 64, generator=generator) for _ in range(5)]
    for batch in batches:
        batch[:, 0] *= 0.05  # a quiet token (a BOS token's)
    return batches[:4], batches[4]


@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_rmsnorm_statistics_stay_float(backend, path):
    torch.manual_seed(0)
    model = RMSNormBlock().eval()
    calibration, x = _quiet_token_batches()
    converted = _converted(model, backend, path, [(b,) for b in calibration], (x,))
    report = qcore.explain(converted)
    statistics = {e.node for e in report if e.reason == STATISTIC_REASON}
    assert {"mean", "add", "mul"} <= statistics, report.format(verbose=True)
    expected, got = model(x), converted(x)
    assert _sqnr(expected, got) > 24  # 10.2 on fbgemm and x86 before
    assert _sqnr(expected[:, 0], got[:, 0]) > 14  # the quiet token: -2.0 before


@pytest.mark.parametrize("backend", backend_params())
def test_a_division_by_a_statistic_stays_float(backend):
    torch.manual_seed(0)
    model, x = LayerNormAsWritten().eval(), torch.randn(2, 3, 10, 10)
    mapping = qcore.get_default_qconfig_mapping(backend)
    prepared = qcore.prepare_fx(model, mapping, (x,), backend=backend)
    prepared(x)
    report = qcore.explain(qcore.convert_fx(prepared))
    kept = {e.node for e in report if e.reason == STATISTIC_REASON}
    assert {"mean_1", "add"} <= kept, kept  # what fbgemm's and qnnpack's configs quantize
    for name in ("sqrt", "truediv", "norm", "truediv_1"):
        assert report[name].status.value == "float"
    assert report["conv"].status.value == "quantized"


class MaskedAttention(nn.Module):
    """BERT's eager attention, its padding mask made as transformers makes it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        with torch.no_grad():
            self.q.weight.mul_(4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / x.shape[-1] ** 0.5
        additive = (1.0 - mask[:, None, :]) * torch.finfo(torch.float32).min
        return torch.softmax(scores + additive, -1) @ self.v(x)


def _padded_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(5):
        x = torch.randn(4, 32, 32, generator=generator)
        mask = torch.ones(4, 32)
        for row, length in enumerate((32, 24, 16, 8)):
            mask[row, length:] = 0
        batches.append((x, mask))
    return batches


@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_an_attention_mask_and_its_softmax_stay_float(backend, path):
    """The observer of ``scores + mask`` spanned -1.7e38: every real score rounded
    to 0 (qnnpack and fbgemm)."""
    torch.manual_seed(0)
    model = MaskedAttention().eval()
    *calibration, held_out = _padded_batches()
    converted = _converted(model, backend, path, calibration, held_out)
    report = qcore.explain(converted)
    for entry in report:
        if "softmax" in entry.op or entry.reason == MASK_REASON:
            assert entry.status.value == "float", entry
    assert any(e.reason == MASK_REASON for e in report), report.format(verbose=True)
    expected, got = model(*held_out), converted(*held_out)
    valid = held_out[1].bool()
    assert _sqnr(expected[valid], got[valid]) > 25


class GuardedRange(nn.Module):
    """A clamp guarding against overflow (T5's, in float16): no mask, nothing kept."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(x).clamp(min=-65504.0, max=65504.0) + x)


@pytest.mark.parametrize("backend", backend_params())
def test_a_large_negative_clamp_bound_is_no_mask(backend):
    torch.manual_seed(0)
    model, x = GuardedRange().eval(), torch.randn(4, 16)
    converted = _converted(model, backend, "fx", [(x,)], (x,))
    report = qcore.explain(converted)
    assert not any(e.reason == MASK_REASON for e in report), report.format(verbose=True)
    assert report["out"].status.value == "quantized"
