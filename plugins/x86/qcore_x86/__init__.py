"""qcore's ``x86`` backend plugin.

Kept light: qcore finds the plugin through the ``qcore.backends`` entry point
and imports :mod:`qcore_x86.plugin` only when the ``x86`` backend is asked for.
"""

__version__ = "0.1.0"
