"""qcore's conformance suite on the x86 backend, as every backend author runs it."""

from qcore.conformance import BackendConformance


class TestX86Conformance(BackendConformance):
    backend = "x86"
