"""Command line: ``hoplite-gpu directory``, ``hoplite-gpu health`` and ``hoplite-gpu demo``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from .auth import new_token, read_token_file, token_from_env
from .config import Config
from .errors import HopliteError


def _directory(args: argparse.Namespace) -> int:
    from .directory.service import DirectoryService

    try:
        token = read_token_file(args.token_file) if args.token_file else token_from_env()
    except HopliteError as exc:
        print(f"hoplite-gpu directory: {exc}", file=sys.stderr)
        return 2
    generated = not token
    if generated:
        token = new_token()
    config = Config.from_env()

    async def serve() -> None:
        service = DirectoryService.from_config(token, args.host, args.port, config)
        await service.start()
        print(f"hoplite-gpu directory listening on {service.address}", flush=True)
        if generated:
            print(f"HOPLITE_TOKEN={token}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await service.stop()

    asyncio.run(serve())
    return 0


async def probe(address: str, timeout: float) -> None:
    """Check that a directory at ``address`` is serving: it accepts a connection and sends its
    authentication challenge within ``timeout`` seconds (no token is needed, nothing is
    registered; the connection is closed before the handshake goes further).

    Raises:
        DirectoryUnavailableError: no connection, no challenge, or something else came back.
    """
    from . import protocol as p
    from .control import parse_address
    from .errors import DirectoryUnavailableError

    host, port = parse_address(address)

    async def first_frame() -> p.Message:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            return await p.read_frame(reader, 4096)
        finally:
            writer.close()

    try:
        first = await asyncio.wait_for(first_frame(), timeout)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, HopliteError) as exc:
        raise DirectoryUnavailableError(
            f"no directory serving at {address}: {str(exc) or type(exc).__name__}",
            peer=address,
            cause=type(exc).__name__,
        ) from exc
    if not isinstance(first, p.Challenge):
        raise DirectoryUnavailableError(
            f"{address} answered with {first.TYPE!r}, not a directory's challenge",
            peer=address,
            cause="protocol",
        )


def _health(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("HOPLITE_DIRECTORY") or "127.0.0.1:7070"
    try:
        asyncio.run(probe(address, args.timeout))
    except HopliteError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    print(f"directory at {address} is serving")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import main

    return main(workers=args.workers, sizes=args.sizes)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hoplite-gpu`` command."""
    from .demo import DEFAULT_SIZES

    parser = argparse.ArgumentParser(prog="hoplite-gpu", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("directory", help="run a standalone directory")
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=7070)
    d.add_argument(
        "--token-file",
        help="file holding the shared token (default: $HOPLITE_TOKEN, else the file "
        "$HOPLITE_TOKEN_FILE names if it exists, else a new token is generated and printed)",
    )
    d.set_defaults(func=_directory)
    h = sub.add_parser(
        "health", help="exit 0 if a directory is serving at an address (a container health check)"
    )
    h.add_argument("--address", help="host:port (default: $HOPLITE_DIRECTORY, else 127.0.0.1:7070)")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for its answer")
    h.set_defaults(func=_health)
    m = sub.add_parser("demo", help="broadcast, reduce and allreduce demo on an embedded local cluster")
    m.add_argument("--workers", type=int, default=4)
    m.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated sizes, e.g. 1KiB,64MiB")
    m.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
