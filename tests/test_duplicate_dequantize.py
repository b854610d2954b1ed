"""The PT2E reference form gives each annotated user of a dequantize its own copy,
as torchao's convert_pt2e does: Inductor's int8 passes match ``dequantize -> op``
per op, and q/k/v linears reading one LayerNorm through a shared dequantize were
compiled as float linears (issue 15 §1, §2)."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from backends import installed

import qcore
from qcore.pt2e.qdq import DEQUANTIZE_OPS, duplicate_dequantize

pytestmark = pytest.mark.skipif(not installed("x86"), reason="needs the x86 plugin")


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(16)
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = torch.softmax(self.q(h) @ self.k(h).transpose(-2, -1), dim=-1)
        return scores @ self.v(h)


def _dequantizes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in DEQUANTIZE_OPS]


def _reference(model: torch.nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    exported = torch.export.export(copy.deepcopy(model), (x,)).module()
    prepared = qcore.prepare_pt2e(exported, "x86")
    prepared(x)
    return qcore.convert_pt2e(prepared, lower=False)


def test_each_linear_reads_its_own_dequantize_and_the_values_are_unchanged():
    model, x = Attention().eval(), torch.randn(2, 4, 16)
    reference = _reference(model, x)
    linears = [n for n in reference.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 3
    inputs = [n.args[0] for n in linears]
    assert all(i.target in DEQUANTIZE_OPS for i in inputs)
    assert len(set(inputs)) == 3  # one dequantize each
    assert all(len(i.users) == 1 for i in inputs)

    shared = copy.deepcopy(reference)  # merge them back: the outputs must not move
    first = inputs[0].name
    for node in list(shared.graph.nodes):
        if node.name in {i.name for i in inputs[1:]}:
            node.replace_all_uses_with(next(n for n in shared.graph.nodes if n.name == first))
            shared.graph.erase_node(node)
    shared.recompile()
    torch.testing.assert_close(reference(x), shared(x), rtol=0, atol=0)
    assert duplicate_dequantize(shared) == 3  # and the pass splits them again


def test_as_many_dequantizes_as_torchaos_convert():
    xiq = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    model, x = Attention().eval(), torch.randn(2, 4, 16)
    quantizer = xiq.X86InductorQuantizer().set_global(
        xiq.get_default_x86_inductor_quantization_config()
    )
    prepared = prepare_pt2e(torch.export.export(copy.deepcopy(model), (x,)).module(), quantizer)
    prepared(x)
    peer = convert_pt2e(prepared)
    assert len(_dequantizes(_reference(model, x))) == len(_dequantizes(peer))


def test_a_dynamic_quantizations_dequantize_stays_shared():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    qd = torch.ops.quantized_decomposed
    qparams = graph.call_function(qd.choose_qparams.tensor, (x, -128, 127, 1e-5, torch.int8))
    scale = graph.call_function(operator.getitem, (qparams, 0))
    zero_point = graph.call_function(operator.getitem, (qparams, 1))
    args = (scale, zero_point, -128, 127, torch.int8)
    q = graph.call_function(qd.quantize_per_tensor.tensor, (x, *args))
    dq = graph.call_function(qd.dequantize_per_tensor.tensor, (q, *args))
    a = graph.call_function(torch.ops.aten.relu.default, (dq,))
    b = graph.call_function(torch.ops.aten.neg.default, (dq,))
    graph.output((a, b))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert duplicate_dequantize(gm, annotated_users_only=False) == 0
