"""qcore.config.fusers: results in eval and QAT mode, and the errors' messages."""

import pytest
import torch
import torch.ao.nn.intrinsic as nni
from torch import nn

from qcore.config.fusers import (
    FusionError,
    fuse_bn2d_relu,
    fuse_conv2d_relu,
    fuse_conv_bn,
    fuse_conv_bn_relu,
    fuse_convtranspose_bn,
    fuse_linear_bn,
    fuse_linear_relu,
    sequential_fuser,
)


def batch_norm(cls=nn.BatchNorm2d, features=4):
    torch.manual_seed(0)
    bn = cls(features)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    return bn


def conv_bn_eval(conv_cls=nn.Conv2d, bn_cls=nn.BatchNorm2d):
    return conv_cls(3, 4, 3).eval(), batch_norm(bn_cls).eval()


# -- eval mode: BatchNorm folded into the weights --------------------------------


@pytest.mark.parametrize(
    "conv_cls, bn_cls, shape",
    [
        (nn.Conv1d, nn.BatchNorm1d, (2, 3, 8)),
        (nn.Conv2d, nn.BatchNorm2d, (2, 3, 8, 8)),
        (nn.Conv3d, nn.BatchNorm3d, (2, 3, 5, 5, 5)),
    ],
)
def test_fuse_conv_bn_eval_folds_bn_and_computes_the_same(conv_cls, bn_cls, shape):
    conv, bn = conv_bn_eval(conv_cls, bn_cls)
    fused = fuse_conv_bn(False, conv, bn)
    assert type(fused) is conv_cls
    x = torch.randn(shape)
    torch.testing.assert_close(fused(x), bn(conv(x)), rtol=1e-4, atol=1e-5)
    assert fused is not conv  # the original is left untouched


def test_fuse_conv_bn_relu_eval_gives_conv_relu_with_folded_conv():
    conv, bn = conv_bn_eval()
    relu = nn.ReLU().eval()
    fused = fuse_conv_bn_relu(False, conv, bn, relu)
    assert type(fused) is nni.ConvReLU2d
    assert type(fused[0]) is nn.Conv2d and fused[1] is relu
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(fused(x), torch.relu(bn(conv(x))), rtol=1e-4, atol=1e-5)


def test_fuse_linear_bn_eval_folds_bn():
    linear, bn = nn.Linear(3, 4).eval(), batch_norm(nn.BatchNorm1d).eval()
    fused = fuse_linear_bn(False, linear, bn)
    assert type(fused) is nn.Linear
    x = torch.randn(5, 3)
    torch.testing.assert_close(fused(x), bn(linear(x)), rtol=1e-4, atol=1e-5)


def test_fuse_convtranspose_bn_eval_folds_bn():
    convt, bn = nn.ConvTranspose2d(3, 4, 3).eval(), batch_norm().eval()
    fused = fuse_convtranspose_bn(False, convt, bn)
    assert type(fused) is nn.ConvTranspose2d
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(fused(x), bn(convt(x)), rtol=1e-4, atol=1e-5)


# -- QAT mode: intrinsic modules -------------------------------------------------


@pytest.mark.parametrize(
    "conv_cls, bn_cls, fused_cls, fused_relu_cls",
    [
        (nn.Conv1d, nn.BatchNorm1d, nni.ConvBn1d, nni.ConvBnReLU1d),
        (nn.Conv2d, nn.BatchNorm2d, nni.ConvBn2d, nni.ConvBnReLU2d),
        (nn.Conv3d, nn.BatchNorm3d, nni.ConvBn3d, nni.ConvBnReLU3d),
    ],
)
def test_qat_builds_intrinsic_conv_bn_modules(conv_cls, bn_cls, fused_cls, fused_relu_cls):
    conv, bn, relu = conv_cls(3, 4, 3), bn_cls(4), nn.ReLU()
    fused = fuse_conv_bn(True, conv, bn)
    assert type(fused) is fused_cls and fused[0] is conv and fused[1] is bn
    fused = fuse_conv_bn_relu(True, conv, bn, relu)
    assert type(fused) is fused_relu_cls and list(fused) == [conv, bn, relu]


def test_qat_linear_bn_builds_linear_bn1d():
    linear, bn = nn.Linear(3, 4), nn.BatchNorm1d(4)
    fused = fuse_linear_bn(True, linear, bn)
    assert type(fused) is nni.LinearBn1d and list(fused) == [linear, bn]


@pytest.mark.parametrize("is_qat", [False, True])
def test_sequential_fusers_ignore_is_qat(is_qat):
    conv, linear, bn, relu = nn.Conv2d(3, 4, 3), nn.Linear(3, 4), nn.BatchNorm2d(4), nn.ReLU()
    assert type(fuse_conv2d_relu(is_qat, conv, relu)) is nni.ConvReLU2d
    assert type(fuse_linear_relu(is_qat, linear, relu)) is nni.LinearReLU
    assert type(fuse_bn2d_relu(is_qat, bn, relu)) is nni.BNReLU2d


def test_sequential_fuser_is_one_function_per_class():
    assert sequential_fuser(nni.ConvReLU2d) is fuse_conv2d_relu
    fuse = sequential_fuser(nni.LinearTanh)
    assert fuse is sequential_fuser(nni.LinearTanh)
    assert fuse.__name__ == "fuse_into_LinearTanh"
    assert fuse.fused_class is nni.LinearTanh
    assert type(fuse(False, nn.Linear(2, 2), nn.Tanh())) is nni.LinearTanh


# -- errors ------------------------------------------------------------------------


def test_mode_mismatch_names_both_modules_and_their_modes():
    conv, bn = nn.Conv2d(3, 4, 3).eval(), nn.BatchNorm2d(4).train()
    with pytest.raises(FusionError) as info:
        fuse_conv_bn(False, conv, bn)
    message = str(info.value)
    assert message.startswith("fuse_conv_bn: got Conv2d(3, 4, kernel_size=(3, 3)")
    assert "in eval mode, BatchNorm2d(4," in message and "in training mode" in message
    assert "expected all modules in the same mode" in message


@pytest.mark.parametrize(
    "fuser, modules",
    [
        (fuse_conv_bn_relu, lambda: (nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU().eval())),
        (fuse_linear_bn, lambda: (nn.Linear(3, 4).eval(), nn.BatchNorm1d(4))),
        (fuse_convtranspose_bn, lambda: (nn.ConvTranspose2d(3, 4, 3), nn.BatchNorm2d(4).eval())),
    ],
)
def test_every_bn_fuser_rejects_a_mode_mismatch(fuser, modules):
    with pytest.raises(FusionError, match=f"^{fuser.__name__}: got .*same mode"):
        fuser(False, *modules())


def test_post_training_fusion_in_training_mode_says_to_call_eval():
    with pytest.raises(FusionError) as info:
        fuse_conv_bn(False, nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    message = str(info.value)
    assert "in training mode" in message and "with is_qat=False" in message
    assert "expected eval mode" in message and "call model.eval()" in message


def test_qat_channel_mismatch_names_both_sizes():
    with pytest.raises(FusionError) as info:
        fuse_conv_bn(True, nn.Conv2d(3, 8, 3), nn.BatchNorm2d(4))
    message = str(info.value)
    assert "with out_channels=8" in message and "with num_features=4" in message
    assert "expected them equal" in message
    with pytest.raises(FusionError, match="out_features=8 .* num_features=4; expected them equal"):
        fuse_linear_bn(True, nn.Linear(3, 8), nn.BatchNorm1d(4))


@pytest.mark.parametrize(
    "bn, expected",
    [
        (nn.BatchNorm2d(4, affine=False), "affine=False; expected affine=True"),
        (
            nn.BatchNorm2d(4, track_running_stats=False),
            "track_running_stats=False; expected track_running_stats=True",
        ),
    ],
)
def test_qat_rejects_bn_without_affine_or_running_stats(bn, expected):
    with pytest.raises(FusionError, match=expected):
        fuse_conv_bn(True, nn.Conv2d(3, 4, 3), bn)


def test_qat_unsupported_conv_lists_the_expected_types():
    with pytest.raises(FusionError) as info:
        fuse_conv_bn_relu(True, nn.ConvTranspose2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    assert str(info.value).startswith("fuse_conv_bn_relu: got ConvTranspose2d(")
    assert str(info.value).endswith("expected one of Conv1d, Conv2d, Conv3d")


def test_eval_fuse_conv_bn_points_a_transposed_conv_to_its_fuser():
    with pytest.raises(FusionError, match="use fuse_convtranspose_bn for a transposed conv"):
        fuse_conv_bn(False, nn.ConvTranspose2d(3, 4, 3).eval(), nn.BatchNorm2d(4).eval())


def test_convtranspose_bn_in_qat_is_unsupported():
    with pytest.raises(FusionError) as info:
        fuse_convtranspose_bn(True, nn.ConvTranspose2d(3, 4, 3), nn.BatchNorm2d(4))
    message = str(info.value)
    assert message.startswith("fuse_convtranspose_bn: got ConvTranspose2d(")
    assert "expected is_qat=False" in message and "not supported" in message


def test_sequential_fuser_wrong_types_names_modules_and_class():
    with pytest.raises(FusionError) as info:
        fuse_conv2d_relu(False, nn.Linear(3, 4), nn.ReLU())
    message = str(info.value)
    assert message.startswith("fuse_into_ConvReLU2d: got (Linear(in_features=3")
    assert "expected modules that torch.ao.nn.intrinsic" in message
    assert "ConvReLU2d accepts" in message


def test_sequential_fuser_needs_a_module_class():
    with pytest.raises(TypeError, match="expected a torch.nn.Module subclass"):
        sequential_fuser(torch.relu)


def test_fusion_error_is_a_value_error():
    assert issubclass(FusionError, ValueError)
