"""pipelining-stage-kwargs: a schedule's keyword inputs reach every stage, torch 2.4.

2 gloo ranks, float64, a 2-stage model whose stages both take a keyword input ``scale`` (a tensor split
with the batch, default None: no scaling), built without ``input_args`` as torchtitan builds them: GPipe
given the whole batch (``step(x, scale=scale)`` on the first rank, ``step(scale=scale, target=y)`` on the
last) and 1F1B given the microbatches pre-split (``kwarg_mbs`` on both ranks, torchtitan 0.3's call) must
give the per-microbatch losses and every parameter's gradient of the same two modules on one process,
which applies ``scale`` in both. Natively torch 2.4 runs the last stage without its keyword input: no
error, the losses and the last stage's gradients are those of an unscaled last stage. On newer torch the
same script runs torch's own (torch 2.15 validates the expectation).
"""

from conftest import LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, patch_applies_here, ranks_result, through_patch_range, \
    where_patch_applies

SCRIPT = """
import copy, datetime, inspect, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.set_default_dtype(torch.float64)
# torch >= 2.7 (and 2.4-2.6 with pipelining-scale-grads) average the microbatches' gradients
MEAN = "scale_grads" in inspect.signature(Schedule1F1B).parameters
D, BATCH, N_MB = 6, 8, 4

class Block(nn.Module):
    def __init__(self, out):
        super().__init__()
        self.lin = nn.Linear(D, out)
    def forward(self, h, scale=None):
        h = self.lin(torch.tanh(h))
        return h if scale is None else h * scale

torch.manual_seed(0)
blocks = [Block(D), Block(3)]
x, y, scale = torch.randn(BATCH, D), torch.randn(BATCH, 3), torch.rand(BATCH, 1) + 0.5
loss_fn = nn.MSELoss()

def reference(scale_last):
    ref = copy.deepcopy(blocks)
    losses = []
    for xm, ym, sm in zip(x.tensor_split(N_MB), y.tensor_split(N_MB), scale.tensor_split(N_MB)):
        loss = loss_fn(ref[1](ref[0](xm, scale=sm), scale=sm if scale_last else None), ym)
        (loss / N_MB if MEAN else loss).backward()
        losses.append(loss.item())
    return losses, [p.grad for p in ref[rank].parameters()]

def run(schedule_cls, pre_split):
    module = copy.deepcopy(blocks[rank])
    schedule = schedule_cls(PipelineStage(module, rank, 2, torch.device("cpu")), n_microbatches=N_MB, loss_fn=loss_fn)
    losses = []
    last = {"losses": losses} if rank == 1 else {}
    if pre_split:
        if rank == 0:
            last["arg_mbs"] = [(xm,) for xm in x.tensor_split(N_MB)]
        else:
            last["target_mbs"] = list(y.tensor_split(N_MB))
        schedule.step(kwarg_mbs=[{"scale": sm} for sm in scale.tensor_split(N_MB)], **last)
    else:
        schedule.step(*([x] if rank == 0 else []), scale=scale, **({"target": y} if rank == 1 else {}), **last)
    return losses, [p.grad for p in module.parameters()]

out = {}
for name, cls, pre_split in (("gpipe", ScheduleGPipe, False), ("1f1b_presplit", Schedule1F1B, True)):
    losses, grads = run(cls, pre_split)
    out[name] = {}
    for kind, scale_last in (("reference", True), ("last_unscaled", False)):
        ref_losses, ref_grads = reference(scale_last)
        out[name][kind] = {
            "losses": rank == 0 or max(abs(a.item() - b) for a, b in zip(losses, ref_losses)) < 1e-12,
            "grads": max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) < 1e-12}
    dist.barrier()
import torchpatch
out["status"] = torchpatch.status().get("pipelining-stage-kwargs")
gathered = [None] * 2
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

CASES = ("gpipe", "1f1b_presplit")


@where_patch_applies("pipelining-stage-kwargs", "torch 2.4 drops a later stage's keyword inputs")
def test_native_last_stage_runs_without_its_keyword_input(tmp_path):
    # pipeline-stage-inference (stages without input_args) and the pre-split inputs stay on: only this patch is off
    env = clean_env(TORCHPATCH="1", TORCHPATCH_PIPELINING_STAGE_KWARGS="0")
    first, last = ranks_result(SCRIPT, tmp_path=tmp_path, env=env, timeout=180)
    assert first["status"] is None and last["status"] is None
    for case in CASES:
        # the first stage gets its keyword input: its gradient is still the unscaled last stage's
        assert first[case]["last_unscaled"] == {"losses": True, "grads": True}, first[case]
        assert last[case]["last_unscaled"] == {"losses": True, "grads": True}, last[case]
        assert last[case]["reference"] == {"losses": False, "grads": False}, last[case]


@through_patch_range("pipelining-stage-kwargs", "pipeline schedules with keyword inputs on every stage")
def test_every_stage_gets_its_keyword_inputs(tmp_path):
    ranks = ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180)
    status = "applied" if patch_applies_here("pipelining-stage-kwargs") else None
    for rank in ranks:
        assert rank["status"] == status, rank
        for case in CASES:
            assert rank[case]["reference"] == {"losses": True, "grads": True}, (case, rank)
