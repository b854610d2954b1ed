"""PT2E annotates ``torch.bmm`` under matmul's pattern; the int8 matmul kernel took
``aten.matmul`` only, so bmm stayed in reference form with the reason "no kernel
for matmul", on a backend whose explain listed a matmul kernel two rows above."""

from __future__ import annotations

import pytest
import torch
from backends import backend_params

import qcore
from qcore.examples import export_batch_free


class Scores(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(self.a(x), self.b(x).transpose(1, 2))


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "qnnpack")))
def test_bmm_runs_the_int8_matmul(backend):
    example = (torch.randn(2, 4, 8),)
    prepared = qcore.prepare_pt2e(export_batch_free(Scores().eval(), example), backend)
    for _ in range(4):
        prepared(torch.randn(2, 4, 8))
    lowered, reference = qcore.convert_pt2e(prepared), qcore.convert_pt2e(prepared, lower=False)
    (bmm,) = [entry for entry in qcore.explain(lowered).entries if entry.node == "bmm"]
    assert bmm.status.value == "quantized" and bmm.kernel == f"{backend}.matmul"
    x = torch.randn(3, 4, 8)
    torch.testing.assert_close(lowered(x), reference(x), rtol=0, atol=0)
