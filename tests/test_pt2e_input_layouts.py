"""A PT2E model lowered for x86 or onednn gives the same numbers whatever the
input's strides, and keeps an empty batch's shape: oneDNN's linear read a
transposed or sliced input (and its residual addend) as a row-major matrix
(transformer_block: -206 dB on a batch-strided view) and flattened an empty
input's leading dimensions ((0, 5, 8) -> (0, 4))."""

import pytest
import torch
from backends import backend_params

import qcore
from qcore.examples import export_batch_free


class LinearResidual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x) + x)


def views(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``x``'s values in other layouts."""
    return {
        "batch-strided": torch.stack([x, x], 1).flatten(0, 1)[::2],
        "transposed": x.transpose(-1, -2).contiguous().transpose(-1, -2),
    }


@pytest.mark.parametrize("backend", backend_params(("x86", "onednn")))
def test_strides_and_an_empty_batch_change_nothing(backend: str) -> None:
    torch.manual_seed(0)
    model = LinearResidual().eval()
    prepared = qcore.prepare_pt2e(export_batch_free(model, (torch.randn(2, 5, 8),)), backend)
    for _ in range(3):
        prepared(torch.randn(4, 5, 8))
    lowered = qcore.convert_pt2e(prepared)
    assert [e.kernel for e in qcore.explain(lowered).quantized if e.op == "Linear"]
    x = torch.randn(3, 5, 8)
    expected = lowered(x)
    for name, view in views(x).items():
        assert torch.equal(lowered(view), expected), name
    assert lowered(torch.randn(0, 5, 8)).shape == (0, 5, 4)
