"""Post-training algorithms that run on a prepared model, FX or PT2E, for any backend.

``equalize``: cross-layer equalization (before calibration).
"""

from qcore.algorithms.equalize import EqualizedPair, equalize, equalized_pairs

__all__ = ["EqualizedPair", "equalize", "equalized_pairs"]
