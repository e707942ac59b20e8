"""Shared test helpers (import as ``from helpers import ...``; tests/ is on sys.path under pytest)."""
from conftest import assert_close, rel_error  # noqa: F401
