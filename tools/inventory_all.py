"""Build the inventory of every torch release torchpatch knows, one throw-away venv each (a one-off job).

    python tools/inventory_all.py                  # every version in VERSIONS that has no inventory yet
    python tools/inventory_all.py 2.6.0 2.15.0     # these (rebuilt if present)
    python tools/inventory_all.py --python 2.13.0=/path/to/venv/bin/python   # reuse an existing torch

Each venv is created under a temporary directory, gets torch (a CUDA build from the package index,
3-5 GB, or a wheel pip finds locally), runs ``tools/inventory.py`` and is deleted. Releases newer than
a machine's pip constraint are installed with pip's config files off (``PIP_CONFIG_FILE=/dev/null``).
This is not part of CI: the inventories are committed data (``patches/_data/inventory``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "src" / "torchpatch" / "patches" / "_data" / "inventory"
# 1.13.1 and one release of every minor from 2.0 on; 2.9.0 is the matrix's (torch_xla's) release.
VERSIONS = ["1.13.1", "2.0.1", "2.1.2", "2.2.2", "2.3.1", "2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0",
            "2.9.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
# The newest release a machine-wide pip constraint may still allow; newer ones install without pip's config.
CONSTRAINED_ABOVE = Version("2.14.1")


def _pip_env(version: str) -> dict:
    env = dict(os.environ)
    if Version(version) > CONSTRAINED_ABOVE:
        env["PIP_CONFIG_FILE"] = os.devnull
    return env


def build(version: str, python: str | None) -> None:
    if python:
        subprocess.run([python, str(ROOT / "tools" / "inventory.py")], check=True)
        return
    with tempfile.TemporaryDirectory(prefix=f"inventory-torch-{version}-") as tmp:
        venv.create(tmp, with_pip=True)
        py = os.path.join(tmp, "bin", "python")
        numpy = "numpy<2" if Version(version) < Version("2.3") else "numpy"
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-cache-dir", f"torch=={version}", numpy],
                       check=True, env=_pip_env(version))
        subprocess.run([py, str(ROOT / "tools" / "inventory.py")], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="*", help="torch versions (default: those in VERSIONS without an inventory)")
    parser.add_argument("--python", action="append", default=[], metavar="VERSION=PYTHON",
                        help="use this interpreter (with that torch installed) instead of a new venv")
    args = parser.parse_args()
    reuse = dict(item.split("=", 1) for item in args.python)
    versions = args.versions or [v for v in VERSIONS if not (OUT / f"torch-{v}.json.gz").exists()] + [
        v for v in reuse if v not in args.versions]
    failed = []
    for version in dict.fromkeys(versions):
        print(f"== torch {version}", flush=True)
        try:
            build(version, reuse.get(version))
        except subprocess.CalledProcessError as exc:
            print(f"torch {version}: {exc}", file=sys.stderr)
            failed.append(version)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
