"""Check of the Ray image (run inside it by ``make docker-test``): a local Ray instance starts, the
hoplite directory actor comes up, tasks pass an object through hoplite, and three actors allreduce
and broadcast through ``ray.util.collective`` with backend "hoplite". Prints one JSON line; exits
1 on a wrong result.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import ray
import ray.util.collective as col

import hoplite_gpu.ray as hgray


@ray.remote
def produce() -> object:
    return hgray.node().put(np.arange(1 << 20, dtype=np.float32))


@ray.remote
def consume(oid: object) -> float:
    return float(hgray.node().get(oid).sum())


@ray.remote
class Member:
    def __init__(self, world: int, rank: int) -> None:
        col.init_collective_group(world, rank, backend="hoplite", group_name="check")
        self.rank = rank

    def run(self) -> tuple[bool, bool]:
        x = np.full(1 << 20, self.rank + 1, dtype=np.float32)
        col.allreduce(x, group_name="check")
        y = np.full(1 << 20, self.rank, dtype=np.int64)
        col.broadcast(y, src_rank=2, group_name="check")
        return bool((x == 6).all()), bool((y == 2).all())


def main() -> int:
    start = time.monotonic()
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        runtime_env={"worker_process_setup_hook": "hoplite_gpu.ray.register_collective_backend"},
    )
    address = hgray.start_directory()
    total = ray.get(consume.remote(produce.remote()), timeout=120)
    members = [Member.remote(3, rank) for rank in range(3)]
    results = ray.get([m.run.remote() for m in members], timeout=120)
    ok = total == float(np.arange(1 << 20, dtype=np.float32).sum()) and all(a and b for a, b in results)
    print(
        json.dumps(
            {
                "ray": ray.__version__,
                "directory": str(address),
                "task_get": total,
                "collective": results,
                "ok": ok,
                "seconds": round(time.monotonic() - start, 1),
            }
        )
    )
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
