"""Test sessions: the quick suite on the default torch, and the torch version matrix; and the manual.

    nox -s tests          # torch 2.13.0 (CPU), the README's test command
    nox -s docs           # the manual (docs/, mkdocs.yml): mkdocs build --strict, a broken link fails it
    nox -t matrix         # torch 1.13.1, 2.1.2, 2.4.1, 2.9.0 (+ torch_xla 2.9.0), 2.14.1, 2.15.0,
                          # with torchtitan's releases where CI tries them (tests/test_torchtitan.py),
                          # and torchtitan's newer releases on torch 2.13.0 (the torchtitan-on-2.13 session),
                          # and Ray Train, accelerate and DeepSpeed's launchers on 2.13.0 (the launchers session)

The matrix sessions leave the tests marked ``torch_independent`` (stand-in targets, no torch in the
process, packaging) to the quick suite: their result is the same on every torch. A patch's test file runs
on the torches of ``MATRIX`` inside its range, the nearest outside each end and the newest
(tests/conftest.py's ``patch_file_runs_here``, docs/tests.md).

Each session installs the *built wheel* of torchpatch (not an editable install) next to one torch.
Virtual environments live outside the repo and are reused between runs (each CUDA torch venv is
3-5 GB): ``$NOX_TORCH_VENVS`` or ``~/.cache/torchpatch/nox``.

Where uv is installed (``.ci/run`` installs it beside nox), it makes the venvs and installs into them:
a CUDA torch with its dependencies installs in about a third of pip's time (torch 2.4.1 + numpy into an
empty venv, nothing cached: 28 s against pip's 78 s, 2026-11-27); without uv, virtualenv and pip do it.
uv reads none of pip's configuration files: the find-links that pip is given here (a machine may keep a
CPU build of torch there, as this one does for 2.13.0) are handed to uv.

Some machines cap pip with a system-wide constraint (``torch<=2.14.1`` in a pip config file); a torch
newer than ``CONSTRAINED_ABOVE`` is installed with pip's config files off for that install only
(``PIP_CONFIG_FILE=/dev/null``), never by changing the machine.
"""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys
import tempfile
from typing import Optional

import nox
from packaging.version import Version

nox.options.envdir = os.environ.get(
    "NOX_TORCH_VENVS", os.path.join(os.path.expanduser("~"), ".cache", "torchpatch", "nox")
)
nox.options.reuse_venv = "yes"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]

DEFAULT_TORCH = "2.13.0"
# torch version -> what else that torch needs beside it in the venv.
MATRIX: dict[str, list[str]] = {
    "1.13.1": ["numpy<2"],
    "2.1.2": ["numpy<2"],
    "2.4.1": ["numpy"],
    "2.9.0": ["numpy", "torch_xla==2.9.0"],
    DEFAULT_TORCH: ["numpy"],
    "2.14.1": ["numpy"],
    "2.15.0": ["numpy"],
}
# The newest torch a machine-wide pip constraint may allow; newer ones install with pip's config off.
CONSTRAINED_ABOVE = Version("2.14.1")

# torchtitan release -> the torches whose sessions train it (tests/test_torchtitan.py): 0.1.0 on 2.4 and 2.9
# (where its patches apply) and 2.15 (the newest); 0.2.2 and 0.3.0 on 2.4 (the oldest torch they train on)
# and 2.9 (where theirs apply), and on 2.13 (fsdp2-spmd-types, fsdp2-gloo-divide-factor) in a session of
# their own, which trains them and surveys their imports. An import survey (each module with TORCHPATCH=1,
# natively those that fail with it) costs 20-30 s a torch for 0.1.0's 33 modules, 2.8 min beside the training
# runs for 0.2.2's and 0.3.0's 270, so it runs where it tells something (tests/test_torchtitan_imports.py's
# SURVEYED). Each is installed without dependencies into a directory of its own under the venv cache (shared
# by the sessions: pure Python); its light dependencies go into the session's venv. torchdata, spmd_types and
# torch_checkpointing require a torch of their own choosing: installed without dependencies.
TORCHTITAN = {"0.1.0": ("2.4.1", "2.9.0", "2.15.0"), "0.2.2": ("2.4.1", "2.9.0", "2.13.0"),
              "0.3.0": ("2.4.1", "2.9.0", "2.13.0")}
# torchtitan 0.2/0.3 import Triton kernels at module level; torch 2.13.0's CUDA builds bring this Triton,
# its CPU wheel (this machine's default torch) does not.
TORCHTITAN_TRITON = "triton==3.7.1"
TORCHTITAN_DEPS = ["datasets>=3.6,<4.8", "tokenizers", "tiktoken", "blobfile", "tomli", "fsspec", "tyro",
                   "tensorboard", "einops", "pillow", "safetensors", "wandb"]
TORCHTITAN_NO_DEPS = ["torchdata", "spmd_types==0.2.3", "torch_checkpointing"]

# The launchers beyond torchrun that tests/test_launchers.py runs (the launchers session), on the
# default torch. DeepSpeed is an sdist, built without its ops (its default): it JIT-compiles its CPU
# shared-memory op at the first init_distributed (about a minute), into TORCH_EXTENSIONS_DIR, which
# the session keeps in its venv.
LAUNCHERS = ["ray[train]==2.60.0", "accelerate==1.15.0", "deepspeed==0.19.8"]

# The manual's builder, pinned: mkdocs with the Material theme (the docs session).
DOCS = ["mkdocs==1.6.1", "mkdocs-material==9.8.2"]

# Two pytest-xdist workers, a test file each at a time (its module fixtures computed once): most tests
# wait on the subprocesses they start (ranks, fresh interpreters), which one worker leaves a core idle for.
# Files are handed out in collection order, the longest first (tests/conftest.py's COLLECTED_FIRST).
XDIST = ("-n", "2", "--dist", "loadfile", "--no-loadscope-reorder")
# The launchers session is one file of seven tests, each a launcher's whole job: test by test, both workers
# run (its file alone on one worker took 117 s of CI's 40 minutes, the other worker idle); the tests of one
# launcher marked ``xdist_group`` stay on one worker, one after the other (Ray: one local cluster at a time).
XDIST_BY_TEST = ("-n", "2", "--dist", "loadgroup")
# The slowest tests of each session, in its log: where CI time goes.
DURATIONS = ("--durations", "15")

_wheel: list[str] = []


@functools.lru_cache(maxsize=None)
def _pip_find_links() -> Optional[str]:
    """The find-links pip is given on this machine (its environment, else its config files)."""
    if os.environ.get("PIP_FIND_LINKS"):
        return os.environ["PIP_FIND_LINKS"]
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True,
                          text=True)
    return (proc.returncode == 0 and proc.stdout.strip()) or None


def _build_wheel(session: nox.Session) -> str:
    """Build torchpatch's wheel once per nox invocation."""
    if not _wheel:
        out = tempfile.mkdtemp(prefix="torchpatch-wheel-")
        session.run_install("python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ".")
        _wheel.append(glob.glob(os.path.join(out, "torchpatch-*.whl"))[0])
    return _wheel[0]


def _install_torchtitan(session: nox.Session, releases: list[str]) -> str:
    """torchtitan's releases and their dependencies; the ``TORCHTITAN_TEST_RELEASES`` value."""
    session.install(*TORCHTITAN_DEPS)
    session.install("--no-deps", *TORCHTITAN_NO_DEPS)
    installed = []
    for release in releases:
        target = os.path.join(nox.options.envdir, "torchtitan", release)
        if not os.path.isdir(os.path.join(target, "torchtitan")):
            session.install("--no-deps", "--target", target, f"torchtitan=={release}")
        installed.append(f"{release}={target}")
    return ",".join(installed)


def _run_suite(session: nox.Session, torch: str, torchtitan: bool = False, extra: tuple[str, ...] = (),
               tests: tuple[str, ...] = ("tests",), env: dict[str, str] | None = None,
               xdist: tuple[str, ...] = XDIST) -> None:
    pip_env = {"PIP_CONFIG_FILE": os.devnull} if Version(torch) > CONSTRAINED_ABOVE else {}
    if session.venv_backend == "uv":
        # pip compiles the bytecode when it installs, uv only when asked: where PYTHONDONTWRITEBYTECODE is
        # set (this machine's environment), every interpreter would otherwise compile torch from source
        session.env["UV_COMPILE_BYTECODE"] = "1"
        find_links = None if "UV_FIND_LINKS" in os.environ else _pip_find_links()
        if find_links:
            session.env["UV_FIND_LINKS"] = find_links
    # pip: the wheel is built with it, and tests install it elsewhere with it (a venv uv made has none)
    session.install(f"torch=={torch}", *MATRIX[torch], *extra, "pip", env=pip_env)
    wheel = _build_wheel(session)
    session.install("--force-reinstall", "--no-deps", wheel)
    session.install(f"torchpatch[test] @ file://{wheel}")
    env = {"TORCHPATCH_EXPECT_TORCH": torch, "TORCHPATCH_TEST_WHEEL": wheel, **(env or {})}
    releases = [release for release, torches in TORCHTITAN.items() if torchtitan and torch in torches]
    if releases:
        env["TORCHTITAN_TEST_RELEASES"] = _install_torchtitan(session, releases)
    session.run("python", "-m", "pytest", *xdist, *DURATIONS, *(session.posargs or tests), env=env)


@nox.session
def tests(session: nox.Session) -> None:
    """The quick suite on the default torch (2.13.0, CPU)."""
    _run_suite(session, DEFAULT_TORCH)


@nox.session(tags=["matrix"])
@nox.parametrize("torch", [v for v in MATRIX if v != DEFAULT_TORCH])
def matrix(session: nox.Session, torch: str) -> None:
    """The suite on one other torch of the matrix (with the torchtitan releases ``TORCHTITAN`` gives it)."""
    _run_suite(session, torch, torchtitan=True, tests=("-m", "not torch_independent", "tests"))


# (not named "torchtitan": its venv would take the directory that holds the releases)
@nox.session(name="torchtitan-on-2.13", tags=["matrix"])
def torchtitan_on_default_torch(session: nox.Session) -> None:
    """torchtitan 0.2.2 and 0.3.0 on torch 2.13.0 (with Triton): tests/test_torchtitan.py, and the import
    survey in a file of its own, which the second worker runs beside the training runs."""
    _run_suite(session, DEFAULT_TORCH, torchtitan=True, extra=(TORCHTITAN_TRITON,),
               tests=("tests/test_torchtitan.py", "tests/test_torchtitan_imports.py"))


@nox.session(tags=["matrix"])
def launchers(session: nox.Session) -> None:
    """Ray Train, accelerate launch and the DeepSpeed launcher on torch 2.13.0: tests/test_launchers.py,
    which fails (instead of skipping) where one is missing."""
    env = {"LAUNCHERS_REQUIRED": "1", "TORCH_EXTENSIONS_DIR": os.path.join(session.virtualenv.location, "torch_extensions")}
    _run_suite(session, DEFAULT_TORCH, extra=tuple(LAUNCHERS), tests=("tests/test_launchers.py",), env=env,
               xdist=XDIST_BY_TEST)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the manual with ``mkdocs build --strict`` into a throw-away folder: a link to a missing page,
    file or anchor, or a page left out of the nav, fails it (the validation settings of mkdocs.yml)."""
    session.install(*DOCS)
    session.run("mkdocs", "build", "--strict", "--site-dir", session.create_tmp(),
                env={"NO_MKDOCS_2_WARNING": "1"})  # (mkdocs-material's notice of mkdocs 2)
