"""pipelining-split-weight-grad: zero-bubble schedules' weight gradients equal plain autograd's.

Two ranks (gloo), 4 stages (2 per rank, loop placement), 4 microbatches, float64. Each stage is a
block that applies one Linear twice (a weight used at two places on one path) and then an LSTM
whose output and ``h_n`` are both used (a node with several outputs). The reference is the same
model in one process: each microbatch's loss backwarded into ``.grad`` in microbatch order, then
divided by 4 (``scale_grads``). ScheduleInterleaved1F1B (full backward) equals it exactly on every
torch. ScheduleInterleavedZeroBubble (split I/W backward) on torch 2.9 without the patch gives
other gradients on stages 1-3 (stage 0 runs a full backward in W); with TORCHPATCH=1 it equals the
reference exactly (the same autograd kernels, the same accumulation order). On torch 2.13+ torch is
right and the patch is not applied.
"""

from typing import Dict

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, PIPELINING_GLOO_WARMUP, RESULT, clean_env, only_torch, patch_applies_here,
    ranks_result, through_patch_range
)

ID = "pipelining-split-weight-grad"

SCRIPT = """
import json, torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
GLOO_WARMUP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
n_stages, n_mb, dim = 2 * world, 4, 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)
        self.rnn = torch.nn.LSTM(dim, dim)

    def forward(self, x):
        h = self.lin(torch.tanh(self.lin(x)))  # one weight, two uses on one path
        out, (h_n, _) = self.rnn(h)  # one autograd node, two outputs with gradients
        return out + h_n


x = torch.randn(8, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
y = torch.randn(8, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
loss_fn = torch.nn.MSELoss()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(n_stages)]).double()


ref = model()
for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb)):
    loss_fn(ref(xm), ym).backward()
for p in ref.parameters():
    p.grad.div_(n_mb)
out = {}
for cls in (ScheduleInterleavedZeroBubble, ScheduleInterleaved1F1B):
    pp = model()
    mine = [rank, rank + world]
    stages = [PipelineStage(pp[i], i, n_stages, torch.device("cpu")) for i in mine]
    schedule = cls(stages, n_microbatches=n_mb, loss_fn=loss_fn)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    for i in mine:
        wrong = {n: (p.grad - q.grad).abs().max().item()
                 for (n, p), q in zip(pp[i].named_parameters(), ref[i].parameters()) if not torch.equal(p.grad, q.grad)}
        out[f"{cls.__name__}/{i}"] = wrong or "right"
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

ZB, I1F1B = "ScheduleInterleavedZeroBubble", "ScheduleInterleaved1F1B"


def _run(tmp_path, **env: str) -> Dict[str, object]:
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@only_torch(">=2.9,<2.13", "ScheduleInterleavedZeroBubble on gloo: 2.9 is the matrix torch with the bug")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_PIPELINING_SPLIT_WEIGHT_GRAD": "0"}],
                         ids=["unset", "opted-out"])
def test_native_zero_bubble_weight_gradients_are_wrong(tmp_path, env):
    out = _run(tmp_path, **env)
    assert out.pop("status") == [None, None]
    assert {k: v for k, v in out.items() if k.startswith(I1F1B)} == {f"{I1F1B}/{i}": "right" for i in range(4)}
    assert out[f"{ZB}/0"] == "right"  # the first stage's W is a full backward
    for i in (1, 2, 3):
        wrong = out[f"{ZB}/{i}"]
        # the Linear used twice and the LSTM's hidden-to-hidden path (h_n is its second output)
        assert isinstance(wrong, dict) and {"lin.weight", "lin.bias", "rnn.bias_hh_l0"} <= set(wrong), out


@through_patch_range("pipelining-split-weight-grad", "ScheduleInterleavedZeroBubble on gloo", since="2.9")
def test_zero_bubble_weight_gradients_equal_autograd(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    status = out.pop("status")
    assert status == (["applied"] * 2 if patch_applies_here("pipelining-split-weight-grad") else [None, None])
    assert out == {f"{s}/{i}": "right" for s in (ZB, I1F1B) for i in range(4)}, out
