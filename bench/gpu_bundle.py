"""Pack downloaded wheels into one archive the GPU machine unpacks as its site directory.

``make gpu-wheels`` runs this. The device tool carries at most 64 MiB per call, and the wheels
the GPU check needs are larger than that once Ray is among them (Ray's alone is 76 MiB). Wheels
are zip files, compressed file by file, so they do not compress further. This script unpacks
them instead, as ``pip install --no-deps --target`` would: none of these wheels has a ``.data``
directory, and entry-point scripts are not needed. It then removes what the check never loads
(``TRIM``), hard-links files with identical bytes (the UCX wheel holds each shared library
three times, because wheels cannot hold symbolic links), and writes one xz-compressed tar.

On the GPU machine, ``tar -xJf site.tar.xz -C DIR`` and ``PYTHONPATH=DIR`` stand in for the pip
install. The RECORD files still list the removed files; ``pip check`` does not read them.

Usage: ``python bench/gpu_bundle.py WHEEL_DIR OUT.tar.xz``
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: Paths (relative to the site directory, glob patterns) the GPU check never loads: Ray's Java
#: jars, its libraries on top of Ray core, its dashboard's web front end and source maps, and the
#: static libraries of the UCX and RAPIDS wheels (only their shared libraries are loaded).
TRIM = (
    "ray/jars",
    "ray/rllib",
    "ray/tune",
    "ray/train",
    "ray/data",
    "ray/serve",
    "ray/dashboard/client/build",
    "ray/**/*.map",
    "**/*.a",
)


def unpack(wheel: Path, site: Path) -> None:
    """Extract ``wheel`` into ``site``, keeping the executable bits (zipfile drops them)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = Path(z.extract(info, site))
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                path.chmod(mode)


def trim(site: Path) -> int:
    """Remove ``TRIM`` from ``site``; the bytes removed."""
    removed = 0
    for pattern in TRIM:
        for path in sorted(site.glob(pattern), reverse=True):
            if path.is_dir() and not path.is_symlink():
                removed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path)
            elif path.exists():
                removed += path.stat().st_size
                path.unlink()
    return removed


def link_duplicates(site: Path) -> int:
    """Replace each file whose bytes another file already has by a hard link to it; the bytes
    saved."""
    seen: dict[tuple[int, str], Path] = {}
    saved = 0
    for path in sorted(p for p in site.rglob("*") if p.is_file() and not p.is_symlink()):
        size = path.stat().st_size
        if size < 4096:
            continue
        key = (size, hashlib.sha256(path.read_bytes()).hexdigest())
        first = seen.setdefault(key, path)
        if first is not path and first.stat().st_mode == path.stat().st_mode:
            path.unlink()
            os.link(first, path)
            saved += size
    return saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheels", type=Path, help="directory of the downloaded wheels")
    ap.add_argument("out", type=Path, help="the archive to write (.tar.xz)")
    args = ap.parse_args()
    wheels = sorted(args.wheels.glob("*.whl"))
    if not wheels:
        print(f"gpu_bundle: no wheels in {args.wheels}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hoplite-gpu-site-") as tmp:
        site = Path(tmp)
        for wheel in wheels:
            unpack(wheel, site)
        removed = trim(site)
        saved = link_duplicates(site)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "wb") as out:
            tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
            assert tar.stdout is not None
            xz = subprocess.run(["xz", "-T0", "-6"], stdin=tar.stdout, stdout=out, check=False)
            tar.stdout.close()
            if tar.wait() != 0 or xz.returncode != 0:
                print("gpu_bundle: tar | xz failed", file=sys.stderr)
                return 1
    mib = 1 << 20
    print(
        f"gpu_bundle: {len(wheels)} wheels -> {args.out} ({args.out.stat().st_size / mib:.1f} MiB; "
        f"{removed / mib:.0f} MiB never loaded left out, {saved / mib:.0f} MiB of duplicates linked)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
