"""What can be checked of the GPU worker image on a machine without a GPU (run inside the image by
``make docker-test``; on a GPU host it also reports the devices CuPy sees).

- hoplite_gpu and CuPy import; the CUDA runtime and NVRTC libraries that came as wheels load;
- NVRTC (the compiler CuPy uses at run time) compiles ``kernels/reduce.cu`` with every kernel
  instantiation ``hoplite_gpu.memory.kernels`` asks for, for sm_80 and sm_90, to CUBIN, with no device;
- ``hoplite_gpu.memory.kernels.available()`` tells whether a GPU is visible (false here, by design).

Prints one JSON object; exits 1 if a check failed.
"""

from __future__ import annotations

import json
import sys


def _nvrtc_compile(source: str, arch: str, names: list[str], include: str) -> int:
    """Bytes of CUBIN for ``arch`` (NVRTC straight, as CuPy's compiler needs a device to pick one)."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "reduce.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, ["--std=c++14", f"-arch=sm_{arch}", f"-I{include}"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"sm_{arch}: {exc}\n{nvrtc.getProgramLog(prog)}") from exc
        for name in names:
            nvrtc.getLoweredName(prog, name)  # raises if an instantiation is missing
        return len(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


def main() -> int:
    report: dict[str, object] = {}
    failed: list[str] = []
    try:
        import cupy

        import hoplite_gpu
        from hoplite_gpu.memory import kernels

        report["hoplite_gpu"] = hoplite_gpu.__version__
        report["cupy"] = cupy.__version__
    except Exception as exc:  # report every failure, not only the first
        print(json.dumps({"failed": [f"import: {exc!r}"]}))
        return 1
    try:
        import cuda.pathfinder as pathfinder

        libs = {name: pathfinder.load_nvidia_dynamic_lib(name).abs_path for name in ("cudart", "nvrtc")}
        report["libraries"] = libs
        include = pathfinder.find_nvidia_header_directory("cudart")
        report["cuda_headers"] = include
    except Exception as exc:
        failed.append(f"CUDA libraries: {exc!r}")
        include = None
    source_path = kernels.kernels_dir() / "reduce.cu"
    report["kernels"] = str(source_path)
    if include is not None:
        try:
            source = source_path.read_text()
            names = kernels.kernel_names()
            report["instantiations"] = len(names)
            report["cubin_bytes"] = {
                f"sm_{arch}": _nvrtc_compile(source, arch, names, include) for arch in ("80", "90")
            }
        except Exception as exc:
            failed.append(f"kernel compile: {exc}")
    report["gpu_visible"] = kernels.available()
    if report["gpu_visible"]:
        report["devices"] = [
            cupy.cuda.runtime.getDeviceProperties(i)["name"].decode()
            for i in range(cupy.cuda.runtime.getDeviceCount())
        ]
    report["failed"] = failed
    print(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
