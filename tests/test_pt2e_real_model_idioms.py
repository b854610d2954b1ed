"""Idioms of real architectures that the PT2E path refused or crashed on, where
torchao runs (found on transformers' BiT, Swinv2, BEiT and the RoPE decoders,
tiny configs; reduced here to the op pattern that failed).

Each model must prepare, convert and run, and both forms must be as accurate as
8-bit allows: the lowered model within 0.5 dB of the reference form.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params
from torch import nn

import qcore
from qcore.engine.explain import Status

MIN_SQNR_DB = 25.0


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(reference.pow(2).sum().item() / noise)


class WeightStandardizedConv(nn.Module):
    """BiT: the conv's weight normalized by ``F.batch_norm(w, None, None, training=True)``,
    which has no running statistics to switch to in eval (convert did, and the model
    failed at run time: "running_mean must be defined in evaluation mode")."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        w = self.conv.weight
        w = F.batch_norm(w.reshape(1, 8, -1), None, None, training=True, momentum=0.0, eps=1e-8)
        y = F.relu(F.conv2d(x, w.reshape_as(self.conv.weight), self.conv.bias))
        return self.head(y.flatten(1))


class CatTwice(nn.Module):
    """RoPE: ``torch.cat((freqs, freqs), -1)``, one tensor twice in a cat (qnnpack's
    prepare raised SharingError: the second input's spec shared with itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        y = self.linear(x)
        return self.out(torch.cat((y, y), dim=-1))


class LinearOnBuffer(nn.Module):
    """Swinv2: a continuous position bias MLP run on a buffer. Convert folds the
    buffer's quantize into int8 constants, and lowering then looked for the quantize
    (IndexError)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(1, 7, 7, 2))
        self.mlp = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        bias = self.mlp(self.table).view(49, 2).sum(-1, keepdim=True)
        return self.proj(x) + bias


class IntegerIndexWrittenInPlace(nn.Module):
    """BEiT: a relative position index built in forward and written in place through
    views (``rel[:, :, 0] += 1``). It is an integer tensor, never quantized, so the
    write is seen by every reader; prepare refused it (AliasedWriteError)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 1))
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        grid = torch.meshgrid(torch.arange(2), torch.arange(2), indexing="ij")
        coords = torch.stack(grid).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += 1
        rel[:, :, 1] += 1
        rel[:, :, 0] *= 3
        bias = self.table[rel.sum(-1).view(-1)].view(4, 4)
        return self.linear(x) + bias


CASES = [
    pytest.param(WeightStandardizedConv, (2, 3, 8, 8), id="bit_weight_standardization"),
    pytest.param(CatTwice, (4, 8), id="rope_cat_twice"),
    pytest.param(LinearOnBuffer, (2, 49, 8), id="swinv2_linear_on_buffer"),
    pytest.param(IntegerIndexWrittenInPlace, (2, 4, 4), id="beit_index_written_in_place"),
]


@pytest.mark.parametrize("backend", backend_params(("x86", "qnnpack")))
@pytest.mark.parametrize("make, shape", CASES)
def test_prepares_converts_and_runs_accurately(backend, make, shape):
    torch.manual_seed(0)
    model = make().eval()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(*shape, generator=generator) for _ in range(3)]
    prepared = qcore.prepare_pt2e(torch.export.export(model, (data[0],)).module(), backend)
    with torch.no_grad():
        for batch in data:
            prepared(batch)
        expected = model(data[0])
        reference_db = sqnr(expected, qcore.convert_pt2e(prepared, lower=False)(data[0]))
        lowered_db = sqnr(expected, qcore.convert_pt2e(prepared)(data[0]))
    assert reference_db > MIN_SQNR_DB
    assert lowered_db >= reference_db - 0.5, (lowered_db, reference_db)


@pytest.mark.parametrize("backend", backend_params(("x86", "qnnpack")))
def test_a_weight_computed_from_parameters_is_lowered_as_a_constant(backend):
    """BiT's standardized weight depends on parameters only: convert quantizes its
    value once, and the conv runs on the backend's int8 kernel, not in reference form
    (which standardized, quantized and dequantized the weight at every call)."""
    torch.manual_seed(0)
    model = WeightStandardizedConv().eval()
    x = torch.randn(2, 3, 8, 8)
    prepared = qcore.prepare_pt2e(torch.export.export(model, (x,)).module(), backend)
    prepared(x)
    converted = qcore.convert_pt2e(prepared)
    conv = next(e for e in qcore.explain(converted).entries if "conv" in e.node)
    assert conv.status is Status.QUANTIZED, conv
    ops = {str(n.target) for n in converted.graph.nodes if n.op == "call_function"}
    assert not any("batch_norm" in op for op in ops), ops


class PositionIdsFromMask(nn.Module):
    """RoBERTa, MPNet, DeBERTa-v2: position ids computed from the token ids, an integer
    ``cumsum(mask) * mask``. x86 annotated that integer mul, and calibration failed
    ("histogram_cpu" not implemented for 'Int'); torchao fails the same way."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(100, 16)
        self.positions = nn.Embedding(32, 16)
        self.linear = nn.Linear(16, 8)

    def forward(self, ids):
        mask = ids.ne(1).int()
        positions = torch.cumsum(mask, dim=1).type_as(mask) * mask + 1
        return self.linear(self.tokens(ids) + self.positions(positions.long()))


@pytest.mark.parametrize("backend", backend_params(("x86", "qnnpack")))
def test_integer_arithmetic_is_never_observed(backend):
    torch.manual_seed(0)
    model = PositionIdsFromMask().eval()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 100, (2, 16), generator=generator) for _ in range(3)]
    prepared = qcore.prepare_pt2e(torch.export.export(model, (data[0],)).module(), backend)
    with torch.no_grad():
        for batch in data:
            prepared(batch)
        expected = model(data[0])
        for lower in (False, True):
            converted = qcore.convert_pt2e(prepared, lower=lower)
            assert sqnr(expected, converted(data[0])) > MIN_SQNR_DB
    mul = next(e for e in qcore.explain(prepared).entries if e.op == "aten.mul")
    assert mul.status is Status.NOT_AN_OP  # integer arithmetic: nothing to quantize
