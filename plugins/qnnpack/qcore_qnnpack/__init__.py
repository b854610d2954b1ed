"""qcore's ``qnnpack`` backend plugin.

Kept light: qcore finds the plugin through the ``qcore.backends`` entry point
and imports :mod:`qcore_qnnpack.plugin` only when the ``qnnpack`` backend is asked for.
"""

__version__ = "0.1.0"
