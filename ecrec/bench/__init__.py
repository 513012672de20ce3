"""Benchmarks behind the ``ecrec-bench`` command (one module per sub-command)."""
