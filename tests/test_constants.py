"""qcore.engine.constants.Constants: what convert may compute once, on both front doors."""

from __future__ import annotations

import torch
from torch import nn

from qcore.engine.constants import Constants


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        self.count.add_(1)  # a buffer written in forward: not a constant
        standardized = (self.weight - self.weight.mean()).reshape(4, 4)
        counted = self.count * 2
        noise = torch.rand_like(self.weight)[0]  # random: not a constant
        return x @ standardized + counted + noise


def _nodes(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {node.name: node for node in gm.graph.nodes}


def test_fx_methods_and_functions_on_parameters_are_constants():
    model = Mixed()
    gm = torch.fx.symbolic_trace(model)
    constants, nodes = Constants(gm), _nodes(gm)
    assert nodes["reshape"] in constants
    expected = (model.weight - model.weight.mean()).reshape(4, 4)
    torch.testing.assert_close(constants.value(nodes["reshape"]), expected)
    assert nodes["rand_like"] not in constants
    assert nodes["getitem"] not in constants  # of a random tensor
    assert nodes["x"] not in constants  # an input


def test_exported_aten_ops_on_parameters_are_constants():
    model = Mixed()
    gm = torch.export.export(model, (torch.randn(2, 4),)).module()
    constants = Constants(gm)
    standardized = next(n for n in gm.graph.nodes if "reshape" in str(n.target))
    assert standardized in constants
    expected = (model.weight - model.weight.mean()).reshape(4, 4)
    torch.testing.assert_close(constants.value(standardized), expected)
    written = [n for n in gm.graph.nodes if "mul" in str(n.target)]
    assert written and all(n not in constants for n in written)
    random = [n for n in gm.graph.nodes if "rand" in str(n.target)]
    assert random and all(n not in constants for n in random)


def test_fx_a_buffer_a_method_writes_in_place_is_not_a_constant():
    root = nn.Module()
    root.register_buffer("count", torch.zeros(2))
    root.register_buffer("fixed", torch.ones(2))
    graph = torch.fx.Graph()
    count, fixed = graph.get_attr("count"), graph.get_attr("fixed")
    graph.call_method("add_", (graph.call_method("view", (count, -1)), 1))
    read = graph.call_function(torch.mul, (count, 2))
    kept = graph.call_function(torch.mul, (fixed, 2))
    graph.output((read, kept))
    constants = Constants(torch.fx.GraphModule(root, graph))
    assert read not in constants  # written through a view, at every call
    assert kept in constants
