"""The model zoo for tests and benchmarks: qcore's bundled example models
(qcore.examples) plus, in baseline.py, torch.ao's FX flow as the peer.

    from zoo import ZOO            # with tests/ on sys.path, as under pytest
"""

from __future__ import annotations

from qcore.examples import CALIBRATION_SEED, EVAL_SEED, MODEL_SEED, ZOO, ZooEntry

__all__ = ["ZOO", "ZooEntry", "MODEL_SEED", "CALIBRATION_SEED", "EVAL_SEED", "calibrated"]


def calibrated(name: str, path: str, backend: str) -> tuple:
    """(the zoo model ``name`` prepared on ``path`` ("fx" or "pt2e") for ``backend`` and
    calibrated on its example inputs, those inputs)."""
    import torch

    import qcore

    entry = ZOO[name]
    model, example = entry.make_model().eval(), entry.example_inputs()
    if path == "fx":
        prepared = qcore.prepare_fx(model, None, example, backend=backend)
    else:
        prepared = qcore.prepare_pt2e(torch.export.export(model, example).module(), backend)
    with torch.no_grad():
        prepared(*example)
    return prepared, example
