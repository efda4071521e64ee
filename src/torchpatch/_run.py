"""``torchpatch run -- CMD``: run CMD with ``TORCHPATCH=1`` and a bootstrap sitecustomize first on
``PYTHONPATH``, warning where the command's interpreter flags defeat that bootstrap."""

from __future__ import annotations

import os
import re
import shutil
import sys
from typing import List, Sequence, Set

from ._doctor import _installed_startup_hooks

# A Python interpreter by name: python, python3, python3.11, python3.13t, pypy3 ...
_PYTHON = re.compile(r"^(python|pypy)(\d+(\.\d+)?t?)?(\.exe)?$")
# Short options of CPython that take a value (-X opt, -W arg), and the long one that does.
_WITH_VALUE = set("XW")
_LONG_WITH_VALUE = ("--check-hash-based-pycs",)
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


def interpreter_flags(command: Sequence[str]) -> Set[str]:
    """The single-letter options given to the interpreter that ``command`` starts, if it starts
    one by name (``python -S -m x``, ``python3 -IS x.py``); empty otherwise. Options end at the
    script, ``-m`` or ``-c``."""
    if not command or not _PYTHON.match(os.path.basename(command[0])):
        return set()
    flags: Set[str] = set()
    args = iter(command[1:])
    for arg in args:
        if arg == "--" or not arg.startswith("-") or arg == "-":
            break
        if arg.startswith("--"):
            if arg in _LONG_WITH_VALUE:
                next(args, None)
            continue
        letters = arg[1:]
        for i, letter in enumerate(letters):
            if letter in "mc":
                return flags
            if letter in _WITH_VALUE:
                if i == len(letters) - 1:
                    next(args, None)
                break
            flags.add(letter)
    return flags


def _same_interpreter(program: str) -> bool:
    found = shutil.which(program)
    return found is not None and os.path.realpath(found) == os.path.realpath(sys.executable)


def bootstrap_warnings(command: Sequence[str]) -> List[str]:
    """Why torchpatch will not (or may not) activate in ``command``, judged from its interpreter flags."""
    flags = interpreter_flags(command)
    program = os.path.basename(command[0]) if command else ""
    out: List[str] = []
    if "S" in flags:
        out.append(f"{program} -S skips the site module, so neither torchpatch.pth nor this command's bootstrap"
                   " (a sitecustomize) runs: torchpatch stays off in that process. Drop -S, or call"
                   " torchpatch.install() in the script")
    ignored = sorted(flags & {"I", "E"})
    if ignored:
        which = " and ".join(f"-{f}" for f in ignored)
        reached = _same_interpreter(command[0]) and _installed_startup_hooks()
        out.append(f"{program} {which} ignores PYTHONPATH, so this command's bootstrap does not reach it: torchpatch"
                   " activates there only through the torchpatch.pth of an install in that interpreter's"
                   " site-packages" + (" (this interpreter has one)" if reached else
                                       "; check with that interpreter: PYTHON -m torchpatch doctor"))
    return out


def run(command: Sequence[str], quiet: bool = False) -> int:
    """Exec ``command`` with torchpatch on (``quiet``: no warnings); returns only where it cannot be
    started: 2 for no command, 127 for one that cannot be run."""
    if not command:
        print("torchpatch run: give the command to run, e.g. torchpatch run -- torchrun train.py", file=sys.stderr)
        return 2
    if not quiet:
        for warning in bootstrap_warnings(command):
            print(f"torchpatch run: warning: {warning}", file=sys.stderr)
    env = dict(os.environ, TORCHPATCH="1")
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP] + [p for p in [env.get("PYTHONPATH")] if p])
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as exc:
        print(f"torchpatch run: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127
