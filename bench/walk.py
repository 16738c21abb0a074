"""The walk of one ``get`` through the package's modules (the layout, not its speed).

Counts the calls from a function of one hoplite_gpu module into another (each a move down, its
return a move back up) on every thread during one ``get``, where the memory modules are entered
from outside, and which memory modules call each other both ways (a bounce). Scenarios in one
process (embedded directory, two nodes): ``pull`` (shared memory off: a UCX pull), ``shm`` (a
same-host segment mapped), ``device`` (a simulated device object opened through its same-host
ticket). Memory modules: ``hoplite_gpu.memory.*`` (before that wing: buffers, device, gpu, shm,
ipc, store). Environment: ``WALK_PAIRS=1`` lists the pairs, ``WALK_ORDER=1`` every call in order.

    python bench/walk.py [pull|shm|device]
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections import Counter

scenario = sys.argv[1] if len(sys.argv) > 1 else "pull"
if scenario == "device":
    os.environ["HOPLITE_DEVICE_BACKEND"] = "sim"

import numpy as np  # noqa: E402

import hoplite_gpu as hg  # noqa: E402
from hoplite_gpu.iothread import IOThread  # noqa: E402

calls: Counter[tuple[str, str]] = Counter()
order: list[str] = []
recording = False
lock = threading.Lock()
MEMORY = {"buffers", "device", "gpu", "shm", "ipc", "store"}  # before the memory wing


def short(frame) -> str:
    return str(frame.f_globals.get("__name__", "")).removeprefix("hoplite_gpu.")


def profile(frame, event, arg):
    if not recording or event != "call" or frame.f_back is None:
        return
    g = frame.f_globals.get("__name__", "")
    c = frame.f_back.f_globals.get("__name__", "")
    if not (g.startswith("hoplite_gpu") and c.startswith("hoplite_gpu")) or g == c:
        return
    if ".directory" in g or ".directory" in c:
        return
    with lock:
        calls[(short(frame.f_back), short(frame))] += 1
        order.append(
            f"{short(frame.f_back)}.{frame.f_back.f_code.co_name} -> {short(frame)}.{frame.f_code.co_name}"
        )


shared = scenario != "pull"
a = hg.init(shared_memory=shared)
b = hg.connect(a.directory_address, token=a.token, shared_memory=shared)
if scenario == "device":
    try:
        from hoplite_gpu.memory.sim import sim_array
    except ImportError:  # a tree before the memory wing (issue 38): its device module
        sim_array = importlib.import_module("hoplite_gpu.device").sim_array

    arr = sim_array(np.arange(1 << 18, dtype=np.float32))
else:
    arr = np.arange(1 << 18, dtype=np.float32)
warm = a.put(arr)
b.get(warm, timeout=30)
oid = a.put(arr)
io = IOThread.get()
ready = threading.Event()
io.loop.call_soon_threadsafe(lambda: (sys.setprofile(profile), ready.set()))
ready.wait(10)
sys.setprofile(profile)
threading.setprofile(profile)
recording = True
b.get(oid, timeout=30)
recording = False
sys.setprofile(None)
threading.setprofile(None)
io.loop.call_soon_threadsafe(sys.setprofile, None)


def memory(name: str) -> bool:
    return name.startswith("memory.") or name in MEMORY


modules = {m for pair in calls for m in pair}
total = sum(calls.values())
within = sum(n for (c, g), n in calls.items() if memory(c) and memory(g))
into = sum(n for (c, g), n in calls.items() if not memory(c) and memory(g))
entry_points = sorted({g for (c, g) in calls if not memory(c) and memory(g)})
two_way = sorted({tuple(sorted((c, g))) for (c, g) in calls if memory(c) and memory(g) and (g, c) in calls})
callers = sorted({c for (c, g) in calls if not memory(c) and memory(g)})
print(f"  entered from outside the memory modules at: {', '.join(entry_points)} (by {', '.join(callers)})")
print(f"  memory modules calling each other both ways: {two_way or 'none'}")
print(
    f"{scenario}: {len(modules)} modules, {total} calls across modules ({2 * total} moves, {total} back up); "
    f"into memory modules from outside {into}, between memory modules {within}"
)
if os.environ.get("WALK_ORDER"):
    print("\n".join(order))
if os.environ.get("WALK_PAIRS"):
    for (c, g), n in calls.most_common():
        print(f"  {c} -> {g}: {n}")
b.close()
a.close()
