"""Fails at import, like a plugin whose own dependency is missing."""

import qcore_broken_missing_dependency  # noqa: F401
