"""gloo-exit-abort: a gloo rank aborts at interpreter exit, after its last line of Python, torch 2.10
and later.

What breaks:   a gloo job's rank dies as it exits with ``terminate called without an active
               exception`` and SIGABRT (exit code -6 / 134), so torchrun reports the whole run as
               failed after it finished. It is a race: 5 of 16 runs of a 2-rank script with a live
               subgroup on torch 2.13.0 (gloo, CPU), 0 of 20 with torchpatch; 5 of 10 runs of one
               that drops an async all_reduce and exits, on 2.14.1 and on 2.15.0, 0 of 10 with it.
Why:           since the PyObject preservation rework (torch 2.10) a C++ reference to a tensor that
               has a Python object also holds that Python object, so dropping it needs the GIL.
               Gloo's worker thread (``pt_gloo_runloop``) drops its references to a collective's
               tensors just after the collective completes. If the main thread reaches interpreter
               finalisation first (CPython lets a waiting thread ask for the GIL only after 5 ms),
               the worker, still waiting in ``take_gil``, is ended by ``pthread_exit`` inside a
               ``noexcept`` destructor (``std::terminate``) once it gets the GIL, or its wait times
               out, during finalisation: when finalisation releases the GIL (a finalizer that
               waits, or a tensor's deallocation, too briefly to lose every time) or lasts 5 ms.
Torch:         2.10 and later (2.13.0, 2.14.1 and 2.15.0 measured). Before the rework only a tensor
               whose last reference is the worker's needs the GIL (an async collective on a
               temporary, its handle dropped, then exit at once): that narrower race aborts on 1.13
               to 2.9 as well, but their worker threads are unnamed and cannot be told apart, so
               they are left alone; the common case (the tensor still alive in Python) never
               aborted there (0 of 20 runs on 2.9.0).
Fix:           an ``atexit`` callback (atexit runs before finalisation starts) hands the GIL to
               gloo's workers: it sleeps in 10 ms steps, which releases the GIL, until no worker
               thread has woken up during a step (their context-switch counts in
               ``/proc/self/task`` stand still: idle workers sleep on a condition variable), for
               2 s at most. No gloo worker thread, no wait. Without ``/proc`` (not Linux) it waits
               one fixed 50 ms step instead. A collective still waiting for its peers at exit is
               not waited for (its worker is as still as an idle one).
Upstream:      the rework: https://github.com/pytorch/pytorch/pull/167564 (no fix for gloo's
               worker threads as of torch 2.15.0)
"""

import atexit
import os
import time
from types import ModuleType
from typing import List, Optional

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="gloo-exit-abort",
    summary="gloo ranks no longer abort at exit (terminate called without an active exception)",
    torch=">=2.10",
    upstream="https://github.com/pytorch/pytorch/pull/167564",
    behaviour="at exit, waits until gloo's worker threads are idle",
)

WORKER = "pt_gloo_runloop"  # the name torch gives gloo's worker threads
STEP = 0.01  # seconds: one hand-over of the GIL
LIMIT = 2.0  # seconds: the longest wait, for a worker that keeps running
NO_PROC_WAIT = 0.05  # seconds: the one wait where threads cannot be listed
TASKS = "/proc/self/task"


def worker_status_files() -> Optional[List[str]]:
    """The ``/proc`` status file of each gloo worker thread; None where threads cannot be listed."""
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    found = []
    for tid in tids:
        try:
            with open(f"{TASKS}/{tid}/comm") as comm:
                if comm.read().strip() == WORKER:
                    found.append(f"{TASKS}/{tid}/status")
        except OSError:
            continue  # the thread ended meanwhile
    return found


def context_switches(paths: List[str]) -> List[int]:
    """Voluntary plus involuntary context switches of each thread (-1: the thread has ended)."""
    counts = []
    for path in paths:
        try:
            with open(path) as status:
                counts.append(sum(int(line.split()[1]) for line in status if "ctxt_switches:" in line))
        except OSError:
            counts.append(-1)
    return counts


def hand_over_gil() -> None:
    """Release the GIL until gloo's workers are idle (the ``atexit`` callback)."""
    paths = worker_status_files()
    if paths is None:
        time.sleep(NO_PROC_WAIT)
        return
    if not paths:
        return
    deadline = time.monotonic() + LIMIT
    before = context_switches(paths)
    while time.monotonic() < deadline:
        time.sleep(STEP)
        after = context_switches(paths)
        if after == before:
            return
        before = after


@PATCH.on_import("torch.distributed")
def wait_for_gloo_at_exit(patcher: Patcher, dist: ModuleType) -> bool:
    if not dist.is_available() or not dist.is_gloo_available():
        return False
    atexit.register(hand_over_gil)
    patcher.on_undo(lambda: atexit.unregister(hand_over_gil))
    return True
