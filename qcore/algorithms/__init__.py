"""Post-training algorithms that run on a prepared model, FX or PT2E, for any backend.

``equalize``: cross-layer equalization (before calibration).
``correct_bias``: fast bias correction (after calibration).
``smooth_quant``: SmoothQuant for linear layers (before calibration).
``adaround``: AdaRound, learned weight rounding (after calibration).
"""

from qcore.algorithms.adaround import AdaroundedLayer, adaround, adarounded_layers
from qcore.algorithms.bias_correction import CorrectedBias, correct_bias, corrected_biases
from qcore.algorithms.equalize import EqualizedPair, equalize, equalized_pairs
from qcore.algorithms.smoothquant import SmoothedLayers, smooth_quant, smoothed_layers

__all__ = [
    "AdaroundedLayer",
    "CorrectedBias",
    "EqualizedPair",
    "SmoothedLayers",
    "adaround",
    "adarounded_layers",
    "correct_bias",
    "corrected_biases",
    "equalize",
    "equalized_pairs",
    "smooth_quant",
    "smoothed_layers",
]
