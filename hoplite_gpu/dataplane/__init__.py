"""The data plane: how an object's bytes cross from one node to another, over UCX.

:class:`DataPlane` (:mod:`.transport`) serves pulls of local objects and pulls from peers;
:mod:`.ucx` starts ``ucxx`` with the measured defaults and turns every UCX failure into a typed
error. Nothing else in the package talks to ``ucxx``.
"""

from __future__ import annotations

from .transport import DataPlane

__all__ = ["DataPlane"]
