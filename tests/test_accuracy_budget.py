"""Accuracy-aware fallback (issue 17 §2): ``qcore.quantize(..., accuracy_budget=...)``.

The models make one or two linears very sensitive: a weight column of 1000 reads
an input channel a ReLU keeps at zero, so it changes nothing in float, but it sets
the per-channel weight scale and every other weight of that layer rounds to zero
in int8. Keeping such a layer float restores the model; the others are harmless.
The search is checked against a greedy per-layer search and an exhaustive one
written here, on the test's own builds and its own SQNR.
"""

from __future__ import annotations

import itertools
import math
import operator
import warnings

import pytest
import torch
from backends import FIRST_PARTY, backend_params, installed

import qcore
from qcore import accuracy, keep_float
from qcore.engine.explain import Status
from qcore.keep_float import weighted_layers

pytestmark = pytest.mark.filterwarnings("ignore:.*stay in float:qcore.QCoreWarning")

LAYERS = ("a", "b", "c", "d")


class Chain(torch.nn.Module):
    """a -> relu -> b -> c -> relu -> d; ``sensitive`` of b and d get the trap."""

    def __init__(self, sensitive: tuple[str, ...] = ("b", "d")) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32)
        self.c, self.d = torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)
        with torch.no_grad():
            for dead, layer in (("a", "b"), ("c", "d")):
                if layer in sensitive:
                    getattr(self, dead).weight[0] = 0  # relu(-1) = 0: a dead channel
                    getattr(self, dead).bias[0] = -1
                    getattr(self, layer).weight[:, 0] = 1000.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(self.b(torch.relu(self.a(x))))))


def _backend() -> str:
    for name in FIRST_PARTY:
        if installed(name):
            return name
    pytest.skip("needs a first-party backend")


class ChainHead(Chain):
    """Its input through a quantized Hardswish module, which is no candidate and
    follows none: no choice of float layers and function calls makes it exact."""

    def __init__(self, sensitive: tuple[str, ...] = ("b", "d")) -> None:
        super().__init__(sensitive)
        self.head = torch.nn.Hardswish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.head(x))


class ChainAdd(Chain):
    """A residual add whose output spans 1000 in one channel that is sliced off:
    the add's int8 output crushes the others, as does the side linear's."""

    def __init__(self) -> None:
        super().__init__(())
        self.e = torch.nn.Linear(16, 8)
        with torch.no_grad():
            self.e.bias[0] = 1000.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) + self.e(x))[:, 1:]


def _backend() -> str:
    for name in FIRST_PARTY:
        if installed(name):
            return name
    pytest.skip("needs a first-party backend")


def _data(n: int = 4, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 16, generator=generator) for _ in range(n)]


def _sqnr(model, quantized, data) -> float:
    """Pooled over the batches: 10 log10(sum |y|^2 / sum |y - q|^2)."""
    with torch.no_grad():
        signal = sum(float(model(x).pow(2).sum()) for x in data)
        noise = sum(float((model(x) - quantized(x)).pow(2).sum()) for x in data)
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def _builder(model, backend, data):
    """The test's own conversions with a set of layers float, counted."""
    built = []

    def build(names):
        built.append(frozenset(names))
        mapping = qcore.get_default_qconfig_mapping(backend)
        for name in names:
            mapping.set_module_name(name, None)
        prepared = qcore.prepare_fx(model, mapping, (data[0],), backend=backend)
        with torch.no_grad():
            for x in data:
                prepared(x)
        return qcore.convert_fx(prepared)

    return build, built


def _float_layers(quantized) -> set[str]:
    report = qcore.explain(quantized)
    return {name for name in LAYERS if report[name].status is Status.FLOAT}


def _greedy(build, model, data, db: float) -> set[str]:
    """Brute-force greedy: each step keeps float the one layer that helps most."""
    kept: set[str] = set()
    while _sqnr(model, build(kept), data) < db:
        rest = [name for name in LAYERS if name not in kept]
        assert rest, "the budget is out of reach"
        kept.add(max(rest, key=lambda name: _sqnr(model, build(kept | {name}), data)))
    return kept


def _fewest(build, model, data, db: float) -> int:
    """Exhaustive: the fewest float layers any choice needs."""
    for size in range(len(LAYERS) + 1):
        for kept in itertools.combinations(LAYERS, size):
            if _sqnr(model, build(set(kept)), data) >= db:
                return size
    raise AssertionError("the budget is out of reach")


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("sensitive", [("b",), ("b", "d")])
def test_keeps_exactly_the_sensitive_layers_float_and_meets_the_budget(backend, sensitive):
    model, data = Chain(sensitive).eval(), _data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    int8 = qcore.quantize(model, (data[0],), data, backend=backend)
    assert _sqnr(model, int8, data) < 10  # the trap works
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)  # the float relus
        chosen = qcore.quantize(
            model, (data[0],), data, backend=backend, accuracy_budget=qcore.MinSQNR(db=30.0)
        )
    assert _float_layers(chosen) == set(sensitive)
    measured = _sqnr(model, chosen, data)
    assert measured >= 30.0
    report = qcore.explain(chosen)
    for name in sensitive:
        reason = report[name].reason
        assert reason.startswith(f"kept float (accuracy budget): SQNR {measured:.1f} dB with")
        assert reason.endswith("int8; budget 30 dB")
        int8_db = float(reason.split(", ")[1].split(" dB")[0])
        assert int8_db < 30.0
    for name in set(LAYERS) - set(sensitive):
        assert report[name].status is Status.QUANTIZED
    for key, value in model.state_dict().items():  # the user's model is untouched
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params())
def test_no_more_float_layers_than_greedy_or_exhaustive_search(backend):
    model, data = Chain(("b", "d")).eval(), _data()
    build, _ = _builder(model, backend, data)
    base = _sqnr(model, build(set(LAYERS)), data)  # the float relus: infinite, or near
    for db in (20.0, 30.0, min(45.0, base - 3)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", qcore.QCoreWarning)
            chosen = qcore.quantize(model, (data[0],), data, backend=backend, accuracy_budget=db)
            greedy = _greedy(build, model, data, db)
            fewest = _fewest(build, model, data, db)
        assert _sqnr(model, chosen, data) >= db
        assert len(_float_layers(chosen)) <= len(greedy), (db, _float_layers(chosen), greedy)
        assert len(_float_layers(chosen)) == fewest, db


def test_build_count_is_within_the_documented_bound():
    model, data = Chain(("b", "d")).eval(), _data()
    build, built = _builder(model, _backend(), data)
    candidates = weighted_layers(build(frozenset()))
    assert candidates == list(LAYERS)
    built.clear()
    gauge = accuracy.gauge_for(qcore.MinSQNR(db=30.0), model, data)
    chosen = accuracy.keep_float_for_budget(build, candidates, gauge)
    kept = _float_layers(chosen)
    n, k = len(candidates), len(kept)
    assert len(built) == len(set(built))  # nothing converted twice
    assert len(built) <= (2 * n + 1 if k == 1 else k * n + k * k)
    assert built[: n + 1] == [frozenset(), *(frozenset({name}) for name in LAYERS)]


def test_a_budget_met_as_is_converts_once_and_keeps_nothing_float():
    model, data = Chain(()).eval(), _data()
    build, built = _builder(model, _backend(), data)
    gauge = accuracy.gauge_for(qcore.MinSQNR(db=20.0), model, data)
    chosen = accuracy.keep_float_for_budget(build, list(LAYERS), gauge)
    assert built == [frozenset()]
    assert _float_layers(chosen) == set()


def _agreement(model, data) -> float:
    """A user's metric: the share of rows whose argmax matches the labels."""
    hits = total = 0
    for x, labels in data:
        hits += int((model(x).argmax(1) == labels).sum())
        total += len(labels)
    return hits / total


@pytest.mark.parametrize("backend", backend_params())
def test_a_user_metric_with_a_tolerance(backend):
    model, data = Chain(("b", "d")).eval(), _data(8)
    with torch.no_grad():
        labelled = [(x, model(x).argmax(1)) for x in _data(4, seed=7)]  # float scores 1.0
    int8 = qcore.quantize(model, (data[0],), data, backend=backend)
    assert _agreement(int8, labelled) < 0.9
    # all four layers tie alone (0.25): the tie-break ranks b and d first
    budget = qcore.MetricBudget(_agreement, max_drop=0.1, eval_data=labelled)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        chosen = qcore.quantize(model, (data[0],), data, backend=backend, accuracy_budget=budget)
    score = _agreement(chosen, labelled)
    assert score >= 0.9
    assert _float_layers(chosen) == {"b", "d"}
    reason = qcore.explain(chosen)["b"].reason
    assert reason.startswith(f"kept float (accuracy budget): metric {score:.4g} with it float")
    assert reason.endswith("budget at least 0.9 (float 1, max_drop 0.1 absolute)")


@pytest.mark.parametrize("drop_type", ["absolute", "relative"])
def test_a_lower_is_better_metric_calibration_data_by_default(drop_type):
    model, data = Chain(("b",)).eval(), _data()
    seen = []

    def error(candidate, eval_data) -> torch.Tensor:  # a tensor is taken as its number
        seen.append(eval_data)
        return sum((candidate(x) - model(x)).pow(2).mean().detach() for x in eval_data) + 1.0

    budget = qcore.MetricBudget(error, max_drop=0.01, drop_type=drop_type, higher_is_better=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        chosen = qcore.quantize(model, (data[0],), data, backend=_backend(), accuracy_budget=budget)
    assert all(list(given) == data for given in seen)  # the calibration data, as given
    assert float(error(chosen, data)) <= 1.01  # float scores 1.0; relative: 1.0 * 0.01
    assert _float_layers(chosen) == {"b"}


def test_an_impossible_budget_warns_with_the_best_and_returns_it():
    model, data = ChainHead(("b", "d")).eval(), _data()
    with pytest.warns(qcore.AccuracyBudgetNotMet) as caught:
        chosen = qcore.quantize(model, (data[0],), data, backend=_backend(), accuracy_budget=300.0)
    warning = next(w for w in caught if w.category is qcore.AccuracyBudgetNotMet)
    assert warning.filename == __file__  # points at the quantize call
    message = str(warning.message)
    best = _sqnr(model, chosen, data)
    assert message.startswith(
        f"accuracy_budget: 300 dB not met: the best found is SQNR {best:.1f} dB with "
    )
    report = qcore.explain(chosen)
    kept = {e.node for e in report.float if e.reason.startswith("kept float (accuracy budget")}
    assert f"with {len(kept)} of 4 candidates float ({', '.join(sorted(kept))})" in message
    assert {"b", "d"} <= kept  # the best has the sensitive ones float
    reason = qcore.explain(chosen)["b"].reason
    assert reason.startswith(f"kept float (accuracy budget not met): SQNR {best:.1f} dB")


@pytest.mark.parametrize("backend", backend_params())
def test_a_function_call_is_a_candidate_too(backend):
    model, data = ChainAdd().eval(), _data()
    build, _ = _builder(model, backend, data)
    names = ("a", "b", "c", "d", "e", "add")

    def float_mapping(kept):
        mapping = qcore.get_default_qconfig_mapping(backend)
        for name in kept:  # the add is the root module's first call of operator.add
            if name == "add":
                mapping.set_module_name_object_type_order("", operator.add, 0, None)
            else:
                mapping.set_module_name(name, None)
        return mapping

    def sqnr_of(kept):
        prepared = qcore.prepare_fx(model, float_mapping(kept), (data[0],), backend=backend)
        for x in data:
            prepared(x)
        return _sqnr(model, qcore.convert_fx(prepared), data)

    assert sqnr_of(()) < 5
    fewest = next(
        size
        for size in range(len(names) + 1)
        if any(sqnr_of(kept) >= 30 for kept in itertools.combinations(names, size))
    )
    chosen = qcore.quantize(model, (data[0],), data, backend=backend, accuracy_budget=30.0)
    report = qcore.explain(chosen)
    kept = {e.node for e in report.float if e.reason.startswith("kept float (accuracy budget)")}
    assert "add" in kept and len(kept) == fewest == 2
    assert _sqnr(model, chosen, data) >= 30
    assert report["add"].reason.endswith("int8; budget 30 dB")


def test_eval_data_is_measured_instead_of_calibration_data():
    model, data = Chain(("b",)).eval(), _data()
    held_out = _data(2, seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qcore.QCoreWarning)
        chosen = qcore.quantize(
            model, (data[0],), data, backend=_backend(), accuracy_budget=qcore.MinSQNR(30, held_out)
        )
    reason = qcore.explain(chosen)["b"].reason
    assert f"SQNR {_sqnr(model, chosen, held_out):.1f} dB with it float" in reason


@pytest.mark.parametrize(
    ("make", "error", "text"),
    [
        (lambda: qcore.MinSQNR("30"), TypeError, r"MinSQNR.db: got '30' \(str\); expected a num"),
        (lambda: qcore.MinSQNR(True), TypeError, r"MinSQNR.db: got True"),
        (lambda: qcore.MinSQNR(math.inf), ValueError, r"MinSQNR.db: got inf.*finite"),
        (lambda: qcore.MinSQNR(30, torch.ones(3)), TypeError, r"MinSQNR.eval_data: got"),
        (lambda: qcore.MetricBudget(3), TypeError, r"MetricBudget.metric: got 3.*metric\(model"),
        (
            lambda: qcore.MetricBudget(_agreement, max_drop=-0.1),
            ValueError,
            r"MetricBudget.max_drop: got -0.1 \(float\); expected a finite number >= 0",
        ),
        (
            lambda: qcore.MetricBudget(_agreement, drop_type="percent"),
            ValueError,
            r"MetricBudget.drop_type: got 'percent'.*'absolute' or 'relative'",
        ),
        (
            lambda: qcore.MetricBudget(_agreement, higher_is_better="yes"),
            TypeError,
            r"MetricBudget.higher_is_better: got 'yes'",
        ),
    ],
)
def test_bad_budgets_are_named(make, error, text):
    with pytest.raises(error, match=text):
        make()


def test_bad_arguments_to_quantize_are_named():
    model, data = Chain(()).eval(), _data(2)
    with pytest.raises(TypeError, match=r"accuracy_budget: got 'high' \(str\); expected qcore"):
        qcore.quantize(model, (data[0],), data, backend=_backend(), accuracy_budget="high")
    with pytest.raises(ValueError, match=r"keep_float_if_slower=True and accuracy_budget"):
        qcore.quantize(
            model,
            (data[0],),
            data,
            backend=_backend(),
            accuracy_budget=30,
            keep_float_if_slower=True,
        )
    budget = qcore.MetricBudget(lambda m, d: None)
    returned = r"MetricBudget.metric: returned None \(NoneType\); expected a number"
    with pytest.raises(TypeError, match=returned):
        qcore.quantize(model, (data[0],), data, backend=_backend(), accuracy_budget=budget)


class Shared(Chain):
    """The sensitive b called twice: one module, one candidate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.d(torch.relu(self.c(self.b(h) + self.b(h))))


def test_a_module_called_twice_is_one_candidate():
    model, data = Shared(("b",)).eval(), _data()
    build, built = _builder(model, _backend(), data)
    converted = build(frozenset())
    assert sorted(weighted_layers(converted)) == ["a", "b", "b_1", "c", "d"]  # a copy per call
    candidates = weighted_layers(converted, model)
    assert candidates == ["a", "b", "c", "d"]
    built.clear()
    gauge = accuracy.gauge_for(qcore.MinSQNR(db=25.0), model, data)
    chosen = accuracy.keep_float_for_budget(build, candidates, gauge)
    assert len(built) == len(set(built))
    report = qcore.explain(chosen)
    assert report["b"].status is report["b_1"].status is Status.FLOAT
    assert report["b_1"].reason.startswith("kept float (accuracy budget): SQNR")
    assert _sqnr(model, chosen, data) >= 25
    through_quantize = qcore.quantize(model, (data[0],), data, _backend(), accuracy_budget=25)
    assert qcore.explain(through_quantize)["b_1"].reason == report["b_1"].reason


class ChainAct(Chain):
    """The sensitive b followed by a Hardswish module that only it feeds."""

    def __init__(self) -> None:
        super().__init__(("b",))
        self.act = torch.nn.Hardswish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.b(torch.relu(self.a(x))))
        return self.d(torch.relu(self.c(h)))


def test_an_activation_only_its_layer_feeds_goes_float_with_it():
    model, data = ChainAct().eval(), _data()
    converted = qcore.quantize(model, (data[0],), data, backend=_backend())
    found = keep_float.Candidates.of(model, converted)
    assert found.names == ["a", "b", "c", "d"]
    assert found.float_with == {"b": ("act",)}
    chosen = qcore.quantize(model, (data[0],), data, backend=_backend(), accuracy_budget=30)
    report = qcore.explain(chosen)
    assert report["b"].reason.startswith("kept float (accuracy budget): SQNR")
    assert report["act"].reason == report["b"].reason + " (with b)"
    assert {e.node for e in report.float if "accuracy budget" in e.reason} == {"b", "act"}
    assert _sqnr(model, chosen, data) >= 30
