"""What a backend name stands for on PT2E (qcore.pt2e.extended), with plugins given
in-process: "native" is the union; a backend's own Quantizer is extended by what
other distributions add, and explain says what of theirs is not used.

tests/test_hostile_plugins.py covers the same with plugins installed for real.
"""

import types

import pytest
import torch

import qcore
from qcore import BackendPatternConfig, DTypeConfig, hookimpl
from qcore.observers import MinMaxObserver, PerChannelMinMaxObserver
from qcore.plugin import BackendRegistry
from qcore.plugin.discovery import PluginSpec
from qcore.pt2e import REASON_KEY, BackendQuantizer
from qcore.pt2e.extended import ExtendedQuantizer, kernel_ops, quantizer_for_backend
from qcore.quantizer import ANNOTATION_KEY, QuantizationAnnotation, QuantizationSpec, Quantizer

pytestmark = pytest.mark.skipif(not hasattr(torch, "export"), reason="PT2E needs torch.export")

aten = torch.ops.aten
INT8 = DTypeConfig(torch.quint8, torch.quint8, torch.qint8, torch.float)
ACTIVATION = QuantizationSpec(
    dtype=torch.uint8,
    quant_min=0,
    quant_max=255,
    qscheme=torch.per_tensor_affine,
    observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12),
)
WEIGHT = QuantizationSpec(
    dtype=torch.int8,
    quant_min=-128,
    quant_max=127,
    qscheme=torch.per_channel_symmetric,
    ch_axis=0,
    observer_or_fake_quant_ctr=PerChannelMinMaxObserver.with_args(eps=2**-12),
)
LINEAR_ONLY = "chip quantizes linear only"


class LinearOnly(Quantizer):
    """The chip's own recipe: linear inputs and weights, nothing else."""

    def annotate(self, model):
        for node in model.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is aten.linear.default:
                node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
                    input_qspec_map={node.args[0]: ACTIVATION, node.args[1]: WEIGHT},
                    _annotated=True,
                )
            else:
                node.meta[REASON_KEY] = LINEAR_ONLY
        return model

    def validate(self, model):
        pass


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.sigmoid(torch.nn.functional.gelu(self.linear(x)))


def module(name, configs=(), kernels=(), quantizer=None):
    plugin = types.ModuleType(name)
    plugin.QCORE_PLUGIN_API_VERSION = 1
    plugin.qcore_backend_pattern_configs = hookimpl(lambda backend: list(configs))
    plugin.qcore_backend_kernels = hookimpl(lambda backend: list(kernels))
    if quantizer is not None:
        plugin.qcore_backend_quantizer = hookimpl(lambda backend, is_qat: quantizer)
    return plugin


def registry(*plugins):
    specs = [
        PluginSpec(backend, f"{distribution}.plugin", distribution, "1.0", lambda m=m: m)
        for backend, distribution, m in plugins
    ]
    return BackendRegistry(find=lambda: specs, environ={})


def linear_config():
    return BackendPatternConfig(torch.nn.Linear).add_dtype_config(INT8)


def gelu_config():
    return BackendPatternConfig(torch.nn.functional.gelu).add_dtype_config(INT8)


def gelu_kernel(name="vendor.gelu"):
    return qcore.Kernel(name, aten.gelu.default, "chip", lambda match: None)


def prepare(quantizer):
    x = torch.randn(4, 8)
    exported = torch.export.export(Net().eval(), (x,)).module()
    prepared = qcore.prepare_pt2e(exported, quantizer)
    return {entry.op: entry for entry in qcore.explain(prepared).ops}


OWNER = ("chip", "qcore-chip", module("own", [linear_config()], quantizer=LinearOnly()))


def test_without_extensions_the_own_quantizer_is_used():
    own = OWNER[2].qcore_backend_quantizer(backend="chip", is_qat=False)
    assert quantizer_for_backend(registry(OWNER).get("chip")) is own


def test_native_is_compiled_from_the_union_and_asks_no_plugin_for_a_quantizer():
    reg = registry(OWNER, ("other", "qcore-other", module("other", [gelu_config()])))
    quantizer = quantizer_for_backend(reg.get("native"))
    assert isinstance(quantizer, BackendQuantizer)
    entries = prepare(quantizer)
    assert entries["aten.linear"].pattern == "Linear"
    assert entries["aten.gelu"].pattern == "gelu"  # the other backend's pattern


def test_an_extension_pattern_annotates_what_the_own_quantizer_left_float():
    vendor = ("chip", "qcore-aaa-vendor", module("vendor", [gelu_config()]))
    backend = registry(vendor, OWNER).get("chip")
    quantizer = quantizer_for_backend(backend)
    assert isinstance(quantizer, ExtendedQuantizer)
    assert quantizer.own_label == "LinearOnly (qcore-chip)"
    entries = prepare(quantizer)
    assert entries["aten.gelu"].status.name == "QUANTIZED"
    assert entries["aten.gelu"].pattern == "gelu" and entries["aten.gelu"].reason == ""
    assert entries["aten.linear"].status.name == "QUANTIZED"
    assert entries["aten.sigmoid"].reason == LINEAR_ONLY  # the owner's reason stays


def test_an_extension_pattern_on_what_the_own_quantizer_annotated_is_explained():
    vendor = ("chip", "qcore-vendor", module("vendor", [linear_config()]))
    entries = prepare(quantizer_for_backend(registry(OWNER, vendor).get("chip")))
    linear = entries["aten.linear"]
    assert linear.status.name == "QUANTIZED"
    assert linear.reason == (
        "annotated by LinearOnly (qcore-chip); qcore-vendor's pattern Linear for chip is "
        "not used here (a backend's own Quantizer takes precedence over its extensions)"
    )


def test_an_extension_kernel_on_an_op_left_float_is_explained():
    vendor = ("chip", "qcore-vendor", module("vendor", kernels=[gelu_kernel()]))
    entries = prepare(quantizer_for_backend(registry(OWNER, vendor).get("chip")))
    gelu = entries["aten.gelu"]
    assert gelu.status.name == "FLOAT"
    assert gelu.reason == (
        f"{LINEAR_ONLY}; qcore-vendor's kernel vendor.gelu for chip is not used: the op stays float"
    )


def test_an_extension_pattern_the_qconfig_rejects_is_explained():
    fp16 = DTypeConfig(torch.float16, torch.float16, torch.float16, torch.float16)
    config = BackendPatternConfig(torch.nn.functional.gelu).add_dtype_config(fp16)
    vendor = ("chip", "qcore-vendor", module("vendor", [config]))
    entries = prepare(quantizer_for_backend(registry(OWNER, vendor).get("chip")))
    gelu = entries["aten.gelu"]
    assert gelu.status.name == "FLOAT"
    assert gelu.reason.startswith(f"{LINEAR_ONLY}; qcore-vendor's pattern for chip: QConfig")


@pytest.mark.parametrize(
    "pattern, ops",
    [
        (aten.gelu.default, {aten.gelu}),
        (torch.nn.GELU, {aten.gelu}),
        ((torch.nn.Linear, "relu"), {aten.linear, aten.relu, aten.relu_}),
        (torch.ao.nn.intrinsic.ConvReLU2d, {aten.conv2d, aten.relu, aten.relu_}),
        ("no_such_method", set()),
    ],
)
def test_kernel_ops(pattern, ops):
    assert kernel_ops(qcore.Kernel("k", pattern, "chip")) == ops
