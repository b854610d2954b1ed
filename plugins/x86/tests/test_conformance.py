"""qcore's conformance suite on the x86 plugin's backends (x86, onednn), as every
backend author runs it."""

from qcore.conformance import BackendConformance


class TestX86Conformance(BackendConformance):
    backend = "x86"


class TestOnednnConformance(BackendConformance):
    backend = "onednn"
