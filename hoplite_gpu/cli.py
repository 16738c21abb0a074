"""Command line: ``hoplite-gpu directory``, ``health``, ``demo`` and ``info``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import ssl
import sys
from typing import Any

from .auth import new_token, read_token_file, token_from_env
from .config import Config, check_port
from .errors import HopliteError
from .iothread import new_event_loop


def _port(text: str) -> int:
    """An argument's port number (argparse reports the error in one line)."""
    try:
        return check_port(int(text))
    except (ValueError, HopliteError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0..65535)") from None


def _directory(args: argparse.Namespace) -> int:
    from .directory.service import DirectoryService

    def refuse(text: object) -> int:
        print(f"hoplite-gpu directory: {text}", file=sys.stderr)
        return 2

    try:
        token = read_token_file(args.token_file) if args.token_file else token_from_env()
        config = Config.from_env()
    except HopliteError as exc:
        return refuse(exc)
    generated = not token  # neither HOPLITE_TOKEN nor a token file named: make one
    if generated:
        token = new_token()

    async def serve() -> int:
        service = DirectoryService.from_config(token, args.host, args.port, config)  # loads TLS
        try:
            await service.start()
        except OSError as exc:  # the port is taken, or the host is not this machine's
            return refuse(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
        print(f"hoplite-gpu directory listening on {service.address}", flush=True)
        if generated:
            print(f"HOPLITE_TOKEN={token}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await service.stop()
        return 0

    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop where installed
            return runner.run(serve())
    except HopliteError as exc:  # e.g. a certificate or key that does not load
        return refuse(exc)


async def probe(address: str, timeout: float, tls: ssl.SSLContext | None = None) -> None:
    """Check that a directory at ``address`` is serving: it accepts a connection (over TLS with
    ``tls``) and sends its authentication challenge within ``timeout`` seconds (no token is
    needed, nothing is registered; the connection is closed before the handshake goes further).

    Raises:
        DirectoryUnavailableError: no connection, no challenge, or something else came back; the
            message says when TLS on one side only may be why.
    """
    from . import protocol as p
    from .errors import DirectoryUnavailableError
    from .node.control import parse_address

    host, port = parse_address(address)

    async def first_frame() -> p.Message:
        opening = asyncio.open_connection(host, port, ssl=tls, server_hostname=host if tls else None)
        reader, writer = await opening
        try:
            return await p.read_frame(reader, 4096)
        finally:
            writer.close()

    try:
        first = await asyncio.wait_for(first_frame(), timeout)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, HopliteError) as exc:
        if isinstance(exc, ssl.SSLError):
            hint = " (TLS failed: check --tls-ca-file, or --no-tls if the directory serves plain TCP)"
        elif tls is None and isinstance(exc, asyncio.TimeoutError):
            hint = " (no challenge came: if the directory serves TLS, pass --tls)"
        else:
            hint = ""
        raise DirectoryUnavailableError(
            f"no directory serving at {address}: {str(exc) or type(exc).__name__}{hint}",
            peer=address,
            cause=type(exc).__name__,
        ) from exc
    if not isinstance(first, p.Challenge):
        raise DirectoryUnavailableError(
            f"{address} answered with {first.TYPE!r}, not a directory's challenge",
            peer=address,
            cause="protocol",
        )


def health_tls(use_tls: bool | None, ca_file: str | None, config: Config) -> ssl.SSLContext | None:
    """The TLS context ``hoplite-gpu health`` probes with (None: plain TCP).

    ``use_tls`` None: TLS where the environment configures it (``HOPLITE_TLS_CERT_FILE``, as in a
    TLS directory's own container, where the image's health check runs, or
    ``HOPLITE_TLS_CA_FILE``). With a CA file (``ca_file``, else ``Config.tls_ca_file``) the
    directory's certificate and host are checked; without one they are not: the probe sends
    nothing and only reads the directory's challenge.

    Raises:
        InvalidArgumentError: the CA file does not load.
    """
    ca = ca_file if ca_file is not None else config.tls_ca_file
    if use_tls is None:
        use_tls = bool(ca_file or config.tls_cert_file or config.tls_ca_file)
    if not use_tls:
        return None
    if ca:
        return config.replace(tls_ca_file=ca).client_tls()
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _health(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("HOPLITE_DIRECTORY") or "127.0.0.1:7070"
    try:
        tls = health_tls(args.tls, args.tls_ca_file, Config.from_env())
        asyncio.run(probe(address, args.timeout, tls))
    except HopliteError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    print(f"directory at {address} is serving" + (" (TLS)" if tls else ""))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import main

    return main(workers=args.workers, sizes=args.sizes)


def node_report() -> dict[str, Any]:
    """What this node sees, as plain types: :meth:`~hoplite_gpu.topology.Inventory.to_dict` of
    its GPU inventory plus ``cupy`` (installed, version, device_count, usable, error), ``ucxx``
    (installed, version), ``ucx_tls`` (the UCX transports hoplite_gpu runs UCX with: ``UCX_TLS``
    when set, else hoplite_gpu's choice for this host) with ``ucx_tls_source`` ("env" or
    "hoplite_gpu default"), and ``ucx_choice``
    (:meth:`~hoplite_gpu.dataplane.ucx.choice.UcxChoice.to_dict` of
    :func:`~hoplite_gpu.dataplane.ucx.settings.ucx_choice`: the UCX settings chosen for this host,
    and why), and
    ``data_plane`` (``kind``: ``tcp`` or ``ucx``, and ``why``: what a node started here runs)."""
    from .config import Config
    from .dataplane.selection import data_plane_choice
    from .dataplane.ucx.settings import default_ucx_tls, ucx_choice
    from .memory import kernels
    from .memory.placement import inventory

    # Before ucxx is imported: importing it sets UCX_RNDV_THRESH (8192) where it is unset.
    tls = os.environ.get("UCX_TLS")
    host_choice = ucx_choice()
    choice = host_choice.to_dict()
    default_tls = default_ucx_tls()
    plane, plane_why = data_plane_choice(Config.from_env(), host_choice)
    cupy: dict[str, Any] = {"installed": False, "version": None, "device_count": None}
    cupy.update(usable=False, error="")
    try:
        import cupy as cp

        cupy.update(installed=True, version=str(cp.__version__))
        cupy["device_count"] = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # not installed, or no usable CUDA driver
        cupy["error"] = f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(Exception):  # a broken CUDA install must not crash `info`
        cupy["usable"] = kernels.available()
    try:
        import ucxx

        ucx: dict[str, Any] = {"installed": True, "version": str(ucxx.__version__)}
    except Exception as exc:
        ucx = {"installed": False, "version": None, "error": f"{type(exc).__name__}: {exc}"}
    return inventory().to_dict() | {
        "cupy": cupy,
        "ucxx": ucx,
        "ucx_tls": tls or default_tls,
        "ucx_tls_source": "env" if tls else "hoplite_gpu default",
        "ucx_choice": choice,
        "data_plane": {"kind": plane, "why": plane_why},
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f}"


def _info(args: argparse.Namespace) -> int:
    report = node_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    cupy, ucx = report["cupy"], report["ucxx"]
    print(f"host: {report['host']}")
    driver, cuda = report["driver_version"], report["cuda_driver_version"]
    print(f"NVIDIA driver: {driver or 'none found'}" + (f" (CUDA {cuda})" if cuda else ""))
    if cupy["installed"]:
        count = cupy["device_count"] if cupy["device_count"] is not None else f"? ({cupy['error']})"
        usable = "usable" if cupy["usable"] else "not usable"
        print(f"CuPy: {cupy['version']}, {count} device(s), GPU buffers {usable}")
    else:
        print("CuPy: not installed (GPU buffers unavailable; pip install hoplite_gpu[cuda])")
    plane = report["data_plane"]
    print(f"data plane: {plane['kind']} ({plane['why']})")
    print(f"ucxx: {ucx['version'] if ucx['installed'] else 'not importable: ' + ucx['error']}")
    print(f"UCX transports: {report['ucx_tls']} ({report['ucx_tls_source']}; set UCX_TLS to change)")
    choice = report["ucx_choice"]
    settings = ", ".join(f"{k}={v}" for k, v in choice["effective"].items() if k.startswith("UCX_"))
    print(f"UCX choice for this host ({choice['case']}): {settings}")
    print(f"  from: {choice['source'] or 'no listing'}")
    for reason in choice["reasons"]:
        print(f"  why: {reason}")
    gpus = report["gpus"]
    if not gpus:
        print(f"no NVIDIA GPU visible: {report['error'] or 'NVML lists no device'}")
        return 0
    index = {g["uuid"]: g["index"] for g in gpus}
    rows = [("GPU", "name", "memory GiB (free)", "PCI bus", "NUMA", "NVLink peers", "CC")]
    for g in gpus:
        peers: dict[str, int] = {}
        for n in g["nvlinks"]:
            if n["active"]:
                peer = f"GPU{index[n['remote_uuid']]}" if n["remote_uuid"] in index else n["remote_kind"]
                peers[peer or "?"] = peers.get(peer or "?", 0) + 1
        cc = g["compute_capability"]
        rows.append(
            (
                str(g["index"]),
                g["name"],
                f"{_gib(g['memory_total_bytes'])} ({_gib(g['memory_free_bytes'])})",
                g["pci_bus_id"] or "?",
                "?" if g["numa_node"] is None else str(g["numa_node"]),
                ", ".join(f"{p} x{c}" for p, c in peers.items()) or "-",
                f"{cc[0]}.{cc[1]}" if cc else "?",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if report["error"]:
        print(f"note: {report['error']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hoplite-gpu`` command."""
    from .demo import DEFAULT_SIZES

    parser = argparse.ArgumentParser(prog="hoplite-gpu", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("directory", help="run a standalone directory")
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=_port, default=7070)
    d.add_argument(
        "--token-file",
        help="file holding the shared token, at least 16 characters (default: $HOPLITE_TOKEN, else "
        "the file $HOPLITE_TOKEN_FILE names, which must then exist; with neither set, a new token is "
        "generated and printed)",
    )
    d.set_defaults(func=_directory)
    h = sub.add_parser(
        "health", help="exit 0 if a directory is serving at an address (a container health check)"
    )
    h.add_argument("--address", help="host:port (default: $HOPLITE_DIRECTORY, else 127.0.0.1:7070)")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for its answer")
    h.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="probe over TLS (default: when $HOPLITE_TLS_CERT_FILE or $HOPLITE_TLS_CA_FILE is set)",
    )
    h.add_argument(
        "--tls-ca-file",
        help="CA certificates to check the directory's certificate and host with (implies --tls; "
        "default: $HOPLITE_TLS_CA_FILE; without one, a TLS probe checks neither)",
    )
    h.set_defaults(func=_health)
    m = sub.add_parser("demo", help="broadcast, reduce and allreduce demo on an embedded local cluster")
    m.add_argument("--workers", type=int, default=4)
    m.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated sizes, e.g. 1KiB,64MiB")
    m.set_defaults(func=_demo)
    i = sub.add_parser("info", help="what this node sees: driver, CuPy, UCX and the GPUs with their links")
    i.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    i.set_defaults(func=_info)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
