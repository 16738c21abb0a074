"""What UCX sees on this host: the text of ``ucx_info -d``, read once per boot.

``ucx_info -d`` opens every transport on every device, which is slow for a process start: 0.40 s
on the 2-core development machine (UCX 1.21 of the libucx wheel, TCP only; three runs 0.40-0.41 s),
where reading the copy cached for this boot takes about 0.5 ms. So the listing is cached per boot, in
``$XDG_RUNTIME_DIR/hoplite_gpu`` (else ``$XDG_CACHE_HOME`` or ``~/.cache``), under a key of the
boot id, the ``ucx_info`` binary (path, size, time) and the devices the kernel shows (RDMA
devices, NVIDIA device nodes, gdrcopy's), so a driver loaded later in the boot is probed anew. A
failed run is cached too (it means TCP only, today's defaults); where nothing can be cached, every
start runs ``ucx_info``. Nothing here raises: every failure is a :class:`Listing` without text.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: Seconds ``ucx_info -d`` may take before the probe gives up (TCP only, cached for the boot).
PROBE_TIMEOUT = 10.0
#: Bumped when the cached record changes shape.
_FORMAT = 1
_DEVICE_NODES = re.compile(r"^(nvidia\d+|nvidia-uvm|gdrdrv)$")


@dataclass(frozen=True)
class Listing:
    """The outcome of asking UCX what it sees.

    Attributes:
        text: The output of ``ucx_info -d``; None where it could not be had.
        problem: Why ``text`` is None ("" when it is not).
        source: Where it came from, in words (for ``hoplite-gpu info``).
    """

    text: str | None
    problem: str
    source: str


def ucx_info_path(environ: Mapping[str, str]) -> str | None:
    """The ``ucx_info`` of the UCX that ``ucxx`` loads: the libucx wheel's, or the one on ``PATH``
    where ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY`` asks libucx for the system's UCX; None if absent."""
    if environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false").lower() != "false":
        found = shutil.which("ucx_info", path=environ.get("PATH"))
        if found:
            return found
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "bin" / "ucx_info"
        if binary.is_file():
            return str(binary)
    return None


def rdma_devices() -> tuple[str, ...]:
    """The RDMA devices the kernel shows (``/sys/class/infiniband``), whatever UCX makes of them."""
    try:
        return tuple(sorted(os.listdir("/sys/class/infiniband")))
    except OSError:
        return ()


def _key(binary: str) -> str:
    """What the cached listing depends on: the boot, the binary and the devices."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        stat = os.stat(binary)
        made = f"{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        made = "?"
    try:
        nodes = sorted(n for n in os.listdir("/dev") if _DEVICE_NODES.match(n))
    except OSError:
        nodes = []
    return json.dumps([_FORMAT, boot, binary, made, rdma_devices(), nodes])


def _cache_dir(environ: Mapping[str, str]) -> Path | None:
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "hoplite_gpu"
    cache = environ.get("XDG_CACHE_HOME", "")
    if cache:
        return Path(cache) / "hoplite_gpu"
    with contextlib.suppress(RuntimeError, KeyError):
        return Path.home() / ".cache" / "hoplite_gpu"
    return None


def _cache_file(folder: Path, key: str) -> Path:
    boot = re.sub(r"[^0-9a-zA-Z]", "", json.loads(key)[1])[:8] or "x"
    return folder / f"ucx_info-{boot}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_cache(path: Path, key: str) -> Listing | None:
    try:
        record = json.loads(path.read_text())
        if record.get("key") != key:
            return None
        text, problem = record["text"], str(record["problem"])
        if text is not None and not isinstance(text, str):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Listing(text, problem, f"ucx_info -d, cached for this boot ({path})")


def _write_cache(path: Path, key: str, listing: Listing) -> None:
    """Store ``listing`` atomically (a temporary file renamed), removing other boots' copies."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".ucx_info-")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump({"key": key, "text": listing.text, "problem": listing.problem}, out)
            os.replace(temporary, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        boot = path.name.split("-")[1]
        for old in path.parent.glob("ucx_info-*.json"):
            if old.name.split("-")[1] != boot:
                with contextlib.suppress(OSError):
                    old.unlink()


def _run(binary: str, environ: Mapping[str, str]) -> Listing:
    """Run ``ucx_info -d`` with none of the user's UCX settings (they change what UCX lists)."""
    env = {k: v for k, v in environ.items() if not k.startswith(("UCX_", "UCXPY_"))}
    lib = Path(binary).parent.parent / "lib"
    if (lib / "libucp.so.0").exists():  # the wheel's binary finds its libraries only this way
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib), env.get("LD_LIBRARY_PATH")]))
    started = time.monotonic()
    try:
        done = subprocess.run(
            [binary, "-d"], capture_output=True, text=True, errors="replace", env=env, timeout=PROBE_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return Listing(None, f"ucx_info -d took more than {PROBE_TIMEOUT:g} s", binary)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return Listing(None, f"ucx_info -d exited with {done.returncode}: {last}", binary)
    return Listing(done.stdout, "", f"ucx_info -d ({binary}), run now in {seconds:.2f} s")


_memo: dict[str, Listing] = {}


def host_listing(environ: Mapping[str, str] | None = None) -> Listing:
    """This host's ``ucx_info -d``: from this process's memory, else this boot's cached copy, else
    run now (and cached). Never raises."""
    env = os.environ if environ is None else environ
    try:
        binary = ucx_info_path(env)
        if binary is None:
            return Listing(None, "ucx_info not found (no libucx wheel, no system UCX)", "")
        key = _key(binary)
        if key in _memo:
            return _memo[key]
        folder = _cache_dir(env)
        path = _cache_file(folder, key) if folder is not None else None
        listing = _read_cache(path, key) if path is not None else None
        if listing is None:
            listing = _run(binary, env)
            if path is not None:
                _write_cache(path, key, listing)
        _memo[key] = listing
        return listing
    except Exception as exc:  # never fail a node start over a probe
        return Listing(None, f"probing UCX failed: {type(exc).__name__}: {exc}", "")
