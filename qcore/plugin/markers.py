"""The pluggy markers and the plugin-API version, importable without side effects."""

from __future__ import annotations

import pluggy

PROJECT_NAME = "qcore"

PLUGIN_API_VERSION = 1
"""The plugin API this qcore implements.

A plugin module declares the version it was written for as the module-level
attribute ``QCORE_PLUGIN_API_VERSION``; qcore refuses a plugin whose version
differs, naming the plugin and both versions.
"""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
