"""gloo-exit-abort: a gloo rank aborts at interpreter exit, after its last line of Python, on every
torch: torch 1.13 and later.

What breaks:   a gloo job's rank dies as it exits with ``terminate called without an active
               exception`` and SIGABRT (exit code -6 / 134), so torchrun reports the whole run as
               failed after it finished. It is a race: 5 of 16 runs of a 2-rank script with a live
               subgroup on torch 2.13.0 (gloo, CPU), 0 of 20 with torchpatch; 5 of 10 runs of one
               that drops an async all_reduce and exits, on 2.14.1 and on 2.15.0, 0 of 10 with it.
               Before 2.10 it needs a collective whose tensor Python has already dropped (an async
               collective on a temporary, its handle dropped, then exit): on 2.1.2 such a job that
               skips ``destroy_process_group`` aborted at exit, or sat in teardown for as long as its
               switch interval (``sys.setswitchinterval``) and then aborted.
Why:           gloo's worker thread drops its references to a collective's tensors just after the
               collective completes; dropping a tensor's last reference from C++ needs the GIL when
               C++ holds its Python object: since the PyObject preservation rework (torch 2.10) for any
               tensor that has one, before it only for a tensor whose Python object Python dropped
               first (and torch kept: any tensor on 1.13.1, 2.1.2 and 2.4.1, one with Python state,
               such as an attribute, on 2.9.0). If the main thread reaches interpreter finalisation
               first (CPython lets a waiting thread ask for the GIL only after 5 ms), the worker, still
               waiting in ``take_gil``, is ended by ``pthread_exit`` inside a ``noexcept`` destructor
               (``std::terminate``) once it gets the GIL, or its wait times out, during finalisation:
               when finalisation releases the GIL (flushing buffered output, a finalizer that waits,
               the group freed by a holder that releases it: 1.13, 2.8+) or lasts 5 ms. On 2.0-2.7
               the group freed with the GIL held (see gloo-destroy-hang) even waits for that worker
               (``~ProcessGroupGloo`` takes the lock the worker holds) until its wait times out.
Torch:         1.13 and later: 2.10+ for any collective (2.13.0, 2.14.1 and 2.15.0 measured); 1.13 to
               2.9 for a collective on a tensor Python dropped (1.13.1, 2.1.2, 2.4.1 and 2.9.0
               measured: the test's forced order aborted 4 of 4 runs natively on each, 0 with the
               patch); the common case (the tensor still alive in Python) never aborted there (0 of
               20 runs on 2.9.0).
Fix:           an ``atexit`` callback (atexit runs before finalisation starts) hands the GIL to
               gloo's workers: it sleeps in 10 ms steps, which releases the GIL, until no worker
               thread has woken up during a step (their context-switch counts in
               ``/proc/self/task`` stand still: idle workers sleep on a condition variable), for
               2 s at most. The workers are the threads torch 2.10+ names ``pt_gloo_runloop`` and,
               on every torch (before 2.10 they are unnamed), the ones ``ProcessGroupGloo``'s
               constructor starts: the last ``options._threads`` threads new in ``/proc/self/task``
               (listed in creation order; its device's event-loop thread, started first, wakes every
               10 ms), known by id and start time. No gloo worker thread, no wait. Without ``/proc``
               (not Linux) it waits one fixed 50 ms step instead. A collective still waiting for its
               peers at exit is not waited for (its worker is as still as an idle one); nor are the
               workers of a gloo backend torch 2.9 creates in C++ (``split_group``).
Upstream:      the rework: https://github.com/pytorch/pytorch/pull/167564 (no fix for gloo's
               worker threads as of torch 2.15.0)
"""

import atexit
import os
import threading
import time
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="gloo-exit-abort",
    summary="gloo ranks no longer abort at exit (terminate called without an active exception)",
    torch=">=1.13",
    upstream="https://github.com/pytorch/pytorch/pull/167564",
    behaviour="at exit, waits until gloo's worker threads are idle",
)

WORKER = "pt_gloo_runloop"  # the name torch 2.10+ gives gloo's worker threads
STEP = 0.01  # seconds: one hand-over of the GIL
LIMIT = 2.0  # seconds: the longest wait, for a worker that keeps running
NO_PROC_WAIT = 0.05  # seconds: the one wait where threads cannot be listed
TASKS = "/proc/self/task"

# The worker threads ProcessGroupGloo's constructor started: (thread id, start time), in creation order.
created: List[Tuple[str, str]] = []


def start_time(tid: str) -> Optional[str]:
    """The thread's start time (``/proc``'s ``stat``, field 22): with its id, which threads reuse once it
    has ended, it names this one thread."""
    try:
        with open(f"{TASKS}/{tid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def record_workers(before: List[str], count: int) -> None:
    """Remember the last ``count`` native threads started since ``before`` was listed: a gloo backend's
    workers, which its constructor starts after its device's event-loop thread (which wakes every 10 ms:
    waiting for it to be still would always take the whole ``LIMIT``)."""
    try:
        now = os.listdir(TASKS)  # in the order the threads were created, whatever their ids
    except OSError:
        return
    known, python = set(before), {str(thread.native_id) for thread in threading.enumerate()}
    new = [tid for tid in now if tid not in known and tid not in python]
    for tid in new[-count:] if count > 0 else ():
        started = start_time(tid)
        if started is not None:
            created.append((tid, started))


def recording_workers(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                      kwargs: Dict[str, Any]) -> None:
    """``ProcessGroupGloo.__init__``: before torch 2.10 gloo's workers are unnamed, so they are known by
    being started here."""
    try:
        before = os.listdir(TASKS)
    except OSError:
        before = None
    wrapped(*args, **kwargs)
    count = getattr(getattr(instance, "options", None), "_threads", None)  # 2 unless options say otherwise
    if before is not None and isinstance(count, int):
        record_workers(before, count)


def worker_status_files() -> Optional[List[str]]:
    """The ``/proc`` status file of each live gloo worker thread (named, or recorded at its creation);
    None where threads cannot be listed."""
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    found = {tid for tid, started in created if start_time(tid) == started}
    for tid in tids:
        try:
            with open(f"{TASKS}/{tid}/comm") as comm:
                if comm.read().strip() == WORKER:
                    found.add(tid)
        except OSError:
            continue  # the thread ended meanwhile
    return [f"{TASKS}/{tid}/status" for tid in sorted(found, key=int)]


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
    patcher.wrap(dist.distributed_c10d.ProcessGroupGloo, "__init__", recording_workers)
    atexit.register(hand_over_gil)
    patcher.on_undo(lambda: atexit.unregister(hand_over_gil))
    patcher.on_undo(created.clear)
    return True
