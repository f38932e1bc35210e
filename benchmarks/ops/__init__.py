"""Benchmarks of one operator or kernel family (attention, linear attention, LM head, gathers, ...)."""
