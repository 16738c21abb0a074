"""Open MPI as a peer of the emulated-cluster benchmark: mpi4py's collectives on NumPy float32 arrays.

One ``mpirun`` for the whole run, started inside host 0's namespace with a hostfile of the hosts'
``10.77.0.x`` addresses (one slot each), as on a real cluster. Instead of ``ssh``, its launch agent
(``plm_rsh_agent``, a small shell script written for the run) maps an address to its host's namespace
and runs the Open MPI daemon there with ``ip netns exec`` (under a host name of its own, ``unshare
--uts``); the daemons call back to ``mpirun`` over the bridge, and each starts the one rank of its host.
Open MPI is held to TCP between hosts (``pml ob1``, ``btl tcp,self``: no shared memory, namespaces
share ``/dev/shm`` but hosts do not), and both its data (``btl_tcp``) and control (``oob_tcp``)
traffic to the cluster's subnet. Its collective algorithms are its defaults (``coll tuned``); waiting
ranks yield the CPU (:data:`YIELD_WHEN_IDLE`, ``--spin`` turns it off).

Every rank runs, for each size and each op, ``warmup + repeat`` rounds of: ``Barrier``, then
``time.monotonic()``, the collective (``Bcast``, ``Reduce``, ``Allreduce`` with ``MPI.SUM``,
``Gather``, ``Allgather``; ``S/N`` bytes from each rank for the gathers), ``time.monotonic()``,
and the rank's CPU seconds from the start of the collective until a ``Barrier`` after it.
The first round's result is checked. Rank 0 gathers every rank's spans and writes them as one JSON line
on its stdout, which ``mpirun`` forwards to the driver; the round is ``max(end) - max(start)``
(:func:`bench.collectives.round_times`).

    python bench/peers/mpi.py --hosts 4 --rate 100MB --sizes 1KiB,1MiB,64MiB

Needs root, iproute2, Debian's Open MPI (``apt-get install openmpi-bin libopenmpi-dev``) and mpi4py
built against it (``pip install --no-binary mpi4py mpi4py==4.1.2``).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import IO, TYPE_CHECKING, Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if TYPE_CHECKING:
    from bench.cluster import Cluster

NAME = "mpi"
OPS = ("broadcast", "reduce", "allreduce", "gather", "allgather", "barrier")
#: The repository root: ranks run this module as ``python -m bench.peers.mpi`` from there.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Rank 0 marks its report lines with this, so that anything else Open MPI prints is ignored.
MARK = "@mpi-peer "
#: Every process of the run carries this variable, with the run's own value, so that cleanup finds
#: (and kills) exactly the processes the run started, in any namespace.
TAG_VAR = "HGM_MPI_PEER_RUN"
#: Environment of ``mpirun`` (inherited by its daemons and ranks): Open MPI refuses root without it.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "PYTHONUNBUFFERED": "1",
}
#: Ranks give up the CPU while they wait (``mpi_yield_when_idle``), as Open MPI does by itself on an
#: oversubscribed node: every "host" is one slot, but all of them share this machine's few cores, and
#: ranks spinning on one core each (Open MPI's default) would take the CPU from the rank they wait for
#: (1 KiB collectives then take milliseconds instead of tens of microseconds).
YIELD_WHEN_IDLE = True
#: Seconds allowed for ``mpirun`` to start its daemons and ranks, on top of each op's own allowance.
START_SECONDS = 120.0

# The launch agent: called by mpirun as ``agent [options] <host> <command words...>`` (as it would
# call ssh), it runs the command in the namespace of the host with that address, under a host name of
# its own (a UTS namespace): Open MPI names its session directories and shared-memory files after the
# host name, and daemons of one name on one file system collide.
_AGENT = """#!/bin/sh
while [ $# -gt 0 ]; do
    case "$1" in
        {subnet}.*) break ;;
        *) shift ;;
    esac
done
host="$1"
shift
index=$(( ${{host##*.}} - 1 ))
exec ip netns exec "{prefix}$index" unshare --uts /bin/sh -c \\
    'hostname "$0" && exec /bin/sh -c "$1"' "{prefix}-host$index" "$*"
"""


def mpi_argv(cluster: Cluster, workdir: str, program: list[str]) -> list[str]:
    """The ``mpirun`` command line (to run in host 0's namespace) that starts ``program`` once on
    every host of ``cluster``; the hostfile and launch agent are written into ``workdir``."""
    from bench.cluster import SUBNET

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RuntimeError("mpirun not found: apt-get install openmpi-bin libopenmpi-dev")
    hostfile = os.path.join(workdir, "hosts")
    with open(hostfile, "w") as fh:
        fh.writelines(f"{cluster.address(i)} slots=1\n" for i in range(cluster.hosts))
    agent = os.path.join(workdir, "agent.sh")
    with open(agent, "w") as fh:
        fh.write(_AGENT.format(subnet=SUBNET, prefix=cluster.prefix))
    os.chmod(agent, 0o755)
    subnet = f"{SUBNET}.0/24"
    mca = {
        "plm_rsh_agent": agent,
        "plm_rsh_no_tree_spawn": "1",
        "orte_tmpdir_base": workdir,
        "oob_tcp_if_include": subnet,
        "pml": "ob1",
        "btl": "tcp,self",
        "btl_tcp_if_include": subnet,
        "osc": "pt2pt",
        "mpi_yield_when_idle": "1" if YIELD_WHEN_IDLE else "0",
    }
    argv = [mpirun, "--allow-run-as-root", "-np", str(cluster.hosts), "--hostfile", hostfile]
    argv += ["--map-by", "node", "--bind-to", "none", "--leave-session-attached", "-wdir", ROOT]
    for key, value in mca.items():
        argv += ["--mca", key, value]
    return argv + program


def _read_lines(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment carries ``TAG_VAR=tag`` (leftover daemons or ranks)."""
    needle = f"{TAG_VAR}={tag}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                found = needle in fh.read().split(b"\0")
        except OSError:
            continue
        if found:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def _stop(proc: subprocess.Popen[str], tag: str) -> None:
    """End ``mpirun`` (its process group: agents and daemons) and anything of the run left behind."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except (OSError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait(10)
    _kill_tagged(tag)


def _allowance(cluster: Cluster, size: int, rounds: int) -> float:
    """Seconds one (op, size) may take: generous, from the bytes the slowest algorithm would move."""
    return 60.0 + rounds * 10.0 * cluster.hosts * size / cluster.rate_bytes


def run(cluster: Cluster, sizes: list[int], ops: list[str], repeat: int, warmup: int) -> list[dict[str, Any]]:
    """Every op at every size with Open MPI on all hosts of ``cluster``: one row per (op, size) with the
    median seconds of ``repeat`` rounds after ``warmup`` untimed ones, and the mean CPU seconds of
    those rounds summed over the ranks."""
    from bench.collectives import round_cpu, round_times
    from bench.common import format_size

    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown ops: {unknown}")
    rounds = warmup + repeat
    tag = uuid.uuid4().hex
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hgm-mpi-") as workdir:
        program = [sys.executable, "-m", "bench.peers.mpi", "--rank", ",".join(ops)]
        program += [",".join(str(s) for s in sizes), str(rounds)]
        argv = mpi_argv(cluster, workdir, program)
        # mpirun under host 0's own host name, as its daemons (see _AGENT).
        named = ["unshare", "--uts", "/bin/sh", "-c", 'hostname "$0" && exec "$@"', f"{cluster.prefix}-host0"]
        with open(os.path.join(workdir, "stderr"), "w+") as errors:
            proc = cluster.popen(
                0,
                named + argv,
                env={**MPI_ENV, TAG_VAR: tag},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                start_new_session=True,
            )
            try:
                assert proc.stdout is not None
                lines: queue.Queue[str | None] = queue.Queue()
                threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
                extra = START_SECONDS
                for size in sizes:
                    for op in ops:
                        print(f"{NAME} {op} {format_size(size)} ...", file=sys.stderr, flush=True)
                        deadline = time.monotonic() + extra + _allowance(cluster, size, rounds)
                        extra = 0.0
                        report = _next_report(lines, deadline, proc, errors)
                        if (report["op"], report["size"]) != (op, size):
                            raise RuntimeError(
                                f"mpi: expected {op} {size}, got {report['op']} {report['size']}"
                            )
                        if report["errors"]:
                            raise RuntimeError(f"mpi {op} {format_size(size)} is wrong: {report['errors']}")
                        seconds = statistics.median(round_times(report["spans"], warmup, repeat))
                        cpu = statistics.mean(round_cpu(report["spans"], warmup, repeat))
                        rows.append(
                            {"system": NAME, "op": op, "size": size, "seconds": seconds, "cpu_seconds": cpu}
                        )
                proc.wait(60)
                if proc.returncode != 0:
                    raise RuntimeError(f"mpirun exited with {proc.returncode}: {_tail(errors)}")
            finally:
                _stop(proc, tag)
    return rows


def _tail(errors: IO[str], chars: int = 3000) -> str:
    errors.flush()
    errors.seek(0)
    return errors.read()[-chars:].strip()


def _next_report(
    lines: queue.Queue[str | None], deadline: float, proc: subprocess.Popen[str], errors: IO[str]
) -> dict[str, Any]:
    """The next report line of rank 0 (other output is passed to stderr)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"mpi: no report in time; mpirun said: {_tail(errors)}")
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            continue
        if line is None:
            proc.wait(30)
            raise RuntimeError(f"mpirun exited (code {proc.returncode}): {_tail(errors)}")
        if line.startswith(MARK):
            report: dict[str, Any] = json.loads(line[len(MARK) :])
            return report
        print(line, end="", file=sys.stderr)


# ---------------------------------------------------------------- the rank program (under mpirun)
def _rank_main(ops: list[str], sizes: list[int], rounds: int) -> None:
    """One rank: every op at every size, ``rounds`` times, reporting spans through rank 0."""
    import numpy as np
    from mpi4py import MPI

    from bench.common import cpu_seconds

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    for size in sizes:
        data = np.ones(size // 4, dtype=np.float32)
        piece = np.ones((size // world) // 4, dtype=np.float32)
        for op in ops:
            if op in ("gather", "allgather"):
                out = np.zeros(piece.size * world, dtype=np.float32)
            elif op == "broadcast":
                out = data if rank == 0 else np.zeros_like(data)
            else:
                out = np.zeros_like(data)
            spans: list[tuple[float, float, float]] = []
            error = ""
            for i in range(rounds):
                comm.Barrier()
                cpu = cpu_seconds()
                start = time.monotonic()
                if op == "broadcast":
                    comm.Bcast(out, root=0)
                elif op == "reduce":
                    comm.Reduce(data, out, op=MPI.SUM, root=0)
                elif op == "allreduce":
                    comm.Allreduce(data, out, op=MPI.SUM)
                elif op == "gather":
                    comm.Gather(piece, out, root=0)
                elif op == "allgather":
                    comm.Allgather(piece, out)
                elif op == "barrier":
                    comm.Barrier()
                end = time.monotonic()
                comm.Barrier()  # CPU until every rank has left the collective, as the other systems
                spans.append((start, end, cpu_seconds() - cpu))
                if i == 0:
                    error = _check(op, out, rank, world)
            everything = comm.gather((spans, error), root=0)
            if rank == 0:
                assert everything is not None
                report = {
                    "op": op,
                    "size": size,
                    "spans": [s for s, _ in everything],
                    "errors": [f"rank {r}: {e}" for r, (_, e) in enumerate(everything) if e],
                }
                sys.stdout.write(MARK + json.dumps(report) + "\n")
                sys.stdout.flush()
            del out


def _check(op: str, out: Any, rank: int, world: int) -> str:
    """What is wrong with a rank's result of ``op`` (empty if right)."""
    if op == "barrier" or (op in ("reduce", "gather") and rank != 0):
        return ""
    want = float(world) if op in ("reduce", "allreduce") else 1.0
    if out.size and not (out == want).all():
        return f"{op}: expected all {want}, got values {sorted(set(out[:1000].tolist()))[:5]}"
    return ""


def main(argv: list[str] | None = None) -> int:
    """Run Open MPI alone on an emulated cluster and print its rows (or, with ``--rank``, be a rank)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:
        _rank_main(argv[1].split(","), [int(s) for s in argv[2].split(",")], int(argv[3]))
        return 0
    from bench.cluster import Cluster, ClusterUnavailable
    from bench.common import cluster_arguments, format_size, parse_rate, parse_size

    ap = cluster_arguments(__doc__ or "", "1KiB,1MiB,64MiB", "hgm")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--spin", action="store_true", help="ranks spin while they wait (Open MPI's default)")
    args = ap.parse_args(argv)
    global YIELD_WHEN_IDLE
    YIELD_WHEN_IDLE = not args.spin
    rate = parse_rate(args.rate)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    started = time.monotonic()
    try:
        with Cluster(args.hosts, rate, prefix=args.prefix) as cluster:
            rows = run(cluster, sizes, args.ops.split(","), args.repeat, args.warmup)
    except ClusterUnavailable as exc:
        print(f"cannot build the emulated cluster: {exc}", file=sys.stderr)
        return 2
    for row in rows:
        print(json.dumps({**row, "size_h": format_size(row["size"])}))
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
