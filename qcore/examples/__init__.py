"""The example models qcore ships: what `qcore demo` and the conformance suite run.

Small, structurally faithful models written for qcore (no torchvision), each
with deterministic weights and data::

    >>> from qcore.examples import ZOO
    >>> entry = ZOO["resnet18_like"]
    >>> model, calibration = entry.make_model(), entry.calibration_data(8)

Every model is symbolically traceable and quantizes in about a second on two
CPU cores.
"""

from __future__ import annotations

from qcore.examples import lstm, mlp, mobilenet, resnet, transformer
from qcore.examples._common import (
    CALIBRATION_SEED,
    EVAL_SEED,
    MODEL_SEED,
    ZooEntry,
    export_batch_free,
)

ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (resnet.ENTRY, mobilenet.ENTRY, mlp.ENTRY, transformer.ENTRY, lstm.ENTRY)
}

__all__ = ["CALIBRATION_SEED", "EVAL_SEED", "MODEL_SEED", "ZOO", "ZooEntry", "export_batch_free"]
