"""gloo-exit-abort: gloo's worker thread must not be killed waiting for the GIL at interpreter exit.

The race is made certain rather than likely, also on a loaded machine. Rank 0 posts an async
all_reduce and drops its handle, so gloo's worker will hold the last reference to the work. Only
then does rank 1 join (it waits for a store key), and rank 0 keeps the GIL (pure Python, numpy reads
of the result, a long switch interval) from before the collective completes until the script ends:
the worker finishes the collective, then waits for the GIL to release the tensor, and Python
finalises under it. The tensor is still alive in Python: the common form of the race, which needs
the GIL only from torch 2.10 on. With TORCHPATCH=1 the summary line is turned off (TORCHPATCH_LOG=off):
writing it at exit releases the GIL too, and would hide whether the patch is what helps.
"""

import signal

from conftest import clean_env, launch, only_torch

SCRIPT = """
import json, sys, time, torch, torch.distributed as dist, torchpatch
dist.init_process_group("gloo")
rank = dist.get_rank()
store = dist.distributed_c10d._get_default_store()
patch = sys.modules.get("torchpatch.patches.gloo_exit_abort")
workers, deadline = None, time.monotonic() + 10
while patch is not None and time.monotonic() < deadline:  # threads name themselves when first run
    workers = len(patch.worker_status_files())
    if workers == 2:
        break
    time.sleep(0.01)
if rank == 1:
    store.wait(["posted"])
    dist.all_reduce(torch.ones(4))
    raise SystemExit(0)
print(json.dumps({"status": torchpatch.status().get("gloo-exit-abort"), "workers": workers}), flush=True)
t = torch.zeros(4)
result = t.numpy()  # reading it keeps the GIL, unlike a torch op
sys.setswitchinterval(5.0)  # a thread waiting for the GIL asks for it only after 5 s
dist.all_reduce(t, async_op=True)  # handle dropped: gloo's worker holds the last reference to the work
store.set("posted", "1")
while result[0] != 1.0:  # rank 1 joined and the worker wrote the sum
    pass
end = time.perf_counter() + 0.2
while time.perf_counter() < end:  # the worker now waits for the GIL
    pass
"""
ABORT = "terminate called without an active exception"


def rank0(tmp_path, **env):
    path = tmp_path / "rank_script.py"
    path.write_text(SCRIPT)
    return launch(str(path), 2, env=clean_env(**env), timeout=120)[0]


def assert_aborts(proc):
    assert proc.returncode == -signal.SIGABRT and ABORT in proc.stderr, (proc.returncode, proc.stderr[-3000:])


@only_torch(">=2.10")
def test_native_abort_at_exit(tmp_path):
    proc = rank0(tmp_path)
    assert_aborts(proc)
    assert '{"status": null, "workers": null}' in proc.stdout  # the script itself ran to its end


@only_torch(">=2.10")
def test_exit_waits_for_the_workers(tmp_path):
    proc = rank0(tmp_path, TORCHPATCH="1", TORCHPATCH_LOG="off")
    assert proc.returncode == 0 and ABORT not in proc.stderr, proc.stderr[-3000:]
    assert '{"status": "applied", "workers": 2}' in proc.stdout  # one process group: two workers


@only_torch(">=2.10")
def test_opt_out_brings_the_abort_back(tmp_path):
    assert_aborts(rank0(tmp_path, TORCHPATCH="1", TORCHPATCH_GLOO_EXIT_ABORT="0", TORCHPATCH_LOG="off"))


@only_torch("<2.10", "the worker needs the GIL for a tensor alive in Python only from torch 2.10")
def test_no_abort_and_inactive_before_torch_2_10(tmp_path):
    for env in ({}, {"TORCHPATCH": "1"}):
        proc = rank0(tmp_path, **env)
        assert proc.returncode == 0 and ABORT not in proc.stderr, proc.stderr[-3000:]
        assert '{"status": null, "workers": null}' in proc.stdout
