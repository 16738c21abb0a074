"""Data-plane (node <-> node, over UCX) wire constants: fixed-size binary headers (``struct``), so
the receiver can post a buffer of known size, and the UCX tags of an endpoint's messages."""

from __future__ import annotations

import struct

#: Pull request, receiver -> sender: magic, version, transfer_id, offset, chunk size (the receiver
#: chooses it; the sender sends messages of exactly that size), object_id (20 bytes).
PULL_REQUEST = struct.Struct("<4sHxxQQQ20s")
PULL_MAGIC = b"HGPL"
#: The same request with this magic asks the holder to keep the connection for a library's own
#: stream (:mod:`hoplite_gpu.dataplane.wire`), its object_id naming what it is for.
WIRE_MAGIC = b"HGWR"
#: Pull response, sender -> receiver: status, object size.
PULL_RESPONSE = struct.Struct("<iiQ")
PULL_OK = 0
PULL_NOT_FOUND = 1
PULL_BAD_REQUEST = 2

#: UCX tags used on a data-plane endpoint (hashed with the endpoint's own tag by ucxx).
TAG_AUTH = 1
TAG_REQUEST = 2
TAG_RESPONSE = 3
TAG_WARMUP = 4
TAG_ACK = 5  # receiver -> sender, per transfer: 8 bytes, the receiver's final byte count
ACK = struct.Struct("<Q")
TAG_CHUNK = 6


def chunk_tag(transfer_id: int, start: int, end: int) -> tuple[int, int, int, int]:
    """The tag of the chunk ``[start, end)`` of a transfer: one per chunk, never per transfer.

    A message can then only land in the receive posted for exactly its bytes. With one tag per
    transfer, the order of receives was the only thing tying a message to its offset, and ucxx
    (0.52, ``Endpoint.recv``) breaks it when the sender dies: each receive the lost endpoint
    cancels takes *any* queued message with its tag from the worker, in the order the
    cancellations resume, so two chunks could land swapped and both count as received (a
    broadcast chain whose relay was SIGKILLed once finished with wrong bytes, in CI). The end
    offset is part of the tag too: a shorter message (a sender cutting a chunk at an injected
    fault) never fills a longer receive, which ucxx completes without an error.
    """
    return (TAG_CHUNK, transfer_id, start, end)
