"""Parity with torchao 0.18's PT2E flow (tox -e peers installs it).

On the exported zoo models, against torchao's X86InductorQuantizer with its
default config (``reduce_range`` as X86Quantizer sets it: 7-bit activations on
a CPU without VNNI, where oneDNN's int8 products saturate with 8-bit ones):

* qcore's x86 backend by name (``prepare_pt2e(model, "x86")``: the plugin's own
  X86Quantizer, oneDNN's recipe): the same quantize/dequantize pairs, SQNR
  within 0.5 dB, reference form and lowered.
* the Quantizer qcore compiles from the plugin's native BackendConfig (with a
  QConfigMapping using torchao's observers: histogram uint8 activations over
  0..255, per-channel symmetric int8 weights): the same weights, more
  activation quantize ops (listed in DELIBERATE), and the accuracy they cost.
"""

import warnings

import pytest
import torch
from zoo import EVAL_SEED, ZOO
from zoo.baseline import sqnr

import qcore
from qcore.config.qconfig import QConfig
from qcore.kernels.runtime import int8_products_saturate
from qcore.observers import HistogramObserver, PerChannelMinMaxObserver
from qcore.pt2e import BackendQuantizer

torchao = pytest.importorskip("torchao")
pytest.importorskip("qcore_x86", reason="needs the x86 plugin")
from qcore_x86.quantizer import X86Quantizer  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e as ao_convert
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e as ao_prepare

MODELS = ["resnet18_like", "mobilenetv2_like", "mlp", "transformer_block", "lstm"]

# Activation quantize ops the compiled native config adds over torchao's, and why. torch.ao's
# native x86 BackendConfig (what the plugin ships) quantizes the output of every
# pattern it knows; X86InductorQuantizer quantizes an output only where a quantized
# op consumes it, and fuses conv -> add (-> relu).
DELIBERATE = {
    "resnet18_like": {
        "conv output feeding a residual add (torchao fuses conv-add-relu)": 8,
        "classifier output (torchao leaves a final linear's output float)": 1,
    },
    "mobilenetv2_like": {
        "conv output feeding a residual add (torchao fuses conv-add)": 4,
        "hardswish/hardtanh/add/cat outputs and final linear output": 19,
    },
    "mlp": {"final linear output": 1},
    "transformer_block": {
        "matmul, softmax (fixed qparams), mul, add, gelu-free reshapes/transposes, "
        "linear outputs: the x86 BackendConfig's patterns": 21,
    },
    "lstm": {"linear outputs (the LSTM itself stays float in both)": 2},
}
SQNR_TOLERANCE_DB = 0.5


def torchao_like_mapping():
    activation = HistogramObserver.with_args(dtype=torch.quint8)
    weight = PerChannelMinMaxObserver.with_args(
        dtype=torch.qint8, qscheme=torch.per_channel_symmetric
    )
    return qcore.get_default_qconfig_mapping("x86").set_global(QConfig(activation, weight))


def count(gm):
    names = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes]
    activations = sum(name.startswith("quantize_per_tensor") for name in names)
    weights = sum(name.startswith("dequantize_per_channel") for name in names)
    return activations, weights


def run_torchao(entry, model, batch):
    # torchao's advice for CPUs without VNNI (7-bit activations) is X86Quantizer's default
    reduce_range = X86Quantizer().reduce_range
    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(
        xiq.get_default_x86_inductor_quantization_config(reduce_range=reduce_range)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = ao_prepare(torch.export.export(model, batch).module(), quantizer)
        with torch.no_grad():
            for inputs in entry.calibration_data(8):
                prepared(*inputs)
        return ao_convert(prepared)


def run_qcore(entry, model, batch, lower, quantizer=None):
    """qcore's x86 backend: by name (the plugin's X86Quantizer), or ``quantizer``."""
    quantizer = quantizer or "x86"
    prepared = qcore.prepare_pt2e(torch.export.export(model, batch).module(), quantizer)
    with torch.no_grad():
        for inputs in entry.calibration_data(8):
            prepared(*inputs)
    return qcore.convert_pt2e(prepared, lower=lower)


def score(entry, model, converted):
    evals = entry.calibration_data(4, seed=EVAL_SEED)
    with torch.no_grad():
        return sum(sqnr(model(*b), converted(*b)) for b in evals) / len(evals)


@pytest.fixture(scope="module", params=MODELS)
def peers(request):
    """qcore's x86 backend by name (its plugin's X86Quantizer) and torchao's."""
    entry = ZOO[request.param]
    model = entry.make_model()
    batch = entry.calibration_data(1)[0]
    ours_reference = run_qcore(entry, model, batch, lower=False)
    ours = run_qcore(entry, model, batch, lower=True)
    theirs = run_torchao(entry, model, batch)
    return request.param, entry, model, batch, ours_reference, ours, theirs


@pytest.fixture(scope="module", params=MODELS)
def compiled_config_peers(request):
    """The Quantizer qcore compiles from the x86 plugin's native BackendConfig."""
    entry = ZOO[request.param]
    model = entry.make_model()
    batch = entry.calibration_data(1)[0]
    compiled = BackendQuantizer.for_backend("x86", torchao_like_mapping())
    ours_reference = run_qcore(entry, model, batch, False, compiled)
    ours = run_qcore(entry, model, batch, True, compiled)
    theirs = run_torchao(entry, model, batch)
    return request.param, entry, model, batch, ours_reference, ours, theirs


def test_x86_by_name_has_torchaos_quantize_dequantize_pairs(peers):
    name, _, _, _, ours_reference, _, theirs = peers
    assert count(ours_reference) == count(theirs), name


def test_x86_by_name_is_within_half_a_db_of_torchao(peers):
    name, entry, model, _, ours_reference, ours, theirs = peers
    theirs_db = score(entry, model, theirs)
    for converted in (ours_reference, ours):
        ours_db = score(entry, model, converted)
        assert abs(ours_db - theirs_db) <= SQNR_TOLERANCE_DB, (name, ours_db, theirs_db)


def test_compiled_config_quantize_dequantize_pairs_up_to_listed_differences(
    compiled_config_peers,
):
    name, _, _, _, ours_reference, _, theirs = compiled_config_peers
    ours_activations, ours_weights = count(ours_reference)
    their_activations, their_weights = count(theirs)
    assert ours_weights == their_weights, name
    extra = sum(DELIBERATE.get(name, {}).values())
    assert ours_activations == their_activations + extra, (
        name,
        ours_activations,
        their_activations,
    )


def test_every_linear_and_conv_is_quantized_as_in_torchao(peers, compiled_config_peers):
    for name, _, _, _, ours_reference, _, _ in (peers, compiled_config_peers):
        float_ops = [e for e in qcore.explain(ours_reference) if e.status.name == "FLOAT"]
        weighted = [e for e in float_ops if e.op in ("aten.linear", "aten.conv2d")]
        assert not weighted, (name, weighted)
        assert all(e.reason for e in float_ops), (name, float_ops)


@pytest.mark.xfail(
    strict=True,
    reason="by design: the extra quantization points of torch.ao's native x86 "
    "BackendConfig (DELIBERATE) cost 1-15 dB against X86InductorQuantizer; the x86 "
    "plugin's own X86Quantizer, used by name, has parity",
)
def test_compiled_config_sqnr_within_half_a_db_of_torchao(compiled_config_peers):
    name, entry, model, _, _, ours, theirs = compiled_config_peers
    ours_db, theirs_db = score(entry, model, ours), score(entry, model, theirs)
    assert ours_db >= theirs_db - SQNR_TOLERANCE_DB, (name, ours_db, theirs_db)


def test_lowering_keeps_the_reference_accuracy(compiled_config_peers, request):
    name, entry, model, _, ours_reference, ours, _ = compiled_config_peers
    if int8_products_saturate():
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="this CPU has no VNNI: with full-range (0..255) activations the x86 "
                "engine's int8 conv and linear sum pairs of u8*s8 products in 16 bits, "
                "which saturate (the reason torch.ao's x86 default uses reduce_range); "
                "the backend's default mapping (reduce_range) lowers without loss",
            )
        )
    reference_db, lowered_db = score(entry, model, ours_reference), score(entry, model, ours)
    assert abs(reference_db - lowered_db) < 0.5, (name, reference_db, lowered_db)


def test_converted_graph_runs_under_torch_compile(peers):
    name, _, _, batch, ours_reference, ours, _ = peers
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    assert any(n.target is quantize for n in ours_reference.graph.nodes)
    for converted in (ours_reference, ours):
        compiled = torch.compile(converted, backend="eager")
        with torch.no_grad():
            torch.testing.assert_close(compiled(*batch), converted(*batch), msg=name)
