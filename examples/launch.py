"""A minimal torchrun stand-in: start N ranks of a script on this host and wait for them.

    python examples/launch.py --nproc 2 [--timeout 120] examples/train.py [script args]

Each rank is ``<this python> script args`` with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1 and a free MASTER_PORT in its environment; the rest is inherited (so
``TORCHPATCH=1`` reaches the ranks) and OMP_NUM_THREADS defaults to 1, as with torchrun. If a rank
fails, the others are killed; if the timeout runs out, all are. The exit status is 0 only if every
rank exited 0 (124 on a timeout). For torch versions whose own torchrun is broken (torch 1.13.1's
crashes on Python 3.11), and for the tests (no agent process). Importable: ``launch()`` returns one
result per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Sequence

TIMEOUT_RC = 124


class RankResult(subprocess.CompletedProcess):  # type: ignore[type-arg]
    """A finished rank: ``args``, ``returncode``, ``stdout``, ``stderr`` (str, or None when not
    captured), plus ``rank`` and ``timed_out``. Ranks killed by the launcher have a negative
    ``returncode``; ``killed`` says so."""

    def __init__(self, args: List[str], returncode: int, stdout: Optional[str],
                 stderr: Optional[str], rank: int, timed_out: bool, killed: bool) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.rank, self.timed_out, self.killed = rank, timed_out, killed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(procs: Sequence[Any], grace: float = 5.0) -> List[int]:
    """Terminate, then kill, every rank still running; return the indices it stopped."""
    alive = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in alive:
        procs[i].terminate()
    deadline = time.monotonic() + grace
    for i in alive:
        try:
            procs[i].wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs[i].kill()
            procs[i].wait()
    return alive


def _read(f: IO[str]) -> str:
    f.seek(0)
    return f.read()


def launch(script: str, nproc: int = 2, args: Sequence[str] = (),
           env: Optional[Mapping[str, str]] = None, timeout: float = 120.0, capture: bool = True,
           python: str = sys.executable, popen: Callable[..., Any] = subprocess.Popen,
           cwd: Optional[str] = None, inherit: bool = True) -> List[RankResult]:
    """Run ``python script *args`` as ``nproc`` ranks (in ``cwd``); return their results in rank order.

    ``env`` is added to (and overrides) this process's environment (with ``inherit=False``, it is
    the whole environment, plus the ranks' variables). With ``capture`` the output of
    each rank is collected in its result, otherwise it goes to this process's stdout/stderr.
    ``popen`` starts each rank (``subprocess.Popen``'s signature; the tests pass a fork server's).
    """
    base: Dict[str, str] = dict(os.environ) if inherit else {}
    base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks share the cores
    base.update(env or {})
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0")
    cmd = [python, script, *args]
    procs: List[Any] = []  # subprocess.Popen's, or what ``popen`` gives
    files: List[Optional[IO[str]]] = []
    stopped: List[int] = []
    timed_out = False
    with contextlib.ExitStack() as stack:
        try:
            for rank in range(nproc):
                for _ in ("stdout", "stderr"):
                    files.append(stack.enter_context(tempfile.TemporaryFile("w+", errors="replace"))
                                 if capture else None)
                procs.append(popen(
                    cmd, env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)),
                    stdin=subprocess.DEVNULL, stdout=files[-2], stderr=files[-1], cwd=cwd))
            deadline = time.monotonic() + timeout
            while None in [p.poll() for p in procs]:  # a list: poll every rank, each time
                if any(p.returncode not in (None, 0) for p in procs):
                    # A second to fail on their own (and finish their tracebacks), then stop.
                    end = min(deadline, time.monotonic() + 1.0)
                    while time.monotonic() < end and None in [p.poll() for p in procs]:
                        time.sleep(0.05)
                    stopped = _stop(procs)
                    break
                if time.monotonic() > deadline:
                    timed_out, stopped = True, _stop(procs)
                    break
                time.sleep(0.05)
        finally:
            _stop(procs)  # on KeyboardInterrupt or a failed start too: leave no rank behind
        output = [_read(f) if f else None for f in files]
    # Killed: our signal ended it (a rank may exit on its own between the check and the signal).
    return [RankResult(cmd, p.returncode, output[2 * i], output[2 * i + 1], i,
                       timed_out and i in stopped, i in stopped and p.returncode < 0)
            for i, p in enumerate(procs)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", "--nproc_per_node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds (default: 120)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    results = launch(opts.script, opts.nproc, opts.args, timeout=opts.timeout, capture=False)
    failed = [r for r in results if r.returncode != 0 and not r.killed]
    for r in results:
        if r.returncode != 0:
            why = "timed out, killed" if r.timed_out else "killed" if r.killed else "failed"
            print(f"launch: rank {r.rank} {why} (exit status {r.returncode})", file=sys.stderr)
    if any(r.timed_out for r in results):
        return TIMEOUT_RC
    if failed:
        return failed[0].returncode if failed[0].returncode > 0 else 1
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
