"""``qcore.quantize_pt2e(..., accuracy_budget=...)``: the FX path's search
(``qcore.accuracy``) on exported models, keeping modules float by their
``nn_module_stack`` path.

The model nests the trap of tests/test_accuracy_budget.py one module down
(``body.b``): a weight column of 1000 reads an input channel a ReLU keeps at
zero, so it changes nothing in float, but it sets the per-channel weight scale
and every other weight of ``body.b`` rounds to zero in int8. Keeping exactly
``body.b`` float restores the model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backends import backend_params, installed
from test_accuracy_budget import Chain

import qcore
from qcore import accuracy
from qcore.engine.explain import Status
from qcore.pt2e.patterns import packet
from qcore.pt2e.quantize import module_path, weighted_layer_paths

pytestmark = pytest.mark.filterwarnings("ignore:.*stay in float:qcore.QCoreWarning")

BACKENDS = backend_params(("x86", "qnnpack"))
requires_x86 = pytest.mark.skipif(not installed("x86"), reason="needs the x86 plugin")
LAYERS = ["body.a", "body.b", "body.c", "body.d"]


class Nested(torch.nn.Module):
    def __init__(self, sensitive: tuple[str, ...]) -> None:
        super().__init__()
        self.body = Chain(sensitive)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _exported(sensitive: tuple[str, ...]) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    model = Nested(sensitive).eval()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 16, generator=generator) for _ in range(4)]
    return torch.export.export(model, (data[0],)).module(), data


def _sqnr(exported: torch.fx.GraphModule, data: list, quantized: torch.nn.Module) -> float:
    return accuracy.gauge_for(qcore.MinSQNR(db=0.0), exported, data).measure(quantized)


def _float_linears(quantized: torch.fx.GraphModule) -> dict[str, str]:
    """Module path -> explain reason, for each aten.linear left float in the graph."""
    report = qcore.explain(quantized)
    entries = {e.node: e for e in report.entries}
    found = {}
    for node in quantized.graph.nodes:
        if packet(node) is torch.ops.aten.linear:
            entry = entries[node.name]
            assert entry.status == Status.FLOAT
            found[module_path(node)] = entry.reason
    return found


def _int8_kernels(quantized: torch.fx.GraphModule) -> int:
    return sum(1 for e in qcore.explain(quantized).entries if e.op in ("Linear", "LinearReLU"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_keeps_exactly_the_sensitive_layer_float(backend: str) -> None:
    exported, data = _exported(("b",))
    before = exported.code
    weights = {k: v.clone() for k, v in exported.state_dict().items()}

    plain = qcore.quantize_pt2e(exported, backend, data)
    assert _float_linears(plain) == {}
    assert _int8_kernels(plain) == 4
    assert _sqnr(exported, data, plain) < 15.0  # the trap works: int8 costs a lot

    with warnings.catch_warnings():
        warnings.simplefilter("error", accuracy.AccuracyBudgetNotMet)
        quantized = qcore.quantize_pt2e(
            exported, backend, data, accuracy_budget=qcore.MinSQNR(db=30.0)
        )
    assert _sqnr(exported, data, quantized) >= 30.0
    kept = _float_linears(quantized)
    assert list(kept) == ["body.b"]
    reason = kept["body.b"]
    assert reason.startswith("kept float (accuracy budget): SQNR ")
    assert "dB with it float" in reason and "budget 30 dB" in reason
    assert reason.endswith("(module body.b)")
    assert _int8_kernels(quantized) == 3  # a, c, d still int8; b has no kernel
    (b_linear,) = [n for n in quantized.graph.nodes if module_path(n) == "body.b"]
    weight = quantized.get_parameter(b_linear.args[1].target)
    assert weight.dtype == torch.float32
    assert torch.equal(weight, weights["body.b.weight"])

    # the user's exported model is as it was
    assert exported.code == before
    assert all(torch.equal(v, weights[k]) for k, v in exported.state_dict().items())


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_sensitive_layers_both_kept(backend: str) -> None:
    exported, data = _exported(("b", "d"))
    quantized = qcore.quantize_pt2e(exported, backend, data, accuracy_budget=30.0)
    assert sorted(_float_linears(quantized)) == ["body.b", "body.d"]
    assert _sqnr(exported, data, quantized) >= 30.0
    assert _int8_kernels(quantized) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_met_as_is_keeps_nothing_float(backend: str) -> None:
    exported, data = _exported(())
    plain = qcore.quantize_pt2e(exported, backend, data)
    measured = _sqnr(exported, data, plain)
    assert measured > 25.0
    quantized = qcore.quantize_pt2e(exported, backend, data, accuracy_budget=measured - 5.0)
    assert _float_linears(quantized) == {}
    assert _int8_kernels(quantized) == 4
    assert "kept float" not in qcore.explain(quantized).format(verbose=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unreachable_budget_warns_and_returns_the_closest(backend: str) -> None:
    exported, data = _exported(("b",))
    with pytest.warns(accuracy.AccuracyBudgetNotMet, match=r"200 dB not met") as record:
        quantized = qcore.quantize_pt2e(exported, backend, data, accuracy_budget=200.0)
    assert record[0].filename == __file__  # points at the caller, as the FX path's
    kept = _float_linears(quantized)
    assert "body.b" in kept
    assert all(r.startswith("kept float (accuracy budget not met)") for r in kept.values())
    assert _sqnr(exported, data, quantized) >= 30.0  # the best found, not the last built


@requires_x86
def test_candidates_are_the_weighted_modules_by_path() -> None:
    exported, data = _exported(("b",))
    prepared = qcore.prepare_pt2e(exported, "x86")
    assert weighted_layer_paths(prepared) == LAYERS


@requires_x86
def test_metric_budget_and_exported_program() -> None:
    model = Nested(("b",)).eval()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 16, generator=generator) for _ in range(4)]
    program = torch.export.export(model, (data[0],))

    def error(candidate: torch.nn.Module, batches: list) -> float:
        with torch.no_grad():
            return sum(float((candidate(x) - model(x)).abs().mean()) for x in batches)

    budget = qcore.MetricBudget(error, max_drop=0.05, higher_is_better=False)
    quantized = qcore.quantize_pt2e(program, "x86", data, accuracy_budget=budget)
    assert list(_float_linears(quantized)) == ["body.b"]
    assert error(quantized, data) <= 0.05


@requires_x86
def test_backend_must_be_a_name() -> None:
    exported, data = _exported(())
    quantizer = qcore.pt2e.BackendQuantizer.for_backend("x86")
    with pytest.raises(TypeError, match="backend: got"):
        qcore.quantize_pt2e(exported, quantizer, data, accuracy_budget=30.0)


class _NestedAct(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from test_accuracy_budget import ChainAct

        self.body = ChainAct()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_activation_only_its_layer_feeds_goes_float_with_it(backend: str) -> None:
    """body.b's Hardswish module is quantized on its own: kept float with body.b, as
    the FX path keeps it (tests/test_accuracy_budget.py)."""
    from qcore.pt2e.quantize import activation_followers

    model = _NestedAct().eval()
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 16, generator=generator) for _ in range(4)]
    exported = torch.export.export(model, (data[0],)).module()
    prepared = qcore.prepare_pt2e(exported, qcore.pt2e.BackendQuantizer.for_backend(backend))
    assert activation_followers(prepared, weighted_layer_paths(prepared)) == {
        "body.b": ("body.act",)
    }
    quantized = qcore.quantize_pt2e(exported, backend, data, accuracy_budget=30.0)
    assert list(_float_linears(quantized)) == ["body.b"]
    report = qcore.explain(quantized)
    act = [e for e in report.entries if e.op.endswith("hardswish") and e.status == Status.FLOAT]
    assert len(act) == 1, str(report)
    assert act[0].reason.startswith("kept float (accuracy budget): SQNR"), act[0].reason
    assert "(with body.b)" in act[0].reason and act[0].reason.endswith("(module body.act)")
    assert _sqnr(exported, data, quantized) >= 30.0
