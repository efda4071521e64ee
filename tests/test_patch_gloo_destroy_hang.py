"""gloo-destroy-hang: ``destroy_process_group()`` must not join gloo's workers with the GIL held.

The hang needs a gloo worker that still holds a finished collective whose input tensor Python has
dropped (freeing it then needs the GIL) when the group dies with the GIL held. Both are made certain
by ordering alone, whatever the machine's load:

- rank 0 posts an async all_gather and drops both the work and its input: gloo's worker holds the last
  reference to the work, the work the last to the input, whose C++ side then owns its Python object. Only then does rank 1 join: it waits for a byte that
  rank 0 writes into a shared ``mmap`` (a store call would release rank 0's GIL). From that write on
  rank 0 keeps the GIL (pure Python, numpy reads of the result, a long switch interval), so the
  worker, done with the collective, waits for the GIL to free the input.
- rank 0 then calls ``destroy_process_group()``: natively the group's last reference dies in it and
  ``~ProcessGroupGloo`` joins that worker with the GIL held, forever (the run is killed by its
  timeout); with TORCHPATCH=1 the gloo backend's own holder frees it with the GIL released.

Rank 1 leaves with ``os._exit`` once rank 0 has the result (its own exit is not what is measured).
The native program hangs in every run (2026-11-29: 3 of 3 on torch 2.1.2, 2 of 2 on 2.4.1; with
TORCHPATCH=1 each of those exited); the free-running race it
stands for hung 7 of 20 runs of a plain script (all_reduce, all_gather_object, destroy) on 2.1.2.
"""

import pytest

from conftest import clean_env, launch, where_patch_applies, where_patch_does_not_apply

pytestmark = pytest.mark.fresh_interpreter  # a hang in interpreter-level teardown

SCRIPT = """
import json, mmap, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
with open(os.environ["GLOO_DESTROY_FLAGS"], "r+b") as f:
    flags = mmap.mmap(f.fileno(), 2)  # [0]: rank 0 posted and dropped its input; [1]: it has the result
if rank == 1:
    while flags[0] == 0:
        pass
    dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.full((4,), 2.0))
    while flags[1] == 0:
        pass
    os._exit(0)

import torchpatch
print(json.dumps({"status": torchpatch.status().get("gloo-destroy-hang")}), flush=True)
out = [torch.zeros(4), torch.zeros(4)]
result = out[1].numpy()  # reading it keeps the GIL, unlike a torch op
sys.setswitchinterval(30.0)  # a thread waiting for the GIL asks for it only after 30 s
dist.all_gather(out, torch.ones(4), async_op=True)  # the work dropped here: gloo's worker holds the last references
flags[0] = 1  # no GIL release from here on: rank 1 joins
while result[0] != 2.0:  # the worker wrote rank 1's part; it then frees the work and its input
    pass
flags[1] = 1
dist.destroy_process_group()
print("destroyed", flush=True)
"""
TIMEOUT = 40  # seconds: a hung rank 0 is killed then (a run that exits takes a few seconds)


def rank0(tmp_path, **env):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path, flags = tmp_path / "rank_script.py", tmp_path / "flags"
    path.write_text(SCRIPT)
    flags.write_bytes(bytes(2))
    return launch(str(path), 2, env=clean_env(GLOO_DESTROY_FLAGS=str(flags), **env), timeout=TIMEOUT)[0]


@where_patch_applies("gloo-destroy-hang")
def test_native_hang_in_destroy_process_group(tmp_path):
    proc = rank0(tmp_path)
    assert proc.timed_out and "destroyed" not in proc.stdout, (proc.returncode, proc.stderr[-2000:])
    assert '{"status": null}' in proc.stdout  # it got as far as the destroy


@where_patch_applies("gloo-destroy-hang")
def test_destroy_returns_and_the_job_exits(tmp_path):
    proc = rank0(tmp_path, TORCHPATCH="1", TORCHPATCH_LOG="off")
    assert proc.returncode == 0 and not proc.timed_out, proc.stderr[-3000:]
    assert '{"status": "applied"}' in proc.stdout and "destroyed" in proc.stdout


@where_patch_does_not_apply("gloo-destroy-hang", "2.8 frees ProcessGroup with the GIL released; 1.13's group is the gloo backend")
def test_no_hang_and_inactive_outside_2_0_to_2_7(tmp_path):
    for env in ({}, {"TORCHPATCH": "1", "TORCHPATCH_LOG": "off"}):
        proc = rank0(tmp_path, **env)
        assert proc.returncode == 0 and not proc.timed_out, proc.stderr[-3000:]
        assert '{"status": null}' in proc.stdout and "destroyed" in proc.stdout
