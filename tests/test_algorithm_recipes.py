"""quantize(algorithms=...) and the qcore_recommended_algorithms hook (issue 17 §1).

Algorithms run by name at their stage (equalize and smooth_quant before
calibration, correct_bias after); a backend's plugin recommends some through a
hook; a plugin whose hook fails is skipped with a warning, never taking the
backend or another plugin's answer down.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backends import installed
from test_bias_correction import RoundsDown, _data
from test_registry import linear, plugin_module, registry, spec

import qcore
from qcore.accuracy import sqnr
from qcore.algorithms import ALGORITHMS, applied_algorithms, recommended_algorithms
from qcore.examples import ZOO

FIRST_PARTY = ["x86", "qnnpack", "fbgemm", "onednn"]


def _installed_or_skip(backend: str) -> None:
    if not installed(backend):
        pytest.skip(f"needs the {backend} plugin")


def _quantize(backend: str, algorithms=None, model=None):
    model = model if model is not None else RoundsDown().eval()
    return qcore.quantize(model, _data(1)[0], _data(), backend, algorithms=algorithms)


# -- the first-party plugins' answers -------------------------------------------


@pytest.mark.parametrize("backend", FIRST_PARTY)
def test_first_party_plugins_answer_with_algorithms_qcore_has(backend):
    _installed_or_skip(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qcore.QCoreWarning)  # nothing dropped or skipped
        steps = recommended_algorithms(backend)
    assert steps == qcore.get_backend(backend).recommended_algorithms()
    for step in steps:
        assert isinstance(step, qcore.AlgorithmStep) and step.name in ALGORITHMS
        assert step.reason, f"{backend} recommends {step.name} without saying why"


def test_qnnpack_recommends_equalization_for_its_per_tensor_weights():
    _installed_or_skip("qnnpack")
    names = [step.name for step in recommended_algorithms("qnnpack")]
    assert names[0] == "equalize"


@pytest.mark.parametrize("backend", FIRST_PARTY)
@pytest.mark.parametrize("name", ["mobilenetv2_like", "resnet18_like"])
def test_a_recommended_recipe_keeps_the_float_function(backend, name):
    """qnnpack recommended equalize(relu6_to_relu=True), which replaces ReLU6 by
    ReLU: on mobilenetv2_like at twice its input scale the float model itself fell
    to 7.5 dB, and the int8 result from 23.8 to 7.5 dB."""
    _installed_or_skip(backend)
    from qcore.algorithms.recipes import BEFORE_CALIBRATION, run_stage

    entry = ZOO[name]
    model = entry.make_model().eval()
    data = [tuple(2 * t for t in batch) for batch in entry.calibration_data(2)]
    prepared = qcore.prepare_fx(model, None, data[0], backend=backend)
    changed, _ = run_stage(prepared, recommended_algorithms(backend), BEFORE_CALIBRATION, data)
    with torch.no_grad():
        for batch in data:
            assert sqnr(model(*batch), changed(*batch)) > 80


def test_native_recommends_none():
    assert qcore.get_backend("native").recommended_algorithms() == ()
    assert recommended_algorithms("native") == ()


# -- the registry keeps a failing plugin from taking others down -----------------


def _two_plugins(first_hook):
    """Backend "m" served by two plugins: the owner (qcore-m) answering
    ``first_hook``, and an extension recommending correct_bias."""
    recommended = (qcore.AlgorithmStep("correct_bias", reason="ext"),)
    owner = plugin_module("m", [linear()], qcore_recommended_algorithms=first_hook)
    extension = plugin_module(
        "ext", [linear()], qcore_recommended_algorithms=lambda backend: recommended
    )
    reg = registry(spec("m", "qcore-m", owner), spec("m", "qcore-ext", extension))
    return reg.get("m"), recommended


def _raises(backend):
    raise RuntimeError("vendor SDK missing")


@pytest.mark.parametrize(
    "hook, words",
    [
        (_raises, r"plugin qcore-m:m raised in qcore_recommended_algorithms: RuntimeError"),
        (
            lambda backend: ["equalize"],
            r"plugin qcore-m:m: qcore_recommended_algorithms\(\) returned \['equalize'\].*"
            r"expected a list or tuple of qcore.AlgorithmStep",
        ),
    ],
)
def test_a_failing_plugin_is_skipped_and_named(hook, words):
    backend, recommended = _two_plugins(hook)
    with pytest.warns(qcore.QCoreWarning, match=words):
        assert backend.recommended_algorithms() == recommended
    assert len(backend.config) == 1  # the backend itself still loads and quantizes


def test_the_owner_answers_first():
    mine = [qcore.AlgorithmStep("equalize", reason="owner")]
    backend, _ = _two_plugins(lambda backend: mine)
    assert backend.recommended_algorithms() == tuple(mine)


def test_a_step_this_qcore_lacks_is_dropped_with_a_warning():
    steps = [qcore.AlgorithmStep("quantum_rounding"), qcore.AlgorithmStep("correct_bias")]
    module = plugin_module("m", [linear()], qcore_recommended_algorithms=lambda backend: steps)
    backend = registry(spec("m", "qcore-m", module)).get("m")
    with pytest.warns(qcore.QCoreWarning, match="unknown algorithm 'quantum_rounding'.*skipped"):
        assert [s.name for s in recommended_algorithms(backend)] == ["correct_bias"]


# -- quantize runs them ----------------------------------------------------------


@pytest.mark.parametrize("backend", ["qnnpack", "x86", "fbgemm"])
def test_quantize_runs_correct_bias_as_the_pass_does(backend):
    """Differential: quantize(algorithms=["correct_bias"]) gives the model the
    manual steps give, and lifts SQNR where rounding is biased."""
    _installed_or_skip(backend)
    model = RoundsDown().eval()
    x = _data(1)[0][0]
    prepared = qcore.prepare_fx(model, None, _data(1)[0], backend=backend)
    for batch in _data():
        prepared(*batch)
    manual = qcore.convert_fx(qcore.correct_bias(prepared, _data()))
    plain = _quantize(backend, model=model)
    corrected = _quantize(backend, ["correct_bias"], model=model)
    with torch.no_grad():
        assert torch.equal(corrected(x), manual(x))
        assert sqnr(model(x), corrected(x)) > sqnr(model(x), plain(x)) + 3.0
    assert [a.step.name for a in applied_algorithms(corrected)] == ["correct_bias"]
    assert applied_algorithms(corrected)[0].changed == 2  # fc1 and fc2
    assert applied_algorithms(plain) == ()


@pytest.mark.skipif(
    not any(installed(name) for name in ("fbgemm", "qnnpack", "x86")),
    reason="native needs a backend plugin",
)
def test_a_before_calibration_pass_gets_the_data_and_its_options():
    """smooth_quant runs before calibration on the calibration batches, with the
    alpha given: the model the manual steps give, and a better one than plain."""
    from test_smoothquant import Outliers
    from test_smoothquant import _data as batches

    model, data = Outliers().eval(), [(x,) for x in batches()]
    x = batches(1, seed=2)[0]
    prepared = qcore.prepare_fx(model, None, data[0], backend="native")
    prepared = qcore.smooth_quant(prepared, data, alpha=0.7)
    for batch in data:
        prepared(*batch)
    manual = qcore.convert_fx(prepared)
    plain = qcore.quantize(model, data[0], data, "native")
    smoothed = qcore.quantize(
        model, data[0], data, "native", algorithms=[("smooth_quant", {"alpha": 0.7})]
    )
    with torch.no_grad():
        assert torch.equal(smoothed(x), manual(x))
        # measured: 26.4 against 24.1 dB
        assert sqnr(model(x), smoothed(x)) > sqnr(model(x), plain(x)) + 1.0
    (ran,) = applied_algorithms(smoothed)
    assert (ran.step.describe(), ran.stage, ran.changed) == (
        "smooth_quant(alpha=0.7)",
        "before calibration",
        2,  # {q, k} after the LayerNorm, v after q's relu
    )


def test_before_calibration_steps_run_before_it_whatever_the_order():
    """equalize listed after correct_bias still runs first (it must see no data)."""
    _installed_or_skip("qnnpack")
    entry = ZOO["mobilenetv2_like"]
    model, data = entry.make_model(), entry.calibration_data(2)
    both = qcore.quantize(
        model,
        data[0],
        data,
        "qnnpack",
        algorithms=["correct_bias", ("equalize", {"relu6_to_relu": True})],
    )
    ran = applied_algorithms(both)
    assert [(a.step.name, a.stage) for a in ran] == [
        ("equalize", "before calibration"),
        ("correct_bias", "after calibration"),
    ]
    assert ran[0].changed > 0  # relu6_to_relu: pairs across the ReLU6s
    assert "algorithms: equalize(relu6_to_relu=True)" in str(qcore.explain(both))


def test_recommended_runs_what_the_backend_recommends():
    _installed_or_skip("qnnpack")
    entry = ZOO["mobilenetv2_like"]
    model, data = entry.make_model(), entry.calibration_data(2)
    steps = recommended_algorithms("qnnpack")
    chosen = qcore.quantize(model, data[0], data, "qnnpack", algorithms="recommended")
    listed = qcore.quantize(model, data[0], data, "qnnpack", algorithms=list(steps))
    assert [a.step for a in applied_algorithms(chosen)] == list(steps)
    with torch.no_grad():
        assert torch.equal(chosen(*data[0]), listed(*data[0]))


def test_the_users_model_is_not_changed():
    model = RoundsDown().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _quantize("native", ["equalize", "correct_bias"], model=model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithms, error, words",
    [
        (
            ["equalise"],
            ValueError,
            r"algorithms\[0\]: unknown algorithm 'equalise' \(did you "
            r"mean 'equalize'\?\); expected one of 'adaround' \(after calibration\), "
            r"'correct_bias' \(after calibration\), 'equalize' \(before calibration\), "
            r"'smooth_quant' \(before calibration\)",
        ),
        (
            [("equalize", {"alpha": 0.5})],
            ValueError,
            r"algorithms\[0\]: equalize takes no option 'alpha'; its options are 'iterations', "
            r"'relu6_to_relu'",
        ),
        ("all", ValueError, r"algorithms: got 'all'; expected None, 'recommended' or a list"),
        ({"equalize": {}}, TypeError, r"algorithms: got \{'equalize': \{\}\} \(dict\)"),
        ([3], TypeError, r"algorithms\[0\]: got 3 \(int\); expected an algorithm's name"),
        ([("equalize", 4)], TypeError, r"options of 'equalize': got 4 \(int\); expected a dict"),
        (
            [("equalize", {"iterations": 0})],
            ValueError,
            r"algorithms: equalize\(iterations=0\): iterations: got 0 \(int\); expected an int",
        ),
    ],
)
def test_bad_algorithms_are_named(algorithms, error, words):
    with pytest.raises(error, match=words):
        _quantize("native", algorithms)


def test_recommended_needs_a_backend_name():
    config = qcore.get_backend_config("native")
    with pytest.raises(ValueError, match="algorithms='recommended': backend .* names no"):
        qcore.quantize(RoundsDown().eval(), _data(1)[0], _data(), config, algorithms="recommended")


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"name": ""}, r"AlgorithmStep.name: got '' \(str\)"),
        ({"name": "equalize", "options": {1: 2}}, r"AlgorithmStep.options: got \{1: 2\}"),
        ({"name": "equalize", "reason": 3}, r"AlgorithmStep.reason: got 3 \(int\)"),
    ],
)
def test_a_step_names_the_field_it_refuses(fields, words):
    with pytest.raises(TypeError, match=words):
        qcore.AlgorithmStep(**fields)


def test_a_step_keeps_its_own_options():
    options = {"alpha": 0.5}
    step = qcore.AlgorithmStep("smooth_quant", options)
    options["alpha"] = 0.9
    assert step.describe() == "smooth_quant(alpha=0.5)"


@pytest.mark.parametrize("extra_db", [8.0, 12.0])
def test_with_a_budget_the_model_returned_reports_its_own_run(extra_db):
    """applied_algorithms came from the last candidate the budget's search built:
    with one linear left quantized, it said correct_bias changed 2."""
    _installed_or_skip("x86")
    torch.manual_seed(0)
    widths = [16, 64, 64, 64, 8]
    layers = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:], strict=True):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).eval()
    data = [(torch.randn(32, 16),) for _ in range(4)]
    plain = qcore.quantize(model, data[0], data, "x86")
    with torch.no_grad():
        plain_db = sqnr(model(*data[0]), plain(*data[0]))
    chosen = qcore.quantize(
        model,
        data[0],
        data,
        "x86",
        algorithms=["correct_bias"],
        accuracy_budget=qcore.MinSQNR(db=plain_db + extra_db),
    )
    quantized_linears = sum(type(m).__name__ == "QuantizedLinear" for m in chosen.modules())
    assert quantized_linears < 4  # the budget kept some float
    (ran,) = applied_algorithms(chosen)
    assert ran.changed == quantized_linears


def test_a_model_quantized_with_algorithms_deep_copies_and_saves():
    """Its report holds the AlgorithmSteps that ran, whose read-only options (a
    mappingproxy) did not pickle: copy.deepcopy and torch.save of the model failed
    (and of a CompileRecipe, a compiled model)."""
    import copy
    import io

    model, data = RoundsDown().eval(), _data()
    quantized = qcore.quantize(model, data[0], data, "native", algorithms=["correct_bias"])
    pickled, saved = io.BytesIO(), io.BytesIO()
    torch.save(quantized, pickled)
    qcore.save(quantized, saved)
    pickled.seek(0)
    saved.seek(0)
    copies = (copy.deepcopy(quantized), torch.load(pickled, weights_only=False), qcore.load(saved))
    for again in copies:
        assert [a.step for a in applied_algorithms(again)] == [
            a.step for a in applied_algorithms(quantized)
        ]
        with torch.no_grad():
            assert torch.equal(again(*data[0]), quantized(*data[0]))
    recipe = qcore.CompileRecipe("inductor", {"freezing": True}, summary="x86")
    assert copy.deepcopy(recipe) == recipe
