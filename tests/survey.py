"""Import survey: which modules of a training repository import on a given torch, without and with torchpatch.

The fixture repositories under ``tests/fixtures/repos/`` are written in the shape of real ones
(torchtitan of June 2024 and February 2025, OpenDiT, Open-Sora; see the README there). Every module
of a repository is imported in a fresh interpreter of the target Python, exactly as
``python -c "import pkg.mod"`` would, with the repository root and ``_stubs`` (import-only stand-ins
for third-party packages other than torch) on ``PYTHONPATH``; once with ``TORCHPATCH`` unset and
once with ``TORCHPATCH=1``. The import rate is the number of modules that import over the number of
modules; for each failure the survey keeps the last line of the error and the innermost repository
frame it came from.

    python tests/survey.py                                    # this interpreter's torch
    python tests/survey.py --python /venvs/t21/bin/python --python /venvs/t24/bin/python
    python tests/survey.py --json --package opendit

Isolation (``--isolation``): ``fresh`` starts a new interpreter for every module, as described above;
it pays torch's import (2-5 s on these builds) every time. ``fork`` (the default) starts one
interpreter per worker and mode, with the same environment, that imports ``torch`` and
``torch._dynamo`` (where torch has it) and nothing else, then forks a child for each module: the
child chdirs to the repository root, puts the root on ``sys.path`` where ``PYTHONPATH`` would, imports
the module and reports. Each module is still imported in a process of its own, on top of torch
alone: every surveyed module imports torch first, and torch's own DTensor, DCP, FSDP2 and pipelining
import ``torch._dynamo`` (1.7-2.8 s of CPU a process). The
``.pth`` hook started torchpatch in the server as it would in a fresh interpreter, and patches apply
as their torch modules are imported, in the server or in the child. Modules that share a package
are forked from a child that imported that package first, recursively (``import a.b.c`` imports ``a``
and ``a.b`` before ``a.b.c``, so it is where a fresh interpreter would be): torchtitan's package
imports everything it has (datasets, inductor, tensorboard: 4.4 s of CPU on torch 2.15), which a child
per module paid again each time (200 s for torchtitan 0.1.0's survey on one torch; 25 s now). Where a
package does not import, every module under it fails with its error, as a fresh import would (the
server's comment below says more). The test suite checks a sample
of modules in ``fresh`` isolation against ``fork``. Two workers by default.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

REPOS = Path(__file__).resolve().parent / "fixtures" / "repos"
STUBS = REPOS / "_stubs"
PACKAGES = ("titan2406", "titan2502", "opendit", "opensora")


@dataclass(frozen=True)
class Tree:
    """Where a surveyed package's modules are: ``root`` goes on ``sys.path`` (and is the working
    directory); ``top`` limits the survey to one package under it ("": every module under ``root``),
    ``exclude`` leaves subpackages of it out; ``stubs`` puts the import-only stand-ins on the path
    (fixture repositories; an installed package uses the real third-party packages of the venv)."""

    root: Path
    top: str = ""
    exclude: Tuple[str, ...] = ()
    stubs: bool = True

    def path(self) -> str:
        """The ``sys.path`` entries of an import from this tree, joined by ``os.pathsep``."""
        return os.pathsep.join([str(self.root)] + ([str(STUBS)] if self.stubs else []))


# Surveyed packages by name: the fixture repositories, plus installed ones (``installed``).
TREES: Dict[str, Tree] = {name: Tree(REPOS / name) for name in PACKAGES}


def installed(root: str, top: str, exclude: Sequence[str] = ()) -> str:
    """Register the package ``top`` installed under ``root`` (``pip install --target root``) for a
    survey, without ``exclude`` subpackages; its name in the results: ``top@<root's name>``."""
    name = f"{top}@{Path(root).name}"
    TREES[name] = Tree(Path(root).resolve(), top, tuple(exclude), stubs=False)
    return name
MODES = ("off", "on")
MARK = "TORCHPATCH-SURVEY "

# Runs in the interpreter that imports the module: the import itself is ``import <module>``; the
# rest only reports (the last line of the error, the innermost frame inside the repository, and
# which torchpatch patches were applied or failed): whether it imported, and the report's line.
_PROBE_FUNCTION = textwrap.dedent(
    """
    def probe(name, root):
        import json, sys, traceback
        result = {"ok": True}
        try:
            __import__(name)
        except BaseException as exc:
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(root)]
            where = frames[-1] if frames else None
            result = {
                "ok": False,
                "error": traceback.format_exception_only(type(exc), exc)[-1].strip(),
                "where": f"{where.filename[len(root) + 1:]}:{where.lineno}" if where else "",
            }
        torch = sys.modules.get("torch")
        result["torch"] = getattr(torch, "__version__", "")
        torchpatch = sys.modules.get("torchpatch")
        result["torchpatch"] = torchpatch is not None and torchpatch.is_installed()
        if result["torchpatch"]:
            result["patches"] = {k: v for k, v in torchpatch.status().items() if v in ("applied", "failed")}
        return result["ok"], %r + json.dumps(result)
    """
    % MARK
)
_PROBE = _PROBE_FUNCTION + "\nimport sys\nprint(probe(sys.argv[1], sys.argv[2])[1], flush=True)\n"

# The fork server: imports torch (and torch._dynamo) once, then serves requests on stdin,
# "<path>\t<module> <module> ...": the tree's sys.path entries (the first its root) and the modules. Each
# module is imported in a child of its own, which reports as _PROBE does; the server then prints END, the
# child's wait status and the module. Modules under a package that two or more of them share are forked
# from a child that imported that package (recursively: a.b.c and a.b.d from a child of a's child that
# imported a.b): Python imports a module's parent packages before the module, so each is where a fresh
# ``import <module>`` would be. Where a package does not import, every module under it fails with its
# error (as ``import <module>`` would: the package is imported first); where its child dies, the modules
# under it that are left are forked from the level above, one by one.
_SERVER = _PROBE_FUNCTION + textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    try:
        import torch._dynamo
    except ModuleNotFoundError as exc:  # torch 1.13 has none; anything else is an error of the survey
        if exc.name != "torch._dynamo":
            raise
    TIMEOUT = int(sys.argv[1])
    END = %r
    entered = False

    def root(path):
        return path.split(os.pathsep)[0]

    def enter(path):
        global entered
        if not entered:
            os.chdir(root(path))
            sys.path[1:1] = path.split(os.pathsep)
            entered = True

    def fork():
        sys.stdout.flush()
        sys.stderr.flush()
        return os.fork()

    def serve(path, name):
        pid = fork()
        if pid == 0:
            signal.alarm(TIMEOUT)
            enter(path)
            print(probe(name, root(path))[1], flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(END + f"{status} {name}", flush=True)

    def serve_under(path, package, names):
        # the names that a child which imported package served (none where its process died)
        done_r, done_w = os.pipe()
        pid = fork()
        if pid == 0:
            os.close(done_r)
            signal.alarm(TIMEOUT)
            enter(path)
            ok, report = probe(package, root(path))
            signal.alarm(0)
            served = lambda name: os.write(done_w, (name + "\\n").encode())
            if ok:
                serve_all(path, package, names, served)
            else:  # importing any module under it raises the package's error, in a fresh interpreter too
                for name in names:
                    print(report + "\\n" + END + f"0 {name}", flush=True)
                    served(name)
            os._exit(0)
        os.close(done_w)
        with os.fdopen(done_r, "rb") as done:
            served = set(done.read().decode().split())
        os.waitpid(pid, 0)
        return served

    def under(package, name):
        # the module right under package ("": the top level) that name is or lies in; package for itself
        if name == package:
            return name
        first = (name[len(package) + 1:] if package else name).split(".")[0]
        return package + "." + first if package else first

    def serve_all(path, package, names, served):
        # every name, in a process that imported package ("": the server)
        groups = {}
        for name in names:
            groups.setdefault(under(package, name), []).append(name)
        for key, members in groups.items():
            done = serve_under(path, key, members) if len(members) > 1 else set()
            for name in members:
                if name not in done:
                    serve(path, name)
                served(name)

    print(%r + json.dumps({"torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        path, names = line.rstrip("\\n").split("\\t")
        serve_all(path, "", names.split(), lambda name: None)
    """
    % (MARK + "END ", MARK + "READY ")
)


@dataclass
class ModuleResult:
    module: str
    ok: bool
    error: str = ""
    where: str = ""
    patches: Dict[str, str] = field(default_factory=dict)  # patch id -> "applied" / "failed"
    torchpatch: bool = False  # torchpatch was installed in the importing process


@dataclass
class PackageSurvey:
    package: str
    modules: List[str]
    results: Dict[str, Dict[str, ModuleResult]]  # mode -> module -> result

    def rate(self, mode: str) -> tuple:
        """(modules that import, modules) for ``mode`` ("off" or "on")."""
        results = self.results[mode]
        return sum(r.ok for r in results.values()), len(results)

    def failures(self, mode: str) -> Dict[str, ModuleResult]:
        return {m: r for m, r in sorted(self.results[mode].items()) if not r.ok}


@dataclass
class Survey:
    python: str
    torch: str
    seconds: float
    packages: Dict[str, PackageSurvey]

    def to_json(self) -> dict:
        return {
            "python": self.python,
            "torch": self.torch,
            "seconds": round(self.seconds, 1),
            "packages": {
                name: {"modules": pkg.modules, **{mode: _mode_json(pkg, mode) for mode in pkg.results}}
                for name, pkg in self.packages.items()
            },
        }


def _patches(pkg: PackageSurvey, mode: str, status: str) -> List[str]:
    """Patches with ``status`` in any process that imported a module of ``pkg`` in ``mode`` (by the
    module's imports, or by torch's own imports before it)."""
    return sorted({p for r in pkg.results[mode].values() for p, s in r.patches.items() if s == status})


def _mode_json(pkg: PackageSurvey, mode: str) -> dict:
    ok, total = pkg.rate(mode)
    return {
        "ok": ok,
        "total": total,
        "failures": {m: {"error": r.error, "where": r.where} for m, r in pkg.failures(mode).items()},
        "patches_applied": _patches(pkg, mode, "applied"),
        "patches_failed": _patches(pkg, mode, "failed"),
    }


def discover(package: str) -> List[str]:
    """Dotted names of every module of a surveyed package (packages, namespace dirs and scripts)."""
    tree = TREES[package]
    names = []
    for path in sorted((tree.root / tree.top).rglob("*.py")):
        parts = list(path.relative_to(tree.root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts and "__pycache__" not in parts and not (tree.top and parts[1:2] and parts[1] in tree.exclude):
            names.append(".".join(parts))
    return names


def survey_env(package: Optional[str], torchpatch: bool) -> Dict[str, str]:
    """The environment of an import: no TORCHPATCH*/launcher variables unless ``torchpatch``;
    ``PYTHONPATH`` starts with the package's tree (none for the fork server, whose children add it)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHPATCH", "PYTEST_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    roots = [TREES[package].path()] if package else []
    env["PYTHONPATH"] = os.pathsep.join(roots + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    if torchpatch:
        env["TORCHPATCH"] = "1"
    return env


def _parse(module: str, line: str) -> tuple:
    data = json.loads(line[len(MARK):])
    result = ModuleResult(module, data["ok"], data.get("error", ""), data.get("where", ""), data.get("patches", {}), data["torchpatch"])
    return result, data["torch"]


def _died(module: str, status: int) -> ModuleResult:
    """The result of a forked import whose process died without reporting: a crash, or the time limit."""
    why = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}"
    return ModuleResult(module, False, f"the importing process died ({why})")


def import_fresh(python: str, package: str, module: str, torchpatch: bool, timeout: float = 300) -> tuple:
    """Import ``module`` of ``package`` in a fresh interpreter; (ModuleResult, torch version)."""
    root = str(TREES[package].root)
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE, module, root],
            env=survey_env(package, torchpatch),
            cwd=root,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return ModuleResult(module, False, f"timed out after {timeout:.0f} s"), ""
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return _parse(module, line)
    # the interpreter died without reporting (a crash, or an exit during interpreter start-up)
    tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return ModuleResult(module, False, f"interpreter exited with status {proc.returncode}: {tail}"), ""


class ForkServer:
    """One interpreter of ``python`` (TORCHPATCH per ``torchpatch``) that has imported torch and
    forks a child per module (under children that imported the packages the modules share). Not
    thread-safe: one per worker."""

    def __init__(self, python: str, torchpatch: bool, timeout: float = 300) -> None:
        self.stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: nobody has to drain it
        self.proc = subprocess.Popen(
            [python, "-c", _SERVER, str(int(timeout))],
            env=survey_env(None, torchpatch),
            cwd="/",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        ready = self._line()
        if not ready.startswith(MARK + "READY "):
            raise RuntimeError(f"the survey's fork server did not start under {python}: {ready!r}")
        self.torch = json.loads(ready[len(MARK + "READY "):])["torch"]

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            status = self.proc.wait()
            self.stderr.seek(0)
            tail = "".join(self.stderr.readlines()[-5:])
            raise RuntimeError(f"the survey's fork server exited with status {status}:\n{tail}")
        return line.rstrip("\n")

    def run(self, package: str, modules: Sequence[str]) -> List[ModuleResult]:
        """Import each of ``modules`` of ``package`` in a child of its own (under their shared packages)."""
        self.proc.stdin.write(f"{TREES[package].path()}\t{' '.join(modules)}\n")
        self.proc.stdin.flush()
        results: Dict[str, ModuleResult] = {}
        report = None
        while len(results) < len(modules):
            line = self._line()
            if line.startswith(MARK + "END "):
                status, module = line[len(MARK + "END "):].split()
                results[module] = _parse(module, report)[0] if report else _died(module, int(status))
                report = None
            elif line.startswith(MARK):
                report = line
        return [results[module] for module in modules]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.stderr.close()


def _chunks(jobs: List[tuple], workers: int) -> List[Tuple[str, List[int]]]:
    """``jobs`` ((package, module) pairs) as (package, job indexes): each package's modules (in name
    order, so that a package's subtree stays together) in up to ``workers`` runs, the longest first."""
    by_package: Dict[str, List[int]] = {}
    for index, (package, _) in enumerate(jobs):
        by_package.setdefault(package, []).append(index)
    chunks = []
    for package, indexes in by_package.items():
        indexes.sort(key=lambda i: jobs[i][1])
        size = -(-len(indexes) // workers)
        chunks += [(package, indexes[i:i + size]) for i in range(0, len(indexes), size)]
    return sorted(chunks, key=lambda chunk: -len(chunk[1]))


def _run_forked(python: str, jobs: List[tuple], torchpatch: bool, workers: int, timeout: float) -> tuple:
    """Results of ``jobs`` ((package, module) pairs) through ``workers`` fork servers; and the torch version."""
    queue = _chunks(jobs, workers)
    results: Dict[int, ModuleResult] = {}
    servers = []

    def work() -> None:
        server = ForkServer(python, torchpatch, timeout)
        servers.append(server)
        try:
            while queue:
                try:
                    package, indexes = queue.pop(0)
                except IndexError:
                    break
                outcomes = server.run(package, [jobs[i][1] for i in indexes])
                results.update(zip(indexes, outcomes))
        finally:
            server.close()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(work) for _ in range(min(workers, len(jobs)))]:
            future.result()
    return [results[i] for i in range(len(jobs))], servers[0].torch if servers else ""


def run_survey(python: str = sys.executable, packages: Sequence[str] = PACKAGES, modes: Sequence[str] = MODES,
               workers: int = 2, timeout: float = 300, isolation: str = "fork", natively: str = "all") -> Survey:
    """Import every module of ``packages`` with ``python`` in each mode, ``workers`` at a time.

    ``natively="failures"`` (both modes): "on" first, then "off" only for the modules that failed "on",
    which is all that "nothing that imports natively breaks with TORCHPATCH=1" needs (about half the time
    where most modules import); the "off" results then hold those modules alone."""
    if isolation not in ("fork", "fresh"):
        raise ValueError(f"isolation must be 'fork' or 'fresh', not {isolation!r}")
    if natively not in ("all", "failures") or natively == "failures" and set(modes) != set(MODES):
        raise ValueError(f"natively must be 'all', or 'failures' with both modes, not {natively!r} with {modes}")
    start = time.monotonic()
    surveys = {pkg: PackageSurvey(pkg, discover(pkg), {mode: {} for mode in modes}) for pkg in packages}
    everything = [(pkg, mod) for pkg in packages for mod in surveys[pkg].modules]
    versions = []
    for mode in sorted(modes, key=lambda m: m != "on") if natively == "failures" else modes:
        on = mode == "on"
        jobs = everything if on or natively == "all" else [
            (pkg, mod) for pkg, mod in everything if not surveys[pkg].results["on"][mod].ok]
        if not jobs:
            continue
        if isolation == "fork":
            results, version = _run_forked(python, jobs, on, workers, timeout)
            versions.append(version)
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                outcomes = list(pool.map(lambda job, on=on: import_fresh(python, job[0], job[1], on, timeout), jobs))
            results = [result for result, _ in outcomes]
            versions += [version for _, version in outcomes]
        for (pkg, mod), result in zip(jobs, results):
            surveys[pkg].results[mode][mod] = result
    torch = next((v for v in versions if v), "") or _torch_version(python)
    return Survey(python, torch, time.monotonic() - start, surveys)


def _torch_version(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('torch'))"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return proc.stdout.strip() or "unknown"


def _percent(ok: int, total: int) -> str:
    return f"{ok}/{total} ({100 * ok // max(total, 1)}%)"


def format_table(result: Survey) -> str:
    """The rate table of one torch version, then the failures grouped by error."""
    n = sum(len(p.modules) for p in result.packages.values())
    modes = [m for m in MODES if any(m in p.results for p in result.packages.values())]
    header = {"off": "TORCHPATCH unset", "on": "TORCHPATCH=1"}
    lines = [
        f"torch {result.torch}  ({result.python}; {n} modules x {len(modes)} modes in {result.seconds:.0f} s)",
        f"  {'package':<11} " + " ".join(f"{header[m]:>17}" for m in modes),
    ]
    for name, pkg in result.packages.items():  # a mode surveyed on part of the modules: "of failing" (``natively``)
        lines.append(f"  {name:<11} " + " ".join(
            f"{_percent(*pkg.rate(m)) + ('' if len(pkg.results[m]) == len(pkg.modules) else ' of failing'):>17}"
            for m in modes))
    for mode in modes:
        for name, pkg in result.packages.items():
            groups: Dict[str, List[str]] = {}
            for mod, r in pkg.failures(mode).items():
                groups.setdefault(r.error, []).append(mod)
            for error, mods in groups.items():
                shown = ", ".join(mods[:4]) + (f", ... ({len(mods)} modules)" if len(mods) > 4 else "")
                lines.append(f"  [{header[mode]}] {name}: {shown}\n      {error}")
    if "on" in modes:
        applied = sorted({p for pkg in result.packages.values() for p in _patches(pkg, "on", "applied")})
        lines.append(f"  patches applied in the importing processes: {', '.join(applied) or 'none'}")
    return "\n".join(lines)


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="interpreter to survey (repeatable; default: this one)")
    parser.add_argument("--package", action="append", choices=PACKAGES, help="fixture repository (default: all)")
    parser.add_argument("--installed", action="append", default=[], metavar="DIR:PACKAGE",
                        help="survey PACKAGE installed under DIR (pip install --target DIR) instead of the fixtures")
    parser.add_argument("--exclude", action="append", default=[], metavar="SUBPACKAGE",
                        help="leave this subpackage of an --installed package out (repeatable)")
    parser.add_argument("--mode", action="append", choices=MODES, help="off (TORCHPATCH unset) or on (default: both)")
    parser.add_argument("--workers", type=int, default=2, help="imports at a time (default 2)")
    parser.add_argument("--isolation", choices=("fork", "fresh"), default="fork",
                        help="fork: a child of a torch-importing server per module (default); fresh: a new interpreter per module")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args(list(argv) if argv is not None else None)
    trees = [installed(*spec.rsplit(":", 1), exclude=args.exclude) for spec in args.installed]
    packages = (args.package or []) + trees or list(PACKAGES)
    results = [run_survey(python, packages, args.mode or MODES, args.workers, isolation=args.isolation)
               for python in args.python or [sys.executable]]
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=1))
    else:
        print("\n\n".join(format_table(r) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
