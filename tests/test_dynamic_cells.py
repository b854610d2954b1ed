"""Dynamic LSTMCell, GRUCell and RNNCell kernels (qcore.kernels.dynamic_cells).

Differential: each cell, converted by qcore for each installed first-party backend
with torch.ao's own dynamic QConfigs (qint8 per tensor, qint8 per channel, float16),
against torch.ao's FX dynamic quantization of the same float model with the same
QConfig, run under the backend's engine. Both run torch's
``quantized_*_cell_dynamic`` op on the same integer weights and qparams (the same
observers saw the same float weights), so the outputs are required to be equal bit
for bit: any difference is a different weight, qparam, engine or op, not rounding.
Then: hx=None, an explicit hidden state, unbatched input, bias=False, scripting,
torch.jit.save/load, torch.save/load, state_dict, qcore.save/load, the engine
kept whatever the global one says, and what stays in reference form (and why).
"""

import copy
import io
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from backends import FIRST_PARTY, backend_params, installed
from torch import nn
from torch.ao.quantization import (
    PlaceholderObserver,
    QConfig,
    QConfigMapping,
    default_dynamic_qconfig,
    default_weight_observer,
    float16_dynamic_qconfig,
    per_channel_dynamic_qconfig,
)
from torch.ao.quantization.quantize_fx import convert_fx as ao_convert_fx
from torch.ao.quantization.quantize_fx import prepare_fx as ao_prepare_fx

import qcore
from qcore.kernels.dynamic_cells import DynamicCell
from qcore.kernels.runtime import using_engine

CELLS = {
    "lstm": lambda bias=True: nn.LSTMCell(8, 16, bias=bias),
    "gru": lambda bias=True: nn.GRUCell(8, 16, bias=bias),
    "rnn_tanh": lambda bias=True: nn.RNNCell(8, 16, bias=bias),
    "rnn_relu": lambda bias=True: nn.RNNCell(8, 16, bias=bias, nonlinearity="relu"),
}
QCONFIGS = {
    "qint8": default_dynamic_qconfig,
    "qint8_per_channel": per_channel_dynamic_qconfig,
    "fp16": float16_dynamic_qconfig,
}
CELL_TYPES = (nn.LSTMCell, nn.GRUCell, nn.RNNCell)


class Step(nn.Module):
    """One step of the cell from a zero state (hx left out)."""

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, x):
        return self.cell(x)


class StepFrom(Step):
    """One step from a given hidden state."""

    def forward(self, x, h):
        return self.cell(x, h)


class LSTMStepFrom(Step):
    """One LSTM step from a given (h, c), passed as two tensors: a traced forward's
    arguments script as tensors."""

    def forward(self, x, h, c):
        return self.cell(x, (h, c))


def _model(name: str, with_state: bool, bias: bool = True, seed: int = 0) -> tuple:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        kind = (LSTMStepFrom if name == "lstm" else StepFrom) if with_state else Step
        model = kind(CELLS[name](bias)).eval()
        x = torch.randn(5, 8) * 3
        states = (torch.randn(5, 16),) * (2 if name == "lstm" else 1)
    return model, (x, *states) if with_state else (x,)


def _mapping(qconfig) -> QConfigMapping:
    mapping = QConfigMapping()
    for cell_type in CELL_TYPES:
        mapping.set_object_type(cell_type, qconfig)
    return mapping


def _qcore(model, inputs, qconfig, backend):
    prepared = qcore.prepare_fx(model, _mapping(qconfig), example_inputs=inputs, backend=backend)
    return qcore.convert_fx(prepared)


def _torch_ao(model, inputs, qconfig, engine):
    """torch.ao's FX dynamic quantization of ``model``, run under ``engine``."""
    with using_engine(engine), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices
        prepared = ao_prepare_fx(copy.deepcopy(model), _mapping(qconfig), example_inputs=inputs)
        converted = ao_convert_fx(prepared)
        with torch.no_grad():
            return converted(*inputs)


def _run(model, inputs):
    with torch.no_grad():
        return model(*inputs)


def _max_difference(expected, actual) -> float:
    expected, actual = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    assert [t.shape for t in expected] == [t.shape for t in actual]
    return max(float((e - a).abs().max()) for e, a in zip(expected, actual, strict=True))


def _assert_identical(expected, actual) -> None:
    for e, a in zip(pytree.tree_leaves(expected), pytree.tree_leaves(actual), strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


#: The engine each backend's cell kernels pack for (onednn's dynamic kernels are x86's).
ENGINE = {"fbgemm": "fbgemm", "qnnpack": "qnnpack", "x86": "x86", "onednn": "x86"}


def _unsupported(backend: str, qconfig_name: str) -> bool:
    # qnnpack has no linear_prepack_fp16; onednn's config declares int8 recurrent layers only
    return backend in ("qnnpack", "onednn") and qconfig_name == "fp16"


@pytest.mark.parametrize("backend", backend_params((*FIRST_PARTY, "onednn")))
@pytest.mark.parametrize("qconfig_name", sorted(QCONFIGS))
@pytest.mark.parametrize("name", sorted(CELLS))
@pytest.mark.parametrize("with_state", [False, True], ids=["hx_none", "hx_given"])
def test_cell_runs_on_its_kernel_with_torch_aos_numbers(name, qconfig_name, backend, with_state):
    if _unsupported(backend, qconfig_name):
        pytest.skip(f"{backend} quantizes no fp16 cell (test_qnnpack_fp16_stays_in_reference_form)")
    model, inputs = _model(name, with_state)
    qconfig = QCONFIGS[qconfig_name]
    converted = _qcore(model, inputs, qconfig, backend)

    assert isinstance(converted.cell, DynamicCell)
    assert converted.cell.engine == ENGINE[backend]
    report = qcore.explain(converted)
    assert [(e.node, e.kernel) for e in report.quantized] == [
        ("cell", f"{ENGINE[backend]}.rnn_cell_dynamic")
    ], str(report)
    # fp16 weights: the kernel takes the float32 input, as torch.ao's lowering does
    expected = _torch_ao(model, inputs, qconfig, ENGINE[backend])
    assert _max_difference(expected, _run(converted, inputs)) == 0.0


#: A dynamic QConfig whose input range is 7 bits (0..127), fbgemm's overflow guard.
SEVEN_BIT = QConfig(
    activation=PlaceholderObserver.with_args(
        dtype=torch.quint8, quant_min=0, quant_max=127, is_dynamic=True
    ),
    weight=default_weight_observer,
)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", sorted(CELLS))
def test_kernel_is_the_reference_form_where_both_quantize_alike(name, backend):
    """What legitimately differs from the reference form, and only that: torch's cell
    ops quantize the input to 7 bits on fbgemm and x86 whatever the QConfig says (8
    on qnnpack), and the hidden state too. Given the QConfig of that range and a zero
    state (exactly quantized), kernel and reference form compute the same real
    numbers: float rounding apart (measured 1.2e-7; allowed 1e-6)."""
    qconfig = default_dynamic_qconfig if backend == "qnnpack" else SEVEN_BIT
    model, inputs = _model(name, with_state=True)
    prepared = qcore.prepare_fx(model, _mapping(qconfig), example_inputs=inputs, backend=backend)
    converted = qcore.convert_fx(prepared)
    assert isinstance(converted.cell, DynamicCell)
    reference = qcore.convert_to_reference_fx(prepared)
    zero_state = (inputs[0], *(torch.zeros_like(s) for s in inputs[1:]))
    assert _max_difference(_run(reference, zero_state), _run(converted, zero_state)) < 1e-6
    # the state is quantized too (8 bits on qnnpack, 7 elsewhere): a few input steps
    assert _max_difference(_run(reference, inputs), _run(converted, inputs)) < 0.05


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", sorted(CELLS))
def test_bias_false_equals_a_zero_bias(name, backend):
    """torch.ao's dynamic cells require a bias; a cell without one computes what the
    same cell with zero biases does."""
    model, inputs = _model(name, with_state=True, bias=False)
    zero_bias, _ = _model(name, with_state=True, bias=True)
    zero_bias.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        zero_bias.cell.bias_ih.zero_()
        zero_bias.cell.bias_hh.zero_()
    converted = _qcore(model, inputs, default_dynamic_qconfig, backend)
    assert isinstance(converted.cell, DynamicCell) and not converted.cell.has_bias
    expected = _torch_ao(zero_bias, inputs, default_dynamic_qconfig, ENGINE[backend])
    assert _max_difference(expected, _run(converted, inputs)) == 0.0


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("qconfig_name", ["qint8", "fp16"])
@pytest.mark.parametrize("name", sorted(CELLS))
def test_unbatched_input_is_one_batch_row(name, qconfig_name, backend):
    """torch.nn's cells take a 1-D sample (and 1-D states) and return 1-D states;
    the kernel gives what it gives that sample as a batch of one."""
    if _unsupported(backend, qconfig_name):
        pytest.skip("qnnpack has no fp16 packed linear")
    model, inputs = _model(name, with_state=True)
    converted = _qcore(model, inputs, QCONFIGS[qconfig_name], backend)
    assert isinstance(converted.cell, DynamicCell)
    unbatched = pytree.tree_leaves(_run(converted, tuple(t[1] for t in inputs)))
    as_batch = pytree.tree_leaves(_run(converted, tuple(t[1:2] for t in inputs)))
    assert [t.shape for t in unbatched] == [torch.Size([16])] * len(as_batch)
    _assert_identical([t[0] for t in as_batch], unbatched)


def _any_backend() -> str:
    for name in FIRST_PARTY:
        if installed(name):
            return name
    pytest.skip("needs a first-party backend")


@pytest.mark.parametrize("name", sorted(CELLS))
def test_hx_none_is_a_zero_state(name):
    model, inputs = _model(name, with_state=False)
    converted = _qcore(model, inputs, default_dynamic_qconfig, _any_backend())
    zeros = torch.zeros(5, 16)
    given = (zeros, zeros) if name == "lstm" else zeros
    _assert_identical(_run(converted, inputs), _run(converted.cell, (inputs[0], given)))


def test_bad_input_shapes_name_the_shape():
    model, inputs = _model("gru", with_state=False)
    converted = _qcore(model, inputs, default_dynamic_qconfig, _any_backend())
    with pytest.raises(ValueError, match=r"expected input to be 1-D or 2-D, got shape \[2, 5, 8\]"):
        converted(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"input has 7 features, expected input_size=8"):
        converted(torch.randn(5, 7))
    with pytest.raises(ValueError, match=r"hidden state of shape \[5, 16\], got \[5, 15\]"):
        converted.cell(torch.randn(5, 8), torch.randn(5, 15))


@pytest.mark.parametrize("backend", backend_params())
def test_qnnpack_fp16_stays_in_reference_form(backend):
    if backend != "qnnpack":
        pytest.skip("only qnnpack lacks fp16 packed linears")
    model, inputs = _model("gru", with_state=False)
    converted = _qcore(model, inputs, float16_dynamic_qconfig, backend)
    assert not isinstance(converted.cell, DynamicCell)
    (entry,) = qcore.explain(converted).reference
    assert "qnnpack has no fp16 packed linear" in entry.reason


def _case_params() -> list:
    """(backend, cell, QConfig) for the save/load tests: per channel and fp16."""
    return [
        pytest.param(
            backend,
            name,
            qconfig_name,
            id=f"{backend}-{name}-{qconfig_name}",
            marks=pytest.mark.skipif(not installed(backend), reason=f"{backend} not installed"),
        )
        for backend in FIRST_PARTY
        for name in sorted(CELLS)
        for qconfig_name in ("qint8_per_channel", "fp16")
        if not _unsupported(backend, qconfig_name)
    ]


def _converted(backend, name, qconfig_name, seed=0):
    model, inputs = _model(name, with_state=True, seed=seed)
    return _qcore(model, inputs, QCONFIGS[qconfig_name], backend), inputs


@pytest.mark.parametrize("backend, name, qconfig_name", _case_params())
def test_scripts_and_survives_jit_save_load_bit_exact(backend, name, qconfig_name):
    converted, inputs = _converted(backend, name, qconfig_name)
    eager = _run(converted, inputs)
    # torch.jit.script swaps each kernel for its __prepare_scriptable__ module in the
    # model it is given: script a copy. torch.jit.load packs torch's quantized
    # weights for the global engine: load under the kernel's.
    with using_engine(backend), torch.no_grad():
        scripted = torch.jit.script(copy.deepcopy(converted))
        buffer = io.BytesIO()
        torch.jit.save(scripted, buffer)
        buffer.seek(0)
        loaded = torch.jit.load(buffer)
        _assert_identical(eager, scripted(*inputs))
        _assert_identical(eager, loaded(*inputs))
        unbatched = tuple(t[0] for t in inputs)
        _assert_identical(_run(converted, unbatched), loaded(*unbatched))
        _assert_identical(_run(converted.cell, inputs[:1]), loaded.cell(inputs[0]))  # hx=None


@pytest.mark.parametrize("backend, name, qconfig_name", _case_params())
def test_torch_save_and_load_of_the_whole_model(backend, name, qconfig_name):
    converted, inputs = _converted(backend, name, qconfig_name)
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    buffer.seek(0)
    with using_engine("qnnpack" if backend != "qnnpack" else "fbgemm"):  # not the kernel's
        loaded = torch.load(buffer, weights_only=False)
    assert loaded.cell.engine == backend
    assert qcore.explain(loaded) == qcore.explain(converted)
    torch.testing.assert_close(_run(loaded, inputs), _run(converted, inputs), rtol=0, atol=0)


@pytest.mark.parametrize("backend, name, qconfig_name", _case_params())
def test_state_dict_loads_into_a_fresh_conversion(backend, name, qconfig_name):
    converted, inputs = _converted(backend, name, qconfig_name)
    fresh, _ = _converted(backend, name, qconfig_name, seed=1)  # other weights
    state = converted.state_dict()
    assert all(not v.is_quantized for v in state.values()), "plain tensors only"
    fresh.load_state_dict(state)
    torch.testing.assert_close(_run(fresh, inputs), _run(converted, inputs), rtol=0, atol=0)


@pytest.mark.parametrize("backend, name, qconfig_name", _case_params())
def test_qcore_save_and_load(backend, name, qconfig_name, tmp_path):
    converted, inputs = _converted(backend, name, qconfig_name)
    qcore.save(converted, tmp_path / "cell.qcore")
    loaded = qcore.load(tmp_path / "cell.qcore")
    torch.testing.assert_close(_run(loaded, inputs), _run(converted, inputs), rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params())
def test_outputs_and_global_engine_do_not_depend_on_each_other(backend):
    converted, inputs = _converted(backend, "gru", "qint8_per_channel")
    expected = _run(converted, inputs)
    user_engine = torch.backends.quantized.engine
    for engine in ("fbgemm", "qnnpack", "x86"):
        if engine in torch.backends.quantized.supported_engines:
            with using_engine(engine):
                _assert_identical(expected, _run(converted, inputs))
    assert torch.backends.quantized.engine == user_engine


@pytest.mark.parametrize("backend", backend_params())
def test_a_given_hidden_state_enters_float_as_in_torch_ao(backend):
    """torch.ao FX quantizes a dynamic pattern's first input alone: an LSTM's or GRU's
    given state is not observed, and the layer still runs on its kernel."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = StepFrom(nn.GRU(8, 16)).eval()
        inputs = (torch.randn(3, 5, 8), torch.randn(1, 5, 16))
    mapping = QConfigMapping().set_object_type(nn.GRU, default_dynamic_qconfig)
    prepared = qcore.prepare_fx(model, mapping, example_inputs=inputs, backend=backend)
    observed = [n.args[0].name for n in prepared.graph.nodes if "post_process" in str(n.target)]
    assert observed == ["x"]
    report = qcore.explain(qcore.convert_fx(prepared))
    assert [e.kernel for e in report.quantized] == [f"{backend}.rnn_dynamic"], str(report)
