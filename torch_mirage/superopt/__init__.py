"""Superoptimizer: μGraphs, equivalence verifier, search."""
