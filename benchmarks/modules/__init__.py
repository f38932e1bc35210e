"""Benchmarks of one layer (MoE) or of the whole model against another implementation of it."""
