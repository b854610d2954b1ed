"""The ``onednn`` backend (the x86 plugin's second entry point) on the FX path.

torch.ao's onednn config fuses ``conv2d [-> bn] -> add(other) [-> relu]`` and
``linear -> leaky_relu/tanh`` at prepare; the fused modules must run as one
oneDNN kernel (a conv with a sum, ``onednn::qconv2d_pointwise.binary``, where
torch.ao's onednn backend calls ``quantized::conv2d_add[_relu]``, which needs the
global engine set to onednn; oneDNN's pointwise ops for the linears), agree with
the reference form within one output step, save and load, and warn about nothing.
"""

import io
import operator
import warnings

import pytest
import torch
from torch import nn

import qcore
from qcore.config.fusers import FusionError


class Residual(nn.Module):
    """``relu?(bn?(conv(x)) + shortcut(x))`` with the conv on either side of the add."""

    def __init__(self, add, conv_left, bn, relu):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8) if bn else nn.Identity()
        self.shortcut = nn.Conv2d(8, 8, 1)
        self.relu = nn.ReLU() if relu else nn.Identity()
        self.add, self.conv_left = add, conv_left
        with torch.no_grad():
            if bn:
                self.bn.running_mean.uniform_(-0.5, 0.5)
                self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        y, shortcut = self.bn(self.conv(x)), self.shortcut(x)
        y = self.add(y, shortcut) if self.conv_left else self.add(shortcut, y)
        return nn.functional.max_pool2d(self.relu(y), 1)  # keeps the output int8


class LinearPost(nn.Module):
    def __init__(self, post):
        super().__init__()
        self.fc, self.post = nn.Linear(16, 12), post

    def forward(self, x):
        y = self.post(self.fc(x))
        return torch.cat([y, y], dim=-1)  # keeps the output int8


def _batches(shape, count=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=generator),) for _ in range(count)]


def _prepare(model, shape, seed=0):
    torch.manual_seed(seed)
    batches = _batches(shape, seed=seed)
    mapping = qcore.get_default_qconfig_mapping("onednn")
    # tanh's default QConfig has fixed qparams, linear's not: a LinearTanh needs one
    # QConfig for both (with the default mapping it stays float, with that reason)
    mapping.set_object_type(nn.Tanh, mapping.global_qconfig)
    prepared = qcore.prepare_fx(model.eval(), mapping, batches[0], "onednn")
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    return prepared, batches


def _kernels(converted):
    return {(e.op, e.kernel) for e in qcore.explain(converted).quantized}


def _assert_within_one_step(lowered, reference, batches, step):
    with torch.no_grad():
        for batch in batches:
            error = (lowered(*batch) - reference(*batch)).abs().max()
            assert error <= step * 1.0001, f"{error} > one step {step}"


@pytest.mark.parametrize("relu", [True, False], ids=["relu", "no-relu"])
@pytest.mark.parametrize("bn", [True, False], ids=["bn", "no-bn"])
@pytest.mark.parametrize("conv_left", [True, False], ids=["conv-left", "conv-right"])
@pytest.mark.parametrize("add", [torch.add, operator.add], ids=["torch.add", "operator.add"])
def test_conv_add_runs_as_one_onednn_kernel_within_one_step(add, conv_left, bn, relu):
    torch.manual_seed(0)
    prepared, batches = _prepare(Residual(add, conv_left, bn, relu), (2, 8, 10, 10))
    reference = qcore.convert_to_reference_fx(prepared)
    lowered = qcore.convert_fx(prepared)
    fused = "ConvAddReLU2d" if relu else "ConvAdd2d"
    assert (fused, "onednn.conv2d_add") in _kernels(lowered)
    assert not [n for n in lowered.graph.nodes if n.target in (torch.add, operator.add)]
    _assert_within_one_step(
        lowered, reference, _batches((2, 8, 10, 10), seed=1), lowered.conv.scale
    )


@pytest.mark.parametrize(
    ("post", "fused"),
    [(nn.LeakyReLU(0.1), "LinearLeakyReLU"), (nn.Tanh(), "LinearTanh")],
    ids=["leaky_relu", "tanh"],
)
def test_linear_with_eltwise_runs_on_onednn_within_one_step(post, fused):
    prepared, batches = _prepare(LinearPost(post), (4, 16))
    reference = qcore.convert_to_reference_fx(prepared)
    lowered = qcore.convert_fx(prepared)
    assert (fused, "x86.onednn_linear") in _kernels(lowered)
    _assert_within_one_step(lowered, reference, _batches((4, 16), seed=1), lowered.fc.scale)


def test_the_add_operand_computed_after_the_conv_is_wired_in_order():
    """``shortcut`` is traced after ``conv``: the fused call moves to the add's place."""
    prepared, _ = _prepare(Residual(operator.add, True, True, True), (1, 8, 6, 6))
    order = [n.name for n in prepared.graph.nodes if n.op == "call_module"]
    assert order.index("shortcut") < order.index("conv")
    conv = next(n for n in prepared.graph.nodes if n.name == "conv")
    assert len(conv.args) == 2


def test_qat_trains_the_batchnorm_of_a_conv_bn_add():
    """conv + BatchNorm + add fuses into ConvAdd2d with the BatchNorm folded for
    good; QAT, which trains it, fuses conv + BatchNorm and leaves the add (prepare
    raised FusionError, as torch.ao's onednn config does)."""
    model = Residual(operator.add, True, True, True).train()
    mapping = qcore.get_default_qat_qconfig_mapping("onednn")
    prepared = qcore.prepare_qat_fx(model, mapping, (torch.randn(1, 8, 6, 6),), "onednn")
    # conv + bn trains as ConvBn2d; the shortcut conv (no BatchNorm) still takes the add
    assert type(prepared.conv).__name__ == "ConvBn2d"
    assert type(prepared.shortcut).__name__ == "ConvAddReLU2d"


def test_a_direct_qat_call_of_the_fuser_still_says_what_to_do():
    from qcore.config.onednn_fusions import fuse_conv_add

    conv, bn = nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)
    with pytest.raises(FusionError, match="is_qat=True.*backend 'x86'"):
        fuse_conv_add(True, operator.add, (bn, conv), None)


def test_save_load_and_no_warnings():
    prepared, batches = _prepare(Residual(operator.add, True, True, True), (2, 8, 10, 10))
    lowered = qcore.convert_fx(prepared)
    other, _ = _prepare(Residual(operator.add, True, True, True), (2, 8, 10, 10), seed=3)
    fresh = qcore.convert_fx(other)
    fresh.load_state_dict(lowered.state_dict())
    buffer = io.BytesIO()
    torch.save(lowered, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            expected = lowered(*batch)
            assert torch.equal(fresh(*batch), expected)
            assert torch.equal(loaded(*batch), expected)
    assert [str(w.message) for w in caught] == []


def test_prepare_leaves_the_users_model_alone():
    model = Residual(operator.add, True, True, True).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _prepare(model, (1, 8, 6, 6))
    assert isinstance(model.bn, nn.BatchNorm2d)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_linear_tanh_with_the_default_mapping_says_why_it_stays_float():
    mapping = qcore.get_default_qconfig_mapping("onednn")
    inputs = (torch.randn(4, 16),)
    prepared = qcore.prepare_fx(LinearPost(nn.Tanh()).eval(), mapping, inputs, "onednn")
    (entry,) = [e for e in qcore.explain(prepared).entries if e.node == "fc"]
    assert entry.status.value == "float" and "different QConfigs" in entry.reason
