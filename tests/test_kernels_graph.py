"""The lowered graphs of the zoo CNNs: int8 from kernel to kernel, no warnings.

Between two consecutive int8 kernels there is no dequantize/quantize pair: the
only dequantize nodes feed float consumers (or the output), and every
quantize takes a float value that no kernel produced in int8 already.
"""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from backends import backend_params, requires_fbgemm
from torch.fx import GraphModule
from zoo import ZOO

import qcore
from qcore import ops

CNNS = ("resnet18_like", "mobilenetv2_like")


def _convert(name: str, backend: str) -> GraphModule:
    entry = ZOO[name]
    return qcore.quantize(
        entry.make_model(), entry.example_inputs(), entry.calibration_data(2), backend=backend
    )


def _produces_int8(node, modules) -> bool:
    if node.op == "call_module":
        return getattr(modules[node.target], "returns_quantized", False)
    return node.op == "call_function" and node.target is torch.quantize_per_tensor


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", CNNS)
def test_no_round_trip_between_consecutive_kernels(name, backend):
    converted = _convert(name, backend)
    modules = dict(converted.named_modules())
    kernels = [n for n in converted.graph.nodes if _produces_int8(n, modules)]
    assert len(kernels) > 10
    for node in converted.graph.nodes:
        if node.op == "call_method" and node.target == "dequantize":
            # a dequantize feeds float code (reference form, float ops, the output), never a
            # requantize into the next kernel
            for user in node.users:
                assert not (
                    user.op == "call_function" and user.target is torch.quantize_per_tensor
                ), f"{node.name} -> {user.name}: a dequantize/quantize round trip"
                assert not _produces_int8(user, modules), f"{user.name} takes float input"
    # the reference ops left are only those explain reports in reference form
    reference = {e.node for e in qcore.explain(converted).reference}
    leftover = [
        n.name
        for n in converted.graph.nodes
        if n.op == "call_function" and n.target is ops.dequantize_per_tensor
    ]
    assert len(leftover) <= 2 * len(reference) + 1


@pytest.mark.parametrize("backend", backend_params())
def test_resnet_lowers_add_relu_and_pooling(backend):
    report = qcore.explain(_convert("resnet18_like", backend))
    kernels = {e.kernel for e in report.quantized}
    for family in ("conv2d_relu", "conv2d", "add_relu", "pool_and_shape", "linear"):
        assert f"{backend}.{family}" in kernels


@requires_fbgemm
def test_converted_forward_emits_no_warnings_in_a_fresh_process():
    """torch's quantized-tensor deprecation warning fires once per process (C++
    TORCH_WARN_ONCE), so this runs where nothing has created a quantized tensor yet."""
    script = textwrap.dedent(
        """
        import sys, warnings
        sys.path.insert(0, "tests")
        import torch
        # What importing torch prints (its NumPy notice where NumPy is absent) is not
        # the subject: stderr is checked from this marker on.
        print("--- torch imported ---", file=sys.stderr, flush=True)
        import qcore
        from zoo import ZOO
        for name in ("resnet18_like", "mobilenetv2_like", "mlp", "transformer_block", "lstm"):
            entry = ZOO[name]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # prepare-time notices are not the subject
                from qcore.config.qconfig import QConfigMapping, default_dynamic_qconfig
                mapping = None
                if entry.dynamic:
                    mapping = QConfigMapping().set_object_type(torch.nn.LSTM,
                        default_dynamic_qconfig).set_object_type(torch.nn.Linear,
                        default_dynamic_qconfig)
                prepared = qcore.prepare_fx(entry.make_model(), mapping,
                                            entry.example_inputs(), backend="fbgemm")
                for batch in entry.calibration_data(1):
                    prepared(*batch)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                converted = qcore.convert_fx(prepared)
                with torch.no_grad():
                    converted(*entry.example_inputs())
            for item in caught:
                print(name, item.category.__name__, item.message)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", result.stdout
    after_import = result.stderr.split("--- torch imported ---", 1)[1]
    assert "Warning" not in after_import, after_import


@requires_fbgemm
def test_warnings_module_is_untouched():
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        _convert("mlp", "fbgemm")
        assert list(warnings.filters) == filters
