"""oneDNN conv weights are packed for the input shape the model was prepared with.

Packed without a shape, oneDNN lays some weights out for a made-up input and reorders
them at every call. qcore packs for the shape it recorded at prepare (FX's
``tensor_meta``, PT2E's ``val``); an input of another shape must still give the values
a weight packed without a shape gives.
"""

import warnings

import pytest
import torch
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping

import qcore
from qcore_x86.onednn import OnednnConv, OnednnPackedConvAdd

ONEDNN_CONVS = (OnednnConv, OnednnPackedConvAdd)


class Residual(nn.Module):
    """conv -> relu, then a 1x1 conv added to it (a conv-add), then a hardswish conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.project = nn.Conv2d(8, 8, 1)
        self.head = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        return nn.functional.hardswish(self.head(self.project(y) + y))


def _converted(path: str, example: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    model = Residual().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if path == "fx":
            mapping = get_default_qconfig_mapping("onednn")
            prepared = qcore.prepare_fx(model, mapping, (example,), backend="onednn")
            prepared(example)
            return qcore.convert_fx(prepared)
        prepared = qcore.prepare_pt2e(torch.export.export(model, (example,)).module(), "x86")
        prepared(example)
        return qcore.convert_pt2e(prepared)


@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_weights_are_packed_for_the_prepared_shape_and_run_any_other(path: str) -> None:
    example = torch.randn(2, 3, 8, 8)
    converted = _converted(path, example)
    kernels = {name: m for name, m in converted.named_modules() if isinstance(m, ONEDNN_CONVS)}
    assert kernels, qcore.explain(converted)
    assert {name: m.packed_for_shape for name, m in kernels.items()} == dict.fromkeys(
        kernels, [2, 8, 8, 8]
    )

    # PT2E's export fixed the shape: only FX's model takes another
    other_shape = torch.randn(3, 3, 11, 9) if path == "fx" else torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        packed_for_prepared = [converted(x) for x in (example, other_shape)]
        for kernel in kernels.values():
            kernel.packed_for_shape = None
            kernel.repack()
        packed_for_none = [converted(x) for x in (example, other_shape)]
    for ours, unshaped in zip(packed_for_prepared, packed_for_none, strict=True):
        torch.testing.assert_close(ours, unshaped, rtol=0, atol=0)


def test_a_symbolic_prepared_shape_packs_for_none() -> None:
    torch.manual_seed(0)
    example = torch.randn(2, 3, 8, 8)
    batch = torch.export.Dim("batch", min=1, max=16)
    exported = torch.export.export(
        Residual().eval(), (example,), dynamic_shapes=({0: batch},)
    ).module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = qcore.prepare_pt2e(exported, "x86")
        prepared(example)
        converted = qcore.convert_pt2e(prepared)
    kernels = [m for m in converted.modules() if isinstance(m, ONEDNN_CONVS)]
    assert kernels and all(m.packed_for_shape is None for m in kernels)
    reference = qcore.convert_pt2e(prepared, lower=False)
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        # the last conv's output is float: the same integers, summed in another order
        torch.testing.assert_close(converted(x), reference(x), rtol=0, atol=1e-5)


def test_torchscript_keeps_the_shape_through_save_and_load() -> None:
    import io

    example = torch.randn(2, 3, 8, 8)
    converted = _converted("fx", example)
    scripted = torch.jit.script(converted)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    shapes = [
        m.packed_for_shape
        for m in loaded.modules()
        if m.original_name == "ScriptedOnednnConv"  # packed again on load
    ]
    assert shapes == [[2, 8, 8, 8]]
    with torch.no_grad():
        torch.testing.assert_close(loaded(example), converted(example), rtol=0, atol=0)
