"""Fusion rules with extra inputs (torch.ao's ``extra_inputs_getter``), on qcore alone.

``conv -> add(other) -> relu`` fuses into one module called with ``other`` as
its second input; torch.ao's own onednn BackendConfig, converted, does the same.
"""

import operator

import pytest
import torch
import torch.ao.nn.intrinsic as nni
from torch import nn

import qcore
from qcore.config import BackendConfig, DTypeConfig, MatchAllNode
from qcore.config.onednn_fusions import conv_add_pattern_configs, fuse_conv_add
from qcore.config.qconfig import default_qconfig_mapping
from qcore.config.standard_ops import standard_pattern_configs

INT8 = DTypeConfig(
    input_dtype=torch.quint8,
    output_dtype=torch.quint8,
    weight_dtype=torch.qint8,
    bias_dtype=torch.float,
)


class Block(nn.Module):
    def __init__(self, conv_left=True):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.shortcut, self.relu = nn.Conv2d(4, 4, 1), nn.ReLU()
        self.conv_left = conv_left

    def forward(self, x):
        y, s = self.bn(self.conv(x)), self.shortcut(x)
        return self.relu(y + s if self.conv_left else s + y)


def _config():
    configs = standard_pattern_configs(conv=[INT8]) + conv_add_pattern_configs([INT8])
    return BackendConfig("convadd").set_backend_pattern_configs(configs)


def _prepared(model, config):
    inputs = (torch.randn(2, 4, 8, 8),)
    mapping = default_qconfig_mapping("onednn")
    return qcore.prepare_fx(model.eval(), mapping, inputs, backend_config=config), inputs


@pytest.mark.parametrize("conv_left", [True, False], ids=["conv-left", "conv-right"])
def test_conv_bn_add_relu_fuses_with_the_other_operand_as_second_input(conv_left):
    model = Block(conv_left).eval()
    prepared, inputs = _prepared(model, _config())
    assert isinstance(prepared.conv, nni.ConvAddReLU2d)
    calls = [n for n in prepared.graph.nodes if n.op == "call_module" and n.target == "conv"]
    (call,) = calls
    assert len(call.args) == 2  # x and the shortcut, both observed
    assert all(a.op == "call_module" and "activation_post_process" in a.target for a in call.args)
    assert not any(n.target in (operator.add, torch.add) for n in prepared.graph.nodes)
    prepared(*inputs)
    reference = qcore.convert_to_reference_fx(prepared)
    with torch.no_grad():
        expected, got = model(*inputs), reference(*inputs)
    assert (expected - got).abs().max() < 0.1 * expected.abs().max()


def test_torch_aos_onednn_config_fuses_the_same():
    from qcore.config.torch_ao import from_torch_ao, import_torch_ao_backend_config

    import_torch_ao_backend_config()
    from torch.ao.quantization.backend_config.onednn import get_onednn_backend_config

    prepared, _ = _prepared(Block(), from_torch_ao(get_onednn_backend_config()))
    assert isinstance(prepared.conv, nni.ConvAddReLU2d)
    (call,) = [n for n in prepared.graph.nodes if n.target == "conv"]
    assert len(call.args) == 2


def test_fuser_is_given_the_add_function_and_match_all_node():
    conv = nn.Conv2d(4, 4, 1)
    left = fuse_conv_add(False, operator.add, conv, MatchAllNode)
    right = fuse_conv_add(False, torch.add, MatchAllNode, conv)
    assert isinstance(left, nni.ConvAdd2d) and left.add is operator.add
    assert right[0] is conv and right.add is torch.add
