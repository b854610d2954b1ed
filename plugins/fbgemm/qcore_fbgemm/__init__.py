"""qcore's ``fbgemm`` backend plugin.

Kept light: qcore finds the plugin through the ``qcore.backends`` entry point
and imports :mod:`qcore_fbgemm.plugin` only when the ``fbgemm`` backend is asked for.
"""

__version__ = "0.1.0"
