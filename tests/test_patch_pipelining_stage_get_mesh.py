"""pipelining-stage-get-mesh: ``PipelineStage(..., get_mesh=callback)``.

On 2 ranks (gloo), float64, a GPipe pipeline of two stages built with ``get_mesh=`` (torchtitan 0.3's
call) trains one step: the last stage's microbatch losses and every stage's gradients are compared
with the same blocks on one process (``pipeline_scripts``; torch 2.4-2.6's schedules sum the
microbatches' gradients where 2.7+ average them: the reference is scaled to match), and the callback, which only DTensor
activations need, is never called. Torch 2.12+ takes the keyword natively (the newest torch validates
the expectation); 2.4-2.11 natively raise ``TypeError`` (an unexpected keyword). Where the patch
applies, two stages on one rank whose first hands a DTensor to the second raise its
``NotImplementedError`` at the first step (these torch versions cannot send DTensor activations).
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, PIPELINING_GLOO_WARMUP, RESULT, clean_env, patch_applies_here, ranks_result,
    through_patch_range, where_patch_applies
)
from pipeline_scripts import schedule_script

BODY = """
calls = []
mine = copy.deepcopy(blocks[2 * rank: 2 * rank + 2])
try:
    stage = PipelineStage(nn.Sequential(*mine), rank, W, torch.device("cpu"), get_mesh=lambda *a: calls.append(a))
except TypeError as exc:
    out["error"] = "TypeError" if "get_mesh" in str(exc) else str(exc)
else:
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    losses = []
    schedule.step(*((x,) if rank == 0 else ()), **({"target": y, "losses": losses} if rank == W - 1 else {}))
    ref_losses = [loss_fn(o, t) for o, t in zip(ref_out.detach().chunk(4), y.chunk(4))]
    losses_equal = rank != W - 1 or all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(losses, ref_losses))
    mean = getattr(schedule, "scale_grads", False)  # torch 2.4-2.6's schedules sum the microbatches' gradients
    grads_equal = all(torch.allclose(p.grad, (1 if mean else 4) * q.grad, rtol=1e-10, atol=1e-14)
                      for m, r in zip(mine, ref[2 * rank: 2 * rank + 2])
                      for p, q in zip(m.parameters(), r.parameters()))
    out["result"] = "reference" if losses_equal and grads_equal and len(losses) == (4 if rank == W - 1 else 0) else "differs"
    out["callback_calls"] = len(calls)
"""

SCRIPT = schedule_script("ScheduleGPipe", "GPipe", 8, "pipelining-stage-get-mesh", BODY)

DTENSOR_BETWEEN_STAGES = """
import datetime, json, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
GLOO_WARMUP
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
mesh = init_device_mesh("cpu", (1,))

class ToDTensor(nn.Linear):
    def forward(self, x):
        return distribute_tensor(super().forward(x), mesh, [Replicate()])

class FromDTensor(nn.Linear):
    def forward(self, x):
        return super().forward(x.full_tensor() if isinstance(x, DTensor) else x)

stages = [PipelineStage(m, i, 2, torch.device("cpu"), get_mesh=lambda *names: mesh)
          for i, m in enumerate((ToDTensor(4, 4), FromDTensor(4, 4)))]
schedule = ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=lambda o, t: (o - t).pow(2).mean())
try:
    schedule.step(torch.randn(4, 4), target=torch.randn(4, 4))
    out = "trained"
except NotImplementedError as exc:
    out = "NotImplementedError" if "DTensor activations" in str(exc) else str(exc)
print(RESULT + json.dumps([out]), flush=True)
""".replace("RESULT", repr(RESULT)).replace("GLOO_WARMUP", PIPELINING_GLOO_WARMUP) + LEAVE_WITHOUT_TEARDOWN


@where_patch_applies("pipelining-stage-get-mesh", "PipelineStage has no get_mesh")
def test_native_stage_refuses_get_mesh(tmp_path):
    for out in ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1", TORCHPATCH_PIPELINING_STAGE_GET_MESH="0"), timeout=180):
        assert out["status"] is None
        assert out["error"] == "TypeError", out


@through_patch_range("pipelining-stage-get-mesh", "pipeline stages on gloo")
def test_stage_with_get_mesh_trains_to_the_reference(tmp_path):
    for out in ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        assert out["status"] == ("applied" if patch_applies_here("pipelining-stage-get-mesh") else None), out
        assert (out["result"], out["callback_calls"]) == ("reference", 0), out


@where_patch_applies("pipelining-stage-get-mesh", "DTensor activations between stages are not served")
def test_dtensor_activation_between_stages_raises(tmp_path):
    assert ranks_result(DTENSOR_BETWEEN_STAGES, nproc=1, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180) == [
        "NotImplementedError"]
