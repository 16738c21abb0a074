"""Joining a running elastic group (:mod:`.elastic`): tickets, admissions and the state a joiner
receives, as ordinary hoplite objects under names derived from the group's.

- A joiner claims ticket ``k`` (the first free one) by putting a nonce under its name.
- Every member watches for the next ticket in the background (:class:`Door`) and votes, at each
  step's agreement, how many it has seen; the least of the votes is admitted, so every member
  admits the same joiners at the same step.
- The first member left publishes each admitted joiner's admission (its rank, the next epoch's
  members, the step it starts at, the members' bucket layout). Before the next forward pass (the
  optimizer has stepped), every member publishes one piece of the flattened parameters and
  optimizer state (identical everywhere), and the first member a manifest (the state's
  structure, its own buffers, the pieces' sizes): the joiner pulls the pieces from all members at
  once.
"""

from __future__ import annotations

import concurrent.futures
import io
import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import HopliteError, HopliteTimeoutError, ObjectExistsError
from ..node import Node
from ..object_id import ObjectID

#: Seconds each background wait for the next ticket lasts (a closed door stops within it).
DOOR_POLL = 1.0


def ticket_id(name: str, k: int) -> ObjectID:
    return ObjectID.from_name(f"hoplite-elastic/{name}/ticket/{k}")


def admission_id(name: str, k: int) -> ObjectID:
    return ObjectID.from_name(f"hoplite-elastic/{name}/admission/{k}")


def manifest_id(name: str, step: int) -> ObjectID:
    return ObjectID.from_name(f"hoplite-elastic/{name}/state/{step}/manifest")


def piece_id(name: str, step: int, i: int) -> ObjectID:
    return ObjectID.from_name(f"hoplite-elastic/{name}/state/{step}/piece/{i}")


def as_bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(obj).encode(), np.uint8)


def from_bytes(array: Any) -> Any:
    return json.loads(bytes(np.asarray(array)).decode())


def claim_ticket(node: Node, name: str, first: int = 0) -> tuple[int, str]:
    """Put a fresh nonce under the first free ticket of group ``name`` from ``first`` on: its
    number and the nonce."""
    nonce = os.urandom(16).hex()
    k = first
    while True:
        try:
            node.put(as_bytes({"nonce": nonce}), ticket_id(name, k))
            return k, nonce
        except ObjectExistsError:
            k += 1


class Door:
    """Watches, on a thread of its own, for the tickets of group ``name`` from number ``first``
    on: :attr:`seen` counts the tickets put so far (in order), :meth:`nonce` reads one."""

    def __init__(self, node: Node, name: str, first: int = 0) -> None:
        self._node = node
        self._name = name
        self.seen = first
        self._nonces: dict[int, str] = {}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hoplite-elastic-door", daemon=True)
        self._thread.start()

    def nonce(self, k: int) -> str:
        return self._nonces.get(k, "")

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.is_set():
            try:
                found = self._node.get(ticket_id(self._name, self.seen), timeout=DOOR_POLL)
            except HopliteTimeoutError:
                continue
            except HopliteError:  # (NodeClosedError too)
                if self._node.closed:
                    return
                self._closed.wait(DOOR_POLL)  # (the directory is away: its session reconnects)
                continue
            self._nonces[self.seen] = str(from_bytes(found).get("nonce", ""))
            self.seen += 1


# ---------------------------------------------------------------------------- the state
@dataclass(frozen=True)
class _Slot:
    """Where a tensor of the state lies in the flat bytes."""

    start: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _flatten(obj: Any, tensors: list[torch.Tensor], offset: list[int]) -> Any:
    """``obj`` with each tensor replaced by its :class:`_Slot` (appended to ``tensors``)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        slot = _Slot(offset[0], t.numel() * t.element_size(), t.dtype, tuple(t.shape))
        tensors.append(t)
        offset[0] += slot.nbytes
        return slot
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors, offset) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_flatten(v, tensors, offset) for v in obj)
    return obj


def _restore(obj: Any, flat: torch.Tensor) -> Any:
    if isinstance(obj, _Slot):
        raw = flat[obj.start : obj.start + obj.nbytes]
        return raw.view(obj.dtype).reshape(obj.shape).clone()
    if isinstance(obj, dict):
        return {k: _restore(v, flat) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_restore(v, flat) for v in obj)
    return obj


def _pieces(total: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous byte ranges covering ``total`` bytes, as even as they go."""
    bounds = [total * i // count for i in range(count + 1)]
    return list(itertools.pairwise(bounds))


def publish_state(
    node: Node, name: str, step: int, index: int, count: int, module: torch.nn.Module, optimizer: Any
) -> list[ObjectID]:
    """Member ``index`` of ``count`` publishes its piece of the state at ``step`` (and member 0
    the manifest): the ids it put, to delete once the joiners have it."""
    buffers = {n for n, _ in module.named_buffers()}
    model = module.state_dict()
    shared = {k: v for k, v in model.items() if k not in buffers}
    state = {"model": shared, "optimizer": optimizer.state_dict() if optimizer is not None else None}
    tensors: list[torch.Tensor] = []
    offset = [0]
    skeleton = _flatten(state, tensors, offset)
    total = offset[0]
    lo, hi = _pieces(total, count)[index]
    mine = np.empty(hi - lo, np.uint8)
    pos = 0
    for t in tensors:  # copy only the bytes of this member's piece
        n = t.numel() * t.element_size()
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            mine[a - lo : b - lo] = raw[a - pos : b - pos]
        pos += n
    put = [node.put(mine, piece_id(name, step, index), copy=False)]
    if index == 0:
        held = io.BytesIO()
        kept = {k: model[k] for k in buffers if k in model}
        torch.save({"skeleton": skeleton, "buffers": kept, "total": total, "count": count}, held)
        put.append(node.put(np.frombuffer(held.getvalue(), np.uint8), manifest_id(name, step)))
    return put


def fetch_state(
    node: Node, name: str, step: int, timeout: float | None, module: torch.nn.Module, optimizer: Any
) -> dict[str, float]:
    """Pull the state published at ``step`` (its pieces from every member at once) and load it.
    Returns the seconds it waited for the manifest (``published``), pulled the pieces
    (``pulled``) and loaded them (``loaded``)."""
    begun = time.monotonic()
    blob = node.get(manifest_id(name, step), timeout)
    published = time.monotonic()
    # (torch.save's format with the skeleton's own class: from the group's members, authenticated)
    held = torch.load(io.BytesIO(bytes(np.asarray(blob))), weights_only=False)
    total, count = int(held["total"]), int(held["count"])
    flat = np.empty(total, np.uint8)

    def pull(i: int, lo: int, hi: int) -> None:
        if hi > lo:
            node.get(piece_id(name, step, i), timeout, out=flat[lo:hi])

    ranges = _pieces(total, count)
    with concurrent.futures.ThreadPoolExecutor(max(1, count)) as pool:
        for done in [pool.submit(pull, i, lo, hi) for i, (lo, hi) in enumerate(ranges)]:
            done.result()
    pulled = time.monotonic()
    state = _restore(held["skeleton"], torch.from_numpy(flat))
    module.load_state_dict({**state["model"], **held["buffers"]})
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    return {"published": published - begun, "pulled": pulled - published, "loaded": time.monotonic() - pulled}


def delete_all(node: Node, oids: list[ObjectID]) -> None:
    for oid in oids:
        try:
            node.delete(oid)
        except HopliteError:
            pass  # (gone already, or the directory is away: nothing to keep)


def later(seconds: float, work: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, work)
    timer.daemon = True
    timer.start()
    return timer
