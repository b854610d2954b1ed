"""The model zoo for tests and benchmarks: qcore's bundled example models
(qcore.examples) plus, in baseline.py, torch.ao's FX flow as the peer.

    from zoo import ZOO            # with tests/ on sys.path, as under pytest
"""

from __future__ import annotations

from qcore.examples import CALIBRATION_SEED, EVAL_SEED, MODEL_SEED, ZOO, ZooEntry

__all__ = ["ZOO", "ZooEntry", "MODEL_SEED", "CALIBRATION_SEED", "EVAL_SEED"]
