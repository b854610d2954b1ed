"""qcore's conformance suite on the fbgemm backend, as every backend author runs it."""

from qcore.conformance import BackendConformance


class TestFbgemmConformance(BackendConformance):
    backend = "fbgemm"
