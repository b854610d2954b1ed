"""A vacuous qcore backend: see plugin.py."""
