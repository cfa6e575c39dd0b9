"""Benchmarks of the trainer and of plain Paddle loops; run from the repository root: python -m scripts.NAME."""
