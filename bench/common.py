"""Shared helpers of the benchmarks (re-exported from :mod:`hoplite_gpu.baselines`)."""

from __future__ import annotations

from hoplite_gpu.baselines import (
    format_size,
    markdown_table,
    memcpy_gbps,
    parse_size,
    socket_copy_gbps,
    socket_copy_times,
    stop_workers,
)

__all__ = [
    "format_size",
    "markdown_table",
    "memcpy_gbps",
    "parse_size",
    "socket_copy_gbps",
    "socket_copy_times",
    "stop_workers",
]
