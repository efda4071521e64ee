"""The exit hint: with torchpatch active, a process that dies of an uncaught exception a patch fixes, but
which is switched off here or is for other torch versions, prints one line after its traceback; the
traceback and the exit status stay the interpreter's, and without TORCHPATCH nothing is printed."""

import re

import pytest

from conftest import clean_env, run_py
from torchpatch._registry import catalogue_ranges
from torchpatch import _versions

# what a real interpreter prints as it dies; the hook is torchpatch's, the same on every torch: plumbing
pytestmark = [pytest.mark.fresh_interpreter, pytest.mark.plumbing]

# deepcopy of a process group: every torch raises it natively (processgroup-deepcopy applies to all)
DEEPCOPY = """
import copy, torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
copy.deepcopy(dist.group.WORLD)
"""
HINT = "torchpatch: this error is what patch processgroup-deepcopy fixes, but it is off here (in TORCHPATCH_DISABLE)"


def _traceback(stderr: str) -> list:
    return [line for line in stderr.splitlines() if "torchpatch" not in line]


def test_a_switched_off_patch_is_named_once_and_nothing_else_changes():
    off = run_py(DEEPCOPY, env=clean_env(TORCHPATCH="1", TORCHPATCH_DISABLE="processgroup-deepcopy", RANK="0",
                                         TORCHPATCH_LOG="warning"))
    native = run_py(DEEPCOPY, env=clean_env(RANK="0"))
    hints = [line for line in off.stderr.splitlines() if "torchpatch:" in line]
    assert len(hints) == 1 and hints[0].endswith(HINT + "; `torchpatch explain` tells more"), off.stderr[-2000:]
    assert hints[0].startswith("[rank0]: ")  # the rank, as torch prefixes the traceback
    assert off.returncode == native.returncode == 1
    assert "torchpatch" not in native.stderr
    assert _traceback(off.stderr)[-1] == _traceback(native.stderr)[-1]
    assert re.search(r"TypeError: cannot pickle 'torch\._C\._distributed_c10d\.ProcessGroup(Gloo)?' object$",
                     _traceback(off.stderr)[-1])  # 1.13's default group is the gloo object


def test_nothing_where_the_patch_is_on_or_the_exception_is_another():
    on = run_py(DEEPCOPY + "raise SystemExit(3)\n", env=clean_env(TORCHPATCH="1", TORCHPATCH_LOG="warning"))
    assert (on.returncode, on.stderr.strip()) == (3, "")
    other = run_py("import torch\nraise ValueError('not a patch error')\n", env=clean_env(TORCHPATCH="1", TORCHPATCH_LOG="warning"))
    assert other.returncode == 1 and "torchpatch" not in other.stderr


def test_a_patch_for_other_torch_versions_and_a_thread_s_exception():
    ranges = catalogue_ranges()
    torch = _versions.torch_version()
    patch, message = ("gloo-avg", "Cannot use ReduceOp.AVG with Gloo") if not _versions.matches(ranges["gloo-avg"], torch) \
        else ("fsdp2-spmd-types", None)
    if message is None:
        pytest.skip(f"gloo-avg applies to torch {torch}")
    code = ("import threading, torch\n"
            f"t = threading.Thread(target=lambda: (_ for _ in ()).throw(RuntimeError({message!r})))\n"
            "t.start(); t.join()\n"
            f"raise RuntimeError({message!r})\n")
    proc = run_py(code, env=clean_env(TORCHPATCH="1", TORCHPATCH_LOG="warning"))
    hints = [line for line in proc.stderr.splitlines() if line.startswith("torchpatch:")]
    assert hints == [f"torchpatch: patch {patch} fixes this error on torch {ranges[patch]}, not on this torch {torch}; "
                     "`torchpatch explain` tells more"], proc.stderr
    assert proc.returncode == 1 and proc.stderr.count(f"RuntimeError: {message}") == 2
