#!/usr/bin/env python3
"""What torchpatch costs when it is installed: a benchmark script that prints ratios, never a test.

Each measurement alternates its two sides (A, B, A, B, ...) so that drift on the machine hits both
alike, and reports the median of either side, the ratio (or difference) of the medians, the
interquartile range as % of the median, and a 95% bootstrap interval over the pairs, so that a
reader can tell whether a 1% difference is resolved (run-to-run noise is ~2% on a 2-core box).

1. ``startup``: ``python -c pass`` in a venv with torchpatch installed but off (``TORCHPATCH``
   unset: only ``torchpatch.pth``'s one line runs) vs an otherwise identical venv without it.
   Target: ratio <= 1.01.
2. ``armed``: ``python -c pass`` with ``TORCHPATCH=1`` vs unset, in the venv with torchpatch: what
   a process that never imports torch (a shell helper, pip, a data worker) pays when a cluster
   sets the flag job-wide. The start-up hook only puts a tiny finder on ``sys.meta_path`` that
   waits for ``import torch``. Target: ratio <= 1.02.
3. ``torch``: ``python -c "import torch, torch.distributed"`` with ``TORCHPATCH=1`` vs unset, in
   the venv with torchpatch. Target: ratio <= 1.01.
4. ``finder``: in one process of that venv, the extra cost of one non-torch import while
   torchpatch's finders are on ``sys.meta_path``: a tiny module is deleted from ``sys.modules`` and
   re-imported, in blocks alternating ``torchpatch.install()`` / ``uninstall()`` (and, as the
   floor CPython charges for any extra finder, a do-nothing finder); plus ``ImportWatcher.find_spec``
   called directly for an unwatched name, its pure added cost. Target: < 1 us each.

Subprocesses are timed with ``time.perf_counter`` around ``subprocess.run`` after unrecorded
warm-up runs; their CPU time (user+sys, less disturbed when other jobs share the machine) is
reported too, but the verdict is on wall time. Children get a clean environment (no
``TORCHPATCH*``/``PYTHON*`` variables) with CPU threads pinned to one (``OMP_NUM_THREADS``,
``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` = 1) to keep the noise down. By default the venvs are
built once and reused, under ``~/.cache/torchpatch/bench/{with,without}``: both get ``torch==2.13.0
numpy`` and torchpatch's dependencies, "with" also gets torchpatch built from this repository (a
copy: pass ``--rebuild`` after changing the source). Or pass ``--python-with``/``--python-without``.
Exit status 0 when every target is met.

    python benchmarks/startup.py                       # all four, default counts (~4 minutes)
    python benchmarks/startup.py --measure torch --torch-pairs 61 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "torchpatch" / "bench"
BASE_PACKAGES = ["torch==2.13.0", "numpy", "wrapt>=1.14", "packaging>=21"]  # torchpatch's deps too
TORCH_CODE = "import torch, torch.distributed"
TINY = "_torchpatch_bench_tiny"
Result = Dict[str, Any]


def child_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPATCH", "PYTHON", "VIRTUAL_ENV"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **extra)
    return env


def pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True)


def ensure_venv(directory: Path, with_torchpatch: bool, rebuild: bool) -> Path:
    """The venv's interpreter, building the venv first unless a finished one is there."""
    python, ready = directory / "bin" / "python", directory / ".bench-ready"
    if not ready.exists():
        print(f"building {directory} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(directory)], check=True)
        pip(python, *BASE_PACKAGES)
        if with_torchpatch:
            pip(python, str(REPO))
        ready.touch()
    elif with_torchpatch and rebuild:
        print(f"reinstalling torchpatch into {directory} ...", file=sys.stderr)
        pip(python, "--force-reinstall", "--no-deps", str(REPO))
    return python


def check_run(cmd: Sequence[str], env: Dict[str, str]) -> None:
    """One run that must succeed, shown in full if it does not (doubles as a warm-up)."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"benchmark command failed: {' '.join(cmd)}\n{done.stdout}{done.stderr}")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_run(cmd: Sequence[str], env: Dict[str, str], cpu: List[float]) -> float:
    """Wall-clock seconds of one run; its CPU seconds are appended to ``cpu``."""
    cpu0, start = children_cpu(), time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    cpu.append(children_cpu() - cpu0)
    return wall


def alternate(*sides: Callable[[], float], pairs: int) -> List[List[float]]:
    """Runs the sides in turn (A, B, A, B, ...), ``pairs`` times each; their timings."""
    out: List[List[float]] = [[] for _ in sides]
    for _ in range(pairs):
        for times, side in zip(out, sides):
            times.append(side())
    return out


def iqr_pct(xs: Sequence[float]) -> float:
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return 100.0 * (q3 - q1) / statistics.median(xs)


def summarize(name: str, xs: List[float], ys: Optional[List[float]], labels: Sequence[str], unit: str,
              scale: float, target: float, as_ratio: bool) -> Result:
    """Medians, spread and verdict for median(xs)/median(ys) if ``as_ratio``, else their difference
    (with no ``ys``: the median of ``xs``); the 95% interval resamples the pairs together."""
    samples = [xs] if ys is None else [xs, ys]
    ys = ys if ys is not None else [0.0] * len(xs)
    stat: Callable[[float, float], float] = (lambda a, b: a / b) if as_ratio else (lambda a, b: (a - b) * scale)
    value = stat(statistics.median(xs), statistics.median(ys))
    rng, n, boot = random.Random(12345), len(xs), []
    for _ in range(2000):
        pick = rng.choices(range(n), k=n)
        boot.append(stat(statistics.median([xs[i] for i in pick]), statistics.median([ys[i] for i in pick])))
    boot.sort()
    lo, hi = boot[50], boot[1949]
    return {
        "measurement": name, "pairs": n, "unit": unit, "target": target, "labels": list(labels),
        "ratio" if as_ratio else "difference": value, "ci95": [lo, hi],
        "median": [statistics.median(s) * scale for s in samples], "iqr_pct": [iqr_pct(s) for s in samples],
        "pass": value <= target if as_ratio else value < target, "resolved": hi <= target or lo > target,
    }


def measure_pair(name: str, what: str, a: Sequence[str], env_a: Dict[str, str], b: Sequence[str],
                 env_b: Dict[str, str], labels: Sequence[str], pairs: int, warmup: int,
                 target: float = 1.01) -> Result:
    for _ in range(warmup):
        check_run(a, env_a)
        check_run(b, env_b)
    cpu_a: List[float] = []
    cpu_b: List[float] = []
    xs, ys = alternate(lambda: time_run(a, env_a, cpu_a), lambda: time_run(b, env_b, cpu_b), pairs=pairs)
    result = summarize(name, xs, ys, labels, "ms", 1e3, target, True)
    return dict(result, what=what, cpu=summarize("cpu", cpu_a, cpu_b, labels, "ms", 1e3, target, True))


def report(r: Result) -> None:
    paired = len(r["labels"]) == 2
    print(f"\n== {r['measurement']}: {r['what']} ({r['pairs']} {'alternated pairs' if paired else 'rounds'})")
    print(f"  {'':<34}{'median':>14}{'IQR % of median':>18}")
    for label, med, iqr in zip(r["labels"], r["median"], r["iqr_pct"]):
        print(f"  {label:<34}{med:>11.3f} {r['unit']:<3}{iqr:>17.2f}%")
    kind, op = ("ratio", "<=") if "ratio" in r else ("difference", "<")
    value, (lo, hi) = r[kind], r["ci95"]
    unit = "" if kind == "ratio" else f" {r['unit']}"
    what = f"{kind} of medians" if paired else "median"
    print(f"  {what} {value:.4f}{unit}, 95% bootstrap CI [{lo:.4f}, {hi:.4f}]{unit}")
    if "cpu" in r:
        c = r["cpu"]
        print(f"  CPU time (user+sys): medians {c['median'][0]:.3f} / {c['median'][1]:.3f} ms, IQR "
              f"{c['iqr_pct'][0]:.2f}% / {c['iqr_pct'][1]:.2f}%, ratio {c['ratio']:.4f}, "
              f"CI [{c['ci95'][0]:.4f}, {c['ci95'][1]:.4f}]")
    if "nop_finder_us" in r:
        print(f"  for reference, a do-nothing finder first on sys.meta_path adds {r['nop_finder_us']:.4f} us")
    resolved = "resolved" if r["resolved"] else "not resolved: the CI straddles the target"
    print(f"{'PASS' if r['pass'] else 'FAIL'} {r['measurement']}: {what} {value:.4f}{unit} {op} "
          f"{r['target']}{unit} ({resolved})")


def finder_child(rounds: int, imports: int, calls: int) -> Dict[str, List[float]]:
    """Runs inside the venv with torchpatch (``--_finder-child``): seconds per import / call."""
    import torchpatch
    from torchpatch._hooks import ImportWatcher

    tmp = tempfile.TemporaryDirectory()
    Path(tmp.name, TINY + ".py").write_text("X = 1\n")
    sys.path.insert(0, tmp.name)

    def block() -> float:
        gc.disable()
        start = time.perf_counter()
        for _ in range(imports):
            del sys.modules[TINY]
            __import__(TINY)
        elapsed = time.perf_counter() - start
        gc.enable()
        return elapsed / imports

    def side(active: bool) -> float:
        # Every side pays install()'s work (it cools the CPU caches) and an unrecorded block after.
        torchpatch.install()
        if not active:
            torchpatch.uninstall()
        block()
        try:
            return block()
        finally:
            torchpatch.uninstall()

    class NopFinder:
        def find_spec(self, *args: object) -> None:
            return None

    def nop_side() -> float:
        sys.meta_path.insert(0, NopFinder())
        try:
            return side(False)
        finally:
            del sys.meta_path[0]

    __import__(TINY)
    side(True), side(False), nop_side()  # warm-up: the catalogue's modules, the directory cache
    with_tp, without, nop = alternate(lambda: side(True), lambda: side(False), nop_side, pairs=rounds)

    torchpatch.install()
    find_spec = next(f for f in sys.meta_path if isinstance(f, ImportWatcher)).find_spec
    per_call, loop = [], range(calls)
    for _ in range(rounds):
        gc.disable()
        start = time.perf_counter()
        for _ in loop:
            find_spec(TINY, None, None)
        per_call.append((time.perf_counter() - start) / calls)
        gc.enable()
    torchpatch.uninstall()
    tmp.cleanup()
    return {"with": with_tp, "without": without, "nop": nop, "find_spec": per_call}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--python-with", type=Path, help="interpreter of a venv with torchpatch")
    ap.add_argument("--python-without", type=Path, help="interpreter of the same venv without it")
    ap.add_argument("--cache", type=Path, default=CACHE, help="where the venvs are built (%(default)s)")
    ap.add_argument("--rebuild", action="store_true", help="reinstall torchpatch in the 'with' venv")
    ap.add_argument("--measure", action="append", choices=["startup", "armed", "torch", "finder"],
                    help="run only these (repeatable; default: all)")
    ap.add_argument("--startup-pairs", type=int, default=150)
    ap.add_argument("--torch-pairs", type=int, default=21)
    ap.add_argument("--finder-rounds", type=int, default=101, help="alternated blocks per side")
    ap.add_argument("--finder-imports", type=int, default=500, help="imports per block")
    ap.add_argument("--finder-calls", type=int, default=200_000, help="find_spec calls per round")
    ap.add_argument("--warmup", type=int, default=3, help="unrecorded runs of each side first")
    ap.add_argument("--json", action="store_true", help="print the results as JSON only")
    ap.add_argument("--_finder-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._finder_child:
        print(json.dumps(finder_child(args.finder_rounds, args.finder_imports, args.finder_calls)))
        return 0

    measures = args.measure or ["startup", "armed", "torch", "finder"]
    py_with = str(args.python_with or ensure_venv(args.cache / "with", True, args.rebuild))
    py_without = args.python_without
    if py_without is None and "startup" in measures:
        py_without = ensure_venv(args.cache / "without", False, False)
    off, on = child_env(), child_env(TORCHPATCH="1")
    results: List[Result] = []

    if "startup" in measures:
        check_run([py_with, "-c", "import _torchpatch_startup"], off)  # torchpatch is really there
        results.append(measure_pair(
            "startup", "python -c pass", [py_with, "-c", "pass"], off, [str(py_without), "-c", "pass"], off,
            ("with torchpatch, TORCHPATCH unset", "without torchpatch"), args.startup_pairs, args.warmup))
    if "armed" in measures:
        cmd = [py_with, "-c", "pass"]
        check_run([py_with, "-c", "import sys; assert sys.modules['_torchpatch_startup'].pending()"], on)
        results.append(measure_pair("armed", "python -c pass", cmd, on, cmd, off,
                                    ("TORCHPATCH=1 (torch never imported)", "TORCHPATCH unset"),
                                    args.startup_pairs, args.warmup, target=1.02))
    if "torch" in measures:
        cmd = [py_with, "-c", TORCH_CODE]
        check_run([py_with, "-c", TORCH_CODE + ", torchpatch; assert torchpatch.is_installed()"], on)
        results.append(measure_pair("torch", f'python -c "{TORCH_CODE}"', cmd, on, cmd, off,
                                    ("TORCHPATCH=1", "TORCHPATCH unset"), args.torch_pairs, args.warmup))
    if "finder" in measures:
        done = subprocess.run(
            [py_with, __file__, "--_finder-child", f"--finder-rounds={args.finder_rounds}",
             f"--finder-imports={args.finder_imports}", f"--finder-calls={args.finder_calls}"],
            env=off, capture_output=True, text=True, check=True)
        child = json.loads(done.stdout)
        r = summarize("finder-import", child["with"], child["without"], ("installed", "uninstalled"),
                      "us", 1e6, 1.0, False)
        r["nop_finder_us"] = (statistics.median(child["nop"]) - statistics.median(child["without"])) * 1e6
        r["what"] = f"re-import of a tiny module, {args.finder_imports} imports per block"
        results.append(r)
        results.append(dict(summarize("find_spec", child["find_spec"], None, ["ImportWatcher.find_spec, per call"],
                                      "us", 1e6, 1.0, False),
                            what=f"direct calls for an unwatched name, {args.finder_calls} per round"))

    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"python {sys.version.split()[0]}; with: {py_with}; without: {py_without}; threads pinned to 1")
        for r in results:
            report(r)
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
