"""The PT2E guide's advice on batch sizes (docs/user-guide.md), checked as written.

It said to export with a batch of two or more when calibration batches differ
in size; exported at 2 and calibrated at 8, that fails. The guide's snippet
(export with ``dynamic_shapes``) is run here as it stands in the guide.
"""

import re
from pathlib import Path

import pytest
import torch
from backends import backend_params, installed
from test_pt2e_api import OwnQuantizer  # every linear in uint8 x int8, no plugin needed
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


class BranchesOnBatch(nn.Module):
    """Its graph depends on the batch: export keeps the branch it took (batch <= 8)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.shape[0] <= 8 else -self.fc(x)


@pytest.mark.parametrize("backend", backend_params(("x86", "qnnpack")))
@pytest.mark.parametrize(
    "dim",
    [torch.export.Dim.AUTO, torch.export.Dim("batch", max=8)],
    ids=["a branch on the batch", "Dim(max=8)"],
)
def test_the_ranges_export_recorded_are_kept(backend, dim, tmp_path):
    """qcore's guard kept static sizes only: batch 12 ran the branch exported for
    batch <= 8 (2.0 off on outputs of 1.2), where export's own guard and torchao's
    model refuse it."""
    model = BranchesOnBatch().eval()
    exported = torch.export.export(model, (torch.randn(4, 16),), dynamic_shapes=({0: dim},))
    prepared = qcore.prepare_pt2e(exported.module(), backend)
    prepared(torch.randn(4, 16))
    message = "input 'x': dimension 0 is 12; the model was exported for 0 to 8"
    for converted in (qcore.convert_pt2e(prepared), qcore.convert_pt2e(prepared, lower=False)):
        for size in (0, 1, 8):
            assert converted(torch.randn(size, 16)).shape == (size, 4)
        with pytest.raises(AssertionError, match=re.escape(message)):
            converted(torch.randn(12, 16))
    qcore.save(qcore.convert_pt2e(prepared), tmp_path / "model.qcore")
    with pytest.raises(AssertionError, match=re.escape(message)):
        qcore.load(tmp_path / "model.qcore")(torch.randn(12, 16))


def test_the_input_guard_lets_torch_compile_keep_the_batch_dynamic():
    """The guard formatted each size into its message before checking it, which
    made torch.compile specialise the graph to the size: a recompile at every new
    batch, the model falling back to eager after 8 (qcore.compile too). torchao's
    model recompiles once."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    shapes = {"x": {0: torch.export.Dim("batch", min=1, max=64)}}
    exported = torch.export.export(
        SmallNet().eval(), (torch.randn(2, 3, 16, 16),), dynamic_shapes=shapes
    )
    prepared = qcore.prepare_pt2e(exported.module(), "x86" if installed("x86") else OwnQuantizer())
    prepared(torch.randn(2, 3, 16, 16))
    reference = qcore.convert_pt2e(prepared, lower=False)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(reference, backend=counter)
    with torch.no_grad():
        for batch in range(2, 9):
            compiled(torch.randn(batch, 3, 16, 16))
    assert counter.frame_count <= 2  # the first size, then the dynamic graph
    with pytest.raises(
        AssertionError, match="dimension 0 is 65; the model was exported for 0 to 64"
    ):
        reference(torch.randn(65, 3, 16, 16))
