"""init-process-group-ranks: ``init_process_group(..., _ranks=...)``.

One process (gloo, world size 1) starts the default group without ``_ranks``, with ``_ranks=[]`` (what
torchtitan 0.3 passes unless told the ranks) and with ``_ranks=[0]``, and reports the default group's
name each time. With TORCHPATCH=1 on torch 2.4 and 2.9 the names must be the ones torch 2.15 gives natively
(run in its venv in the same test); natively 2.4 and 2.9 raise ``TypeError`` for ``_ranks``. From 2.10 torch
takes it itself (the patch stays off).
"""

import json

from conftest import clean_env, free_port, run_json, run_newest_torch_json, through_patch_range, where_patch_applies

SCRIPT = """
import json, os, sys, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
ranks = json.loads(sys.argv[1])
try:
    dist.init_process_group("gloo", **({} if ranks == "absent" else {"_ranks": ranks}))
    out = {"name": dist.group.WORLD.group_name, "size": dist.get_world_size()}
except TypeError as exc:
    out = {"error": "TypeError" if "_ranks" in str(exc) else str(exc)}
import torchpatch
out["status"] = torchpatch.status().get("init-process-group-ranks")
print(json.dumps(out), flush=True)
os._exit(0)
"""

CASES = ("absent", [], [0])


@where_patch_applies("init-process-group-ranks", "init_process_group has no _ranks")
def test_native_refuses_ranks():
    out = run_json(SCRIPT, args=[json.dumps([0]), str(free_port())], env=clean_env())
    assert out == {"error": "TypeError", "status": None}


@through_patch_range("init-process-group-ranks", "the default group's name")
def test_default_group_named_as_the_newest_torch_names_it():
    for ranks in CASES:
        args = [json.dumps(ranks), str(free_port())]
        here = run_json(SCRIPT, args=args, env=clean_env(TORCHPATCH="1"))
        newest = run_newest_torch_json(SCRIPT, json.dumps(ranks), str(free_port()))
        newest.pop("status")
        assert here.pop("status") in ("applied", None), here
        assert here == newest, (ranks, here, newest)
