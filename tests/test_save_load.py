"""A converted model survives state_dict and torch.save/torch.load.

Packed weights are opaque engine objects: kernels keep the integer weights,
their qparams and the float bias as buffers and re-pack on load. A state_dict
loads into a freshly prepared and converted model (whose own calibration and
weights differ), and the whole model pickles; outputs are identical after.
"""

import io

import pytest
import torch
from backends import backend_params, requires_fbgemm
from kernel_cases import CASES, STATEFUL, build

# One case per kernel module with state (packed weights, norm buffers, qparams).


def _run(model, inputs):
    with torch.no_grad():
        output = model(*inputs)
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", STATEFUL)
def test_state_dict_loads_into_a_fresh_conversion(name, backend):
    case = CASES[name]
    built = build(case, backend)
    fresh = build(case, backend, seed=1).converted  # other weights, other calibration
    state = built.converted.state_dict()
    assert all(not v.is_quantized for v in state.values()), "plain tensors only"
    fresh.load_state_dict(state)
    torch.testing.assert_close(
        _run(fresh, built.inputs), _run(built.converted, built.inputs), rtol=0, atol=0
    )


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", STATEFUL)
def test_torch_save_and_load_of_the_whole_model(name, backend):
    built = build(CASES[name], backend)
    buffer = io.BytesIO()
    torch.save(built.converted, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(
        _run(loaded, built.inputs), _run(built.converted, built.inputs), rtol=0, atol=0
    )


@requires_fbgemm
def test_zoo_cnn_round_trips_through_torch_save():
    from zoo import ZOO

    import qcore

    entry = ZOO["resnet18_like"]
    converted = qcore.quantize(
        entry.make_model(), entry.example_inputs(), entry.calibration_data(2), backend="fbgemm"
    )
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert qcore.explain(loaded) == qcore.explain(converted)
    inputs = entry.calibration_data(1, seed=5)[0]
    torch.testing.assert_close(_run(loaded, inputs), _run(converted, inputs), rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params())
def test_a_graph_keeping_a_qcore_op_round_trips_through_torch_save(backend):
    """torch.load traces a GraphModule's code again. An LSTM with ``proj_size`` has no
    dynamic kernel and stays in reference form, which computes its input's qparams
    with ``qcore.ops.choose_qparams_per_tensor``; traced through, its branch on the
    tensor's size failed (TraceError). The call is now kept as one node."""
    import qcore

    class Projected(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(32, 24, batch_first=True, proj_size=12)
            self.out = torch.nn.Linear(12, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.rnn(x)[0])

    torch.manual_seed(0)
    converted = qcore.quantize_dynamic(Projected().eval(), backend=backend)
    assert [entry.op for entry in qcore.explain(converted).reference] == ["LSTM"]
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(4, 7, 32)
    torch.testing.assert_close(loaded(x), converted(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params())
def test_the_reference_form_round_trips_through_torch_save(backend):
    """convert_to_reference_fx kept prepare's state (a BackendConfig naming fuser
    closures and torch's max_pool2d): torch.save raised PicklingError."""
    import torch.nn.functional as F

    import qcore

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(4, 4, 3), torch.nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(F.max_pool2d(torch.relu(self.conv(x)), 2).flatten(1))

    torch.manual_seed(0)
    x = torch.randn(8, 4, 6, 6)
    prepared = qcore.prepare_fx(Net().eval(), None, (x,), backend=backend)
    prepared(x)
    reference = qcore.convert_to_reference_fx(prepared)
    buffer = io.BytesIO()
    torch.save(reference, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert qcore.explain(loaded) == qcore.explain(reference)
    torch.testing.assert_close(loaded(x), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("form", ["lowered", "reference", "pt2e"])
def test_a_deep_copy_of_a_converted_model_round_trips_through_torch_save(form, backend):
    """Keeping a deep copy of the best model and saving it is a common loop. The deep
    copy took the graph's tracer class (qcore's, which needs prepare-time arguments),
    and torch.load failed: ``QuantizationTracer.__init__() missing 2 required
    positional arguments``."""
    import copy

    import torch.nn.functional as F

    import qcore

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(F.relu(self.fc1(x)))

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    if form == "pt2e":
        prepared = qcore.prepare_pt2e(torch.export.export(Net().eval(), (x,)).module(), backend)
    else:
        prepared = qcore.prepare_fx(Net().eval(), None, (x,), backend=backend)
    prepared(x)
    convert = {
        "lowered": qcore.convert_fx,
        "reference": qcore.convert_to_reference_fx,
        "pt2e": qcore.convert_pt2e,
    }[form]
    converted = convert(prepared)
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(converted), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), converted(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params())
def test_the_reference_form_of_a_forward_with_string_annotations_round_trips(backend):
    """``from __future__ import annotations`` (every transformers model) leaves the
    forward's annotations as strings; the reference form's code kept them as globals
    pickling could not name (torch.ao's convert fails the same way)."""
    import qcore

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3)

        def forward(self, x: "torch.Tensor") -> "torch.Tensor":  # noqa: UP037
            return torch.relu(self.conv(x))

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    prepared = qcore.prepare_fx(Net().eval(), None, (x,), backend=backend)
    prepared(x)
    for converted in (qcore.convert_to_reference_fx(prepared), qcore.convert_fx(prepared)):
        buffer = io.BytesIO()
        torch.save(converted, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        torch.testing.assert_close(loaded(x), converted(x), rtol=0, atol=0)
