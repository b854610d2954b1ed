"""Lowered vs reference where int8 products saturate (issue 13, silent accuracy).

On an x86 CPU without VNNI (AVX2), fbgemm and oneDNN multiply uint8 activations by
int8 weights with ``vpmaddubsw``, which sums pairs of products in 16 bits: with
activations above 127 and large weights the sums saturate and the output drifts by
many steps. torch.ao's fbgemm/x86 QConfigs avoid that with 7-bit activations
(``reduce_range``), but some activations use all 8 bits whatever the QConfig says:
the outputs of sigmoid, softmax and tanh (fixed qparams, 0..255), and any activation
observed over 0..255. A kernel with such an input, whose weights could overflow a pair
sum, is packed for qnnpack instead (16-bit products, 32-bit sums: the reference's
numbers), or left in reference form where qnnpack cannot run it; explain says which.
Measured on :class:`SigmoidSoftmax` with fbgemm (reference 37.5 dB against float;
latency at batch 16, one thread): 8-bit weights 30.9 dB, 0.62 ms; the input
requantized to 7 bits before the kernel (torch.ao's way) 33.3 dB, 0.71 ms; those two
ops left in reference form 37.5 dB, 1.09 ms; on qnnpack's kernels 37.5 dB, 1.03 ms;
7-bit weights 35.8 dB, 0.64 ms, but 1.5 dB below torch.ao's 8-bit kernels where the
data never saturates them (tests/test_properties_vs_torch_ao.py found it), so qcore
takes the exact kernel.
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
from qcore.engine.lower import ON_EXACT_ENGINE, SATURATING_SUMS
from qcore.kernels.packed import PackedWeights
from qcore.kernels.runtime import (
    EXACT_ENGINE,
    SATURATING_ENGINES,
    int8_products_saturate,
    pair_sums_may_saturate,
)

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


def _notes(lowered) -> dict[str, str]:
    return {e.node: e.reason for e in qcore.explain(lowered).entries if e.reason}


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86", "onednn")))
def test_lowered_matches_the_reference_where_int8_products_would_saturate(backend):
    model, reference, lowered = _converted(backend)
    scores = _scores(model, reference, lowered)
    # 8-bit weights on fbgemm: 30.9 dB vs float, 30.5 dB from the reference
    assert scores["lowered vs float"] > scores["reference vs float"] - 0.1, scores
    assert scores["lowered vs reference"] > 50, scores
    notes = _notes(lowered)
    exact = sorted(name for name, reason in notes.items() if reason == ON_EXACT_ENGINE)
    in_reference = sorted(name for name, reason in notes.items() if reason == SATURATING_SUMS)
    # conv1 and fc1 read 7-bit inputs (the QConfig's reduce_range): left on the backend
    assert sorted(exact + in_reference) == ["conv2", "fc2"], notes
    for name in exact:
        assert lowered.get_submodule(name).engine == EXACT_ENGINE
    assert lowered.conv1.engine != EXACT_ENGINE


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86")))
def test_a_kernel_moved_to_the_exact_engine_stays_there_through_save_and_load(backend):
    """The engine is the kernel's state: torch.save brings it, and a state_dict
    loaded into a freshly lowered model is packed for it again, whatever the
    global engine says."""
    _, _, lowered = _converted(backend)
    x = _batches(1, seed=3)[0]
    assert isinstance(lowered.conv2, PackedWeights) and lowered.conv2.engine == EXACT_ENGINE
    buffer = io.BytesIO()
    torch.save(lowered, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.conv2.engine == EXACT_ENGINE
    _, _, fresh = _converted(backend)
    fresh.load_state_dict(lowered.state_dict())
    with torch.no_grad():
        expected = lowered(x)
        assert torch.equal(loaded(x), expected)
        assert torch.equal(fresh(x), expected)


def test_the_saturating_engines_are_the_ones_the_kernels_run_on():
    from qcore.kernels.library import ENGINES

    assert set(SATURATING_ENGINES) == set(ENGINES) - {EXACT_ENGINE}


@pytest.mark.parametrize(
    ("weights", "input_max", "may_saturate"),
    [
        ([127, 1, -5], 255, False),  # 255 * 128 = 32640 fits int16
        ([127, 2, -5], 255, True),  # 255 * 129 = 32895 does not
        ([127, 127, -5], 127, False),  # 7-bit inputs: torch.ao's reduce_range
        ([-128, -1, 3], 255, True),  # -32895 < -32768
        ([127, -128, 100, -100], 255, True),  # 127 + 100: same sign adds up
        ([127, -128, 1, 0], 255, False),  # opposite signs cancel
        ([127], 255, False),
        ([[127, 2], [-5, 0]], 255, True),
        ([[127, 0], [127, 0]], 255, False),  # each output channel sums its own pairs
    ],
)
def test_pair_sums_may_saturate(weights, input_max, may_saturate):
    weight = torch.tensor(weights, dtype=torch.int8)
    assert pair_sums_may_saturate(weight, input_max) is may_saturate


def test_pair_sums_of_transposed_convs_run_along_their_input_channels():
    weight = torch.zeros(4, 2, 1, dtype=torch.int8)  # (in, out, kernel)
    weight[0, 0, 0] = weight[0, 1, 0] = 127  # each output channel: one large weight
    assert not pair_sums_may_saturate(weight, 255, output_axis=1)
    assert pair_sums_may_saturate(weight, 255, output_axis=0)


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86")))
def test_small_weights_stay_on_the_backend_engine(backend):
    """Weights no pair of products can overflow keep the backend's own kernel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sigmoid(), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].weight[:, 0] = 1.0  # one large weight a row: no pair reaches int16
    x = torch.randn(8, 16) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_fx(model, None, (x,), backend)
        with torch.no_grad():
            prepared(x)
        lowered = qcore.convert_fx(prepared)
    kernel = lowered.get_submodule("1")
    assert isinstance(kernel, PackedWeights) and kernel.engine != EXACT_ENGINE, _notes(lowered)


@pytest.mark.parametrize("backend", backend_params(("fbgemm",)))
def test_inputs_observed_over_eight_bits_move_every_kernel(backend):
    """A QConfig whose activations use 0..255 (qnnpack's, here on fbgemm): every conv's
    input may use the 8th bit, so every conv and linear runs on the exact engine; the
    default (reduce_range) QConfig leaves the first conv on fbgemm (see above)."""
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
    notes = _notes(lowered)
    exact = sorted(name for name, reason in notes.items() if reason == ON_EXACT_ENGINE)
    assert exact == ["conv1", "conv2", "fc1", "fc2"], notes
    scores = _scores(model, reference, lowered)
    assert scores["lowered vs reference"] > 50, scores
