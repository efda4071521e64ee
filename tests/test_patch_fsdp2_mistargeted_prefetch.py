"""fsdp2-mistargeted-prefetch: FSDP2 under an interleaved pipeline trains the model one process trains.

Two gloo ranks, a pipeline of 4 float64 stages (Linear, Tanh, Linear, Tanh; two stages a rank),
``ScheduleInterleaved1F1B`` over 4 microbatches, MSE loss; every Linear and every stage
``fully_shard``-ed with ``reshard_after_forward=False`` (torchtitan's choice under PP) on the rank's
one-rank data-parallel mesh; stages built without ``input_args`` (shapes learnt at the first step, as
torchtitan builds them), SGD, 3 steps. The reference is the same model on one process over the
whole batch. With the patch every parameter after step 3 and every step's loss equal it; with the
patch switched off on torch 2.4, step 1's loss still does but the last backward's mistargeted
prefetch leaves a stale all-gather that step 2's forward copies out: later losses and the
parameters differ.
"""

from typing import Any, Dict, List

from conftest import (
    PIPELINING_GLOO_WARMUP, clean_env, gathered_tail, patch_applies_here, ranks_result, through_patch_range,
    where_patch_applies
)

ID = "fsdp2-mistargeted-prefetch"

SCRIPT = """
import copy, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
GLOO_WARMUP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_default_dtype(torch.float64)
n_mb, batch, dim, n_stages, steps = 4, 8, 4, 2 * world, 3
mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
torch.manual_seed(0)
blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim), nn.Tanh())
                       for _ in range(n_stages))
ref = copy.deepcopy(blocks)
loss_fn = nn.MSELoss()
xs = [torch.randn(batch, dim, generator=torch.Generator().manual_seed(10 + s)) for s in range(steps)]
ys = [torch.randn(batch, dim, generator=torch.Generator().manual_seed(20 + s)) for s in range(steps)]
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
ref_losses = []
for s in range(steps):
    h = xs[s]
    for block in ref:
        h = block(h)
    loss = loss_fn(h, ys[s])
    ref_losses.append(loss.item())
    loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()

mine = list(range(rank, n_stages, world))
stages = []
for i in mine:
    for linear in (blocks[i][0], blocks[i][2]):
        fully_shard(linear, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(blocks[i], mesh=mesh["dp"], reshard_after_forward=False)
    stages.append(PipelineStage(blocks[i], i, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
schedule = ScheduleInterleaved1F1B(stages, n_mb, loss_fn=loss_fn)
opt = torch.optim.SGD([p for i in mine for p in blocks[i].parameters()], lr=0.5)
losses_by_step = []
for s in range(steps):
    losses = []
    if rank == 0:
        schedule.step(xs[s])
    else:
        schedule.step(target=ys[s], losses=losses)
    opt.step()
    opt.zero_grad()
    if losses:
        losses_by_step.append(torch.stack(losses).mean().item())
diffs = [(p.full_tensor() - q).abs().max().item()
         for i in mine for p, q in zip(blocks[i].parameters(), ref[i].parameters())]
out = {"max_param_diff": max(diffs), "losses": losses_by_step, "ref_losses": ref_losses}
"""


def _run(tmp_path, **env: str) -> List[Dict[str, Any]]:
    script = SCRIPT.replace("GLOO_WARMUP", PIPELINING_GLOO_WARMUP) + gathered_tail(ID)
    return ranks_result(script, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1", **env), timeout=300)


@where_patch_applies(ID, "torch 2.4-2.5 keep a mistargeted prefetch's all-gather past the optimizer step")
def test_switched_off_step_two_forwards_stale_parameters(tmp_path):
    ranks = _run(tmp_path, TORCHPATCH_FSDP2_MISTARGETED_PREFETCH="0")
    assert [r["status"] for r in ranks] == [None, None]
    last = ranks[-1]
    assert abs(last["losses"][0] - last["ref_losses"][0]) < 1e-12, last  # step 1 is right
    assert abs(last["losses"][1] - last["ref_losses"][1]) > 1e-4, last  # step 2 ran the stale model
    assert max(r["max_param_diff"] for r in ranks) > 1e-4, ranks


@through_patch_range(ID)
def test_interleaved_pipeline_over_fsdp2_trains_as_one_process(tmp_path):
    ranks = _run(tmp_path)
    assert [r["status"] for r in ranks] == (["applied"] * 2 if patch_applies_here(ID) else [None, None])
    last = ranks[-1]
    assert len(last["losses"]) == 3
    for loss, ref_loss in zip(last["losses"], last["ref_losses"]):
        assert abs(loss - ref_loss) < 1e-12, last
    assert max(r["max_param_diff"] for r in ranks) < 1e-12, ranks
