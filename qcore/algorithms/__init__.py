"""Post-training algorithms that run on a prepared model, FX or PT2E, for any backend.

``equalize``: cross-layer equalization (before calibration).
``correct_bias``: fast bias correction (after calibration).
"""

from qcore.algorithms.bias_correction import CorrectedBias, correct_bias, corrected_biases
from qcore.algorithms.equalize import EqualizedPair, equalize, equalized_pairs

__all__ = [
    "CorrectedBias",
    "EqualizedPair",
    "correct_bias",
    "corrected_biases",
    "equalize",
    "equalized_pairs",
]
