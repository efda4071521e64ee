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
file system included) never see half a file. A report that cannot be written is one warning per
process, never an error (``TORCHPATCH_STRICT`` included): atexit cannot change the exit status,
and the job's result matters more than its report.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, Union

from . import _versions
from ._summary import log

if TYPE_CHECKING:
    from ._manager import _Installation

NO_RANK = "none"  # the rank in the file name of a process no launcher gave a RANK
_installation: Optional["_Installation"] = None
_directory = ""
_warned = False  # a report that cannot be written is said once
_written: Tuple[int, str] = (0, "")  # (pid, path) of the file last written


def arm(inst: "_Installation") -> None:
    """Write the report of ``inst`` (the newest installation of this process) now, whenever one of
    its patches settles, and at exit, into ``TORCHPATCH_REPORT`` taken relative to the working
    directory at activation."""
    global _installation, _directory
    if _installation is None:
        atexit.register(_write, True)
    _installation = inst
    _directory = os.path.abspath(inst.cfg.report_dir)
    inst.on_settled = lambda: _write(False)
    _write(False)


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


def build(inst: "_Installation", complete: bool = True) -> Dict[str, Any]:
    """The report of this process, as a JSON-ready dict (``complete``: written at exit)."""
    import socket

    from ._manager import __version__

    served_modules = {
        name: {"patch": patch, **({"alias_of": real} if real else {})}
        for name, (patch, real) in sorted(inst.shims.served.items())
    }
    return {
        "torchpatch": __version__,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "parent_pid": os.getppid(),
        "rank": _number("RANK"),
        "local_rank": _number("LOCAL_RANK"),
        "world_size": _number("WORLD_SIZE"),
        "argv": list(sys.argv),
        "executable": sys.executable,
        "python": _versions.python_version(),
        "torch": _versions.torch_version(),
        "activated": _stamp(inst.started),
        "written": _stamp(time.time()),
        "complete": complete,
        "flags": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHPATCH")},
        "patches": {
            patch_id: {"status": status, **({"error": inst.errors[patch_id]} if patch_id in inst.errors else {})}
            for patch_id, status in sorted(inst.status.items())
        },
        "switched_off": {p.patch.id: p.decision.reason for p in inst.plans if p.applies and not p.decision.enabled},
        "used": {
            "modules": served_modules,
            "symbols": {name: {"patch": patch} for name, patch in sorted(inst.symbols_used.items())},
        },
    }


def file_name(host: str, rank: Union[int, str, None], pid: int) -> str:
    """``torchpatch-<host>-<rank>-<pid>.json``, with anything but ``[A-Za-z0-9._]`` in the host
    and rank made ``_`` (so that the name stays one path component, its dashes unambiguous)."""
    clean = lambda text: re.sub(r"[^A-Za-z0-9._]", "_", text)  # noqa: E731
    return f"torchpatch-{clean(host)}-{clean(NO_RANK if rank is None else str(rank))}-{pid}.json"


def write(directory: str, report: Dict[str, Any]) -> str:
    """Write ``report`` into ``directory`` (made if missing) atomically; the file's path."""
    import tempfile

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, file_name(report["host"], report["rank"], report["pid"]))
    fd, temporary = tempfile.mkstemp(prefix=".torchpatch-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        os.chmod(temporary, 0o666 & ~_umask())  # as open() would make it: mkstemp's is 0600
        os.replace(temporary, path)
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise
    return path


def _umask() -> int:
    """This process's umask, read without setting it where Linux says it (``os.umask`` sets it
    for every thread, for a moment)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write(complete: bool) -> None:
    """Write this process's report now (``complete`` at exit); a failure is one warning per process."""
    global _warned, _written
    inst = _installation
    if inst is None:
        return
    directory = _directory
    try:
        path = write(directory, build(inst, complete))
        # one file per process: a launcher's library may set RANK after the first write (Ray
        # Train's), so the name changes; a forked child's first write is its own file
        if _written[0] == os.getpid() and _written[1] != path:
            os.remove(_written[1])
        _written = (os.getpid(), path)
    except Exception as exc:  # a full disk or a read-only DIR must not turn a finished job into a traceback
        if not _warned:
            _warned = True
            log.warning("cannot write this process's report into %s (TORCHPATCH_REPORT): %s: %s; point "
                        "TORCHPATCH_REPORT at a writable directory, or unset it", directory, type(exc).__name__, exc)
        return
    log.debug("report written to %s", path)
