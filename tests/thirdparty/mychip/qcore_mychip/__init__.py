"""qcore-mychip: the tutorial's backend (quantized linear and conv-relu), packaged."""
