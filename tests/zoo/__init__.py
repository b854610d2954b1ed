"""A zoo of small, structurally faithful models for qcore's tests and benchmarks.

    from zoo import ZOO            # with tests/ on sys.path, as under pytest
    entry = ZOO["resnet18_like"]
    model = entry.make_model()     # eval mode, deterministic weights
    calibration = entry.calibration_data(8)

Every model is symbolically traceable with torch.fx.symbolic_trace and small enough that a
prepare + calibrate + convert takes well under a second or two on 2 CPU cores.
tests/zoo/baseline.py quantizes them with torch.ao's FX flow, the peer qcore is measured against.
"""

from __future__ import annotations

from . import lstm, mlp, mobilenet, resnet, transformer
from ._common import CALIBRATION_SEED, EVAL_SEED, MODEL_SEED, ZooEntry

ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (resnet.ENTRY, mobilenet.ENTRY, mlp.ENTRY, transformer.ENTRY, lstm.ENTRY)
}

__all__ = ["ZOO", "ZooEntry", "MODEL_SEED", "CALIBRATION_SEED", "EVAL_SEED"]
