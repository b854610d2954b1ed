"""The PT2E guide's advice on batch sizes (docs/user-guide.md), checked as written.

It said to export with a batch of two or more when calibration batches differ
in size; exported at 2 and calibrated at 8, that fails. The guide's snippet
(export with ``dynamic_shapes``) is run here as it stands in the guide.
"""

import re
from pathlib import Path

import pytest
import torch
from backends import backend_params
from torch import nn

import qcore

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "user-guide.md"


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, stride=4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))


def _guide_snippet() -> str:
    """The PT2E section's code block that exports with ``dynamic_shapes``."""
    section = GUIDE.read_text().split("## PT2E", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    (snippet,) = [block for block in blocks if "dynamic_shapes" in block]
    return snippet


@pytest.mark.parametrize("backend", backend_params(("x86",)))
def test_guide_dynamic_batch_snippet_calibrates_and_runs_any_batch(backend):
    snippet = _guide_snippet()
    assert 'prepare_pt2e(exported, "x86")' in snippet
    scope = {"torch": torch, "qcore": qcore, "model": SmallNet().eval()}
    exec(snippet, scope)  # calibrates at batches of 8 and 3, as the guide says
    quantized, model = scope["quantized"], scope["model"]
    for size in (1, 5):
        x = torch.randn(size, 3, 224, 224)
        assert quantized(x).shape == (size, 5)
        assert torch.allclose(quantized(x), model(x), atol=0.1)


@pytest.mark.parametrize("backend", backend_params(("x86",)))
def test_a_fixed_batch_of_two_refuses_other_batches_as_the_guide_says(backend):
    model = SmallNet().eval()
    exported = torch.export.export(model, (torch.randn(2, 3, 224, 224),)).module()
    prepared = qcore.prepare_pt2e(exported, backend)
    message = "input 'x': dimension 0 is 8; the model was exported for 2"
    assert message in GUIDE.read_text().replace("\n", " ")
    with pytest.raises(AssertionError, match=re.escape(message)):
        prepared(torch.randn(8, 3, 224, 224))
