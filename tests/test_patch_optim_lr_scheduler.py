"""optim-lr-scheduler: ``LRScheduler`` on torch 1.13 is torch's own ``_LRScheduler``; a scheduler
subclassing it behaves as on torch 2.x (checked against ``LambdaLR`` on the same torch, and the same
script on torch >= 2.0 where ``LRScheduler`` is torch's)."""

from conftest import clean_env, run_json, run_py, where_patch_applies, where_patch_does_not_apply

USE = """
import json, math, torch, torchpatch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR

class WarmupCosine(LRScheduler):  # the shape of torchtitan's and timm's schedulers
    def __init__(self, optimizer, warmup, total, last_epoch=-1):
        self.warmup, self.total = warmup, total
        super().__init__(optimizer, last_epoch)
    def get_lr(self):
        return [base * factor(self.last_epoch, self.warmup, self.total) for base in self.base_lrs]

def factor(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

def run(make):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    sched = make(opt)
    lrs = []
    for _ in range(10):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    return sched, lrs

mine, lrs = run(lambda o: WarmupCosine(o, 3, 12))
ref, ref_lrs = run(lambda o: LambdaLR(o, lambda s: factor(s, 3, 12)))
resumed = WarmupCosine(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), 3, 12)
resumed.load_state_dict(mine.state_dict())
print(json.dumps({
    "same_lrs": lrs == ref_lrs, "n": len(lrs), "resumed_epoch": resumed.last_epoch,
    "isinstance": [isinstance(s, LRScheduler) for s in (mine, ref, StepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), 2))],
    "name": LRScheduler.__name__, "status": torchpatch.status().get("optim-lr-scheduler"),
}))
"""


@where_patch_applies("optim-lr-scheduler", "torch 2.0 named the base class LRScheduler")
def test_native_failure():
    proc = run_py("from torch.optim.lr_scheduler import LRScheduler")
    assert "ImportError: cannot import name 'LRScheduler' from 'torch.optim.lr_scheduler'" in proc.stderr


@where_patch_applies("optim-lr-scheduler")
def test_served_is_the_base_class():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out["name"] == "_LRScheduler" and out["status"] == "applied"
    assert out["same_lrs"] and out["n"] == 10 and out["resumed_epoch"] == 10
    assert out["isinstance"] == [True, True, True]


@where_patch_does_not_apply("optim-lr-scheduler", "torch's own LRScheduler: the same expectations hold, nothing is served")
def test_inactive_where_torch_has_it():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out["name"] == "LRScheduler" and out["status"] is None
    assert out["same_lrs"] and out["n"] == 10 and out["resumed_epoch"] == 10
    assert out["isinstance"] == [True, True, True]
