"""Dynamic recurrent layers and embedding bags in the forms users build them.

* An LSTM without biases converted ("quantized, x86.rnn_dynamic") and then failed
  at every call: "quantized LSTM requires biases" (torch.ao refuses it at convert).
* An EmbeddingBag with ``include_last_offset=True`` given 2-D input (fixed-length
  bags) dropped its last bag: (3, 16) for the float model's (4, 16); torch.ao's
  converted model too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from backends import backend_params
from torch import nn
from zoo.baseline import quantized_engine

import qcore
from qcore.config.qconfig import QConfigMapping, float_qparams_weight_only_qconfig


def _sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.pow(2).sum() / (reference - actual).pow(2).sum()))


class Recurrent(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(16, 32, num_layers=2, batch_first=True, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize("backend", backend_params())
def test_an_lstm_without_biases_runs_as_one_with_zero_biases(backend):
    x = torch.randn(3, 7, 16)
    without = Recurrent(bias=False).eval()
    zero = Recurrent(bias=True).eval()
    with torch.no_grad():
        for name, value in without.rnn.named_parameters():
            getattr(zero.rnn, name).copy_(value)
        for name, value in zero.rnn.named_parameters():
            if name.startswith("bias"):
                value.zero_()
    converted = qcore.quantize_dynamic(without, backend=backend)
    kernels = [e.kernel for e in qcore.explain(converted).entries if e.kernel]
    assert any("rnn_dynamic" in kernel for kernel in kernels), qcore.explain(converted)
    with torch.no_grad():
        output = converted(x)
        torch.testing.assert_close(
            output, qcore.quantize_dynamic(zero, backend=backend)(x), rtol=0, atol=0
        )
        assert _sqnr(without(x), output) > 30


class Bags(nn.Module):
    def __init__(self, include_last_offset: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(50, 16, mode="sum", include_last_offset=include_last_offset)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.bag(indices)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_fixed_length_bags_give_one_row_per_bag(include_last_offset, backend):
    model = Bags(include_last_offset).eval()
    indices = torch.randint(0, 50, (4, 5))
    mapping = QConfigMapping().set_object_type(nn.EmbeddingBag, float_qparams_weight_only_qconfig)
    prepared = qcore.prepare_fx(copy.deepcopy(model), mapping, (indices,), backend=backend)
    converted = qcore.convert_fx(prepared)
    with torch.no_grad():
        expected, output = model(indices), converted(indices)
    assert output.shape == expected.shape == (4, 16)
    assert _sqnr(expected, output) > 30


class PackedRecurrent(nn.Module):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = kind(16, 32, num_layers=2, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(64, 4)
        self.lstm = kind is nn.LSTM  # a Python bool: traced as a constant

    def forward(self, packed, state=None):
        output, hidden = self.rnn(packed, state)
        last = hidden[0] if self.lstm else hidden
        return output.data, self.fc(torch.cat([last[-2], last[-1]], dim=1))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("with_state", [False, True])
def test_a_packed_sequence_runs_on_the_dynamic_kernel(kind, with_state, backend):
    """pack_padded_sequence's PackedSequence into an LSTM/GRU: explain said
    "quantized, rnn_dynamic" and every call failed ('PackedSequence' object has no
    attribute 'dim'); torch.ao's converted model runs it."""
    from torch.nn.utils.rnn import pack_padded_sequence

    model = PackedRecurrent(kind).eval()
    padded, lengths = torch.randn(5, 9, 16), torch.tensor([9, 4, 7, 2, 9])
    packed = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
    state = None
    if with_state:
        h = torch.randn(4, 5, 32)
        state = (h, torch.randn(4, 5, 32)) if kind is nn.LSTM else h
    converted = qcore.quantize_dynamic(model, backend=backend)
    kernels = [e.kernel for e in qcore.explain(converted).entries if e.kernel]
    assert any("rnn_dynamic" in kernel for kernel in kernels), qcore.explain(converted)
    with torch.no_grad():
        expected, output = model(packed, state), converted(packed, state)
    for wanted, got in zip(expected, output, strict=True):
        assert got.shape == wanted.shape
        assert _sqnr(wanted, got) > 25  # each sequence's own state, in the caller's order


class DataDependent(nn.Module):
    """A branch on the data: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.gate = nn.Linear(16, 16), nn.Linear(16, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) if x.sum() > 0 else self.gate(x)
        for layer in self.layers:
            y = torch.relu(layer(y))
        return y


class WithAnUntraceableBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block, self.head = DataDependent(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


@pytest.mark.parametrize("backend", backend_params())
def test_quantize_dynamic_quantizes_the_layers_of_a_block_that_does_not_trace(backend):
    """BERT's embeddings do not trace: quantize_dynamic raised TraceFailure, advising
    a prepare_custom_config it does not take, where torch.ao's quantize_dynamic
    swaps every linear (BERT: 12, 68.8 dB). The block stays a leaf; its own layers
    are quantized each on its own, as dynamic quantization needs no graph around."""
    from torch.ao.quantization import quantize_dynamic

    model = WithAnUntraceableBlock().eval()
    converted = qcore.quantize_dynamic(model, backend=backend)
    kernels = [
        type(m).__name__ for m in converted.modules() if type(m).__module__.startswith("qcore")
    ]
    assert len(kernels) == 5, kernels  # fc, gate, the two layers, head
    with quantized_engine(backend):
        theirs = quantize_dynamic(copy.deepcopy(model))
    for x in (torch.randn(8, 16) + 1, torch.randn(8, 16) - 1):  # both branches
        with torch.no_grad(), quantized_engine(backend):
            expected, peer = model(x), theirs(x)
        assert _sqnr(expected, converted(x)) >= _sqnr(expected, peer) - 0.5


class RecurrentInABranch(nn.Module):
    """A data-dependent branch around a recurrent layer (a packed-sequence encoder
    does not trace either)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2 if x.sum() > 0 else x
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


def _qcore_kernels(model: nn.Module) -> dict[str, str]:
    return {
        name: type(m).__name__
        for name, m in model.named_modules()
        if type(m).__module__.startswith("qcore.kernels")
    }


@pytest.mark.parametrize("layer_class", [nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell])
@pytest.mark.parametrize("backend", backend_params())
def test_recurrent_layers_in_a_block_that_does_not_trace_are_quantized(layer_class, backend):
    """An LSTM, GRU or cell in such a block stayed float (the block's Linears were
    swapped), and explain called the block "float: no QConfig": tracing the layer
    on its own fails in nn.LSTM's forward. torch.ao swaps it (about 41 dB)."""
    from torch.ao.quantization import quantize_dynamic

    torch.manual_seed(0)
    model = nn.Sequential(RecurrentInABranch(layer_class(8, 16)), nn.Linear(16, 4)).eval()
    x = torch.randn(5, 3, 8) if layer_class in (nn.LSTM, nn.GRU) else torch.randn(3, 8)
    converted = qcore.quantize_dynamic(model, backend=backend)
    kernel = "DynamicRNN" if layer_class in (nn.LSTM, nn.GRU) else "DynamicCell"
    assert _qcore_kernels(converted) == {"0.layer": kernel, "1": "DynamicLinear"}
    (entry,) = [e for e in qcore.explain(converted).entries if e.op == "RecurrentInABranch"]
    assert (
        entry.reason == "does not trace: kept as a leaf, its layers quantized on their own: layer"
    )
    with quantized_engine(backend):
        theirs = quantize_dynamic(copy.deepcopy(model))
    with torch.no_grad(), quantized_engine(backend):
        expected, peer = model(x), theirs(x)
    assert _sqnr(expected, converted(x)) >= _sqnr(expected, peer) - 0.5


@pytest.mark.parametrize(
    "names, swapped",
    [
        ({"head"}, {"head"}),
        ({"block.fc"}, {"block.fc"}),
        ({"block"}, {"block.fc", "block.gate", "block.layers.0", "block.layers.1"}),
        ({"block.layers"}, {"block.layers.0", "block.layers.1"}),
    ],
)
@pytest.mark.parametrize("backend", backend_params())
def test_module_names_reach_into_a_block_that_does_not_trace(names, swapped, backend):
    """Any module name in qconfig_spec raised TraceFailure as soon as a block did not
    trace, advising a prepare_custom_config quantize_dynamic does not take; torch.ao
    swaps exactly the named modules (and everything in a named block)."""
    from torch.ao.quantization import quantize_dynamic

    model = WithAnUntraceableBlock().eval()
    with quantized_engine(backend):
        theirs = quantize_dynamic(copy.deepcopy(model), names)
    theirs_swapped = {
        name for name, m in theirs.named_modules() if "quantized.dynamic" in type(m).__module__
    }
    assert theirs_swapped == swapped
    converted = qcore.quantize_dynamic(model, names, backend=backend)
    ours = {name.removesuffix(".linear_linear") for name in _qcore_kernels(converted)}
    assert ours == swapped


class PacksItsInput(nn.Module):
    """Packs padded sequences in its own forward: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.fc = nn.LSTM(8, 16), nn.Linear(16, 4)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        output, _ = self.rnn(packed)
        return self.fc(nn.utils.rnn.pad_packed_sequence(output)[0])


@pytest.mark.parametrize("backend", backend_params())
def test_a_model_whose_own_forward_does_not_trace_gets_its_layers_swapped(backend, tmp_path):
    """It raised "symbolic tracing failed: TypeError: `__cuda_array_interface__` must
    be a dict", naming no module; torch.ao's quantize_dynamic swaps its layers."""
    from torch.ao.quantization import quantize_dynamic

    model = PacksItsInput().eval()
    x, lengths = torch.randn(6, 3, 8), torch.tensor([2, 6, 4])
    converted = qcore.quantize_dynamic(model, backend=backend)
    assert type(converted) is PacksItsInput and type(model.rnn) is nn.LSTM  # a copy
    assert {n: type(m).__name__ for n, m in converted.named_children()} == {
        "rnn": "DynamicRNN",
        "fc": "GraphModule",
    }
    (entry,) = qcore.explain(converted).entries
    assert entry.reason.startswith("its layers quantized on their own: rnn, fc; its forward")
    with quantized_engine(backend):
        theirs = quantize_dynamic(copy.deepcopy(model))
    with torch.no_grad(), quantized_engine(backend):
        expected, peer = model(x, lengths), theirs(x, lengths)
    assert _sqnr(expected, converted(x, lengths)) >= _sqnr(expected, peer) - 0.5

    qcore.save(converted, tmp_path / "model.qcore", allow=[PacksItsInput])
    loaded = qcore.load(tmp_path / "model.qcore", allow=[PacksItsInput])
    assert torch.equal(loaded(x, lengths), converted(x, lengths))
    assert qcore.explain(loaded).entries == [entry]


@pytest.mark.parametrize("backend", backend_params())
def test_a_bare_lstm_is_swapped_as_torch_ao_swaps_it(backend):
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16)
    converted = qcore.quantize_dynamic(lstm, backend=backend)
    assert type(converted).__name__ == "DynamicRNN"
    assert [e.status.value for e in qcore.explain(converted).entries] == ["quantized"]
    x = torch.randn(5, 3, 8)
    assert _sqnr(lstm(x)[0], converted(x)[0]) > 30


class BranchesOnData(nn.Module):
    """No children, a forward torch.fx cannot trace, and no layer type to swap."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.weight if x.sum() > 0 else x


def test_a_childless_module_that_does_not_trace_stays_float():
    model = nn.Sequential(BranchesOnData(), nn.Linear(4, 4)).eval()
    converted = qcore.quantize_dynamic(model, backend="native")
    x = torch.randn(2, 4)
    assert any(type(m) is BranchesOnData for m in converted.modules())
    assert _sqnr(model(x), converted(x)) > 30
    alone = qcore.quantize_dynamic(BranchesOnData(), backend="native")
    assert type(alone) is BranchesOnData
    assert "its layers quantized on their own: none" in qcore.explain(alone).entries[0].reason
