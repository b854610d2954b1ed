"""Every kernel against the reference form, on each backend's own engine.

For each case of ``kernel_cases`` (one op or fused chain per model) and each
backend: the converted model runs the expected kernel (or, where the engine
has none, stays in reference form and explain gives the reason), and its
output, run with torch.backends.quantized.engine set to the backend as its
users do, agrees with ``convert_to_reference_fx``'s within one quantization step
of the output (plus float rounding).

Legitimate differences, bounded differently:
* dynamic linear: float output; the kernel quantizes its input on the fly like
  the reference, so the outputs agree to float rounding (1e-4 relative). On a
  CPU where fbgemm's int8 products saturate (x86 without VNNI) the fbgemm/x86
  kernels quantize it to 7 bits (as torch.ao's dynamic modules always do) where
  the reference uses 8: the bound is an SQNR of 30 dB.
* dynamic LSTM/GRU: the kernels also quantize the hidden state at every step
  where the reference runs the float cell; the bound is an SQNR of 30 dB.
* embeddings (weight-only): the same dequantized rows; float rounding.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from backends import FIRST_PARTY, backend_params, requires_fbgemm
from kernel_cases import CASES, build, output_scale
from zoo.baseline import quantized_engine

import qcore
from qcore.kernels import PACKED_AS, UNAVAILABLE
from qcore.kernels.runtime import (
    SATURATING_ENGINES,
    int8_products_saturate,
    quiet_quantized_tensors,
)


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _sqnr(reference, actual) -> float:
    noise = (reference - actual).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(reference.norm().item() / noise)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name, backend):
    case = CASES[name]
    built = build(case, backend)
    report = qcore.explain(built.converted)
    kernel = f"{backend}.{case.family}"
    unavailable = UNAVAILABLE.get(backend, {}).get(case.family)
    used = {entry.kernel for entry in report.quantized}
    if unavailable is not None:
        assert kernel not in used
        reasons = " ".join(entry.reason for entry in report.reference)
        assert unavailable in reasons, reasons
    elif case.mapping == "fp16" and backend == "qnnpack":
        # the reason that applies comes first, where the table shows it (the static
        # kernel's "needs one quantized input ..." after it), without an error name
        (entry,) = report.reference
        assert entry.reason.startswith(f"kernel {kernel}: qnnpack has no fp16 packed"), entry.reason
        assert "KernelUnavailable" not in entry.reason
    else:
        assert kernel in used, str(report)
    with torch.no_grad(), quantized_engine(backend):
        actual = _first(built.converted(*built.inputs))
        expected = _first(built.reference(*built.inputs))
    assert actual.shape == expected.shape and not actual.is_quantized
    seven_bit = case.mapping == "dynamic" and backend in SATURATING_ENGINES
    if case.family == "rnn_dynamic" or (seven_bit and int8_products_saturate()):
        assert _sqnr(expected, actual) > 30
    elif case.mapping == "fp16":
        # the one difference: the reference form rounds the input to float16 too;
        # the kernel takes it in float32, as torch.ao's does. Given it rounded: equal.
        rounded = tuple(x.half().float() for x in built.inputs)
        with torch.no_grad(), quantized_engine(backend):
            on_rounded = _first(built.converted(*rounded))
        torch.testing.assert_close(on_rounded, expected, rtol=1e-4, atol=1e-5)
        assert _sqnr(expected, actual) > 50
    elif case.mapping != "default":
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    else:
        step = output_scale(built.reference)
        worst = (actual - expected).abs().max().item()
        assert worst <= step * (1 + 1e-4), f"{worst / step:.3f} steps"


@requires_fbgemm
def test_averaging_op_with_its_own_output_qparams_stays_in_reference_form():
    """avg pooling keeps its input's qparams in torch's kernel: a reference asking for
    other output qparams is not lowered (it would round twice), and explain says why."""
    from kernel_cases import Case

    case = Case(lambda: torch.nn.AdaptiveAvgPool2d(1), ((2, 3, 4, 4),), "average")
    built = build(case, "fbgemm")
    report = qcore.explain(built.converted)
    (entry,) = [e for e in report.ops if e.op == "AdaptiveAvgPool2d"]
    if entry.status.value == "reference":
        assert "differ from the input's" in entry.reason
    with torch.no_grad():
        worst = (built.converted(*built.inputs) - built.reference(*built.inputs)).abs().max()
    assert worst <= output_scale(built.reference) * (1 + 1e-4)


def test_kernel_library_covers_every_engine():
    from qcore.kernels import kernels_for

    for engine in FIRST_PARTY:
        kernels = kernels_for(engine)
        assert all(k.name.startswith(engine + ".") for k in kernels)
        packed_as = PACKED_AS.get(engine, {})
        for kernel in kernels:
            family = kernel.name.removeprefix(engine + ".")
            assert kernel.engine == packed_as.get(family, engine), kernel.name
    assert {k.engine for k in kernels_for("x86") if "conv_transpose" in k.name} == {"fbgemm"}
    with pytest.raises(ValueError, match="covers"):
        kernels_for("mychip")


@pytest.mark.parametrize("engine", ["fbgemm", "qnnpack"])
@pytest.mark.parametrize(
    "shape, layout",
    [
        ((2, 8, 5, 5), torch.channels_last),
        ((2, 8, 3, 4, 4), torch.channels_last_3d),
        ((2, 8, 5, 5), torch.contiguous_format),
    ],
    ids=["channels_last", "channels_last_3d", "contiguous"],
)
def test_clamp_and_elu_keep_their_input_layout(engine, shape, layout):
    """An int8 conv returns channels-last: the clamp (relu6, hardtanh) and elu kernels
    return that layout too, so the next conv does not copy its input, and their values
    are right in every layout (torch 2.13's qnnpack clamp alone scrambles channels-last)."""
    from qcore.kernels.activations import QuantizedClamp, QuantizedELU
    from qcore.plugin.kernels import ActivationQParams

    quiet_quantized_tensors()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) * 3
    qx = torch.quantize_per_tensor(x, 0.05, 128, torch.quint8).contiguous(memory_format=layout)
    output = ActivationQParams(0.04, 100, torch.quint8)
    with quantized_engine(engine):
        clamped = QuantizedClamp(0.0, 6.0, None)(qx)
        elu = QuantizedELU(output, 0.5)(qx)
        strided = QuantizedClamp(0.0, 6.0, None)(qx[:, ::2])  # neither layout: copied
    for result in (clamped, elu):
        assert result.is_contiguous(memory_format=layout)
    assert torch.equal(clamped.dequantize(), qx.dequantize().clamp(0, 6))
    assert torch.equal(strided.dequantize(), qx[:, ::2].dequantize().clamp(0, 6))
    expected = torch.quantize_per_tensor(F.elu(qx.dequantize(), 0.5), 0.04, 100, torch.quint8)
    assert (elu.int_repr().int() - expected.int_repr().int()).abs().max() <= 1


def test_clamp_requantizes_to_its_own_output_qparams():
    from qcore.kernels.activations import QuantizedClamp
    from qcore.plugin.kernels import ActivationQParams

    quiet_quantized_tensors()
    qx = torch.quantize_per_tensor(torch.linspace(-4, 8, 50), 0.05, 128, torch.quint8)
    output = ActivationQParams(0.025, 0, torch.quint8)
    result = QuantizedClamp(0.0, 6.0, output)(qx)
    assert (result.q_scale(), result.q_zero_point()) == (0.025, 0)
    assert torch.equal(result.dequantize(), qx.dequantize().clamp(0, 6))
