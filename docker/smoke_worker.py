"""A hoplite node inside a container, driven by ``docker/smoke.py`` over stdin/stdout.

Joins the directory named by ``HOPLITE_DIRECTORY`` with the token in ``HOPLITE_TOKEN_FILE`` (a
mounted secret), then answers one JSON command per line with one JSON reply per line:

- ``{"op": "put", "name": N, "seed": S, "size": B}``: put a float32 array of B bytes made from S
  under ``ObjectID.from_name(N)``;
- ``{"op": "get", "name": N, "seeds": [S...], "timeout": T}``: get it and compare it bit for bit with
  the sum of the arrays made from the seeds (one seed: a plain copy);
- ``{"op": "reduce", "names": [N...], "seeds": [S...], "timeout": T}``: reduce the objects (SUM), get
  the result and compare it with the sum of the seeds' arrays;
- ``{"op": "transfers", "name": N}``: the transfers of that object the directory logged (sender,
  receiver, whether the sender was still receiving, and how each ended);
- ``{"op": "exit"}``.

The arrays hold small integers, so every order of summation gives the same bits.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

import hoplite_gpu as hg


def make_array(seed: int, nbytes: int) -> np.ndarray[Any, Any]:
    """Float32 array of ``nbytes`` bytes with small integer values (exact sums in any order)."""
    n = nbytes // 4
    return ((np.arange(n, dtype=np.int64) * 2654435761 + seed * 97) % 201 - 100).astype(np.float32)


def expected(seeds: list[int], nbytes: int) -> np.ndarray[Any, Any]:
    """The sum of the seeds' arrays."""
    total = make_array(seeds[0], nbytes)
    for seed in seeds[1:]:
        total += make_array(seed, nbytes)
    return total


def serve(node: Any) -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        start = time.monotonic()
        reply: dict[str, Any] = {"op": op}
        try:
            if op == "exit":
                break
            if op == "put":
                node.put(make_array(cmd["seed"], cmd["size"]), hg.ObjectID.from_name(cmd["name"]))
            elif op in ("get", "reduce"):
                if op == "get":
                    oid = hg.ObjectID.from_name(cmd["name"])
                else:
                    ids = [hg.ObjectID.from_name(n) for n in cmd["names"]]
                    oid = node.reduce(ids, "sum", timeout=cmd["timeout"])
                got = np.asarray(node.get(oid, timeout=cmd["timeout"]))
                want = expected(cmd["seeds"], got.nbytes)
                reply["bytes"] = got.nbytes
                reply["exact"] = bool(got.dtype == want.dtype and np.array_equal(got, want))
            elif op == "transfers":
                oid = hg.ObjectID.from_name(cmd["name"]).hex()
                done = {}
                started = []
                for ev in node.event_log():
                    if ev.get("object_id") != oid:
                        continue
                    if ev["kind"] == "transfer_start":
                        started.append(ev)
                    elif ev["kind"] == "transfer_done":
                        done[ev["transfer_id"]] = ev
                reply["transfers"] = [
                    {
                        "sender": ev["sender"],
                        "receiver": ev["receiver"],
                        "relay": not ev["sender_complete"],
                        "ok": done.get(ev["transfer_id"], {}).get("ok"),
                        "reason": done.get(ev["transfer_id"], {}).get("reason", ""),
                    }
                    for ev in started
                ]
            else:
                raise ValueError(f"unknown op {op!r}")
            reply["ok"] = True
        except Exception as exc:  # reported to the driver, which fails the smoke test
            reply.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        reply["seconds"] = round(time.monotonic() - start, 3)
        print(json.dumps(reply), flush=True)


def main() -> int:
    node = hg.connect()
    print(json.dumps({"op": "ready", "ok": True, "node_id": node.node_id}), flush=True)
    try:
        serve(node)
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
