"""Benchmarks of a training step's stages: compaction, planning, operator counts, several GPUs, engine and server."""
