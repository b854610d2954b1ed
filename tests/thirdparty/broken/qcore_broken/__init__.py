"""Plugins that fail in each way a real one can."""
