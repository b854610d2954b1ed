"""Pass-through ops of exported graphs run on int8 tensors (PT2E, fbgemm and qnnpack).

An eval model's dropout exports as ``aten.dropout(x, p, train=False)``; transformers'
attention blocks also export ``aten.contiguous``, ``aten.unsqueeze`` and
``aten.squeeze``. The backends' configs annotate them as sharing their input's
qparams, but no kernel took their aten form: each stayed in reference form,
a dequantize and a requantize around a copy (5 dropouts in BERT, 8 contiguous
calls in Whisper's encoder). They now run on the int8 tensor, exactly.
"""

from __future__ import annotations

import pytest
import torch
from backends import backend_params

import qcore


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.a(x)).unsqueeze(1).squeeze(1)
        y = y.view(-1, 2, 4).transpose(1, 2).contiguous().view(-1, 8)
        return self.b(y)


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "qnnpack")))
def test_pass_through_ops_run_on_int8(backend):
    torch.manual_seed(0)
    model = Block().eval()
    batches = [(torch.randn(4, 8),) for _ in range(3)]
    exported = torch.export.export(model, batches[0]).module()
    prepared = qcore.prepare_pt2e(exported, backend)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    lowered = qcore.convert_pt2e(prepared)
    reference = qcore.convert_pt2e(prepared, lower=False)
    entries = {e.op: e for e in qcore.explain(lowered)}
    for op in ("aten.dropout", "aten.unsqueeze", "aten.contiguous", "aten.squeeze"):
        assert entries[op].status.name == "QUANTIZED", entries[op]
        assert entries[op].kernel == f"{backend}.pool_and_shape"
    for batch in batches:
        assert torch.equal(lowered(*batch), reference(*batch))


def test_a_training_dropout_is_not_lowered():
    """QAT exports dropout with train=True: random, so it stays in reference form."""
    from qcore.kernels.shape import lower_selecting
    from qcore.plugin.kernels import KernelMatch

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.dropout.default, (x, 0.5, True))
    match = KernelMatch(nodes=(node,), modules=(None,), inputs=(), output=None)
    with pytest.raises(ValueError, match="dropout in training mode"):
        lower_selecting(match)
