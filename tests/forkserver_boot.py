"""The fork server's own program (tests/forkserver.py starts it as ``python -c <this file's text>``).

It starts as a fresh interpreter of the venv does, in the environment the client gave it:
torchpatch's start-up hook runs (activation with that environment's ``TORCHPATCH*`` flags), then it
imports ``torch`` and ``torch._dynamo`` (where torch has it), so each of their modules' patches apply
in it exactly when a fresh interpreter importing them would apply them. Then it forks one child per
request; the child takes the request's environment, arguments, working directory and output files,
and runs the code as ``__main__``; it ends as the interpreter's exit does (SystemExit, uncaught exceptions, non-daemon
threads, atexit handlers) but leaves without tearing modules down (``_exit``). Only modules that
``import torch`` and ``import torch._dynamo`` load anyway are imported before it.

argv: the socket path, the ready pipe's write end, the lifeline pipe's read end (EOF: exit).
"""

import os
import sys

import torch  # noqa: F401  (the point: what every child starts with)

try:  # half of the CPU time of a DTensor, FSDP2, DCP or pipelining import, which all import it
    import torch._dynamo  # noqa: F401
except ModuleNotFoundError as exc:  # torch 1.13 has none
    if exc.name != "torch._dynamo":
        raise

import json
import select
import signal
import socket
import struct
import types

_SOCKET, _READY, _LIFELINE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
_HEADER = struct.Struct("!Q")


def _initial_environment():
    """The environment this process was started with (os.environ now also holds what activation set)."""
    with open("/proc/self/environ", "rb") as f:
        items = [entry.partition(b"=") for entry in f.read().split(b"\0") if entry]
    return {os.fsdecode(k): os.fsdecode(v) for k, _, v in items}


def _recv_exactly(conn, size):
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _serve():
    """Return a request (in a forked child) or never (the server exits with os._exit)."""
    initial = _initial_environment()
    activation_set = {k: v for k, v in os.environ.items() if initial.get(k) != v}
    threads = len(os.listdir("/proc/self/task"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(_SOCKET)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(os.path.join(os.path.dirname(_SOCKET), "server.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.write(_READY, f"ready {threads}\n".encode())
    os.close(_READY)
    running = {}  # pid -> the client's connection
    while True:
        readable = select.select([listener, wake_r, _LIFELINE], [], [])[0]
        if _LIFELINE in readable:
            os._exit(0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{status}\n".encode())
                except OSError:
                    pass
                conn.close()
        if listener not in readable:
            continue
        conn = listener.accept()[0]
        try:
            header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 2)
            request = json.loads(_recv_exactly(conn, _HEADER.unpack(header)[0]))
        except (OSError, EOFError, ValueError, struct.error):
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w, _LIFELINE):
                os.close(fd)
            listener.close()
            for other in running.values():
                other.close()
            conn.close()
            return request, fds, activation_set
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        running[pid] = conn


def _run(request, fds, activation_set):
    """Run the request as __main__; its exit status."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(activation_set)
    sys.argv = request["argv"]
    sys.path[0] = request["path0"]
    main = types.ModuleType("__main__")
    if request["file"] is not None:
        main.__file__ = request["file"]
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    if os.environ.get("NATIVE_ERRORS_OUT"):  # tools/native_errors.py: record the exceptions the program meets
        tracer = {}
        exec(open(os.path.join(os.environ["NATIVE_ERRORS_OUT"], "tracer.py")).read(), tracer)
        tracer["install"](request["file"] or "<string>")
    try:
        exec(compile(request["source"], request["file"] or "<string>", "exec"), vars(main))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # as at a fresh interpreter's top level, without this program's frames
        kind, value, tb = sys.exc_info()
        sys.excepthook(kind, value.with_traceback(tb.tb_next), tb.tb_next)
        return -signal.SIGINT if kind is KeyboardInterrupt else 1
    return 0


def _exit(status):
    """End as the interpreter's exit begins (non-daemon threads joined, atexit handlers, streams
    flushed), then without tearing down modules: that teardown takes seconds with torch loaded, and
    what it does (objects' __del__) is what the fresh_interpreter tests are for."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if status == -signal.SIGINT:  # as CPython ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status & 0xFF)


_exit(_run(*_serve()))
