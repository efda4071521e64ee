#!/usr/bin/env python3
"""How fast ``torchpatch check`` scans: 1,000 files on one core, a benchmark script, never a test.

Two corpora of 1,000 ``.py`` files are copied into a temporary directory:

- ``torch``: the first 1,000 files (sorted by path, tests left out) of the installed torch's own
  ``distributed``, ``nn``, ``optim``, ``utils``, ``ao`` and ``fx`` packages, found on ``sys.path``
  without importing torch: real code that uses torch on nearly every line, and files larger than a
  training repository's;
- ``repos``: the fixture repositories of the test suite (tests/fixtures/repos, tests/fixtures/check:
  torchtitan, OpenDiT and Open-Sora in miniature), copied round-robin until there are 1,000 files.

Each corpus is scanned with ``torchpatch check DIR --torch 2.1.2 --json`` (the inventory: no torch
is imported anywhere) as a subprocess of this interpreter, end to end (interpreter start, catalogue,
parse, resolve, JSON out), after one unrecorded warm-up run, REPEATS times; the median wall and CPU
(user+sys) times are printed with the spread, and the machine's load average (other jobs slow the
wall time down). The process and its children are pinned to one CPU (``os.sched_setaffinity``) so
that "one core" means one core. Once, for scale: the same scan against
the installed torch, where names the inventory cannot decide cost one import of torch in a helper
process. Exit status 0 when every median wall time is under 5 s.

    python benchmarks/check.py                 # a python with torchpatch and torch installed
    python benchmarks/check.py --repeats 9 --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
FILES = 1000
TARGET_S = 5.0
TORCH_PACKAGES = ("distributed", "nn", "optim", "utils", "ao", "fx")


def torch_dir() -> Optional[Path]:
    for entry in sys.path:
        candidate = Path(entry or ".") / "torch"
        if (candidate / "__init__.py").is_file():
            return candidate
    return None


def copy_corpus(sources: List[Path], out: Path) -> Dict[str, Any]:
    """Copy ``sources`` round-robin into ``out`` until there are FILES files (flat, numbered)."""
    out.mkdir(parents=True)
    lines = size = 0
    for i in range(FILES):
        src = sources[i % len(sources)]
        data = src.read_bytes()
        (out / f"m{i:04d}_{src.stem}.py").write_bytes(data)
        lines += data.count(b"\n")
        size += len(data)
    return {"files": FILES, "distinct": min(len(sources), FILES), "lines": lines, "mb": round(size / 1e6, 2)}


def torch_sources() -> List[Path]:
    root = torch_dir()
    if root is None:
        raise SystemExit("torch is not on sys.path: run this with a python that has torch installed")
    found = [p for pkg in TORCH_PACKAGES for p in sorted((root / pkg).rglob("*.py"))
             if not {"test", "tests", "testing"}.intersection(p.relative_to(root).parts)]
    return found[:FILES]


def repo_sources() -> List[Path]:
    return sorted(p for d in ("repos", "check") for p in (REPO / "tests" / "fixtures" / d).rglob("*.py"))


def timed(cmd: List[str]) -> Dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.decode()}")
    rows = len(json.loads(proc.stdout)["rows"])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "rows": rows}


def child_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPATCH", "PYTHON"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return env


def measure(corpus: Path, extra: List[str], repeats: int) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "torchpatch", "check", str(corpus), "--json", *extra]
    timed(cmd)  # warm-up: file cache, .pyc files
    runs = [timed(cmd) for _ in range(repeats)]
    walls = sorted(r["wall"] for r in runs)
    cpus = sorted(r["cpu"] for r in runs)
    return {
        "args": extra,
        "rows": runs[0]["rows"],
        "wall_median_s": round(statistics.median(walls), 3),
        "wall_min_s": round(walls[0], 3),
        "wall_max_s": round(walls[-1], 3),
        "cpu_median_s": round(statistics.median(cpus), 3),
        "repeats": repeats,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # children inherit it
    results: Dict[str, Any] = {"python": sys.version.split()[0], "cpus": sorted(os.sched_getaffinity(0))
                               if hasattr(os, "sched_getaffinity") else None, "load_before": os.getloadavg(),
                               "corpora": {}}
    with tempfile.TemporaryDirectory(prefix="torchpatch-check-bench-") as tmp:
        for name, sources in (("torch", torch_sources()), ("repos", repo_sources())):
            corpus = Path(tmp) / name
            info = copy_corpus(sources, corpus)
            info["inventory"] = measure(corpus, ["--torch", "2.1.2"], args.repeats)
            info["installed"] = measure(corpus, [], max(3, args.repeats // 2))
            results["corpora"][name] = info
            shutil.rmtree(corpus)
    results["load_after"] = os.getloadavg()
    ok = all(c["inventory"]["wall_median_s"] < TARGET_S for c in results["corpora"].values())
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        load = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(results["load_before"][:1], results["load_after"][:1]))
        print(f"torchpatch check, {FILES} files, one CPU ({results['cpus']}), Python {results['python']},"
              f" machine load average before/after {load}:")
        for name, c in results["corpora"].items():
            inv, live = c["inventory"], c["installed"]
            print(f"  {name:<6} {c['lines']} lines ({c['mb']} MB, {c['distinct']} distinct files), {inv['rows']} names:"
                  f" --torch 2.1.2 median {inv['wall_median_s']} s wall (min {inv['wall_min_s']}, max"
                  f" {inv['wall_max_s']}), {inv['cpu_median_s']} s CPU; installed torch (one live import)"
                  f" median {live['wall_median_s']} s wall")
        print(f"target: median wall < {TARGET_S} s per corpus: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
