"""fsdp2-spmd-types: ``fully_shard(dp_mesh_dims=...)`` on spmd_types-annotated plain parameters.

On 2 real ranks (gloo), a small MLP (one weight with 5 rows: uneven over 2 ranks) whose parameters are
annotated as torchtitan 0.3.0 annotates them (``spmd.assert_type(param, {"dp_shard": spmd.R})`` under
the mesh, then ``fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))``
per block and on the root) trains 4 SGD steps, each rank on its own half of the batch, and is compared
(losses and full parameters, float64) with the same model trained on one process on the full batch in
the same run. A parameter annotated ``S(0)`` on the FSDP axis must raise torch 2.14's ``ValueError``.
Torch 2.13 natively (and with the patch switched off) refuses the plain parameters; with TORCHPATCH=1
it trains to the reference. Torch 2.14 does so natively where spmd_types is installed (it imports the
package); the tests skip where it is not.
"""

import importlib.util

import pytest

from conftest import (
    clean_env, gathered_tail, patch_applies_here, ranks_result, through_patch_range,
    where_patch_applies
)

needs_spmd_types = pytest.mark.skipif(
    importlib.util.find_spec("spmd_types") is None,
    reason="the spmd_types package is not installed here (torchtitan 0.3.0's dependency; the "
    "torchtitan-on-2-13 venv has it)")

RANKS_BODY = """
import copy, datetime, json, torch, torch.nn as nn, torch.distributed as dist
import spmd_types as spmd
from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, W = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("dp_shard",))
dims = DataParallelMeshDims(shard="dp_shard")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
x, y = torch.randn(W, 6, 4, dtype=torch.float64), torch.randn(W, 6, 3, dtype=torch.float64)

ref = copy.deepcopy(model)  # the reference: one process, the full batch
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
ref_losses = []
for _ in range(4):
    ref_opt.zero_grad()
    loss = nn.functional.mse_loss(ref(x.flatten(0, 1)), y.flatten(0, 1))
    loss.backward()
    ref_opt.step()
    ref_losses.append(loss.item())

def annotate(m, dp_type):
    with spmd.set_current_mesh(mesh):
        for p in m.parameters():
            spmd.assert_type(p, {"dp_shard": dp_type})

def shard(m):
    for block in (m[0], m[2]):
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(m, mesh=mesh, dp_mesh_dims=dims)

def outcome(exc):
    text = str(exc)
    if "all parameters must be DTensors on the full SPMD mesh" in text:
        return "plain-tensor error"
    if text.startswith("Expected spmd.R on FSDP DP axis") and "'weight'" in text:
        return "dp-axis error"
    return text

out = {}
m = copy.deepcopy(model)
annotate(m, spmd.R)
try:
    shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(x[rank]), y[rank])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / W)
    full = {k: v.full_tensor() for k, v in m.state_dict().items()}
    out["storage"] = sorted({f"{type(p).__name__}{tuple(p.placements)}" for p in m.parameters()})
    # float64, the mean of the ranks' gradients against the full batch's: equal up to a few additions'
    # rounding (~1e-16); a gradient not reduced across ranks, or summed, is off by ~1e-2
    out["loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    out["param_diff"] = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())
except ValueError as exc:
    out["train"] = outcome(exc)
m = copy.deepcopy(model)
annotate(m, spmd.S(0))
try:
    shard(m)
    out["sharded_on_dp"] = "no error"
except ValueError as exc:
    out["sharded_on_dp"] = outcome(exc)
"""
RANKS = RANKS_BODY + gathered_tail("fsdp2-spmd-types")


def run(tmp_path, **env) -> list:
    return ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(**env), timeout=180)


@needs_spmd_types
@where_patch_applies("fsdp2-spmd-types", "FSDP2 refuses plain parameters with dp_mesh_dims")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_FSDP2_SPMD_TYPES": "0"}], ids=["unset", "opted-out"])
def test_native_refuses_annotated_plain_parameters(tmp_path, env):
    for out in run(tmp_path, **env):
        assert out == {"train": "plain-tensor error", "sharded_on_dp": "plain-tensor error", "status": None}, out


@needs_spmd_types
@through_patch_range("fsdp2-spmd-types", "FSDP2 with dp_mesh_dims")
def test_annotated_parameters_train_to_the_reference(tmp_path):
    for out in run(tmp_path, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if patch_applies_here("fsdp2-spmd-types") else None)
        assert out.pop("storage") == ["DTensor(Shard(dim=0),)"], out
        assert out.pop("sharded_on_dp") == "dp-axis error", out
        assert out.pop("loss_diff") < 1e-12 and out.pop("param_diff") < 1e-12, out
        assert out == {}, out
