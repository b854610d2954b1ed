"""qcore-tutorialchip: the BackendConfig tutorial's backend as a qcore plugin.

The chip quantizes linear layers and fused conv-relu only, with quint8
activations whose scale is at least 2**-12, and runs them on its own integer
kernels (``qcore_tutorialchip.kernels``).
"""

__version__ = "0.1.0"
