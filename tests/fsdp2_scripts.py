"""Pieces of the FSDP2 tests' rank scripts (tests/test_patch_fsdp2_*.py): the start of a script (gloo,
a 1-D CPU mesh over every rank, seed 0), SGD training against the same model trained on one process, and
the one-process sum of every rank's own gradient."""

# FSDP2's first home (2.4), still the same objects in 2.15 (torch.distributed.fsdp's from 2.6)
FIRST_HOME = "torch.distributed._composable.fsdp"


def head(names: str = "fully_shard", home: str = FIRST_HOME) -> str:
    """The start of a rank script: ``from home import names``, gloo, ``rank`` and ``W`` (the world size),
    ``mesh`` (1-D, CPU, every rank), then ``torch.manual_seed(0)``."""
    return f"""
import copy, datetime, json, torch, torch.nn as nn, torch.distributed as dist
from {home} import {names}
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, W = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (W,))
torch.manual_seed(0)
"""


# After the script's ``model`` and ``loss(m, batch)`` (the loss of model ``m`` on data-parallel batch
# ``batch``): ``train_against_reference`` trains the sharded ``m`` 3 SGD steps (lr 0.5) on ``batch``
# (``group``: the data-parallel ranks, every rank by default) and ``model``'s copy as many on one process,
# each step on the mean of the ``batches`` batches' losses; the largest differences of the losses and of
# the full parameters. ``before_forward(step)`` and ``after_forward(step)`` run in each sharded step.
TRAIN_AGAINST_REFERENCE = """
def train_against_reference(m, batch, batches, group=None, before_forward=None, after_forward=None):
    ref = copy.deepcopy(model)  # the reference: one process, every data-parallel batch, the mean of the losses
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for _ in range(3):
        ref_opt.zero_grad()
        total = sum(loss(ref, b) for b in range(batches)) / batches
        ref_losses.append(float(total))
        total.backward()
        ref_opt.step()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for step in range(3):
        if before_forward:
            before_forward(step)
        opt.zero_grad()
        mine = loss(m, batch)
        if after_forward:
            after_forward(step)
        mine.backward()
        total = mine.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(float(total) / batches)
        opt.step()
    params = zip(m.parameters(), ref.parameters())
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max(float((p.full_tensor() - q).abs().max()) for p, q in params)}
"""

# After the script's ``model``, ``xs`` and ``ys`` (one batch a rank): ``summed_grads()``, every rank's own
# gradient of the MSE loss computed on one process, summed; ``rel_diff(got, want)``, the largest relative
# difference of two lists of tensors (relative to at least 1e-3).
SUMMED_GRADS = """
def summed_grads():
    summed = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(W):
        m = copy.deepcopy(model)
        nn.functional.mse_loss(m(xs[r]), ys[r]).backward()
        summed = [a + p.grad for a, p in zip(summed, m.parameters())]
    return summed

def rel_diff(got, want):
    return max(float(((g - w).abs() / w.abs().clamp_min(1e-3)).max()) for g, w in zip(got, want))
"""
