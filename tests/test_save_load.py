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
