"""Imports fine, raises when asked for its patterns."""

from qcore import hookimpl

QCORE_PLUGIN_API_VERSION = 1


@hookimpl
def qcore_backend_pattern_configs(backend):
    raise RuntimeError("vendor SDK not initialised")
