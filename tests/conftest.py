"""Shared helpers: every behaviour test runs a real Python subprocess with real environment
variables (torchpatch's start-up hook only acts at interpreter start)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import pytest

import forkserver
from torchpatch import _versions
from torchpatch._registry import catalogue_ranges

# torchpatch's wheel as the nox session built and installed it (tests that install it elsewhere reuse it);
# unset where torchpatch is installed editable from this working tree (the fixture ``wheel`` builds one).
# pytest-xdist's workers start with this process's environment as the loop below leaves it: they read
# the wheel from WHEEL_HANDOVER, which is no TORCHPATCH_<ID> switch.
WHEEL_HANDOVER = "_TORCHPATCH_TEST_WHEEL"
WHEEL = os.environ.get("TORCHPATCH_TEST_WHEEL") or os.environ.get(WHEEL_HANDOVER)
if WHEEL:
    os.environ[WHEEL_HANDOVER] = WHEEL
# Each test sets the TORCHPATCH* variables it means; none leak in from the caller's shell.
for _name in [n for n in os.environ if n.startswith("TORCHPATCH")]:
    del os.environ[_name]
# torch 2.4 starts inductor's compile-worker pool (a process that imports torch) in every process that imports
# torch._inductor.async_compile (torchtitan, the inductor patches' tests), compiling or not; one that compiles
# starts it then (the same results). Off in the suite's processes, which inherit this environment.
os.environ.setdefault("TORCH_WARM_POOL", "0")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PLUGIN = HERE / "fixtures" / "plugin"
TORCH = _versions.torch_version()


def torch_matches(spec: str) -> bool:
    return _versions.matches(spec, TORCH)


def only_torch(spec: str, why: str = ""):
    """Skip unless the installed torch matches ``spec``."""
    return pytest.mark.skipif(not torch_matches(spec), reason=f"needs torch {spec}; have {TORCH}. {why}")


# Each catalogue patch's torch specifier, as its Patch(...) declares it (the installed wheel's index).
PATCH_TORCH = catalogue_ranges()
# The torch minor versions the catalogue covers, as far as tests reason about them.
TORCH_MINORS = ["1.13"] + [f"2.{minor}" for minor in range(16)]


def patch_applies_here(patch_id: str) -> bool:
    """Whether the installed torch is in the catalogue patch ``patch_id``'s range."""
    return torch_matches(PATCH_TORCH[patch_id])


def where_patch_applies(patch_id: str, why: str = ""):
    """Skip unless the installed torch is in the patch's range (its ``Patch(torch=...)``)."""
    return only_torch(PATCH_TORCH[patch_id], f"where {patch_id} applies. {why}")


def where_patch_does_not_apply(patch_id: str, why: str = ""):
    """Skip where the installed torch is in the patch's range."""
    return pytest.mark.skipif(patch_applies_here(patch_id),
                              reason=f"needs torch outside {patch_id}'s {PATCH_TORCH[patch_id]}; have {TORCH}. {why}")


def through_patch_range(patch_id: str, why: str = "", since: Optional[str] = None):
    """Skip unless the installed torch is at least ``since`` (a torch minor version), by default the
    patch's first: the result with torchpatch from there on, which the patch gives where it applies and
    torch itself gives after."""
    first, _end = _versions.minor_range(PATCH_TORCH[patch_id])
    return only_torch(f">={since or _dotted(first)}", f"across {patch_id}'s range. {why}")


def until_patch_range_ends(patch_id: str, why: str = "", *, since: str):
    """Skip unless the installed torch is at least ``since`` and before the end of the patch's range,
    where torch itself does not have what the patch gives."""
    _first, end = _versions.minor_range(PATCH_TORCH[patch_id])
    assert end is not None, f"{patch_id}'s range has no end"
    return only_torch(f">={since},<{_dotted(end)}", f"torch without what {patch_id} gives. {why}")


def _dotted(minor: Tuple[int, int]) -> str:
    return "%d.%d" % minor


def clean_env(**extra: Optional[str]) -> Dict[str, str]:
    """os.environ without any TORCHPATCH* or torchrun variables, plus ``extra`` (None removes)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHPATCH", "PYTEST_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run_py(code: str, *, env: Optional[Dict[str, str]] = None, args=(), timeout: float = 180, cwd=None) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python -c code *args`` of this venv: forked from a warm interpreter where
    that is the same as a fresh one (tests/forkserver.py), otherwise a fresh interpreter."""
    return forkserver.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          env=env if env is not None else clean_env(), timeout=timeout, cwd=cwd)


def import_with_torchpatch(statement: str, patch_id: str) -> dict:
    """Run the import ``statement`` with TORCHPATCH=1: ``{"error": the ImportError's type name or None,
    "status": patch_id's torchpatch.status()}``."""
    return run_json(
        "import json, torchpatch\n"
        f"try:\n    {statement}\n    error = None\n"
        "except ImportError as exc:\n    error = type(exc).__name__\n"
        f"print(json.dumps({{'error': error, 'status': torchpatch.status().get({patch_id!r})}}))\n",
        env=clean_env(TORCHPATCH="1"),
    )


def run_json(code: str, **kw) -> dict:
    """Run ``code``, which prints one JSON document as its last stdout line; fail loudly otherwise."""
    proc = run_py(code, **kw)
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def matrix_python(torch: str) -> Path:
    """The python of the matrix venv of ``torch`` (noxfile.py's cache of venvs; it may not exist)."""
    venvs = Path(os.environ.get("NOX_TORCH_VENVS", "~/.cache/torchpatch/nox")).expanduser()
    return venvs / f"matrix-torch-{torch.replace('.', '-')}" / "bin" / "python"


# The matrix venv of the newest torch, where it exists: files written by a served backport are read back
# there by that torch's own code (run_newest_torch_json).
NEWEST_TORCH_PYTHON = matrix_python("2.15.0")


def run_newest_torch_json(code: str, *args: str) -> Any:
    """Run ``code`` (printing one JSON document last) natively on torch 2.15's matrix venv, in a
    subprocess (forked from a warm interpreter of that venv where :func:`run_py` would fork); skip the
    test where that venv does not exist. Without ``args`` the document is remembered (newest_torch_cached)."""
    if not NEWEST_TORCH_PYTHON.exists():
        pytest.skip(f"no torch 2.15 venv at {NEWEST_TORCH_PYTHON}")

    def compute() -> Any:
        proc = forkserver.run([str(NEWEST_TORCH_PYTHON), "-c", textwrap.dedent(code), *args], env=clean_env(),
                              timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return compute() if args else newest_torch_cached(code, compute)


# pytest's cache (.pytest_cache, one per checkout: shared by the nox sessions of a CI run and by their
# pytest-xdist workers); None where the cacheprovider plugin is off (-p no:cacheprovider).
_PYTEST_CACHE: Any = None


def pytest_configure(config: pytest.Config) -> None:
    global _PYTEST_CACHE
    _PYTEST_CACHE = getattr(config, "cache", None)


def newest_torch_cached(program: str, compute: Callable[[], Any]) -> Any:
    """What torch 2.15.0 natively gives for ``program`` (a script's text, taking no argument, file or
    port: its output is a function of the text and the torch alone), computed once per checkout: the
    sessions of other torches compare with it (4 of them: 15-20 s each on 2 cores for
    create_block_mask's compiled masks). Keyed by the program and the 2.15 venv's torch version."""
    if _PYTEST_CACHE is None:
        return compute()
    key = _newest_torch_key(program)
    cached = _PYTEST_CACHE.get(f"torchpatch/newest-torch/{key}", None)
    if cached is None:
        cached = {"value": compute()}
        _PYTEST_CACHE.set(f"torchpatch/newest-torch/{key}", cached)
    return cached["value"]


def newest_torch_files(program: str, make: Callable[[Path], Any], tmp_path_factory: pytest.TempPathFactory,
                       ) -> Tuple[Path, Any]:
    """Files torch 2.15.0 natively writes, and a JSON-able value: ``make(folder)`` fills an empty
    ``folder`` by running ``program`` (the text of what it runs: the files and the value are a function of
    it and the torch) and returns the value. Made once per checkout, as newest_torch_cached's values are
    (in pytest's cache; the sessions of other torches read the same folder, which no test may write
    into); a new folder in each session where the cache is off."""
    if _PYTEST_CACHE is None:
        folder = tmp_path_factory.mktemp("newest-torch-files")
        return folder, make(folder)
    root = Path(_PYTEST_CACHE.mkdir("torchpatch-newest-torch-files"))
    done = root / _newest_torch_key(program)[:32]
    if not (done / "value.json").exists():
        work = Path(tempfile.mkdtemp(dir=root, prefix="making-"))  # complete, then renamed: never seen half made
        (work / "files").mkdir()
        (work / "value.json").write_text(json.dumps(make(work / "files")))
        try:
            os.rename(work, done)
        except OSError:  # another worker or session made it first
            shutil.rmtree(work, ignore_errors=True)
    return done / "files", json.loads((done / "value.json").read_text())


def _newest_torch_key(program: str) -> str:
    """What newest_torch_cached and newest_torch_files keep ``program``'s result under: the program's text
    and the 2.15 venv's torch version."""
    return hashlib.sha256(f"{_newest_torch_version()}\0{program}".encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _newest_torch_version() -> str:
    """The torch version installed in the 2.15 venv (its dist-info's name)."""
    infos = sorted(NEWEST_TORCH_PYTHON.parent.parent.glob("lib/python*/site-packages/torch-*.dist-info"))
    return ",".join(info.name for info in infos) or "unknown"


# Test scripts that exercise the engine on the demo plugin's fake targets start with this line: the
# start-up hook activates torchpatch when torch is first looked up (as ``import torch`` does first),
# and looking it up costs nothing of torch's own import time.
ARM = "import importlib.util; importlib.util.find_spec('torch')\n"


def plugin_env(**extra: Optional[str]) -> Dict[str, str]:
    """An environment that has the demo plugin (fake targets + third-party patches) importable."""
    path = os.pathsep.join([str(PLUGIN)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return clean_env(PYTHONPATH=path, **extra)


def make_plugin(directory: Path, module: str, source: str) -> Path:
    """A third-party distribution in ``directory`` (put it on PYTHONPATH) whose ``torchpatch.patches``
    entry point is the module ``module``, with ``source``; ``directory``."""
    info = directory / f"{module}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[torchpatch.patches]\n{module} = {module}\n")
    (directory / f"{module}.py").write_text(source)
    return directory


def torchpatch_command(*args: Any, env: Optional[Dict[str, str]] = None, stdin: Optional[bytes] = None,
                       cwd: Optional[os.PathLike] = None) -> subprocess.CompletedProcess:
    """``python -m torchpatch *args``, run in this process: the command's own code (``torchpatch._cli.main``)
    on the same arguments, environment (``clean_env()`` by default), working directory and standard
    input, without a new interpreter (0.5 s of CPU each: mostly loading the inventories, which this
    process then keeps). For what the commands compute; what a process does (start-up, exit, a terminal,
    a closed pipe, the interpreter's own flags or path) is tested with the real command."""
    from torchpatch._cli import main

    saved = dict(os.environ), os.getcwd(), sys.stdin
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(env if env is not None else clean_env())
        if cwd is not None:
            os.chdir(cwd)
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(arg) for arg in args])
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        os.chdir(saved[1])
        sys.stdin = saved[2]
    return subprocess.CompletedProcess([sys.executable, "-m", "torchpatch", *map(str, args)], code,
                                       out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torchpatch's wheel: the nox session's (``TORCHPATCH_TEST_WHEEL``), else one built from the working
    tree (an editable install, ``pip install -e``), once per test run (5 s): the first pytest-xdist worker
    to ask builds it under the run's temporary directory, the others wait on its lock and take it."""
    if WHEEL:
        return Path(WHEEL)
    run_dir = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        run_dir = run_dir.parent  # the run's directory, above each worker's own
    out = run_dir / "torchpatch-wheel"
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        built = next(out.glob("torchpatch-*.whl"), None)
        if built is None:
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                           check=True)
            built = next(out.glob("torchpatch-*.whl"))
    return built


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


sys.path.insert(0, str(REPO / "examples"))
from launch import launch  # noqa: E402  (the plain env:// launcher of examples/)

RESULT = "TORCHPATCH-TEST-RESULT "

# The files whose tests take longest, longest first (minutes: torchtitan's import survey and training,
# the fixture repositories' survey; then 15-60 s each, from the per-file times each session prints) are
# collected first: pytest-xdist (``--dist loadfile --no-loadscope-reorder``, the noxfile) hands out whole
# files in collection order, and a long file started last would keep one worker busy alone while the
# other idles. (Without ``--no-loadscope-reorder`` xdist orders files by their number of tests instead.)
COLLECTED_FIRST = ("test_torchtitan.py", "test_torchtitan_imports.py", "test_survey.py", "test_dtensor_fuzz.py",
                   "test_forkserver.py",
                   "test_cluster_shapes.py", "test_patch_xla_parallelize.py",
                   "test_engine_torch.py", "test_patch_dtensor_mixed.py", "test_engine.py", "test_check.py",
                   "test_report.py", "test_activation.py", "test_torchrun.py", "test_example.py", "test_check_source.py",
                   "test_cli.py", "test_patch_gloo_exit_abort.py", "test_check_live.py", "test_doctor.py",
                   "test_packaging.py", "test_check_shims.py")


@pytest.fixture(autouse=True)
def _process_kind(request: pytest.FixtureRequest):
    """Tests marked ``fresh_interpreter`` start every process fresh; the others fork where they can."""
    forkserver.allowed = request.node.get_closest_marker("fresh_interpreter") is None
    yield
    forkserver.allowed = True


# The torch minor versions of CI's sessions (noxfile.py's MATRIX, whose entries are lists, and its DEFAULT_TORCH),
# and the installed one.
_NOXFILE = (REPO / "noxfile.py").read_text()
DEFAULT_MINOR = _versions.release(re.search(r'^DEFAULT_TORCH = "([\d.]+)"', _NOXFILE, re.M).group(1))[:2]
MATRIX_MINORS = sorted({_versions.release(v)[:2] for v in re.findall(r'^\s*"(\d+\.\d+\.\d+)": \[', _NOXFILE, re.M)}
                       | {DEFAULT_MINOR})
TORCH_MINOR = tuple((_versions.release(TORCH) or ())[:2])
# Set to 1 to run every patch's test file and every ``plumbing`` test on any torch (patch_file_runs_here).
EVERY_TORCH = os.environ.get("PATCH_TESTS_ON_EVERY_TORCH") == "1"


def patch_file_runs_here(patch_id: str) -> bool:
    """Whether the test file of the catalogue patch ``patch_id`` (tests/test_patch_<id>.py) runs on the
    installed torch. On CI's torches (``MATRIX_MINORS``) it runs where the patch applies, on the nearest of
    them outside each end of its range (where it must stay inactive, and torch's own behaviour takes
    over), and on the newest (the oracle: inactive, and the served behaviour is torch's); on a matrix torch
    farther from the range the file would only check inactivity again. Any other torch runs every file."""
    if EVERY_TORCH or TORCH_MINOR not in MATRIX_MINORS:
        return True
    first, end = _versions.minor_range(PATCH_TORCH[patch_id])
    below = [m for m in MATRIX_MINORS if m < first]
    above = [m for m in MATRIX_MINORS if end is not None and m >= end]
    return (patch_applies_here(patch_id) or TORCH_MINOR == MATRIX_MINORS[-1]
            or TORCH_MINOR in (below[-1:] + above[:1]))


# The matrix torches that run the tests marked ``plumbing`` (the engine's process plumbing with a real torch:
# start-up activation, per-process reports, torchrun's workers, the suite's fork server), whose outcome
# depends on how a torch starts and launches rather than on which patches apply: the oldest, the default and
# the newest. The torches between them run the same code (2.4 ran them too until CI's time was cut, 2026-11-29:
# about 70 s of its session).
PLUMBING_MINORS = (MATRIX_MINORS[0], DEFAULT_MINOR, MATRIX_MINORS[-1])


def plumbing_runs_here() -> bool:
    return EVERY_TORCH or TORCH_MINOR not in MATRIX_MINORS or TORCH_MINOR in PLUMBING_MINORS


def pytest_collection_modifyitems(items: list) -> None:
    first = {name: i for i, name in enumerate(COLLECTED_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(COLLECTED_FIRST)))  # stable: the rest keep their order
    for item in items:
        name = item.path.name
        patch_id = name[len("test_patch_"):-len(".py")].replace("_", "-") if name.startswith("test_patch_") else None
        if item.get_closest_marker("plumbing") is not None and not plumbing_runs_here():
            item.add_marker(pytest.mark.skip(reason=(
                f"process plumbing is tested on torch {', '.join('.'.join(map(str, m)) for m in PLUMBING_MINORS)} "
                f"of the matrix, not on {TORCH} (conftest.PLUMBING_MINORS)")))
        if patch_id in PATCH_TORCH and not patch_file_runs_here(patch_id):
            item.add_marker(pytest.mark.skip(reason=(
                f"{patch_id} ({PATCH_TORCH[patch_id]}) is tested on the matrix torches inside its range, the nearest "
                f"outside each end and the newest, not on {TORCH} (conftest.patch_file_runs_here)")))


# Where a session's time goes, per test file (setup, call and teardown summed over its tests): printed
# at the end of each session, beside pytest's ``--durations`` of single tests.
_FILE_SECONDS: Dict[str, float] = {}
FILES_SHOWN = 12


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"test time per file ({total:.0f} s over all workers), the {FILES_SHOWN} longest")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:FILES_SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")

# The end of a rank script (append it to the script's text): meet at a barrier, then leave without the
# process-group teardown. torch 2.1/2.4's gloo destroy_process_group() can hang on one rank even after
# a barrier, with or without torchpatch: 2 of 16 runs of test_patch_dtensor_partial's script on 2.4.1,
# about 1 in 5 after pipelining's P2P traffic, and CI runs timed out on it.
LEAVE_WITHOUT_TEARDOWN = """
import os
dist.barrier()
os._exit(0)
"""


def gathered_tail(patch_id: str) -> str:
    """The end of a rank script whose ranks each fill a dict ``out``: with ``out["status"]`` the patch's
    status there, rank 0 prints every rank's ``out`` (a list in rank order); then the exit without teardown."""
    return ("\nimport torchpatch\n"
            f"out['status'] = torchpatch.status().get({patch_id!r})\n"
            "gathered = [None] * dist.get_world_size()\n"
            "dist.all_gather_object(gathered, out)\n"
            "if dist.get_rank() == 0:\n"
            f"    print({RESULT!r} + json.dumps(gathered), flush=True)\n") + LEAVE_WITHOUT_TEARDOWN


# The start of a DTensor rank script: gloo, a 1-D CPU mesh over every rank, the public names (served
# on torch 2.4 with TORCHPATCH=1; torch.distributed._tensor's without).
DTENSOR_RANK_SETUP = """
import json, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
except ImportError:  # torch 2.4 without torchpatch
    from torch.distributed._tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
mesh = init_device_mesh("cpu", (world,))
"""


# For pipelining rank scripts on torch 2.9 with gloo (put it after the imports): 2.9's warm-up sends
# each stage an int64 tensor into a float32 buffer (with TORCHPATCH=1 pipelining-gloo-warmup fixes that
# part), and V placements post sends to their own rank, so gloo aborts before the first step (a loud
# fault of 2.9, not what the tests measure; gone in 2.13).
PIPELINING_GLOO_WARMUP = """
from torch.distributed.pipelining.stage import _PipelineStageBase
if "_get_init_p2p_neighbors_ops" in vars(_PipelineStageBase):
    _init_ops = _PipelineStageBase._get_init_p2p_neighbors_ops

    def _gloo_init_ops(self):
        ops = [op for op in _init_ops(self) if op.group_peer != self.group_rank]
        for op in ops:
            op.tensor = op.tensor.float()
        return ops

    _PipelineStageBase._get_init_p2p_neighbors_ops = _gloo_init_ops
"""


def run_ranks(script: str, *, nproc: int = 2, env: Optional[Dict[str, str]] = None, tmp_path: Path,
              launcher: str = "plain", timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``script`` (source text) as ``nproc`` ranks on loopback/gloo; one combined result.

    ``launcher``: "plain" (examples/launch.py: the ranks alone, with torchrun's variables) or
    "torchrun" (the real one, with its agent), for the tests about launching (the summary line of a
    job, the report of each process, the README's job); on torch 1.13 without TORCHPATCH, whose
    torchrun crashes on Python 3.11 unless torchpatch fixes it (the torchrun-py311 patch), the plain
    one. What a rank computes does not depend on the launcher; the agent is a third process importing
    torch: a 2-rank job takes 3.8 s plain and 5.4 s under torchrun on 2 cores, and the suite runs
    hundreds (test_torchrun.py runs torchrun itself, one node and two).
    """
    path = tmp_path / "rank_script.py"
    path.write_text(textwrap.dedent(script))
    env = env if env is not None else clean_env()
    if launcher == "torchrun" and not (torch_matches(">=2.0") or env.get("TORCHPATCH") == "1"):
        launcher = "plain"
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(path)]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    ranks = launch(str(path), nproc, env=env, timeout=timeout, popen=forkserver.popen)
    return subprocess.CompletedProcess(
        [str(path)], max((abs(r.returncode) for r in ranks), default=0),
        "".join(r.stdout or "" for r in ranks), "".join(r.stderr or "" for r in ranks),
    )


def ranks_result(script: str, *, tmp_path: Path, env: Optional[Dict[str, str]] = None, **kwargs: Any) -> Any:
    """Run ``script`` as ranks (:func:`run_ranks`, same keywords), which must all succeed; the
    document rank 0 printed after ``RESULT``."""
    proc = run_ranks(script, env=env, tmp_path=tmp_path, **kwargs)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rank_result(proc)


def newest_torch_ranks_result(script: str, *, nproc: int, tmp_path: Path, timeout: float = 240) -> Any:
    """Run ``script`` as ``nproc`` ranks natively on torch 2.15's matrix venv (what the newest torch
    gives); the document rank 0 printed after ``RESULT`` (remembered: newest_torch_cached). Skip where
    that venv does not exist."""
    if not NEWEST_TORCH_PYTHON.exists():
        pytest.skip(f"no torch 2.15 venv at {NEWEST_TORCH_PYTHON}")
    path = tmp_path / "newest_torch_script.py"
    path.write_text(textwrap.dedent(script))

    def compute() -> Any:
        ranks = launch(str(path), nproc, env=clean_env(), timeout=timeout, python=str(NEWEST_TORCH_PYTHON),
                       popen=forkserver.popen)
        assert all(r.returncode == 0 for r in ranks), [(r.stderr or "")[-2000:] for r in ranks]
        return rank_result(subprocess.CompletedProcess([str(path)], 0, "".join(r.stdout or "" for r in ranks), ""))

    return newest_torch_cached(f"{nproc} ranks\n{textwrap.dedent(script)}", compute)


def rank_result(proc: subprocess.CompletedProcess) -> dict:
    """The JSON document a rank script printed after ``RESULT`` (rank 0 prints it)."""
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise AssertionError(f"no result line; rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}")
