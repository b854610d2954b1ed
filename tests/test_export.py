"""The torch.export route (issue 16 §1): a PT2E model in reference form (the standard
``quantized_decomposed`` ops) is exported with torch.export, saved with
``torch.export.save``, loaded back, and gives the reference form's outputs bit for
bit, at the batch it was exported with and at another.

torch.export.load unpickles parts of the archive (weights_only=False on torch 2.13):
load only files you trust (docs/reliability.md, docs/deploy.md).
"""

import io
import warnings

import pytest
import torch
from backends import FIRST_PARTY, backend_params, installed
from export_cases import QUANTIZES, export_free_batch, reference_case
from torch.utils._pytree import tree_leaves

from qcore.examples import ZOO


def _quantize_ops(graph) -> list[str]:
    return sorted(
        str(n.target) for n in graph.nodes if n.op == "call_function" and n.target in QUANTIZES
    )


def _load(program) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    with warnings.catch_warnings():
        # torch 2.13 warns unpickling the pytree specs of its own exported modules.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return torch.export.load(buffer)


def _run(module, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return tree_leaves(module(*inputs))


@pytest.mark.parametrize("backend", backend_params((*FIRST_PARTY, "onednn")))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_pt2e_reference_form_exports_saves_and_reloads(name, backend):
    case = reference_case(name, backend)
    quantizes = _quantize_ops(case.reference.graph)
    assert quantizes, f"{name} on {backend}: nothing quantized, nothing to export"
    loaded = _load(export_free_batch(case.reference, case.inputs))
    # every quantize op is still there, as the standard op (what ExecuTorch's
    # and ONNX's exporters read), none lowered or decomposed away
    assert _quantize_ops(loaded.graph) == quantizes
    smaller = tuple(t[:3] for t in case.inputs)  # the batch stays free after the round trip
    for inputs in (case.inputs, smaller):
        expected, actual = _run(case.reference, inputs), _run(loaded.module(), inputs)
        for a, e in zip(actual, expected, strict=True):
            assert a.shape == e.shape
            assert torch.equal(a, e), (name, backend, (a - e).abs().max().item())


def test_the_documented_lines_load_a_pt2_in_a_new_process(tmp_path):
    """docs/deploy.md: a new process needs torch's quantized_decomposed ops
    registered before torch.export.load reads the graph."""
    import subprocess
    import sys

    backend = next((name for name in (*FIRST_PARTY, "onednn") if installed(name)), None)
    if backend is None:
        pytest.skip("needs a backend whose PT2E reference form exports")
    case = reference_case("mlp", backend)
    torch.export.save(export_free_batch(case.reference, case.inputs), tmp_path / "model.pt2")
    torch.save((case.inputs, _run(case.reference, case.inputs)), tmp_path / "io.pt")
    code = f"""
import torch, warnings
warnings.simplefilter("ignore", FutureWarning)
import torch.ao.quantization.fx._decomposed  # noqa: F401  registers quantized_decomposed
program = torch.export.load({str(tmp_path / "model.pt2")!r})
inputs, expected = torch.load({str(tmp_path / "io.pt")!r})
with torch.no_grad():
    actual = program.module()(*inputs)
actual = actual if isinstance(actual, (list, tuple)) else [actual]
assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
