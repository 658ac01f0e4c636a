"""Test support shipped with the package: the multi-rank harness and the sequence-length catalogue."""
