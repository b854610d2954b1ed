"""qcore.quantize takes calibration data as users have it (issue 16 §2): a
DataLoader's (x, y) pairs, dicts of keyword arguments, or any batch through
input_fn; a batch that does not fit forward is an error naming it."""

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import qcore

BACKEND = backend_params(("x86", "fbgemm", "qnnpack"))


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(x) + bias)


class OneInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(x))


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    xs = torch.randn(16, 8, generator=generator) * 3
    biases = torch.randn(16, 4, generator=generator)
    labels = torch.randint(0, 4, (16,), generator=generator)
    return xs, biases, labels


def _same(a: torch.nn.Module, b: torch.nn.Module, *inputs) -> bool:
    return torch.equal(a(*inputs), b(*inputs))


@pytest.mark.parametrize("backend", BACKEND)
def test_dataloader_of_x_y_pairs_drops_the_labels(backend):
    xs, _, labels = _data()
    model = OneInput().eval()
    example = (xs[:1],)
    reference = qcore.quantize(model, example, [xs[i : i + 4] for i in (0, 4, 8, 12)], backend)
    loader = DataLoader(TensorDataset(xs, labels), batch_size=4)  # yields [x, y] lists
    from_loader = qcore.quantize(model, example, loader, backend)
    from_tuples = qcore.quantize(model, example, [(x, y) for x, y in loader], backend)
    assert _same(reference, from_loader, xs) and _same(reference, from_tuples, xs)
    # Calibration saw the data: a model calibrated on other values differs.
    other = qcore.quantize(model, example, [xs[:4] / 10], backend)
    assert not _same(reference, other, xs)


@pytest.mark.parametrize("backend", BACKEND)
def test_two_inputs_from_tuples_dicts_and_input_fn(backend):
    xs, biases, labels = _data()
    model = TwoInputs().eval()
    example = (xs[:1], biases[:1])
    chunks = [slice(i, i + 4) for i in (0, 4, 8, 12)]
    reference = qcore.quantize(model, example, [(xs[s], biases[s]) for s in chunks], backend)
    with_labels = [(xs[s], biases[s], labels[s]) for s in chunks]
    as_dicts = [{"x": xs[s], "bias": biases[s]} for s in chunks]
    records = [{"features": xs[s], "offset": biases[s], "label": labels[s]} for s in chunks]
    for quantized in (
        qcore.quantize(model, example, with_labels, backend),
        qcore.quantize(model, example, as_dicts, backend),
        qcore.quantize(
            model,
            example,
            records,
            backend,
            input_fn=lambda record: (record["features"], record["offset"]),
        ),
        qcore.quantize(
            model,
            example,
            records,
            backend,
            input_fn=lambda record: {"x": record["features"], "bias": record["offset"]},
        ),
    ):
        assert _same(reference, quantized, xs, biases)


def test_a_batch_that_does_not_fit_names_its_index_contents_and_forward():
    xs, biases, labels = _data()
    model = TwoInputs().eval()
    # Before any backend is needed: the first bad batch stops calibration.
    too_few = [(xs[:4], biases[:4]), (xs[:4],)]
    with pytest.raises(TypeError) as error:
        _calibrate(model, too_few)
    message = str(error.value)
    assert message.startswith("calibration batch 1: got a tuple of 1 (Tensor(4, 8) float32)")
    assert "TwoInputs.forward(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor" in message
    assert "missing a required argument: 'bias'" in message
    assert "input_fn=" in message

    wrong_keys = [{"x": xs[:4], "label": labels[:4]}]
    with pytest.raises(TypeError, match=r"calibration batch 0: got a dict \('x': Tensor\(4, 8\)"):
        _calibrate(model, wrong_keys)
    with pytest.raises(TypeError, match="forward takes no parameter named 'label'"):
        _calibrate(model, wrong_keys)

    with pytest.raises(TypeError, match=r"calibration batch 0: got str 'abc'.*not a tensor"):
        _calibrate(model, ["abc"])

    with pytest.raises(TypeError, match=r"which input_fn turned into Tensor\(4, 8\) float32"):
        _calibrate(model, [(xs[:4], biases[:4])], input_fn=lambda batch: batch[0])

    with pytest.raises(TypeError, match=r"calibration_data: got Tensor\(16, 8\) float32"):
        _calibrate(model, xs)
    with pytest.raises(TypeError, match=r"input_fn: got int 3; expected a function"):
        _calibrate(model, [xs], input_fn=3)


def _calibrate(model, data, input_fn=None):
    from qcore.calibration import calibration_calls

    return [model(*args, **kwargs) for args, kwargs in calibration_calls(model, data, input_fn)]


@pytest.mark.parametrize("backend", BACKEND)
def test_quantize_reports_the_bad_batch(backend):
    xs, _, _ = _data()
    with pytest.raises(TypeError, match=r"calibration batch 2: got int 7"):
        qcore.quantize(OneInput().eval(), (xs[:1],), [xs[:4], xs[4:8], 7], backend)


@pytest.mark.parametrize("backend", BACKEND)
def test_a_batch_the_model_fails_on_is_named_in_the_models_error(backend):
    """The wrong width reached the model as torch's bare error, naming no batch."""
    xs, _, _ = _data()
    torch_says = r"mat1 and mat2 shapes cannot be multiplied \(4x5 and 8x4\)"
    with pytest.raises(RuntimeError, match=r"^calibration batch 1: " + torch_says):
        qcore.quantize(OneInput().eval(), (xs[:1],), [xs[:4], torch.randn(4, 5)], backend)


class RaisesKeyError(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyError("missing")


def test_an_error_not_rebuilt_from_its_message_gets_a_note_naming_the_batch():
    from qcore.calibration import raise_in_batch

    original = None
    with pytest.raises(KeyError) as raised:
        try:
            RaisesKeyError()(torch.zeros(1))
        except KeyError as error:
            original = error
            raise_in_batch(error, 3)
    assert raised.value is original
    assert raised.value.__notes__ == ["calibration batch 3: raised this"]


@pytest.mark.parametrize("backend", BACKEND)
@pytest.mark.parametrize("empty", ["list", "spent generator", "empty loader"])
def test_calibration_data_that_gives_no_batch_is_an_error(empty, backend):
    # It returned a model near 0 dB, with only a warning per observer.
    xs, _, _ = _data()
    spent = (x for x in [xs])
    list(spent)
    data = {
        "list": [],
        "spent generator": spent,
        "empty loader": DataLoader(TensorDataset(xs[:0]), batch_size=4),
    }[empty]
    with pytest.raises(ValueError, match="calibration_data: got .* which gave no batches"):
        qcore.quantize(OneInput().eval(), (xs[:2],), data, backend=backend)
