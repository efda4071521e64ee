"""Processes forked from a warm interpreter instead of started fresh: the suite's main saving.

Most of the suite's time was ``import torch`` (about 3.7 s of CPU on these cores), paid by every
process a test starts, twice for a 2-rank job. A fork server (tests/forkserver_boot.py) is one
interpreter per (venv, environment) that started exactly as a fresh one does (torchpatch's ``.pth``
start-up hook ran, with that environment's flags) and then ran ``import torch`` and
``import torch._dynamo`` (which torch's DTensor, FSDP2, DCP and pipelining import: about half of their
import's CPU time); each process a test asks for is forked from it, takes its environment, arguments,
working directory and output files, and runs the code as ``__main__``, ending as an interpreter's exit
begins (threads joined, atexit handlers) but without tearing modules down. What that process sees
is what a fresh interpreter sees after ``import torch, torch._dynamo``: every other torch module, and
the patches on it, are imported in the child for the first time.

So a process is forked only where that is the same thing (:func:`forkable`): the code's first
statements import torch (after standard-library modules and torchpatch, at most), the environment
asks for no per-process report, and the test is not marked ``fresh_interpreter`` (activation,
``-I``/``-E``/``-S``, exit-time behaviour, the report, the summary line, launchers: what depends on
a real interpreter start). Everything else, and everything when ``TORCHPATCH_TEST_FORK=0``, starts
a fresh interpreter, as before. The environment variables a launcher or pytest sets per process
(``RANK``, ``MASTER_PORT``, ``PYTEST_*``, ...) are set in the child; torch reads none of them at import.

Differences that remain, by design: ``torch._dynamo`` is imported in a child whose code never imports
it (a test that asserts what a process imports, or when, is marked ``fresh_interpreter``); children
share the server's hash seed (``PYTHONHASHSEED``) and numpy's global random state, and their parent is
the server, not the test.
"""

from __future__ import annotations

import ast
import atexit
import collections
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, List, Mapping, Optional, Sequence, Tuple

BOOT = (Path(__file__).resolve().parent / "forkserver_boot.py").read_text()
HEADER = struct.Struct("!Q")
# Set by the launcher (or pytest) per process; neither torch nor torchpatch reads them while importing
# torch (torchpatch's summary reads RANK again at exit, its log lines per line).
PER_PROCESS = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                         "MASTER_PORT"})
PER_PROCESS_PREFIX = "PYTEST_"
# Modules a script may import before torch and still be forked: torch imports them itself (or they
# have no import-time effect on it), and torchpatch is what the start-up hook already imported.
BEFORE_TORCH = frozenset(getattr(sys, "stdlib_module_names", ())) | {"torchpatch"}
# tools/native_errors.py sets CAPTURE to a directory holding ``tracer.py``: each process a test starts
# records there the exceptions that reach its own program's code (a fresh ``-c`` one through the prelude).
CAPTURE, CAPTURE_TEST = "NATIVE_ERRORS_OUT", "PYTEST_NATIVE_ERRORS_TEST"
CAPTURE_PRELUDE = ("import os as _o; _t = {}; exec(open(_o.path.join(_o.environ['NATIVE_ERRORS_OUT'], 'tracer.py')).read(), _t); "
                   "_t['install']('<string>'); del _o, _t\n")
SERVERS_KEPT = 6  # per test process; each holds an imported torch (300-500 MB)
ENABLED = os.environ.get("TORCHPATCH_TEST_FORK", "1") != "0" and sys.platform == "linux"


def imports_torch_first(source: str) -> bool:
    """Whether the first statements of ``source`` import torch, after nothing but imports of
    ``BEFORE_TORCH`` modules (a docstring aside)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    for stmt in body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            continue
        if isinstance(stmt, ast.Import):
            names = [alias.name for alias in stmt.names]
        elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
            names = [stmt.module]
        else:
            return False
        for name in names:
            top = name.partition(".")[0]
            if top == "torch":
                return True
            if top not in BEFORE_TORCH:
                return False
    return False


class ForkedProcess:
    """A forked child, with the part of :class:`subprocess.Popen`'s interface that the tests and
    examples/launch.py use: ``pid``, ``returncode``, ``poll``, ``wait``, ``terminate``, ``kill``."""

    def __init__(self, args: List[str], conn: socket.socket) -> None:
        self.args = args
        self._conn = conn
        self._buffer = b""
        self.pid = int(self._line(None))
        self.returncode: Optional[int] = None

    def _line(self, timeout: Optional[float]) -> Optional[str]:
        self._conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                chunk = self._conn.recv(64)
            except (socket.timeout, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError(f"the fork server ended before process {self.args!r} did")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def poll(self) -> Optional[int]:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = os.waitstatus_to_exitcode(int(line))
            self._conn.close()
        return self.returncode

    def _signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


class ForkServer:
    """One warm interpreter of ``python`` in ``env``, in a private directory of its own."""

    def __init__(self, python: str, env: Mapping[str, str]) -> None:
        self.python, self.env = python, dict(env)
        self.directory = tempfile.mkdtemp(prefix="torchpatch-forkserver-")  # 0700, a fresh name
        self.socket = os.path.join(self.directory, "socket")
        self.prelude: Tuple[bytes, bytes] = (b"", b"")  # what start-up and `import torch` printed
        self.usable = False
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._lifeline = -1
        self._start()

    def _start(self) -> None:
        ready_r, ready_w = os.pipe()
        life_r, self._lifeline = os.pipe()
        with tempfile.TemporaryFile(dir=self.directory) as out, tempfile.TemporaryFile(dir=self.directory) as err:
            self._proc = subprocess.Popen(
                [self.python, "-c", BOOT, self.socket, str(ready_w), str(life_r)], env=self.env,
                cwd=self.directory, stdin=subprocess.DEVNULL, stdout=out, stderr=err, pass_fds=(ready_w, life_r))
            os.close(ready_w)
            os.close(life_r)
            with os.fdopen(ready_r, "rb") as ready:
                line = ready.readline().split()  # EOF (b"") if it failed before serving
            out.seek(0)
            err.seek(0)
            self.prelude = (out.read(), err.read())
        # One thread only: forking a process that runs other threads is not the same start.
        self.usable = line[:1] == [b"ready"] and line[1:] == [b"1"]
        if not self.usable:
            self.close()

    def popen(self, cmd: List[str], argv: List[str], source: str, file: Optional[str], path0: str,
              env: Mapping[str, str], cwd: str, stdout: IO[Any], stderr: IO[Any]) -> ForkedProcess:
        """Fork a child that runs ``source`` (``file``'s text, or ``-c``'s when ``file`` is None) with
        ``sys.argv = argv``, ``sys.path[0] = path0``; what start-up printed opens its output."""
        for stream, prelude in zip((stdout, stderr), self.prelude):
            stream.flush()
            os.write(stream.fileno(), prelude)
        request = json.dumps({"argv": argv, "source": source, "file": file,
                              "path0": path0, "env": dict(env), "cwd": cwd}).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket)
        socket.send_fds(conn, [HEADER.pack(len(request))], [stdout.fileno(), stderr.fileno()])
        conn.sendall(request)
        return ForkedProcess(cmd, conn)

    def close(self) -> None:
        if self._lifeline >= 0:
            os.close(self._lifeline)  # the server sees EOF and exits; running children go on
            self._lifeline = -1
        if self._proc is not None:
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


class ForkPool:
    """The fork servers of this test process, by (python, environment less ``PER_PROCESS``); the
    least recently used beyond ``SERVERS_KEPT`` are closed."""

    def __init__(self) -> None:
        self._servers: "collections.OrderedDict[Tuple[str, frozenset], ForkServer]" = collections.OrderedDict()
        atexit.register(self.close)

    def server(self, python: str, env: Mapping[str, str]) -> ForkServer:
        key = (python, frozenset((k, v) for k, v in env.items() if k not in PER_PROCESS and not k.startswith(PER_PROCESS_PREFIX)))
        if key in self._servers:
            self._servers.move_to_end(key)
        else:
            self._servers[key] = ForkServer(python, dict(key[1]))
            while len(self._servers) > SERVERS_KEPT:
                self._servers.popitem(last=False)[1].close()
        return self._servers[key]

    def close(self) -> None:
        while self._servers:
            self._servers.popitem()[1].close()


POOL = ForkPool()
allowed = True  # False while a test marked fresh_interpreter runs (tests/conftest.py)


def forkable(source: str, env: Mapping[str, str]) -> bool:
    return ENABLED and allowed and "TORCHPATCH_REPORT" not in env and imports_torch_first(source)


def popen(cmd: Sequence[str], *, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
          stdin: Any = None, stdout: Any = None, stderr: Any = None) -> Any:
    """``subprocess.Popen(cmd, ...)``, forked from a warm interpreter where that is the same thing:
    ``cmd`` is ``[python, "-c", code, *args]`` or ``[python, script, *args]``, ``stdin`` is DEVNULL and
    ``stdout``/``stderr`` are files (examples/launch.py passes these); otherwise a fresh process."""
    cmd = [str(part) for part in cmd]
    env = dict(os.environ if env is None else env)
    if CAPTURE in env:  # tools/native_errors.py: the child records the exceptions its own code meets
        env[CAPTURE_TEST] = os.environ.get("PYTEST_CURRENT_TEST", "")
        if len(cmd) >= 3 and cmd[1] == "-c" and not forkable(cmd[2], env):
            cmd[2] = CAPTURE_PRELUDE + cmd[2]
    fresh = lambda: subprocess.Popen(cmd, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)  # noqa: E731
    plain = len(cmd) >= 2 and not cmd[1].startswith("-") or len(cmd) >= 3 and cmd[1] == "-c"
    if not (plain and stdin == subprocess.DEVNULL and hasattr(stdout, "fileno") and hasattr(stderr, "fileno")):
        return fresh()
    if cmd[1] == "-c":
        source, file, path0, argv = cmd[2], None, "", ["-c", *cmd[3:]]
    else:
        try:
            source = Path(cwd or ".", cmd[1]).read_text()
        except (OSError, UnicodeDecodeError):
            return fresh()
        file = os.path.abspath(os.path.join(cwd or ".", cmd[1]))
        path0, argv = os.path.dirname(os.path.realpath(file)), cmd[1:]
    if not forkable(source, env):
        return fresh()
    server = POOL.server(cmd[0], env)
    if not server.usable:
        return fresh()
    return server.popen(cmd, argv, source, file, path0, env, os.path.abspath(cwd or os.getcwd()), stdout, stderr)


def run(cmd: Sequence[str], *, env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
        cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)``
    (stdin from /dev/null), forked where :func:`popen` forks."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        text = [f.read().decode(errors="replace") for f in (out, err)]
    return subprocess.CompletedProcess(list(cmd), proc.returncode, *text)
