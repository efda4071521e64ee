"""What exists on the installed torch, asked of a helper interpreter (:mod:`.helper`) that imports
torch once; and the layered view that asks it only what the installed torch's inventory cannot say.

Each answer must come within ``TORCHPATCH_CHECK_TIMEOUT`` seconds (default 60: the first answer
includes importing torch); a helper that does not answer is killed and the check fails with
:class:`~.base.CheckError`, naming the fixes.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from typing import IO, Dict, List, Optional, Sequence, Tuple

from .base import UNKNOWN, CheckError, Lookup
from .inventory import InventoryView

TIMEOUT_VARIABLE = "TORCHPATCH_CHECK_TIMEOUT"
DEFAULT_TIMEOUT = 60.0


def answer_timeout() -> float:
    """Seconds to wait for each answer of the helper (``TORCHPATCH_CHECK_TIMEOUT``)."""
    value = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        raise CheckError(f"{TIMEOUT_VARIABLE}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise CheckError(f"{TIMEOUT_VARIABLE}={value!r}: give a positive number of seconds")
    return seconds


def helper_command(patched: bool) -> List[str]:
    """The helper run with this interpreter: the installed torch, torchpatch off (or on)."""
    return [sys.executable, "-m", "torchpatch._check.helper"] + (["--patched"] if patched else [])


def helper_env(patched: bool) -> Dict[str, str]:
    """This environment without ``TORCHPATCH``: without any ``TORCHPATCH_*`` variable for torch
    as it is; with the switches (and logging off) for torch as torchpatch serves it."""
    if not patched:
        return {k: v for k, v in os.environ.items() if not k.startswith("TORCHPATCH")}
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHPATCH", "TORCHPATCH_STRICT", TIMEOUT_VARIABLE)}
    env["TORCHPATCH_LOG"] = "off"
    return env


def _read_lines(stream: IO[str], into: "queue.Queue[str]") -> None:
    for line in stream:
        into.put(line)
    into.put("")  # end of output


class LiveView:
    """The installed torch as the helper finds it: with torchpatch off, or (``patched``) with it
    on, which is how the names a shim module holds are found where its torch is installed."""

    def __init__(self, patched: bool = False, command: Optional[Sequence[str]] = None,
                 timeout: Optional[float] = None) -> None:
        self.patched = patched
        self.label = "the installed torch with torchpatch on" if patched else "the installed torch"
        self._command = list(command) if command else helper_command(patched)
        self._timeout = timeout
        self._proc: Optional[subprocess.Popen[str]] = None
        self._lines: "queue.Queue[str]" = queue.Queue()
        self._memo: Dict[Tuple[str, ...], Lookup] = {}
        self._stopped = False  # the helper ended (or was stopped): it answers no more

    def start(self) -> None:
        """Start the helper (it imports torch at once), ahead of the first question."""
        if self._proc is None and not self._stopped:
            self._proc = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, env=helper_env(self.patched), text=True)
            threading.Thread(target=_read_lines, args=(self._proc.stdout, self._lines), daemon=True).start()

    def _ask(self, *query: str) -> Lookup:
        if query in self._memo:
            return self._memo[query]
        timeout = self._timeout if self._timeout is not None else answer_timeout()
        self.start()
        answer: Lookup = (UNKNOWN, "", "the helper interpreter that imports torch stopped")
        if not self._stopped:
            try:
                assert self._proc is not None and self._proc.stdin is not None
                self._proc.stdin.write(json.dumps(query) + "\n")
                self._proc.stdin.flush()
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                self._proc.kill()
                self._proc.wait()
                self._stopped = True
                importing = query[1] if self._memo else "torch"  # the first answer waits for torch's import
                raise CheckError(
                    f"the helper interpreter that imports the installed torch ({' '.join(self._command)}) gave no "
                    f"answer within {timeout:g} s and was stopped: importing {importing} hangs or is this slow here. "
                    f"Wait longer with {TIMEOUT_VARIABLE}=SECONDS, or leave the installed torch alone: --no-import "
                    "(its inventory only) or --torch VERSION (an inventoried torch)") from None
            except OSError:  # the helper is gone: its pipe is closed
                line = ""
            self._stopped = not line
            if line:
                answer = tuple(json.loads(line))
        self._memo[query] = answer
        return answer

    def child(self, module: str, name: str) -> Lookup:
        return self._ask("child", module, name)

    def op(self, namespace: str, name: str) -> Lookup:
        return self._ask("op", namespace, name)

    def close(self) -> None:
        """Stop the helper: it keeps nothing, so it is killed rather than left to tear torch down."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            if self._proc.stdin is not None:
                try:
                    self._proc.stdin.close()
                except OSError:  # unflushed input to a dead helper
                    pass
            self._proc = None
        self._stopped = True


class LayeredView:
    """The inventory first; what it cannot decide goes to the live torch."""

    def __init__(self, first: InventoryView, live: LiveView) -> None:
        self.first, self.live = first, live
        self.label = f"{first.label} and the installed torch"

    def child(self, module: str, name: str) -> Lookup:
        found = self.first.child(module, name)
        return self.live.child(module, name) if found[0] == UNKNOWN else found

    def op(self, namespace: str, name: str) -> Lookup:
        found = self.first.op(namespace, name)
        return self.live.op(namespace, name) if found[0] == UNKNOWN else found

    def start(self) -> None:
        self.live.start()

    def close(self) -> None:
        self.live.close()
