"""Linears reading one quantized input become one in the compiled path (issue 15 §2).

x86's compile recipe merges q/k/v-style linears (per-channel int8 weights, one
input quantization) into one linear of concatenated weights whose slices stand
for theirs: the reference form's numbers stay the same, Inductor lowers one int8
GEMM where it lowered three. What would change the numbers or the compiled
graph's fusions is left alone.
"""

from __future__ import annotations

import pytest
import torch
from backends import installed

import qcore
from qcore.engine.concat_linears import concat_sibling_linears

requires_x86 = pytest.mark.skipif(not installed("x86"), reason="needs the x86 plugin")

LINEAR = torch.ops.aten.linear.default


class Attention(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim, bias=False)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        h = self.norm(x)

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(batch, tokens, self.heads, dim // self.heads).transpose(1, 2)

        q, k = split(self.q(h)), split(self.k(h))
        # a view that merges the tokens with the features: impossible on a slice
        v = self.v(h).view(batch, tokens * dim).view(batch, tokens, self.heads, -1)
        attended = torch.softmax(q @ k.transpose(-2, -1) / 3.0, -1) @ v.transpose(1, 2)
        return x + self.out(attended.transpose(1, 2).reshape(batch, tokens, dim))


class ReturnsProjections(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 8)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _batches(shape: tuple[int, ...], count: int = 3) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, generator=generator),) for _ in range(count)]


def _calibrated(model: torch.nn.Module, batches: list, quantizer="x86") -> torch.fx.GraphModule:
    torch.manual_seed(0)
    exported = torch.export.export(model.eval(), batches[0]).module()
    prepared = qcore.prepare_pt2e(exported, quantizer)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    return prepared


def _linears(gm: torch.fx.GraphModule) -> int:
    return sum(node.target == LINEAR for node in gm.graph.nodes)


@requires_x86
def test_q_k_v_become_one_int8_gemm_with_the_same_numbers():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    batches = _batches((2, 8, 32))
    prepared = _calibrated(Attention(), batches)
    unmerged = qcore.convert_pt2e(prepared, lower=False)
    assert _linears(unmerged) == 4

    torch._dynamo.reset()
    counters.clear()
    fast = qcore.compile(prepared)
    assert fast.recipe.concat_linears
    assert _linears(fast.compiled_form) == 2  # q, k, v as one; out
    assert _linears(fast.reference) == 4  # the form the first call is checked against
    (x,) = _batches((2, 8, 32), 1)[0]
    x = x * 1.1
    with torch.no_grad():
        expected, merged, compiled = unmerged(x), fast.compiled_form(x), fast(x)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-6)
    # Inductor took the merged linear to oneDNN's int8 GEMM: two of them, not four
    assert counters["inductor"]["qlinear_weight_prepack_matcher_count"] == 2
    assert (compiled - expected).abs().max().item() <= 0.02 * expected.abs().max().item()
    # the compiled form holds the merged weights, not those it replaced too
    names = {name for name, _ in fast.compiled_form.named_buffers()}
    names |= {name for name, _ in fast.compiled_form.named_parameters()}
    assert not any(name.startswith(("q.", "k.", "v.")) for name in names), names


@requires_x86
def test_linears_whose_output_the_graph_returns_stay_apart():
    batches = _batches((4, 16))
    reference = qcore.convert_pt2e(_calibrated(ReturnsProjections(), batches), lower=False)
    assert concat_sibling_linears(reference) == 0
    assert _linears(reference) == 2


@requires_x86
def test_per_tensor_weights_stay_apart():
    """Concatenated per-tensor weights would need one scale for all: not exact."""
    from qcore.config.qconfig import QConfig
    from qcore.observers import MinMaxObserver
    from qcore.pt2e import BackendQuantizer

    qconfig = QConfig(
        MinMaxObserver.with_args(dtype=torch.quint8),
        MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
    mapping = qcore.get_default_qconfig_mapping("x86").set_global(qconfig)
    quantizer = BackendQuantizer.for_backend("x86", mapping)
    batches = _batches((2, 8, 32))
    reference = qcore.convert_pt2e(_calibrated(Attention(), batches, quantizer), lower=False)
    linears = _linears(reference)
    assert concat_sibling_linears(reference) == 0
    assert _linears(reference) == linears


@requires_x86
def test_linears_with_quantized_outputs_stay_apart():
    """Each output's own quantize fuses into its GEMM; a merged GEMM would lose that."""

    class TwoBranches(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
            self.c = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(torch.relu(self.a(x)) + torch.relu(self.b(x)))

    torch.manual_seed(0)
    batches = _batches((4, 16))
    prepared = qcore.prepare_fx(TwoBranches().eval(), None, batches[0], backend="x86")
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    from qcore.compiling import _reference_form

    reference = _reference_form(prepared, "fx")
    assert _linears(reference) == 3
    assert concat_sibling_linears(reference) == 0


class OtherViews(torch.nn.Module):
    """Views of q a slice cannot stand in for: split, as_strided, diagonal."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.q, self.k = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k = self.q(h), self.k(h)
        batch, tokens, dim = q.shape
        diagonal = q.view(batch, tokens * dim).diagonal()
        first, second = q.split(tokens // 2, dim=1)
        strided = torch.as_strided(q, (batch, tokens * dim), (tokens * dim, 1))
        halves = first.view(batch, -1) + second.view(batch, -1)
        return strided + k.reshape(batch, -1) + halves.repeat(1, 2) + diagonal.sum()


@requires_x86
def test_other_views_of_an_output_keep_its_linear_apart():
    batches = _batches((2, 4, 8))
    reference = qcore.convert_pt2e(_calibrated(OtherViews(), batches), lower=False)
    (x,) = batches[0]
    with torch.no_grad():
        expected = reference(x)
    assert concat_sibling_linears(reference) == 0
    with torch.no_grad():
        torch.testing.assert_close(reference(x), expected, rtol=0, atol=0)
