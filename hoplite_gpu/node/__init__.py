"""The node side: one process's view of the object store.

:class:`Node` (:mod:`.node`) is what users call, and wires the parts together: the directory link
(:mod:`.session` over :mod:`.control`), the get side (:mod:`.fetch`, which fills a copy from one of
the :mod:`.sources` the directory's reply names), the put side (:mod:`.puts`), reduce-tree vertices
(:mod:`.vertex`) and the checks of its arguments (:mod:`.arguments`). Beside its object API, its
methods come in parts: watched groups (:mod:`.watches`), what libraries built on the node use
(:mod:`.primitives`), diagnostics (:mod:`.diagnostics`) and what the directory pushes
(:mod:`.pushes`). Where bytes live is the memory package's (:mod:`hoplite_gpu.memory`); how they
cross hosts, the data plane's (:mod:`hoplite_gpu.dataplane`).
"""

from __future__ import annotations

from ..iothread import IOThread
from .node import Node
from .watches import Agreement

__all__ = ["Agreement", "IOThread", "Node"]
