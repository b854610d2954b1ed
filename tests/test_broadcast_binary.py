"""A quantized add or mul whose operands broadcast (``x.sum(1, keepdim=True) / 8 + x``,
a gate) printed torch's C++ warning at every call of the converted model: "An output
with one or more elements was resized since it had shape [2, 1, 8, 8]" (torch.ao's
model too). torch's kernel makes the output in the first operand's shape; qcore
passes the one of the output's shape first (both ops commute)."""

import pytest
import torch
from backends import backend_params
from torch import nn

import qcore
from qcore.accuracy import sqnr


class Broadcasts(nn.Module):
    def __init__(self, order: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.order = nn.Conv2d(3, 8, 3, padding=1), order

    def forward(self, x):
        x = self.conv(x)
        small = x.sum(1, keepdim=True) / 8
        if self.order == "small first":
            return small + x, small * x
        if self.order == "small second":
            return x + small, x * small
        row = x.mean(2, keepdim=True)  # (N, C, 1, W) with (N, 1, H, W): neither is whole
        return row + small, row * small


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("order", ["small first", "small second", "neither whole"])
def test_a_broadcast_add_and_mul_print_nothing_and_agree_with_the_reference(
    order, backend, capfd
) -> None:
    model = Broadcasts(order).eval()
    torch.manual_seed(1)
    batches = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    prepared = qcore.prepare_fx(model, None, (batches[0],), backend=backend)
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    lowered, reference = qcore.convert_fx(prepared), qcore.convert_to_reference_fx(prepared)
    scripted = torch.jit.script(lowered)
    capfd.readouterr()
    with torch.no_grad():
        for batch in batches:
            got, script_got = lowered(batch), scripted(batch)
            floats, expected = model(batch), reference(batch)
            for value, script_value, wanted, exact in zip(
                got, script_got, expected, floats, strict=True
            ):
                assert value.shape == wanted.shape == (2, 8, 8, 8)
                assert sqnr(exact, value) >= sqnr(exact, wanted) - 0.5, (order, backend)
                assert torch.equal(value, script_value)
    assert "resized" not in capfd.readouterr().err


def test_the_kernels_broadcast_shape_is_torchs():
    """The kernel computes the broadcast shape in plain Python (torch.broadcast_shapes
    costs 15 us a call): the same shape, or an error, on every pair of small shapes."""
    from qcore.kernels.binary import _broadcast_shape

    sizes = [[]] + [[s] for s in (1, 2, 3)]
    shapes = [[]]
    for _ in range(4):
        shapes += [shape + size for shape in shapes for size in sizes if size]
        shapes = [list(s) for s in {tuple(s) for s in shapes} if len(s) <= 4]
    assert len(shapes) > 100
    for a in shapes:
        for b in shapes[::7]:
            try:
                expected = list(torch.broadcast_shapes(a, b))
            except RuntimeError:
                with pytest.raises(RuntimeError, match="do not broadcast"):
                    _broadcast_shape(a, b)
                continue
            assert _broadcast_shape(a, b) == expected, (a, b)
