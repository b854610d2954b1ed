"""SmoothQuant (issue 17 §1): activation outlier channels move into the weights of
the linears reading them, folded into the LayerNorm or linear producing them, on
FX and PT2E prepared models; the float function stays, SQNR rises, the backend's
constraints hold."""

from __future__ import annotations

import copy

import pytest
import torch
from backends import backend_params, installed
from test_vendor_constraints import POW2_QCONFIG, is_power_of_two, pow2_backend, sqnr

import qcore
from qcore.algorithms import smoothed_layers
from qcore.config.qconfig import QConfigMapping


class Outliers(torch.nn.Module):
    """LayerNorm -> q and k (one input, one s), q -> relu -> v (folds into q's rows),
    and an add feeding out (which cannot absorb 1/s). The LayerNorm's weight makes
    4 of 64 channels 50x larger than the rest, as in LLM activations."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.norm = torch.nn.LayerNorm(64)
        self.q = torch.nn.Linear(64, 64)
        self.k = torch.nn.Linear(64, 64)
        self.v = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 16)
        with torch.no_grad():
            for linear in (self.q, self.k, self.v, self.out):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.1)
                linear.bias.copy_(torch.randn(linear.bias.shape, generator=generator) * 0.1)
            self.norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=generator))
            self.norm.weight[:4] = 50.0
            self.norm.bias.copy_(0.1 * torch.randn(64, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.out(self.v(torch.relu(self.q(h))) + self.k(h))


def _data(count: int = 4, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 64, generator=generator) for _ in range(count)]


_X = _data(1, seed=2)[0]


def _prepared(model, path: str, backend):
    example = (_data(1)[0],)
    mapping = None if isinstance(backend, str) else QConfigMapping().set_global(POW2_QCONFIG)
    if path == "fx" and mapping is None:
        return qcore.prepare_fx(model, None, example, backend=backend)
    if path == "fx":
        return qcore.prepare_fx(model, mapping, example, backend)
    exported = torch.export.export(model, example).module()
    if mapping is None:
        return qcore.prepare_pt2e(exported, backend)
    from qcore.pt2e import BackendQuantizer

    return qcore.prepare_pt2e(exported, BackendQuantizer(backend, mapping))


def _quantized(prepared, path: str, *, lower: bool = True):
    prepared = copy.deepcopy(prepared)
    with torch.no_grad():
        for batch in _data():
            prepared(batch)
    if path == "pt2e":
        return qcore.convert_pt2e(prepared, lower=lower)
    return qcore.convert_fx(prepared) if lower else qcore.convert_to_reference_fx(prepared)


def _backend() -> str:
    for name in ("x86", "fbgemm", "qnnpack"):
        if installed(name):
            return name
    pytest.skip("needs a first-party backend")


@pytest.mark.parametrize("path", ["fx", "pt2e"])
@pytest.mark.parametrize("backend", backend_params())
def test_float_function_stays_and_sqnr_rises(path, backend):
    model = Outliers().eval()
    prepared = _prepared(model, path, backend)
    smoothed = qcore.smooth_quant(prepared, _data())
    with torch.no_grad():  # uncalibrated observers pass values through: the float model
        before, after = copy.deepcopy(prepared)(_X), copy.deepcopy(smoothed)(_X)
    assert ((after - before).abs().max() / before.abs().max()).item() < 1e-5
    groups = {group.layers: group for group in smoothed_layers(smoothed)}
    assert groups[("q", "k")].alpha == 0.5
    assert groups[("q", "k")].source in ("norm", "layer_norm")
    assert groups[("q", "k")].spread_before > 5 * groups[("q", "k")].spread_after
    assert groups[("v",)].alpha == 0.5 and groups[("v",)].source in ("q", "linear")
    assert (
        groups[("out",)].alpha is None
        and "only a LayerNorm or a linear absorbs" in groups[("out",)].skipped
    )
    with torch.no_grad():
        expected = model(_X)
        plain_db = sqnr(expected, _quantized(prepared, path)(_X))
        smoothed_db = sqnr(expected, _quantized(smoothed, path)(_X))
    assert smoothed_db >= plain_db + 3.0, (plain_db, smoothed_db)


@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_search_picks_an_alpha_per_group_no_worse_than_the_default(path):
    """Scored on 8 held-out batches: on _X alone, 32 rows, alphas 0.4 to 0.7 differ by
    up to 1.7 dB of noise (PT2E: 36.4 dB there, 29.4 on 1024 other rows). What the
    search promises is the gain over leaving the model alone; against the default
    alpha it is within the noise of choosing on half the calibration batches (fbgemm,
    PT2E: alpha 0.3 for q/k, 0.7 dB below the default's 0.5, 3.4 dB above plain)."""
    model = Outliers().eval()
    prepared = _prepared(model, path, _backend())
    default = qcore.smooth_quant(prepared, _data())
    searched = qcore.smooth_quant(prepared, _data(), alpha="search")
    alphas = {g.layers: g.alpha for g in smoothed_layers(searched) if g.alpha is not None}
    assert ("q", "k") in alphas  # the outliers' group; v's input has none to move
    assert set(alphas) <= {("q", "k"), ("v",)}
    assert all(a in qcore.algorithms.smoothquant.SEARCH_ALPHAS for a in alphas.values())
    unseen = torch.cat(_data(8, seed=2))
    with torch.no_grad():
        expected = model(unseen)
        plain_db = sqnr(expected, _batched(_quantized(prepared, path), unseen))
        default_db = sqnr(expected, _batched(_quantized(default, path), unseen))
        searched_db = sqnr(expected, _batched(_quantized(searched, path), unseen))
    assert searched_db >= plain_db + 2.0, (plain_db, searched_db)
    assert searched_db >= default_db - 1.0, (default_db, searched_db)


def _batched(model, x: torch.Tensor, size: int = 32) -> torch.Tensor:
    """``model`` on ``x`` in batches of ``size`` rows (a PT2E model runs its export's)."""
    return torch.cat([model(chunk) for chunk in x.split(size)])


class NormThenLinear(torch.nn.Module):
    """No outliers: smoothing has little to gain, and an alpha that brings every
    channel to the edge of its calibration range clips inputs seen later."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(64)
        self.fc = torch.nn.Linear(64, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


@pytest.mark.parametrize("backend", backend_params())
def test_search_scores_alphas_on_rows_their_scale_did_not_see(backend):
    """With s taken from every calibration row, alpha 1 scored best and lost 3.5 dB
    on qnnpack on new inputs (each channel's range exactly 1 on calibration data)."""
    model = NormThenLinear().eval()
    generator = torch.Generator().manual_seed(3)
    calibration = [torch.randn(128, 64, generator=generator) for _ in range(4)]
    unseen = torch.randn(1024, 64, generator=generator)
    results = {}
    for alpha in (None, "search"):
        prepared = qcore.prepare_fx(copy.deepcopy(model), None, (calibration[0],), backend=backend)
        if alpha is not None:
            prepared = qcore.smooth_quant(prepared, calibration, alpha=alpha)
        with torch.no_grad():
            for batch in calibration:
                prepared(batch)
            results[alpha] = sqnr(model(unseen), qcore.convert_fx(prepared)(unseen))
    assert results["search"] >= results[None] - 0.3, results


@pytest.mark.parametrize("backend", backend_params())
def test_search_is_never_below_leaving_the_model_alone(backend):
    """The example MLP (Linear-ReLU x3, then a Linear) has three groups in a chain:
    smoothing one divides the rows of the linear before it and changes the noise
    every later layer gets. Scored on each group's own output, the search smoothed
    two of them and lost 3.3 dB on held-out batches on x86 (36.2 against 39.4
    unsmoothed), 4.2 on qnnpack (34.1 against 38.3); scored on the model's output,
    it is not below."""
    from qcore.examples import EVAL_SEED, ZOO

    entry = ZOO["mlp"]
    model, calibration = entry.make_model(), entry.calibration_data(4)
    unseen = entry.calibration_data(4, seed=EVAL_SEED)
    exported = torch.export.export(model, calibration[0]).module()
    results = {}
    for alpha in (None, "search"):
        prepared = qcore.prepare_pt2e(exported, backend)
        if alpha is not None:
            prepared = qcore.smooth_quant(prepared, calibration, alpha=alpha)
        with torch.no_grad():
            for batch in calibration:
                prepared(*batch)
            quantized = qcore.convert_pt2e(prepared)
            expected = torch.cat([model(*batch) for batch in unseen])
            results[alpha] = sqnr(expected, torch.cat([quantized(*batch) for batch in unseen]))
    assert results["search"] >= results[None] - 0.3, results


def test_alpha_per_layer_smooths_the_named_layers_alone():
    prepared = _prepared(Outliers().eval(), "fx", _backend())
    smoothed = qcore.smooth_quant(prepared, _data(), alpha={"q": 0.8, "k": 0.8})
    done = {g.layers: g.alpha for g in smoothed_layers(smoothed)}
    assert done == {("q", "k"): 0.8}
    assert torch.equal(smoothed.v.weight, prepared.v.weight)
    assert not torch.equal(smoothed.q.weight, prepared.q.weight)


@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_power_of_two_scales_stay_powers_of_two(path):
    model = Outliers().eval()
    prepared = _prepared(model, path, pow2_backend())
    smoothed = qcore.smooth_quant(prepared, _data())
    assert any(g.alpha is not None for g in smoothed_layers(smoothed))
    converted = _quantized(smoothed, path, lower=False)
    scales = []
    for name, buffer in converted.named_buffers():
        if name.endswith("scale"):
            scales += buffer.flatten().tolist()
    for node in converted.graph.nodes:
        if "quantize_per_tensor" in str(node.target) and isinstance(node.args[1], float):
            scales.append(node.args[1])
    for module in converted.modules():
        for qparams in getattr(module, "weight_qparams", {}).values():
            scales += qparams.scale.flatten().tolist()
    assert len(scales) >= 3 * 64 + 16, len(scales)  # per-channel weights of q, k, v and out
    assert all(is_power_of_two(s) for s in scales)
    with torch.no_grad():
        expected = model(_X)
        assert sqnr(expected, converted(_X)) > sqnr(expected, _quantized(prepared, path)(_X))


def test_the_prepared_model_is_not_changed():
    prepared = _prepared(Outliers().eval(), "pt2e", _backend())
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    smoothed = qcore.smooth_quant(prepared, _data())
    assert all(torch.equal(v, prepared.state_dict()[k]) for k, v in before.items())
    assert smoothed_layers(prepared) == ()
    changed = sorted(k for k, v in smoothed.state_dict().items() if not torch.equal(v, before[k]))
    assert changed == ["k.weight", "norm.bias", "norm.weight", "q.bias", "q.weight", "v.weight"]


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"prepared: got .*Linear.*expected a model from qcore"):
        qcore.smooth_quant(torch.nn.Linear(2, 2), [])
    prepared = _prepared(Outliers().eval(), "fx", _backend())
    for alpha in (1.5, -0.1, "best", True, {"q": 2.0}, {3: 0.5}):
        with pytest.raises(ValueError, match=r"alpha: got .*expected a float from 0 to 1"):
            qcore.smooth_quant(prepared, _data(), alpha=alpha)
    with pytest.raises(ValueError, match=r"alpha: names no quantized linear.*'qq'.*'k', 'out'"):
        qcore.smooth_quant(prepared, _data(), alpha={"qq": 0.5})
    with pytest.raises(ValueError, match=r"linears \['q', 'k'\] share one input.*0.3, 0.6"):
        qcore.smooth_quant(prepared, _data(), alpha={"q": 0.3, "k": 0.6})
    with pytest.raises(ValueError, match=r"calibration_data: got .*which gave no batches"):
        qcore.smooth_quant(prepared, [])
    with torch.no_grad():
        prepared(_X)
    with pytest.raises(
        ValueError, match=r"has already seen data; smooth_quant.*before calibration"
    ):
        qcore.smooth_quant(prepared, _data())


class DroppedOutliers(Outliers):
    """Outliers with a dropout between the LayerNorm and q/k, as transformers' BERT
    and Wav2Vec2 have (the embeddings' or the encoder's dropout before the first
    layer): in eval mode the identity, in the exported graph an ``aten.dropout``
    node with ``train=False``."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(x))
        return self.out(self.v(torch.relu(self.q(h))) + self.k(h))


@pytest.mark.parametrize("path", ["fx", "pt2e"])
def test_an_eval_mode_dropout_is_stepped_over(path):
    """The dropout neither hides the LayerNorm (which absorbs 1/s) nor counts as a
    second reader of it: q and k are smoothed through it, as without it."""
    model = DroppedOutliers().eval()
    prepared = _prepared(model, path, _backend())
    if path == "pt2e":
        dropouts = [n for n in prepared.graph.nodes if n.target is torch.ops.aten.dropout.default]
        assert dropouts and all(n.args[2] is False for n in dropouts)
    smoothed = qcore.smooth_quant(prepared, _data())
    groups = {group.layers: group for group in smoothed_layers(smoothed)}
    assert groups[("q", "k")].alpha == 0.5, groups[("q", "k")].skipped
    assert groups[("q", "k")].source in ("norm", "layer_norm")
    with torch.no_grad():
        before, after = copy.deepcopy(prepared)(_X), copy.deepcopy(smoothed)(_X)
        assert ((after - before).abs().max() / before.abs().max()).item() < 1e-5
        expected = model(_X)
        plain_db = sqnr(expected, _quantized(prepared, path)(_X))
        smoothed_db = sqnr(expected, _quantized(smoothed, path)(_X))
    assert smoothed_db >= plain_db + 3.0, (plain_db, smoothed_db)


def test_a_dropout_that_drops_is_not_stepped_over():
    """In training mode a dropout zeroes and rescales: the pass stops at it (its
    input comes from the dropout, which cannot absorb 1/s)."""
    from qcore.algorithms.smoothquant import _is_eval_dropout

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    aten = torch.ops.aten
    F = torch.nn.functional
    cases = {
        graph.call_function(aten.dropout.default, (x, 0.1, False)): True,
        graph.call_function(aten.dropout.default, (x, 0.1, True)): False,
        graph.call_function(aten.dropout.default, (x, 0.0, True)): True,
        graph.call_function(F.dropout, (x,), {"p": 0.1, "training": False}): True,
        graph.call_function(F.dropout, (x, 0.1)): False,  # training defaults to True
        graph.call_function(F.dropout, (x, 0.1, False, True)): False,  # in place
        graph.call_function(torch.relu, (x,)): False,
    }
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert {node.name: _is_eval_dropout(gm, node) for node in cases} == {
        node.name: expected for node, expected in cases.items()
    }


def test_dynamic_quantization_is_smoothed_too():
    """Dynamic linears quantize their input per batch at run time: the search scores
    each alpha with the input's range, as that quantization takes it."""
    from qcore.config.qconfig import default_dynamic_qconfig

    model = Outliers().eval()
    mapping = QConfigMapping().set_object_type(torch.nn.Linear, default_dynamic_qconfig)
    prepared = qcore.prepare_fx(model, mapping, (_X,), backend=_backend())
    smoothed = qcore.smooth_quant(prepared, _data(), alpha="search")
    # v's input, relu(q(h)), has no outlier channels: smoothing it gains nothing
    # (under 0.1 dB at any alpha, on 1024 unseen rows), and the search may leave it
    assert ("q", "k") in {g.layers for g in smoothed_layers(smoothed) if g.alpha is not None}
    with torch.no_grad():
        expected = model(_X)
        plain_db = sqnr(expected, _quantized(prepared, "fx")(_X))
        smoothed_db = sqnr(expected, _quantized(smoothed, "fx")(_X))
    assert smoothed_db >= plain_db + 2.0, (plain_db, smoothed_db)
