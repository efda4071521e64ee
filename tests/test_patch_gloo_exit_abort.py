"""gloo-exit-abort: gloo's worker thread must not be killed waiting for the GIL at interpreter exit.

The abort needs two things: gloo's worker waits for the GIL when interpreter finalisation begins,
and it then gets the GIL (or its wait times out) while finalisation runs, whereupon CPython ends the
thread. Both are made certain, whatever the machine's load, by ordering alone:

- rank 0 posts an async all_gather and drops both the work and its input, so gloo's worker holds the
  last reference to the work and the work the last to the input, whose C++ side then owns its Python
  object: freeing it needs the GIL on every torch (from 2.10 on, a tensor alive in Python does too).
  The input carries an attribute: torch 2.9 keeps the Python object of a tensor with Python state
  only (a plain temporary never aborted there, 0 of 2 runs). Only then does rank 1 join: it waits
  for a byte that rank 0 writes into a shared ``mmap`` (a store call would release rank 0's GIL).
  From that write on rank 0 keeps the GIL (pure Python, numpy reads of the result, a 10 s switch
  interval) until Python finalises: the worker finishes the collective and waits for the GIL to
  free the input.
- rank 0's first ``atexit`` callback (it runs before torchpatch's) replaces ``sys.stdout`` with a
  stream whose ``flush`` sleeps 0.5 s, as a flush that writes releases the GIL (only longer); the
  interpreter flushes it once finalisation has begun, so the waiting worker gets the GIL there and
  is ended: the abort comes at once, not from the switch interval (on torch 2.0-2.7 the group, freed
  with the GIL held later in finalisation, would otherwise deadlock with that worker until its wait
  for the GIL timed out). A plain buffered line written there released the GIL too briefly: the
  worker got it in about half of the runs.

Rank 1 leaves with ``os._exit`` once rank 0 has the result, so that its own worker cannot abort it
first. With TORCHPATCH=1 the summary line is turned off (TORCHPATCH_LOG=off): writing it at exit
releases the GIL too, and would hide whether the patch is what helps. So would any other GIL release
in torchpatch's exit handlers: with the line off, torchpatch does not even build it (finding torch's
version reads the file system, which once let the worker finish in time in a CI run of the opt-out
test on torch 2.15.0).
"""

import signal

import pytest

from conftest import clean_env, launch, where_patch_applies

pytestmark = pytest.mark.fresh_interpreter  # gloo's abort at interpreter exit

SCRIPT = """
import atexit, json, mmap, os, sys, time, torch, torch.distributed as dist, torchpatch
dist.init_process_group("gloo")
rank = dist.get_rank()
with open(os.environ["GLOO_EXIT_FLAGS"], "r+b") as f:
    flags = mmap.mmap(f.fileno(), 2)  # [0]: rank 0 posted and dropped its input; [1]: it has the result
if rank == 1:
    while flags[0] == 0:
        pass
    dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.full((4,), 2.0))
    while flags[1] == 0:
        pass
    os._exit(0)

patch = sys.modules.get("torchpatch.patches.collectives.gloo_exit_abort")
workers = None if patch is None else len(patch.worker_status_files())
print(json.dumps({"status": torchpatch.status().get("gloo-exit-abort"), "workers": workers}), flush=True)
class SlowToFlush:  # sys.stdout from the first exit callback on: finalisation flushes it once it has begun
    closed = False

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self.stream.write(text)

    def flush(self, sleep=time.sleep):
        sleep(0.5)  # releases the GIL, as a flush that writes does, long enough for a waiting thread to take it
        self.stream.flush()

atexit.register(lambda: setattr(sys, "stdout", SlowToFlush(sys.stdout)))
out = [torch.zeros(4), torch.zeros(4)]
result = out[1].numpy()  # reading it keeps the GIL, unlike a torch op
sys.setswitchinterval(10.0)  # a thread waiting for the GIL asks for it only after 10 s
inp = torch.ones(4)
inp.state = "Python state"  # its Python object outlives Python's last reference (torch 2.9 keeps only such)
dist.all_gather(out, inp, async_op=True)  # the work dropped: gloo's worker holds the last references
del inp
flags[0] = 1  # no GIL release from here on: rank 1 joins
while result[0] != 2.0:  # the worker wrote rank 1's part; it then frees the work and its input
    pass
flags[1] = 1
"""
ABORT = "terminate called without an active exception"
TIMEOUT = 60  # seconds: a run takes a few; an abort that waited for the switch interval, 10 more


def rank0(tmp_path, **env):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path, flags = tmp_path / "rank_script.py", tmp_path / "flags"
    path.write_text(SCRIPT)
    flags.write_bytes(bytes(2))
    return launch(str(path), 2, env=clean_env(GLOO_EXIT_FLAGS=str(flags), **env), timeout=TIMEOUT)[0]


def aborts(proc) -> bool:
    return proc.returncode == -signal.SIGABRT and ABORT in proc.stderr


# A machine busy with other work (two pytest-xdist workers on 2 cores) can deschedule gloo's worker
# past the GIL release (seen once in a loaded quick suite with the earlier form of this script):
# the reproduction of the native abort is the first of up to this many runs that aborts.
TRIES = 3


def assert_aborts(tmp_path, **env):
    runs = []
    for attempt in range(TRIES):
        proc = rank0(tmp_path / str(attempt), **env)
        if aborts(proc):
            return proc
        runs.append((proc.returncode, proc.timed_out, proc.stderr[-1000:]))
    raise AssertionError(f"no abort in {TRIES} runs: {runs}")


@where_patch_applies("gloo-exit-abort")
def test_native_abort_at_exit(tmp_path):
    proc = assert_aborts(tmp_path)
    assert '{"status": null, "workers": null}' in proc.stdout  # the script ran to its end


@where_patch_applies("gloo-exit-abort")
def test_exit_waits_for_the_workers(tmp_path):
    proc = rank0(tmp_path, TORCHPATCH="1", TORCHPATCH_LOG="off")
    assert proc.returncode == 0 and ABORT not in proc.stderr, (proc.timed_out, proc.stderr[-3000:])
    assert '{"status": "applied", "workers": 2}' in proc.stdout  # one gloo group: two workers


@where_patch_applies("gloo-exit-abort")
def test_opt_out_brings_the_abort_back(tmp_path):
    assert_aborts(tmp_path, TORCHPATCH="1", TORCHPATCH_GLOO_EXIT_ABORT="0", TORCHPATCH_LOG="off")
