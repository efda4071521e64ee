"""``TORCHPATCH_REPORT=DIR``: one JSON file per process that activated torchpatch.

The file is ``DIR/torchpatch-<host>-<rank>-<pid>.json`` (``<rank>``: the ``RANK`` a launcher set, or
``none``). It says who the process was (host, pid, parent pid, rank, local rank, world size, command
line), what it ran on (Python, torch, torchpatch), each armed patch with its status (and, for a
failed one, why), the patches the flags switched off, and the served modules and symbols the process
actually used. It is written at activation, each time a patch has applied or failed
(``"complete": false``), and at exit (``"complete": true``): a process that never reaches its
atexit handlers (killed by a signal, ``os._exit``, an actor that Ray kills) still leaves what it
did, all but the served names it used after the last patch settled. A patch settles when its torch
module is first imported, mostly at start-up: a few writes per process, none in a training loop.
The engine notes each served module and symbol when it is first made, which it does anyway. The
file is written to a temporary name in ``DIR`` and renamed, so ranks sharing ``DIR`` (a network
file system included) never see half a file. The file is its owner's alone (mode 0600: it holds
the command line, unless ``TORCHPATCH_REPORT_ARGV=0``), and a ``DIR`` another user owns, or may write
into without the sticky bit, is refused. A report that cannot be written is one warning per
process, never an error (``TORCHPATCH_STRICT`` included): atexit cannot change the exit status,
and the job's result matters more than its report.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import stat
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple, Union

from . import _versions
from ._config import shown
from ._summary import log
from ._version import __version__

if TYPE_CHECKING:
    from ._config import Config
    from ._outcome import Outcome

NO_RANK = "none"  # the rank in the file name of a process no launcher gave a RANK
_outcome: Optional[Callable[[], "Outcome"]] = None  # the newest installation's
_directory = ""
_with_argv = True
_warned = False  # a report that cannot be written is said once
_written: Tuple[int, str] = (0, "")  # (pid, path) of the file last written


def arm(cfg: "Config", outcome: Callable[[], "Outcome"]) -> Callable[[], None]:
    """Write the report of an installation (the newest of this process; ``outcome()``: what it has
    done so far) now, and at exit, into ``TORCHPATCH_REPORT`` taken relative to the working
    directory at activation; the function to call whenever one of its patches settles, which
    writes it again."""
    global _outcome, _directory, _with_argv
    if _outcome is None:
        atexit.register(_write, True)
    _outcome = outcome
    _directory = os.path.abspath(cfg.report_dir)
    _with_argv = cfg.report_argv
    _write(False)
    return lambda: _write(False)


def _number(name: str) -> Union[int, str, None]:
    """An integer variable a launcher sets (``RANK``...): the integer, the text if it is not one."""
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return value


def _stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def build(outcome: "Outcome", with_argv: bool, complete: bool = True) -> Dict[str, Any]:
    """The report of this process, as a JSON-ready dict (``with_argv``: its command line included;
    ``complete``: written at exit)."""
    import socket

    served_modules = {
        name: {"patch": patch, **({"alias_of": real} if real else {})}
        for name, (patch, real) in sorted(outcome.served_modules.items())
    }
    return {
        "torchpatch": __version__,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "parent_pid": os.getppid(),
        "rank": _number("RANK"),
        "local_rank": _number("LOCAL_RANK"),
        "world_size": _number("WORLD_SIZE"),
        "argv": list(sys.argv) if with_argv else None,
        "executable": sys.executable,
        "python": _versions.python_version(),
        "torch": _versions.torch_version(),
        "activated": _stamp(outcome.started),
        "written": _stamp(time.time()),
        "complete": complete,
        "flags": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHPATCH")},
        "patches": {
            patch_id: {"status": status, **({"error": outcome.errors[patch_id]} if patch_id in outcome.errors else {})}
            for patch_id, status in sorted(outcome.status.items())
        },
        "switched_off": outcome.switched_off,
        "used": {
            "modules": served_modules,
            "symbols": {name: {"patch": patch} for name, patch in sorted(outcome.served_symbols.items())},
        },
    }


def file_name(host: str, rank: Union[int, str, None], pid: int) -> str:
    """``torchpatch-<host>-<rank>-<pid>.json``, with anything but ``[A-Za-z0-9._]`` in the host
    and rank made ``_`` (so that the name stays one path component, its dashes unambiguous)."""
    clean = lambda text: re.sub(r"[^A-Za-z0-9._]", "_", text)  # noqa: E731
    return f"torchpatch-{clean(host)}-{clean(NO_RANK if rank is None else str(rank))}-{pid}.json"


REPORT_MODE = 0o600  # a report describes one user's job (its command line, its paths): its owner reads it


class UnsafeFolder(Exception):
    """A report folder in which another user could replace or read what this process writes."""


def check_folder(folder: os.stat_result, uid: int) -> None:
    """UnsafeFolder where ``folder`` (the report folder's stat) belongs to another user (root
    aside: ``/tmp`` is root's) or others may write into it without the sticky bit: there they could
    rename this process's files away and put theirs (or a link) in their place."""
    if folder.st_uid not in (uid, 0):
        raise UnsafeFolder(f"it belongs to another user (uid {folder.st_uid})")
    if folder.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not folder.st_mode & stat.S_ISVTX:
        raise UnsafeFolder(f"others can write into it (mode {stat.S_IMODE(folder.st_mode):o}, no sticky bit)")


def write(directory: str, report: Dict[str, Any]) -> str:
    """Write ``report`` atomically into ``directory`` (made, mode 0700, if missing) as a file only
    its owner reads; the file's path. UnsafeFolder where the folder is not safe to write into.

    Everything happens relative to the folder opened once and checked (``dir_fd``), so swapping
    the folder after the check changes nothing. The temporary file is made with ``O_EXCL`` and
    ``O_NOFOLLOW`` (a link planted at its name fails the write) and its mode is set on the open
    descriptor, never through a name. ``os.replace`` renames the temporary name's entry: a link
    planted at the final name is replaced, never followed. Another user who could still swap the
    temporary name for a link before the rename would need write access to a folder without the
    sticky bit, which :func:`check_folder` refuses.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    name = file_name(report["host"], report["rank"], report["pid"])
    folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        check_folder(os.fstat(folder), os.geteuid())
        temporary = f".torchpatch-{os.getpid()}-{os.urandom(6).hex()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, REPORT_MODE, dir_fd=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                os.fchmod(fd, REPORT_MODE)  # the umask does not decide who reads it
                json.dump(report, f, indent=1)
                f.write("\n")
            os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            try:
                os.remove(temporary, dir_fd=folder)
            except OSError:
                pass
            raise
    finally:
        os.close(folder)
    return os.path.join(directory, name)


def _write(complete: bool) -> None:
    """Write this process's report now (``complete`` at exit); a failure is one warning per process."""
    global _written
    outcome = _outcome
    if outcome is None:
        return
    directory = _directory
    try:
        path = write(directory, build(outcome(), _with_argv, complete))
        # one file per process: a launcher's library may set RANK after the first write (Ray
        # Train's), so the name changes; a forked child's first write is its own file
        if _written[0] == os.getpid() and _written[1] != path:
            os.remove(_written[1])
        _written = (os.getpid(), path)
    except UnsafeFolder as exc:
        _warn_once("not writing this process's report into %s (TORCHPATCH_REPORT): %s, so another user could "
                   "replace or read it; point TORCHPATCH_REPORT at a directory of yours that only you can write "
                   "(or one with the sticky bit, chmod +t), or unset it", shown(directory), exc)
        return
    except Exception as exc:  # a full disk or a read-only DIR must not turn a finished job into a traceback
        _warn_once("cannot write this process's report into %s (TORCHPATCH_REPORT): %s: %s; point "
                   "TORCHPATCH_REPORT at a writable directory, or unset it", shown(directory), type(exc).__name__, exc)
        return
    log.debug("report written to %s", path)


def _warn_once(message: str, *args: object) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(message, *args)
