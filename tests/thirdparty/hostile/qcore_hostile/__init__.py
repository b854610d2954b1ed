"""Plugins that misbehave on demand; tests/test_hostile_plugins.py installs them."""
