"""The benchmark suite: DESIGN.md's workloads and end-to-end LLMs, every mode side by side.

``workloads`` (the table), ``llm`` (transformers models, random weights), ``models`` (Hugging Face models from
their configs), ``harness`` (the measurement method), ``report`` (JSON, markdown, plot), ``cli``
(``python -m torch_mirage bench``). Here: picking entries of those tables by name, and whether ``transformers``
(the ``bench`` extra) is there.
"""
from __future__ import annotations

from typing import Mapping, Sequence, TypeVar

T = TypeVar("T")


def select(table: Mapping[str, T], names: Sequence[str] | None, what: str) -> list[T]:
    """The entries of ``table`` that ``names`` name, in that order (every entry for no names); an unknown name
    raises ValueError naming the known ones."""
    if not names:
        return list(table.values())
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(table)}")
    return [table[n] for n in names]


def has_transformers() -> bool:
    """Whether ``transformers`` imports: the LLM and Hugging Face model benches need it."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
