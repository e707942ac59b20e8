"""Reference models and helpers for tests, the demo and benchmarks."""
