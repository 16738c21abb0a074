"""System calls per same-host ``put``, ``get`` and ``delete``, counted with strace.

Where system calls are intercepted (gVisor, as on the GPU machine this project borrows), each one
costs microseconds, and a same-host get that makes twenty pays for them on every call. This
counts them, so a change to the same-host paths shows its effect on any machine with ``strace``
(timings on this 2-core machine hide a few microseconds in their noise).

Two processes on one host, each started under ``strace -f``: an owner that puts an object (a
fresh ObjectID each time) and deletes it after the reader's get, and a reader that ``get``s it.
Each call is bracketed by two marker calls (``access`` of a path that does not exist), and the
system calls between them are counted: those of the calling thread, those of the process's
other threads (the node's I/O thread, where a call hands its work to it; heartbeats add a little
noise), and ``futex`` calls apart (lock and GIL hand-offs, whose number depends on timing).
The median over ``--count`` calls is reported (after :data:`LEFT_OUT` rounds), with the calling
thread's calls by name.

Paths:

* ``sim-index``: device objects in simulated device memory (``HOPLITE_DEVICE_BACKEND=sim``: the
  ticket, mapping and copy code of CUDA IPC over host memory), the reader finding each through
  its owner's index link (``Config.same_host_index``).
* ``sim-lookup``: the same, the reader asking the directory (``same_host_index=False``).
* ``shm``: host objects in shared-memory segments, the reader mapping the owner's.

    python bench/syscalls.py --paths sim-index,sim-lookup,shm --size 1MiB --count 30

Exits 2 with one line where ``strace`` is missing or may not trace (no ptrace permission).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parse_size, write_json

PATHS = ("sim-index", "sim-lookup", "shm")
MARK = "/hoplite-syscalls-mark"
#: Rounds not counted: first use (imports, connections, and the data plane's progress thread,
#: which loads its CUDA helpers in the background, slowly under strace).
LEFT_OUT = 10
_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()")


# ---------------------------------------------------------------- the traced processes
def _child(role: str, address: str, path: str, size: int) -> None:
    """An owner or a reader: reads commands on stdin, answers one line each on stdout."""
    import numpy as np

    if path.startswith("sim"):
        os.environ["HOPLITE_DEVICE_BACKEND"] = "sim"
    import hoplite_gpu as hg
    from hoplite_gpu.memory import sim, to_host

    node = hg.connect(
        address,
        token=os.environ["HOPLITE_TOKEN"],
        shared_memory=True,
        same_host_index=path != "sim-lookup",
    )
    arr = np.arange(size // 8, dtype=np.int64)
    try:
        for line in sys.stdin:
            what, *arg = line.split()
            os.access(f"{MARK}/{what}/begin", os.F_OK)
            if what == "put":
                answer = node.put(sim.sim_array(arr) if path.startswith("sim") else arr).hex()
            elif what == "get":
                got = node.get(hg.ObjectID.from_hex(arg[0]), timeout=60)
                answer = "ok" if int(to_host(got).reshape(-1)[-1]) == arr.size - 1 else "wrong"
                del got
            elif what == "delete":
                node.delete(hg.ObjectID.from_hex(arg[0]))
                answer = "ok"
            else:
                answer = f"unknown command {what!r}"
            os.access(f"{MARK}/{what}/end", os.F_OK)
            print(answer, flush=True)
    finally:
        node.close()


class _Traced:
    """A child process under ``strace -f``, talked to line by line."""

    def __init__(self, role: str, address: str, token: str, path: str, size: int, trace: str) -> None:
        cmd = [
            shutil.which("strace") or "strace",
            "-f",
            "-qq",
            "-o",
            trace,
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            role,
            "--address",
            address,
            "--paths",
            path,
            "--size",
            str(size),
        ]
        env = {**os.environ, "HOPLITE_TOKEN": token, "PYTHONUNBUFFERED": "1"}
        self.trace = trace
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1
        )

    def ask(self, line: str, timeout: float) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{line.split()[0]}: no answer within {timeout:.0f} s")
        answer = self.proc.stdout.readline().strip()
        if not answer or answer.startswith("unknown") or answer == "wrong":
            raise RuntimeError(f"{line.split()[0]}: {answer or 'the process ended'}")
        return answer

    def close(self, timeout: float) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)


# ---------------------------------------------------------------- counting
def count_calls(trace: str, what: str) -> list[dict[str, Any]]:
    """Per bracketed ``what`` call in ``trace`` (``strace -f`` output): the system calls of the
    calling thread and of the other threads, by name (without futex), and the futex calls."""
    windows: list[dict[str, Any]] = []
    caller = None
    current: dict[str, Any] | None = None
    with open(trace) as fh:
        for line in fh:
            if f'"{MARK}/{what}/begin"' in line:
                caller = line.split()[0]
                current = {"caller": collections.Counter(), "others": collections.Counter(), "futex": 0}
                continue
            if current is None:
                continue
            if f'"{MARK}/{what}/end"' in line and line.split()[0] == caller:
                windows.append(current)
                current = None
                continue
            m = _LINE.match(line)
            if m is None or m.group(2):  # not a call, or the end of one counted where it began
                continue
            name = m.group(3)
            if name == "futex":
                current["futex"] += 1
            elif m.group(1) == caller:
                current["caller"][name] += 1
            else:
                current["others"][name] += 1
    return windows


def _summary(windows: list[dict[str, Any]]) -> dict[str, Any]:
    if not windows:
        return {"calls": 0}
    totals = [sum(w["caller"].values()) for w in windows]
    typical = min(windows, key=lambda w: abs(sum(w["caller"].values()) - statistics.median(totals)))
    return {
        "calls": len(windows),
        "caller_median": statistics.median(totals),
        "others_median": statistics.median(sum(w["others"].values()) for w in windows),
        "futex_median": statistics.median(w["futex"] for w in windows),
        "caller_typical": dict(sorted(typical["caller"].items())),
        # Other threads by name: the median of each name over the calls (heartbeats and sweeps
        # land in some windows and not others, so no one window is typical of them).
        "others_by_name": {
            name: statistics.median(w["others"][name] for w in windows)
            for name in sorted({n for w in windows for n in w["others"]})
            if statistics.median(w["others"][name] for w in windows)
        },
    }


def run(path: str, size: int, count: int, timeout: float) -> dict[str, Any]:
    """``count`` rounds of put, get and delete over ``path``; the counts of each."""
    import hoplite_gpu as hg

    node = hg.init(shared_memory=True)  # hosts the directory
    workdir = tempfile.mkdtemp(prefix="hoplite-syscalls-")
    owner = reader = None
    try:
        owner = _Traced("owner", node.directory_address, node.token, path, size, f"{workdir}/owner")
        reader = _Traced("reader", node.directory_address, node.token, path, size, f"{workdir}/reader")
        for _ in range(count + LEFT_OUT):
            oid = owner.ask("put", timeout)
            reader.ask(f"get {oid}", timeout)
            owner.ask(f"delete {oid}", timeout)
        owner.close(timeout)
        reader.close(timeout)
        return {
            "path": path,
            "size": size,
            "put": _summary(count_calls(f"{workdir}/owner", "put")[LEFT_OUT:]),
            "get": _summary(count_calls(f"{workdir}/reader", "get")[LEFT_OUT:]),
            "delete": _summary(count_calls(f"{workdir}/owner", "delete")[LEFT_OUT:]),
        }
    finally:
        for child in (owner, reader):
            if child is not None and child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait(timeout)
        shutil.rmtree(workdir, ignore_errors=True)
        node.close()


def strace_usable() -> str:
    """Why strace cannot count here ("" where it can)."""
    if shutil.which("strace") is None:
        return "no strace on this machine"
    probe = subprocess.run(["strace", "-qq", "-o", os.devnull, "true"], capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"strace cannot trace here: {probe.stderr.strip()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated: " + ", ".join(PATHS))
    ap.add_argument("--size", default="1MiB")
    ap.add_argument("--count", type=int, default=30, help=f"rounds counted (after {LEFT_OUT} left out)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds each call may take")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--child", choices=("owner", "reader"), help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    if args.child:
        _child(args.child, args.address, args.paths, size)
        return 0
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not paths or set(paths) - set(PATHS):
        ap.error(f"--paths takes some of {', '.join(PATHS)}")
    why = strace_usable()
    if why:
        print(f"syscalls: {why}", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d")
    rows = [run(path, size, args.count, args.timeout) for path in paths]
    print(f"system calls per call, median of {args.count} ({started}, {args.size} objects)")
    print(f"{'path':>10} {'call':>7} {'caller':>7} {'others':>7} {'futex':>6}  the caller's calls")
    for row in rows:
        for what in ("put", "get", "delete"):
            s = row[what]
            names = " ".join(
                f"{k}{'' if v == 1 else f' x{v}'}" for k, v in s.get("caller_typical", {}).items()
            )
            print(
                f"{row['path']:>10} {what:>7} {s.get('caller_median', 0):>7g} "
                f"{s.get('others_median', 0):>7g} {s.get('futex_median', 0):>6g}  {names}"
            )
    write_json(args.json, {"date": started, "count": args.count, "rows": rows})
    return 0


__all__ = ["PATHS", "count_calls", "main", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
