"""gloo-exit-abort: gloo's worker thread must not be killed waiting for the GIL at interpreter exit.

The race is made certain rather than likely: the last collective's handle is dropped at once, so
gloo's worker holds the last reference to it and needs the GIL to release it; the main thread keeps
the GIL (pure Python, a long switch interval) until the script ends. Without torchpatch that aborts
every time, on every torch (on 1.13 to 2.9 only in this narrow form: see the patch's docstring).
"""

import signal

from conftest import clean_env, only_torch, run_py

SCRIPT = """
import json, sys, time, torch, torch.distributed as dist, torchpatch
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
patch = sys.modules.get("torchpatch.patches.gloo_exit_abort")
print(json.dumps({"status": torchpatch.status().get("gloo-exit-abort"),
                  "workers": patch and len(patch.worker_status_files())}), flush=True)
sys.setswitchinterval(5.0)  # a thread waiting for the GIL asks for it only after 5 s
dist.all_reduce(torch.ones(1 << 16), async_op=True)  # handle dropped: gloo's worker holds the last reference
end = time.perf_counter() + 0.2
while time.perf_counter() < end:  # keep the GIL while the worker finishes and waits for it
    pass
"""
ABORT = "terminate called without an active exception"


def run(**env):
    return run_py(SCRIPT, env=clean_env(**env))


def assert_aborts(proc):
    assert proc.returncode == -signal.SIGABRT and ABORT in proc.stderr, (proc.returncode, proc.stderr[-3000:])


@only_torch(">=2.10")
def test_native_abort_at_exit():
    proc = run()
    assert_aborts(proc)
    assert '{"status": null, "workers": null}' in proc.stdout  # the script itself ran to its end


@only_torch(">=2.10")
def test_exit_waits_for_the_workers():
    proc = run(TORCHPATCH="1")
    assert proc.returncode == 0 and ABORT not in proc.stderr, proc.stderr[-3000:]
    assert '{"status": "applied", "workers": 2}' in proc.stdout  # one process group: two workers


@only_torch(">=2.10")
def test_opt_out_brings_the_abort_back():
    assert_aborts(run(TORCHPATCH="1", TORCHPATCH_GLOO_EXIT_ABORT="0"))


@only_torch("<2.10", "unnamed gloo worker threads; the common form of the race does not occur")
def test_inactive_before_torch_2_10():
    proc = run(TORCHPATCH="1")
    assert '{"status": null, "workers": null}' in proc.stdout, proc.stderr[-3000:]
    assert "gloo-exit-abort" not in proc.stderr  # not in the summary line of what was applied
