"""torchao's Quantizers on qcore's PT2E path, measured against torchao's own prepare/convert.

qcore.prepare_pt2e takes a torchao Quantizer (XNNPACKQuantizer, EmbeddingQuantizer,
ComposableQuantizer, a user's subclass) as torchao's prepare_pt2e does, and
convert_pt2e then gives the reference form torchao gives: the same
quantized_decomposed quantize/dequantize nodes, the same numbers.
"""

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import qcore

torchao_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
xnnpack = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")
from torchao.quantization.pt2e import observer as torchao_observer  # noqa: E402
from torchao.quantization.pt2e.quantizer import (  # noqa: E402
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
)
from torchao.quantization.pt2e.quantizer.composable_quantizer import (  # noqa: E402
    ComposableQuantizer,
)
from torchao.quantization.pt2e.quantizer.embedding_quantizer import (  # noqa: E402
    EmbeddingQuantizer,
)

QD = torch.ops.quantized_decomposed
aten = torch.ops.aten


class ConvLinear(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, dtype=dtype)
        self.linear = nn.Linear(8 * 6 * 6, 10, dtype=dtype)

    def forward(self, x):
        return self.linear(torch.relu(self.conv(x)).flatten(1))


def _xnnpack(**config):
    return xnnpack.XNNPACKQuantizer().set_global(
        xnnpack.get_symmetric_quantization_config(**config)
    )


def _export(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.export.export(model.eval(), inputs).module()


def _both(model, inputs, make_quantizer, calibration=None):
    """(torchao's converted model, qcore's), each from its own prepare and convert."""
    results = []
    for prepare, convert in (
        (torchao_pt2e.prepare_pt2e, torchao_pt2e.convert_pt2e),
        (qcore.prepare_pt2e, qcore.convert_pt2e),
    ):
        prepared = prepare(_export(copy.deepcopy(model), inputs), make_quantizer())
        for batch in calibration or [inputs]:
            prepared(*batch)
        results.append(convert(prepared))
    return results


def _counts(gm, targets):
    found = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return {target: found.count(target) for target in targets}


QDQ = (
    QD.quantize_per_tensor.default,
    QD.dequantize_per_tensor.default,
    QD.quantize_per_channel.default,
    QD.dequantize_per_channel.default,
    QD.choose_qparams.tensor,
    QD.quantize_per_tensor.tensor,
    QD.dequantize_per_tensor.tensor,
)


def _output_step(gm):
    """The scale of the last dequantize before the output (one quantization step)."""
    steps = [n.args[1] for n in gm.graph.nodes if n.target is QD.dequantize_per_tensor.default]
    return float(steps[-1])


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_xnnpack_quantizer_gives_torchaos_graph_and_outputs(per_channel):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    calibration = [(torch.randn(2, 3, 8, 8),) for _ in range(4)]
    theirs, ours = _both(
        ConvLinear(), (x,), lambda: _xnnpack(is_per_channel=per_channel), calibration
    )
    assert _counts(ours, QDQ) == _counts(theirs, QDQ)
    assert _counts(ours, QDQ)[QD.dequantize_per_tensor.default] > 0
    step = _output_step(theirs)
    torch.testing.assert_close(ours(x), theirs(x), atol=step * 1.01, rtol=0)


def test_dynamic_and_embedding_quantizers_composed_match_torchao():
    class EmbeddingLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(10, 16)
            self.linear = nn.Linear(16, 4)

        def forward(self, indices):
            return self.linear(self.embedding(indices))

    indices = torch.tensor([[1, 4, 2, 9, 0]])

    def composed():
        return ComposableQuantizer(
            [EmbeddingQuantizer(), _xnnpack(is_per_channel=True, is_dynamic=True)]
        )

    theirs, ours = _both(EmbeddingLinear(), (indices,), composed)
    counts = _counts(ours, QDQ)
    assert counts == _counts(theirs, QDQ)
    assert counts[QD.choose_qparams.tensor] == 1  # the linear's input, chosen at run time
    assert counts[QD.dequantize_per_channel.default] == 2  # embedding and linear weights
    torch.testing.assert_close(ours(indices), theirs(indices), atol=1e-5, rtol=0)


def test_qcores_embedding_quantizer_ports_torchaos_with_changed_imports():
    """``ComposableQuantizer([EmbeddingQuantizer(), ...])`` written against qcore's
    classes gives torchao's graph and numbers (qcore had no EmbeddingQuantizer, and
    its ComposableQuantizer refuses torchao's, naming qcore's)."""
    model = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 4))
    indices = (torch.tensor([[1, 4, 2, 9, 0]]),)
    torchao_model = torchao_pt2e.prepare_pt2e(
        _export(copy.deepcopy(model), indices), ComposableQuantizer([EmbeddingQuantizer()])
    )
    torchao_model(*indices)
    theirs = torchao_pt2e.convert_pt2e(torchao_model)
    composed = qcore.quantizer.ComposableQuantizer([qcore.quantizer.EmbeddingQuantizer()])
    prepared = qcore.prepare_pt2e(_export(copy.deepcopy(model), indices), composed)
    prepared(*indices)
    ours = qcore.convert_pt2e(prepared, lower=False)
    assert _counts(ours, QDQ) == _counts(theirs, QDQ)
    assert _counts(ours, QDQ)[QD.dequantize_per_channel.default] == 1
    assert torch.equal(ours(*indices), theirs(*indices))
    with pytest.raises(qcore.ConfigError, match=r"quantizers\[0\]: got .*torchao's Embedding"):
        qcore.quantizer.ComposableQuantizer([EmbeddingQuantizer()])


class SigmoidAdd(nn.Module):
    def forward(self, x, y):
        return torch.sigmoid(x) + y


class FixedQParamsQuantizer(Quantizer):
    """sigmoid and add, every edge and output with one fixed-qparams spec."""

    def annotate(self, model):
        spec = FixedQParamsQuantizationSpec(
            dtype=torch.uint8,
            quant_min=0,
            quant_max=255,
            qscheme=torch.per_tensor_affine,
            scale=1.0 / 256.0,
            zero_point=0,
        )
        for node in model.graph.nodes:
            if node.target in (aten.sigmoid.default, aten.add.Tensor):
                inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map=dict.fromkeys(inputs, spec), output_qspec=spec
                )
        # torchao's prepare ignores what annotate returns; this one returns nothing

    def validate(self, model):
        pass


def test_equal_fixed_qparams_edges_share_one_observer_as_in_torchao():
    inputs = (torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4))
    observers = []
    for prepare in (torchao_pt2e.prepare_pt2e, qcore.prepare_pt2e):
        prepared = prepare(_export(SigmoidAdd(), inputs), FixedQParamsQuantizer())
        observers.append(
            sum(1 for n in prepared.graph.nodes if n.op == "call_module" and "post" in n.target)
        )
    # x -> sigmoid, sigmoid's output (which is also add's first input), y -> add, add's output
    assert observers[1] == observers[0] == 4


def test_tensor_keyword_argument_is_refused_naming_it():
    class ClampOut(nn.Module):
        def forward(self, t):
            torch.clamp(t, max=0.5, out=t)
            return t

    class EveryOp(Quantizer):
        def annotate(self, model):
            spec = QuantizationSpec(torch.int8, torchao_observer.default_observer)
            for node in model.graph.nodes:
                if node.op == "call_function":
                    node.meta["quantization_annotation"] = QuantizationAnnotation(
                        input_qspec_map=dict.fromkeys(node.all_input_nodes, spec),
                        output_qspec=spec,
                    )
            return model

        def validate(self, model):
            pass

    exported = _export(ClampOut(), (torch.randn(2, 3),))
    with pytest.raises(AssertionError, match=r"keyword argument 'out' is a tensor"):
        qcore.prepare_pt2e(exported, EveryOp())


def test_object_that_is_no_quantizer_is_refused_with_what_is_accepted():
    exported = _export(ConvLinear(), (torch.randn(1, 3, 8, 8),))
    with pytest.raises(TypeError, match=r"expected a qcore.Quantizer, a torchao Quantizer"):
        qcore.prepare_pt2e(exported, object())


def test_callback_sees_observers_by_graph_node_before_insertion():
    seen = {}

    class Recording(type(_xnnpack())):
        def prepare_obs_or_fq_callback(self, model, edge_or_node_to_obs_or_fq):
            output = next(n for n in model.graph.nodes if n.op == "output").args[0][0]
            seen["output"] = edge_or_node_to_obs_or_fq.get(output)

    quantizer = Recording().set_global(xnnpack.get_symmetric_quantization_config())
    prepared = qcore.prepare_pt2e(_export(ConvLinear(), (torch.randn(1, 3, 8, 8),)), quantizer)
    assert seen["output"] is not None  # keyed by the linear itself, not by its observer
    assert any(m is seen["output"] for m in prepared.modules())


def test_fold_quantize_false_keeps_the_weights_quantize():
    x = torch.randn(2, 3, 8, 8)
    prepared = qcore.prepare_pt2e(_export(ConvLinear(), (x,)), _xnnpack())
    prepared(x)
    folded = qcore.convert_pt2e(prepared)
    kept = qcore.convert_pt2e(prepared, fold_quantize=False)
    quantize = QD.quantize_per_tensor.default
    assert _counts(kept, [quantize])[quantize] == _counts(folded, [quantize])[quantize] + 2
    assert any(n.target.startswith("_frozen_param") for n in folded.graph.find_nodes(op="get_attr"))
    torch.testing.assert_close(kept(x), folded(x))


def test_foreign_quantizer_cannot_be_lowered():
    x = torch.randn(2, 3, 8, 8)
    prepared = qcore.prepare_pt2e(_export(ConvLinear(), (x,)), _xnnpack())
    prepared(x)
    with pytest.raises(ValueError, match=r"lower=True: .*XNNPACKQuantizer.*names no backend"):
        qcore.convert_pt2e(prepared, lower=True)


def test_prepared_and_converted_models_refuse_eval_as_exported_ones_do():
    x = torch.randn(2, 3, 8, 8)
    prepared = qcore.prepare_pt2e(_export(ConvLinear(), (x,)), _xnnpack())
    prepared(x)
    converted = qcore.convert_pt2e(prepared)
    for model in (prepared, converted):
        with pytest.raises(NotImplementedError, match="not supported on a model from torch.export"):
            model.eval()
    buffer = io.BytesIO()
    torch.save(converted, buffer)  # the refusal lives on the class: it still pickles
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), converted(x))


# ----------------------------------------------------------------------- bfloat16


def test_bfloat16_model_dequantizes_to_bfloat16_as_torchao():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    theirs, ours = _both(ConvLinear(torch.bfloat16), (x,), _xnnpack)
    dequantizes = [n for n in ours.graph.nodes if n.target is QD.dequantize_per_tensor.default]
    assert dequantizes and all(n.kwargs.get("out_dtype") is torch.bfloat16 for n in dequantizes)
    assert ours(x).dtype is torch.bfloat16
    torch.testing.assert_close(ours(x), theirs(x), atol=_output_step(theirs) * 1.01, rtol=0)


def test_bfloat16_model_for_a_backend_stays_in_reference_form_and_says_why():
    torch.manual_seed(0)
    model = ConvLinear(torch.bfloat16).eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    prepared = qcore.prepare_pt2e(_export(model, (x,)), "x86")
    prepared(x)
    converted = qcore.convert_pt2e(prepared)
    assert converted(x).dtype is torch.bfloat16
    reasons = {e.reason for e in qcore.explain(converted).entries if e.op == "aten.linear"}
    assert reasons == {
        "torch's int8 kernels take float32 models; this one computes in torch.bfloat16"
    }
    expected = model(x).float()
    error = (converted(x).float() - expected).abs().max()
    assert error < 0.1 * expected.abs().max()


# ------------------------------------------------------------------ linear + batch norm


@pytest.mark.parametrize("quantizer", ["x86", "xnnpack"])
def test_linear_batchnorm1d_is_folded_before_annotation(quantizer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)).eval()
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    x = torch.randn(4, 8)
    prepared = qcore.prepare_pt2e(
        _export(model, (x,)), _xnnpack() if quantizer == "xnnpack" else quantizer
    )
    assert not [n for n in prepared.graph.nodes if "batch_norm" in str(n.target)]
    torch.testing.assert_close(prepared(x), model(x), atol=1e-5, rtol=1e-5)


def test_linear_batchnorm1d_on_3d_input_is_not_folded_and_warns():
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5)).eval()
    x = torch.randn(2, 5, 3)
    with pytest.warns(UserWarning, match="Not fusing linear\\+bn"):
        prepared = qcore.prepare_pt2e(_export(model, (x,)), _xnnpack())
    torch.testing.assert_close(prepared(x), model(x), atol=1e-5, rtol=1e-5)
