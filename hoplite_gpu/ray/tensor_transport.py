"""hoplite_gpu as a Ray Direct Transport: actors' torch tensors move through hoplite's store instead
of Ray's object store. The transport (:class:`HopliteTensorTransport`) and its metadata live here;
it imports Ray, so :func:`hoplite_gpu.ray.register_tensor_transport` imports it on first use.

Register it in the driver before creating the actors that use it (Ray hands it to every actor
created afterwards), then name it on the methods whose tensors it carries::

    import hoplite_gpu.ray as hgray
    hgray.start_directory()
    hgray.register_tensor_transport()          # "HOPLITE"

    @ray.remote
    class Learner:
        @ray.method(tensor_transport="HOPLITE")
        def weights(self):
            return self.model_weights          # a torch tensor (or a list / dict of them)

    @ray.remote(enable_tensor_transport=True)  # receives tensors, returns none through a transport
    class Worker:
        def rollout(self, weights):
            ...

    ref = learner.weights.remote()
    ray.get([w.rollout.remote(ref) for w in workers])   # each worker receives the tensor
    ray.get(ref)                                         # the driver too

Two things Ray asks of every user of a custom transport. The decorators check the transport's
name when the class is defined, so a module that defines such actors and is imported by Ray's worker
processes must register it at import (the call is idempotent); this is also what makes an actor
that Ray restarted after a crash usable, since Ray 2.60 registers a custom transport on an actor
only when it is first created. Keep such classes in an importable module: a class defined in
``__main__`` travels to the workers by value and its restarted process never registers.
And an actor that receives tensors but has no method returning them through a transport needs
``enable_tensor_transport=True``: without it, the receive is queued behind the very task that waits
for it and the task fails after Ray's fetch timeout (ray-project/ray#66264).

How it works. The transport is one-sided: when the method returns, the source actor ``put``s each
tensor into its hoplite node under an ObjectID derived from Ray's object id, without copying it
(:meth:`HopliteTensorTransport.extract_tensor_transport_metadata`); the metadata Ray keeps carries
those ObjectIDs. Each receiver ``get``s them through hoplite (:meth:`recv_multiple_tensors`), so
many receivers of one tensor (a learner's weights going to every rollout worker) pull from each
other in hoplite's pipelined broadcast tree rather than each from the source, and a receiver that
dies mid-transfer costs the others only a repair of the tree. When Ray frees the object, the source
deletes its hoplite objects everywhere (:meth:`garbage_collect`). A transfer that cannot finish
raises within its timeout an error naming the object and its holder, and Ray's abort (it calls
:meth:`abort_transport` when a transfer failed or outlived ``RAY_rdt_fetch_fail_timeout_milliseconds``)
cancels a receive in progress.

As with Ray's other one-sided transports (NIXL, CUDA IPC), the tensors are shared, not copied: do not
modify a tensor after returning it until Ray freed the object
(``ray.experimental.wait_tensor_freed``), or readers may see the new bytes. CPU tensors move as they
are; CUDA tensors are staged through host memory until hoplite keeps objects on the device, and
arrive on the receiver's current CUDA device.

Needs Ray >= 2.60 and torch; :func:`hoplite_gpu.ray.register_tensor_transport` is the entry point.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

from ..errors import HopliteError, HopliteTimeoutError, InvalidArgumentError, TransportError
from ..iothread import IOThread
from ..object_id import ObjectID
from .common import as_buffer
from .directory import node as _node

log = logging.getLogger("hoplite_gpu")

#: The transport's name in ``@ray.method(tensor_transport=...)``.
TRANSPORT = "HOPLITE"
#: Devices it carries tensors of.
DEVICES = ["cpu", "cuda"]

#: Seconds a receive waits for all of an object's tensors (set by ``register_tensor_transport``
#: in the process that registers it, which is where Ray asks for the communicator metadata).
_timeout = 60.0


def set_timeout(seconds: float) -> None:
    """Set the receive timeout of the transfers this process starts (see
    :func:`hoplite_gpu.ray.register_tensor_transport`)."""
    global _timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise InvalidArgumentError(
            f"timeout must be a number of seconds > 0, got {seconds!r}", argument="timeout"
        )
    _timeout = float(seconds)


@dataclass
class HopliteCommunicatorMetadata(CommunicatorMetadata):
    """What a receiver needs beyond the tensors' metadata: how long it may wait."""

    timeout: float = 60.0


@dataclass
class HopliteTransportMetadata(TensorTransportMetadata):
    """The tensors' shapes, dtypes and device (Ray's fields), and where hoplite has them.

    Attributes:
        object_ids: Hex ObjectID of each tensor, in order.
        holder: Data-plane address of the node that put them (named in errors).
    """

    object_ids: list[str] = field(default_factory=list)
    holder: str = ""


def object_id_for(ray_object_id: str, index: int) -> ObjectID:
    """The hoplite ObjectID of tensor ``index`` of Ray's RDT object ``ray_object_id``
    (deterministic, so a retried task that stores the same tensors again is idempotent)."""
    return ObjectID.from_name(f"ray-rdt/{ray_object_id}/{index}")


def _torch() -> Any:
    import torch

    return torch


class HopliteTensorTransport(TensorTransportManager):  # type: ignore[misc]
    """The ``"HOPLITE"`` tensor transport (see the module docstring). Ray makes one per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._receiving: dict[str, concurrent.futures.Future[list[Any]]] = {}
        self._aborted: set[str] = set()

    def tensor_transport_backend(self) -> str:
        """``"HOPLITE"``."""
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        """True: receivers pull; the source takes no part in a transfer."""
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        """True: :meth:`abort_transport` cancels a receive in progress."""
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        """True: every process with hoplite_gpu installed can use it (checked without blocking,
        as Ray asks before submitting each task)."""
        return True

    # ------------------------------------------------------------ source side
    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> HopliteTransportMetadata:
        """Put each tensor of Ray's object ``obj_id`` into this process's hoplite node (sharing
        its memory) and return the metadata that locates them."""
        torch = _torch()
        node = _node()
        meta: list[tuple[Any, Any]] = []
        ids: list[str] = []
        device: str | None = None
        for index, tensor in enumerate(rdt_object):
            if not isinstance(tensor, torch.Tensor):
                raise InvalidArgumentError(
                    f"the HOPLITE transport carries torch tensors, got {type(tensor).__name__}",
                    argument="rdt_object",
                )
            if device is None:
                device = tensor.device.type
            elif tensor.device.type != device:
                raise InvalidArgumentError(
                    f"all tensors of one RDT object must be on one device type, got {device} and "
                    f"{tensor.device.type}",
                    argument="rdt_object",
                )
            buf, _ = as_buffer(tensor, write=False)  # a view where it can (a copy if not contiguous)
            oid = object_id_for(obj_id, index)
            node.put(buf, oid, copy=False)
            meta.append((tensor.shape, tensor.dtype))
            ids.append(oid.hex())
        return HopliteTransportMetadata(
            tensor_meta=meta, tensor_device=device, object_ids=ids, holder=node.data_address
        )

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: list[Any]
    ) -> None:
        """Ray freed the object: delete its tensors from hoplite everywhere (the source owns them)."""
        if not isinstance(tensor_transport_meta, HopliteTransportMetadata):
            return
        node = _node()
        for hex_id in tensor_transport_meta.object_ids:
            try:
                node.delete(ObjectID.from_hex(hex_id))
            except HopliteError as exc:
                log.warning("could not delete %s of Ray object %s: %s", hex_id, obj_id, exc)

    def send_multiple_tensors(
        self,
        tensors: list[Any],
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
    ) -> None:
        """Not used: the transport is one-sided."""
        raise NotImplementedError("the HOPLITE transport is one-sided: receivers pull, nothing is sent")

    # ------------------------------------------------------------ receiver side
    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> HopliteCommunicatorMetadata:
        """The receive timeout set in this process (the one that starts the transfer)."""
        return HopliteCommunicatorMetadata(timeout=_timeout)

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        """Fetch the tensors of Ray's object ``obj_id`` through hoplite, all at once, into
        ``target_buffers`` when given (else into new tensors on the object's device type).

        Raises:
            HopliteTimeoutError: not all of them arrived within the communicator's timeout (the
                error names the object and the node that put it).
            TransportError: Ray aborted the transfer, or every source of a tensor was lost.
        """
        meta = tensor_transport_metadata
        if not isinstance(meta, HopliteTransportMetadata):
            raise InvalidArgumentError(
                f"expected HOPLITE transport metadata, got {type(meta).__name__}",
                argument="tensor_transport_metadata",
            )
        timeout = getattr(communicator_metadata, "timeout", _timeout)
        tensors = self._buffers(meta, target_buffers)
        if not tensors:
            return []
        views = [as_buffer(t) for t in tensors]
        node = _node()
        oids = [ObjectID.from_hex(h) for h in meta.object_ids]

        async def fetch_all() -> list[Any]:
            return list(
                await asyncio.gather(
                    *(
                        node.get_async(oid, timeout, out=buf)
                        for oid, (buf, _) in zip(oids, views, strict=True)
                    )
                )
            )

        with self._lock:
            if obj_id in self._aborted:
                self._aborted.discard(obj_id)
                raise self._abort_error(obj_id, meta)
            future = IOThread.get().submit(fetch_all())
            self._receiving[obj_id] = future
        try:
            # The gets time out on their own; the margin only covers their last step.
            future.result(timeout + 5.0)
        except concurrent.futures.CancelledError:
            raise self._abort_error(obj_id, meta) from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise self._timeout_error(obj_id, meta, timeout) from None
        except HopliteTimeoutError:
            raise self._timeout_error(obj_id, meta, timeout) from None
        except HopliteError as exc:
            raise type(exc)(
                f"receiving Ray object {obj_id} (put by the node at {meta.holder}) failed: {exc}",
                **exc.fields,
            ) from exc
        finally:
            with self._lock:
                self._receiving.pop(obj_id, None)
        for _, back in views:
            if back is not None:
                back()
        return tensors

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        """Cancel the receive of ``obj_id`` in progress here (or the next one, if it has not started:
        Ray may abort before this process's receive began)."""
        with self._lock:
            future = self._receiving.get(obj_id)
            if future is None:
                self._aborted.add(obj_id)
                return
        future.cancel()

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _buffers(meta: HopliteTransportMetadata, target_buffers: list[Any] | None) -> list[Any]:
        if len(meta.object_ids) != len(meta.tensor_meta):
            raise InvalidArgumentError(
                f"metadata lists {len(meta.tensor_meta)} tensors but {len(meta.object_ids)} ObjectIDs",
                argument="tensor_transport_metadata",
            )
        if target_buffers:
            if len(target_buffers) != len(meta.tensor_meta):
                raise InvalidArgumentError(
                    f"{len(target_buffers)} target buffers for {len(meta.tensor_meta)} tensors",
                    argument="target_buffers",
                )
            return list(target_buffers)
        torch = _torch()
        device = "cpu"
        if meta.tensor_device == "cuda":
            if not torch.cuda.is_available():
                raise InvalidArgumentError(
                    "the tensors are CUDA tensors but this process has no CUDA device; give it a GPU "
                    "or set a CPU target (ray.experimental.set_target_device_for_ref)",
                    argument="tensor_transport_metadata",
                )
            device = f"cuda:{torch.cuda.current_device()}"
        return [torch.empty(tuple(shape), dtype=dtype, device=device) for shape, dtype in meta.tensor_meta]

    @staticmethod
    def _abort_error(obj_id: str, meta: HopliteTransportMetadata) -> TransportError:
        return TransportError(
            f"Ray aborted the transfer of object {obj_id} (put by the node at {meta.holder})",
            peer=meta.holder,
            cause="aborted",
        )

    @staticmethod
    def _timeout_error(obj_id: str, meta: HopliteTransportMetadata, timeout: float) -> HopliteTimeoutError:
        return HopliteTimeoutError(
            f"Ray object {obj_id} did not arrive within {timeout} s: its tensors "
            f"{', '.join(h[:12] for h in meta.object_ids)} were put by the node at {meta.holder}; "
            "is that actor alive, and did it return them with tensor_transport='HOPLITE'?",
            operation="rdt receive",
            timeout=timeout,
            object_id=meta.object_ids[0] if meta.object_ids else None,
        )
