"""fsdp-root-buffer-dtype: FSDP1 ``MixedPrecision(buffer_dtype=bf16)`` with a root that has no parameters.

On 2 real ranks (gloo, CPU), a block (a Linear, then a module that keeps a running mean in a buffer and
subtracts it) trains 3 steps under FSDP1 with ``param_dtype=buffer_dtype=torch.bfloat16``. Each rank's
outputs and buffer are compared exactly with the same model cast to bfloat16 on one process, run on that
rank's batches in the same run (the forward has no collective besides the parameter all-gather, so the
numbers are the same). With the block wrapped by ``ModuleWrapPolicy`` (the root then holds no
parameters), torch 2.4 natively (and with the patch switched off) computes in float32 buffers: float32
outputs that differ from the reference; with TORCHPATCH=1 it matches exactly. A root with parameters
matches either way. Torch 2.9 and 2.15 match natively; the patch is not applied there.
"""

import pytest

from conftest import LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, patch_applies_here, ranks_result, through_patch_range

RANKS = """
import copy, datetime, json, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, W = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)

class Center(nn.Module):  # keeps a running mean of its input in a buffer and subtracts it
    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(4))

    def forward(self, x):
        self.running.mul_(0.5).add_(x.detach().mean(0), alpha=0.5)
        return x - self.running

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.center = nn.Linear(4, 4), Center()

    def forward(self, x):
        return self.center(self.lin(x))

model = nn.Sequential(Block())
xs = torch.randn(W, 3, 8, 4)
ref = copy.deepcopy(model).bfloat16()  # the reference: parameters and buffers in bfloat16, one process
ref_outs = [ref(xs[rank, step].bfloat16()).detach() for step in range(3)]
mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
out = {}
for name, policy in (("root_without_params", ModuleWrapPolicy({Block})), ("root_with_params", None)):
    m = FSDP(copy.deepcopy(model), auto_wrap_policy=policy, mixed_precision=mp, device_id=torch.device("cpu"), use_orig_params=True)
    outs = []
    for step in range(3):
        y = m(xs[rank, step])
        outs.append(y.detach())
        y.float().sum().backward()
    buffer = m.module[0].center.running
    out[name] = {"out_dtype": sorted({str(o.dtype) for o in outs}),
                 "outputs": all(torch.equal(o, r) for o, r in zip(outs, ref_outs)),
                 "buffer_dtype": str(buffer.dtype),
                 "buffer": torch.equal(buffer, ref[0].center.running)}
import torchpatch
out["status"] = torchpatch.status().get("fsdp-root-buffer-dtype")
gathered = [None] * W
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

RIGHT = {"out_dtype": ["torch.bfloat16"], "outputs": True, "buffer_dtype": "torch.bfloat16", "buffer": True}


def run(tmp_path, **env) -> list:
    return ranks_result(RANKS, tmp_path=tmp_path, env=clean_env(**env), timeout=180)


@only_torch(">=2.4,<2.6", "a root without a handle forces full-precision buffers (FSDP1 runs on CPU from torch 2.4 here)")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_FSDP_ROOT_BUFFER_DTYPE": "0"}], ids=["unset", "opted-out"])
def test_native_ignores_buffer_dtype(tmp_path, env):
    for out in run(tmp_path, **env):
        assert out.pop("status") is None
        assert out == {"root_without_params": {"out_dtype": ["torch.float32"], "outputs": False,
                                               "buffer_dtype": "torch.float32", "buffer": False},
                       "root_with_params": RIGHT}, out


@through_patch_range("fsdp-root-buffer-dtype", "FSDP1 on CPU", since="2.4")
def test_buffers_keep_buffer_dtype(tmp_path):
    for out in run(tmp_path, TORCHPATCH="1"):
        assert out.pop("status") == ("applied" if patch_applies_here("fsdp-root-buffer-dtype") else None)
        assert out == {"root_without_params": RIGHT, "root_with_params": RIGHT}, out
