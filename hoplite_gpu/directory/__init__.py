"""The object directory: a pure state machine (:mod:`.state`) and its asyncio host (:mod:`.service`)."""

from __future__ import annotations

from .service import DirectoryService
from .state import DirectoryState

__all__ = ["DirectoryService", "DirectoryState"]
