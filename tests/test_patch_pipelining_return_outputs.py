"""pipelining-return-outputs: ``schedule.step(..., return_outputs=False)`` on torch 2.4-2.9.

One process, one stage (gloo, world size 1), a float64 model: natively the flag reaches the model
(``TypeError: ... unexpected keyword argument 'return_outputs'``). With torchpatch (and natively
where torch has the flag) ``return_outputs=False`` returns None and gives the same per-microbatch
losses and gradients, bit for bit, as the step with ``return_outputs=True``, whose output is the
model's output and whose losses are the loss of each microbatch computed directly.
"""

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies

SCRIPT = """
import copy, json, sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleGPipe
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
x, y = torch.randn(8, 6), torch.randn(8, 3)
loss_fn = nn.MSELoss()

def step(**flag):
    module = copy.deepcopy(model)
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), input_args=torch.zeros(2, 6))
    losses = []
    out = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn).step(x, target=y, losses=losses, **flag)
    return out, [l.item() for l in losses], [p.grad for p in module.parameters()]

if sys.argv[1:] == ["native"]:
    step(return_outputs=False)
out_t, losses_t, grads_t = step(return_outputs=True)
out_f, losses_f, grads_f = step(return_outputs=False)
direct = [loss_fn(model(xm), ym).item() for xm, ym in zip(x.tensor_split(4), y.tensor_split(4))]
import torchpatch
print(json.dumps({"none": out_f is None, "output": torch.equal(out_t, model(x)),
                  "losses": losses_f == losses_t and max(abs(a - b) for a, b in zip(losses_t, direct)) < 1e-12,
                  "grads": all(torch.equal(a, b) for a, b in zip(grads_t, grads_f)),
                  "status": torchpatch.status().get("pipelining-return-outputs")}))
"""


@where_patch_applies("pipelining-return-outputs", "the flag came after torch 2.9")
def test_native_failure():
    proc = run_py(SCRIPT, args=("native",), env=clean_env())
    # the flag is taken for a model keyword input: torch 2.5-2.9's stage hands it to the model, 2.4's
    # stage counts it as one input more than its module takes
    assert "unexpected keyword argument 'return_outputs'" in proc.stderr \
        or "Stage 0 forward inputs: Number of values (1) does not match expected number (0)" in proc.stderr, \
        proc.stderr[-2000:]


@through_patch_range("pipelining-return-outputs")
def test_step_without_outputs():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["none"] and out["output"] and out["losses"] and out["grads"], out
