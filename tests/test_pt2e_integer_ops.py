"""PT2E: integer arithmetic in an exported graph (BERT's position ids, an add on
int64 tensors) is never observed; a histogram observer on it failed calibration
("histogram_cpu not implemented for 'Long'") where torchao's quantizers run."""

from __future__ import annotations

import pytest
import torch
from backends import backend_params

import qcore


class PositionIds(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        positions = ids + 2  # int64 + int64
        return self.linear(x + self.embedding(positions))


@pytest.mark.parametrize("backend", backend_params())
def test_integer_add_is_not_observed_and_the_model_quantizes(backend: str) -> None:
    torch.manual_seed(0)
    model = PositionIds().eval()
    ids = torch.arange(5).repeat(2, 1)
    batches = [
        (torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(s)), ids) for s in range(3)
    ]
    example = batches[0]  # a calibration batch: its range is observed, so no clipping
    exported = torch.export.export(model, example).module()
    prepared = qcore.prepare_pt2e(exported, backend)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    observed = [
        node.args[0]
        for node in prepared.graph.nodes
        if node.op == "call_module" and "activation_post_process" in str(node.target)
    ]
    assert observed, "nothing observed: the linear should be"
    integer = [n.name for n in observed if not n.meta["val"].is_floating_point()]
    assert integer == []
    converted = qcore.convert_pt2e(prepared)
    report = qcore.explain(converted)
    assert any(entry.op == "Linear" for entry in report.quantized + report.reference)
    with torch.no_grad():
        expected, actual = model(*example), converted(*example)
    assert torch.allclose(actual, expected, atol=0.1 * expected.abs().max().item())
