"""The rank program of tests/test_cluster_shapes.py: 8 gloo ranks, two 3-D cluster shapes, one job.

Shape A: ("dp_replicate", "dp_shard", "tp") = 2 x 2 x 2, HSDP + TP. Shape B: ("pp", "dp", "tp") = 2 x 2 x 2,
two pipeline stages (activations and their gradients sent between stages with plain send/recv), FSDP2 on
"dp" + TP on "tp" in each stage. Each rank reports, for the test to judge against the layout:

- ``meshes``: for each (sub)mesh, flattened mesh and unflattened mesh: its rank tensor, dimension names,
  and per dimension the ranks of its process group and the sum of the ranks an all-reduce over that
  group returns (which proves the group connects exactly those ranks);
- ``shape_a``/``shape_b``: per parameter, whether its gradient (``full_tensor()``) and its weight after one
  SGD step equal, bit for bit, those of one process training the full model on the global batch in this
  rank (``{"error": ...}`` where this torch refuses the shape);
- ``dcp``: whether a DTensor placed (Replicate, Shard(0), Shard(1)) on the 3-D mesh, saved with DCP and
  loaded into a fresh DTensor (the same placements, and (Shard(1), Replicate, Shard(0))), has exactly the
  original full tensor.

Exact comparison, not a tolerance: every value is a dyadic rational of few bits (inputs integers in
[-2, 2], weights and biases multiples of 1/4 in [-1, 1], integer targets, mean over 64 = 2^6 elements,
data-parallel averages over 2 or 4 ranks, SGD's learning rate 1/8). Then the forward values are multiples
of 1/16 below 2^9, the gradients multiples of 2^-11 whose terms' absolute sum stays below 2^11 (dW1:
8 samples x |dh| <= 72 x |x| <= 2; dW2: 8 x |dy| < 9 x |h| <= 17), so every partial sum in any order,
every all-reduce and reduce-scatter, and every division by a power of two is exact in float64 (22 of 53
bits): any order of summation gives the same bits, and any difference is a wrong value.

The test replaces ``CKPT_AND_RESULT`` with a folder for DCP and the result line's prefix.
"""

PROGRAM = r"""
import datetime, json, os, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
CKPT, RESULT = CKPT_AND_RESULT
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
D, H, B, LR = 8, 16, 8, 0.125
out = {}


def error(exc):
    return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}


def describe(mesh):
    dims = []
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        total = torch.tensor([rank])
        dist.all_reduce(total, group=group)
        dims.append({"ranks": dist.get_process_group_ranks(group), "sum": int(total)})
    return {"mesh": mesh.mesh.tolist(), "names": list(mesh.mesh_dim_names), "dims": dims}


# (a) meshes, submeshes, flattened and unflattened meshes
meshes = out["meshes"] = {}
mesh_a = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
mesh_b = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
meshes["A"] = describe(mesh_a)
meshes["A[dp_replicate,dp_shard]"] = describe(mesh_a["dp_replicate", "dp_shard"])
meshes["A[tp]"] = describe(mesh_a["tp"])
flat = mesh_a["dp_replicate", "dp_shard"]._flatten("dp")
meshes["A[dp_replicate,dp_shard]._flatten(dp)"] = describe(flat)
meshes["A[dp]"] = describe(mesh_a["dp"])
meshes["A[dp,tp]"] = describe(mesh_a["dp", "tp"])
meshes["B"] = describe(mesh_b)
meshes["B[dp,tp]"] = describe(mesh_b["dp", "tp"])
meshes["B[pp]"] = describe(mesh_b["pp"])
meshes["B[dp,tp]._flatten()"] = describe(mesh_b["dp", "tp"]._flatten())
meshes["B[dp_tp]"] = describe(mesh_b["dp_tp"])
world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
try:
    unflat = world._unflatten(0, (2, 2, 2), ("pp", "dp", "tp"))
except Exception as exc:
    out["unflatten"] = error(exc)
else:
    out["unflatten"] = {"U": describe(unflat), "U[dp,tp]": describe(unflat["dp", "tp"]),
                        "U[pp]": describe(unflat["pp"]), "U[dp,tp]._flatten()": describe(unflat["dp", "tp"]._flatten())}


# (b, c) training: one SGD step of FSDP2 + TP against one process with full tensors on the global batch
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.lin2(F.relu(self.lin1(x)))


def mlp():
    model = MLP().double()
    with torch.no_grad():  # multiples of 1/4 in [-1, 1], the same on every torch
        for k, p in enumerate(model.parameters()):
            p.copy_(((torch.arange(p.numel()) * 5 + 3 * k) % 9 - 4).double().reshape(p.shape) / 4)
    return model


x = ((torch.arange(B * D) * 7) % 5 - 2).double().reshape(B, D)
target = ((torch.arange(B * D) * 3) % 7 - 3).double().reshape(B, D)
ref = mlp()
F.mse_loss(ref(x), target).backward()
ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
torch.optim.SGD(ref.parameters(), lr=LR).step()
ref_weights = {n: p.detach().clone() for n, p in ref.named_parameters()}


def compare(named_params, names, optimizer):
    grads = {names[n]: p.grad.full_tensor() for n, p in named_params}
    optimizer.step()
    weights = {names[n]: p.detach().full_tensor() for n, p in named_params}
    return {"grads": {n: torch.equal(g, ref_grads[n]) for n, g in grads.items()},
            "weights": {n: torch.equal(w, ref_weights[n]) for n, w in weights.items()},
            "max_diff": max(float((g - ref_grads[n]).abs().max()) for n, g in grads.items())}


try:  # shape A: TP on mesh["tp"], HSDP on mesh["dp_replicate", "dp_shard"]
    model = mlp()
    parallelize_module(model, mesh_a["tp"], {"lin1": ColwiseParallel(), "lin2": RowwiseParallel()})
    fully_shard(model, mesh=mesh_a["dp_replicate", "dp_shard"])
    part = slice((rank // 2) * 2, (rank // 2) * 2 + 2)  # data-parallel index 2 * replicate + shard
    F.mse_loss(model(x[part]), target[part]).backward()
    names = {n: n for n, _ in model.named_parameters()}
    out["shape_a"] = compare(list(model.named_parameters()), names, torch.optim.SGD(model.parameters(), lr=LR))
except Exception as exc:
    out["shape_a"] = error(exc)

try:  # shape B: stage pp of the model on ranks 4 pp .. 4 pp + 3, FSDP2 on mesh["dp"], TP on mesh["tp"]
    pp, peer = rank // 4, rank ^ 4
    model = mlp()
    if pp == 0:
        stage = nn.Sequential(model.lin1)
        parallelize_module(stage, mesh_b["tp"], {"0": ColwiseParallel(output_layouts=Replicate())})
    else:
        stage = nn.Sequential(model.lin2)
        parallelize_module(stage, mesh_b["tp"], {"0": RowwiseParallel(input_layouts=Replicate())})
    fully_shard(stage, mesh=mesh_b["dp"])
    part = slice((rank // 2 % 2) * 4, (rank // 2 % 2) * 4 + 4)
    if pp == 0:
        h = F.relu(stage(x[part]))
        dist.send(h.detach().contiguous(), dst=peer)
        grad = torch.empty_like(h)
        dist.recv(grad, src=peer)
        h.backward(grad)
    else:
        h = torch.empty(4, H, dtype=torch.float64)
        dist.recv(h, src=peer)
        h.requires_grad_()
        F.mse_loss(stage(h), target[part]).backward()
        dist.send(h.grad.contiguous(), dst=peer)
    names = {f"0.{kind}": f"lin{pp + 1}.{kind}" for kind in ("weight", "bias")}
    out["shape_b"] = compare(list(stage.named_parameters()), names, torch.optim.SGD(stage.parameters(), lr=LR))
except Exception as exc:
    out["shape_b"] = error(exc)

# (d) DCP: a DTensor with three placements on the 3-D mesh, saved and loaded into fresh DTensors
full = torch.arange(5 * 6, dtype=torch.float64).reshape(5, 6) / 3  # 5 rows: uneven Shard(0)
saved = distribute_tensor(full, mesh_a, [Replicate(), Shard(0), Shard(1)])
dcp.save({"t": saved}, checkpoint_id=CKPT)
out["dcp"] = {}
for placements in ([Replicate(), Shard(0), Shard(1)], [Shard(1), Replicate(), Shard(0)]):
    fresh = distribute_tensor(torch.zeros(5, 6, dtype=torch.float64), mesh_a, placements)
    state = {"t": fresh}
    dcp.load(state, checkpoint_id=CKPT)
    out["dcp"][str(placements)] = {"placements": list(state["t"].placements) == placements,
                                   "equal": torch.equal(state["t"].full_tensor(), full)}

gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
dist.barrier()
os._exit(0)
"""
