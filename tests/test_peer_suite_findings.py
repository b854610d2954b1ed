"""Regression tests for what the peers' own suites found (tests/peer_suite).

Each is a model from a torch.ao FX test that qcore quantized differently from
torch.ao, checked here the way a user would: which ops run on int8 kernels, and
that the numbers equal the reference form's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params, installed
from torch import nn
from torch.ao.quantization import default_qconfig

import qcore


def _converted(model: nn.Module, x: torch.Tensor, backend: str, reference: bool = False):
    prepared = qcore.prepare_fx(model.eval(), {"": default_qconfig}, (x,), backend)
    with torch.no_grad():
        prepared(x)
    return (qcore.convert_to_reference_fx if reference else qcore.convert_fx)(prepared)


def _calls(model: torch.fx.GraphModule, op: str, target) -> int:
    return sum(1 for n in model.graph.nodes if n.op == op and n.target == target)


class SelfAdd(nn.Module):
    def forward(self, x):
        return torch.channel_shuffle(x + x, 2) + x


class ChannelShuffleModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shuffle = nn.ChannelShuffle(2)

    def forward(self, x):
        return self.shuffle(x + x) + x


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86", "qnnpack", "native")))
@pytest.mark.parametrize("model", [SelfAdd(), ChannelShuffleModule()], ids=type)
def test_x_plus_x_and_channel_shuffle_run_on_int8(backend, model):
    x = torch.randn(4, 4, 4, 4)
    converted = _converted(model, x, backend)
    report = qcore.explain(converted)
    assert not report.reference, report  # `x + x` used to be refused: one operand seen
    assert not report.float, report  # channel_shuffle used to stay float
    assert _calls(converted, "call_function", torch.quantize_per_tensor) == 1
    assert _calls(converted, "call_method", "dequantize") == 1
    expected = _converted(model, x, backend, reference=True)(x)
    assert torch.equal(converted(x), expected)


class ConvPlusNumber(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3)

    def forward(self, x):
        return self.conv(x) + 3


@pytest.mark.parametrize("backend", backend_params(("onednn", "native")))
def test_conv_plus_a_number_is_not_a_conv_add(backend):
    """onednn's conv-add fusion took `conv(x) + 3` for a residual add (its
    MatchAllNode matched the constant 3); the fused module then had no kernel."""
    model, x = ConvPlusNumber(), torch.randn(2, 3, 8, 8)
    converted = _converted(model, x, backend)
    report = qcore.explain(converted)
    assert [e.op for e in report.quantized] == ["Conv2d", "add"], report
    assert torch.equal(converted(x), _converted(model, x, backend, reference=True)(x))


class ShapeBetweenConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 2, 2)
        self.conv2 = nn.Conv2d(2, 2, 2)

    def forward(self, x):
        x = self.conv1(x)
        torch._assert(x.shape == x.size(), "")
        return self.conv2(x)


@pytest.mark.skipif(not installed("fbgemm"), reason="needs the fbgemm plugin")
def test_a_shape_query_reads_the_int8_tensor():
    """`x.shape` on a kernel's output used to dequantize the whole tensor for it."""
    model, x = ShapeBetweenConvs(), torch.randn(2, 2, 4, 4)
    converted = _converted(model, x, "fbgemm")
    assert _calls(converted, "call_method", "dequantize") == 1  # the output's only
    assert torch.equal(converted(x), _converted(model, x, "fbgemm", True)(x))


class FloatFunctionals(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add = torch.ao.nn.quantized.FloatFunctional()
        self.cat = torch.ao.nn.quantized.FloatFunctional()

    def forward(self, x):
        return self.cat.cat([self.add.add_relu(x, x)])


@pytest.mark.skipif(not installed("fbgemm"), reason="needs the fbgemm plugin")
def test_float_functional_gets_no_observers_of_its_own():
    """FloatFunctional's `activation_post_process` Identity traced as an op and got
    observers of its own (torch.ao swaps it for FXFloatFunctional)."""
    model, x = FloatFunctionals().eval(), torch.randn(3, 3)
    prepared = qcore.prepare_fx(model, {"": default_qconfig}, (x,), "fbgemm")
    observers = [n.target for n in prepared.graph.nodes if n.op == "call_module"]
    assert observers == [f"activation_post_process_{i}" for i in range(3)]  # input, add, cat
    assert isinstance(model.add, torch.ao.nn.quantized.FloatFunctional)  # the user's, untouched


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(2)

    def forward(self, x):
        return self.pool(x)


@pytest.mark.skipif(not installed("fbgemm"), reason="needs the fbgemm plugin")
def test_a_shared_observer_has_a_name_per_call_as_in_torch_ao():
    x = torch.randn(1, 3, 4, 4)
    prepared = qcore.prepare_fx(Pool().eval(), {"": default_qconfig}, (x,), "fbgemm")
    assert prepared.activation_post_process_0 is prepared.activation_post_process_1
    prepared(x)
    converted = qcore.convert_fx(prepared)
    step = prepared.activation_post_process_1.calculate_qparams()[0].item()
    # the decomposed reference rounds a tie (a mean of 4) the other way at times
    worst = (converted(x) - qcore.convert_to_reference_fx(prepared)(x)).abs().max().item()
    assert worst <= step * (1 + 1e-4)
    # no name of the shared observer outlives convert (an unused one broke TorchScript)
    names = [name for name, _ in converted.named_modules(remove_duplicate=False)]
    assert not [name for name in names if "activation_post_process" in name]


@pytest.mark.skipif(not installed("fbgemm"), reason="needs the fbgemm plugin")
@pytest.mark.parametrize("convert", [qcore.convert_fx, qcore.convert_to_reference_fx])
def test_nodes_keep_the_stack_trace_of_the_users_forward(convert):
    x = torch.randn(2, 2, 4, 4)
    prepared = qcore.prepare_fx(ShapeBetweenConvs().eval(), {"": default_qconfig}, (x,), "fbgemm")
    prepared(x)
    for model in (prepared, convert(prepared)):
        conv = next(n for n in model.graph.nodes if n.target == "conv1")
        assert "x = self.conv1(x)" in conv.stack_trace


@pytest.mark.skipif(not installed("fbgemm"), reason="needs the fbgemm plugin")
def test_torch_ao_observer_state_dict_utilities_take_qcore_observers():
    """torch.ao's get/load_observer_state_dict know observers by torch.ao's base
    classes: with qcore's own HistogramObserver built from torch.ao's QConfig, a
    saved calibration was silently not loaded (every scale 1.0)."""
    model, x = ShapeBetweenConvs().eval(), torch.randn(2, 2, 4, 4)
    mapping = {"": torch.ao.quantization.get_default_qconfig("fbgemm")}
    calibrated = qcore.prepare_fx(model, mapping, (x,), "fbgemm")
    calibrated(x)
    fresh = qcore.prepare_fx(model, mapping, (x,), "fbgemm")
    state = torch.ao.quantization.get_observer_state_dict(calibrated)
    torch.ao.quantization.load_observer_state_dict(fresh, state)
    assert torch.equal(qcore.convert_fx(fresh)(x), qcore.convert_fx(calibrated)(x))


class LinearThen(nn.Module):
    def __init__(self, activation: nn.Module, with_bn: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4) if with_bn else None
        self.activation = activation

    def forward(self, x):
        x = self.linear(x)
        return self.activation(x if self.bn is None else self.bn(x))


_FUSED_FOR_ONEDNN = {
    nn.Tanh: torch.ao.nn.intrinsic.LinearTanh,
    nn.LeakyReLU: torch.ao.nn.intrinsic.LinearLeakyReLU,
}


def _module_classes(model: nn.Module) -> set[type]:
    return {type(module) for module in model.modules()}


@pytest.mark.parametrize("with_bn", [False, True])
@pytest.mark.parametrize("activation", [nn.Tanh, nn.LeakyReLU], ids=lambda c: c.__name__)
def test_fuse_fx_without_a_backend_fuses_what_every_backend_fuses(activation, with_bn):
    """fuse_fx's default fused with native, the installed backends' union, so x86's
    onednn made Linear+Tanh a LinearTanh, a module no other backend quantizes.
    Without a backend it fuses as torch.ao's default (its native config) does."""
    model = LinearThen(activation(), with_bn).eval()
    fused = qcore.fuse_fx(model)
    assert {nn.Linear, activation} <= _module_classes(fused)  # a batch norm folds in
    assert _FUSED_FOR_ONEDNN[activation] not in _module_classes(fused)
    # the standard fusions still happen
    standard = qcore.fuse_fx(LinearThen(nn.ReLU()).eval())
    assert torch.ao.nn.intrinsic.LinearReLU in _module_classes(standard)
    # asked for by name, the backend's own fusions apply (onednn: Linear [+ BatchNorm1d]
    # + LeakyReLU, Linear + Tanh)
    if installed("onednn") and not (with_bn and activation is nn.Tanh):
        by_name = qcore.fuse_fx(model, backend="onednn")
        assert _FUSED_FOR_ONEDNN[activation] in _module_classes(by_name)
    x = torch.randn(3, 4)
    torch.testing.assert_close(fused(x), model(x))


def test_fuse_fx_default_fusions_are_torch_ao_native_ones():
    import torch.ao.quantization.backend_config.utils  # noqa: F401  (native's import needs it)
    from torch.ao.quantization.backend_config import get_native_backend_config

    from qcore.config.standard_ops import standard_fusion_config

    ours = {str(config.pattern) for config in standard_fusion_config().configs}
    native = get_native_backend_config().configs
    assert ours == {str(c.pattern) for c in native if c.fuser_method is not None}


def _legacy_fp16_config():
    import torch.ao.quantization.backend_config.utils  # noqa: F401  (native's import needs it)
    from torch.ao.quantization.backend_config.native import (
        get_test_only_legacy_native_backend_config,
    )

    return get_test_only_legacy_native_backend_config()


class FunctionalLinearFp16(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.randn(64, 30)
        self.b = torch.randn(64) / 3 if bias else None

    def forward(self, x):
        return torch.relu(F.linear(x, self.w, self.b))


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("convert", [qcore.convert_fx, qcore.convert_to_reference_fx])
def test_static_float16_linear_rounds_its_bias_and_stays_functional(bias, convert):
    """torch.ao rounds F.linear's bias to float16 with its weight and input (float16
    static QConfig, a dtype config with bias_dtype float16); qcore left the bias in
    float32. And a static float16 F.linear has no kernel: it stays F.linear on the
    rounded weight (it became a module)."""
    from torch.ao.quantization import float16_static_qconfig

    model, x = FunctionalLinearFp16(bias).eval(), torch.randn(16, 30)
    config = _legacy_fp16_config()
    prepared = qcore.prepare_fx(model, {"": float16_static_qconfig}, (x,), backend_config=config)
    placeholders = [m for m in prepared.modules() if type(m).__name__ == "PlaceholderObserver"]
    assert len(placeholders) == 3 + bias  # input, weight, bias, output
    prepared(x)
    converted = convert(prepared)
    expected = _fp16(torch.relu(F.linear(_fp16(x), _fp16(model.w), _fp16_or_none(model.b))))
    assert torch.equal(converted(x), expected)
    assert _calls(converted, "call_function", F.linear) == 1


def _fp16_or_none(t):
    return None if t is None else _fp16(t)


class ReshapePoolFp16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        return self.pool(x.reshape(2, 3, 8, 8)).flatten(1)


def test_float16_values_stay_float16_through_ops_that_select_them():
    """`to(float16) -> dequantize -> reshape -> to(float16) -> dequantize` is one
    rounding: the lowered model runs such ops on the float16 tensor, as torch.ao's
    lowering does, with the reference form's numbers."""
    from torch.ao.quantization import float16_static_qconfig

    model, x = ReshapePoolFp16().eval(), torch.randn(2, 192)
    config = _legacy_fp16_config()
    prepared = qcore.prepare_fx(model, {"": float16_static_qconfig}, (x,), backend_config=config)
    prepared(x)
    lowered, reference = qcore.convert_fx(prepared), qcore.convert_to_reference_fx(prepared)
    assert _calls(lowered, "call_method", "to") == 1
    assert _calls(lowered, "call_method", "dequantize") == 1
    assert _calls(reference, "call_method", "to") == 3  # the input, reshape and pool outputs
    assert torch.equal(lowered(x), reference(x))
    assert torch.equal(lowered(x), _fp16(model(_fp16(x))))
    assert lowered.graph.find_nodes(op="call_module", target="pool")[0].args[0].target == "reshape"


class FunctionalLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.randn(8, 30)
        self.b = torch.randn(8)

    def forward(self, x):
        return F.linear(x, self.w, self.b)


@pytest.mark.skipif(not installed("fbgemm"), reason="needs the fbgemm plugin")
@pytest.mark.parametrize(
    "qconfig",
    [default_qconfig, torch.ao.quantization.float16_dynamic_qconfig],
    ids=["int8", "dynamic-float16"],
)
def test_reference_form_keeps_a_functional_linear_as_torch_ao_does(qconfig):
    """convert_to_reference_fx wrapped F.linear on constant weights in a
    ReferenceModule (the form lowering takes); torch.ao's reference form, and what
    a user of it matches on, is F.linear on the dequantized weight. The numbers
    equal torch.ao's reference form."""
    from torch.ao.quantization import quantize_fx

    model, x = FunctionalLinear().eval(), torch.rand(4, 30)
    prepared = qcore.prepare_fx(model, {"": qconfig}, (x,), "fbgemm")
    prepared(x)
    reference = qcore.convert_to_reference_fx(prepared)
    assert _calls(reference, "call_function", F.linear) == 1
    assert not any(type(m).__name__ == "ReferenceModule" for m in reference.modules())
    ao_prepared = quantize_fx.prepare_fx(model, {"": qconfig}, (x,))
    ao_prepared(x)
    ao = quantize_fx.convert_to_reference_fx(ao_prepared)
    assert torch.equal(reference(x), ao(x))
    lowered = qcore.convert_fx(prepared)  # lowering still takes it as a linear
    assert qcore.explain(lowered).quantized[0].kernel.startswith("fbgemm.linear")
