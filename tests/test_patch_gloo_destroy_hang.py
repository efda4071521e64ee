"""gloo-destroy-hang: ``destroy_process_group()`` must not join gloo's workers with the GIL held.

The hang needs a gloo worker that still holds a finished collective whose input tensor Python has
dropped (freeing it then needs the GIL) when the group dies with the GIL held. Ordering alone makes
both likely, whatever the machine's load:

- rank 0 posts an async all_gather and drops both the work and its input: gloo's worker holds the last
  reference to the work, the work the last to the input, whose C++ side then owns its Python object. Only then does rank 1 join: it waits for a byte that
  rank 0 writes into a shared ``mmap`` (a store call would release rank 0's GIL). From that write on
  rank 0 keeps the GIL (pure Python, numpy reads of the result, a long switch interval), so the
  worker, done with the collective, waits for the GIL to free the input.
- rank 0 then calls ``destroy_process_group()``: natively the group's last reference dies in it and
  ``~ProcessGroupGloo`` joins that worker with the GIL held, forever (rank 1 says so, the
  launcher kills rank 0); with TORCHPATCH=1 the gloo backend's own holder frees it with the GIL released.

Rank 1 is the watch: from the moment rank 0 enters ``destroy_process_group()`` it gives it
``GLOO_DESTROY_WAIT`` seconds to return (a destroy that does not hang takes milliseconds), then leaves
with ``os._exit``: 0 if it returned, 3 if not (the launcher then kills rank 0). Start-up and load
before the destroy count for nothing.
The native program hangs in most runs, not all (2026-11-29, on 2.4.1: 7 of 8 runs by hand, and not the
one run of CI's 2.4.1 session, both under load; on 2.1.2 every run so far; with TORCHPATCH=1 every run
exits). Presumably a call inside ``destroy_process_group`` releases the GIL before the group dies and a
worker already waiting for it gets through (not traced). So the native test runs it up to
``NATIVE_ATTEMPTS`` times and needs one hang. The free-running race it stands for hung 7 of 20 runs of a
plain script (all_reduce, all_gather_object, destroy) on 2.1.2.
"""

import pytest

from conftest import clean_env, launch, where_patch_applies, where_patch_does_not_apply

pytestmark = pytest.mark.fresh_interpreter  # a hang in interpreter-level teardown

SCRIPT = """
import json, mmap, os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
with open(os.environ["GLOO_DESTROY_FLAGS"], "r+b") as f:
    flags = mmap.mmap(f.fileno(), 2)  # [0]: 1 rank 0 posted and dropped its input, 2 destroyed; [1]: destroying
if rank == 1:
    while flags[0] == 0:
        pass
    dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.full((4,), 2.0))
    while flags[1] == 0:
        pass
    deadline = time.monotonic() + float(os.environ["GLOO_DESTROY_WAIT"])
    while flags[0] != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    if flags[0] != 2:
        print("rank 0 is still in destroy_process_group", flush=True)
    os._exit(0 if flags[0] == 2 else 3)

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
flags[0] = 2
print("destroyed", flush=True)
"""
# Seconds rank 1 gives rank 0's destroy before calling it hung: where the hang is expected, the time it
# costs; where it is not, a bound no loaded machine reaches (the destroy itself takes milliseconds).
HUNG_AFTER, RETURNS_WITHIN = 5, 120
NATIVE_ATTEMPTS = 5  # the native order hangs in most runs, not all (the module docstring says why)


def run(tmp_path, wait, **env):
    """Both ranks' results; rank 0's output says how far it got, rank 1's exit status whether it returned."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path, flags = tmp_path / "rank_script.py", tmp_path / "flags"
    path.write_text(SCRIPT)
    flags.write_bytes(bytes(2))
    return launch(str(path), 2, env=clean_env(GLOO_DESTROY_FLAGS=str(flags), GLOO_DESTROY_WAIT=str(wait), **env),
                  timeout=wait + 300)


@where_patch_applies("gloo-destroy-hang")
def test_native_hang_in_destroy_process_group(tmp_path):
    outcomes = []
    for attempt in range(NATIVE_ATTEMPTS):  # one hang shows it; each run that did not hang is listed
        rank0, rank1 = run(tmp_path / str(attempt), HUNG_AFTER)
        if rank1.returncode == 3:
            break
        outcomes.append((rank0.returncode, rank1.returncode, rank0.stderr[-500:]))
    assert rank1.returncode == 3 and "still in destroy_process_group" in rank1.stdout, outcomes
    assert rank0.killed and "destroyed" not in rank0.stdout and '{"status": null}' in rank0.stdout, rank0.stderr[-2000:]


@where_patch_applies("gloo-destroy-hang")
def test_destroy_returns_and_the_job_exits(tmp_path):
    rank0, rank1 = run(tmp_path, RETURNS_WITHIN, TORCHPATCH="1", TORCHPATCH_LOG="off")
    assert (rank0.returncode, rank1.returncode) == (0, 0) and not rank0.timed_out, rank0.stderr[-3000:] + rank1.stdout
    assert '{"status": "applied"}' in rank0.stdout and "destroyed" in rank0.stdout


@where_patch_does_not_apply("gloo-destroy-hang", "2.8 frees ProcessGroup with the GIL released; 1.13's group is the gloo backend")
def test_no_hang_and_inactive_outside_2_0_to_2_7(tmp_path):
    rank0, rank1 = run(tmp_path, RETURNS_WITHIN, TORCHPATCH="1", TORCHPATCH_LOG="off")
    assert (rank0.returncode, rank1.returncode) == (0, 0) and not rank0.timed_out, rank0.stderr[-3000:]
    assert '{"status": null}' in rank0.stdout and "destroyed" in rank0.stdout
