"""The PT2E front door: every backend by name, plugin quantizers, composition, bad input."""

import importlib
import importlib.util
import math
import warnings

import pytest
import torch
from backends import installed
from torch import nn
from zoo.baseline import sqnr

import qcore
from qcore.config.errors import ConfigError
from qcore.engine.observe import SharingError
from qcore.observers import MinMaxObserver
from qcore.pt2e import AnnotationError, BackendQuantizer
from qcore.quantizer import (
    ANNOTATION_KEY,
    ComposableQuantizer,
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationConfig,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)

aten = torch.ops.aten

ACT = QuantizationSpec(
    dtype=torch.uint8, quant_min=0, quant_max=255, observer_or_fake_quant_ctr=MinMaxObserver
)
INT8 = QuantizationSpec(
    dtype=torch.int8, quant_min=-128, quant_max=127, observer_or_fake_quant_ctr=MinMaxObserver
)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def make_small():
    torch.manual_seed(0)
    model = Small()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.2, 0.2)
        model.bn.running_var.uniform_(0.5, 1.5)
    return model.eval()


X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def exported(model=None):
    return torch.export.export(model or make_small(), (X,)).module()


def mychip_mapping():
    """The tutorial's QConfig, within mychip's constraints (eps 2**-12)."""
    from qcore.config.qconfig import QConfig, QConfigMapping
    from qcore.observers import HistogramObserver

    activation = HistogramObserver.with_args(
        dtype=torch.quint8, quant_min=0, quant_max=255, eps=2**-12
    )
    weight = MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    return QConfigMapping().set_global(QConfig(activation, weight))


# mychip is the tutorial's backend: the default mapping's eps is below its bound, so by
# name it explains instead (test_mychip_gets_pt2e_from_its_backend_config).
BACKENDS = sorted(set(qcore.list_backends()) - {"mychip"})


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_works_by_name(name):
    if not installed(name):
        pytest.skip(f"backend {name!r} is not installed")
    model = make_small()
    prepared = qcore.prepare_pt2e(exported(model), name)
    prepared(X)
    converted = qcore.convert_pt2e(prepared)
    quantized = [e for e in qcore.explain(converted) if e.status.name in ("QUANTIZED", "REFERENCE")]
    assert quantized, f"backend {name!r} quantized nothing"
    assert sqnr(model(X), converted(X)) > 15


def test_mychip_gets_pt2e_from_its_backend_config():
    if not installed("mychip"):
        pytest.skip("qcore-mychip is not installed (tox -e thirdparty installs it)")
    by_name = qcore.prepare_pt2e(exported(), "mychip")
    (linear,) = [e for e in qcore.explain(by_name) if e.node == "linear"]
    assert "scale_min_lower_bound" in linear.reason
    quantizer = BackendQuantizer.for_backend("mychip", mychip_mapping())
    prepared = qcore.prepare_pt2e(exported(), quantizer)
    patterns = {e.pattern for e in qcore.explain(prepared) if e.pattern}
    assert {"Linear", "ConvReLU2d"} <= patterns, patterns


def test_backend_config_quantizer_explains_what_it_leaves_float():
    pytest.importorskip("qcore_x86", reason="needs the x86 plugin")

    class WithNorm(nn.Module):
        def forward(self, x):
            return torch.nn.functional.group_norm(x, 1)

    compiled = BackendQuantizer.for_backend("x86")
    prepared = qcore.prepare_pt2e(exported(WithNorm()), compiled)
    (entry,) = [e for e in qcore.explain(prepared) if e.status.name == "FLOAT"]
    assert "no pattern in backend 'x86' matches aten.group_norm" in entry.reason
    # By name, the x86 plugin's own Quantizer gives its recipe's reason.
    prepared = qcore.prepare_pt2e(exported(WithNorm()), "x86")
    (entry,) = [e for e in qcore.explain(prepared) if e.status.name == "FLOAT"]
    assert "x86 quantizes conv, linear, mul" in entry.reason


class OwnQuantizer(Quantizer):
    backend_name = "pt2e-own"

    def __init__(self):
        self.calls = []

    def annotate(self, model):
        self.calls.append("annotate")
        for node in model.graph.nodes:
            if getattr(node.target, "overloadpacket", None) is aten.linear:
                QuantizationConfig(ACT, ACT, weight=INT8).annotate_op(
                    node, [node.args[0]], weight=node.args[1]
                )
        return model

    def validate(self, model):
        self.calls.append("validate")


class OwnPlugin:
    def __init__(self, quantizer):
        self.quantizer = quantizer

    @qcore.hookimpl
    def qcore_backend_pattern_configs(self, backend):
        return []

    @qcore.hookimpl
    def qcore_backend_quantizer(self, backend):
        return self.quantizer


def test_a_plugins_own_quantizer_takes_precedence():
    quantizer = OwnQuantizer()
    qcore.register_plugin(OwnPlugin(quantizer), name="pt2e-own")
    prepared = qcore.prepare_pt2e(exported(), "pt2e-own")
    assert quantizer.calls == ["annotate", "validate"]
    annotated = [n.name for n in prepared.graph.nodes if ANNOTATION_KEY in n.meta]
    assert annotated == ["linear"]


def test_composable_quantizer_runs_in_order_and_reports_changes():
    first, second = OwnQuantizer(), OwnQuantizer()

    class Overwrite(Quantizer):
        def annotate(self, model):
            for node in model.graph.nodes:
                if node.name == "linear":
                    node.meta[ANNOTATION_KEY] = QuantizationAnnotation(output_qspec=ACT)
            return model

    composed = ComposableQuantizer([first, Overwrite(), second])
    with pytest.warns(qcore.QCoreWarning, match="changed the annotation of node 'linear'"):
        qcore.prepare_pt2e(exported(), composed)
    assert first.calls == second.calls == ["annotate", "validate"]
    assert [str(c) for c in composed.changes] == [
        "quantizers[1] (Overwrite) changed the annotation of node 'linear' made by "
        "quantizers[0] (OwnQuantizer)",
        "quantizers[2] (OwnQuantizer) changed the annotation of node 'linear' made by "
        "quantizers[1] (Overwrite)",
    ]
    with pytest.raises(ValueError, match="quantizers\\[1\\] \\(Overwrite\\) changed"):
        qcore.prepare_pt2e(exported(), ComposableQuantizer([first, Overwrite()], strict=True))


def test_composable_quantizer_rejects_non_quantizers():
    with pytest.raises(ConfigError, match=r"quantizers\[1\]: got 'x86' \(str\)"):
        ComposableQuantizer([OwnQuantizer(), "x86"])


def test_callback_sees_and_replaces_observers():
    class Replacing(OwnQuantizer):
        def annotate(self, model):
            for node in model.graph.nodes:
                if getattr(node.target, "overloadpacket", None) is aten.linear:
                    x = node.args[0]
                    node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
                        input_qspec_map={x: ACT}, output_qspec=SharedQuantizationSpec((x, node))
                    )
            return model

        def prepare_obs_or_fq_callback(self, model, observers):
            self.seen = dict(observers)
            for point in observers:
                observers[point] = MinMaxObserver(dtype=torch.quint8, quant_min=0, quant_max=15)

    quantizer = Replacing()
    composed = ComposableQuantizer([quantizer])
    with pytest.raises(ValueError, match="replaced the observer of only some"):
        qcore.prepare_pt2e(exported(), composed)

    class ReplacingAll(OwnQuantizer):
        def prepare_obs_or_fq_callback(self, model, observers):
            replacement = {}
            for point, observer in observers.items():
                new = replacement.setdefault(
                    id(observer), MinMaxObserver(quant_min=0, quant_max=15)
                )
                observers[point] = new

    prepared = qcore.prepare_pt2e(exported(), ComposableQuantizer([ReplacingAll()]))
    observers = [m for n, m in prepared.named_modules() if n.startswith("activation_post")]
    assert observers and all(o.quant_max == 15 for o in observers)
    assert quantizer.seen  # the first run saw every point before failing


def test_quantization_config_checks_its_fields():
    with pytest.raises(ConfigError, match="QuantizationConfig.weight: got 'int8'"):
        QuantizationConfig(ACT, ACT, weight="int8")


@pytest.mark.parametrize(
    "build, message",
    [
        (  # gave -5.9 dB, silently (torchao: an assertion at run time)
            lambda: QuantizationSpec(
                dtype=torch.uint8,
                quant_min=-128,
                quant_max=127,
                observer_or_fake_quant_ctr=MinMaxObserver,
            ),
            r"QuantizationSpec.quant_min: got -128 \(int\); expected a value in "
            r"torch.uint8's range \[0, 255\]",
        ),
        (  # NaN passed "scale > 0" and gave NaN outputs
            lambda: FixedQParamsQuantizationSpec(dtype=torch.uint8, scale=math.nan, zero_point=0),
            r"FixedQParamsQuantizationSpec.scale: got nan .*expected a finite float",
        ),
        (
            lambda: FixedQParamsQuantizationSpec(dtype=torch.uint8, scale=0.1, zero_point=300),
            r"FixedQParamsQuantizationSpec.zero_point: got 300 .*expected an int in \[0, 255\]",
        ),
        (  # an instance failed at calibration: "forward() missing ... 'x_orig'"
            lambda: QuantizationSpec(
                dtype=torch.uint8, observer_or_fake_quant_ctr=MinMaxObserver()
            ),
            "QuantizationSpec.observer_or_fake_quant_ctr: got MinMaxObserver",
        ),
        (  # raised a bare AssertionError at prepare
            lambda: QuantizationAnnotation(output_qspec=torch.int8),
            "QuantizationAnnotation.output_qspec: got torch.int8",
        ),
    ],
    ids=["range beyond the dtype", "nan scale", "zero point", "observer instance", "not a spec"],
)
def test_a_spec_a_quantizer_gets_wrong_is_refused_when_built(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_an_observer_constructor_that_makes_no_observer_names_the_edge():
    """nn.Identity passed the callable() check and left the input unquantized."""
    identity = QuantizationSpec(dtype=torch.uint8, observer_or_fake_quant_ctr=nn.Identity)

    class Identity(Quantizer):
        def annotate(self, model):
            for node in model.graph.nodes:
                if node.name == "linear":
                    node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
                        input_qspec_map={node.args[0]: identity}
                    )
            return model

    with pytest.raises(
        TypeError,
        match="the annotation of the input 'flatten' of 'linear': its observer_or_fake_quant",
    ):
        qcore.prepare_pt2e(exported(), Identity())


def test_prepare_leaves_the_exported_model_untouched_and_convert_needs_a_prepared_one():
    gm = exported()
    before = [n.name for n in gm.graph.nodes]
    qcore.prepare_pt2e(gm, OwnQuantizer())
    assert [n.name for n in gm.graph.nodes] == before
    assert not any(ANNOTATION_KEY in n.meta for n in gm.graph.nodes)
    with pytest.raises(TypeError, match="expected a model returned by qcore.prepare_pt2e"):
        qcore.convert_pt2e(gm)


def test_an_exported_program_is_accepted():
    program = torch.export.export(make_small(), (X,))
    prepared = qcore.prepare_pt2e(program, OwnQuantizer())
    assert any(n.op == "call_module" for n in prepared.graph.nodes)


@pytest.mark.parametrize("lower", [False, True])
def test_converted_model_keeps_no_float_copy_of_folded_weights(lower):
    if not installed("fbgemm"):
        pytest.skip("needs the fbgemm plugin")
    model = make_small()
    prepared = qcore.prepare_pt2e(exported(model), "fbgemm")
    prepared(X)
    converted = qcore.convert_pt2e(prepared, lower=lower)
    state = converted.state_dict()
    float_bytes = sum(v.numel() * v.element_size() for v in state.values() if v.is_floating_point())
    int8_elements = sum(v.numel() for v in state.values() if v.dtype == torch.int8)
    weights = sum(m.weight.numel() for m in (model.conv, model.fc))
    # Weights once, as int8 (lowered: inside the kernels); in float only biases and qparams.
    assert int8_elements == weights, sorted(state)
    assert float_bytes < 4 * weights / 4, {k: v.dtype for k, v in state.items()}
    with torch.no_grad():
        assert sqnr(model(X), converted(X)) > 15


def test_reference_form_runs_under_torch_compile():
    model = make_small()
    prepared = qcore.prepare_pt2e(exported(model), OwnQuantizer())
    prepared(X)
    converted = qcore.convert_pt2e(prepared, lower=False)
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    assert any(n.target is quantize for n in converted.graph.nodes)
    compiled = torch.compile(converted, backend="eager")
    torch.testing.assert_close(compiled(X), converted(X))


def test_qat_prepares_fake_quantizes_trains_and_converts():
    pytest.importorskip("qcore_x86", reason="needs the x86 plugin")
    model = make_small().train()
    gm = torch.export.export(model, (X,)).module()
    prepared = qcore.prepare_qat_pt2e(gm, "x86")
    kinds = {type(m).__name__ for n, m in prepared.named_modules() if n.startswith("activation")}
    assert any("FakeQuantize" in kind for kind in kinds), kinds
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        prepared(X).square().mean().backward()
        optimizer.step()
    converted = qcore.convert_pt2e(prepared)
    with torch.no_grad():
        assert torch.isfinite(converted(X)).all()


# ---------------------------------------------------------------- bad input


def test_a_symbolic_trace_graph_is_refused_naming_the_node():
    traced = torch.fx.symbolic_trace(make_small())
    with pytest.raises(TypeError, match="node 'conv' calls module 'conv'.*torch.export.export"):
        qcore.prepare_pt2e(traced, OwnQuantizer())


def test_a_plain_module_is_refused():
    with pytest.raises(TypeError, match="(?s)model: got Small.*torch.export.export"):
        qcore.prepare_pt2e(make_small(), "x86")


def test_a_quantizer_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match="quantizer: got 3 \\(int\\); expected a qcore.Quantizer"):
        qcore.prepare_pt2e(exported(), 3)


def test_an_annotation_pointing_outside_the_graph_names_the_node():
    stranger = exported()
    outside = next(n for n in stranger.graph.nodes if n.op == "placeholder")

    class Stray(Quantizer):
        def annotate(self, model):
            for node in model.graph.nodes:
                if node.name == "linear":
                    node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
                        input_qspec_map={outside: ACT}
                    )
            return model

    with pytest.raises(
        AnnotationError, match="annotation of node 'linear': input_qspec_map key 'x' is not"
    ):
        qcore.prepare_pt2e(exported(), Stray())

    class StrayShare(Quantizer):
        def annotate(self, model):
            for node in model.graph.nodes:
                if node.name == "linear":
                    node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
                        output_qspec=SharedQuantizationSpec(outside)
                    )
            return model

    with pytest.raises(AnnotationError, match="refers to node 'x', not in this graph"):
        qcore.prepare_pt2e(exported(), StrayShare())


def test_an_input_that_is_not_the_nodes_input_names_both():
    class Wrong(Quantizer):
        def annotate(self, model):
            nodes = {n.name: n for n in model.graph.nodes}
            nodes["linear"].meta[ANNOTATION_KEY] = QuantizationAnnotation(
                input_qspec_map={nodes["x"]: ACT}
            )
            return model

    with pytest.raises(AnnotationError, match="key 'x' is not an input of 'linear'"):
        qcore.prepare_pt2e(exported(), Wrong())


class MixedDtypes(nn.Module):
    def forward(self, x, y):
        return torch.cat([x, y.to(torch.float16).float()]), y.to(torch.float16)


def test_a_sharing_group_with_incompatible_dtypes_names_the_nodes():
    class Mixed(Quantizer):
        def annotate(self, model):
            nodes = {n.name: n for n in model.graph.nodes}
            cat, half = nodes["cat"], nodes["to_2"]
            x = cat.args[0][0]
            cat.meta[ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map={x: ACT})
            half.meta[ANNOTATION_KEY] = QuantizationAnnotation(
                output_qspec=SharedQuantizationSpec((x, cat))
            )
            return model

    inputs = (torch.randn(2, 3), torch.randn(2, 3))
    gm = torch.export.export(MixedDtypes(), inputs).module()
    with pytest.raises(
        SharingError,
        match="annotation of node 'to_2', output: .*torch.float16 tensor with 'x->cat', "
        "a torch.float32 tensor",
    ):
        qcore.prepare_pt2e(gm, Mixed())


def test_mychip_is_reported_when_missing():
    if importlib.util.find_spec("qcore_mychip") is not None:
        pytest.skip("qcore-mychip is installed")
    with pytest.raises(qcore.UnknownBackendError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qcore.prepare_pt2e(exported(), "mychip")


def test_the_third_party_backend_gets_pt2e_without_a_quantizer(monkeypatch):
    """tests/thirdparty/mychip, registered in-process (tox -e thirdparty installs it)."""
    import pathlib

    name = "mychip"
    if name not in qcore.list_backends():  # not installed: register it in-process
        root = pathlib.Path(__file__).parent / "thirdparty" / "mychip"
        monkeypatch.syspath_prepend(str(root))
        name = "mychip-pt2e"
        qcore.register_plugin(importlib.import_module("qcore_mychip.plugin"), name=name)
    # The default mapping's eps is below mychip's scale_min_lower_bound: the
    # tutorial's faulty setup, explained.
    prepared = qcore.prepare_pt2e(exported(), name)
    (linear,) = [e for e in qcore.explain(prepared) if e.node == "linear"]
    assert linear.status.name == "FLOAT"
    assert "scale_min_lower_bound" in linear.reason
    model = make_small()
    quantizer = BackendQuantizer.for_backend(name, mychip_mapping())
    prepared = qcore.prepare_pt2e(exported(model), quantizer)
    patterns = {e.pattern for e in qcore.explain(prepared) if e.pattern}
    assert patterns == {"Linear", "ConvReLU2d"}, patterns
    prepared(X)
    converted = qcore.convert_pt2e(prepared)  # mychip has no kernels: reference form
    assert "REFERENCE" in {e.status.name for e in qcore.explain(converted)}
    assert sqnr(model(X), converted(X)) > 15


@pytest.mark.skipif(not installed("x86"), reason="needs the x86 plugin")
def test_a_quantizer_that_quantizes_nothing_is_said_once():
    """SqueezeBERT's linears are 1x1 conv1ds, which x86 (as torchao's
    X86InductorQuantizer) quantizes only with a fused activation: the prepared
    model observed nothing and convert returned the float model, without a word."""

    class Pointwise(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(8, 8, 1)

        def forward(self, x):
            return nn.functional.gelu(self.conv(x))

    x = torch.randn(2, 8, 16)
    exported_model = torch.export.export(Pointwise().eval(), (x,)).module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qcore.prepare_pt2e(exported_model, "x86")
    messages = [str(w.message) for w in caught if "quantizes nothing" in str(w.message)]
    assert messages == [
        "prepare_pt2e: 'x86' quantizes nothing in this model; its 2 op(s) stay float "
        "(aten.conv1d, aten.gelu), e.g. aten.conv1d: x86 quantizes conv1d only with a fused "
        "unary post-op (relu, hardtanh, hardswish, silu), as torchao's X86InductorQuantizer "
        "does. qcore.explain(prepared) gives the reason for each."
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qcore.prepare_pt2e(exported(), "x86")
    assert not [w for w in caught if "quantizes nothing" in str(w.message)]
