"""gloo-destroy-hang: ``destroy_process_group()`` must not join gloo's workers with the GIL held.

The hang needs a gloo worker that finishes a collective whose input tensor Python has dropped (freeing
it then needs the GIL) while the group dies with the GIL held. The test orders both, whatever the
machine's load:

- rank 0 posts an async all_gather and drops both the work and its input (gloo's worker holds the last
  reference to the work, the work the last to the input, whose C++ side then owns its Python object),
  says so in a shared ``mmap`` and calls ``destroy_process_group()`` at once. Rank 1 has not joined:
  the worker waits in the collective.
- rank 1 waits until rank 0's main thread sleeps in a futex wait with its CPU time standing still
  (``/proc``: natively, ``~ProcessGroupGloo`` joining the waiting worker with the GIL held), or until
  rank 0's destroy returned; only then does it join the all_gather. Natively the worker then finishes,
  drops the work and waits for the GIL to free the input, which the joining main thread never releases:
  rank 1 gives rank 0 ``GLOO_DESTROY_WAIT`` seconds to return, says it did not, and the launcher kills
  rank 0. With TORCHPATCH=1 the destroy returns at once (the gloo backend's own holder frees it later,
  with the GIL released), rank 1 answers the collective and both exit.

Waiting for the join first makes the native hang certain: a worker that finished before the join got
the GIL through one of the calls inside ``destroy_process_group`` that release it (the earlier form of
this test, which let the worker finish first, hung in most runs under load and in none of five on an
idle machine, torch 2.4.1). The free-running race it stands for hung 7 of 20 runs of a plain script
(all_reduce, all_gather_object, destroy) on 2.1.2.
"""

import pytest

from conftest import clean_env, launch, where_patch_applies, where_patch_does_not_apply

pytestmark = pytest.mark.fresh_interpreter  # a hang in interpreter-level teardown

SCRIPT = """
import json, mmap, os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
with open(os.environ["GLOO_DESTROY_FLAGS"], "r+b") as f:
    flags = mmap.mmap(f.fileno(), 2)  # [0]: 2 once rank 0's destroy returned; [1]: 1 once rank 0 calls it


def blocked(pid):
    # rank 0's main thread asleep in a futex wait (joining a thread), not running between three reads
    seen = set()
    for _ in range(3):
        with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/wchan") as wchan:
            fields, waits_in = stat.read().rsplit(")", 1)[1].split(), wchan.read()
        if fields[0] != "S" or "futex" not in waits_in:
            return False
        seen.add((fields[11], fields[12]))  # utime, stime
        time.sleep(0.05)
    return len(seen) == 1


if rank == 1:
    pid = int(store.get("rank0-pid"))
    while flags[1] == 0:
        time.sleep(0.01)
    while flags[0] != 2 and not blocked(pid):
        time.sleep(0.01)
    dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.full((4,), 2.0))  # answers rank 0's all_gather
    deadline = time.monotonic() + float(os.environ["GLOO_DESTROY_WAIT"])
    while flags[0] != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    if flags[0] != 2:
        print("rank 0 is still in destroy_process_group", flush=True)
    os._exit(0 if flags[0] == 2 else 3)

import torchpatch
print(json.dumps({"status": torchpatch.status().get("gloo-destroy-hang")}), flush=True)
store.set("rank0-pid", str(os.getpid()))
out = [torch.zeros(4), torch.zeros(4)]
dist.all_gather(out, torch.ones(4), async_op=True)  # the work dropped here: gloo's worker holds the last references
flags[1] = 1
dist.destroy_process_group()
flags[0] = 2
print("destroyed", flush=True)
"""
# Seconds rank 1 gives rank 0's destroy before calling it hung: where the hang is expected, the time it
# costs; where it is not, a bound no loaded machine reaches (the destroy itself takes milliseconds).
HUNG_AFTER, RETURNS_WITHIN = 5, 120


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
    rank0, rank1 = run(tmp_path, HUNG_AFTER)
    assert rank1.returncode == 3 and "still in destroy_process_group" in rank1.stdout, (rank1.returncode, rank0.stderr[-2000:])
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
