"""Generated graphs, quantized by qcore and by torch.ao with the same mapping (issue 13, item 5).

hypothesis builds small models from the shapes users bring and the defects of
issue 13 came from: a conv or linear followed by each activation family in its
module, functional, method and in-place forms; modules called twice and
residuals reused; ops on sizes and lists, bool masks, scalar arithmetic; in-place
writes whose results nothing reads, and views made before an in-place write.

Each model goes through qcore and through torch.ao FX with torch.ao's own
default QConfigMapping for fbgemm (7-bit activations, so int8 sums cannot
saturate on CPUs without VNNI). Where torch.ao runs, qcore must run too, and
its reference form's SQNR against float must be at least that of torch.ao's
reference path - 0.5 dB, and its lowered model's at least that of its own
reference form or of torch.ao's lowered model (``assert_as_accurate``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params, requires_fbgemm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx as ao_convert_fx
from torch.ao.quantization.quantize_fx import convert_to_reference_fx as ao_reference_fx
from torch.ao.quantization.quantize_fx import prepare_fx as ao_prepare_fx
from zoo.baseline import backend_config

import qcore
from qcore.kernels.runtime import using_engine

pytestmark = requires_fbgemm

CHANNELS = 4
SIDE = 6
TOLERANCE_DB = 0.5

# Each activation family in the forms a user writes it: name -> form -> callable(module, x).
# A form that needs a module gets it from ActivationModule.
ACTIVATIONS: dict[str, dict[str, object]] = {
    "relu": {
        "module": lambda: nn.ReLU(),
        "module_inplace": lambda: nn.ReLU(inplace=True),
        "functional": lambda x: F.relu(x),
        "functional_inplace": lambda x: F.relu(x, inplace=True),
        "torch": lambda x: torch.relu(x),
        "method": lambda x: x.relu(),
        "method_inplace": lambda x: x.relu_(),
    },
    "relu6": {
        "module": lambda: nn.ReLU6(),
        "functional": lambda x: F.relu6(x),
        "functional_inplace": lambda x: F.relu6(x, inplace=True),
    },
    "hardtanh": {
        "module": lambda: nn.Hardtanh(-1.0, 1.0),
        "functional": lambda x: F.hardtanh(x, -1.0, 1.0),
        "functional_inplace": lambda x: F.hardtanh(x, -1.0, 1.0, inplace=True),
    },
    "hardswish": {
        "module": lambda: nn.Hardswish(),
        "functional": lambda x: F.hardswish(x),
    },
    "hardsigmoid": {
        "module": lambda: nn.Hardsigmoid(),
        "functional": lambda x: F.hardsigmoid(x),
        "functional_inplace": lambda x: F.hardsigmoid(x, inplace=True),
    },
    "sigmoid": {
        "module": lambda: nn.Sigmoid(),
        "torch": lambda x: torch.sigmoid(x),
        "method": lambda x: x.sigmoid(),
        "method_inplace": lambda x: x.sigmoid_(),
    },
    "tanh": {
        "module": lambda: nn.Tanh(),
        "torch": lambda x: torch.tanh(x),
        "method": lambda x: x.tanh(),
        "method_inplace": lambda x: x.tanh_(),
    },
    "softmax": {
        "module": lambda: nn.Softmax(dim=1),
        "functional": lambda x: F.softmax(x, dim=1),
        "method": lambda x: x.softmax(1),
    },
    "elu": {"module": lambda: nn.ELU(), "functional": lambda x: F.elu(x)},
    "leaky_relu": {
        "module": lambda: nn.LeakyReLU(0.1),
        "functional": lambda x: F.leaky_relu(x, 0.1),
    },
    "gelu": {"module": lambda: nn.GELU(), "functional": lambda x: F.gelu(x)},
    "silu": {"module": lambda: nn.SiLU(), "functional": lambda x: F.silu(x)},
}

ACTIVATION_FORMS = [(name, form) for name, forms in ACTIVATIONS.items() for form in forms]

# The steps of a generated model, all on (N, CHANNELS, SIDE, SIDE) tensors.
STEPS = (
    "conv_act",  # a conv, then an activation in one of its forms
    "called_twice",  # one conv module called twice, the results added
    "called_twice_fusable",  # relu(conv(x)) + conv(x): one call fusable, the other not
    "residual_reused",  # y = a(x); z = b(x) + y; z + y
    "view_list",  # a view whose shape is a list built from x.size()
    "mask",  # masked_fill with a bool mask computed from the tensor
    "scalar",  # scalar arithmetic on either side
    "write_ignored",  # y = a(x); y.mul_(0.5); F.relu(y, inplace=True): results unread, y read
    "view_before_write",  # v = y.view(...); y.add_(b(x)); relu(y) + v: v sees the write
)
SCALAR_OPS = ("x + 3", "3 + x", "x * 0.5", "x - 1", "x / 2", "0.5 * x")


@dataclass(frozen=True)
class Step:
    kind: str
    activation: tuple[str, str] | None = None
    scalar: str | None = None


class Generated(nn.Module):
    """A chain of ``steps`` on images, with a linear head and an activation on it."""

    def __init__(self, steps: tuple[Step, ...], head: tuple[str, str]) -> None:
        super().__init__()
        self.steps = steps
        self.head_activation = head
        self.convs = nn.ModuleList()
        self.activations = nn.ModuleDict()
        for index, step in enumerate(steps):
            count = {
                "conv_act": 1,
                "called_twice": 1,
                "called_twice_fusable": 1,
                "residual_reused": 2,
                "write_ignored": 1,
                "view_before_write": 2,
            }.get(step.kind, 0)
            for _ in range(count):
                self.convs.append(nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1))
            if step.activation and step.activation[1].startswith("module"):
                self.activations[str(index)] = ACTIVATIONS[step.activation[0]][step.activation[1]]()
        self.head = nn.Linear(CHANNELS * SIDE * SIDE, 8)
        if head[1].startswith("module"):
            self.activations["head"] = ACTIVATIONS[head[0]][head[1]]()

    def _activate(self, key: str, activation: tuple[str, str], x: torch.Tensor) -> torch.Tensor:
        if activation[1].startswith("module"):
            return self.activations[key](x)
        return ACTIVATIONS[activation[0]][activation[1]](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = 0
        for index, step in enumerate(self.steps):
            if step.kind == "conv_act":
                x = self._activate(str(index), step.activation, self.convs[conv](x))
                conv += 1
            elif step.kind == "called_twice":
                x = self.convs[conv](x) + self.convs[conv](x)
                conv += 1
            elif step.kind == "called_twice_fusable":
                x = F.relu(self.convs[conv](x)) + self.convs[conv](x)
                conv += 1
            elif step.kind == "residual_reused":
                y = self.convs[conv](x)
                z = self.convs[conv + 1](x) + y
                x = z + y
                conv += 2
            elif step.kind == "view_list":
                s = x.mean((2, 3))
                s = s.view([-1, s.size(1)] + [1] * (x.ndim - 2))
                x = x * s
            elif step.kind == "mask":
                x = x.masked_fill(x < -0.5, 0.0)
            elif step.kind == "scalar":
                x = _scalar(step.scalar, x)
            elif step.kind == "write_ignored":
                x = self.convs[conv](x)
                x.mul_(0.5)
                F.relu(x, inplace=True)
                conv += 1
            elif step.kind == "view_before_write":
                y = self.convs[conv](x)
                flat = y.view(y.size(0), -1)
                y.add_(self.convs[conv + 1](x))
                x = torch.relu(y) + flat.view_as(y)
                conv += 2
        x = self.head(torch.flatten(x, 1))
        return self._activate("head", self.head_activation, x)


def _scalar(op: str, x: torch.Tensor) -> torch.Tensor:
    if op == "x + 3":
        return x + 3
    if op == "3 + x":
        return 3 + x
    if op == "x * 0.5":
        return x * 0.5
    if op == "x - 1":
        return x - 1
    if op == "x / 2":
        return x / 2
    return 0.5 * x


activations = st.sampled_from(ACTIVATION_FORMS)
steps = st.one_of(
    activations.map(lambda a: Step("conv_act", activation=a)),
    st.sampled_from(
        [
            "called_twice",
            "called_twice_fusable",
            "residual_reused",
            "view_list",
            "mask",
            "write_ignored",
            "view_before_write",
        ]
    ).map(Step),
    st.sampled_from(SCALAR_OPS).map(lambda op: Step("scalar", scalar=op)),
)
models = st.tuples(st.lists(steps, min_size=1, max_size=4), activations)


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other).pow(2).sum().item()
    signal = reference.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _build(parts) -> nn.Module:
    step_list, head = parts
    torch.manual_seed(0)
    return Generated(tuple(step_list), head).eval()


def _data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, CHANNELS, SIDE, SIDE, generator=generator) for _ in range(4)]


def _run_torch_ao(model: nn.Module, data: list[torch.Tensor], backend: str = "fbgemm"):
    """torch.ao's (reference, lowered) outputs on data[0] under its own default mapping,
    BackendConfig and quantized engine for ``backend``, or None where torch.ao fails."""
    mapping, config = get_default_qconfig_mapping(backend), backend_config(backend)
    try:
        with warnings.catch_warnings(), using_engine(backend):
            warnings.simplefilter("ignore")
            prepared = ao_prepare_fx(model, mapping, (data[0].clone(),), backend_config=config)
            with torch.no_grad():
                for batch in data:
                    prepared(batch.clone())
            reference = ao_reference_fx(_copy(prepared), backend_config=config)
            lowered = ao_convert_fx(_copy(prepared), backend_config=config)
            with torch.no_grad():
                return reference(data[0].clone()), lowered(data[0].clone())
    except Exception:  # noqa: BLE001 - torch.ao failing excuses qcore from this model
        return None


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def _run_qcore(model: nn.Module, data: list[torch.Tensor], backend: str = "fbgemm"):
    """qcore's (reference, lowered) outputs on data[0], with torch.ao's own mapping."""
    mapping = get_default_qconfig_mapping(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        prepared = qcore.prepare_fx(model, mapping, (data[0].clone(),), backend=backend)
    with torch.no_grad():
        for batch in data:
            prepared(batch.clone())
    reference = qcore.convert_to_reference_fx(prepared)
    lowered = qcore.convert_fx(prepared)
    with torch.no_grad():
        return reference(data[0].clone()), lowered(data[0].clone())


def assert_as_accurate(expected, ours, peer, case) -> None:
    """qcore's reference form is at least as accurate as one of torch.ao's forms
    (-0.5 dB); its lowered model at least as accurate as its own reference form or
    as torch.ao's lowered model: its kernels either follow its reference, or, where
    the CPU cannot (int8 sums of 8-bit activations saturate without VNNI), do no
    worse than torch.ao's kernels on the same CPU.

    One of torch.ao's forms: after a scalar product torch.ao's reference shares the
    input's observer, while its mul_scalar kernel scales exactly, as qcore's
    reference does. There its reference is not what its lowered model computes,
    and lands its rounding elsewhere, 1.5 dB either way (hardsigmoid, x * 0.5:
    torch.ao 41.1 reference, 39.6 lowered; qcore 39.6 both)."""
    reference_db, lowered_db = sqnr(expected, ours[0]), sqnr(expected, ours[1])
    peer_reference_db, peer_lowered_db = sqnr(expected, peer[0]), sqnr(expected, peer[1])
    assert reference_db >= min(peer_reference_db, peer_lowered_db) - TOLERANCE_DB, (
        f"reference: qcore {reference_db:.1f} dB, torch.ao {peer_reference_db:.1f} dB on {case}"
    )
    assert lowered_db >= min(reference_db, peer_lowered_db) - TOLERANCE_DB, (
        f"lowered: qcore {lowered_db:.1f} dB, its reference {reference_db:.1f} dB, "
        f"torch.ao lowered {peer_lowered_db:.1f} dB on {case}"
    )


#: The least SQNR against float a generated model may give, either form.
FLOOR_DB = 15.0

GENERATED = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
"""How many generated models each path is tried on (test_pt2e_generated_vs_torchao too)."""


def float_case(parts) -> tuple[nn.Module, list[torch.Tensor], torch.Tensor]:
    """The model ``parts`` describes, its data, and its float output on data[0]."""
    model = _build(parts)
    data = _data()
    with torch.no_grad():
        return model, data, model(data[0].clone())


#: fbgemm, and onednn for its fusions (conv-add, linear-leaky_relu) no other backend has.
GENERATED_BACKENDS = backend_params(("fbgemm", "onednn"))


@pytest.mark.parametrize("backend", GENERATED_BACKENDS)
@GENERATED
@given(parts=models)
def test_generated_graphs_match_torch_ao(backend, parts):
    model, data, expected = float_case(parts)
    ours = _run_qcore(model, data, backend)
    # Against float too: a fault torch.ao shares passes the comparison (a module called
    # twice and fused under its name: 6-8 dB on both). On 150 random models of up to 6
    # steps (fbgemm) and 80 (onednn), none gave less than 20.9 dB.
    assert min(sqnr(expected, output) for output in ours) > FLOOR_DB, (backend, parts)
    peer = _run_torch_ao(model, data, backend)
    if peer is None:
        return  # torch.ao cannot quantize it either
    assert_as_accurate(expected, ours, peer, (backend, parts))


@pytest.mark.parametrize("activation", ACTIVATION_FORMS, ids="-".join)
def test_every_activation_form_after_conv_and_linear(activation):
    """Each family and form once, with the same activation on the linear head."""
    model = _build(([Step("conv_act", activation=activation)], activation))
    data = _data()
    with torch.no_grad():
        expected = model(data[0].clone())
    peer = _run_torch_ao(model, data)
    reference, lowered = _run_qcore(model, data)
    if peer is None:  # torch.ao fails on sigmoid_/tanh_ after a linear; qcore runs
        assert torch.isfinite(lowered).all()
        return
    assert_as_accurate(expected, (reference, lowered), peer, activation)


@pytest.mark.parametrize(
    "scalars",
    [
        # x * 0.5 derives its qparams (exact); x + 3 shared them, which observe
        # nothing, and was clipped: 15.7 dB against torch.ao's lowered 40.7
        ("x * 0.5", "x + 3", "x + 3"),
        # x * 0.5 * 0.5 shared the first product's: its lowered form 29.3 dB
        # against torch.ao's lowered 36.3
        ("x * 0.5", "x * 0.5"),
    ],
    ids=" then ".join,
)
def test_scalar_arithmetic_after_a_derived_product(scalars):
    """Found by the generator above. Both forms of qcore against torch.ao's lowered
    model, what its users run: torch.ao's reference form shares one observer along
    the chain and lands its rounding elsewhere (43.8 dB on the first chain, where
    its own kernels give 40.7), a difference of where steps fall, not of clipping."""
    model = _build(([Step("scalar", scalar=op) for op in scalars], ("relu", "module")))
    data = _data()
    with torch.no_grad():
        expected = model(data[0].clone())
    reference, lowered = _run_qcore(model, data)
    peer_lowered_db = sqnr(expected, _run_torch_ao(model, data)[1])
    assert sqnr(expected, reference) >= peer_lowered_db - TOLERANCE_DB
    assert sqnr(expected, lowered) >= peer_lowered_db - TOLERANCE_DB
