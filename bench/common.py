"""Shared helpers of the benchmarks (re-exported from :mod:`hoplite_gpu.baselines`)."""

from __future__ import annotations

import argparse

from hoplite_gpu.baselines import (
    format_size,
    markdown_table,
    memcpy_gbps,
    parse_size,
    socket_copy_gbps,
    socket_copy_times,
    start_workers,
    stop_workers,
)

__all__ = [
    "cluster_arguments",
    "cluster_options",
    "format_size",
    "markdown_table",
    "memcpy_gbps",
    "parse_rate",
    "parse_size",
    "socket_copy_gbps",
    "socket_copy_times",
    "start_workers",
    "stop_workers",
]


def parse_rate(text: str) -> float:
    """A link rate in bytes/s from ``"100MB"``, ``"1GB"`` or a plain number."""
    return float(text.upper().replace("GB", "e9").replace("MB", "e6"))


def cluster_options(
    description: str, prefix: str, hosts: int, hosts_help: str | None = None
) -> argparse.ArgumentParser:
    """A parser with the emulated cluster's options: ``--hosts``, ``--rate`` and ``--prefix``."""
    formatter = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(description=description, formatter_class=formatter)
    ap.add_argument("--hosts", type=int, default=hosts, help=hosts_help)
    ap.add_argument("--rate", default="100MB", help="link bandwidth per direction (bytes/s: 100MB, 1GB)")
    ap.add_argument("--prefix", default=prefix, help="namespace prefix of the emulated cluster")
    return ap


def cluster_arguments(description: str, sizes: str, prefix: str) -> argparse.ArgumentParser:
    """The command-line options shared by the emulated-cluster benchmarks run on their own."""
    ap = cluster_options(description, prefix, hosts=4)
    ap.add_argument("--sizes", default=sizes)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    return ap
