"""Physical baselines measured in the same run as our own figures: a plain TCP socket copy between
two processes on loopback, and an in-process memcpy; and the worker-process teardown the demo and
``bench/`` share. Used by the demo and ``bench/``."""

from __future__ import annotations

import multiprocessing as mp
import re
import socket
import struct
import time
from typing import Any

import numpy as np

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864 (also KiB, GiB, K, M, G, plain bytes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def format_size(n: int) -> str:
    """67108864 -> ``"64 MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _socket_sender(port: int, size: int, repeat: int) -> None:
    buf = np.ones(size, np.uint8)
    cpu = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(repeat):
            c0 = time.process_time()
            s.recv(1)  # go signal
            s.sendall(memoryview(buf))  # type: ignore[arg-type]
            cpu.append(time.process_time() - c0)
        s.sendall(struct.pack(f"<{repeat}d", *cpu))  # this side's CPU seconds of each copy


def socket_copy(size: int, repeat: int = 3) -> list[tuple[float, float]]:
    """Seconds and CPU seconds (user + system, of both processes) of each copy of a plain Python TCP
    socket moving ``size`` bytes between two processes.

    The connection is set up before timing and the receive buffer is reused, so every copy after
    the first runs on warm pages and a warm connection."""
    ctx = mp.get_context("spawn")
    copies: list[tuple[float, float]] = []
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(60)
        proc = ctx.Process(target=_socket_sender, args=(srv.getsockname()[1], size, repeat))
        proc.start()
        try:
            conn, _ = srv.accept()
            conn.settimeout(60)
            out = np.empty(size, np.uint8)
            with conn:
                for _ in range(repeat):
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    conn.sendall(b"g")
                    _recv_exactly(conn, memoryview(out))  # type: ignore[arg-type]
                    copies.append((time.perf_counter() - t0, time.process_time() - c0))
                theirs = bytearray(8 * repeat)
                _recv_exactly(conn, memoryview(theirs))
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return [
        (t, c + other) for (t, c), other in zip(copies, struct.unpack(f"<{repeat}d", theirs), strict=True)
    ]


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ConnectionError("socket baseline sender went away")
        got += n


def socket_copy_times(size: int, repeat: int = 3) -> list[float]:
    """Seconds per copy of :func:`socket_copy`."""
    return [t for t, _ in socket_copy(size, repeat)]


def socket_copy_gbps(size: int, repeat: int = 3) -> float:
    """Best GB/s of :func:`socket_copy_times`."""
    return size / min(socket_copy_times(size, repeat)) / 1e9


def memcpy_gbps(size: int, repeat: int = 3) -> float:
    """Best GB/s of ``np.copyto`` of ``size`` bytes (destination pre-faulted)."""
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return size / best / 1e9


def markdown_table(columns: list[tuple[str, str]], rows: list[list[str]]) -> str:
    """A Markdown table: ``columns`` are (heading, alignment: ``"l"``, ``"r"`` or ``"c"``), each row
    one formatted cell per column."""
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    lines = [
        "| " + " | ".join(name for name, _ in columns) + " |",
        "|" + "|".join(rule[align] for _, align in columns) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def start_workers(
    target: Any, args: list[tuple[Any, ...]], timeout: float = 120.0, daemon: bool = True
) -> tuple[list[Any], list[Any]]:
    """Start one spawned process per tuple in ``args``, running ``target(*tuple, pipe)``, and wait
    up to ``timeout`` seconds for each to send ``"ready"`` on its pipe. Returns the parent ends of
    the pipes and the processes, in order; stops them all (:func:`stop_workers`) and raises
    RuntimeError if one did not get ready."""
    ctx = mp.get_context("spawn")
    pipes: list[Any] = []
    procs: list[Any] = []
    try:
        for one in args:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(*one, child), daemon=daemon)
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for i, pipe in enumerate(pipes):
            if not pipe.poll(timeout) or pipe.recv() != "ready":
                raise RuntimeError(f"worker {i} of {len(args)} did not start within {timeout} s")
    except BaseException:
        stop_workers(pipes, procs)
        raise
    return pipes, procs


def stop_workers(pipes: list[Any], procs: list[Any], timeout: float = 30.0) -> None:
    """Tell worker processes to exit (``None`` on each pipe), wait up to ``timeout`` seconds for
    each, and kill those still alive."""
    for pipe in pipes:
        try:
            pipe.send(None)
        except (OSError, BrokenPipeError):
            pass
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
