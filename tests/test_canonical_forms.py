"""Layers written in other forms than the backend's patterns read run on int8 kernels.

- Convs with padding="same"/"valid" (FX and PT2E). transformers' EfficientNet writes
  its convs that way; torch.export gives them as ``aten.conv2d.padding``. They used
  to stay in reference form on every backend (15 of EfficientNet's 16 convs on
  PT2E) and the algorithms could not see them. An even kernel's "same" (asymmetric
  in torch) stays in reference form, with the reason.
- Linears written as ``torch.addmm(bias, x, weight)`` (transformers' Conv1D, all of
  GPT-2's projections), on PT2E and FX: they stayed float, and on FX the views
  around them were quantized for nothing.

Each lowered model must equal, bit for bit, the same model written the usual way.
"""

from __future__ import annotations

import pytest
import torch
from backends import backend_params, requires_qnnpack

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


class Conv1D(torch.nn.Module):
    """transformers' GPT-2 projection: a linear with its weight stored (in, out)."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(inputs, outputs) * 0.2)
        self.bias = torch.nn.Parameter(torch.randn(outputs) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(shape)


class Linear2D(torch.nn.Linear):
    """The twin: an nn.Linear on the same 2-D view Conv1D multiplies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.out_features,)
        return super().forward(x.view(-1, x.shape[-1])).view(shape)


class Projections(torch.nn.Module):
    def __init__(self, layer: type) -> None:
        super().__init__()
        self.up, self.down = layer(16, 32), layer(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _addmm_and_linear_twins() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    addmm = Projections(Conv1D).eval()
    linear = Projections(Linear2D).eval()
    with torch.no_grad():
        for name in ("up", "down"):
            getattr(linear, name).weight.copy_(getattr(addmm, name).weight.t())
            getattr(linear, name).bias.copy_(getattr(addmm, name).bias)
    return addmm, linear


def _pt2e(model: torch.nn.Module, quantizer: object) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 5, 16, generator=generator),) for _ in range(3)]
    prepared = qcore.prepare_pt2e(torch.export.export(model, batches[0]).module(), quantizer)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    return qcore.convert_pt2e(prepared), batches


@pytest.mark.parametrize("backend", backend_params())
def test_addmm_linears_run_on_kernels_as_their_nn_linear_twins(backend):
    addmm, linear = _addmm_and_linear_twins()
    lowered, batches = _pt2e(addmm, backend)
    twin, _ = _pt2e(linear, backend)
    layers = [e for e in qcore.explain(lowered) if e.op in ("aten.linear", "Linear")]
    assert [e.status.name for e in layers] == ["QUANTIZED", "QUANTIZED"], layers
    assert [e.kernel for e in layers] == [
        e.kernel for e in qcore.explain(twin) if e.op in ("aten.linear", "Linear")
    ]
    for batch in batches:
        assert torch.equal(lowered(*batch), twin(*batch))
    # the user's model is untouched: its Conv1D weights are still (in, out)
    assert addmm.up.weight.shape == (16, 32)


def _fx(model: torch.nn.Module, backend: str, mapping: object, reference: bool = False):
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 5, 16, generator=generator),) for _ in range(3)]
    prepared = qcore.prepare_fx(model, mapping, batches[0], backend=backend)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    convert = qcore.convert_to_reference_fx if reference else qcore.convert_fx
    return convert(prepared), batches


def _linears(model: torch.nn.Module) -> list:
    return [e for e in qcore.explain(model) if e.op == "linear"]


@pytest.mark.parametrize("backend", backend_params())
def test_fx_addmm_linears_run_on_kernels_as_their_nn_linear_twins(backend):
    from torch.ao.quantization import get_default_qconfig_mapping

    mapping = get_default_qconfig_mapping(backend)
    addmm, linear = _addmm_and_linear_twins()
    lowered, batches = _fx(addmm, backend, mapping)
    twin, _ = _fx(linear, backend, mapping)
    layers = _linears(lowered)
    assert [e.status.name for e in layers] == ["QUANTIZED", "QUANTIZED"], layers
    assert [e.kernel for e in layers] == [e.kernel for e in _linears(twin)]
    reference, _ = _fx(addmm, backend, mapping, reference=True)
    twin_reference, _ = _fx(linear, backend, mapping, reference=True)
    for batch in batches:
        assert torch.equal(lowered(*batch), twin(*batch))
        assert torch.equal(reference(*batch), twin_reference(*batch))
    assert addmm.up.weight.shape == (16, 32)  # the user's Conv1D is untouched


@requires_qnnpack
def test_fx_addmm_linear_follows_its_modules_qconfig():
    """The rewritten node keeps its module path: a QConfig of None by module name
    keeps that projection float, the other quantized."""
    from torch.ao.quantization import get_default_qconfig_mapping

    mapping = get_default_qconfig_mapping("qnnpack").set_module_name("down", None)
    addmm, _ = _addmm_and_linear_twins()
    lowered, _ = _fx(addmm, "qnnpack", mapping)
    assert [e.status.name for e in _linears(lowered)] == ["QUANTIZED", "FLOAT"]


def test_a_quantizer_of_ones_own_sees_the_exported_graph_as_is():
    """Only qcore's quantizers canonicalize (in their transform_for_annotation): a
    Quantizer written for the exported graph finds its addmm where it left it."""
    from qcore.quantizer import Quantizer

    seen = []

    class Looking(Quantizer):
        def annotate(self, model):
            seen.extend(str(n.target) for n in model.graph.nodes if n.op == "call_function")
            return model

    addmm, _ = _addmm_and_linear_twins()
    _pt2e(addmm, Looking())
    assert seen.count("aten.addmm.default") == 2 and "aten.linear.default" not in seen


def test_an_addmm_that_is_not_a_linear_is_left_as_is():
    """beta != 1 scales the bias: not a linear; the rewrite leaves it."""
    from qcore.pt2e import canonicalize

    class Scaled(Conv1D):
        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight, beta=0.5)

    torch.manual_seed(0)
    model = Scaled(4, 3).eval()
    x = torch.randn(2, 4)
    exported = torch.export.export(model, (x,)).module()
    assert canonicalize(exported) == 0
    assert [str(n.target) for n in exported.graph.nodes if n.op == "call_function"].count(
        "aten.addmm.default"
    ) == 1
