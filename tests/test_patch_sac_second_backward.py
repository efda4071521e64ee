"""sac-second-backward: a second backward through a selective activation checkpoint region.

The region saves the outputs of its two matmuls; the recomputation stops early before the second
matmul takes its saved output, which stays behind. On torch 2.4-2.12 without the patch (TORCHPATCH
unset, or the patch switched off) the second ``torch.autograd.grad`` of the region silently differs
from the same gradient computed without checkpointing (the first matmul got the second's output);
with TORCHPATCH=1 it raises "Trying to backward an extra time", as torch 2.13+ does natively, where
the patch is not applied. One backward, with several calls of the saved op, equals the
uncheckpointed gradient exactly everywhere (the same ops on the same values).
"""

import pytest

from conftest import clean_env, patch_applies_here, run_json, through_patch_range, where_patch_applies

SCRIPT = """
import json, torch
import torch.utils.checkpoint as cp
from torch.utils.checkpoint import checkpoint
aten = torch.ops.aten

def context_fn():
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 5):  # 2.4: the private API
        return cp._pt2_selective_checkpoint_context_fn_gen(lambda mode, func, *a, **k: func == aten.mm.default)
    return cp.create_selective_checkpoint_contexts([aten.mm.default])

def fn(x, w1, w2):
    return torch.mm(torch.mm(x, w1).sin(), w2)  # the last saved op's inputs are the last tensors packed

def deep(x, w):
    h = x
    for _ in range(3):
        h = torch.mm(h, w).tanh()
    return h

def inputs(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(n)]

def grads(f, ckpt, n, twice):
    args = inputs(n)
    out = checkpoint(f, *args, use_reentrant=False, context_fn=context_fn) if ckpt else f(*args)
    loss = (out * torch.arange(16.0, dtype=torch.float64).view(4, 4)).sum()
    first = torch.autograd.grad(loss, args, retain_graph=twice)
    if not twice:
        return first, None
    try:
        second = torch.autograd.grad(loss, args)
    except RuntimeError as exc:
        return first, str(exc)
    return first, second

ref, ref_again = grads(fn, False, 3, True)
first, second = grads(fn, True, 3, True)
deep_ref, _ = grads(deep, False, 2, False)
deep_sac, _ = grads(deep, True, 2, False)
import torchpatch
print(json.dumps({
    "first": all(torch.equal(a, b) for a, b in zip(first, ref)),
    "second": second if isinstance(second, str) else all(torch.equal(a, b) for a, b in zip(second, ref_again)),
    "deep": all(torch.equal(a, b) for a, b in zip(deep_sac, deep_ref)),
    "status": torchpatch.status().get("sac-second-backward"),
}))
"""

EXTRA = ("Trying to backward an extra time. You are only allowed to backward once "
         "on any region computed under selective activation checkpoint.")


@where_patch_applies("sac-second-backward", "SAC storage popped from the front")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_SAC_SECOND_BACKWARD": "0"}], ids=["unset", "opted-out"])
def test_native_second_backward_is_wrong(env):
    out = run_json(SCRIPT, env=clean_env(**env))
    assert out == {"first": True, "second": False, "deep": True, "status": None}, out


@through_patch_range("sac-second-backward", "no eager selective activation checkpointing in torch before 2.4")
def test_second_backward_raises():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    status = out.pop("status")
    assert status == ("applied" if patch_applies_here("sac-second-backward") else None)
    assert out == {"first": True, "second": EXTRA, "deep": True}, out
