"""Inductor's compile of part of a graph (a region to time, the fallback partitions) without its spurious warning.

``standalone_compile`` — which ``regional_inductor`` and region timing both go through — ends by trying to save
cache artifacts and logs ``standalone_compile artifact generation failed, cannot save`` when there are none to
save. Mirage never saves them, so the warning says nothing to a user; it is filtered out while we compile, and
every other Inductor message passes.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

_LOGGER = "torch._inductor.standalone_compile"
_MESSAGE = "standalone_compile artifact generation failed"


class _DropArtifactWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_MESSAGE)


@contextlib.contextmanager
def without_artifact_warning() -> Iterator[None]:
    logger, drop = logging.getLogger(_LOGGER), _DropArtifactWarning()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
