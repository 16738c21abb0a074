"""The backend's name, which its registration (:mod:`.plugin`) and its process groups
(:mod:`.backend`) share."""

from __future__ import annotations

#: The backend's name for ``init_process_group``, ``new_group`` and ``TorchConfig(backend=)``.
BACKEND = "hoplite"
