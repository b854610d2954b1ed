"""qcore-acme: a vendor backend whose choices must not leak into "native"."""
