"""The suite's fork server (tests/forkserver.py): a process forked from it sees what a fresh
interpreter sees, with and without torchpatch (on the matrix torches of conftest.PLUMBING_MINORS: how a
torch starts, not which patches apply); and it forks only code whose first statements import torch."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import forkserver
from conftest import clean_env

pytestmark = pytest.mark.plumbing

# What a process can tell of its own start: torch's and torchpatch's modules, patches, arguments, path,
# environment, what it printed while importing torch.
# The server imported torch._dynamo too (tests/forkserver.py says why): so does the code compared.
DYNAMO = """
try:
    import torch._dynamo
except ImportError:  # torch 1.13
    pass
"""
PROBE = """
import torch, json, os, sys
""" + DYNAMO + """
import torchpatch
print(json.dumps({
    "argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchpatch", "_torchpatch_startup")),
    "status": torchpatch.status(),
    # (the job-summary claim names a marker file after the process that made it)
    "environ": {k: v if k != "_TORCHPATCH_SUMMARY" else v.partition("|")[0]
                for k, v in os.environ.items() if not k.startswith("PYTEST_")},
    "parent_is_the_test": os.getppid() == int(sys.argv[1]),
}))
"""


def command(code):
    """``python -c code <test pid> x``."""
    return [sys.executable, "-c", textwrap.dedent(code), str(os.getpid()), "x"]


def both(code, env, cwd):
    """(forked, fresh) results of :func:`command`."""
    cmd = command(code)
    forked = forkserver.run(cmd, env=env, cwd=cwd, timeout=120)
    fresh = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    return forked, fresh


@pytest.mark.skipif(not forkserver.ENABLED, reason="TORCHPATCH_TEST_FORK=0 or not Linux")
# (a server per set of TORCHPATCH* flags: every opt-out test of the suite forks from one with its patch off)
@pytest.mark.parametrize("flags", [{}, {"TORCHPATCH": "1"}], ids=["off", "on"])
def test_a_forked_process_starts_as_a_fresh_one(flags, tmp_path):
    forked, fresh = both(PROBE, clean_env(**flags), str(tmp_path))
    assert forked.returncode == fresh.returncode == 0, (forked.stderr, fresh.stderr)
    got, want = json.loads(forked.stdout.splitlines()[-1]), json.loads(fresh.stdout.splitlines()[-1])
    assert (got.pop("parent_is_the_test"), want.pop("parent_is_the_test")) == (False, True)  # forked indeed
    assert got == want
    assert forked.stderr == fresh.stderr  # warnings of the start and of `import torch`, the summary line


@pytest.mark.skipif(not forkserver.ENABLED, reason="TORCHPATCH_TEST_FORK=0 or not Linux")
@pytest.mark.parametrize("code, status", [
    ("import torch, sys\nsys.exit(3)", 3),
    ("import torch, sys\nsys.exit('bye')", 1),
    ("import torch\nraise ValueError('boom')", 1),
    ("import torch, atexit\natexit.register(print, 'at exit')\nprint('end')", 0),
])
def test_exit_status_output_and_atexit_as_a_fresh_interpreter(code, status, tmp_path):
    # torchpatch off: nothing of its own at exit (its summary line is compared above), and no need to
    # import torch._dynamo as the server did (2-3 s of CPU in the fresh interpreter)
    forked, fresh = both(code, clean_env(), str(tmp_path))
    assert forked.returncode == fresh.returncode == status
    assert forked.stdout == fresh.stdout
    assert forked.stderr == fresh.stderr  # the traceback holds no frame of the server's


@pytest.mark.torch_independent
@pytest.mark.parametrize("source, forked", [
    ("import torch", True),
    ('"""doc"""\nfrom __future__ import annotations\nimport json, os\nimport torch.distributed as dist', True),
    ("import torchpatch, torch", True),
    ("from torch.distributed import init_process_group", True),
    ("import numpy, torch", False),  # numpy before torch: a fresh process imports it first
    ("import os\nos.environ['X'] = '1'\nimport torch", False),  # a statement before torch
    ("try:\n    import torch\nexcept ImportError:\n    pass", False),
    ("import json\nprint(1)", False),  # never imports torch: nothing to save
    ("import torch(", False),
])
def test_only_code_that_imports_torch_first_is_forked(source, forked):
    assert forkserver.imports_torch_first(source) is forked


@pytest.mark.skipif(not forkserver.ENABLED, reason="TORCHPATCH_TEST_FORK=0 or not Linux")
@pytest.mark.fresh_interpreter
def test_a_test_marked_fresh_interpreter_forks_nothing(tmp_path):
    code = "import torch, os, sys\nprint(os.getppid() == int(sys.argv[1]))"  # forked, were it not marked
    proc = forkserver.run(command(code), env=clean_env(), cwd=str(tmp_path), timeout=120)
    assert proc.stdout.splitlines() == ["True"], proc.stderr
