"""A quantize -> dequantize pair that feeds a float op (one left in reference form, as
fbgemm's group_norm after a float layer) runs on torch's quantized tensors once
lowered: the same numbers as the reference form, without qcore.ops' float64 passes
(BiT's FX model has one, after its float stem)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backends import backend_params
from torch import nn
from torch.ao.quantization import MinMaxObserver, QConfig, default_weight_observer

import qcore
from qcore import ops

torch.manual_seed(0)


class _FloatStemThenGroupNorm(nn.Module):
    """BiT's shape: a float stem, then group_norm written as a function (fbgemm's
    config quantizes its input and output; no kernel takes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.norm = nn.GroupNorm(2, 8)
        nn.init.uniform_(self.norm.weight, 0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.group_norm(self.stem(x), 2, self.norm.weight, self.norm.bias)
        return y * 3.0


def _qcore_ops_calls(model: torch.fx.GraphModule) -> list[str]:
    return [
        node.name
        for node in model.graph.nodes
        if node.op == "call_function"
        and node.target in (ops.quantize_per_tensor, ops.dequantize_per_tensor)
    ]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("reduce_range", [False, True])
def test_a_float_ops_round_trip_runs_in_torch_with_the_reference_numbers(backend, reduce_range):
    model = _FloatStemThenGroupNorm().eval()
    mapping = qcore.get_default_qconfig_mapping(backend).set_module_name("stem", None)
    if reduce_range:  # a 7-bit range: the lowered quantize clamps first
        seven_bits = QConfig(
            activation=MinMaxObserver.with_args(quant_min=0, quant_max=127),
            weight=default_weight_observer,
        )
        mapping.set_object_type(F.group_norm, seven_bits)
    batches = [(torch.randn(2, 3, 8, 8) * 3,) for _ in range(4)]
    prepared = qcore.prepare_fx(model, mapping, batches[0], backend=backend)
    for batch in batches:
        prepared(*batch)
    reference = qcore.convert_to_reference_fx(prepared)
    lowered = qcore.convert_fx(prepared)

    assert _qcore_ops_calls(lowered) == []
    with torch.no_grad():
        for batch in (*batches, (torch.randn(2, 3, 8, 8) * 10,)):
            assert torch.equal(lowered(*batch), reference(*batch))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", ["mobilenetv2_like", "resnet18_like", "transformer_block"])
def test_a_lowered_models_state_dict_holds_only_buffers_its_graph_reads(backend, name):
    """Every qparams buffer lowering adds is read by the converted graph: the pass
    above once registered a pair for each dequantize dead-code elimination then
    removed (mobilenetv2_like on fbgemm saved 282 state_dict entries, 102 unread)."""
    from qcore.examples import ZOO

    entry = ZOO[name]
    prepared = qcore.prepare_fx(entry.make_model(), None, entry.example_inputs(), backend)
    with torch.no_grad():
        for batch in entry.calibration_data(2):
            prepared(*batch)
    lowered = qcore.convert_fx(prepared)
    read = {node.target for node in lowered.graph.nodes if node.op == "get_attr"}
    own = [name for name, _ in lowered.named_buffers(recurse=False)]
    assert own, "the lowered model keeps its qparams in buffers"
    assert [name for name in own if name not in read] == []
