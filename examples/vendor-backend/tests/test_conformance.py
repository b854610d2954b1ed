"""qcore's conformance suite on tutorialchip: the whole test file a vendor needs."""

from qcore.conformance import BackendConformance


class TestTutorialChipConformance(BackendConformance):
    backend = "tutorialchip"
