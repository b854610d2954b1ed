"""Written for a plugin API this qcore does not implement."""

from qcore import hookimpl

QCORE_PLUGIN_API_VERSION = 0


@hookimpl
def qcore_backend_pattern_configs(backend):
    return []
