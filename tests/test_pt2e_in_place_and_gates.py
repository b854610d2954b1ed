"""Exported residual blocks and gates run on int8 kernels (PT2E, fbgemm and qnnpack).

transformers' ResNet and RegNet write their residual as ``hidden += shortcut`` and
then a relu: torch.export keeps the in-place ``aten.add_``. RegNet's squeeze-excite
gate is ``aten.sigmoid``, GPT-2's gelu an ``aten.tanh``. The backends' configs
annotate them all, but no kernel listed those aten forms: each stayed in reference
form (4 of 14 ops of transformers' ResNet, 6 of 26 of RegNet). They now run on the
int8 kernels of their FX forms.
"""

from __future__ import annotations

import pytest
import torch
from backends import backend_params

import qcore


class ResidualGate(torch.nn.Module):
    """conv -> relu -> conv, ``out += shortcut``, relu, then a sigmoid gate and a tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.shortcut = torch.nn.Conv2d(4, 4, 1)
        self.gate = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(torch.relu(self.conv1(x)))
        out += self.shortcut(x)
        out = torch.relu(out)
        return torch.sigmoid(self.gate(out)) * torch.tanh(out)


def _converted(backend: str):
    torch.manual_seed(0)
    model = ResidualGate().eval()
    batches = [(torch.randn(2, 4, 8, 8),) for _ in range(3)]
    exported = torch.export.export(model, batches[0]).module()
    prepared = qcore.prepare_pt2e(exported, backend)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    return qcore.convert_pt2e(prepared), qcore.convert_pt2e(prepared, lower=False), batches


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "qnnpack")))
def test_in_place_residual_add_and_gates_run_on_int8(backend):
    lowered, reference, batches = _converted(backend)
    entries = {e.op: e for e in qcore.explain(lowered)}
    expected = {
        "aten.add_": f"{backend}.add_relu",
        "aten.sigmoid": f"{backend}.sigmoid",
        "aten.tanh": f"{backend}.tanh",
    }
    for op, kernel in expected.items():
        assert entries[op].status.name == "QUANTIZED", entries[op]
        assert entries[op].kernel == kernel
    (returned,) = next(n for n in reference.graph.nodes if n.op == "output").args[0]
    step = returned.args[1]  # the scale the model's output is dequantized with
    with torch.no_grad():
        for batch in batches:
            # the conformance suite's bound: one step for an activation's rounding, one
            # for a kernel's own (qnnpack's convs, lowered already before these ops)
            apart = ((lowered(*batch) - reference(*batch)).abs() / step).round()
            assert apart.max() <= 2, f"{int(apart.max())} output steps apart"


def test_an_in_place_add_whose_operand_is_read_elsewhere_is_not_lowered():
    """The kernel writes nothing in place: taking ``x.add_(y)`` is safe only where
    nothing else reads ``x``."""
    from qcore.kernels.binary import lower_binary
    from qcore.plugin.kernels import ActivationQParams, KernelMatch

    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    add = graph.call_function(torch.ops.aten.add_.Tensor, (x, y))
    graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))  # x read again
    qparams = ActivationQParams(0.1, 128, torch.quint8)
    match = KernelMatch(nodes=(add,), modules=(None,), inputs=(qparams, qparams), output=qparams)
    with pytest.raises(ValueError, match="add_ writes into 'x', which is read elsewhere"):
        lower_binary(match, op="add")
