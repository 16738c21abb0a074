"""The CUDA kernels compile with nvcc for the GPUs we target (A100: sm_80, H100/H200: sm_90), with
every warning an error, on machines without a GPU (CI has nvcc 13). Skipped where nvcc is missing."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hoplite_gpu.memory import kernels

NVCC = shutil.which("nvcc")
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(NVCC is None, reason="needs nvcc"),
]
FLAGS = ["-std=c++14", "-cubin", "-Werror", "all-warnings", "-Xptxas", "-Werror"]


def instantiations() -> str:
    """A translation unit with reduce.cu and an explicit instantiation of every kernel that
    :func:`hoplite_gpu.memory.kernels.kernel_names` asks CuPy for."""
    lines = [f'#include "{kernels.kernels_dir() / "reduce.cu"}"']
    for name in kernels.kernel_names():
        match = re.fullmatch(r"(hoplite_\w+)<([^,>]+)(?:, \w+)?>", name)
        assert match, name
        kernel, ctype = match.groups()
        params = {
            "hoplite_reduce": f"{ctype}* __restrict__, const {ctype}* __restrict__, unsigned long long",
            "hoplite_average": f"{ctype}* __restrict__, unsigned long long, double",
            "hoplite_scale": f"{ctype}* __restrict__, unsigned long long, double",
            "hoplite_axpy": f"{ctype}* __restrict__, const {ctype}* __restrict__, unsigned long long, double",
        }[kernel]
        lines.append(f"template __global__ void {name}({params});")
    return "\n".join(lines) + "\n"


def nvcc(source: Path, arch: str) -> subprocess.CompletedProcess[str]:
    assert NVCC is not None
    return subprocess.run(
        [NVCC, *FLAGS, f"-arch=sm_{arch}", "-o", str(source.with_suffix(".cubin")), str(source)],
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.parametrize("arch", ["80", "90"])
def test_kernels_compile_without_warnings(tmp_path: Path, arch: str) -> None:
    source = tmp_path / "instantiate.cu"
    source.write_text(instantiations())
    done = nvcc(source, arch)
    assert done.returncode == 0, done.stderr
    cubin = source.with_suffix(".cubin").read_bytes()
    for kernel in ("hoplite_reduce", "hoplite_average", "hoplite_scale", "hoplite_axpy"):
        assert kernel.encode() in cubin


def test_the_flags_turn_a_warning_into_a_failure(tmp_path: Path) -> None:
    """The check above can fail: the same flags reject a kernel with an unused variable."""
    source = tmp_path / "warns.cu"
    source.write_text(instantiations() + "__global__ void warns(int* p) { int unused = 3; p[0] = 1; }\n")
    done = nvcc(source, "90")
    assert done.returncode != 0
    assert "unused" in done.stderr
