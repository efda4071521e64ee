"""gloo-avg: functional ``all_reduce(x, "avg", group)`` on gloo groups, torch 2.2-2.6.

Without torchpatch (or with the patch turned off) torch 2.4 raises ``Cannot use ReduceOp.AVG with
Gloo``. On 2 real ranks (gloo) the average over every kind of group funcol takes (the default group,
a list of ranks, a 1-D mesh, a mesh dimension, a group of ``new_group``, a one-rank group) equals the
sum over the ranks' tensors divided by the group's size computed locally, in float32 and float64,
also with keyword arguments and through DTensor's ``Partial("avg")``; the input is left unchanged and
other reductions are torch's own. On torch 2.9 and 2.15 (gloo has AVG) the same script gives torch's
own results and the patch is not armed.
"""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, run_json,
    through_patch_range, where_patch_applies
)

NATIVE = """
import json, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
try:
    y = funcol.all_reduce(torch.ones(2), "avg", dist.group.WORLD)
    error = None if (y.wait() if hasattr(y, "wait") else y) is not None else "no result"
except RuntimeError as exc:
    error = str(exc)
import torchpatch
print(json.dumps({"error": error, "status": torchpatch.status().get("gloo-avg")}))
"""


@where_patch_applies("gloo-avg", "gloo has no AVG before torch 2.7")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_GLOO_AVG": "0"}], ids=["unset", "opted-out"])
def test_native_failure(env):
    out = run_json(NATIVE, env=clean_env(**env))
    assert out == {"error": "Cannot use ReduceOp.AVG with Gloo", "status": None}


SCRIPT = """
import datetime, json, sys, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()

def data(r, dtype):  # what rank r holds; every rank can compute every rank's tensor
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(100 + r), dtype=dtype)

def waited(y):
    return y.wait() if hasattr(y, "wait") else y

mesh = init_device_mesh("cpu", (world,))
new = dist.new_group(list(range(world)))
alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
groups = {"default": (dist.group.WORLD, world), "ranks": (list(range(world)), world), "mesh": (mesh, world),
          "mesh_dim": ((mesh, 0), world), "new_group": (new, world), "alone": (alone, 1)}
out = {}
for name, (group, size) in groups.items():
    for dtype in (torch.float32, torch.float64):
        x = data(rank, dtype)
        y = waited(funcol.all_reduce(x, "avg", group))
        members = range(world) if size == world else [rank]
        ref = sum(data(r, dtype) for r in members) / size  # sum, then division by the group's size
        out[f"{name}/{dtype}"] = [y.dtype == dtype, torch.equal(y, ref), torch.equal(x, data(rank, dtype))]
x = data(rank, torch.float64)
y = waited(funcol.all_reduce(x, reduceOp="avg", group=dist.group.WORLD))
out["keywords"] = torch.equal(y, sum(data(r, torch.float64) for r in range(world)) / world)
out["max"] = torch.equal(waited(funcol.all_reduce(x, "max", dist.group.WORLD)),
                         torch.stack([data(r, torch.float64) for r in range(world)]).amax(0))
out["sum"] = torch.equal(waited(funcol.all_reduce(x, "sum", dist.group.WORLD)), sum(data(r, torch.float64) for r in range(world)))
full = DTensor.from_local(x, mesh, [Partial("avg")]).full_tensor()
out["partial_avg"] = torch.equal(waited(full), sum(data(r, torch.float64) for r in range(world)) / world)
import torchpatch
out["status"] = torchpatch.status().get("gloo-avg")
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@through_patch_range("gloo-avg", "torch 1.13 and 2.1 reduce 'avg' through functional-collectives")
def test_average_equals_sum_over_size(tmp_path):
    for out in ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        status = out.pop("status")
        assert status == ("applied" if patch_applies_here("gloo-avg") else None)
        assert out == dict({f"{g}/{d}": [True, True, True] for g in ("default", "ranks", "mesh", "mesh_dim", "new_group", "alone")
                            for d in ("torch.float32", "torch.float64")},
                           keywords=True, max=True, sum=True, partial_avg=True), out


DEFAULT_BACKEND = """
import json, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
dist.init_process_group(rank=0, world_size=1, store=dist.HashStore())  # no backend: cpu:gloo here
x = torch.randn(4, dtype=torch.float64)
try:
    y = funcol.all_reduce(x, "avg", dist.group.WORLD)
    result = torch.equal(y.wait() if hasattr(y, "wait") else y, x)
except RuntimeError as exc:
    result = str(exc)
import torchpatch
print(json.dumps({"result": result, "backend": str(dist.get_backend()), "status": torchpatch.status().get("gloo-avg")}))
"""


@through_patch_range("gloo-avg")
def test_default_group_without_backend():
    """init_process_group() without a backend: dist.get_backend() says 'undefined' on torch 2.4, but
    the group's backend for CPU tensors is gloo, which the patch asks."""
    out = run_json(DEFAULT_BACKEND, env=clean_env(TORCHPATCH="1"))
    assert out["result"] is True, out
