"""Lowered vs reference where int8 products saturate (issue 13, silent accuracy).

On an x86 CPU without VNNI (AVX2), fbgemm and oneDNN multiply uint8 activations by
int8 weights with ``vpmaddubsw``, which sums pairs of products in 16 bits: with
activations above 127 and large weights the sums saturate and the output drifts by
many steps. torch.ao's fbgemm/x86 QConfigs avoid that with 7-bit activations
(``reduce_range``), but some activations use all 8 bits whatever the QConfig says:
the outputs of sigmoid, softmax and tanh (fixed qparams, 0..255), and any activation
observed over 0..255. For those inputs the kernel's weights are requantized to 7 bits
(``PackedWeights.use_seven_bit_weights``: 2 * 255 * 64 fits int16), and explain says
so. Measured on :class:`SigmoidSoftmax` with fbgemm (reference 37.5 dB against float;
latency at batch 16, one thread): 8-bit weights 30.9 dB, 0.62 ms; the input
requantized to 7 bits before the kernel (torch.ao's way) 33.3 dB, 0.71 ms; those two
ops left in reference form 37.5 dB, 1.09 ms; on qnnpack's kernels 37.5 dB, 1.03 ms;
7-bit weights 35.8 dB, 0.64 ms. On a larger model (a 128-channel 3x3 conv after the
sigmoid, batch 8): reference 38.4 dB; 8-bit weights 37.1 dB, 16.0 ms; 7-bit input
36.2 dB, 16.8 ms; reference form 38.4 dB, 41.8 ms; 7-bit weights 38.0 dB, 16.8 ms.
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
from backends import backend_params
from torch import nn

import qcore
from qcore.engine.lower import SEVEN_BIT_WEIGHTS
from qcore.kernels.packed import PackedWeights
from qcore.kernels.runtime import SATURATING_ENGINES, int8_products_saturate

pytestmark = pytest.mark.skipif(
    not int8_products_saturate(), reason="this CPU sums int8 products in 32 bits (VNNI)"
)


class SigmoidSoftmax(nn.Module):
    """sigmoid -> conv and softmax -> linear: inputs using all 8 bits, large weights
    (as trained networks have) that saturate 16-bit pair sums."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.sigmoid = nn.Sigmoid()
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc1 = nn.Linear(32 * 8 * 8, 8)
        self.softmax = nn.Softmax(dim=1)
        self.fc2 = nn.Linear(8, 10)
        with torch.no_grad():
            self.conv2.weight.mul_(4)
            self.fc2.weight.mul_(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv2(self.sigmoid(self.conv1(x))))
        return self.fc2(self.softmax(self.fc1(torch.flatten(x, 1))))


def _sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (reference - actual).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(reference.norm().item() / noise)


def _batches(n: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 3, 8, 8, generator=generator) * 2 for _ in range(n)]


def _converted(backend: str):
    torch.manual_seed(0)
    model = SigmoidSoftmax().eval()
    calibration = _batches(4, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fixed-qparams op's override notice, reduce_range
        prepared = qcore.prepare_fx(model, None, (calibration[0],), backend)
        with torch.no_grad():
            for batch in calibration:
                prepared(batch)
        return model, qcore.convert_to_reference_fx(prepared), qcore.convert_fx(prepared)


def _scores(model, reference, lowered) -> dict[str, float]:
    with torch.no_grad():
        inputs = _batches(4, seed=2)
        expected = torch.cat([model(x) for x in inputs])
        ref = torch.cat([reference(x) for x in inputs])
        low = torch.cat([lowered(x) for x in inputs])
    return {
        "reference vs float": _sqnr(expected, ref),
        "lowered vs float": _sqnr(expected, low),
        "lowered vs reference": _sqnr(ref, low),
    }


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86", "onednn")))
def test_lowered_stays_close_to_the_reference_where_int8_products_would_saturate(backend):
    model, reference, lowered = _converted(backend)
    scores = _scores(model, reference, lowered)
    # reference 37.5 dB vs float; lowered with 8-bit weights 30.9 (30.5 dB from the
    # reference), with 7-bit weights 35.8 (35.0 from the reference)
    assert scores["lowered vs float"] > scores["reference vs float"] - 2, scores
    assert scores["lowered vs reference"] > 34, scores
    notes = {e.node: e.reason for e in qcore.explain(lowered).quantized if e.kernel}
    narrowed = sorted(name for name, reason in notes.items() if reason == SEVEN_BIT_WEIGHTS)
    # conv1 and fc1 read 7-bit inputs (the QConfig's reduce_range): weights unchanged
    assert narrowed == ["conv2", "fc2"], notes


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86")))
def test_seven_bit_weights_survive_save_and_load(backend):
    """The narrowed weights are the kernel's state: a state_dict brings them, and 8-bit
    weights loaded into such a kernel (a state_dict saved where products do not
    saturate) are narrowed again."""
    model, _, lowered = _converted(backend)
    x = _batches(1, seed=3)[0]
    kernel = lowered.conv2
    assert isinstance(kernel, PackedWeights) and kernel.seven_bit_weights
    assert kernel.weight_int.abs().max().item() == 64
    assert kernel.weight_zero_point.eq(0).all()
    buffer = io.BytesIO()
    torch.save(lowered, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x), lowered(x))
    # 8-bit weights (the reference's), as a CPU with VNNI would have saved them
    _, reference, fresh = _converted(backend)
    eight_bit = fresh.state_dict()
    (name,) = reference.conv2.weight_qparams  # "0.weight": conv2 is fused with relu
    qparams = reference.conv2.weight_qparams[name]
    eight_bit["conv2.weight_int"] = reference.conv2.integer_weight(name)
    eight_bit["conv2.weight_scale"] = qparams.scale.double().reshape(-1)
    eight_bit["conv2.weight_zero_point"] = qparams.zero_point.long().reshape(-1)
    assert eight_bit["conv2.weight_int"].abs().max().item() == 127
    fresh.load_state_dict(eight_bit)
    assert fresh.conv2.weight_int.abs().max().item() == 64
    with torch.no_grad():
        assert torch.equal(fresh(x), lowered(x))


def test_the_saturating_engines_are_the_ones_the_kernels_run_on():
    from qcore.kernels.library import ENGINES

    assert set(SATURATING_ENGINES) == set(ENGINES) - {"qnnpack"}


@pytest.mark.parametrize("backend", backend_params(("fbgemm",)))
def test_inputs_observed_over_eight_bits_get_seven_bit_weights(backend):
    """A QConfig whose activations use 0..255 (qnnpack's, here on fbgemm): every conv's
    input may use the 8th bit, so every conv gets 7-bit weights; the default
    (reduce_range) QConfig leaves the first conv's alone (see above)."""
    torch.manual_seed(0)
    model = SigmoidSoftmax().eval()
    calibration = _batches(2, seed=1)
    mapping = qcore.get_default_qconfig_mapping("qnnpack")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(model, mapping, (calibration[0],), backend)
        with torch.no_grad():
            for batch in calibration:
                prepared(batch)
        lowered = qcore.convert_fx(prepared)
        reference = qcore.convert_to_reference_fx(prepared)
    notes = {e.node: e.reason for e in qcore.explain(lowered).quantized if e.kernel}
    narrowed = sorted(name for name, reason in notes.items() if reason == SEVEN_BIT_WEIGHTS)
    assert narrowed == ["conv1", "conv2", "fc1", "fc2"], notes
    scores = _scores(model, reference, lowered)
    assert scores["lowered vs float"] > scores["reference vs float"] - 2, scores
