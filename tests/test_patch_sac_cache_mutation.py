"""sac-cache-mutation: a SAC-saved output modified in place later in the forward pass.

The region saves its matmul's output, then multiplies it by 2 in place and takes the sine. On torch
2.4 without the patch (TORCHPATCH unset, or the patch switched off) the forward value is right but
both gradients differ from the same computation without checkpointing (the recomputation doubled the
cached, already doubled, tensor again); with TORCHPATCH=1 backward raises torch 2.5's error, which
torch 2.5+ (2.9, 2.13, 2.14, 2.15) raises natively, with the patch not applied. Regions without such
a mutation (several saved matmuls, an in-place op on an output that is not saved) give exactly the
uncheckpointed gradients everywhere.
"""

import pytest

from conftest import clean_env, patch_applies_here, run_json, through_patch_range, where_patch_applies

SCRIPT = """
import json, torch
import torch.utils.checkpoint as cp
aten = torch.ops.aten

def context_fn():
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 5):  # 2.4: the private API
        return cp._pt2_selective_checkpoint_context_fn_gen(lambda mode, func, *a, **k: func == aten.mm.default)
    return cp.create_selective_checkpoint_contexts([aten.mm.default])

def mutated(x, w):
    y = torch.mm(x, w)  # saved
    y.mul_(2)           # ... then modified in place
    return y.sin()

def clean(x, w):
    h = torch.mm(x, w).relu()
    h = torch.mm(h, w).tanh()
    z = h + 1
    z.mul_(3)           # in place on an output that is not saved
    return torch.mm(z, w)

def grads(f, ckpt):
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    out = cp.checkpoint(f, x, w, use_reentrant=False, context_fn=context_fn) if ckpt else f(x, w)
    value = out.detach().clone()
    try:
        return value, torch.autograd.grad((out * torch.arange(16.0, dtype=torch.float64).view(4, 4)).sum(), (x, w))
    except RuntimeError as exc:
        return value, str(exc)

result = {}
for name, f in (("mutated", mutated), ("clean", clean)):
    (ref_value, ref), (value, got) = grads(f, False), grads(f, True)
    result[name] = {"value": torch.equal(value, ref_value),
                    "grads": got if isinstance(got, str) else [torch.equal(a, b) for a, b in zip(got, ref)]}
import torchpatch
result["status"] = torchpatch.status().get("sac-cache-mutation")
print(json.dumps(result))
"""

MUTATED = "Tensor cached during selective activation checkpoint has been mutated"
CLEAN = {"value": True, "grads": [True, True]}


@where_patch_applies("sac-cache-mutation", "torch 2.4's private SAC does not check cached tensors")
@pytest.mark.parametrize("env", [{}, {"TORCHPATCH": "1", "TORCHPATCH_SAC_CACHE_MUTATION": "0"}], ids=["unset", "opted-out"])
def test_native_gradients_are_wrong(env):
    out = run_json(SCRIPT, env=clean_env(**env))
    assert out == {"mutated": {"value": True, "grads": [False, False]}, "clean": CLEAN, "status": None}, out


@through_patch_range("sac-cache-mutation", "no eager selective activation checkpointing before torch 2.4")
def test_mutation_raises():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out.pop("status") == ("applied" if patch_applies_here("sac-cache-mutation") else None)
    assert out == {"mutated": {"value": True, "grads": MUTATED}, "clean": CLEAN}, out
