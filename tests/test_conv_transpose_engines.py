"""torch 2.13's fbgemm int8 conv_transpose2d is 200-255 steps off for 2-row kernels
with 8k input and output channels on AVX512 CPUs: UNet's ``ConvTranspose2d(C, C, 2,
stride=2)`` came out at -10 dB on x86 and fbgemm (torch.ao's fbgemm model too).
Each transposed conv is now checked once at lowering and packed for qnnpack where
its engine's kernel is off; the lowered model agrees with the reference form."""

import pytest
import torch
from backends import backend_params

import qcore

SHAPES = [  # (in, out, kernel, stride, padding, output_padding)
    (8, 8, 2, 2, 0, 0),  # UNet's up-conv
    (16, 8, (2, 3), 1, 0, 0),
    (8, 16, 2, 2, 0, 1),
    (3, 8, 3, 2, 1, 1),
    (4, 8, 2, 2, 0, 0),
]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_lowered_transposed_conv_agrees_with_its_reference_form(backend, shape) -> None:
    cin, cout, kernel, stride, padding, output_padding = shape
    layer = torch.nn.ConvTranspose2d(cin, cout, kernel, stride, padding, output_padding)
    model = torch.nn.Sequential(layer).eval()
    torch.manual_seed(0)
    batches = [(torch.randn(2, cin, 8, 8),) for _ in range(3)]
    prepared = qcore.prepare_fx(model, None, batches[0], backend=backend)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    reference, lowered = qcore.convert_to_reference_fx(prepared), qcore.convert_fx(prepared)
    entry = qcore.explain(lowered)["_0"]
    assert entry.status.value == "quantized", entry
    scale = lowered.get_submodule("0").scale
    with torch.no_grad():
        for batch in batches:
            steps = (lowered(*batch) - reference(*batch)).abs().max() / scale
            assert steps <= 2.01, (entry, float(steps))
