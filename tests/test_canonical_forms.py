"""Convs with padding="same"/"valid" run on int8 kernels, FX and PT2E.

transformers' EfficientNet writes its convs that way; torch.export gives them as
``aten.conv2d.padding``. They used to stay in reference form on every backend
(15 of EfficientNet's 16 convs on PT2E) and the algorithms could not see them.
The lowered model must equal, bit for bit, the same model written with explicit
padding; an even kernel's "same" (asymmetric in torch) stays in reference form,
with the reason.
"""

from __future__ import annotations

import pytest
import torch
from backends import backend_params

import qcore
from qcore.engine.conv_padding import explicit_padding


class Net(torch.nn.Module):
    def __init__(self, same: object = "same", valid: object = "valid") -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 3, padding=same)
        self.b = torch.nn.Conv2d(8, 8, 5, padding=valid, groups=8)  # depthwise
        self.c = torch.nn.Conv2d(8, 6, (1, 5), padding=same, dilation=2)
        self.d = torch.nn.Conv2d(6, 4, 2, padding="same")  # torch pads 0 before, 1 after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.relu(self.a(x))
        y = torch.nn.functional.relu(self.b(y))
        return self.d(self.c(y))


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The net with string padding and its twin with the same padding as integers."""
    torch.manual_seed(0)
    strings = Net().eval()
    integers = Net(same=1, valid=0).eval()
    integers.c.padding = (0, 4)  # "same" for (1, 5) with dilation 2
    integers.load_state_dict(strings.state_dict())
    return strings, integers


def _batches() -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 3, 16, 16, generator=generator),) for _ in range(3)]


def _convert(model: torch.nn.Module, path: str, backend: str) -> torch.nn.Module:
    example = _batches()[0]
    if path == "fx":
        prepared = qcore.prepare_fx(model, None, example, backend=backend)
    else:
        exported = torch.export.export(model, example).module()
        prepared = qcore.prepare_pt2e(exported, backend)
    with torch.no_grad():
        for batch in _batches():
            prepared(*batch)
    return qcore.convert_fx(prepared) if path == "fx" else qcore.convert_pt2e(prepared)


@pytest.mark.parametrize(
    "padding, kernel, dilation, expected",
    [
        ("valid", (3, 5), 1, [0, 0]),
        ("same", (3, 5), 1, [1, 2]),
        ("same", (3,), (2,), [2]),
        ("same", (1, 5), 2, [0, 4]),
        ("same", (2, 3), 1, None),  # total 1: torch pads 0 before, 1 after
        ("same", (2, 3), 2, [1, 2]),  # an even kernel with even dilation is symmetric
        (2, (3, 3), 1, [2, 2]),
        ((1, 0), (3, 1), 1, [1, 0]),
    ],
)
def test_explicit_padding(padding, kernel, dilation, expected):
    assert explicit_padding(padding, kernel, dilation) == expected


@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_string_padded_convs_run_on_kernels_as_their_explicit_twins(path, backend):
    strings, integers = _models()
    lowered, twin = _convert(strings, path, backend), _convert(integers, path, backend)
    convs = [e for e in qcore.explain(lowered) if "conv" in e.op.lower()]
    assert [e.status.name for e in convs] == ["QUANTIZED"] * 3 + ["REFERENCE"], convs
    assert "torch pads one more after than before" in convs[3].reason or (
        # PT2E: the asymmetric conv keeps its string overload, which no kernel takes
        path == "pt2e" and "no kernel for" in convs[3].reason
    )
    twin_kernels = [e.kernel for e in qcore.explain(twin) if "conv" in e.op.lower()]
    assert [e.kernel for e in convs[:3]] == twin_kernels[:3]
    for batch in _batches():
        assert torch.equal(lowered(*batch), twin(*batch))


@pytest.mark.parametrize("backend", backend_params())
def test_equalization_sees_string_padded_convs_on_pt2e(backend):
    """The algorithms read convs through the default overload: a -> relu -> b (depthwise)
    -> relu -> c are two pairs once their "same" and "valid" are integers."""
    strings, _ = _models()
    example = _batches()[0]
    prepared = qcore.prepare_pt2e(torch.export.export(strings, example).module(), backend)
    overloads = [
        n.target
        for n in prepared.graph.nodes
        if getattr(n.target, "__name__", "").startswith("conv2d")
    ]
    assert overloads.count(torch.ops.aten.conv2d.default) == 3
    assert overloads.count(torch.ops.aten.conv2d.padding) == 1
    equalized = qcore.equalize(prepared)
    pairs = [(p.first, p.second) for p in qcore.algorithms.equalized_pairs(equalized)]
    assert pairs == [("conv2d", "conv2d_1"), ("conv2d_1", "conv2d_2")]  # a -> b -> c
    with torch.no_grad():
        torch.testing.assert_close(equalized(*example), prepared(*example), rtol=1e-4, atol=1e-5)
