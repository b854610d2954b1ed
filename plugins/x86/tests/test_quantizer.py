"""The x86 plugin's own PT2E Quantizer (oneDNN's recipe), used by name."""

import torch
from torch import nn

import qcore
from qcore.observers import FakeQuantizeBase
from qcore_x86.quantizer import X86Quantizer

aten = torch.ops.aten


class Residual(nn.Module):
    """conv-bn-relu, conv-add-relu (residual), max pool, flatten, linear, a float op."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.conv2(y) + x)
        y = torch.flatten(self.pool(y), 1)
        return torch.sigmoid(self.fc(y))


X = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))


def exported(train=False):
    torch.manual_seed(0)
    model = Residual().train(train)
    return model, torch.export.export(model, (X,)).module()


def quantized_inputs(prepared):
    """For each op node, the names of its inputs that pass through an observer."""
    observed = {}
    for node in prepared.graph.nodes:
        if node.op != "call_function":
            continue
        names = [a.args[0].name for a in node.all_input_nodes if a.op == "call_module"]
        if names:
            observed[node.name] = sorted(names)
    return observed


def test_the_x86_backend_by_name_uses_the_plugins_quantizer():
    assert isinstance(qcore.get_backend("x86").quantizer(), X86Quantizer)
    assert qcore.get_backend("x86").quantizer(is_qat=True).is_qat


def test_onednn_recipe_quantizes_inputs_of_fused_patterns_only():
    _, graph = exported()
    prepared = qcore.prepare_pt2e(graph, "x86")
    observed = quantized_inputs(prepared)
    assert observed == {
        "conv2d": ["conv2d_folded_weight", "x"],  # conv (bn folded) + relu
        "conv2d_1": ["conv2_weight", "relu"],  # conv + add + relu: the conv's output is
        "add": ["x"],  # not quantized, the add's residual input is
        "max_pool2d": ["relu_1"],  # after a quantized pattern: int8 in and out
        "flatten": ["max_pool2d"],  # it feeds a linear
        "linear": ["fc_weight", "flatten"],  # its output feeds a float sigmoid
    }
    # The sigmoid is not in x86's recipe: float, with the reason.
    report = qcore.explain(prepared)
    assert report["sigmoid"].status.value == "float"
    assert "x86 quantizes conv, linear" in report["sigmoid"].reason


def test_converts_runs_and_stays_close_to_float():
    model, graph = exported()
    prepared = qcore.prepare_pt2e(graph, "x86")
    prepared(X)
    converted = qcore.convert_pt2e(prepared)
    with torch.no_grad():
        expected, actual = model(X), converted(X)
    noise = (expected - actual).norm() / expected.norm()
    assert noise < 0.05, noise


def test_qat_by_name_fake_quantizes_and_trains():
    _, graph = exported(train=True)
    prepared = qcore.prepare_qat_pt2e(graph, "x86")
    fake_quants = [m for m in prepared.modules() if isinstance(m, FakeQuantizeBase)]
    assert fake_quants, "QAT by name must insert fake quants"
    # The batch norm trains: it stays in the graph, inside the conv's pattern.
    assert any(n.target is aten.batch_norm.default for n in prepared.graph.nodes)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    loss = prepared(X).sum()
    loss.backward()
    optimizer.step()
    converted = qcore.convert_pt2e(prepared)
    assert torch.isfinite(converted(X)).all()


def test_a_quantizer_instance_works_without_the_name():
    _, graph = exported()
    by_instance = quantized_inputs(qcore.prepare_pt2e(graph, X86Quantizer()))
    _, graph = exported()
    assert by_instance == quantized_inputs(qcore.prepare_pt2e(graph, "x86"))
