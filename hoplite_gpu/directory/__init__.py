"""The object directory: a pure state machine (:mod:`.state`, with its parts: see its docstring),
its settings (:class:`DirectoryConfig`), its asyncio host (:mod:`.service`), and a standalone
directory in a child process (:mod:`.process`)."""

from __future__ import annotations

from .config import DirectoryConfig
from .process import DirectoryProcess
from .service import DirectoryService
from .state import DirectoryState

__all__ = ["DirectoryConfig", "DirectoryProcess", "DirectoryService", "DirectoryState"]
