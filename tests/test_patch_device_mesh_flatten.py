"""device-mesh-flatten: ``DeviceMesh._flatten`` and slicing the root mesh by flattened names on torch 2.4.

Without torchpatch (or with the patch turned off) torch 2.4 has no ``_flatten``. On 4 real ranks
(gloo, a torchtitan-like 2x1x2 mesh ``dp_replicate, dp_shard, tp``) the flattened meshes hold the
ranks torch 2.9 puts in them (the ``tp`` coordinate is kept, the flattened dimensions are merged), in
the same order, with the same size and local rank; their groups all-reduce over exactly those ranks;
``root["dp"]`` is the flattened mesh, a second ``_flatten`` returns the same object and the flattened
mesh's root is the root mesh. Slicing flattened names together with other dimensions
(``root["dp", "tp"]``) gives torch 2.9's submesh, whose groups are the flattened group and the other
dimension's; names out of the root's order raise ``KeyError`` as on torch 2.9. FSDP2 + TP on the
flattened mesh (which slices ``root["dp", "tp"]`` and checks that both meshes share a root) trains as
the same model on one process. On torch 2.9 and 2.15 the same scripts give torch's own results and
the patch is not even armed.
"""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, rank_result, run_json, run_ranks, through_patch_range,
    torch_matches, where_patch_applies
)

NATIVE = """
import json, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
root = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
try:
    root["dp_replicate", "dp_shard"]._flatten("dp")
    error = None
except AttributeError as exc:
    error = str(exc)
import torchpatch
print(json.dumps({"error": error, "status": torchpatch.status().get("device-mesh-flatten")}))
"""


@where_patch_applies("device-mesh-flatten", "torch 2.4's DeviceMesh slices by names but cannot flatten")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_DEVICE_MESH_FLATTEN": "0"}], ids=["unset", "opted-out"])
def test_native_failure(env):
    out = run_json(NATIVE, env=clean_env(**env))
    assert out == {"error": "'DeviceMesh' object has no attribute '_flatten'", "status": None}


# The start of both rank scripts: torchtitan's world mesh on 4 ranks, [[[0, 1]], [[2, 3]]], and its
# flattened data-parallel mesh.
MESH = """
import datetime, json, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
root = init_device_mesh("cpu", (2, 1, world // 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
dp = root["dp_replicate", "dp_shard"]._flatten("dp")
"""

SCRIPT = MESH + """
def describe(m):
    sums = []
    for dim in range(m.ndim):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=m.get_group(dim))
        sums.append(t.item())
    return {"mesh": m.mesh.tolist(), "names": list(m.mesh_dim_names), "size": m.size(), "ndim": m.ndim,
            "coordinate": m.get_coordinate(), "local_rank": [m.get_local_rank(d) for d in range(m.ndim)], "group_sum": sums}

def root_of(m):  # how each torch records a submesh's root mesh
    if hasattr(m, "_get_root_mesh"):
        return m._get_root_mesh()
    from torch.distributed.device_mesh import _mesh_resources as env
    return env.get_root_mesh(m) if hasattr(env, "get_root_mesh") else env.get_parent_mesh(m)

out = {"dp": describe(dp)}
out["again_same_object"] = root["dp_replicate", "dp_shard"]._flatten("dp") is dp
out["sliced_equal"] = [root["dp"] == dp, root[("dp",)] == dp, describe(root["dp"]) == out["dp"]]
out["sliced_same_object"] = [root["dp"] is dp, root[("dp",)] is dp]
shard_tp = root["dp_shard", "tp"]._flatten()  # default name: the names joined by "_"
out["default_name"] = describe(shard_tp)
out["default_sliced_equal"] = root["dp_shard_tp"] == shard_tp
out["one_dim"] = describe(root["tp"]._flatten("tp_only"))
out["plain_slices"] = {"tp": describe(root["tp"]), "dp_replicate": describe(root["dp_replicate"])}
out["mixed"] = {"dp,tp": describe(root["dp", "tp"]), "dp_replicate,dp_shard_tp": describe(root["dp_replicate", "dp_shard_tp"])}
try:
    root["tp", "dp"]
    out["out_of_order"] = None
except KeyError as exc:
    out["out_of_order"] = "KeyError"
out["root"] = [root_of(dp) is root, root_of(root["dp", "tp"]) is root]
import torchpatch
out["status"] = torchpatch.status().get("device-mesh-flatten")
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


def expected(rank):
    """torch 2.9's answers on rank ``rank`` of the 2x1x2 mesh [[[0, 1]], [[2, 3]]]."""
    replica, tp = divmod(rank, 2)
    same_tp, same_replica = [tp, tp + 2], [2 * replica, 2 * replica + 1]

    def total(ranks):
        return float(sum(r + 1 for r in ranks))

    def mesh(ranks, name, local_rank):
        return {"mesh": ranks, "names": [name], "size": 2, "ndim": 1, "coordinate": [local_rank],
                "local_rank": [local_rank], "group_sum": [total(ranks)]}

    def mixed(names):
        return {"mesh": [[0, 1], [2, 3]], "names": names, "size": 4, "ndim": 2, "coordinate": [replica, tp],
                "local_rank": [replica, tp], "group_sum": [total(same_tp), total(same_replica)]}

    return {
        "dp": mesh(same_tp, "dp", replica),
        "default_name": mesh(same_replica, "dp_shard_tp", tp),
        "one_dim": mesh(same_replica, "tp_only", tp),
        "plain_slices": {"tp": mesh(same_replica, "tp", tp), "dp_replicate": mesh(same_tp, "dp_replicate", replica)},
        "mixed": {"dp,tp": mixed(["dp", "tp"]), "dp_replicate,dp_shard_tp": mixed(["dp_replicate", "dp_shard_tp"])},
    }


@through_patch_range("device-mesh-flatten", "DeviceMesh slices by names from 2.4 on; _flatten is torch's own from 2.5")
def test_flatten_on_four_ranks_as_torch_2_9(tmp_path):
    proc = run_ranks(SCRIPT, nproc=4, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = rank_result(proc)
    assert len(ranks) == 4
    for rank, out in enumerate(ranks):
        for key, value in expected(rank).items():
            assert out[key] == value, (rank, key, out[key])
        assert out["again_same_object"] is True
        assert out["sliced_equal"] == [True, True, True] and out["default_sliced_equal"] is True
        assert out["out_of_order"] == "KeyError" and out["root"] == [True, True]
        if torch_matches("<2.5"):
            assert out["sliced_same_object"] == [True, True]
            assert out["status"] == "applied"
        else:  # torch's own
            assert out["status"] is None


# torchtitan's FSDP2 + TP: TP over root["tp"], FSDP2 over the flattened root["dp"] (FSDP2 checks the
# two meshes share a root mesh and slices root["dp", "tp"] for the parameters' 2-D spec). Each dp
# rank trains on its half of the batch; the mean loss of every step equals the one-process loss.
FSDP_TP = MESH + """
import copy, torch.nn as nn
from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
x = torch.randn(8, 6)

def train(model, inputs, mean):
    losses = []
    for _ in range(3):
        loss = model(inputs).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
                p.grad = None
        losses.append(mean(loss.detach()))
    return losses

def mean_over_dp(loss):
    dist.all_reduce(loss, group=root["dp"].get_group())
    return loss.item() / root["dp"].size()

ref = copy.deepcopy(base)
ref_losses = train(ref, x, lambda loss: loss.item())
model = copy.deepcopy(base)
parallelize_module(model, root["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=root["dp"])
losses = train(model, x.chunk(2)[root["dp"].get_local_rank()], mean_over_dp)
# (layer 0's parameters are sharded on dim 0 by TP and FSDP2 both: torch 2.4's DTensor, without
# torch 2.5's _StridedShard, gathers their full tensor in another row order; layer 2's it does not)
out = {"losses": losses, "ref_losses": ref_losses, "mesh_ndim": [p.device_mesh.ndim for p in model.parameters()],
       "layer2": [float((p.full_tensor() - q).abs().max()) for p, q in zip(model[2].parameters(), ref[2].parameters())]}
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@through_patch_range("device-mesh-flatten", "FSDP2 came with torch 2.4")
def test_fsdp_and_tp_on_the_flattened_mesh(tmp_path):
    proc = run_ranks(FSDP_TP, nproc=4, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for out in rank_result(proc):
        assert out["losses"] == pytest.approx(out["ref_losses"], rel=1e-12, abs=0), out
        assert out["ref_losses"][0] > out["ref_losses"][1] > out["ref_losses"][2]
        assert out["mesh_ndim"] == [2, 2, 2, 2] and max(out["layer2"]) < 1e-12, out
