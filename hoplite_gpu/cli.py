"""Command line: ``hoplite-gpu directory`` and ``hoplite-gpu demo``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from .auth import new_token
from .config import Config


def _directory(args: argparse.Namespace) -> int:
    from .directory.service import DirectoryService

    token = os.environ.get("HOPLITE_TOKEN", "")
    if args.token_file:
        with open(args.token_file) as fh:
            token = fh.read().strip()
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
        help="file holding the shared token (default: $HOPLITE_TOKEN, "
        "else a new token is generated and printed)",
    )
    d.set_defaults(func=_directory)
    m = sub.add_parser("demo", help="broadcast, reduce and allreduce demo on an embedded local cluster")
    m.add_argument("--workers", type=int, default=4)
    m.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated sizes, e.g. 1KiB,64MiB")
    m.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
