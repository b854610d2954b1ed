"""qcore's conformance suite on the qnnpack backend, as every backend author runs it."""

from qcore.conformance import BackendConformance


class TestQnnpackConformance(BackendConformance):
    backend = "qnnpack"
