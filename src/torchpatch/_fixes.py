"""The errors the catalogue's patches fix (``Patch(errors=...)``), as data: ``patches/_data/patch_errors.json``,
which ``tools/patch_table.py --write`` generates. ``torchpatch explain`` matches them in messages and logs;
the exit hint (:func:`arm_exit_hint`) matches the exception a process dies of, without importing a patch.

The exit hint: with torchpatch active, a process that dies of an uncaught exception which a patch fixes
but which is switched off here, or which is for other torch versions, prints one line to stderr after the
traceback, prefixed with its rank where it has one (``[rank1]: ``, as torch's own hook prefixes the
traceback): only the process whose exception it is prints, once, so no file is shared between the
ranks of a job (sys.excepthook and threading.excepthook both chained; the originals still run first, unchanged, and
the exit status is the interpreter's). Nothing is read until an exception reaches the hook.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _versions

FILE = "patch_errors.json"
MAX_CHAIN = 8  # causes and contexts of an exception looked at


@functools.lru_cache(maxsize=None)
def patch_errors() -> Dict[str, Dict[str, Any]]:
    """Patch id -> ``{"torch", "summary", "upstream", "patterns", "examples"}`` for each patch with errors."""
    from ._registry import catalogue_data

    return json.loads((catalogue_data() / FILE).read_text())["patches"]


@functools.lru_cache(maxsize=None)
def _compiled() -> Tuple[Tuple[str, "re.Pattern[str]"], ...]:
    return tuple((pid, re.compile(p)) for pid, entry in patch_errors().items() for p in entry["patterns"])


def fixed_by(text: str) -> List[str]:
    """The ids of the patches that fix an error one of ``text``'s lines shows."""
    lines = text.splitlines() or [text]
    return list(dict.fromkeys(pid for pid, pattern in _compiled() for line in lines if pattern.search(line)))


def _shown(exc: BaseException) -> str:
    """What the traceback prints of ``exc`` and the exceptions it chains: their last lines, in full."""
    import traceback

    parts, seen = [], set()
    while exc is not None and id(exc) not in seen and len(parts) < MAX_CHAIN:
        seen.add(id(exc))
        parts.append("".join(traceback.format_exception_only(type(exc), exc)))
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return "\n".join(parts)


def hint(exc: BaseException, switched_off: Dict[str, str], torch: Optional[str]) -> Optional[str]:
    """The exit hint for ``exc``: a patch fixes it but is off here (``switched_off``: id -> why) or is
    for other torch versions than ``torch``; None otherwise (no such patch, or it was on)."""
    if not isinstance(exc, Exception):
        return None
    for pid in fixed_by(_shown(exc)):
        entry = patch_errors()[pid]
        if pid in switched_off:
            return (f"this error is what patch {pid} fixes, but it is off here ({switched_off[pid]}); "
                    f"`torchpatch explain` tells more")
        if torch is not None and not _versions.matches(entry["torch"], torch):
            return (f"patch {pid} fixes this error on torch {entry['torch']}, not on this torch {torch}; "
                    f"`torchpatch explain` tells more")
    return None


class _ExitHint:
    """The chained excepthooks of one installation; ``outcome`` says which patches are off here."""

    def __init__(self, switched_off: Callable[[], Dict[str, str]]) -> None:
        self._switched_off = switched_off
        self._said = False
        self.sys_hook, self.thread_hook = sys.excepthook, threading.excepthook

    def _say(self, exc: Optional[BaseException]) -> None:
        if self._said or exc is None:
            return
        try:
            line = hint(exc, self._switched_off(), _versions.torch_version())
        except Exception:  # a hint must never add a traceback of its own
            return
        if line:
            self._said = True
            rank = os.environ.get("RANK")
            # inside torch's own hook (init_process_group's, 2.2+) stderr is its buffer, which it prefixes
            prefix = f"[rank{rank}]: " if rank and sys.stderr is sys.__stderr__ else ""
            sys.stderr.write(f"{prefix}torchpatch: {line}\n")
            sys.stderr.flush()

    def on_exception(self, kind: Any, value: Any, tb: Any) -> None:
        self.sys_hook(kind, value, tb)
        self._say(value)

    def on_thread_exception(self, args: Any) -> None:
        self.thread_hook(args)
        self._say(args.exc_value)


_armed: Optional[_ExitHint] = None


def arm_exit_hint(switched_off: Callable[[], Dict[str, str]]) -> None:
    """Chain the hint onto ``sys.excepthook`` and ``threading.excepthook`` (once per process)."""
    global _armed
    if _armed is not None:
        return
    _armed = _ExitHint(switched_off)
    sys.excepthook, threading.excepthook = _armed.on_exception, _armed.on_thread_exception


def disarm_exit_hint() -> None:
    """Put the original hooks back, where nothing chained itself after ours since."""
    global _armed
    armed, _armed = _armed, None
    if armed is None:
        return
    if sys.excepthook == armed.on_exception:
        sys.excepthook = armed.sys_hook
    if threading.excepthook == armed.on_thread_exception:
        threading.excepthook = armed.thread_hook
