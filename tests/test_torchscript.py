"""Converted FX models script with torch.jit.script, survive torch.jit.save/load, and
give the eager converted model's outputs bit for bit.

Scripting keeps each kernel's packed weights as they are (packed for the kernel's
engine). torch.jit.load packs torch's ``quantized`` weights again for
``torch.backends.quantized.engine``, as it does for torch.ao's scripted models, so a
model is loaded (and run, since some of torch's int8 ops read the global engine too)
under the engine its kernels were packed for. x86's oneDNN kernels pack themselves
again on load, whatever the engine.
"""

import collections
import io

import pytest
import torch
from backends import FIRST_PARTY, backend_params
from kernel_cases import CASES, build
from torch import nn

import qcore
from qcore import ops
from qcore.examples import ZOO
from qcore.kernels.packed import PackedWeights
from qcore.kernels.runtime import using_engine

ALL_BACKENDS = (*FIRST_PARTY, "onednn", "native")
_REFERENCE_FUNCTIONS = {
    ops.quantize_per_tensor,
    ops.dequantize_per_tensor,
    ops.quantize_per_channel,
    ops.dequantize_per_channel,
    ops.fake_quantize_dynamic,
}


def _leaves(output):
    return torch.utils._pytree.tree_leaves(output)


def _assert_identical(expected, actual):
    expected, actual = _leaves(expected), _leaves(actual)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual, strict=True):
        assert torch.equal(e, a), (e - a).abs().max()


def _packing_engine(model: nn.Module) -> str:
    """The engine most of the model's ``quantized`` packed weights were packed for."""
    engines = collections.Counter(
        m.engine
        for m in model.modules()
        if isinstance(m, PackedWeights) and not type(m).__name__.startswith("Onednn")
    )
    return engines.most_common(1)[0][0] if engines else torch.backends.quantized.engine


def _uses_reference_functions(model) -> list[str]:
    return sorted(
        node.target.__name__
        for node in model.graph.nodes
        if node.op == "call_function" and node.target in _REFERENCE_FUNCTIONS
    )


def _script_save_load(converted, inputs, engine: str):
    """(eager output, scripted output, loaded output), all under ``engine``."""
    with using_engine(engine), torch.no_grad():
        scripted = torch.jit.script(converted)
        buffer = io.BytesIO()
        torch.jit.save(scripted, buffer)
        buffer.seek(0)
        loaded = torch.jit.load(buffer)
        return converted(*inputs), scripted(*inputs), loaded(*inputs)


@pytest.mark.parametrize("backend", backend_params(ALL_BACKENDS))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_scripts_saves_loads_bit_exact(name, backend):
    example = ZOO[name]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = example.make_model()
    inputs = example.example_inputs()
    converted = qcore.quantize(model, inputs, example.calibration_data(2), backend=backend)
    eager, scripted, loaded = _script_save_load(converted, inputs, _packing_engine(converted))
    _assert_identical(eager, scripted)
    _assert_identical(eager, loaded)


# onednn's dynamic kernels are x86's (packed for the x86 engine); no single global
# engine at load packs both them and onednn's convs as the eager model has them.
_LOAD_ELSEWHERE = {("onednn", "linear_dynamic"), ("onednn", "lstm_dynamic")}


@pytest.mark.parametrize("backend", backend_params(FIRST_PARTY))
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_kernel_scripts_saves_loads_bit_exact(name, backend):
    built = build(CASES[name], backend)
    converted = built.converted
    eager, scripted, loaded = _script_save_load(converted, built.inputs, _packing_engine(converted))
    _assert_identical(eager, scripted)
    if (backend, name) not in _LOAD_ELSEWHERE:
        _assert_identical(eager, loaded)


class _ConvThenTransposed3d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 4, 1)
        self.up = nn.ConvTranspose3d(4, 2, 2)

    def forward(self, x):
        return self.up(torch.relu(self.conv(x)))


# torch 2.13 has no working int8 conv_transpose3d on these engines (qcore.kernels.UNAVAILABLE):
# the config quantizes it, no kernel takes it, it stays in reference form.
@pytest.mark.parametrize("backend", backend_params(("qnnpack", "onednn")))
def test_a_pattern_left_in_reference_form_scripts(backend):
    torch.manual_seed(0)
    model = _ConvThenTransposed3d().eval()
    inputs = (torch.randn(1, 3, 4, 4, 4),)
    converted = qcore.quantize(model, inputs, [inputs, (torch.randn(1, 3, 4, 4, 4),)], backend)
    report = qcore.explain(converted)
    assert [e.op for e in report.reference] == ["ConvTranspose3d"], str(report)
    assert report.quantized, str(report)
    # its quantize/dequantize run on torch's quantized tensors once lowered
    # (tests/test_round_trips_in_torch.py); qcore.ops' own scripting: tests/test_ops.py
    assert _uses_reference_functions(converted) == []
    eager, scripted, loaded = _script_save_load(converted, inputs, _packing_engine(converted))
    _assert_identical(eager, scripted)
    _assert_identical(eager, loaded)


def test_reference_module_scripts_as_its_float_module():
    """What a pattern with no kernel keeps (a ReferenceModule) scripts as the float
    module on the dequantized weights, which is all its forward runs."""
    from qcore.engine.reference import ReferenceModule, qparams_of

    observer = torch.ao.quantization.MinMaxObserver(dtype=torch.qint8)
    conv = nn.ConvTranspose3d(4, 2, 2)
    observer(conv.weight)
    reference = ReferenceModule(conv, {"weight": qparams_of(observer)}, nn.ConvTranspose3d)
    x = torch.randn(1, 4, 3, 3, 3)
    with torch.no_grad():
        _assert_identical(reference(x), torch.jit.script(reference)(x))


class ConvAndLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 6 * 6, 10)
        with torch.no_grad():  # large enough that 16-bit pair sums overflow
            self.conv.weight.mul_(8)
            self.fc.weight.mul_(8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(x)
        return y, self.fc(y.flatten(1))


@pytest.mark.parametrize("backend", backend_params(("fbgemm", "x86")))
def test_layers_moved_off_the_backends_engine_load_with_the_references_numbers(
    backend, monkeypatch
):
    """Layers whose backend kernel is wrong on this CPU run on qnnpack's (made so
    here: 8-bit inputs on a CPU said to sum int8 products in 16 bits). torch.jit.load
    packs torch's weights for the global engine, the backend's, whose kernel is wrong
    for them: their scripted form computes the reference's numbers, bit for bit,
    before saving and after loading."""
    from qcore.kernels import runtime

    monkeypatch.setattr(runtime, "int8_products_saturate", lambda: True)
    eight_bits = torch.ao.quantization.MinMaxObserver.with_args(reduce_range=False)
    qconfig = torch.ao.quantization.QConfig(
        activation=eight_bits, weight=torch.ao.quantization.default_per_channel_weight_observer
    )
    mapping = qcore.QConfigMapping().set_global(qconfig)
    torch.manual_seed(0)
    batches = [torch.randn(4, 16, 6, 6) for _ in range(3)]
    prepared = qcore.prepare_fx(ConvAndLinear().eval(), mapping, (batches[0],), backend)
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    converted = qcore.convert_fx(prepared)
    assert converted.conv.engine == converted.fc.engine == "qnnpack"
    reference = qcore.convert_to_reference_fx(prepared)
    with torch.no_grad():
        expected = reference(batches[1])
    _, scripted, loaded = _script_save_load(converted, (batches[1],), backend)
    _assert_identical(expected, scripted)
    _assert_identical(expected, loaded)


@pytest.mark.parametrize("backend", backend_params(("x86",)))
def test_a_conv_moved_off_onednn_loads_with_the_references_numbers(backend):
    """wav2vec2's positional conv, which oneDNN computes up to 255 steps off on some
    CPUs (an AMX/AVX512-VNNI Xeon): lowering moves it to qnnpack's kernel there, and
    torch.jit.load, packing for the x86 engine, would bring oneDNN's back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(32, 32, 16, padding=8, groups=2)).eval()
    batches = [torch.randn(2, 32, 50) for _ in range(3)]
    prepared = qcore.prepare_fx(model, None, (batches[0],), backend)
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    converted = qcore.convert_fx(prepared)
    if converted.get_submodule("0").engine != "qnnpack":
        pytest.skip("this CPU's oneDNN computes this conv right: nothing moves")
    with torch.no_grad():
        expected = qcore.convert_to_reference_fx(prepared)(batches[1])
    _, scripted, loaded = _script_save_load(converted, (batches[1],), backend)
    _assert_identical(expected, scripted)
    _assert_identical(expected, loaded)
