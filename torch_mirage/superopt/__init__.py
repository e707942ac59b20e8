"""Superoptimizer: μGraphs, equivalence verifier, search."""
from .verify import Verdict, verify  # noqa: F401  (the module imports only torch and the field code)
