"""Post-training algorithms that run on a prepared model, FX or PT2E, for any backend.

``equalize``: cross-layer equalization (before calibration).
``correct_bias``: fast bias correction (after calibration).
``smooth_quant``: SmoothQuant for linear layers (before calibration).
``adaround``: AdaRound, learned weight rounding (after calibration).

``ALGORITHMS`` names them for ``qcore.quantize(..., algorithms=...)``, with their
stage; a backend recommends some through the ``qcore_recommended_algorithms`` hook
(``recommended_algorithms(backend)``); ``applied_algorithms(model)`` lists what ran.
"""

from qcore.algorithms.adaround import AdaroundedLayer, adaround, adarounded_layers
from qcore.algorithms.bias_correction import CorrectedBias, correct_bias, corrected_biases
from qcore.algorithms.equalize import EqualizedPair, equalize, equalized_pairs
from qcore.algorithms.recipes import (
    AFTER_CALIBRATION,
    ALGORITHMS,
    BEFORE_CALIBRATION,
    Algorithm,
    AppliedAlgorithm,
    applied_algorithms,
    recommended_algorithms,
)
from qcore.algorithms.smoothquant import SmoothedLayers, smooth_quant, smoothed_layers

__all__ = [
    "AFTER_CALIBRATION",
    "ALGORITHMS",
    "BEFORE_CALIBRATION",
    "AdaroundedLayer",
    "Algorithm",
    "AppliedAlgorithm",
    "CorrectedBias",
    "EqualizedPair",
    "SmoothedLayers",
    "adaround",
    "adarounded_layers",
    "applied_algorithms",
    "correct_bias",
    "corrected_biases",
    "equalize",
    "equalized_pairs",
    "recommended_algorithms",
    "smooth_quant",
    "smoothed_layers",
]
