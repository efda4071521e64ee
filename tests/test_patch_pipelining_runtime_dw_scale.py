"""pipelining-runtime-dw-scale: ScheduleDualPipeV's gradients are those of the mean microbatch loss.

Two ranks (gloo) run ScheduleDualPipeV (4 Linear stages in V placement, 4 microbatches, MSE loss,
float64). The reference is the same model in one process: each microbatch's loss backwarded into
the same ``.grad`` in microbatch order, then divided by 4 (``scale_grads=True``) or not
(``scale_grads=False``): the same operations the pipeline does, so equality is exact. On torch 2.9
without the patch every stage whose last backward is a weight backward (stages 0, 1, 2) gets 4x
the reference with ``scale_grads=True``; with TORCHPATCH=1 all stages equal it. On torch >= 2.10
(2.13, 2.14, 2.15 here) torch is right and the patch is not applied.
"""

from typing import Dict

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, PIPELINING_GLOO_WARMUP, RESULT, clean_env, only_torch, patch_applies_here,
    ranks_result, through_patch_range
)

ID = "pipelining-runtime-dw-scale"

SCRIPT = """
import json, torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleDualPipeV
GLOO_WARMUP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
n_stages, n_mb, dim = 2 * world, 4, 4
x = torch.randn(8, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
y = torch.randn(8, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
loss_fn = torch.nn.MSELoss()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(n_stages)]).double()


out = {}
for scale in (True, False):
    ref = model()
    for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb)):
        loss_fn(ref(xm), ym).backward()
    if scale:
        for p in ref.parameters():
            p.grad.div_(n_mb)
    pp = model()
    mine = [rank, n_stages - 1 - rank]  # V placement
    stages = [PipelineStage(pp[i], i, n_stages, torch.device("cpu")) for i in mine]
    schedule = ScheduleDualPipeV(stages, n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=scale)
    if rank == 0:
        schedule.step(x, target=y)
    else:
        schedule.step()
    for i in mine:
        grads = [(p.grad, q.grad) for p, q in zip(pp[i].parameters(), ref[i].parameters())]
        out[f"{scale}/{i}"] = ("right" if all(torch.equal(g, r) for g, r in grads) else
                               "x%d" % n_mb if all(torch.equal(g, r * n_mb) for g, r in grads) else
                               str([(g / r).mean().item() for g, r in grads]))
import torchpatch
out["status"] = torchpatch.status().get(ID)
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    merged = {}
    for o in gathered:
        merged.update(o)
    merged["status"] = [o["status"] for o in gathered]
    print(RESULT + json.dumps(merged), flush=True)
""".replace("GLOO_WARMUP", PIPELINING_GLOO_WARMUP).replace("RESULT", repr(RESULT)).replace("ID", repr(ID)) + LEAVE_WITHOUT_TEARDOWN


def _run(tmp_path, **env: str) -> Dict[str, object]:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


def _expected(scaled_last_w: str) -> Dict[str, str]:
    # stage 3's last backward is a full backward (B), which torch scales on every version
    return {**{f"True/{i}": scaled_last_w for i in (0, 1, 2)}, "True/3": "right",
            **{f"False/{i}": "right" for i in range(4)}}


@only_torch(">=2.9,<2.10", "ScheduleDualPipeV exists from 2.8; torch 2.10 scales after W")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_PIPELINING_RUNTIME_DW_SCALE": "0"}],
                         ids=["unset", "opted-out"])
def test_native_gradients_are_n_microbatches_too_large(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") == [None, None]
    assert out == _expected("x4"), out


@through_patch_range("pipelining-runtime-dw-scale", "ScheduleDualPipeV", since="2.9")
def test_gradients_equal_single_process_mean(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    status = out.pop("status")
    assert status == (["applied"] * 2 if patch_applies_here("pipelining-runtime-dw-scale") else [None, None])
    assert out == _expected("right"), out
