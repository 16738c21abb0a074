"""The object directory: a pure state machine (:mod:`.state`), its asyncio host (:mod:`.service`), and
a standalone directory in a child process (:mod:`.process`)."""

from __future__ import annotations

from .process import DirectoryProcess
from .service import DirectoryService
from .state import DirectoryState

__all__ = ["DirectoryProcess", "DirectoryService", "DirectoryState"]
