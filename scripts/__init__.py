"""The repository's scripts; `scripts.benchmarks` is the performance benchmark (`python -m scripts.benchmarks`)."""
